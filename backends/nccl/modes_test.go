package nccl

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl/ncclsim"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// These tests check how each Mode uses NCCL comms, and that no call waits
// past its deadline when ranks die during a reconfiguration, against the
// Simulation.

func TestModes(t *testing.T) {
	for _, tc := range []struct {
		mode              Mode
		commsPerRank      int
		blocking, nonbloc bool // collectives enqueued on blocking / nonblocking comms
	}{
		{ModeBlockingData, 2, true, true}, // p2p ops go to the control comm
		{ModeNonblocking, 1, false, true},
		{ModeBlocking, 1, true, false},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			ctx := testCtx(t)
			w := newFakeWorld(t, 3)
			w.SetInProgressPolls(2)
			ranks := startJob(t, ctx, simLibrary(w), devs(3), 1, "job", func(c *Config, o *comm.Options) { c.Mode = tc.mode })
			if n := w.LiveComms(); n != 3*tc.commsPerRank {
				t.Errorf("%d NCCL comms for 3 ranks, want %d", n, 3*tc.commsPerRank)
			}
			collectiveSuite(t, ctx, ranks, []comm.DType{comm.Float32, comm.Int32}, 5, 7)
			if got := w.Calls("enqueue(blocking)") > 0; got != tc.blocking {
				t.Errorf("ops enqueued on blocking comms: %v, want %v", got, tc.blocking)
			}
			if got := w.Calls("enqueue(nonblocking)") > 0; got != tc.nonbloc {
				t.Errorf("ops enqueued on nonblocking comms: %v, want %v", got, tc.nonbloc)
			}
			// Reconfiguration works in every mode: 3 → 2 → split → grow back.
			survivors := []*rank{ranks[0], ranks[1]}
			each(t, survivors, func(rk *rank) error {
				nc, err := rk.c.Shrink(ctx, []int{2}, 2)
				rk.c = nc
				return err
			})
			ranks[2].c.Close()
			collectiveSuite(t, ctx, survivors, []comm.DType{comm.Float32}, 4, 8)
			closeJob(t, survivors)
			if n := w.LiveComms(); n != 0 {
				t.Errorf("%d NCCL comms alive after every Close", n)
			}
		})
	}
	if _, err := ParseMode("blocking-data"); err != nil {
		t.Error(err)
	}
	if _, err := ParseMode("fast"); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("ParseMode(fast) = %v", err)
	}
	if err := (&Config{Mode: 9}).Validate(); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("mode 9: %v", err)
	}
}

func TestCommBlockingEnvRefused(t *testing.T) {
	w := newFakeWorld(t, 1)
	for _, tc := range []struct {
		env  string
		mode Mode
		ok   bool
	}{
		{"1", ModeBlockingData, false}, {"0", ModeBlockingData, false}, {"1", ModeNonblocking, false},
		{"0", ModeNonblocking, true}, {"1", ModeBlocking, true}, {"", ModeBlockingData, true},
	} {
		t.Setenv(envCommBlocking, tc.env)
		c, err := New(testCtx(t), comm.Options{Rank: 0, Size: 1, BackendConfig: &Config{Library: simLibrary(w), Mode: tc.mode}})
		if ok := err == nil; ok != tc.ok || (!ok && !errors.Is(err, comm.ErrInvalidArgument)) {
			t.Errorf("%s=%q, mode %s: %v", envCommBlocking, tc.env, tc.mode, err)
		}
		if c != nil {
			c.Close()
			<-c.Released()
		}
	}
}

