package comm_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// lateShrinker's Shrink succeeds at the moment the backend is aborted: the
// abort (from Close) arrives just as the new comm formed.
type lateShrinker struct {
	*fake
	entered chan struct{}
	formed  chan *fake
}

func (s lateShrinker) Shrink(ctx context.Context, exclude []int, epoch uint64) (comm.Backend, error) {
	close(s.entered)
	<-s.fake.abort
	nf := newFake(s.rank-countBelow(exclude, s.rank), s.size-len(exclude))
	nf.epoch = epoch
	s.formed <- nf
	return nf, nil
}

// Close while a Shrink completes: no panic (both used to shut the old comm
// down: "close of closed channel"), Close returns nil, and the Shrink
// reports ErrClosed and closes the comm it formed, which nobody would.
func TestCloseAsShrinkCompletes(t *testing.T) {
	for range 20 {
		b := lateShrinker{fake: newFake(0, 3), entered: make(chan struct{}), formed: make(chan *fake, 1)}
		c, err := comm.Wrap(b, comm.Options{})
		if err != nil {
			t.Fatal(err)
		}
		type result struct {
			nc  *comm.Comm
			err error
		}
		done := make(chan result, 1)
		go func() {
			nc, err := c.Shrink(context.Background(), []int{2}, 1)
			done <- result{nc, err}
		}()
		<-b.entered
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		r := <-done
		nf := <-b.formed
		if !errors.Is(r.err, comm.ErrClosed) || r.nc != nil {
			t.Fatalf("Shrink after Close: %v, %v; want ErrClosed and no comm", r.nc, r.err)
		}
		nf.mu.Lock()
		closed := nf.closed
		nf.mu.Unlock()
		if closed != 1 {
			t.Fatalf("the comm the Shrink formed was closed %d times, want 1", closed)
		}
		if err := c.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
	}
}

// stuckShrinker's Shrink waits until it is aborted or its ctx ends, as the
// Backend contract allows.
type stuckShrinker struct{ *fake }

func (s stuckShrinker) Shrink(ctx context.Context, exclude []int, epoch uint64) (comm.Backend, error) {
	s.fake.mu.Lock()
	abort := s.fake.abort
	s.fake.mu.Unlock()
	select {
	case <-abort:
		return nil, s.fake.abortErr
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// A Shrink repairs a broken comm, and its deadline (Options.Timeout) holds
// too: the backend is aborted and the Shrink fails with ErrTimeout, while
// the comm stays broken as it was. Before, the deadline was skipped on a
// broken comm and the Shrink waited for its peers forever.
func TestShrinkOnBrokenCommKeepsItsDeadline(t *testing.T) {
	f := newFake(0, 3)
	c, err := comm.Wrap(stuckShrinker{f}, comm.Options{Timeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	f.failNext = fmt.Errorf("%w: rank 2 died", comm.ErrPeerFailed)
	if err := c.Barrier(context.Background()); !errors.Is(err, comm.ErrPeerFailed) {
		t.Fatalf("barrier: %v", err)
	}
	// The abort that followed the failure is spent: the Shrink must be
	// stopped by its own deadline.
	f.mu.Lock()
	f.abort, f.abortErr = make(chan struct{}), nil
	f.mu.Unlock()
	done := make(chan error, 1)
	go func() { _, err := c.Shrink(context.Background(), []int{2}, 1); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, comm.ErrTimeout) {
			t.Fatalf("Shrink past its deadline: %v, want ErrTimeout", err)
		}
	case <-time.After(30 * time.Second): // a hang, not a slow machine
		t.Fatal("a Shrink with a 100 ms deadline still ran after 30 s")
	}
	if err := c.Barrier(context.Background()); !errors.Is(err, comm.ErrPeerFailed) {
		t.Fatalf("after the failed Shrink the comm should still refuse with its failure: %v", err)
	}
}

// peerFailer's barrier sees a peer die (a RankError) once it is aborted,
// as a backend whose op was revoked while a peer had failed does.
type peerFailer struct {
	*fake
	started chan struct{}
}

func (p peerFailer) Barrier(ctx context.Context) error {
	close(p.started)
	<-p.fake.abort
	return &comm.RankError{Rank: 2, Op: comm.OpBarrier, Err: comm.ErrPeerFailed}
}

// An op revoked locally while it runs fails with ErrRevoked, and what the
// backend saw stays matchable: the dead peer (ErrPeerFailed, FailedRanks),
// as backends/gloo/doc.go promises. Before, the backend's error was kept
// as text only.
func TestRevokeKeepsTheBackendsFailure(t *testing.T) {
	p := peerFailer{fake: newFake(0, 3), started: make(chan struct{})}
	c, err := comm.Wrap(p, comm.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	done := make(chan error, 1)
	go func() { done <- c.Barrier(context.Background()) }()
	<-p.started
	c.Revoke(errors.New("the quorum moved on"))
	err = <-done
	if !errors.Is(err, comm.ErrRevoked) || !errors.Is(err, comm.ErrPeerFailed) {
		t.Fatalf("revoked op: %v; want ErrRevoked and ErrPeerFailed", err)
	}
	if got := comm.FailedRanks(err); len(got) != 1 || got[0] != 2 {
		t.Fatalf("FailedRanks %v, want [2]", got)
	}
}
