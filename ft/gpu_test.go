package ft

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/backends/nccl/ncclsim"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/coordinator/memcoord"
	"github.com/ftcomm/ftcomm/recovery"
)

// GPU tests of ft (FTCOMM_FT_GPU=1; ft/gpurun.sh builds and runs them on
// the one-GPU device machine):
//
//   - TestGPUFTOneReplica: ft with the NCCL data backend and one replica
//     (a one-rank NCCL comm beside a gloo control comm) trains a few steps
//     on device tensors; the device state is checked against the host.
//   - TestGPUHealThroughput: device-state healing between processes that
//     share the GPU. Source processes (this test binary re-run as
//     TestGPUHealSource) each hold FTCOMM_FT_HEAL_BYTES (1 GiB) of device
//     memory with a known pattern, served by a recovery.Server through
//     ft's deviceState (chunks staged through pinned buffers); this
//     process fetches it into its own device buffer from 1 source and
//     from 3, for each chunk size and stream count of the sweep, checks
//     every byte (copied back from the device), and prints GB/s.
//
// Environment: FTCOMM_FT_HEAL_BYTES (default 1 GiB), FTCOMM_FT_HEAL_CHUNKS
// (MiB, comma-separated; default 1,4,16,64), FTCOMM_FT_HEAL_STREAMS
// (default 2,4,8), FTCOMM_FT_HEAL_SOURCES (default 3), FTCOMM_FT_HEAL_ROUNDS
// (default 1: how many times the whole sweep runs, interleaved).

const gpuEnv = "FTCOMM_FT_GPU"

// gpuOnly returns the loaded NCCL, or skips the test unless
// FTCOMM_FT_GPU=1. FTCOMM_FT_GPU=sim runs the tests on ncclsim.Simulation
// instead (one simulated GPU per process), to check the tests themselves
// where there is no GPU.
func gpuOnly(t *testing.T) *nccl.Library {
	t.Helper()
	switch os.Getenv(gpuEnv) {
	case "1":
	case "sim":
		return simLibrary(t, ncclsim.New(1))
	default:
		t.Skipf("GPU test: set %s=1 on a machine with a GPU (ft/gpurun.sh)", gpuEnv)
	}
	lib, err := nccl.Open(nccl.LibraryConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := lib.DeviceCount(); err != nil || n < 1 {
		t.Skipf("no GPU: %d devices (%v)", n, err)
	}
	return lib
}

func envInts(t testing.TB, name string, def []int) []int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	var out []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			t.Fatalf("%s=%q: want positive integers", name, v)
		}
		out = append(out, n)
	}
	return out
}

