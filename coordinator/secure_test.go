package coordinator_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// A quorum record written by someone who is not the
// leader (here with etcd's root credentials, which pass every access
// check) used to be obeyed by every member within milliseconds and never
// corrected. Members now ignore it (not signed by the coordinator's key),
// and the leader restores its own record at once; the job goes on.
func TestForgedQuorumIgnoredAndRepaired(t *testing.T) {
	sj := clustertest.StartSecureJob(t)
	a, b := sj.Join("a"), sj.Join("b")
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	clustertest.WaitQuorum(t, b, 0, "a", "b")
	ctx := clustertest.Ctx(t, 30*time.Second)
	k := etcdkeys.Layout{}
	resp, err := sj.CoordClient.Get(ctx, k.Quorum(sj.Name))
	if err != nil {
		t.Fatal(err)
	}
	good := resp.Kvs[0].Value
	rootCreds := clustertest.Credentials(t, sj.Etcd, etcdhost.UserRoot)
	root, err := rootCreds.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()

	// Forged records: unsigned; signed by another key; the real one
	// altered; a real record of another job.
	other, _ := coordinator.GenerateQuorumSigner()
	forged := q
	forged.Epoch, forged.Participants, forged.Reason, forged.Signature = q.Epoch+1, q.Participants[:1], "forged", nil
	unsigned, _ := json.Marshal(forged)
	badKey, _ := other.Marshal(forged)
	altered := bytes.Replace(good, []byte(`"reason":"`), []byte(`"reason":"x`), 1)
	for _, v := range [][]byte{unsigned, badKey, altered} {
		if _, err := root.Put(ctx, k.Quorum(sj.Name), string(v)); err != nil {
			t.Fatal(err)
		}
		sj.WaitRecord(good)
	}
	if n := sj.Logs.FilterMessageSnippet("written by someone else").Len(); n != 3 {
		t.Errorf("%d foreign writes logged, want 3", n)
	}
	for _, m := range []*membership.Member{a, b} {
		if cur, _ := m.Quorum(); cur.Epoch != q.Epoch || len(cur.Participants) != 2 {
			t.Fatalf("%s obeyed a forged quorum: %+v", m.ID(), cur)
		}
	}
	// The job goes on: a joiner is admitted in the very next epoch.
	c := sj.Join("c")
	q2 := clustertest.WaitQuorum(t, c, 0, "a", "b", "c")
	if q2.Epoch != q.Epoch+1 {
		t.Fatalf("epoch %d after the forgeries, want %d", q2.Epoch, q.Epoch+1)
	}

	// A forged record written while no coordinator runs is found when the
	// next one loads the job, and restored from the signed history.
	sj.Stop()
	resp, err = sj.CoordClient.Get(ctx, k.Quorum(sj.Name))
	if err != nil {
		t.Fatal(err)
	}
	good = resp.Kvs[0].Value
	if _, err := root.Put(ctx, k.Quorum(sj.Name), string(unsigned)); err != nil {
		t.Fatal(err)
	}
	sj.StartCoordinator("c1")
	sj.WaitRecord(good)
	d := sj.Join("d")
	q3 := clustertest.WaitQuorum(t, d, 0, "a", "b", "c", "d")
	if q3.Epoch != q2.Epoch+1 {
		t.Fatalf("epoch %d after the restart, want %d", q3.Epoch, q2.Epoch+1)
	}
}

// A quorum record forged for a job the leader has none of is deleted, and
// the deletion (the leader's own) raises no second alarm.
func TestForgedQuorumOfUnknownJobDeleted(t *testing.T) {
	sj := clustertest.StartSecureJob(t)
	rootCreds := clustertest.Credentials(t, sj.Etcd, etcdhost.UserRoot)
	root, err := rootCreds.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	ctx := clustertest.Ctx(t, 20*time.Second)
	k := etcdkeys.Layout{}.Quorum("ghost")
	put, err := root.Put(ctx, k, `{"job":"ghost","epoch":9}`)
	if err != nil {
		t.Fatal(err)
	}
	for ev := range root.Watch(ctx, k, clientv3.WithRev(put.Header.Revision+1)) {
		if len(ev.Events) > 0 && ev.Events[0].Type == mvccpb.DELETE {
			break
		}
	}
	// Something after the deletion, so its event has been handled.
	sj.Join("a")
	clustertest.WaitQuorum(t, sj.Join("b"), 0, "a", "b")
	if n := sj.Logs.FilterMessageSnippet("written by someone else").Len(); n != 1 {
		t.Fatalf("%d foreign-write warnings, want 1: %v", n, sj.Logs.All())
	}
}

