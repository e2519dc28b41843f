package comm_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// On a Refuser backend, a collective or point-to-point op that fails
// validation takes its place in the issue order (so the backend can keep
// every rank's sequence in step and tell the peers), fails with
// ErrInvalidArgument, and leaves the comm usable.
func TestRefusedOpTakesItsPlaceInOrder(t *testing.T) {
	f := &refuser{fake: newFake(1, 4)}
	f.gate = make(chan struct{})
	c := newComm(t, f, comm.Options{})
	ctx := context.Background()
	x := comm.Float32s(make([]float32, 4))

	first := c.AllReduceAsync(ctx, x, comm.Sum)
	bad := c.BroadcastAsync(ctx, x, 9)
	last := c.BarrierAsync(ctx)
	select {
	case <-bad.Done():
		t.Fatal("the refused op completed before the op issued ahead of it")
	default:
	}
	close(f.gate)
	if err := waitDone(t, first); err != nil {
		t.Fatal(err)
	}
	if err := waitDone(t, bad); !errors.Is(err, comm.ErrInvalidArgument) || bad.Seq() != 2 {
		t.Fatalf("refused op: seq %d, %v; want seq 2, ErrInvalidArgument", bad.Seq(), err)
	}
	if err := waitDone(t, last); err != nil {
		t.Fatalf("op after the refused one: %v", err)
	}
	if got, want := f.ops(), []comm.OpType{comm.OpAllReduce, comm.OpNone, comm.OpBarrier}; !slices.Equal(got, want) {
		t.Fatalf("backend saw %v, want %v", got, want)
	}
	f.mu.Lock()
	op, reason := f.refused[0], f.reasons[0]
	f.mu.Unlock()
	if op.Kind != comm.OpBroadcast || op.Root != 9 || !errors.Is(reason, comm.ErrInvalidArgument) {
		t.Fatalf("backend refused %+v for %v", op, reason)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("comm broken after a refusal: %v", err)
	}

	// A sync one on an idle comm too; point-to-point ops and batches alike.
	if err := c.Send(ctx, x, 7); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("send to rank 7: %v", err)
	}
	if err := c.BatchP2P(ctx, []comm.P2POp{{Kind: comm.P2PRecv, Tensor: comm.Tensor{}, Peer: 0}}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("batch with no tensor: %v", err)
	}
	f.mu.Lock()
	n := len(f.refused)
	f.mu.Unlock()
	if n != 3 {
		t.Fatalf("backend refused %d ops, want 3", n)
	}
}

// Ops that are not collectives or point-to-point ops concern no peer's
// matching op: they fail at once, as on any backend.
func TestReconfigurationIsNotRefusedThroughTheBackend(t *testing.T) {
	f := &refuser{fake: newFake(1, 4)}
	c := newComm(t, f, comm.Options{})
	ctx := context.Background()
	if _, err := c.Split(ctx, -2, 0); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("split: %v", err)
	}
	if _, err := c.Grow(ctx, 3, 1); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("grow: %v", err)
	}
	if got := f.ops(); len(got) != 0 {
		t.Fatalf("backend saw %v", got)
	}
}

// Comm.Refuse returns the op's error at once and tells the backend in
// the op's place.
func TestCommRefuse(t *testing.T) {
	f := &refuser{fake: newFake(0, 2)}
	f.gate = make(chan struct{})
	c := newComm(t, f, comm.Options{})
	ctx := context.Background()
	w := c.BarrierAsync(ctx)
	err := c.Refuse(ctx, comm.Op{Kind: comm.OpRecv, Peer: 1}, errors.New("tensor is on the wrong device"))
	if !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("Refuse: %v", err)
	}
	close(f.gate)
	if err := waitDone(t, w); err != nil {
		t.Fatal(err)
	}
	// The refusal runs on the worker after the barrier; a sync op issued
	// now runs after it.
	if err := c.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	if got, want := f.ops(), []comm.OpType{comm.OpBarrier, comm.OpNone, comm.OpBarrier}; !slices.Equal(got, want) {
		t.Fatalf("backend saw %v, want %v", got, want)
	}
	f.mu.Lock()
	op := f.refused[0]
	f.mu.Unlock()
	if op.Kind != comm.OpRecv || op.Peer != 1 {
		t.Fatalf("backend refused %+v", op)
	}
	if err := c.Refuse(ctx, comm.Op{Kind: comm.OpShrink}, errors.New("x")); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("Refuse of a shrink: %v", err)
	}
	if got := f.ops(); len(got) != 3 {
		t.Fatalf("a refused shrink reached the backend: %v", got)
	}
}

