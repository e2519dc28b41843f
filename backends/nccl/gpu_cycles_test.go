package nccl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

// The kill-shrink-grow cycle soak. FTCOMM_NCCL_RANKS (default 2) rank
// processes, one per GPU: ranks 0..n-2 survive all FTCOMM_NCCL_CYCLES
// (default 20) cycles; rank n-1 is a victim. In each cycle the ranks
// all-reduce until the harness SIGKILLs the victim mid-all-reduce and
// notifies the survivors (as membership would); they shrink to n-1 ranks,
// check a collective, and grow back to n with a new victim process. Every
// rank checks every verified all-reduce is exact, and the 256 MiB
// all-reduce bandwidth is measured before the first kill and after the
// last grow. FTCOMM_NCCL_ONE_RANK=nccl makes a lone survivor's comm an
// NCCL comm of one rank (ncclCommShrink), as before the default's device
// copies, for a side-by-side run; FTCOMM_NCCL_SHRINK=split makes a shrink
// to two or more ranks split its data comm off the shrunk control comm,
// as before the default's data comm made by the shrink itself.

const (
	cyclesEnv     = "FTCOMM_NCCL_CYCLES"
	cycleEpochEnv = "FTCOMM_NCCL_EPOCH"
	cycleRanksEnv = "FTCOMM_NCCL_RANKS"
	cycleRankEnv  = "FTCOMM_NCCL_RANK"
)

func cycleRanks() int {
	if n, err := strconv.Atoi(os.Getenv(cycleRanksEnv)); err == nil && n >= 2 {
		return n
	}
	return 2
}

type cycleResult struct {
	Cycle      int      `json:"cycle"`
	NotifiedAt int64    `json:"notified"`
	FailedAt   int64    `json:"failed_at"`
	Revoked    bool     `json:"revoked"`
	ShrunkAt   int64    `json:"shrunk_at"`
	ResumedAt  int64    `json:"resumed_at"`
	ShrinkOK   bool     `json:"shrink_ok"`
	GrownAt    int64    `json:"grown_at"`
	GrowOK     bool     `json:"grow_ok"`
	BusBW      float64  `json:"busbw"`  // GB/s at 256 MiB, in result/before and result/after
	Shrunk     Creation `json:"shrunk"` // how the shrunk comm was made, phase by phase
	Grown      Creation `json:"grown"`
}

func cycleCount() int {
	if n, err := strconv.Atoi(os.Getenv(cyclesEnv)); err == nil && n > 0 {
		return n
	}
	return 20
}