// TestGPUFTOneReplica: ft over NCCL with one replica on GPU 0.
func TestGPUFTOneReplica(t *testing.T) {
	lib := gpuOnly(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	coord := memcoord.New("gpu", quick())
	defer coord.Close()
	const n = 1 << 20 // 4 MiB of float32 state
	// Allocated before the Comm, so that the deferred Close runs before the
	// frees: device memory is freed only after Close (see Caller duties).
	params, err := lib.Alloc(0, 4*n)
	if err != nil {
		t.Fatal(err)
	}
	defer params.Free()
	grads, err := lib.Alloc(0, 4*n)
	if err != nil {
		t.Fatal(err)
	}
	defer grads.Free()
	c, err := New(ctx, Config{Job: "gpu", Group: "a", Backend: "nccl", BackendConfig: &nccl.Config{Library: lib},
		ControlBackend: "gloo", Secret: []byte("k"), Membership: joinAs(coord, "a.0", 1), Timeout: time.Minute,
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel))})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	host := make([]float32, n) // what the device must hold
	for i := range host {
		host[i] = 1
	}
	if err := params.CopyFromHost(ctx, f32bytes(host)); err != nil {
		t.Fatal(err)
	}
	if err := c.Register("params", params.Tensor(comm.Float32)); err != nil {
		t.Fatal(err)
	}
	g := make([]float32, n)
	const steps = 5
	for s := 1; s <= steps; s++ {
		t0 := time.Now()
		if err := c.Step(ctx); err != nil {
			t.Fatal(err)
		}
		for i := range g {
			g[i] = float32((s*7+i)%13) / 8
		}
		if err := grads.CopyFromHost(ctx, f32bytes(g)); err != nil {
			t.Fatal(err)
		}
		if err := c.AllReduce(ctx, grads.Tensor(comm.Float32), comm.Avg).Wait(ctx); err != nil {
			t.Fatal(err)
		}
		ok, err := c.Commit(ctx)
		if err != nil || !ok {
			t.Fatalf("step %d: commit %v, %v", s, ok, err)
		}
		// The optimizer step on the host, from the device's all-reduced
		// gradients (Avg over one replica: the gradients themselves).
		gb := make([]byte, 4*n)
		if err := grads.CopyToHost(ctx, gb); err != nil {
			t.Fatal(err)
		}
		pb := make([]byte, 4*n)
		if err := params.CopyToHost(ctx, pb); err != nil {
			t.Fatal(err)
		}
		p, gd := f32s(pb), f32s(gb)
		for i := range p {
			if gd[i] != g[i] {
				t.Fatalf("step %d: all-reduced gradient %d is %v, want %v", s, i, gd[i], g[i])
			}
			p[i] -= 0.01 * gd[i]
			host[i] -= 0.01 * g[i]
		}
		if err := params.CopyFromHost(ctx, f32bytes(p)); err != nil {
			t.Fatal(err)
		}
		t.Logf("step %d committed in %v (epoch %d, %d participant)", s, time.Since(t0).Round(time.Microsecond), c.Epoch(), c.Participants())
	}
	if c.CommittedStep() != steps {
		t.Errorf("committed %d steps, want %d", c.CommittedStep(), steps)
	}
	pb := make([]byte, 4*n)
	if err := params.CopyToHost(ctx, pb); err != nil {
		t.Fatal(err)
	}
	if got, want := stateHash(f32s(pb)), stateHash(host); got != want {
		t.Errorf("device state %x after %d steps, want %x", got, steps, want)
	}
	cur := c.current().ft
	data, ctl := cur.data, cur.ctl
	if data.Backend().Name() != "nccl" || ctl.Backend().Name() != "gloo" {
		t.Errorf("data comm on %s, control on %s", data.Backend().Name(), ctl.Backend().Name())
	}
	t.Logf("NCCL %s", lib.Info().NCCL)
}

// libCopier is a comm.HostCopier over a Library and one GPU: what a
// source process without a comm serves its device state through.
type libCopier struct {
	L   *nccl.Library
	dev int
}

func (c libCopier) PinnedHost(n int) ([]byte, func(), error) { return c.L.PinnedHost(c.dev, n) }
func (c libCopier) CopyToHost(ctx context.Context, dst []byte, src comm.Tensor, off int) error {
	return c.L.CopyToHost(ctx, dst, src, off)
}
func (c libCopier) CopyFromHost(ctx context.Context, dst comm.Tensor, off int, src []byte) error {
	return c.L.CopyFromHost(ctx, dst, off, src)
}

// healPattern fills b with the state's bytes at offset off (a multiple of
// 8): a word per 8 bytes that depends on its offset.
func healPattern(b []byte, off int) {
	for i := 0; i+8 <= len(b); i += 8 {
		x := uint64(off+i) * 0x9E3779B97F4A7C15
		binary.LittleEndian.PutUint64(b[i:], x^(x>>29))
	}
}

// fillDevice writes the pattern into the device buffer, a piece at a time.
func fillDevice(ctx context.Context, lib *nccl.Library, buf *nccl.DeviceBuffer) error {
	const piece = 64 << 20
	host, free, err := lib.PinnedHost(0, piece)
	if err != nil {
		return err
	}
	defer free()
	t := buf.Tensor(comm.Uint8)
	for off := 0; off < buf.Len(); off += piece {
		n := min(piece, buf.Len()-off)
		healPattern(host[:n], off)
		if err := lib.CopyFromHost(ctx, t, off, host[:n]); err != nil {
			return err
		}
	}
	return nil
}

// checkDevice copies the device buffer back and compares it with the
// pattern; it returns the first difference.
func checkDevice(ctx context.Context, lib *nccl.Library, buf *nccl.DeviceBuffer) error {
	const piece = 64 << 20
	host, free, err := lib.PinnedHost(0, piece)
	if err != nil {
		return err
	}
	defer free()
	want := make([]byte, piece)
	t := buf.Tensor(comm.Uint8)
	for off := 0; off < buf.Len(); off += piece {
		n := min(piece, buf.Len()-off)
		if err := lib.CopyToHost(ctx, host[:n], t, off); err != nil {
			return err
		}
		healPattern(want[:n], off)
		for i := 0; i < n; i += 8 {
			if binary.LittleEndian.Uint64(host[i:]) != binary.LittleEndian.Uint64(want[i:]) {
				return fmt.Errorf("byte %d: %x, want %x", off+i, host[i:i+8], want[i:i+8])
			}
		}
	}
	return nil
}

