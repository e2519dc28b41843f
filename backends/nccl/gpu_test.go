package nccl

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

// The tests in this file run on a machine with NVIDIA GPUs and
// libnccl.so.2, and skip elsewhere (each skips unless the machine has as
// many GPUs as it needs: one for the single-rank tests in gpu1_test.go,
// two for most, three for TestGPUShrinkSecondDeath). To run them:
//
//	CGO_ENABLED=1 go test -c -o nccl.test ./backends/nccl
//	FTCOMM_NCCL_GPU=1 NCCL_NVLS_ENABLE=0 ./nccl.test -test.run GPU -test.v
//
// FTCOMM_NCCL_LIB selects another libnccl (e.g. PyTorch's 2.28.9, which has
// ncclCommRevoke). The fault tests start rank processes (this binary again,
// told its role by FTCOMM_NCCL_ROLE) that rendezvous through an embedded
// etcd, SIGKILL one of them mid-all-reduce, and print FIGURE lines with the
// measured times.

const gpuEnv = "FTCOMM_NCCL_GPU"

const gpuSkip = "GPU tests skipped: set " + gpuEnv + "=1 on a machine with NVIDIA GPUs and libnccl.so.2 " +
	"(CGO_ENABLED=1 go test -c ./backends/nccl; " + gpuEnv + "=1 NCCL_NVLS_ENABLE=0 ./nccl.test -test.run GPU -test.v)"

func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		os.Exit(runRole(role))
	}
	os.Exit(m.Run())
}

// gpuLib opens the real library, or skips the test: without
// FTCOMM_NCCL_GPU=1, or with fewer than need GPUs.
func gpuLib(t *testing.T, need int) *Library {
	t.Helper()
	if os.Getenv(gpuEnv) == "" {
		t.Skip(gpuSkip)
	}
	L, err := Open(LibraryConfig{})
	if err != nil {
		t.Fatalf("%s is set but the library does not load: %v", gpuEnv, err)
	}
	n, err := L.DeviceCount()
	if err != nil {
		t.Fatalf("cudaGetDeviceCount: %v", err)
	}
	if n < need {
		t.Skipf("needs %d GPUs, this machine has %d", need, n)
	}
	return L
}

// figure prints a measurement in a form the run's log is grepped for.
func figure(t *testing.T, name string, d time.Duration) {
	t.Helper()
	t.Logf("FIGURE %s %.3f ms", name, float64(d)/float64(time.Millisecond))
}

func TestGPUInfo(t *testing.T) {
	L := gpuLib(t, 1)
	n, _ := L.DeviceCount()
	t.Logf("%d devices; %s", n, L.Info())
}

func TestGPUCollectives(t *testing.T) {
	L := gpuLib(t, 2)
	ctx := testCtx(t)
	t0 := time.Now()
	ranks := startJob(t, ctx, L, []int{0, 1}, 1, "gpu-coll", nil)
	figure(t, "init+warmup(2 ranks)", time.Since(t0))
	collectiveSuite(t, ctx, ranks, suiteDTypes, 1031, 11)
	t.Run("large", func(t *testing.T) {
		collectiveSuite(t, ctx, ranks, []comm.DType{comm.Float32, comm.BFloat16}, 1<<20+7, 12)
	})
	closeJob(t, ranks)
	t.Run("fallback", func(t *testing.T) {
		fb := startJob(t, ctx, L, []int{0, 1}, 2, "gpu-coll", func(c *Config, o *comm.Options) { c.DisableNativeCollectives = true })
		collectiveSuite(t, ctx, fb, []comm.DType{comm.Float32, comm.Int32}, 1031, 13)
	})
}

