package nccl

import (
	"errors"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// A shrink to one rank after a failure makes no NCCL comm: the lone
// survivor's comm runs every op as the device copy NCCL would make of
// it, on a stream ordered after the old comm's, whose NCCL comms the
// watchdog aborts meanwhile. Every op of the suite gives NCCL's one-rank
// results; a split of it is local too; it grows back to two ranks with a
// joiner through a fresh init.
func TestLocalOneRankShrink(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 3)
	var joiner comm.Options
	var joinerCfg Config
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond // the dead rank's stream never drains
		if o.Rank == 0 {
			joiner, joinerCfg = *o, *c
		}
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks)
	ranks[0].c.Revoke(errors.New("membership: rank 1 left"))
	if err := work.Wait(ctx); !errors.Is(err, comm.ErrRevoked) {
		t.Fatalf("stuck op after Revoke: %v", err)
	}
	old := ranks[0].c.Backend().(*Backend)
	aborts, inits, splits := w.Calls("ncclCommAbort"), w.Calls("ncclCommInitRankConfig"), w.Calls("ncclCommSplit")
	nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nb := nc.Backend().(*Backend)
	if mk := nb.Creation(); mk.How != localHow || nb.ctl != 0 || nb.data != 0 {
		t.Fatalf("shrunk to one rank: %+v, control comm %#x, data comm %#x; want %q and no NCCL comm", mk, nb.ctl, nb.data, localHow)
	}
	for _, call := range []string{"ncclCommShrink", "ncclCommShrink(abort)"} {
		if n := w.Calls(call); n != 0 {
			t.Errorf("%s called %d times on the way to one rank", call, n)
		}
	}
	if n := w.Calls("ncclCommSplit") - splits; n != 0 {
		t.Errorf("ncclCommSplit called %d times on the way to one rank", n)
	}
	if n := w.Calls("ncclCommInitRankConfig") - inits; n != 0 {
		t.Errorf("%d NCCL comms initialised on the way to one rank", n)
	}
	eventually(t, "the old data and control comms to be aborted", func() bool { return w.Calls("ncclCommAbort")-aborts == 2 })
	eventually(t, "the old comm's stream to drain", func() bool { return w.StreamIdle(uintptr(old.stream)) })

	one := []*rank{{r: 0, c: nc, L: ranks[0].L, dev: 0}}
	collectiveSuite(t, ctx, one, []comm.DType{comm.Float32, comm.Int64, comm.Float16}, 5, 11)

	sub, err := nc.Split(ctx, 7, 0)
	if err != nil || sub == nil || sub.Size() != 1 || sub.Backend().(*Backend).Creation().How != localHow {
		t.Fatalf("split of the one-rank comm: %v, %v", sub, err)
	}
	collectiveSuite(t, ctx, []*rank{{r: 0, c: sub, L: ranks[0].L, dev: 0}}, []comm.DType{comm.Int32}, 3, 12)
	sub.Close()
	if none, err := nc.Split(ctx, comm.NoColor, 0); none != nil || err != nil {
		t.Fatalf("split with NoColor: %v, %v; want nothing", none, err)
	}

	// A replica comes back: a fresh init with the joiner, a data comm again.
	grown := growWithJoiner(t, ctx, w, nc, joiner, joinerCfg)
	t.Cleanup(func() { closeJob(t, grown) })
	collectiveSuite(t, ctx, grown, []comm.DType{comm.Float32}, 4, 13)
}

