package nccl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// GPU tests that need one GPU (FTCOMM_NCCL_GPU=1): single-rank comms in
// every Mode, the launch cost of each mode, the host copier and the NVML
// watch, and the choice of library. FTCOMM_NCCL_LIB picks the libnccl
// (e.g. PyTorch's 2.28.9); without it Open loads the newest found.

var allModes = []Mode{ModeBlockingData, ModeNonblocking, ModeBlocking}

// TestGPUOneRank runs the collective suite on a one-rank comm in every
// mode, then a Split, and reports the time to a ready comm.
func TestGPUOneRank(t *testing.T) {
	L := gpuLib(t, 1)
	// The process's first comm also initialises CUDA and NCCL: not timed.
	closeJob(t, startJob(t, testCtx(t), L, []int{0}, 1, "gpu-one-first", nil))
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := testCtx(t)
			t0 := time.Now()
			ranks := startJob(t, ctx, L, []int{0}, 1, "gpu-one-"+mode.String(), func(c *Config, o *comm.Options) { c.Mode = mode })
			figure(t, "one-rank init+warm-up ("+mode.String()+")", time.Since(t0))
			b := ranks[0].c.Backend().(*Backend)
			if b.data != b.ctl {
				t.Errorf("a one-rank comm in mode %s has a data comm of its own", mode) // see separateData
			}
			collectiveSuite(t, ctx, ranks, []comm.DType{comm.Float32, comm.BFloat16, comm.Int32}, 1031, 41)
			t0 = time.Now()
			sub, err := ranks[0].c.Split(ctx, 0, 0)
			if err != nil {
				t.Fatal(err)
			}
			figure(t, "one-rank split+warm-up ("+mode.String()+")", time.Since(t0))
			collectiveSuite(t, ctx, []*rank{{r: 0, c: sub, L: L, dev: 0}}, []comm.DType{comm.Float32}, 257, 42)
			closeJob(t, []*rank{{c: sub}})
			t0 = time.Now()
			closeJob(t, ranks)
			figure(t, "one-rank close+release ("+mode.String()+")", time.Since(t0))
		})
	}
}

// launchCost times an 8-byte send to self and receive from self, grouped,
// on the data comm of a one-rank comm: a collective of one rank bypasses
// NCCL's group launch (it is a local copy), a self send/recv does not, so
// this is the per-op launch cost NCCL adds to a comm of each blocking
// kind. A one-rank comm of ModeBlockingData has no data comm of its own
// (separateData), so its figure is the nonblocking control comm's, where
// that mode runs point-to-point ops; its blocking data comm (two or more
// ranks) is a blocking comm like ModeBlocking's. waited: each op
// enqueued, settled (ncclCommGetAsyncError until not in progress on a
// nonblocking comm) and waited for; enqueue: the enqueue+settle part of
// that; b2b: ops enqueued back to back, one wait at the end.
func launchCost(ctx context.Context, b *Backend, buf uintptr, n int) (waited, enqueue, b2b time.Duration, err error) {
	ops := []libapi.CollArgs{
		{Kind: libapi.Send, Type: libapi.Uint8, Peer: 0, Send: buf, Count: 8},
		{Kind: libapi.Recv, Type: libapi.Uint8, Peer: 0, Recv: buf + 8, Count: 8},
	}
	one := func() (time.Duration, error) {
		b.hmu.Lock()
		defer b.hmu.Unlock()
		t0 := time.Now()
		r := b.lib.Group(b.dev, b.data, b.stream, ops)
		var err error
		if b.dataBlocking {
			if r != libapi.Success {
				err = b.ncclError(b.data, "self send/recv", r)
			}
		} else {
			err = b.settle(ctx, b.data, "self send/recv", r)
		}
		return time.Since(t0), err
	}
	for range 50 { // warm up
		if _, err := one(); err != nil {
			return 0, 0, 0, err
		}
		if err := b.waitStream(ctx, "warm-up"); err != nil {
			return 0, 0, 0, err
		}
	}
	t0 := time.Now()
	for range n {
		d, err := one()
		if err != nil {
			return 0, 0, 0, err
		}
		enqueue += d
		if err := b.waitStream(ctx, "waited"); err != nil {
			return 0, 0, 0, err
		}
	}
	waited = time.Since(t0) / time.Duration(n)
	enqueue /= time.Duration(n)
	t0 = time.Now()
	for range n {
		if _, err := one(); err != nil {
			return 0, 0, 0, err
		}
	}
	if err := b.waitStream(ctx, "b2b"); err != nil {
		return 0, 0, 0, err
	}
	return waited, enqueue, time.Since(t0) / time.Duration(n), nil
}