func TestGPUKillCycles(t *testing.T) {
	n := cycleRanks()
	if have, _ := gpuLib(t, n).DeviceCount(); have < n {
		t.Fatalf("%s=%d but only %d GPUs", cycleRanksEnv, n, have)
	}
	cycles := cycleCount()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
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
	const prefix = "nccl-cycles"
	store := membership.NewStore(cli, prefix)
	ep := strings.Join(etcd.Endpoints(), ",")
	env := func(role string, rank, epoch int) []string {
		return append(rankEnvs(role, ep, prefix, "cycles"), cyclesEnv+"="+strconv.Itoa(cycles), cycleEpochEnv+"="+strconv.Itoa(epoch),
			cycleRanksEnv+"="+strconv.Itoa(n), cycleRankEnv+"="+strconv.Itoa(rank))
	}
	var survivors []*proc
	for r := range n - 1 {
		survivors = append(survivors, startProc(t, fmt.Sprintf("survivor%d", r), env("cycle-survivor", r, 1)))
	}
	victim := startProc(t, "victim0", env("cycle-victim", n-1, 1))
	var detect, shrink, resume, grow []time.Duration
	phases := map[string][]time.Duration{} // the slowest survivor's, per cycle
	var how []string
	for k := range cycles {
		for r := range n {
			if _, err := store.Get(ctx, fmt.Sprintf("ready/%d/%d", k, r)); err != nil {
				t.Fatalf("cycle %d: waiting for rank %d: %v", k, r, err)
			}
		}
		killAt := time.Now()
		if err := victim.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		if err := store.Set(ctx, fmt.Sprintf("notify/%d", k), []byte(strconv.FormatInt(killAt.UnixNano(), 10))); err != nil {
			t.Fatal(err)
		}
		_ = victim.wait(t, 30*time.Second)
		// Per cycle: the slowest survivor's times.
		var worstDetect, worstShrink, worstResume time.Duration
		worst := map[string]time.Duration{}
		for r := range n - 1 {
			var res cycleResult
			getJSON(t, ctx, store, fmt.Sprintf("result/%d/shrink/%d", k, r), &res)
			if !res.Revoked || !res.ShrinkOK {
				t.Errorf("cycle %d rank %d: revoked %v, shrunk comm's all-reduce right %v", k, r, res.Revoked, res.ShrinkOK)
			}
			m := res.Shrunk
			for name, d := range map[string]time.Duration{"shrink: agree": m.Agree, "shrink: call": m.Call,
				"shrink: ready": m.Ready, "shrink: data split": m.DataSplit, "shrink: warm-up": m.WarmUp,
				"shrink: first collective": time.Duration(res.ResumedAt - res.ShrunkAt)} {
				worst[name] = max(worst[name], d)
			}
			if r == 0 {
				how = append(how, m.How)
			}
			worstDetect = max(worstDetect, time.Duration(res.FailedAt-res.NotifiedAt))
			worstShrink = max(worstShrink, time.Duration(res.ShrunkAt-res.FailedAt))
			worstResume = max(worstResume, time.Duration(res.ResumedAt-killAt.UnixNano()))
		}
		detect, shrink, resume = append(detect, worstDetect), append(shrink, worstShrink), append(resume, worstResume)
		for name, d := range worst {
			phases[name] = append(phases[name], d)
		}
		growAt := time.Now()
		victim = startProc(t, fmt.Sprintf("victim%d", k+1), env("cycle-victim", n-1, 3+2*k))
		if err := store.Set(ctx, fmt.Sprintf("ctl/grow/%d", k), nil); err != nil {
			t.Fatal(err)
		}
		var worstGrow time.Duration
		for r := range n - 1 {
			var res cycleResult
			getJSON(t, ctx, store, fmt.Sprintf("result/%d/grow/%d", k, r), &res)
			if !res.GrowOK {
				t.Errorf("cycle %d rank %d: the grown comm's all-reduce was wrong", k, r)
			}
			worstGrow = max(worstGrow, time.Duration(res.GrownAt-growAt.UnixNano()))
			m := res.Grown
			for name, d := range map[string]time.Duration{"grow: agree": m.Agree, "grow: init (rendezvous + call)": m.Call,
				"grow: ready": m.Ready, "grow: data split": m.DataSplit, "grow: warm-up": m.WarmUp} {
				worst[name] = max(worst[name], d)
			}
		}
		grow = append(grow, worstGrow)
		for _, name := range []string{"grow: agree", "grow: init (rendezvous + call)", "grow: ready", "grow: data split", "grow: warm-up"} {
			phases[name] = append(phases[name], worst[name])
		}
	}
	var before, after cycleResult
	getJSON(t, ctx, store, "result/before", &before)
	getJSON(t, ctx, store, "result/after", &after)
	for _, p := range append(survivors, victim) {
		if err := p.wait(t, time.Minute); err != nil {
			t.Errorf("%s: %v", p.name, err)
		}
	}
	pct := func(name string, ds []time.Duration) {
		s := slices.Clone(ds)
		slices.Sort(s)
		p := func(q float64) time.Duration { return s[min(len(s)-1, int(q*float64(len(s))))] }
		t.Logf("FIGURE ranks=%d cycles=%d %s: p50 %.3f ms, p99 %.3f ms, max %.3f ms", n, len(s), name,
			float64(p(0.5))/1e6, float64(p(0.99))/1e6, float64(s[len(s)-1])/1e6)
	}
	pct("notification read->op failed", detect)
	pct("op failed->shrunk (incl. warm-up)", shrink)
	pct("kill->first collective on the shrunk comm", resume)
	pct("joiner started->grown comm verified", grow)
	names := slices.Sorted(maps.Keys(phases))
	for _, name := range names {
		pct(name, phases[name])
	}
	t.Logf("FIGURE ranks=%d shrinks made by: %s", n, strings.Join(slices.Compact(slices.Sorted(slices.Values(how))), ", "))
	t.Logf("FIGURE ranks=%d 256 MiB all-reduce busbw before the first kill %.1f GB/s, after the last grow %.1f GB/s", n, before.BusBW, after.BusBW)
}

