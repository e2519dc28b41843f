package nccl

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/backends/nccl/ncclsim"
	"github.com/ftcomm/ftcomm/comm"
)

// killAndRevoke kills the process on dead's device mid-all-reduce and
// revokes the others' comms, as the membership layer would; it returns
// the survivors.
func killAndRevoke(t *testing.T, ctx context.Context, w *ncclsim.Simulation, ranks []*rank, dead int) []*rank {
	t.Helper()
	var survivors []*rank
	var works []*comm.Work
	w.Kill(ranks[dead].dev)
	for _, rk := range ranks {
		if rk.r == dead {
			continue
		}
		x, err := rk.alloc(comm.Float32, 16)
		if err != nil {
			t.Fatal(err)
		}
		c := rk.c
		works = append(works, c.AllReduceAsync(ctx, x.t(), comm.Sum))
		survivors = append(survivors, rk)
		b := c.Backend().(*Backend)
		eventually(t, "the all-reduce to be running", b.opActive.Load)
		t.Cleanup(func() { c.Close(); waitReleased(t, b); x.b.Free() }) // the op uses x until the release
	}
	for _, rk := range survivors {
		rk.c.Revoke(fmt.Errorf("membership: rank %d died", dead))
	}
	for i, wk := range works {
		if err := wk.Wait(ctx); !errors.Is(err, comm.ErrRevoked) {
			t.Fatalf("survivor %d's op after Revoke: %v, want ErrRevoked", survivors[i].r, err)
		}
	}
	return survivors
}

// shrinkAll shrinks every survivor's comm at epoch, renumbering them.
func shrinkAll(t *testing.T, ctx context.Context, survivors []*rank, exclude []int, epoch uint64) {
	t.Helper()
	each(t, survivors, func(rk *rank) error {
		nc, err := rk.c.Shrink(ctx, exclude, epoch)
		if err == nil {
			rk.c = nc
		}
		return err
	})
	for i, rk := range survivors {
		rk.r = i
	}
}

// allReduceExact runs one all-reduce (sum of rank+1 over the ranks) on
// every rank and checks the result.
func allReduceExact(t *testing.T, ctx context.Context, ranks []*rank) {
	t.Helper()
	want := float64(len(ranks) * (len(ranks) + 1) / 2)
	each(t, ranks, func(rk *rank) error {
		x, err := rk.alloc(comm.Float32, 4)
		if err != nil {
			return err
		}
		defer x.b.Free()
		v := float64(rk.r + 1)
		if err := x.set(ctx, []float64{v, v, v, v}); err != nil {
			return err
		}
		if err := rk.c.AllReduce(ctx, x.t(), comm.Sum); err != nil {
			return err
		}
		got, err := x.get(ctx)
		if err != nil {
			return err
		}
		if !slices.Equal(got, []float64{want, want, want, want}) {
			return fmt.Errorf("all-reduce gave %v, want %v", got, want)
		}
		return nil
	})
}