// TestGPULaunchCost prints, per mode, the launch cost of NCCL (see
// launchCost) and an 8-byte one-rank all-reduce through comm.Comm, sync
// and async (back to back).
func TestGPULaunchCost(t *testing.T) {
	L := gpuLib(t, 1)
	info := L.Info()
	t.Logf("NCCL %s (%s)", info.NCCL, info.NCCLPath)
	for _, mode := range allModes {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := testCtx(t)
			ranks := startJob(t, ctx, L, []int{0}, 1, "gpu-launch-"+mode.String(), func(c *Config, o *comm.Options) { c.Mode = mode })
			b := ranks[0].c.Backend().(*Backend)
			buf, err := L.Alloc(0, 64)
			if err != nil {
				t.Fatal(err)
			}
			defer buf.Free()
			const n = 2000
			waited, enq, b2b, err := launchCost(ctx, b, buf.Ptr(), n)
			if err != nil {
				t.Fatal(err)
			}
			c := ranks[0].c
			x := buf.Tensor(comm.Float32).Slice(0, 2)
			t0 := time.Now()
			for range n {
				if err := c.AllReduce(ctx, x, comm.Sum); err != nil {
					t.Fatal(err)
				}
			}
			sync := time.Since(t0) / n
			t0 = time.Now()
			works := make([]*comm.Work, n)
			for i := range works {
				works[i] = c.AllReduceAsync(ctx, x, comm.Sum)
			}
			for _, w := range works {
				if err := w.Wait(ctx); err != nil {
					t.Fatal(err)
				}
			}
			async := time.Since(t0) / n
			us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
			t.Logf("FIGURE launch NCCL %s mode %-13s self send/recv 8 B: waited-for %6.2f us (enqueue %6.2f us), back-to-back %6.2f us; "+
				"one-rank allreduce 8 B via comm.Comm: sync %6.2f us, async %6.2f us",
				info.NCCL, mode, us(waited), us(enq), us(b2b), us(sync), us(async))
		})
	}
}