// The local one-rank comm's stream runs nothing before the old comm's
// work is over: here nothing failed (a peer left in good order) and rank
// 0's all-reduce with rank 1 is still waiting for rank 1 when rank 0
// shrinks; the copy enqueued on the one-rank comm stays queued until
// rank 1 posts, and then both are right.
func TestLocalOneRankOrderedAfterTheOldStream(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", nil)
	t.Cleanup(func() { closeJob(t, ranks) })
	x0, err := ranks[0].alloc(comm.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	x1, err := ranks[1].alloc(comm.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	in, out := ranks[0].mustAlloc(t, comm.Float32, 4), ranks[0].mustAlloc(t, comm.Float32, 4)
	for _, d := range []*devBuf{x0, x1, in, out} {
		t.Cleanup(func() { d.b.Free() })
	}
	if err := x0.set(ctx, []float64{1, 2, 3, 4}); err != nil {
		t.Fatal(err)
	}
	if err := x1.set(ctx, []float64{10, 20, 30, 40}); err != nil {
		t.Fatal(err)
	}
	if err := in.set(ctx, []float64{5, 6, 7, 8}); err != nil {
		t.Fatal(err)
	}
	if err := out.poison(ctx); err != nil {
		t.Fatal(err)
	}
	pending := ranks[0].c.AllReduceAsync(ctx, x0.t(), comm.Sum)
	b := ranks[0].c.Backend().(*Backend)
	eventually(t, "rank 0's all-reduce to be running", b.opActive.Load)
	nbb, err := b.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	nb := nbb.(*Backend)
	t.Cleanup(func() { nb.Close(); waitReleased(t, nb) })
	a := libapi.CollArgs{Kind: libapi.AllGather, Type: libapi.Float32, Send: in.t().Ptr(), Recv: out.t().Ptr(), Count: 4}
	if err := nb.launch(ctx, "allgather", &a, nil); err != nil {
		t.Fatal(err)
	}
	if idle, err := nb.lib.StreamQuery(nb.dev, nb.stream); err != nil || idle {
		t.Fatalf("the one-rank comm's stream idle %v (%v) while the old comm's all-reduce waits for rank 1: it ran out of order", idle, err)
	}
	if err := ranks[1].c.AllReduce(ctx, x1.t(), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if err := pending.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the one-rank comm's copy", func() bool { idle, _ := nb.lib.StreamQuery(nb.dev, nb.stream); return idle })
	for _, c := range []struct {
		d    *devBuf
		want []float64
	}{{x0, []float64{11, 22, 33, 44}}, {out, []float64{5, 6, 7, 8}}} {
		got, err := c.d.get(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := compareVals(got, c.want, 0); err != nil {
			t.Fatal(err)
		}
	}
}

// A group's sends to itself on a one-rank comm pair with its receives in
// order (the grouped sends and receives of AllToAll, Gather and Scatter
// without NCCL's own calls); a send without its receive, which NCCL would
// leave waiting, and a pair that differs are refused, and the comm stays
// usable.
func TestLocalOneRankSendsPairWithReceives(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", nil)
	t.Cleanup(func() { closeJob(t, ranks[1:]) })
	nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	ranks[0].c.Close()
	ranks[0].c = nc
	t.Cleanup(func() { closeJob(t, ranks[:1]) })
	nb := nc.Backend().(*Backend)
	a, b := ranks[0].mustAlloc(t, comm.Float32, 4), ranks[0].mustAlloc(t, comm.Float32, 4)
	c, d := ranks[0].mustAlloc(t, comm.Float32, 3), ranks[0].mustAlloc(t, comm.Float32, 3)
	for _, x := range []*devBuf{a, b, c, d} {
		t.Cleanup(func() { x.b.Free() })
	}
	if err := a.set(ctx, []float64{1, 2, 3, 4}); err != nil {
		t.Fatal(err)
	}
	if err := c.set(ctx, []float64{7, 8, 9}); err != nil {
		t.Fatal(err)
	}
	send := func(x *devBuf, n uint64) libapi.CollArgs {
		return libapi.CollArgs{Kind: libapi.Send, Type: libapi.Float32, Send: x.t().Ptr(), Count: n}
	}
	recv := func(x *devBuf, n uint64) libapi.CollArgs {
		return libapi.CollArgs{Kind: libapi.Recv, Type: libapi.Float32, Recv: x.t().Ptr(), Count: n}
	}
	if err := nb.launch(ctx, "group", nil, []libapi.CollArgs{send(a, 4), send(c, 3), recv(b, 4), recv(d, 3)}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	for _, x := range []struct {
		d    *devBuf
		want []float64
	}{{b, []float64{1, 2, 3, 4}}, {d, []float64{7, 8, 9}}} {
		got, err := x.d.get(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := compareVals(got, x.want, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := nb.launch(ctx, "group", nil, []libapi.CollArgs{send(a, 4)}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("a lone send to itself: %v, want ErrInvalidArgument", err)
	}
	if err := nb.launch(ctx, "group", nil, []libapi.CollArgs{send(a, 4), recv(d, 3)}); !errors.Is(err, comm.ErrMismatch) {
		t.Fatalf("a send of 4 to a receive of 3: %v, want ErrMismatch", err)
	}
	if err := nc.Barrier(ctx); err != nil {
		t.Fatalf("after the refusals: %v", err)
	}
}

// mustAlloc allocates n elements of dt on the rank's device.
func (rk *rank) mustAlloc(t *testing.T, dt comm.DType, n int) *devBuf {
	t.Helper()
	d, err := rk.alloc(dt, n)
	if err != nil {
		t.Fatal(err)
	}
	return d
}