const (
	healSourceEnv = "FTCOMM_FT_HEAL_SOURCE"
	healJob       = "heal"
)

var healSecret = []byte("heal-secret")

func healBytes(t *testing.T) int {
	return envInts(t, "FTCOMM_FT_HEAL_BYTES", []int{1 << 30})[0]
}

// TestGPUHealSource is the source process of TestGPUHealThroughput: it
// fills its device state with the pattern, serves it as step 1 and prints
// "HEALSOURCE <addr>" until its stdin closes.
func TestGPUHealSource(t *testing.T) {
	if os.Getenv(healSourceEnv) != "1" {
		t.Skip("the source process of TestGPUHealThroughput")
	}
	lib := gpuOnly(t)
	ctx := context.Background()
	size := healBytes(t)
	buf, err := lib.Alloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	if err := fillDevice(ctx, lib, buf); err != nil {
		t.Fatal(err)
	}
	srv, err := recovery.NewServer(recovery.ServerConfig{Job: healJob, Secret: healSecret})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	// The pool's buffers hold the largest chunk a healer asks for, so
	// every chunk is staged through a kept buffer.
	chunks := envInts(t, "FTCOMM_FT_HEAL_CHUNKS", []int{1, 4, 16, 64})
	pool := newStagingPool(libCopier{lib, 0}, slices.Max(chunks)<<20, stagingBuffers)
	defer func() { pool.close(time.Now().Add(time.Minute)) }()
	srv.Offer(1, []recovery.Blob{{Name: "state", Mem: &deviceState{copier: libCopier{lib, 0}, t: buf.Tensor(comm.Uint8), pool: pool}}})
	fmt.Printf("HEALSOURCE %s\n", srv.Addr())
	io.Copy(io.Discard, os.Stdin) // until the parent ends
}

