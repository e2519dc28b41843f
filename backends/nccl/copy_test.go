package nccl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// The HostCopier tests run against the Simulation; TestGPUHostCopier and
// BenchmarkHostCopy (FTCOMM_NCCL_GPU=1) against a GPU.

// copier returns rank 0's backend as a comm.HostCopier, as ft probes it.
func copier(t *testing.T, rk *rank) comm.HostCopier {
	t.Helper()
	hc, ok := rk.c.Backend().(comm.HostCopier)
	if !ok {
		t.Fatal("the nccl backend is not a comm.HostCopier")
	}
	return hc
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) + seed
	}
	return b
}

func TestHostCopier(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, libraryWith(t, w, 2), devs(2), 1, "job", nil)
	hc := copier(t, ranks[0])
	dev, err := ranks[0].alloc(comm.Uint8, 1024)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.b.Free()
	pin, free, err := hc.PinnedHost(1024)
	if err != nil {
		t.Fatal(err)
	}
	// Chunks in and out, pinned and Go memory, at offsets.
	want := pattern(1024, 3)
	for off := 0; off < 1024; off += 256 {
		copy(pin[off:off+256], want[off:off+256])
		if err := hc.CopyFromHost(ctx, dev.t(), off, pin[off:off+256]); err != nil {
			t.Fatal(err)
		}
	}
	got := make([]byte, 1024)
	for off := 0; off < 1024; off += 512 {
		if err := hc.CopyToHost(ctx, got[off:off+512], dev.t(), off); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(got, want) {
		t.Fatal("round trip through pinned chunks and Go memory differs")
	}
	clear(pin)
	if err := hc.CopyToHost(ctx, pin[100:300], dev.t().Slice(50, 500), 50); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(pin[100:300], want[100:300]) {
		t.Fatal("copy from a tensor slice at an offset landed wrong")
	}
	free()
	free() // once is enough; twice is harmless
	if n := w.PinnedLive(); n != 0 {
		t.Errorf("%d pinned allocations left", n)
	}
	if b, f, err := hc.PinnedHost(0); err != nil || len(b) != 0 {
		t.Errorf("PinnedHost(0) = %d bytes, %v", len(b), err)
	} else {
		f()
	}
}