// TestBlockingDataFailureShrink: a collective stuck on the blocking data
// comm fails at Revoke; Shrink hands the data comm to the watchdog, which
// aborts it (its kernels end) while the control comm shrinks with
// NCCL_SHRINK_ABORT. The survivor's one-rank comm has no data comm of its
// own (no split on the way to it) and works; grown back to two ranks it
// has a blocking data comm again.
func TestBlockingDataFailureShrink(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 3)
	var joiner comm.Options // rank 0's, for the joiner of the grow below
	var joinerCfg Config
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
		c.DisableLocalOneRank = true // the NCCL comm of one rank (TestLocalOneRankShrink: without)
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
	aborts, splits := w.Calls("ncclCommAbort"), w.Calls("ncclCommSplit")
	nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if n := w.Calls("ncclCommShrink(abort)"); n != 1 {
		t.Errorf("ncclCommShrink with NCCL_SHRINK_ABORT called %d times, want 1", n)
	}
	if n := w.Calls("ncclCommSplit") - splits; n != 0 {
		t.Errorf("the shrink to one rank split %d data comms, want none", n)
	}
	eventually(t, "the old data comm to be aborted", func() bool { return w.Calls("ncclCommAbort") > aborts })
	eventually(t, "the old comm's stream to drain", func() bool { return w.StreamIdle(uintptr(old.stream)) })
	nb := nc.Backend().(*Backend)
	if nb.data != nb.ctl || nb.dataBlocking {
		t.Errorf("one-rank comm: data comm %#x (blocking %v), control comm %#x: want the control comm for both",
			nb.data, nb.dataBlocking, nb.ctl)
	}
	if nb.dirty.Load() {
		t.Error("the shrunk comm is marked dirty: NCCL_SHRINK_ABORT ended every kernel it had")
	}
	x, err := ranks[0].alloc(comm.Float32, 8)
	if err != nil {
		t.Fatal(err)
	}
	defer x.b.Free()
	if err := nc.AllReduce(ctx, x.t(), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if err := nc.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
	// A replica comes back: grown to two ranks, the comm splits a data comm again.
	grown := growWithJoiner(t, ctx, w, nc, joiner, joinerCfg)
	for _, rk := range grown {
		b := rk.c.Backend().(*Backend)
		if b.data == 0 || b.data == b.ctl || !b.dataBlocking {
			t.Errorf("rank %d of two after the grow: data comm %#x (blocking %v), control comm %#x: want a blocking data comm of its own",
				rk.r, b.data, b.dataBlocking, b.ctl)
		}
	}
	collectiveSuite(t, ctx, grown, []comm.DType{comm.Float32}, 3, 5)
	closeJob(t, grown)
}

// TestNoHangWhenPeersDieDuringReconfiguration: every Shrink, Grow and
// New returns by its ctx's deadline when a rank dies in the middle of it,
// and the comms it leaves are released.
func TestNoHangWhenPeersDieDuringReconfiguration(t *testing.T) {
	const deadline = 200 * time.Millisecond
	// run starts fn on the survivor with a ctx of deadline and checks it
	// fails with ErrTimeout within a generous bound.
	run := func(t *testing.T, what string, fn func(ctx context.Context) error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		t0 := time.Now()
		err := fn(ctx)
		if !errors.Is(err, comm.ErrTimeout) {
			t.Fatalf("%s: %v, want ErrTimeout", what, err)
		}
		if el := time.Since(t0); el > deadline+5*time.Second {
			t.Errorf("%s returned %s after its deadline", what, el-deadline)
		}
	}
	for _, tc := range []struct {
		name, call string // the call in which the second rank dies
		dev        int
		split      bool // the shrink splits the data comm off the control comm
	}{
		{"second death in shrink", "ncclCommShrink", 1, false},
		{"second death in the data comm's split", "ncclCommSplit", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			w := newFakeWorld(t, 3)
			ranks := startJob(t, ctx, simLibrary(w), devs(3), 1, "job", func(c *Config, o *comm.Options) {
				c.ReleaseTimeout = 50 * time.Millisecond
				c.DisableShrinkToData = tc.split
			})
			x, err := ranks[0].alloc(comm.Float32, 16)
			if err != nil {
				t.Fatal(err)
			}
			y, err := ranks[1].alloc(comm.Float32, 16)
			if err != nil {
				t.Fatal(err)
			}
			w.Kill(2)
			wx := ranks[0].c.AllReduceAsync(ctx, x.t(), comm.Sum)
			wy := ranks[1].c.AllReduceAsync(ctx, y.t(), comm.Sum)
			for _, rk := range ranks[:2] {
				rk.c.Revoke(errors.New("membership: rank 2 died"))
			}
			if err := errors.Join(wx.Wait(ctx), wy.Wait(ctx)); !errors.Is(err, comm.ErrRevoked) {
				t.Fatalf("ops after Revoke: %v", err)
			}
			w.KillDuring(tc.call, tc.dev)
			var wg sync.WaitGroup
			wg.Go(func() { // rank 1, whose process dies in the call
				dctx, cancel := context.WithTimeout(ctx, deadline)
				defer cancel()
				if nc, err := ranks[1].c.Shrink(dctx, []int{2}, 2); err == nil {
					nc.Close()
				}
			})
			run(t, "rank 0's Shrink", func(ctx context.Context) error {
				nc, err := ranks[0].c.Shrink(ctx, []int{2}, 2)
				if err == nil {
					nc.Close()
				}
				return err
			})
			wg.Wait()
			// Close releases every comm, the stuck data comms included.
			b0 := ranks[0].c.Backend().(*Backend)
			ranks[0].c.Close()
			waitReleased(t, b0)
			for _, b := range []*DeviceBuffer{x.b, y.b} {
				b.Free()
			}
		})
	}
	t.Run("joiner dies in grow", func(t *testing.T) {
		ctx := testCtx(t)
		w := newFakeWorld(t, 2)
		L := simLibrary(w)
		store := memstore.New()
		defer store.Close()
		c, err := comm.New(ctx, "nccl", comm.Options{Name: "g", Rank: 0, Size: 1, Epoch: 1, Store: store,
			BackendConfig: &Config{Library: L}})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		// The joiner never comes (its process died before init).
		inits := w.Calls("ncclCommInitRankConfig")
		run(t, "Grow", func(ctx context.Context) error {
			nc, err := c.Grow(ctx, 2, 2)
			if err == nil {
				nc.Close()
			}
			return err
		})
		if w.Calls("ncclCommInitRankConfig") != inits+1 {
			t.Errorf("grow made %d inits, want 1", w.Calls("ncclCommInitRankConfig")-inits)
		}
		// The half-made comm was aborted: only the 1-rank comm remains
		// (one rank has no data comm of its own).
		if n := w.LiveComms(); n != 1 {
			t.Errorf("%d NCCL comms alive, want 1", n)
		}
	})
	t.Run("peer dies during init", func(t *testing.T) {
		w := newFakeWorld(t, 2)
		store := memstore.New()
		defer store.Close()
		w.KillDuring("ncclCommSplit", 1)
		L := simLibrary(w)
		var wg sync.WaitGroup
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), deadline)
			defer cancel()
			if c, err := comm.New(ctx, "nccl", comm.Options{Rank: 1, Size: 2, Device: 1, Store: store,
				BackendConfig: &Config{Library: L}}); err == nil {
				c.Close()
			}
		})
		run(t, "New", func(ctx context.Context) error {
			c, err := comm.New(ctx, "nccl", comm.Options{Rank: 0, Size: 2, Store: store, BackendConfig: &Config{Library: L}})
			if err == nil {
				c.Close()
			}
			return err
		})
		wg.Wait()
		eventually(t, "every comm to be aborted", func() bool { return w.LiveComms() == 0 })
	})
}