func TestGPUReconfigInProcess(t *testing.T) {
	L := gpuLib(t, 2)
	ctx := testCtx(t)
	ranks := startJob(t, ctx, L, []int{0, 1}, 1, "gpu-reconf", nil)
	// Split into two one-rank comms.
	subs := make([]*rank, 2)
	each(t, ranks, func(rk *rank) error {
		c, err := rk.c.Split(ctx, rk.r, 0)
		subs[rk.r] = &rank{r: 0, c: c, L: L, dev: rk.dev}
		return err
	})
	for _, s := range subs {
		if s.c.Size() != 1 {
			t.Fatalf("split comm of size %d", s.c.Size())
		}
		collectiveSuite(t, ctx, []*rank{s}, []comm.DType{comm.Float32}, 257, 21)
	}
	closeJob(t, subs)
	// Healthy shrink: rank 1 leaves, rank 0 shrinks (NCCL_SHRINK_DEFAULT).
	t0 := time.Now()
	nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	figure(t, "healthy-shrink(2->1)+warmup", time.Since(t0))
	ranks[1].c.Close()
	ranks[0].c = nc
	// Grow back: rank 0 grows to 2, a joiner takes GPU 1.
	store := ranks[0].c.Backend().(*Backend).opts.Store
	t0 = time.Now()
	grown := make([]*rank, 2)
	each(t, []*rank{ranks[0], {r: 1}}, func(rk *rank) error {
		if rk.r == 1 {
			c, err := comm.New(ctx, "nccl", comm.Options{Name: "t", Rank: 1, Size: 2, Epoch: 3, Store: store, Prefix: "gpu-reconf",
				Device: 1, BackendConfig: &Config{Library: L}})
			grown[1] = &rank{r: 1, c: c, L: L, dev: 1}
			return err
		}
		c, err := rk.c.Grow(ctx, 2, 3)
		grown[0] = &rank{r: 0, c: c, L: L, dev: 0}
		return err
	})
	figure(t, "grow(1->2)+warmup", time.Since(t0))
	ranks[0].c = grown[0].c
	ranks[1] = grown[1]
	collectiveSuite(t, ctx, grown, []comm.DType{comm.Float32}, 1031, 22)
}

func TestGPUPeerNeverPosts(t *testing.T) {
	L := gpuLib(t, 2)
	ctx := testCtx(t)
	ranks := startJob(t, ctx, L, []int{0, 1}, 1, "gpu-never", func(c *Config, o *comm.Options) { o.Timeout = time.Second })
	x, err := ranks[0].alloc(comm.Float32, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	err = ranks[0].c.AllReduce(ctx, x.t(), comm.Sum)
	figure(t, "peer-never-posts: op failed after", time.Since(t0))
	if !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("all-reduce whose peer never posts: %v, want ErrTimeout", err)
	}
	t0 = time.Now()
	closeJob(t, ranks)
	figure(t, "peer-never-posts: close+release (ncclCommAbort, stream drained)", time.Since(t0))
	for _, rk := range ranks {
		if err := rk.c.Backend().(*Backend).ReleaseErr(); err != nil {
			t.Errorf("rank %d release: %v", rk.r, err)
		}
	}
	x.b.Free()
	// The GPUs still work: a new comm, every collective.
	again := startJob(t, ctx, L, []int{0, 1}, 2, "gpu-never", nil)
	collectiveSuite(t, ctx, again, []comm.DType{comm.Float32}, 1031, 31)
}

// TestGPURevoke compares the Revoke modes on a peer that never posts (in
// one process): Revoke → op failed → Shrink → first collective.
func TestGPURevoke(t *testing.T) {
	L := gpuLib(t, 2)
	modes := []RevokeMode{RevokeDeferred, RevokeAuto} // Auto: native or deferred, as the library allows
	if L.Info().Features.Revoke {
		modes = append(modes, RevokeNative)
	} else {
		t.Logf("NCCL %s has no ncclCommRevoke: only the deferred mode is measured (set %s to NCCL 2.28.7+ for the native one)", L.Info().NCCL, EnvNCCLLib)
	}
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := testCtx(t)
			ranks := startJob(t, ctx, L, []int{0, 1}, 1, "gpu-revoke-"+mode.String(), func(c *Config, o *comm.Options) { c.Revoke = mode })
			x, err := ranks[0].alloc(comm.Float32, 1<<20)
			if err != nil {
				t.Fatal(err)
			}
			defer x.b.Free()
			work := ranks[0].c.AllReduceAsync(ctx, x.t(), comm.Sum)
			b := ranks[0].c.Backend().(*Backend)
			eventually(t, "the op to run", b.opActive.Load)
			t0 := time.Now()
			ranks[0].c.Revoke(errors.New("test: peer declared dead"))
			if err := work.Wait(ctx); !errors.Is(err, comm.ErrRevoked) {
				t.Fatalf("op after Revoke: %v", err)
			}
			figure(t, "revoke("+mode.String()+"): op failed after", time.Since(t0))
			nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
			if err != nil {
				t.Fatal(err)
			}
			figure(t, "revoke("+mode.String()+"): revoke->shrunk+warm", time.Since(t0))
			if err := nc.AllReduce(ctx, x.t(), comm.Sum); err != nil {
				t.Fatal(err)
			}
			figure(t, "revoke("+mode.String()+"): revoke->first collective done", time.Since(t0))
			ranks[0].c = nc
		})
	}
}

