package coordinator

import (
	"fmt"
	"math/rand"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// An epoch of a 100,000-participant job is one transaction within etcd's
// default request limit (membership.MaxRequestBytes, 1.5 MiB), signed, in
// the largest case: the job forming (the view is then the whole list as
// well) with a revocation. An embedded etcd at its default limits takes
// it.
func TestEpochTxnFitsEtcdDefaults(t *testing.T) {
	const n = 100000
	signer, err := GenerateQuorumSigner()
	if err != nil {
		t.Fatal(err)
	}
	q := membership.Quorum{Job: "big", Epoch: 2, MaxStep: 100, Created: time.Now(), Reason: "joined …", Run: "r1"}
	// Incarnations as concurrent joins leave them: etcd revisions
	// shuffled within windows of 128 joins in flight.
	r := rand.New(rand.NewSource(1))
	incs := make([]int64, n)
	for i := range incs {
		incs[i] = int64(1000 + 2*i)
	}
	for w := 0; w < n; w += 128 {
		e := min(w+128, n)
		r.Shuffle(e-w, func(i, j int) { incs[w+i], incs[w+j] = incs[w+j], incs[w+i] })
	}
	for i := 0; i < n; i++ {
		q.Participants = append(q.Participants, membership.Participant{ID: fmt.Sprintf("m%06d", i), Group: fmt.Sprintf("g%06d", i/8),
			Addr: "10.1.2.3:29500", Step: 100, Incarnation: incs[i]})
	}
	prev := membership.Quorum{Job: "big", Epoch: 1, Participants: q.Participants[:1]}
	rev := &membership.Revocation{Epoch: 1, Reason: "joiners", By: "coordinator c0", At: time.Now()}
	k := etcdkeys.Layout{}
	for _, c := range []struct {
		name string
		a    publish
	}{
		{"forming", publish{job: "big", quorum: &q, revocation: rev, prev: &prev, viewRev: rev}},
		{"first", publish{job: "big", quorum: &q}},
	} {
		ops, val, err := publishOps(k, 100, c.a, signer.Sign)
		if err != nil {
			t.Fatal(err)
		}
		size := 0
		for _, op := range ops {
			size += len(op.KeyBytes()) + len(op.ValueBytes())
		}
		t.Logf("%s: %d participants, the record %d bytes, the transaction's keys and values %d bytes (limit %d)",
			c.name, n, len(val), size, membership.MaxRequestBytes)
		if size > membership.MaxRequestBytes*3/4 {
			t.Fatalf("%s: %d bytes, want well under %d", c.name, size, membership.MaxRequestBytes)
		}
	}

	// The real thing: etcd at its default limits takes the transaction.
	ctx := testutil.Ctx(t, 60*time.Second)
	cfg := etcdhost.DefaultEmbeddedConfig()
	cfg.UnsafeNoFsync = true
	e, err := etcdhost.StartEmbedded(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	cli, err := membership.NewClient(e.Endpoints(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ops, _, err := publishOps(k, 100, publish{job: "big", quorum: &q, revocation: rev, prev: &prev, viewRev: rev}, signer.Sign)
	if err != nil {
		t.Fatal(err)
	}
	tr, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(k.Quorum("big")), "=", 0)).Then(ops...).Commit()
	if err != nil || !tr.Succeeded {
		t.Fatalf("etcd at its default limits: %v (succeeded %v)", err, tr != nil && tr.Succeeded)
	}
	got, err := NewAdmin(cli, "").Quorum(ctx, "big")
	if err != nil || len(got.Participants) != n || got.Epoch != 2 {
		t.Fatalf("read back: %v, %d participants", err, len(got.Participants))
	}
}

// The operations of a death's epoch at 100,000 participants (the record
// and history entry are the whole list, the view one removal): what the
// leader encodes per publication.
func BenchmarkPublishOpsDeath100K(b *testing.B) {
	const n = 100000
	prev := membership.Quorum{Job: "big", Epoch: 7, MaxStep: 100, Created: time.Now(), Run: "r1"}
	for i := 0; i < n; i++ {
		prev.Participants = append(prev.Participants, membership.Participant{ID: fmt.Sprintf("m%06d", i), Group: fmt.Sprintf("g%06d", i/8),
			Addr: "10.1.2.3:29500", Step: 100, Incarnation: int64(1000 + i)})
	}
	q := prev
	q.Epoch, q.Participants, q.Removed, q.Reason = 8, append(prev.Participants[:1:1], prev.Participants[2:]...), []string{"m000001"}, "m000001 died"
	rev := &membership.Revocation{Epoch: 7, Reason: q.Reason, Failed: q.Removed, By: "coordinator c0", At: time.Now()}
	a := publish{job: "big", quorum: &q, revocation: rev, prev: &prev, viewRev: rev}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, _, err := publishOps(etcdkeys.Layout{}, 100, a, nil); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e6, "ms/epoch")
}