// A shrink to two or more ranks makes the survivors' blocking data comm
// as ncclCommShrink's child, with no split after it: collectives run on
// it at once, while the control comm is still being made in the
// background (held here); point-to-point ops wait for the control comm
// and then run, and the next shrink shrinks it natively.
func TestShrinkMakesTheDataCommFirst(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 4)
	hold := make(chan struct{})
	ranks := startJob(t, ctx, simLibrary(w), devs(4), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond // the dead ranks' streams never drain
		c.holdControl = hold
	})
	survivors := killAndRevoke(t, ctx, w, ranks, 3)
	splits, inits := w.Calls("ncclCommSplit"), w.Calls("ncclCommInitRankConfig")
	shrinkAll(t, ctx, survivors, []int{3}, 2)
	if n := w.Calls("ncclCommSplit") - splits; n != 0 {
		t.Errorf("ncclCommSplit called %d times by the shrink, want none", n)
	}
	for _, rk := range survivors {
		b := rk.c.Backend().(*Backend)
		if m := b.Creation(); m.How != "ncclCommShrink(NCCL_SHRINK_ABORT) → data comm" || m.DataSplit != 0 {
			t.Errorf("survivor %d: made %+v, want the data comm as ncclCommShrink's child", rk.r, m)
		}
		b.hmu.Lock()
		ctl, data := b.ctl, b.data
		b.hmu.Unlock()
		if ctl != 0 || data == 0 || !b.dataBlocking || isClosed(b.ctlDone) {
			t.Errorf("survivor %d while its control comm is held: control %#x, data %#x (blocking %v)", rk.r, ctl, data, b.dataBlocking)
		}
	}
	blocking := w.Calls("enqueue(blocking)")
	allReduceExact(t, ctx, survivors) // no control comm needed
	if n := w.Calls("enqueue(blocking)") - blocking; n != len(survivors) {
		t.Errorf("%d enqueues on blocking comms for %d all-reduces", n, len(survivors))
	}
	if n := w.Calls("ncclCommInitRankConfig") - inits; n != 0 {
		t.Errorf("%d comms initialised while the control comm is held", n)
	}

	// Point-to-point ops wait for the control comm, then run.
	src, dst := survivors[0].mustAlloc(t, comm.Float32, 4), survivors[2].mustAlloc(t, comm.Float32, 4)
	if err := src.set(ctx, []float64{7, 8, 9, 10}); err != nil {
		t.Fatal(err)
	}
	send := survivors[0].c.SendAsync(ctx, src.t(), 2)
	recv := survivors[2].c.RecvAsync(ctx, dst.t(), 0)
	close(hold)
	if err := errors.Join(send.Wait(ctx), recv.Wait(ctx)); err != nil {
		t.Fatal(err)
	}
	if got, err := dst.get(ctx); err != nil || !slices.Equal(got, []float64{7, 8, 9, 10}) {
		t.Fatalf("received %v (%v)", got, err)
	}
	for _, rk := range survivors {
		b := rk.c.Backend().(*Backend)
		waitControl(t, b)
		if b.ctlErr != nil || b.ctl == 0 || b.ctl == b.data || b.ctlBlocking {
			t.Errorf("survivor %d: control comm %#x (%v), data comm %#x", rk.r, b.ctl, b.ctlErr, b.data)
		}
	}
	collectiveSuite(t, ctx, survivors, []comm.DType{comm.Float32}, 5, 41)
	if n := w.Calls("ncclCommInitRankConfig") - inits; n != len(survivors) {
		t.Errorf("%d control comms initialised, want %d", n, len(survivors))
	}

	// A second failure: the next shrink is native again, from the control comm.
	survivors = killAndRevoke(t, ctx, w, survivors, 2)
	shrinkAll(t, ctx, survivors, []int{2}, 3)
	for _, rk := range survivors {
		if how := rk.c.Backend().(*Backend).Creation().How; how != "ncclCommShrink(NCCL_SHRINK_ABORT) → data comm" {
			t.Errorf("survivor %d's second shrink: %q", rk.r, how)
		}
	}
	allReduceExact(t, ctx, survivors)
}

// A second death while the survivors' control comm is still being made:
// none of them holds one, so the next shrink initialises fresh among the
// new survivors, the held init gives up at the failure, and every comm is
// released.
func TestShrinkSecondDeathWhileTheControlCommIsMade(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 4)
	hold := make(chan struct{}) // never closed: the control comms never come
	ranks := startJob(t, ctx, simLibrary(w), devs(4), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
		c.holdControl = hold
	})
	survivors := killAndRevoke(t, ctx, w, ranks, 3)
	shrinkAll(t, ctx, survivors, []int{3}, 2)
	held := make([]*Backend, len(survivors))
	for i, rk := range survivors {
		held[i] = rk.c.Backend().(*Backend)
	}
	survivors = killAndRevoke(t, ctx, w, survivors, 2)
	for _, b := range held[:2] {
		waitControl(t, b) // given up at the revoke
		if b.ctlErr == nil || b.ctl != 0 {
			t.Errorf("rank %d's held control comm: %#x, %v; want given up", b.rank, b.ctl, b.ctlErr)
		}
	}
	shrinkAll(t, ctx, survivors, []int{2}, 3)
	for _, rk := range survivors {
		if how := rk.c.Backend().(*Backend).Creation().How; how != "fresh init" {
			t.Errorf("survivor %d's shrink without a control comm: %q, want a fresh init", rk.r, how)
		}
	}
	allReduceExact(t, ctx, survivors)
	collectiveSuite(t, ctx, survivors, []comm.DType{comm.Float32}, 3, 42)
	closeJob(t, survivors)
	// The dead rank's Backend too: its held init gives up at the close.
	held[2].Close()
	waitReleased(t, held[2])
	waitControl(t, held[2])
}