// ---- multi-process fault tests ----

const (
	roleEnv     = "FTCOMM_NCCL_ROLE"
	etcdEnv     = "FTCOMM_NCCL_ETCD"
	prefixEnv   = "FTCOMM_NCCL_PREFIX"
	scenarioEnv = "FTCOMM_NCCL_SCENARIO"
)

// faultResult is what the survivor reports.
type faultResult struct {
	KillAt     int64  `json:"kill_at"`   // UnixNano, set by the harness (0 without notification)
	NotifiedAt int64  `json:"notified"`  // when the survivor read the notification
	FailedAt   int64  `json:"failed_at"` // when its all-reduce returned the error
	Err        string `json:"err"`
	Revoked    bool   `json:"revoked"`
	TimedOut   bool   `json:"timed_out"`
	ShrunkAt   int64  `json:"shrunk_at"`  // Shrink returned (includes the warm-up)
	ResumedAt  int64  `json:"resumed_at"` // first collective on the shrunk comm done
	OpsBefore  int    `json:"ops_before"`
	GrownAt    int64  `json:"grown_at"`
	GrowOK     bool   `json:"grow_ok"`
}

// rankEnvs are the environment every rank process gets: NVLink multicast
// stays off in children too.
func rankEnvs(role, etcd, prefix, scenario string) []string {
	return append(os.Environ(), roleEnv+"="+role, etcdEnv+"="+etcd, prefixEnv+"="+prefix, scenarioEnv+"="+scenario,
		"NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1")
}

type proc struct {
	name string
	cmd  *exec.Cmd
	done chan error
}

func startProc(t *testing.T, name string, env []string) *proc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = env
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			fmt.Fprintf(os.Stderr, "[%s] %s\n", name, sc.Text())
		}
		_, _ = io.Copy(io.Discard, out)
		p.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = cmd.Process.Kill() // by pid: only the process this test started
			<-p.done
		}
	})
	return p
}

func (p *proc) wait(t *testing.T, d time.Duration) error {
	t.Helper()
	select {
	case err := <-p.done:
		p.done <- err
		return err
	case <-time.After(d):
		t.Fatalf("%s did not exit within %s", p.name, d)
		return nil
	}
}

