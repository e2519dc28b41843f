package nccl

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/backends/nccl/ncclsim"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
	"github.com/ftcomm/ftcomm/internal/testutil"
)

// These tests run everywhere: the library is the simulation (package ncclsim).

func testCtx(t *testing.T) context.Context { return testutil.Ctx(t, 60*time.Second) }

func devs(n int) []int {
	d := make([]int, n)
	for i := range d {
		d[i] = i
	}
	return d
}

// eventually waits for cond with a deadline, checking it every millisecond.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestOpenWithoutLibrary(t *testing.T) {
	_, err := Open(LibraryConfig{NCCLPath: "/nonexistent/libnccl.so.2"})
	if !errors.Is(err, comm.ErrBackendUnavailable) {
		t.Fatalf("Open: %v, want ErrBackendUnavailable", err)
	}
	if !strings.Contains(err.Error(), "/nonexistent/libnccl.so.2") {
		t.Errorf("error %q does not carry the loader's message", err)
	}
	// The registered factory fails the same way, through comm.New.
	_, err = comm.New(context.Background(), "nccl", comm.Options{Rank: 0, Size: 1,
		BackendConfig: &Config{LibraryConfig: LibraryConfig{NCCLPath: "/nonexistent/libnccl.so.2"}}})
	if !errors.Is(err, comm.ErrBackendUnavailable) {
		t.Fatalf("comm.New: %v, want ErrBackendUnavailable", err)
	}
}

func TestOpenEnvOverride(t *testing.T) {
	t.Setenv(EnvNCCLLib, "/nonexistent/from-env/libnccl.so.2")
	_, err := Open(LibraryConfig{})
	if !errors.Is(err, comm.ErrBackendUnavailable) || !strings.Contains(err.Error(), "from-env") {
		t.Fatalf("Open with %s set: %v", EnvNCCLLib, err)
	}
}