// cycleMain runs the survivor or a victim of the cycle soak.
func cycleMain(role string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 7*time.Minute)
	defer cancel()
	cli, err := membership.NewClient(strings.Split(os.Getenv(etcdEnv), ","), nil)
	if err != nil {
		return err
	}
	defer cli.Close()
	store := membership.NewStore(cli, os.Getenv(prefixEnv))
	L, err := Open(LibraryConfig{})
	if err != nil {
		return err
	}
	log, _ := zap.NewProduction()
	cycles, n := cycleCount(), cycleRanks()
	epoch, _ := strconv.Atoi(os.Getenv(cycleEpochEnv))
	rank, _ := strconv.Atoi(os.Getenv(cycleRankEnv))
	opts := func(rank, size int, epoch uint64) comm.Options {
		return comm.Options{Name: "cycles", Rank: rank, Size: size, Epoch: epoch, Store: store, Prefix: "comm",
			Device: rank, Logger: log, Timeout: time.Minute,
			BackendConfig: &Config{Library: L, DisableLocalOneRank: os.Getenv("FTCOMM_NCCL_ONE_RANK") == "nccl",
				DisableShrinkToData: os.Getenv("FTCOMM_NCCL_SHRINK") == "split"}}
	}
	dev := rank
	buf, err := L.Alloc(dev, 64<<20)
	if err != nil {
		return err
	}
	defer buf.Free()
	big, err := L.Alloc(dev, 256<<20)
	if err != nil {
		return err
	}
	defer big.Free()
	// busbw times 20 all-reduces of 256 MiB after 5 to warm up.
	busbw := func(c *comm.Comm) (float64, error) {
		for range 5 {
			if err := c.AllReduce(ctx, big.Tensor(comm.Float32), comm.Sum); err != nil {
				return 0, err
			}
		}
		if err := c.Barrier(ctx); err != nil {
			return 0, err
		}
		t0 := time.Now()
		for range 20 {
			if err := c.AllReduce(ctx, big.Tensor(comm.Float32), comm.Sum); err != nil {
				return 0, err
			}
		}
		per := time.Since(t0) / 20
		n := float64(c.Size())
		return float64(256<<20) / per.Seconds() / 1e9 * 2 * (n - 1) / n, nil
	}
	// loop all-reduces until it fails (the victim: until it is killed),
	// saying "ready" after 20 ops.
	loop := func(c *comm.Comm, k, rank int) error {
		for i := 1; ; i++ {
			if err := c.AllReduce(ctx, buf.Tensor(comm.Float32), comm.Sum); err != nil {
				return err
			}
			if i == 20 {
				if err := store.Set(ctx, fmt.Sprintf("ready/%d/%d", k, rank), nil); err != nil {
					return err
				}
			}
		}
	}
	if role == "cycle-victim" {
		c, err := comm.New(ctx, "nccl", opts(rank, n, uint64(epoch)))
		if err != nil {
			return err
		}
		defer c.Close()
		k := (epoch - 1) / 2
		if epoch > 1 { // joined by a grow: the survivor checks the grown comm first
			if _, err := checkSum(ctx, L, c, dev); err != nil {
				return err
			}
		}
		if epoch == 1 || k == cycles {
			if _, err := busbw(c); err != nil {
				return err
			}
		}
		if k == cycles {
			return c.Barrier(ctx)
		}
		return loop(c, k, rank) // until killed
	}

	c, err := comm.New(ctx, "nccl", opts(rank, n, 1))
	if err != nil {
		return err
	}
	bw, err := busbw(c)
	if err != nil {
		return err
	}
	b, _ := json.Marshal(cycleResult{BusBW: bw})
	if rank == 0 {
		if err := store.Set(ctx, "result/before", b); err != nil {
			return err
		}
	}
	e := uint64(1)
	for k := range cycles {
		var r cycleResult
		r.Cycle = k
		notified := make(chan int64, 1)
		go func(c *comm.Comm) {
			if _, err := store.Get(ctx, fmt.Sprintf("notify/%d", k)); err != nil {
				return
			}
			notified <- time.Now().UnixNano()
			c.Revoke(fmt.Errorf("membership: the victim of cycle %d was killed", k))
		}(c)
		opErr := loop(c, k, rank)
		r.FailedAt = time.Now().UnixNano()
		r.NotifiedAt = <-notified
		r.Revoked = errors.Is(opErr, comm.ErrRevoked)
		nc, err := c.Shrink(ctx, []int{n - 1}, e+1)
		if err != nil {
			return fmt.Errorf("cycle %d: shrink: %w", k, err)
		}
		r.ShrunkAt = time.Now().UnixNano()
		r.Shrunk = nc.Backend().(*Backend).Creation()
		if err := nc.AllReduce(ctx, buf.Tensor(comm.Float32), comm.Sum); err != nil {
			return fmt.Errorf("cycle %d: first collective after shrink: %w", k, err)
		}
		r.ResumedAt = time.Now().UnixNano()
		if r.ShrinkOK, err = checkSum(ctx, L, nc, dev); err != nil {
			return err
		}
		b, _ := json.Marshal(r)
		if err := store.Set(ctx, fmt.Sprintf("result/%d/shrink/%d", k, rank), b); err != nil {
			return err
		}
		if _, err := store.Get(ctx, fmt.Sprintf("ctl/grow/%d", k)); err != nil {
			return err
		}
		gc, err := nc.Grow(ctx, n, e+2)
		if err != nil {
			return fmt.Errorf("cycle %d: grow: %w", k, err)
		}
		if r.GrowOK, err = checkSum(ctx, L, gc, dev); err != nil {
			return err
		}
		r.GrownAt = time.Now().UnixNano()
		r.Grown = gc.Backend().(*Backend).Creation()
		b, _ = json.Marshal(r)
		if err := store.Set(ctx, fmt.Sprintf("result/%d/grow/%d", k, rank), b); err != nil {
			return err
		}
		c, e = gc, e+2
	}
	defer c.Close()
	if bw, err = busbw(c); err != nil {
		return err
	}
	if rank == 0 {
		b, _ = json.Marshal(cycleResult{BusBW: bw})
		if err := store.Set(ctx, "result/after", b); err != nil {
			return err
		}
	}
	return c.Barrier(ctx)
}