// waitControl waits until b's background control comm is made or
// given up.
func waitControl(t *testing.T, b *Backend) {
	t.Helper()
	select {
	case <-b.ctlDone:
	case <-time.After(30 * time.Second):
		t.Fatalf("rank %d's control comm neither made nor given up after 30 s", b.rank)
	}
}

// The shrunk comm's stream runs nothing before the old comm's work is
// over: rank 0's all-reduce is stuck on the dead rank when the survivors
// shrink, and the abort of rank 0's old data comm, which ends that
// kernel, is stalled; rank 0's first collective on the shrunk comm stays
// queued on the GPU until the abort is let go.
func TestShrinkOrderedAfterTheOldStream(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 3)
	ranks := startJob(t, ctx, simLibrary(w), devs(3), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
		c.NoWarmUp = true // the warm-up would be the first op
	})
	old := ranks[0].c.Backend().(*Backend)
	w.StallAborts(0, true)
	survivors := killAndRevoke(t, ctx, w, ranks, 2)
	t.Cleanup(func() { w.StallAborts(0, false) }) // before the comms' release
	shrinkAll(t, ctx, survivors, []int{2}, 2)
	if w.StreamIdle(uintptr(old.stream)) {
		t.Fatal("rank 0's old stream drained while the abort of its data comm is stalled")
	}
	xs := make([]*devBuf, 2)
	for i, rk := range survivors {
		xs[i] = rk.mustAlloc(t, comm.Float32, 4)
		v := float64(i + 1)
		if err := xs[i].set(ctx, []float64{v, v, v, v}); err != nil {
			t.Fatal(err)
		}
	}
	nbs := make([]*Backend, 2)
	for i, rk := range survivors {
		nbs[i] = rk.c.Backend().(*Backend)
		a := libapi.CollArgs{Kind: libapi.AllReduce, Type: libapi.Float32, Op: libapi.Sum,
			Send: xs[i].t().Ptr(), Recv: xs[i].t().Ptr(), Count: 4}
		if err := nbs[i].launch(ctx, "allreduce", &a, nil); err != nil {
			t.Fatal(err)
		}
	}
	if idle, err := nbs[0].lib.StreamQuery(nbs[0].dev, nbs[0].stream); err != nil || idle {
		t.Fatalf("rank 0's shrunk stream idle %v (%v) while its old all-reduce is stuck: it ran out of order", idle, err)
	}
	w.StallAborts(0, false)
	for _, nb := range nbs {
		eventually(t, "the shrunk comm's all-reduce", func() bool { idle, _ := nb.lib.StreamQuery(nb.dev, nb.stream); return idle })
	}
	for i, x := range xs {
		if got, err := x.get(ctx); err != nil || !slices.Equal(got, []float64{3, 3, 3, 3}) {
			t.Errorf("survivor %d: %v (%v), want 3s", i, got, err)
		}
	}
}

// A peer that stops (SIGSTOP, or a hung host) during the first collective
// on a comm a shrink made with its data comm first: the survivors'
// all-reduce fails with ErrTimeout at its deadline, never hangs inside
// NCCL. The data comm connected every algorithm while the shrink made it,
// so the collective only enqueues; nothing on the survivors' way connects
// to the silent peer.
func TestShrinkDataCommFirstUseWithASilentPeer(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 4)
	ranks := startJob(t, ctx, simLibrary(w), devs(4), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
		o.Timeout = 300 * time.Millisecond
	})
	survivors := killAndRevoke(t, ctx, w, ranks, 3)
	shrinkAll(t, ctx, survivors, []int{3}, 2)
	w.Kill(survivors[2].dev) // stops before its first collective on the shrunk comm
	errs := make([]error, 2)
	took := make([]time.Duration, 2)
	each(t, survivors[:2], func(rk *rank) error {
		x, err := rk.alloc(comm.Float32, 4)
		if err != nil {
			return err
		}
		b := rk.c.Backend().(*Backend)
		t.Cleanup(func() { rk.c.Close(); waitReleased(t, b); x.b.Free() })
		t0 := time.Now()
		errs[rk.r] = rk.c.AllReduce(ctx, x.t(), comm.Sum)
		took[rk.r] = time.Since(t0)
		return nil
	})
	for i, err := range errs {
		if !errors.Is(err, comm.ErrTimeout) {
			t.Errorf("survivor %d's first all-reduce with a silent peer: %v, want ErrTimeout", i, err)
		}
		if took[i] > 5*time.Second {
			t.Errorf("survivor %d's all-reduce returned %s after it began, its deadline 300 ms", i, took[i])
		}
	}
}
