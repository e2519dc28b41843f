package nccl

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl/ncclsim"
	"github.com/ftcomm/ftcomm/comm"
)

// Ops with a StreamOrder run after the work queued on the caller's stream
// (they read what it wrote) and before the work queued there afterwards,
// and a collective returns once enqueued: torch.distributed's contract.
func TestStreamOrder(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	L := simLibrary(w)
	ranks := startJob(t, ctx, L, devs(2), 1, "job", nil)
	bufs := make([]*devBuf, 2)
	for i, rk := range ranks {
		b, err := rk.alloc(comm.Float32, 4)
		if err != nil {
			t.Fatal(err)
		}
		defer b.b.Free()
		if err := b.set(ctx, []float64{float64(i + 1), 1, 1, 1}); err != nil {
			t.Fatal(err)
		}
		bufs[i] = b
	}
	user, err := L.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer user.Close()
	// Rank 0's stream writes 10 into its tensor, held back for now.
	pin, free, err := L.PinnedHost(0, 16)
	if err != nil {
		t.Fatal(err)
	}
	defer free()
	copy(pin, encode(comm.Float32, []float64{10, 1, 1, 1}))
	w.StallCopies(true)
	if err := user.CopyToDevice(bufs[0].t(), pin); err != nil {
		t.Fatal(err)
	}
	// Enqueued without waiting, though rank 1 has not called yet.
	octx := WithStreamOrder(ctx, StreamOrder{Stream: user.Handle()})
	if err := ranks[0].c.AllReduce(octx, bufs[0].t(), comm.Sum); err != nil {
		t.Fatal(err)
	}
	after, err := L.NewEvent(0, false)
	if err != nil {
		t.Fatal(err)
	}
	defer after.Close()
	if err := after.Record(user); err != nil {
		t.Fatal(err)
	}
	w.StallCopies(false)
	if done, err := after.Done(); err != nil || done {
		t.Fatalf("work queued on the caller's stream after the op ran before it (done %v, %v)", done, err)
	}
	if err := ranks[1].c.AllReduce(ctx, bufs[1].t(), comm.Sum); err != nil {
		t.Fatal(err)
	}
	got, err := bufs[1].get(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got[0] != 12 {
		t.Fatalf("rank 1 got %v: the op did not read what the caller's stream wrote before it (want 12)", got[0])
	}
	if err := after.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	got, err = bufs[0].get(ctx)
	if err != nil || got[0] != 12 {
		t.Fatalf("rank 0 after its stream's event: %v, %v; want 12", got, err)
	}
	// Async ops through comm.Comm's queue (the Enqueuer path) follow the
	// same order; Async leaves the caller's stream alone.
	for i, so := range []StreamOrder{{Stream: user.Handle()}, {Stream: user.Handle(), Async: true}} {
		each(t, ranks, func(rk *rank) error {
			c := ctx
			if rk.r == 0 {
				c = WithStreamOrder(ctx, so)
			}
			return rk.c.AllReduceAsync(c, bufs[rk.r].t(), comm.Sum).Wait(ctx)
		})
		if err := user.Synchronize(ctx); err != nil {
			t.Fatal(err)
		}
		if got, _ := bufs[0].get(ctx); got[0] != 24*float64(int(1)<<i) {
			t.Fatalf("async %d: rank 0 has %v", i, got)
		}
	}
	if n := ranks[0].c.Backend().(*Backend).nOrdered.Load(); n > 1 {
		t.Errorf("%d ordered ops still followed after completing", n)
	}
}

// A stream-ordered op whose peer never comes fails the comm with
// ErrTimeout at its deadline, and its NCCL comms are aborted so that the
// caller's stream moves on.
func TestStreamOrderDeadline(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	L := simLibrary(w)
	ranks := startJob(t, ctx, L, devs(2), 1, "job", nil)
	buf, err := ranks[0].alloc(comm.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	user, err := L.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer user.Close()
	octx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if err := ranks[0].c.AllReduce(WithStreamOrder(octx, StreamOrder{Stream: user.Handle()}), buf.t(), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if err := user.Synchronize(ctx); err != nil {
		t.Fatalf("the caller's stream did not move on after the deadline: %v", err)
	}
	err = ranks[0].c.AllReduce(ctx, buf.t(), comm.Sum)
	if !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("next op: %v, want ErrTimeout", err)
	}
	closeJob(t, ranks)
	if err := buf.b.Free(); err != nil {
		t.Fatal(err)
	}
}

// A stream the comm cannot use is refused before anything is enqueued.
func TestStreamOrderBadStream(t *testing.T) {
	ctx := testCtx(t)
	w := ncclsim.New(1)
	ranks := startJob(t, ctx, simLibrary(w), devs(1), 1, "job", nil)
	buf, err := ranks[0].alloc(comm.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.b.Free()
	err = ranks[0].c.AllReduce(WithStreamOrder(ctx, StreamOrder{Stream: 0xdead}), buf.t(), comm.Sum)
	if !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("unknown stream: %v, want ErrInvalidArgument", err)
	}
}

// Closing a healthy comm never cancels a stream-ordered op the caller was
// told had been enqueued: Close waits for it (here, for a peer that calls
// late), so its output is the reduction, not what a cancelled kernel left.
// Torch's finalize right after a sync op on CUDA is this case.
func TestCloseSettlesOrderedOps(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	L := simLibrary(w)
	ranks := startJob(t, ctx, L, devs(2), 1, "job", nil)
	bufs := make([]*devBuf, 2)
	for i, rk := range ranks {
		b, err := rk.alloc(comm.Float32, 4)
		if err != nil {
			t.Fatal(err)
		}
		defer b.b.Free()
		if err := b.set(ctx, []float64{float64(i + 1), 1, 1, 1}); err != nil {
			t.Fatal(err)
		}
		bufs[i] = b
	}
	user, err := L.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer user.Close()
	if err := ranks[0].c.AllReduce(WithStreamOrder(ctx, StreamOrder{Stream: user.Handle()}), bufs[0].t(), comm.Sum); err != nil {
		t.Fatal(err)
	}
	b0 := ranks[0].c.Backend().(*Backend)
	closed := make(chan error, 1)
	go func() { closed <- ranks[0].c.Close() }()
	eventually(t, "rank 0's Close waits for its ordered op", b0.settling.Load)
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) before the ordered op could complete", err)
	default:
	}
	if err := ranks[1].c.AllReduce(ctx, bufs[1].t(), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if err := <-closed; err != nil {
		t.Fatalf("Close after the ordered op completed: %v", err)
	}
	waitReleased(t, b0)
	if err := user.Synchronize(ctx); err != nil {
		t.Fatal(err)
	}
	got, err := bufs[0].get(ctx)
	if err != nil || got[0] != 3 {
		t.Fatalf("rank 0 after Close: %v, %v; want 3 (the ordered op was cancelled)", got, err)
	}
	closeJob(t, ranks[1:])
}

// A stream-ordered op that cannot complete (its peer never calls) does not
// hold Close past its deadline, and its failure is said: by Close, or, when
// the deadline passed before Close was called (a loaded machine), by the
// comm's failure, which the next op would have returned.
func TestCloseReportsUnsettledOrderedOps(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	L := simLibrary(w)
	ranks := startJob(t, ctx, L, devs(2), 1, "job", nil)
	buf, err := ranks[0].alloc(comm.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	user, err := L.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer user.Close()
	octx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if err := ranks[0].c.AllReduce(WithStreamOrder(octx, StreamOrder{Stream: user.Handle()}), buf.t(), comm.Sum); err != nil {
		t.Fatal(err)
	}
	b0 := ranks[0].c.Backend().(*Backend)
	err = ranks[0].c.Close()
	if err == nil && b0.failed.Load() {
		err = b0.failure() // the deadline passed first: the comm had failed
	}
	if !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("Close with an ordered op that never completes: %v, want ErrTimeout", err)
	}
	if err := user.Synchronize(ctx); err != nil {
		t.Fatalf("the caller's stream did not move on: %v", err)
	}
	closeJob(t, ranks)
	if err := buf.b.Free(); err != nil {
		t.Fatal(err)
	}
}