func TestConfig(t *testing.T) {
	d := DefaultConfig()
	if err := d.Validate(); err != nil {
		t.Fatalf("default config invalid: %v", err)
	}
	for name, c := range map[string]Config{
		"revoke mode":  {Revoke: 7},
		"spin > yield": {SpinWait: time.Second, YieldWait: time.Millisecond},
		"poll":         {PollInterval: -1},
		"watchdog":     {WatchdogInterval: time.Hour},
		"release":      {ReleaseTimeout: -time.Second},
	} {
		if err := c.Validate(); !errors.Is(err, comm.ErrInvalidArgument) {
			t.Errorf("%s: Validate = %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, err := configFrom(42); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("configFrom(int) = %v", err)
	}
	c, err := configFrom(&Config{SpinWait: time.Microsecond})
	if err != nil || c.SpinWait != time.Microsecond || c.YieldWait != d.YieldWait {
		t.Errorf("configFrom fills defaults: %+v, %v", c, err)
	}
}

func TestVersionFeatures(t *testing.T) {
	all := []string{"ncclCommSplit", "ncclCommShrink", "ncclCommRevoke", "ncclCommGrow", "ncclCommGetUniqueId",
		"ncclAlltoAll", "ncclGather", "ncclScatter"}
	for _, tc := range []struct {
		code int
		want Features
	}{
		{22803, Features{Split: true, Shrink: true, AllToAll: true, Gather: true, Scatter: true}},
		{22809, Features{Split: true, Shrink: true, Revoke: true, AllToAll: true, Gather: true, Scatter: true}},
		{22902, Features{Split: true, Shrink: true, Revoke: true, Grow: true, AllToAll: true, Gather: true, Scatter: true}},
		{22605, Features{Split: true}},
	} {
		L := simLibrary(newFakeWorld(t, 1).WithVersion(tc.code, all...))
		if got := L.Info().Features; got != tc.want {
			t.Errorf("NCCL %d: features %+v, want %+v", tc.code, got, tc.want)
		}
	}
	if v := versionFromCode(22803); v != (Version{2, 28, 3}) || v.String() != "2.28.3" || !v.AtLeast(2, 27, 3) || v.AtLeast(2, 28, 7) {
		t.Errorf("versionFromCode(22803) = %v", v)
	}
	if v := versionFromCode(2708); v != (Version{2, 7, 8}) {
		t.Errorf("versionFromCode(2708) = %v", v)
	}
	// A library without symbols gets no features whatever its version.
	L := simLibrary(newFakeWorld(t, 1).WithVersion(23000))
	if got := L.Info().Features; got != (Features{}) {
		t.Errorf("no symbols: %+v", got)
	}
	if s := L.Info().String(); !strings.Contains(s, "NCCL 3.0.0") && !strings.Contains(s, "2.30.0") {
		t.Errorf("Info.String() = %q", s)
	}
}

func TestRecord(t *testing.T) {
	var id libapi.UniqueID
	for i := range id {
		id[i] = byte(i)
	}
	kind, size, got, err := decodeRecord(encodeRecord(recGrow, 5, &id))
	if err != nil || kind != recGrow || size != 5 || got != id {
		t.Fatalf("round trip: %d %d %v", kind, size, err)
	}
	if _, _, _, err := decodeRecord([]byte("garbage")); !errors.Is(err, comm.ErrMismatch) {
		t.Errorf("garbage: %v", err)
	}
}

func TestDeviceMemory(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	L := simLibrary(w)
	buf, err := L.Alloc(1, 64)
	if err != nil {
		t.Fatal(err)
	}
	want := []byte("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
	if err := buf.CopyFromHost(ctx, want); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 64)
	if err := buf.CopyToHost(ctx, got); err != nil || string(got) != string(want) {
		t.Fatalf("round trip: %q, %v", got, err)
	}
	if err := buf.Fill(ctx, 'x'); err != nil {
		t.Fatal(err)
	}
	if err := L.CopyFromDevice(ctx, got[:8], buf.Tensor(comm.Float32).Slice(2, 2)); err != nil || string(got[:8]) != "xxxxxxxx" {
		t.Fatalf("fill: %q, %v", got[:8], err)
	}
	if tt := buf.Tensor(comm.Float32); tt.Count() != 16 || tt.Device() != 1 || tt.Ptr() != buf.Ptr() {
		t.Errorf("tensor view %v", tt)
	}
	if err := buf.CopyFromHost(ctx, make([]byte, 65)); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("oversized copy: %v", err)
	}
	if err := L.CopyToDevice(ctx, comm.Float32s(make([]float32, 2)), make([]byte, 8)); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("host tensor as destination: %v", err)
	}
	s, err := L.NewStream(1)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := L.NewEvent(1, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CopyToDevice(buf.Tensor(comm.Uint8).Slice(0, 4), []byte("abcd")); err != nil {
		t.Fatal(err)
	}
	if err := ev.Record(s); err != nil {
		t.Fatal(err)
	}
	if err := ev.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(ctx); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(ev.Close(), s.Close(), buf.Free(), buf.Free(), L.Release()); err != nil {
		t.Fatal(err)
	}
	if _, err := L.Alloc(5, 8); err == nil {
		t.Error("alloc on a device that does not exist succeeded")
	}
}

func TestCollectives(t *testing.T) {
	for _, tc := range []struct {
		name  string
		size  int
		ver   int
		syms  []string
		force bool
	}{
		{name: "2ranks-native", size: 2},
		{name: "3ranks-native", size: 3},
		{name: "3ranks-fallback-forced", size: 3, force: true},
		{name: "2ranks-nccl2.26", size: 2, ver: 22605, syms: []string{"ncclCommSplit"}},
		{name: "1rank", size: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			w := newFakeWorld(t, tc.size)
			w.SetInProgressPolls(2)
			if tc.ver != 0 {
				w.WithVersion(tc.ver, tc.syms...)
			}
			ranks := startJob(t, ctx, simLibrary(w), devs(tc.size), 1, "job", func(c *Config, o *comm.Options) {
				c.DisableNativeCollectives = tc.force
				o.Timeout = 10 * time.Second
			})
			collectiveSuite(t, ctx, ranks, []comm.DType{comm.Float32, comm.BFloat16, comm.Float16, comm.Int32, comm.Int8,
				comm.Uint8, comm.Int64, comm.Float64}, 5, 1)
			native := w.Calls("ncclAlltoAll") > 0
			if wantNative := tc.ver == 0 && !tc.force; native != wantNative {
				t.Errorf("ncclAlltoAll used: %v, want %v", native, wantNative)
			}
		})
	}
}