// A refusal the backend cannot tell its peers of breaks the comm, as any
// failed op does; the op's error is still the caller's mistake first.
func TestRefuseThatFailsBreaksTheComm(t *testing.T) {
	f := &refuser{fake: newFake(0, 2)}
	dead := &comm.RankError{Rank: 1, Err: comm.ErrPeerFailed}
	f.failRefuse = dead
	c := newComm(t, f, comm.Options{})
	err := c.Broadcast(context.Background(), comm.Float32s(make([]float32, 1)), 5)
	if !errors.Is(err, comm.ErrInvalidArgument) || !errors.Is(err, comm.ErrPeerFailed) {
		t.Fatalf("got %v, want ErrInvalidArgument and ErrPeerFailed", err)
	}
	if !errors.Is(c.Err(), comm.ErrAborted) {
		t.Fatalf("comm not broken: %v", c.Err())
	}
}

// A refused op whose caller's ctx has ended still tells the peers: they
// wait for it.
func TestRefusedOpIgnoresItsCtx(t *testing.T) {
	f := &refuser{fake: newFake(0, 2)}
	c := newComm(t, f, comm.Options{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.Reduce(ctx, comm.Tensor{}, comm.Sum, 0); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("got %v", err)
	}
	if got := f.ops(); !slices.Equal(got, []comm.OpType{comm.OpNone}) {
		t.Fatalf("backend saw %v", got)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("comm broken: %v", err)
	}
}

// An op that fails because a peer refused it (ErrPeerRefused from the
// backend) leaves the comm usable.
func TestPeerRefusalKeepsTheComm(t *testing.T) {
	f := newFake(0, 2)
	f.failNext = &comm.RankError{Rank: 1, Op: comm.OpAllReduce, Err: &comm.Refusal{Rank: 1, Op: comm.OpAllReduce, Reason: "bor is not supported for dtype float32"}}
	c := newComm(t, f, comm.Options{})
	ctx := context.Background()
	err := c.AllReduce(ctx, comm.Float32s(make([]float32, 2)), comm.Sum)
	var re *comm.RankError
	var ref *comm.Refusal
	if !errors.Is(err, comm.ErrPeerRefused) || !errors.As(err, &re) || re.Rank != 1 || !errors.As(err, &ref) || ref.Op != comm.OpAllReduce {
		t.Fatalf("got %v", err)
	}
	if want := "rank 1 refused its allreduce: bor is not supported"; !strings.Contains(err.Error(), want) {
		t.Fatalf("%q does not say %q", err, want)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("comm broken: %v", err)
	}
	if err := c.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
}

// Close lets a refusal that is being told to the peers finish rather than
// abort the backend: the peers wait for it, its caller has no Work to wait
// on, and an abort would reach the peers' comms too.
func TestCloseLetsARunningRefusalFinish(t *testing.T) {
	f := &refuser{fake: newFake(0, 2), hold: make(chan struct{}), holding: make(chan struct{})}
	c := newComm(t, f, comm.Options{})
	if err := c.Refuse(context.Background(), comm.Op{Kind: comm.OpBatchP2P}, errors.New("batch: no sends or receives")); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("Refuse: %v", err)
	}
	waitClosed(t, f.holding, "refusal reached the backend")
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	waitClosed(t, c.Broken(), "Close began")
	close(f.hold)
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(30 * time.Second): // a hang, not a slow machine
		t.Fatal("Close did not return once the refusal finished")
	}
	f.mu.Lock()
	err, closes := f.heldErr, f.closed
	f.mu.Unlock()
	if err != nil || closes != 1 {
		t.Fatalf("refusal ended with %v, backend closed %d times; want it finished, then closed once", err, closes)
	}
}

// A refusal that Close waits for keeps its deadline (Options.Timeout): a
// peer that never takes it cannot hold Close up.
func TestCloseWaitsForARefusalOnlyUntilItsDeadline(t *testing.T) {
	f := &refuser{fake: newFake(0, 2), hold: make(chan struct{}), holding: make(chan struct{})}
	c := newComm(t, f, comm.Options{Timeout: 300 * time.Millisecond})
	if err := c.Refuse(context.Background(), comm.Op{Kind: comm.OpSend, Peer: 1}, errors.New("tensor is on the wrong device")); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("Refuse: %v", err)
	}
	waitClosed(t, f.holding, "refusal reached the backend")
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(30 * time.Second): // a hang, not a slow machine
		t.Fatal("Close still waited for a refusal 30 s after its 300 ms deadline")
	}
	f.mu.Lock()
	err := f.heldErr
	f.mu.Unlock()
	if !errors.Is(err, comm.ErrTimeout) || errors.Is(err, comm.ErrClosed) {
		t.Fatalf("refusal ended with %v; want it aborted at its deadline (ErrTimeout), not by Close", err)
	}
}

func waitClosed(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("no %s within 30 s", what)
	}
}
