package membership_test

import (
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

func TestMemberDuplicateID(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	first := tj.Join("a", nil)
	cfg := membership.DefaultMemberConfig()
	cfg.Client, cfg.Job, cfg.ID, cfg.Addr = tj.Client, tj.Name, "a", "other:1"
	_, err := membership.Join(clustertest.Ctx(t, 10*time.Second), cfg)
	var dup *membership.DuplicateMemberError
	if !errors.Is(err, membership.ErrDuplicateMember) || !errors.As(err, &dup) || dup.Incarnation != first.Incarnation() {
		t.Fatalf("second join = %v", err)
	}
	// Waiting for the holder: it goes, the new incarnation gets in — even
	// when the wait outlasts the waiter's own lease TTL.
	cfg.WaitForDuplicate = true
	cfg.LeaseTTL = 2 * time.Second
	waiting := make(chan struct{})
	var once sync.Once
	cfg.Logger = zap.New(zapcore.RegisterHooks(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(io.Discard), zap.InfoLevel), func(e zapcore.Entry) error {
		if e.Message == "waiting for the previous incarnation to go" {
			once.Do(func() { close(waiting) })
		}
		return nil
	}))
	joined := make(chan *membership.Member, 1)
	go func() {
		m, err := membership.Join(clustertest.Ctx(t, 30*time.Second), cfg)
		if err != nil {
			t.Error(err)
		}
		joined <- m
	}()
	select {
	case <-waiting:
	case <-clustertest.Ctx(t, 10*time.Second).Done():
		t.Fatal("the second join did not wait")
	}
	<-time.After(3 * time.Second) // longer than the waiter's lease TTL
	first.Leave(clustertest.Ctx(t, 5*time.Second))
	m := <-joined
	if m == nil {
		return
	}
	defer m.Close()
	if m.Incarnation() <= first.Incarnation() {
		t.Fatalf("incarnation %d not above %d", m.Incarnation(), first.Incarnation())
	}
}

func TestMemberRevokeEpoch(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	q := clustertest.WaitQuorum(t, b, 0, "a", "b")
	ch := b.Revoked(q.Epoch)
	if err := a.Revoke(clustertest.Ctx(t, 5*time.Second), q.Epoch, "peer b timed out", "b"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ch:
	case <-clustertest.Ctx(t, 10*time.Second).Done():
		t.Fatal("b did not see the revocation")
	}
	if r, ok := b.Revocation(q.Epoch); !ok || r.By != "a" || r.Reason != "peer b timed out" {
		t.Fatalf("revocation %+v", r)
	}
	// The coordinator follows with the next epoch (same participants).
	q2 := clustertest.WaitQuorum(t, b, q.Epoch, "a", "b")
	if q2.Epoch != q.Epoch+1 {
		t.Fatalf("epoch %d", q2.Epoch)
	}
}

func TestDeathByLeaseExpiry(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	start := time.Now()
	b.Crash()
	q2 := clustertest.WaitQuorum(t, a, q.Epoch, "a")
	t.Logf("lease expiry (TTL 2s) noticed after %v: %s", time.Since(start), q2.Reason)
	if q2.Reason != "b lease expired" {
		t.Fatalf("reason %q", q2.Reason)
	}
}

// A member that stops without a word is found by gossip (its lease would
// last a minute), published dead, and its registration deleted so that it
// comes back at once; its healthy peers stay.
func TestDeathByGossip(t *testing.T) {
	tj := clustertest.StartJobGossip(t, quorum.DefaultConfig(), clustertest.SteadyGossip())
	long := func(c *membership.MemberConfig) { c.LeaseTTL = time.Minute } // gossip must find it
	a, b, c := tj.Join("a", long), tj.Join("b", long), tj.Join("c", long)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b", "c")
	_ = c
	start := time.Now()
	b.Crash()
	q2 := clustertest.WaitQuorum(t, a, q.Epoch, "a", "c")
	t.Logf("gossip death noticed and published after %v: %s", time.Since(start), q2.Reason)
	if q2.Reason != "b died (gossip)" {
		t.Fatalf("reason %q", q2.Reason)
	}
	// The coordinator deletes the dead registration (right after the
	// publication): b comes back without waiting out its minute's lease.
	ctx := clustertest.Ctx(t, 20*time.Second)
	testutil.WaitFor(t, ctx, "b's registration deleted", func() bool {
		resp, err := tj.Client.Get(ctx, etcdkeys.Layout{}.Member(tj.Name, "b"))
		return err == nil && len(resp.Kvs) == 0
	})
	b2 := tj.Join("b", long)
	clustertest.WaitQuorum(t, a, q2.Epoch, "a", "c", "b")
	if b2.Incarnation() <= b.Incarnation() {
		t.Fatal("no new incarnation")
	}
}

// The first epoch to record a step owns it; others learn who did.
func TestRecordCommit(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 1, JoinTimeout: time.Second}, false)
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	ctx := clustertest.Ctx(t, 20*time.Second)
	if _, ok, err := a.LastCommit(ctx); err != nil || ok {
		t.Fatalf("a fresh job has a commit record (%v, %v)", ok, err)
	}
	if _, ok, err := a.RecordCommit(ctx, 1, 3); err != nil || !ok {
		t.Fatalf("first record: ok=%v err=%v", ok, err)
	}
	if _, ok, err := b.RecordCommit(ctx, 1, 3); err != nil || !ok {
		t.Fatalf("same epoch again: ok=%v err=%v", ok, err)
	}
	rec, ok, err := b.RecordCommit(ctx, 1, 4)
	if err != nil || ok || rec.Epoch != 3 || rec.By != "a" {
		t.Fatalf("another epoch: rec=%+v ok=%v err=%v", rec, ok, err)
	}
	for s := int64(2); s <= 3; s++ {
		if _, ok, err := b.RecordCommit(ctx, s, 4); err != nil || !ok {
			t.Fatalf("step %d: ok=%v err=%v", s, ok, err)
		}
	}
	if last, ok, err := a.LastCommit(ctx); err != nil || !ok || last.Step != 3 || last.Epoch != 4 {
		t.Fatalf("last commit %+v ok=%v err=%v", last, ok, err)
	}
}