func TestInvalidArguments(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", nil)
	b := ranks[0].c.Backend().(*Backend)
	other, err := ranks[1].alloc(comm.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	defer other.b.Free()
	for name, err := range map[string]error{
		"host tensor":    b.AllReduce(ctx, comm.Float32s(make([]float32, 4)), comm.Sum),
		"other device":   b.AllReduce(ctx, other.t(), comm.Sum),
		"avg on ints":    b.AllReduce(ctx, other.b.Tensor(comm.Int32), comm.Avg),
		"no tensor":      b.Broadcast(ctx, comm.Tensor{}, 0),
		"bad peer":       b.Send(ctx, b.L.mustScratch(t, 0), 0),
		"shrink self":    shrinkErr(b.Shrink(ctx, []int{0}, 2)),
		"grow smaller":   shrinkErr(b.Grow(ctx, 1, 2)),
		"comm host mem":  ranks[0].c.AllReduce(ctx, comm.Float32s(make([]float32, 4)), comm.Sum),
		"alltoallv self": b.AllToAllV(ctx, b.L.mustScratch(t, 0), []int{1, 0}, b.L.mustScratch(t, 0), []int{2, 0}),
	} {
		if !errors.Is(err, comm.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
	// The comm is still usable.
	each(t, ranks, func(rk *rank) error { return rk.c.Barrier(ctx) })
}

func shrinkErr(_ comm.Backend, err error) error { return err }

// mustScratch allocates a small device tensor for argument tests.
func (l *Library) mustScratch(t *testing.T, dev int) comm.Tensor {
	b, err := l.Alloc(dev, 64)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Free() })
	return b.Tensor(comm.Float32)
}

// stuckAllReduce starts an all-reduce on rank 0 whose peer (rank 1, on a
// killed device) never joins, and returns its Work once the op is running.
func stuckAllReduce(t *testing.T, ctx context.Context, w *ncclsim.Simulation, ranks []*rank) (*comm.Work, *devBuf) {
	x, err := ranks[0].alloc(comm.Float32, 16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Free only after the comm released its stream (the op uses x).
		b := ranks[0].c.Backend().(*Backend)
		ranks[0].c.Close()
		waitReleased(t, b)
		x.b.Free()
	})
	w.Kill(ranks[1].dev)
	work := ranks[0].c.AllReduceAsync(ctx, x.t(), comm.Sum)
	b := ranks[0].c.Backend().(*Backend)
	eventually(t, "the op to be running", b.opActive.Load)
	return work, x
}

func TestRevokeThenShrink(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond // the dead rank's stream never drains
		c.DisableLocalOneRank = true             // ncclCommShrink to one rank, not device copies
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks)
	t0 := time.Now()
	ranks[0].c.Revoke(errors.New("membership: rank 1 left"))
	err := work.Wait(ctx)
	if !errors.Is(err, comm.ErrRevoked) {
		t.Fatalf("stuck op after Revoke: %v, want ErrRevoked", err)
	}
	t.Logf("op failed %s after Revoke", time.Since(t0))

	nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	if nc.Size() != 1 || nc.Rank() != 0 || nc.Epoch() != 2 {
		t.Fatalf("shrunk comm: rank %d size %d epoch %d", nc.Rank(), nc.Size(), nc.Epoch())
	}
	if n := w.Calls("ncclCommShrink(abort)"); n != 1 {
		t.Errorf("ncclCommShrink with NCCL_SHRINK_ABORT called %d times, want 1", n)
	}
	ranks[0] = &rank{r: 0, c: nc, L: ranks[0].L, dev: 0}
	collectiveSuite(t, ctx, ranks[:1], []comm.DType{comm.Float32}, 4, 2)
}

func TestDeadlineWithoutNotification(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
		o.Timeout = 100 * time.Millisecond
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks)
	if err := work.Wait(ctx); !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("stuck op: %v, want ErrTimeout", err)
	}
	if err := ranks[0].c.Barrier(ctx); !errors.Is(err, comm.ErrAborted) {
		t.Errorf("op after the timeout: %v, want ErrAborted", err)
	}
	// Close releases the comm: ncclCommAbort, the stream drains, memory freed.
	b := ranks[0].c.Backend().(*Backend)
	ranks[0].c.Close()
	waitReleased(t, b)
	if err := b.ReleaseErr(); err != nil {
		t.Errorf("release: %v", err)
	}
	if n := w.Calls("ncclCommAbort"); n < 1 {
		t.Errorf("ncclCommAbort called %d times", n)
	}
}