// TestGPUHealThroughput heals device state from 1 and from 3 source
// processes on the same GPU and prints the throughput of each setting.
func TestGPUHealThroughput(t *testing.T) {
	lib := gpuOnly(t)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	size := healBytes(t)
	nSources := envInts(t, "FTCOMM_FT_HEAL_SOURCES", []int{3})[0]
	chunks := envInts(t, "FTCOMM_FT_HEAL_CHUNKS", []int{1, 4, 16, 64})
	streams := envInts(t, "FTCOMM_FT_HEAL_STREAMS", []int{2, 4, 8})

	// The sources start (and fill their GPU memory) in parallel.
	addrs := make([]string, nSources)
	var wg sync.WaitGroup
	errs := make([]error, nSources)
	for i := range nSources {
		wg.Go(func() { addrs[i], errs[i] = startHealSource(t) })
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	buf, err := lib.Alloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	copier := libCopier{lib, 0}
	host, _ := os.Hostname()
	t.Logf("heal %d MiB of device state; sources %v; GPU 0 shared by all; %s; stagingBuffers %d; %s",
		size>>20, addrs, host, stagingBuffers, lib.Info().NCCL)
	heal := func(k, chunk, st int) (recovery.Stats, time.Duration) {
		t.Helper()
		if err := buf.Fill(ctx, 0); err != nil {
			t.Fatal(err)
		}
		// ft keeps its staging buffers from one heal to the next; their
		// first allocation (cudaHostAlloc) is timed apart.
		pool := newStagingPool(copier, chunk<<20, stagingBuffers)
		defer func() { pool.close(time.Now().Add(time.Minute)) }()
		t0 := time.Now()
		var puts []func()
		for range min(stagingBuffers, k*st) {
			_, put, err := pool.get(ctx, chunk<<20)
			if err != nil {
				t.Fatal(err)
			}
			puts = append(puts, put)
		}
		for _, put := range puts {
			put()
		}
		alloc := time.Since(t0)
		fc := recovery.DefaultFetchConfig(healJob, healSecret)
		fc.ChunkSize, fc.Streams = chunk<<20, st
		stats, err := recovery.Fetch(ctx, fc, 1, addrs[:k],
			[]recovery.Blob{{Name: "state", Mem: &deviceState{copier: copier, t: buf.Tensor(comm.Uint8), pool: pool}}})
		if err != nil {
			t.Fatalf("fetch from %d sources, chunk %d MiB, %d streams: %v", k, chunk, st, err)
		}
		if err := checkDevice(ctx, lib, buf); err != nil {
			t.Fatalf("fetch from %d sources, chunk %d MiB, %d streams: healed state wrong at %v", k, chunk, st, err)
		}
		return stats, alloc
	}
	// Warm-up (not reported): the sources allocate their staging buffers.
	heal(nSources, slices.Max(chunks), slices.Max(streams))
	t.Logf("defaults: chunk %d MiB, %d streams/source", recovery.DefaultFetchConfig("", nil).ChunkSize>>20, recovery.DefaultFetchConfig("", nil).Streams)
	rounds := envInts(t, "FTCOMM_FT_HEAL_ROUNDS", []int{1})[0]
	for round := 1; round <= rounds; round++ { // rounds interleave the settings
		for _, chunk := range chunks {
			for _, st := range streams {
				for _, k := range []int{1, nSources} { // side by side in one run
					stats, alloc := heal(k, chunk, st)
					t.Logf("FIGURE heal %d MiB from %d source(s), chunk %d MiB, %d streams/source: %.2f GB/s (round %d; %v; staging alloc %v apart; retries %d; MiB per source %v)",
						size>>20, k, chunk, st, stats.Throughput()/1e9, round, stats.Duration.Round(time.Millisecond), alloc.Round(time.Millisecond),
						stats.Retries, perSourceMiB(stats.PerSource))
				}
			}
		}
	}
}

func perSourceMiB(m map[string]int64) []int64 {
	var out []int64
	for _, v := range m {
		out = append(out, v>>20)
	}
	return out
}

// startHealSource runs one source process and returns its address once it
// serves; it is stopped (stdin closed, then killed if need be) at cleanup.
func startHealSource(t *testing.T) (string, error) {
	cmd := exec.Command(os.Args[0], "-test.run", "^TestGPUHealSource$", "-test.v")
	cmd.Env = append(os.Environ(), healSourceEnv+"=1")
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return "", err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return "", err
	}
	if err := cmd.Start(); err != nil {
		return "", err
	}
	done := make(chan struct{})
	addr := make(chan string, 1)
	go func() { // reads the child's output until it exits, then reaps it
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "HEALSOURCE "); ok {
				addr <- a
			}
		}
		io.Copy(io.Discard, stdout)
		cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		stdin.Close()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	select {
	case a := <-addr:
		return a, nil
	case <-done:
		return "", fmt.Errorf("heal source %d exited before serving", cmd.Process.Pid)
	case <-time.After(2 * time.Minute):
		return "", fmt.Errorf("heal source %d did not serve within 2 minutes", cmd.Process.Pid)
	}
}

// TestGPUSpareWarmUp: what a spare's warm-up pays for it while it waits.
// In a fresh process (run it alone), a spare's Comm makes its one-rank
// NCCL comm in the background (the process's first: NCCL loads its
// kernels); then a second one-rank comm is made as a promotion's would
// be, now warm. Both times are printed (FIGURE): their difference is what
// the warm-up takes off the promotion.
func TestGPUSpareWarmUp(t *testing.T) {
	lib := gpuOnly(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	coord := memcoord.New("gpu", quick())
	defer coord.Close()
	cfg := Config{Job: "gpu", Group: "s", Backend: "nccl", BackendConfig: &nccl.Config{Library: lib},
		ControlBackend: "gloo", Secret: []byte("k"), Membership: coord.JoinSpare("s.0", "s", 1), Timeout: time.Minute,
		Spare: true, Logger: zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel))}
	c, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	<-c.d.warm.done
	cold := c.d.warm.took
	if cold <= 0 {
		t.Fatal("the spare's warm-up failed (see its log line)")
	}
	var warm []time.Duration
	for range 3 {
		t0 := time.Now()
		x, err := comm.New(ctx, "nccl", comm.Options{Name: "after-warm-up", Rank: 0, Size: 1, Epoch: 1, JobID: "gpu",
			Secret: []byte("k"), Timeout: time.Minute, BackendConfig: &nccl.Config{Library: lib}})
		if err != nil {
			t.Fatal(err)
		}
		if err := x.Close(); err != nil {
			t.Fatal(err)
		}
		warm = append(warm, time.Since(t0))
	}
	t.Logf("FIGURE a one-rank NCCL comm made and closed: the process's first (the spare's warm-up) %v, then %v (NCCL %s)",
		cold.Round(10*time.Microsecond), warm, lib.Info().NCCL)
}
