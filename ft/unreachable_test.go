package ft

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/coordinator/memcoord"
)

// unreachableMember is a member whose writes to the coordinator hang, as
// etcd's do when the replica is cut off from it, once cut is set.
type unreachableMember struct {
	*memcoord.Member
	cut atomic.Bool
}

func (m *unreachableMember) Revoke(ctx context.Context, epoch uint64, reason string, failed ...string) error {
	if m.cut.Load() {
		<-ctx.Done()
		return ctx.Err()
	}
	return m.Member.Revoke(ctx, epoch, reason, failed...)
}

func (m *unreachableMember) ReportCommitFailure(ctx context.Context, epoch uint64, blamed ...string) error {
	if m.cut.Load() {
		<-ctx.Done()
		return ctx.Err()
	}
	return m.Member.ReportCommitFailure(ctx, epoch, blamed...)
}

// Found by test/chaos (a replica partitioned from etcd and its peers): a
// failed commit reports itself to the coordinator with the training loop's
// ctx, so with etcd out of reach Commit blocked until etcd answered again
// (7.3 s through the chaos proxy, forever with a ctx without deadline).
// Reporting is best effort: Commit must return within the op timeout.
func TestCommitReturnsWhenCoordinatorUnreachable(t *testing.T) {
	j := newJob(t, quick(), 1)
	// The op timeout bounds the Commit under test. Under a CPU hog an
	// epoch can fail to form within it, so b must not give up after a few
	// failed commits while a joins.
	j.cfg.Timeout, j.cfg.MaxCommitFailures = 2*time.Second, 1000
	b := j.start("b", 0, 1, forever)
	cfg := j.cfg
	cfg.Group = "a"
	m := &unreachableMember{Member: joinAs(j.coord, "a.0", 1)}
	cfg.Membership = m
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	params := make([]float32, j.nParams) // as b's: the all-reduces must match
	if err := a.Register("params", comm.Float32s(params)); err != nil {
		t.Fatal(err)
	}
	grads := make([]float32, len(params))
	for a.Participants() < 2 { // train until both take part
		if err := a.Step(ctx); err != nil && !errors.Is(err, ErrRolledBack) {
			b.mu.Lock()
			berr := b.err
			b.mu.Unlock()
			t.Fatalf("%v (b: %v)", err, berr)
		}
		a.AllReduce(ctx, comm.Float32s(grads), comm.Sum)
		if _, err := a.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Step(ctx); err != nil && !errors.Is(err, ErrRolledBack) {
		t.Fatal(err)
	}
	m.cut.Store(true)
	a.ftData().Abort(errors.New("injected link failure"))
	a.AllReduce(ctx, comm.Float32s(grads), comm.Sum)
	done := make(chan error, 1)
	go func() {
		ok, err := a.Commit(ctx)
		if ok {
			err = errors.New("a step with a failed all-reduce committed")
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatal("Commit blocked on a coordinator out of reach")
	}
	m.cut.Store(false)
	j.stopAll(b)
}