func TestPeerNeverPosts(t *testing.T) {
	// Both ranks alive; rank 1 skips an op. Rank 0 times out, both close
	// cleanly, and the devices serve a new comm.
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	L := simLibrary(w)
	ranks := startJob(t, ctx, L, devs(2), 1, "job", func(c *Config, o *comm.Options) { o.Timeout = 100 * time.Millisecond })
	x, err := ranks[0].alloc(comm.Float32, 8)
	if err != nil {
		t.Fatal(err)
	}
	if err := ranks[0].c.AllReduce(ctx, x.t(), comm.Sum); !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("all-reduce without its peer: %v, want ErrTimeout", err)
	}
	closeJob(t, ranks)
	x.b.Free()
	if n := w.LiveComms(); n != 0 {
		t.Errorf("%d NCCL comms still alive after Close", n)
	}
	again := startJob(t, ctx, L, devs(2), 2, "job", nil)
	collectiveSuite(t, ctx, again, []comm.DType{comm.Float32}, 3, 3)
}

func TestAsyncErrorFailsOp(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks)
	w.InjectAsyncError(0, int(libapi.RemoteError))
	if err := work.Wait(ctx); !errors.Is(err, comm.ErrPeerFailed) {
		t.Fatalf("op after ncclRemoteError: %v, want ErrPeerFailed", err)
	}
}

func TestAbortDelay(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
		c.AbortDelay = 20 * time.Millisecond
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks)
	ranks[0].c.Abort(errors.New("test"))
	if err := work.Wait(ctx); !errors.Is(err, comm.ErrAborted) {
		t.Fatalf("op after Abort: %v", err)
	}
	eventually(t, "the watchdog to abort the NCCL comm", func() bool { return w.Calls("ncclCommAbort") > 0 })
	// The NCCL comm is gone, so Shrink falls back to a fresh init.
	nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if w.Calls("ncclCommShrink(abort)")+w.Calls("ncclCommShrink") != 0 {
		t.Error("ncclCommShrink on an aborted comm")
	}
	if err := nc.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
}

// The survivors choose between ncclCommShrink and a fresh init together:
// here rank 0's NCCL comm is gone (the watchdog aborted it) while rank
// 2's is whole. Rank 2 shrinks natively at once, as every survivor that
// can does; rank 0 says it cannot (freshKey), and rank 2 abandons its
// shrink, which could not complete without rank 0, for a fresh init with
// it. Had rank 2 not heard, it would wait in ncclCommShrink for a rank 0
// that initialises a fresh comm, until the Timeout.
func TestShrinkChoiceIsCollective(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 3)
	ranks := startJob(t, ctx, simLibrary(w), devs(3), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
		c.AbortDelay = 20 * time.Millisecond
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks) // rank 1's GPU is dead
	ranks[0].c.Abort(errors.New("test"))
	if err := work.Wait(ctx); !errors.Is(err, comm.ErrAborted) {
		t.Fatalf("op after Abort: %v", err)
	}
	eventually(t, "the watchdog to abort rank 0's NCCL comm", func() bool { return w.Calls("ncclCommAbort") > 0 })
	inits := w.Calls("ncclCommInitRankConfig")
	gctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	survivors := []*rank{ranks[0], ranks[2]}
	each(t, survivors, func(rk *rank) error {
		nc, err := rk.c.Shrink(gctx, []int{1}, 2)
		if nc != nil {
			rk.c = nc
		}
		return err
	})
	ranks[2].r = 1
	// Rank 2 shrinks natively at once and abandons it on rank 0's word.
	for _, rk := range survivors {
		if how := rk.c.Backend().(*Backend).Creation().How; how != "fresh init" {
			t.Errorf("survivor %d's comm made by %q; both survivors should have initialised a fresh comm", rk.r, how)
		}
	}
	if n := w.Calls("ncclCommShrink") + w.Calls("ncclCommShrink(abort)"); n > 1 {
		t.Errorf("ncclCommShrink called %d times: only rank 2 could", n)
	}
	if got := w.Calls("ncclCommInitRankConfig") - inits; got != 2 {
		t.Errorf("%d fresh inits, want 2", got)
	}
	each(t, survivors, func(rk *rank) error { return rk.c.Barrier(ctx) })
}