// Without signatures (an insecure coordinator, members without a
// verifier), members cannot tell a forged record and obey it; the leader
// then republishes its participants above the forged epoch at once, so
// they come back.
func TestForgedQuorumRepairedWithoutSignatures(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	forged := q
	forged.Epoch, forged.Participants, forged.Reason = q.Epoch+5, q.Participants[:1], "forged"
	v, _ := json.Marshal(forged)
	if _, err := tj.Client.Put(clustertest.Ctx(t, 5*time.Second), etcdkeys.Layout{}.Quorum(tj.Name), string(v)); err != nil {
		t.Fatal(err)
	}
	q2 := clustertest.WaitQuorum(t, b, q.Epoch+5, "a", "b")
	if q2.Epoch != q.Epoch+6 || !strings.Contains(q2.Reason, "overwritten") {
		t.Fatalf("repair %+v", q2)
	}
}

// Coordinators that sign with different keys refuse to run side by side.
func TestCoordinatorKeyMismatch(t *testing.T) {
	sj := clustertest.StartSecureJob(t)
	other, _ := coordinator.GenerateQuorumSigner()
	cc := coordinator.DefaultConfig()
	cc.Client, cc.Name, cc.QuorumSigner = sj.CoordClient, "c-other", other
	c, err := coordinator.New(cc)
	if err != nil {
		t.Fatal(err)
	}
	err = c.Run(clustertest.Ctx(t, 20*time.Second))
	if !errors.Is(err, coordinator.ErrKeyMismatch) {
		t.Fatalf("Run = %v, want ErrKeyMismatch", err)
	}
}

// A coordinator started on a data directory written before the compact
// records (quorum record and history in the old JSON encoding, signed
// over membership.CanonicalQuorum) trusts them and goes on from their
// epoch, publishing the compact encoding from its first decision; a
// forged record found beside an old history is restored from it, and a
// member that reads the restored record (old encoding) takes it.
func TestCoordinatorLoadsRecordsOfTheOldEncoding(t *testing.T) {
	sj := clustertest.StartSecureJob(t)
	a, b := sj.Join("a"), sj.Join("b")
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	clustertest.WaitQuorum(t, b, 0, "a", "b")
	ctx := clustertest.Ctx(t, 40*time.Second)
	k := etcdkeys.Layout{}
	rootCreds := clustertest.Credentials(t, sj.Etcd, etcdhost.UserRoot)
	root, err := rootCreds.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	// writeOld rewrites the record and every history entry as the old
	// coordinator wrote them.
	writeOld := func(cur membership.Quorum, record []byte) []byte {
		t.Helper()
		resp, err := root.Get(ctx, k.History(sj.Name), clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		var last []byte
		for _, kv := range resp.Kvs {
			hq, err := membership.DecodeQuorumRecord(kv.Value, sj.Signer.Verifier())
			if err != nil {
				t.Fatal(err)
			}
			if hq.Epoch == cur.Epoch {
				hq = cur // with the addresses and steps the old record carried
			}
			old, err := sj.Signer.Marshal(hq)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := root.Put(ctx, string(kv.Key), string(old)); err != nil {
				t.Fatal(err)
			}
			last = old
		}
		if record == nil {
			record = last
		}
		if _, err := root.Put(ctx, k.Quorum(sj.Name), string(record)); err != nil {
			t.Fatal(err)
		}
		return last
	}

	sj.Stop()
	writeOld(q, nil)
	sj.StartCoordinator("c1")
	c := sj.Join("c")
	q2 := clustertest.WaitQuorum(t, c, 0, "a", "b", "c")
	if q2.Epoch != q.Epoch+1 {
		t.Fatalf("epoch %d on the old records, want %d", q2.Epoch, q.Epoch+1)
	}
	if got := clustertest.WaitQuorum(t, a, q.Epoch, "a", "b", "c"); got.Epoch != q2.Epoch {
		t.Fatalf("a member of the old epoch: epoch %d, want %d", got.Epoch, q2.Epoch)
	}
	resp, err := root.Get(ctx, k.Quorum(sj.Name))
	if err != nil {
		t.Fatal(err)
	}
	if rec := resp.Kvs[0].Value; bytes.HasPrefix(rec, []byte("{")) && !bytes.Contains(rec, []byte("\n")) {
		t.Fatalf("the first decision wrote the old encoding: %.80s", rec)
	}

	// A forged record beside an old history: restored from it.
	sj.Stop()
	forged, _ := json.Marshal(membership.Quorum{Job: sj.Name, Epoch: q2.Epoch + 3, Reason: "forged"})
	good := writeOld(q2, forged)
	sj.StartCoordinator("c2")
	sj.WaitRecord(good)
	// A member joining now reads the restored record (the old encoding)
	// when it cannot apply the view, and is admitted in the next epoch.
	d := sj.Join("d")
	q3 := clustertest.WaitQuorum(t, d, 0, "a", "b", "c", "d")
	if q3.Epoch != q2.Epoch+1 {
		t.Fatalf("epoch %d after the restore, want %d", q3.Epoch, q2.Epoch+1)
	}
}