func getJSON(t *testing.T, ctx context.Context, s comm.Store, key string, v any) {
	t.Helper()
	b, err := s.Get(ctx, key)
	if err != nil {
		t.Fatalf("waiting for %s: %v", key, err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", key, err)
	}
}

func TestGPUKillShrinkGrow(t *testing.T) { gpuKillTest(t, "notify") }

func TestGPUKillDeadline(t *testing.T) { gpuKillTest(t, "deadline") }

// gpuKillTest: two rank processes all-reduce in a loop; the harness
// SIGKILLs rank 1. With "notify" it then tells the survivor at once (as
// the membership layer would) and, after the survivor has shrunk, starts a
// new process that grows the comm back to 2 ranks; with "deadline" the
// survivor learns of the death from its op's 2 s deadline alone.
func gpuKillTest(t *testing.T, scenario string) {
	gpuLib(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	etcd, err := etcdhost.StartEmbedded(ctx, etcdhost.EmbeddedConfig{UnsafeNoFsync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()
	cli, err := etcd.Client()
	if err != nil {
		t.Fatal(err)
	}
	prefix := "nccl-kill-" + scenario
	store := membership.NewStore(cli, prefix)
	ep := strings.Join(etcd.Endpoints(), ",")
	survivor := startProc(t, "survivor", rankEnvs("survivor", ep, prefix, scenario))
	victim := startProc(t, "victim", rankEnvs("victim", ep, prefix, scenario))
	for _, k := range []string{"ready/0", "ready/1"} {
		if _, err := store.Get(ctx, k); err != nil {
			t.Fatalf("waiting for %s: %v", k, err)
		}
	}
	killAt := time.Now()
	if err := victim.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if scenario == "notify" {
		if err := store.Set(ctx, "notify/kill", []byte(strconv.FormatInt(killAt.UnixNano(), 10))); err != nil {
			t.Fatal(err)
		}
	}
	_ = victim.wait(t, 30*time.Second)
	var res faultResult
	getJSON(t, ctx, store, "result/shrink", &res)
	ms := func(a, b int64) time.Duration { return time.Duration(b - a) }
	k := killAt.UnixNano()
	t.Logf("survivor: %d ops before the kill; op error: %s", res.OpsBefore, res.Err)
	figure(t, scenario+": kill->op failed", ms(k, res.FailedAt))
	if res.NotifiedAt != 0 {
		figure(t, scenario+": notification read->op failed", ms(res.NotifiedAt, res.FailedAt))
	}
	figure(t, scenario+": op failed->shrunk (incl. warm-up)", ms(res.FailedAt, res.ShrunkAt))
	figure(t, scenario+": kill->first collective on the shrunk comm", ms(k, res.ResumedAt))
	switch scenario {
	case "notify":
		if !res.Revoked {
			t.Errorf("survivor's op error %q is not ErrRevoked", res.Err)
		}
	case "deadline":
		if !res.TimedOut {
			t.Errorf("survivor's op error %q is not ErrTimeout", res.Err)
		}
	}
	if res.ResumedAt == 0 {
		t.Fatal("the survivor did not resume on the shrunk comm")
	}
	if scenario == "notify" {
		growAt := time.Now()
		joiner := startProc(t, "joiner", rankEnvs("joiner", ep, prefix, scenario))
		if err := store.Set(ctx, "ctl/grow", []byte("1")); err != nil {
			t.Fatal(err)
		}
		var g faultResult
		getJSON(t, ctx, store, "result/grow", &g)
		figure(t, "grow: joiner started->grown comm verified", ms(growAt.UnixNano(), g.GrownAt))
		if !g.GrowOK {
			t.Error("the grown comm's all-reduce was wrong")
		}
		if err := joiner.wait(t, time.Minute); err != nil {
			t.Errorf("joiner: %v", err)
		}
	}
	if err := survivor.wait(t, time.Minute); err != nil {
		t.Errorf("survivor: %v", err)
	}
}

// ---- the rank processes ----

func runRole(role string) int {
	run := rankMain
	switch {
	case strings.HasPrefix(role, "cycle-"):
		run = cycleMain
	case strings.HasPrefix(role, "death-"):
		run = deathMain
	}
	if err := run(role); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", role, err)
		return 1
	}
	return 0
}

func rankMain(role string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cli, err := membership.NewClient(strings.Split(os.Getenv(etcdEnv), ","), nil)
	if err != nil {
		return err
	}
	defer cli.Close()
	store := membership.NewStore(cli, os.Getenv(prefixEnv))
	scenario := os.Getenv(scenarioEnv)
	L, err := Open(LibraryConfig{})
	if err != nil {
		return err
	}
	log, _ := zap.NewDevelopment()
	opts := func(rank, size int, epoch uint64) comm.Options {
		o := comm.Options{Name: "kill", Rank: rank, Size: size, Epoch: epoch, Store: store, Prefix: "comm",
			Device: rank, Logger: log, BackendConfig: &Config{Library: L}, Timeout: time.Minute}
		if scenario == "deadline" {
			o.Timeout = 2 * time.Second
		}
		return o
	}
	switch role {
	case "victim":
		c, err := comm.New(ctx, "nccl", opts(1, 2, 1))
		if err != nil {
			return err
		}
		buf, err := L.Alloc(1, 64<<20)
		if err != nil {
			return err
		}
		for i := 1; ; i++ {
			if err := c.AllReduce(ctx, buf.Tensor(comm.Float32), comm.Sum); err != nil {
				return err
			}
			if i == 50 {
				if err := store.Set(ctx, "ready/1", nil); err != nil {
					return err
				}
			}
		}
	case "survivor":
		return survivorMain(ctx, L, store, opts, scenario)
	case "joiner":
		c, err := comm.New(ctx, "nccl", opts(1, 2, 3))
		if err != nil {
			return err
		}
		defer c.Close()
		ok, err := checkSum(ctx, L, c, 1)
		if err != nil {
			return err
		}
		if !ok {
			return errors.New("joiner: wrong all-reduce result")
		}
		return c.Barrier(ctx)
	}
	return fmt.Errorf("unknown role %q", role)
}

// checkSum all-reduces 1M float32 where rank r contributes r+1 everywhere,
// and reports whether every element is the expected sum.
func checkSum(ctx context.Context, L *Library, c *comm.Comm, dev int) (bool, error) {
	n := 1 << 20
	buf, err := L.Alloc(dev, 4*n)
	if err != nil {
		return false, err
	}
	defer buf.Free()
	vals := make([]float64, n)
	for i := range vals {
		vals[i] = float64(c.Rank() + 1)
	}
	if err := buf.CopyFromHost(ctx, encode(comm.Float32, vals)); err != nil {
		return false, err
	}
	if err := c.AllReduce(ctx, buf.Tensor(comm.Float32), comm.Sum); err != nil {
		return false, err
	}
	out := make([]byte, 4*n)
	if err := buf.CopyToHost(ctx, out); err != nil {
		return false, err
	}
	want := float64(c.Size() * (c.Size() + 1) / 2)
	return compareVals(decode(comm.Float32, out), func() []float64 {
		for i := range vals {
			vals[i] = want
		}
		return vals
	}(), 0) == nil, nil
}

func survivorMain(ctx context.Context, L *Library, store comm.Store, opts func(int, int, uint64) comm.Options, scenario string) error {
	c, err := comm.New(ctx, "nccl", opts(0, 2, 1))
	if err != nil {
		return err
	}
	buf, err := L.Alloc(0, 64<<20)
	if err != nil {
		return err
	}
	defer buf.Free()
	var res faultResult
	var mu sync.Mutex
	if scenario == "notify" {
		go func() {
			v, err := store.Get(ctx, "notify/kill")
			if err != nil {
				return
			}
			now := time.Now().UnixNano()
			k, _ := strconv.ParseInt(string(v), 10, 64)
			mu.Lock()
			res.NotifiedAt, res.KillAt = now, k
			mu.Unlock()
			c.Revoke(errors.New("membership: rank 1 was killed"))
		}()
	}
	var opErr error
	var t10 time.Time
	var s10 Stats
	for i := 1; ; i++ {
		if i == 10 {
			t10, s10 = time.Now(), c.Backend().(*Backend).Stats()
		}
		if i == 50 {
			s := c.Backend().(*Backend).Stats()
			n := float64(s.Ops - s10.Ops)
			fmt.Fprintf(os.Stderr, "64 MiB all-reduce, 2 processes: %.1f us per op (enqueue %.1f us, async polling %.1f us, wait %.1f us, %d in progress)\n",
				float64(time.Since(t10).Microseconds())/40, float64((s.Enqueue-s10.Enqueue).Microseconds())/n,
				float64((s.Settle-s10.Settle).Microseconds())/n, float64((s.Wait-s10.Wait).Microseconds())/n, s.InProgress-s10.InProgress)
		}
		if opErr = c.AllReduce(ctx, buf.Tensor(comm.Float32), comm.Sum); opErr != nil {
			mu.Lock()
			res.FailedAt, res.OpsBefore = time.Now().UnixNano(), i-1
			mu.Unlock()
			break
		}
		if i == 50 {
			if err := store.Set(ctx, "ready/0", nil); err != nil {
				return err
			}
		}
	}
	mu.Lock()
	res.Err = opErr.Error()
	res.Revoked = errors.Is(opErr, comm.ErrRevoked)
	res.TimedOut = errors.Is(opErr, comm.ErrTimeout)
	mu.Unlock()
	nc, err := c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		return err
	}
	res.ShrunkAt = time.Now().UnixNano()
	if err := nc.AllReduce(ctx, buf.Tensor(comm.Float32), comm.Sum); err != nil {
		return err
	}
	res.ResumedAt = time.Now().UnixNano()
	ok, err := checkSum(ctx, L, nc, 0)
	if err != nil || !ok {
		return fmt.Errorf("shrunk comm all-reduce: ok=%v err=%v", ok, err)
	}
	mu.Lock()
	b, _ := json.Marshal(res)
	mu.Unlock()
	if err := store.Set(ctx, "result/shrink", b); err != nil {
		return err
	}
	if scenario != "notify" {
		return nc.Close()
	}
	// Grow back to 2 when told; the joiner is rank 1.
	if _, err := store.Get(ctx, "ctl/grow"); err != nil {
		return err
	}
	gc, err := nc.Grow(ctx, 2, 3)
	if err != nil {
		return err
	}
	defer gc.Close()
	ok, err = checkSum(ctx, L, gc, 0)
	if err != nil {
		return err
	}
	g := faultResult{GrownAt: time.Now().UnixNano(), GrowOK: ok}
	b, _ = json.Marshal(g)
	if err := store.Set(ctx, "result/grow", b); err != nil {
		return err
	}
	return gc.Barrier(ctx)
}