func TestNativeRevoke(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2).WithVersion(22809, "ncclCommSplit", "ncclCommShrink", "ncclCommRevoke", "ncclAlltoAll", "ncclGather", "ncclScatter")
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.Revoke = RevokeNative
		c.ReleaseTimeout = 50 * time.Millisecond
		c.DisableLocalOneRank = true // ncclCommShrink to one rank, not device copies
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks)
	ranks[0].c.Revoke(errors.New("test"))
	if err := work.Wait(ctx); !errors.Is(err, comm.ErrRevoked) {
		t.Fatalf("op after Revoke: %v", err)
	}
	eventually(t, "ncclCommRevoke", func() bool { return w.Calls("ncclCommRevoke") > 0 })
	nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if w.Calls("ncclCommShrink") != 1 || w.Calls("ncclCommShrink(abort)") != 0 {
		t.Errorf("after a native revoke Shrink should use NCCL_SHRINK_DEFAULT: default %d, abort %d",
			w.Calls("ncclCommShrink"), w.Calls("ncclCommShrink(abort)"))
	}
	if err := nc.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestNativeRevokeUnavailableAborts(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.Revoke = RevokeNative
		c.ReleaseTimeout = 50 * time.Millisecond
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks)
	ranks[0].c.Revoke(errors.New("test"))
	if err := work.Wait(ctx); !errors.Is(err, comm.ErrRevoked) {
		t.Fatalf("op after Revoke: %v", err)
	}
	eventually(t, "ncclCommAbort", func() bool { return w.Calls("ncclCommAbort") > 0 })
	nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if err := nc.Barrier(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestShrinkHealthyAndFallback(t *testing.T) {
	for _, fallback := range []bool{false, true} {
		t.Run(map[bool]string{false: "native", true: "fallback"}[fallback], func(t *testing.T) {
			ctx := testCtx(t)
			w := newFakeWorld(t, 3)
			ranks := startJob(t, ctx, simLibrary(w), devs(3), 1, "job", func(c *Config, o *comm.Options) {
				c.DisableNativeShrink = fallback
			})
			inits := w.Calls("ncclCommInitRankConfig")
			// Rank 1 leaves; 0 and 2 shrink (no failure: NCCL_SHRINK_DEFAULT).
			survivors := []*rank{ranks[0], ranks[2]}
			each(t, survivors, func(rk *rank) error {
				nc, err := rk.c.Shrink(ctx, []int{1}, 2)
				if err != nil {
					return err
				}
				rk.c = nc
				return nil
			})
			for i, rk := range survivors {
				rk.r = i
				if rk.c.Rank() != i || rk.c.Size() != 2 {
					t.Fatalf("survivor %d: rank %d size %d", i, rk.c.Rank(), rk.c.Size())
				}
			}
			if fallback {
				if got := w.Calls("ncclCommInitRankConfig") - inits; got != 2 {
					t.Errorf("fallback made %d fresh inits, want 2", got)
				}
			} else if w.Calls("ncclCommShrink") != 2 {
				t.Errorf("ncclCommShrink called %d times", w.Calls("ncclCommShrink"))
			}
			collectiveSuite(t, ctx, survivors, []comm.DType{comm.Float32}, 4, 4)
			ranks[1].c.Close()
		})
	}
}

func TestGrow(t *testing.T) {
	for _, native := range []bool{true, false} {
		t.Run(map[bool]string{true: "native", false: "fallback"}[native], func(t *testing.T) {
			w, _, calls := growJob(t, native, nil, nil)
			if got := w.Calls("ncclCommGrow"); (got > 0) != native {
				t.Errorf("ncclCommGrow called %d times (native %v)", got, native)
			}
			// Without ncclCommGrow anywhere (one NCCL version per comm)
			// there is nothing to vote on: no Store round trip for it.
			if votes := calls.calls("nccl-native"); (len(votes) > 0) != native {
				t.Errorf("the grow's vote through the Store (native %v): %v", native, votes)
			}
		})
	}
}

// The existing ranks choose between ncclCommGrow and a fresh init
// together: here one of them cannot grow natively (its comm was revoked,
// or its configuration forbids it) and the others could. Chosen alone, one
// rank would call ncclCommGrow while the other initialised a fresh comm,
// and both would wait for each other until the Timeout.
func TestGrowChoiceIsCollective(t *testing.T) {
	for name, tc := range map[string]struct {
		cfg     func(r int, c *Config)
		prepare func(ranks []*rank)
	}{
		"rank 1 revoked": {prepare: func(ranks []*rank) { ranks[1].c.Revoke(errors.New("test: a peer moved on")) }},
		"rank 0 revoked": {prepare: func(ranks []*rank) { ranks[0].c.Revoke(errors.New("test: a peer moved on")) }},
		"rank 1 forbids": {cfg: func(r int, c *Config) { c.DisableNativeGrow = r == 1 }},
	} {
		t.Run(name, func(t *testing.T) {
			w, _, _ := growJob(t, true, tc.cfg, tc.prepare)
			if got := w.Calls("ncclCommGrow"); got != 0 {
				t.Errorf("ncclCommGrow called %d times; every rank should have initialised a fresh comm", got)
			}
		})
	}
}

// growJob makes a job of 2 ranks at epoch 1 (on a simulated NCCL 2.29.2,
// with ncclCommGrow, when native), lets prepare act on it, grows it to 3
// ranks at epoch 2 with a joiner as rank 2 and runs the collective suite
// on the result; it returns the calls to the job's Store too.
func growJob(t *testing.T, native bool, cfg func(r int, c *Config), prepare func(ranks []*rank)) (*ncclsim.Simulation, []*rank, *storeCalls) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 3)
	if native {
		w.WithVersion(22902, "ncclCommSplit", "ncclCommShrink", "ncclCommRevoke", "ncclCommGrow", "ncclCommGetUniqueId",
			"ncclAlltoAll", "ncclGather", "ncclScatter")
	}
	L := simLibrary(w)
	mem := memstore.New()
	t.Cleanup(func() { mem.Close() })
	store := &storeCalls{Store: mem}
	opts := func(r, size int, epoch uint64) comm.Options {
		c := &Config{Library: L}
		if cfg != nil {
			cfg(r, c)
		}
		return comm.Options{Name: "g", Rank: r, Size: size, Epoch: epoch, Store: store, Device: r, BackendConfig: c}
	}
	ranks := make([]*rank, 3)
	each(t, []*rank{{r: 0}, {r: 1}}, func(rk *rank) error {
		c, err := comm.New(ctx, "nccl", opts(rk.r, 2, 1))
		ranks[rk.r] = &rank{r: rk.r, c: c, L: L, dev: rk.r}
		return err
	})
	t.Cleanup(func() { closeJob(t, ranks) })
	if prepare != nil {
		prepare(ranks[:2])
	}
	// Ranks 0 and 1 grow to 3; a joiner comes as rank 2. A wrong choice
	// waits for the others until ctx ends: fail well before testCtx.
	gctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	each(t, []*rank{ranks[0], ranks[1], {r: 2}}, func(rk *rank) error {
		if rk.c == nil {
			c, err := comm.New(gctx, "nccl", opts(2, 3, 2))
			ranks[2] = &rank{r: 2, c: c, L: L, dev: 2}
			return err
		}
		nc, err := rk.c.Grow(gctx, 3, 2)
		if nc != nil {
			rk.c = nc
		}
		return err
	})
	collectiveSuite(t, ctx, ranks, []comm.DType{comm.Float32}, 3, 5)
	return w, ranks, store
}