// TestCreationReportsPhases: every comm says how it was made and what
// each phase took (the fault path's breakdown on GPUs reads it).
func TestCreationReportsPhases(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 3)
	w.SetInProgressPolls(2)
	ranks := startJob(t, ctx, simLibrary(w), devs(3), 1, "job", nil)
	for _, rk := range ranks {
		m := rk.c.Backend().(*Backend).Creation()
		if m.How != "ncclCommInitRankConfig" || m.Call <= 0 || m.DataSplit <= 0 || m.WarmUp <= 0 ||
			m.Total < m.Call+m.Ready+m.DataSplit+m.WarmUp {
			t.Errorf("rank %d: made %+v", rk.r, m)
		}
	}
	survivors := ranks[:2]
	each(t, survivors, func(rk *rank) error {
		nc, err := rk.c.Shrink(ctx, []int{2}, 2)
		if err == nil {
			rk.c = nc
		}
		return err
	})
	ranks[2].c.Close()
	for _, rk := range survivors {
		m := rk.c.Backend().(*Backend).Creation()
		if m.How != "ncclCommShrink → data comm" || m.Ready <= 0 || m.DataSplit != 0 ||
			m.Total < m.Agree+m.Call+m.Ready+m.WarmUp {
			t.Errorf("rank %d: shrunk comm made %+v", rk.r, m)
		}
	}
}

// growWithJoiner grows the one-rank comm nc back to two ranks at epoch 3
// with a joiner on device 2, made with rank 0's options and config as the
// job started them; it returns the two ranks.
func growWithJoiner(t *testing.T, ctx context.Context, w *ncclsim.Simulation, nc *comm.Comm, joiner comm.Options, cfg Config) []*rank {
	t.Helper()
	joiner.Rank, joiner.Size, joiner.Epoch, joiner.Device, joiner.BackendConfig = 1, 2, 3, 2, &cfg
	grown := []*rank{{r: 0, L: simLibrary(w), dev: 0}, {r: 1, L: simLibrary(w), dev: 2}}
	each(t, grown, func(rk *rank) error {
		var err error
		if rk.r == 1 {
			rk.c, err = comm.New(ctx, "nccl", joiner)
		} else {
			rk.c, err = nc.Grow(ctx, 2, 3)
		}
		return err
	})
	return grown
}