// TestGPUHostCopier: 8 copiers move 64 MiB through pinned 4 MiB chunks
// while the comm all-reduces, then again after it is closed; every chunk
// is checked; bad ranges and a cancelled copy.
func TestGPUHostCopier(t *testing.T) {
	L := gpuLib(t, 1)
	ctx := testCtx(t)
	ranks := startJob(t, ctx, L, []int{0}, 1, "gpu-copier", nil)
	hc := copier(t, ranks[0])
	const chunk, total = 4 << 20, 64 << 20
	dev, err := L.Alloc(0, total)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free()
	round := func(seed byte) error {
		var wg sync.WaitGroup
		errs := make([]error, 8)
		for g := range 8 {
			wg.Go(func() {
				pin, free, err := hc.PinnedHost(chunk)
				if err != nil {
					errs[g] = err
					return
				}
				defer free()
				for i := g; i < total/chunk; i += 8 {
					want := pattern(chunk, seed+byte(i))
					copy(pin, want)
					if err := hc.CopyFromHost(ctx, dev.Tensor(comm.Uint8), i*chunk, pin); err != nil {
						errs[g] = err
						return
					}
					clear(pin)
					if err := hc.CopyToHost(ctx, pin, dev.Tensor(comm.Uint8), i*chunk); err != nil {
						errs[g] = err
						return
					}
					if !bytes.Equal(pin, want) {
						errs[g] = fmt.Errorf("chunk %d differs after a round trip", i)
						return
					}
				}
			})
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	x, err := L.Alloc(0, 64<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer x.Free()
	opsDone := make(chan error, 1)
	go func() {
		for range 200 {
			if err := ranks[0].c.AllReduce(ctx, x.Tensor(comm.Float32), comm.Sum); err != nil {
				opsDone <- err
				return
			}
		}
		opsDone <- nil
	}()
	t0 := time.Now()
	for r := range 4 {
		if err := round(byte(r)); err != nil {
			t.Fatal(err)
		}
	}
	figure(t, "host copier: 4 x 64 MiB each way in 4 MiB chunks, 8 copiers, beside 64 MiB all-reduces", time.Since(t0))
	if err := <-opsDone; err != nil {
		t.Fatal(err)
	}
	if err := hc.CopyToHost(ctx, make([]byte, 8), dev.Tensor(comm.Uint8), total-4); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("copy past the end: %v", err)
	}
	// A copy abandoned at its deadline: free waits for the copy engine.
	pin, free, err := hc.PinnedHost(total)
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 200*time.Microsecond)
	t0 = time.Now()
	err = hc.CopyToHost(cctx, pin, dev.Tensor(comm.Uint8), 0)
	cancel()
	t.Logf("64 MiB copy with a 200 us deadline returned after %s: %v", time.Since(t0), err)
	t0 = time.Now()
	free()
	t.Logf("free of its pinned memory returned after %s", time.Since(t0))
	closeJob(t, ranks)
	if err := round(77); err != nil {
		t.Fatalf("after Close: %v", err)
	}
}

// TestGPUWatchHealth starts the NVML watch of a comm's GPU for real.
func TestGPUWatchHealth(t *testing.T) {
	L := gpuLib(t, 1)
	ctx := testCtx(t)
	ranks := startJob(t, ctx, L, []int{0}, 1, "gpu-health", nil)
	b := ranks[0].c.Backend().(*Backend)
	bus, err := b.lib.PCIBusID(0)
	if err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	events := make(chan comm.HealthEvent, 4)
	if err := b.WatchHealth(wctx, func(e comm.HealthEvent) { events <- e }); err != nil {
		t.Fatalf("WatchHealth of device 0 (%s): %v", bus, err)
	}
	select {
	case e := <-events:
		t.Logf("health event: %+v", e)
		if e.Critical {
			t.Errorf("critical GPU fault on a machine under test: %+v", e)
		}
	case <-time.After(1500 * time.Millisecond):
		t.Logf("watching device 0 (%s): no health events in 1.5 s (as expected)", bus)
	}
}

// TestGPULibrarySelection opens NCCL with nothing named (FTCOMM_NCCL_LIB
// unset), logs every candidate the search found and the path a comm on
// the chosen one takes, and checks what the choice promises: the chosen
// file is the newest usable candidate, its version as read from the file
// is what ncclGetVersion says, and RevokeAuto revokes natively exactly
// where the library's Recovery allows it.
func TestGPULibrarySelection(t *testing.T) {
	if os.Getenv(gpuEnv) == "" {
		t.Skip(gpuSkip)
	}
	t.Setenv(EnvNCCLLib, "")
	t0 := time.Now()
	L, err := Open(LibraryConfig{Logger: zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel))})
	if err != nil {
		t.Fatalf("Open with nothing named: %v", err)
	}
	figure(t, "library search and open", time.Since(t0))
	i := L.Info()
	for _, c := range i.Candidates {
		t.Logf("candidate %s", c)
	}
	t.Logf("FIGURE library chosen: NCCL %s from %s (source %s), recovery %s; %d candidates", i.NCCL, i.NCCLPath,
		i.NCCLSource, i.Recovery, len(i.Candidates))
	if i.NCCLSource != SourceLoader {
		var chosen *NCCLCandidate
		for k := range i.Candidates {
			if c := &i.Candidates[k]; c.Chosen {
				if chosen != nil {
					t.Errorf("two candidates chosen: %s and %s", chosen.Path, c.Path)
				}
				chosen = c
			}
		}
		if chosen == nil || chosen.Path != i.NCCLPath || chosen.Source != i.NCCLSource {
			t.Fatalf("the loaded library %s is not the candidate marked chosen (%v)", i.NCCLPath, chosen)
		}
		if chosen.Version != i.NCCL {
			t.Errorf("the file says NCCL %s, ncclGetVersion %s", chosen.Version, i.NCCL)
		}
		for _, c := range i.Candidates {
			if c.Err == nil && c.Version.Code() > i.NCCL.Code() && !strings.HasPrefix(c.Reason, "built for CUDA") &&
				!strings.Contains(c.Reason, "does not load") {
				t.Errorf("%s is newer than the chosen one and was not ruled out", c)
			}
		}
	}
	ranks := startJob(t, testCtx(t), L, []int{0}, 1, "gpu-select", func(c *Config, o *comm.Options) { c.Revoke = RevokeAuto })
	defer closeJob(t, ranks)
	b := ranks[0].c.Backend().(*Backend)
	if want := i.Recovery == RecoveryRevokeShrink; b.revokeNative != want {
		t.Errorf("RevokeAuto on recovery %s: native revoke %v, want %v", i.Recovery, b.revokeNative, want)
	}
	t.Logf("FIGURE library path: RevokeAuto on NCCL %s revokes natively: %v", i.NCCL, b.revokeNative)
}