func TestSplit(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 4)
	ranks := startJob(t, ctx, simLibrary(w), devs(4), 1, "job", nil)
	subs := make([]*comm.Comm, 4)
	each(t, ranks, func(rk *rank) error {
		color := rk.r % 2
		if rk.r == 3 {
			color = comm.NoColor
		}
		c, err := rk.c.Split(ctx, color, -rk.r) // key reverses the order
		subs[rk.r] = c
		return err
	})
	if subs[3] != nil {
		t.Fatal("NoColor rank got a comm")
	}
	if subs[0].Size() != 2 || subs[2].Size() != 2 || subs[0].Rank() != 1 || subs[2].Rank() != 0 || subs[1].Size() != 1 {
		t.Fatalf("split ranks: %d/%d %d/%d %d/%d", subs[0].Rank(), subs[0].Size(), subs[2].Rank(), subs[2].Size(), subs[1].Rank(), subs[1].Size())
	}
	even := []*rank{{r: 0, c: subs[2], L: ranks[2].L, dev: 2}, {r: 1, c: subs[0], L: ranks[0].L, dev: 0}}
	t.Cleanup(func() { closeJob(t, append(even, &rank{c: subs[1]})) })
	collectiveSuite(t, ctx, even, []comm.DType{comm.Int32}, 3, 6)
	// The parent is still usable.
	each(t, ranks, func(rk *rank) error { return rk.c.Barrier(ctx) })
}