func TestHostCopierInvalid(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", nil)
	hc := copier(t, ranks[0])
	dev, err := ranks[0].alloc(comm.Float32, 16) // 64 bytes
	if err != nil {
		t.Fatal(err)
	}
	defer dev.b.Free()
	other, err := ranks[1].alloc(comm.Float32, 16)
	if err != nil {
		t.Fatal(err)
	}
	defer other.b.Free()
	devWant := pattern(64, 9)
	if err := dev.b.CopyFromHost(ctx, devWant); err != nil {
		t.Fatal(err)
	}
	host := pattern(64, 1)
	hostWant := bytes.Clone(host)
	for name, err := range map[string]error{
		"to host past the end":     hc.CopyToHost(ctx, host[:8], dev.t(), 60),
		"to host negative offset":  hc.CopyToHost(ctx, host[:8], dev.t(), -1),
		"to host offset past end":  hc.CopyToHost(ctx, host[:0], dev.t(), 65),
		"to host too long":         hc.CopyToHost(ctx, make([]byte, 65), dev.t(), 0),
		"from host past the end":   hc.CopyFromHost(ctx, dev.t(), 57, host[:8]),
		"from host negative":       hc.CopyFromHost(ctx, dev.t(), -8, host[:8]),
		"host tensor as source":    hc.CopyToHost(ctx, host[:8], comm.Float32s(make([]float32, 4)), 0),
		"host tensor as target":    hc.CopyFromHost(ctx, comm.Float32s(make([]float32, 4)), 0, host[:8]),
		"tensor of another device": hc.CopyToHost(ctx, host[:8], other.t(), 0),
		"no tensor":                hc.CopyFromHost(ctx, comm.Tensor{}, 0, host[:8]),
	} {
		if !errors.Is(err, comm.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, _, err := hc.PinnedHost(-1); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("PinnedHost(-1): %v", err)
	}
	got := make([]byte, 64)
	if err := dev.b.CopyToHost(ctx, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, devWant) || !bytes.Equal(host, hostWant) {
		t.Error("a refused copy touched memory")
	}
	// A ctx already done: nothing is copied.
	done, cancel := context.WithCancel(ctx)
	cancel()
	if err := hc.CopyFromHost(done, dev.t(), 0, host[:8]); !errors.Is(err, comm.ErrAborted) || !errors.Is(err, context.Canceled) {
		t.Errorf("copy with a cancelled ctx: %v", err)
	}
	if err := dev.b.CopyToHost(ctx, got); err != nil || !bytes.Equal(got, devWant) {
		t.Errorf("a cancelled copy touched the device: %v", err)
	}
}

// TestHostCopierConcurrent: copiers on more goroutines than copy streams,
// beside collectives on the comm, every chunk checked; then the same after
// the comm is aborted and closed.
func TestHostCopierConcurrent(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, libraryWith(t, w, 2), devs(2), 1, "job", nil)
	hc := copier(t, ranks[0])
	const chunk, chunks = 256, 16
	dev, err := ranks[0].alloc(comm.Uint8, chunk*chunks)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.b.Free()
	copiers := func(t *testing.T, seed byte) {
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
				for i := g; i < chunks; i += 8 {
					want := pattern(chunk, seed+byte(i))
					copy(pin, want)
					if err := hc.CopyFromHost(ctx, dev.t(), i*chunk, pin); err != nil {
						errs[g] = err
						return
					}
					clear(pin)
					if err := hc.CopyToHost(ctx, pin, dev.t(), i*chunk); err != nil {
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
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
	}
	// Collectives run meanwhile on both ranks.
	var ops sync.WaitGroup
	for _, rk := range ranks {
		ops.Go(func() {
			x, err := rk.alloc(comm.Float32, 8)
			if err != nil {
				t.Error(err)
				return
			}
			defer x.b.Free()
			for range 200 {
				if err := rk.c.AllReduce(ctx, x.t(), comm.Sum); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	for round := range 3 {
		copiers(t, byte(round))
	}
	ops.Wait()
	// After Abort and Close the copier still works.
	b := ranks[0].c.Backend().(*Backend)
	b.Abort(errors.New("test"))
	ranks[0].c.Close()
	waitReleased(t, b)
	copiers(t, 100)
}

// TestHostCopierCancel: a copy whose ctx ends while the copy engine is
// still busy returns at once; the memory stays reserved (free waits) until
// the engine is done, and the stream is reused only then.
func TestHostCopierCancel(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 1)
	L := libraryWith(t, w, 1)
	dev, err := L.Alloc(0, 64)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free()
	pin, free, err := L.PinnedHost(0, 64)
	if err != nil {
		t.Fatal(err)
	}
	copy(pin, pattern(64, 5))
	w.StallCopies(true)
	cctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancel()
	if err := L.CopyFromHost(cctx, dev.Tensor(comm.Uint8), 0, pin); !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("stalled copy: %v, want ErrTimeout", err)
	}
	// The only copy stream is still busy: the next copy waits for it, and
	// gives up at its own deadline.
	cctx2, cancel2 := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancel2()
	if err := L.CopyToHost(cctx2, make([]byte, 8), dev.Tensor(comm.Uint8), 0); !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("copy while the only stream is held: %v, want ErrTimeout", err)
	}
	freed := make(chan struct{})
	go func() { free(); close(freed) }()
	select {
	case <-freed:
		t.Fatal("free returned while a copy from the memory was still running")
	case <-time.After(20 * time.Millisecond):
	}
	w.StallCopies(false)
	select {
	case <-freed:
	case <-time.After(10 * time.Second):
		t.Fatal("free still waiting 10 s after the copy could finish")
	}
	got := make([]byte, 64)
	if err := L.CopyToHost(ctx, got, dev.Tensor(comm.Uint8), 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, pattern(64, 5)) {
		t.Error("the abandoned copy did not complete on the device")
	}
	if err := L.Release(); err != nil {
		t.Error(err)
	}
}

// BenchmarkHostCopy measures CopyToHost (d2h) and CopyFromHost (h2d)
// throughput with pinned chunks of 1–64 MiB and 1–8 concurrent copiers,
// each copying its own chunk-sized region of a device buffer. On a GPU
// with FTCOMM_NCCL_GPU=1; elsewhere against the Simulation, with KiB for MiB
// (which measures nothing but the code path):
//
//	FTCOMM_NCCL_GPU=1 ./nccl.test -test.run '^$' -test.bench HostCopy -test.benchtime 20x
func BenchmarkHostCopy(b *testing.B) {
	var L *Library
	unit, unitName := 1<<20, "MiB"
	if os.Getenv(gpuEnv) != "" {
		var err error
		if L, err = Open(LibraryConfig{CopyStreams: 8}); err != nil {
			b.Fatal(err)
		}
	} else {
		L = libraryWith(b, newFakeWorld(b, 1), 8)
		unit, unitName = 1<<10, "KiB"
	}
	ctx := context.Background()
	const maxCopiers = 8
	maxChunk := 64 * unit
	devBuf, err := L.Alloc(0, maxChunk*maxCopiers)
	if err != nil {
		b.Fatal(err)
	}
	defer devBuf.Free()
	pins := make([][]byte, maxCopiers)
	for i := range pins {
		p, free, err := L.PinnedHost(0, maxChunk)
		if err != nil {
			b.Fatal(err)
		}
		defer free()
		pins[i] = p
	}
	for _, dir := range []string{"d2h", "h2d"} {
		for _, chunk := range []int{unit, 4 * unit, 16 * unit, 64 * unit} {
			for _, copiers := range []int{1, 2, 4, 8} {
				b.Run(fmt.Sprintf("%s/chunk=%d%s/copiers=%d", dir, chunk/unit, unitName, copiers), func(b *testing.B) {
					b.SetBytes(int64(chunk * copiers))
					var wg sync.WaitGroup
					errs := make([]error, copiers)
					b.ResetTimer()
					for g := range copiers {
						wg.Go(func() {
							region := devBuf.Tensor(comm.Uint8).Slice(g*maxChunk, chunk)
							for range b.N {
								if dir == "d2h" {
									errs[g] = L.CopyToHost(ctx, pins[g][:chunk], region, 0)
								} else {
									errs[g] = L.CopyFromHost(ctx, region, 0, pins[g][:chunk])
								}
								if errs[g] != nil {
									return
								}
							}
						})
					}
					wg.Wait()
					if err := errors.Join(errs...); err != nil {
						b.Fatal(err)
					}
				})
			}
		}
	}
}

// BenchmarkHostCopyRaw is one copier's floor: cudaMemcpyAsync on a stream
// of its own and a busy poll of cudaStreamQuery, no pool, no ctx
// (FTCOMM_NCCL_GPU=1; skipped on the Simulation).
func BenchmarkHostCopyRaw(b *testing.B) {
	if os.Getenv(gpuEnv) == "" {
		b.Skip(gpuSkip)
	}
	L, err := Open(LibraryConfig{})
	if err != nil {
		b.Fatal(err)
	}
	devBuf, err := L.Alloc(0, 64<<20)
	if err != nil {
		b.Fatal(err)
	}
	defer devBuf.Free()
	pin, free, err := L.PinnedHost(0, 64<<20)
	if err != nil {
		b.Fatal(err)
	}
	defer free()
	s, err := L.lib.StreamCreate(0)
	if err != nil {
		b.Fatal(err)
	}
	defer L.lib.StreamDestroy(0, s)
	for _, chunk := range []int{4 << 20, 16 << 20, 32 << 20, 64 << 20} {
		b.Run(fmt.Sprintf("d2h/chunk=%dMiB", chunk>>20), func(b *testing.B) {
			b.SetBytes(int64(chunk))
			for range b.N {
				if err := L.lib.CopyDtoH(0, pin[:chunk], devBuf.Ptr(), s); err != nil {
					b.Fatal(err)
				}
				for {
					ok, err := L.lib.StreamQuery(0, s)
					if err != nil {
						b.Fatal(err)
					}
					if ok {
						break
					}
				}
			}
		})
	}
}