func TestInitWaitsForRankZero(t *testing.T) {
	w := newFakeWorld(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err := New(ctx, comm.Options{Rank: 1, Size: 2, Store: memstore.New(), Device: 1, BackendConfig: &Config{Library: simLibrary(w)}})
	if !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("init without rank 0: %v, want ErrTimeout", err)
	}
	if _, err := New(context.Background(), comm.Options{Rank: 0, Size: 1, Device: 7, BackendConfig: &Config{Library: simLibrary(w)}}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("device 7 of 2: %v", err)
	}
}

func TestConcurrentCloseAndAbort(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks)
	b := ranks[0].c.Backend().(*Backend)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { b.Abort(errors.New("a")); b.Revoke(errors.New("r")); b.Close() })
	}
	wg.Wait()
	if err := work.Wait(ctx); err == nil {
		t.Fatal("op survived Abort/Revoke/Close")
	}
	waitReleased(t, b)
}

// storeCalls counts a Store's calls by key suffix.
type storeCalls struct {
	comm.Store
	mu   sync.Mutex
	keys []string
}

func (s *storeCalls) Set(ctx context.Context, key string, v []byte) error {
	s.mu.Lock()
	s.keys = append(s.keys, "set "+key)
	s.mu.Unlock()
	return s.Store.Set(ctx, key, v)
}

func (s *storeCalls) Get(ctx context.Context, key string) ([]byte, error) {
	s.mu.Lock()
	s.keys = append(s.keys, "get "+key)
	s.mu.Unlock()
	return s.Store.Get(ctx, key)
}

// calls returns the calls so far whose key contains part.
func (s *storeCalls) calls(part string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, k := range s.keys {
		if strings.Contains(k, part) {
			out = append(out, k)
		}
	}
	return out
}

// Survivors that can all shrink natively do so with no Store round trip
// before ncclCommShrink: no vote is written or awaited (only each one's
// watch for a refusal, which never comes).
func TestShrinkWithoutVote(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 3)
	calls := &storeCalls{}
	var once sync.Once
	ranks := startJob(t, ctx, simLibrary(w), devs(3), 1, "job", func(c *Config, o *comm.Options) {
		c.ReleaseTimeout = 50 * time.Millisecond
		once.Do(func() { calls.Store = o.Store }) // the job's one store
		o.Store = calls
	})
	work, _ := stuckAllReduce(t, ctx, w, ranks) // rank 1's GPU is dead
	ranks[0].c.Revoke(errors.New("membership: rank 1 left"))
	if err := work.Wait(ctx); !errors.Is(err, comm.ErrRevoked) {
		t.Fatalf("op after Revoke: %v", err)
	}
	ranks[2].c.Revoke(errors.New("membership: rank 1 left"))
	survivors := []*rank{ranks[0], ranks[2]}
	each(t, survivors, func(rk *rank) error {
		nc, err := rk.c.Shrink(ctx, []int{1}, 2)
		if nc != nil {
			rk.c = nc
		}
		return err
	})
	ranks[2].r = 1
	for _, rk := range survivors {
		if how := rk.c.Backend().(*Backend).Creation().How; how != "ncclCommShrink(NCCL_SHRINK_ABORT) → data comm" {
			t.Errorf("survivor %d's comm made by %q, want ncclCommShrink(NCCL_SHRINK_ABORT) → data comm", rk.r, how)
		}
	}
	if got := calls.calls("nccl-native"); len(got) != 0 {
		t.Errorf("the shrink voted through the Store: %v", got)
	}
	if got := calls.calls("set epoch/2/nccl-fresh"); len(got) != 0 {
		t.Errorf("a survivor refused the native shrink: %v", got)
	}
	collectiveSuite(t, ctx, survivors, []comm.DType{comm.Float32}, 3, 9)
}
