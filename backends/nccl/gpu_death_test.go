package nccl

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
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

// A second rank dies during a reconfiguration: the survivor's Shrink or
// Grow must return by its deadline (reconfigDeadline), its comm must be
// released by Close, and the GPU must still work. Rank processes, one per
// GPU, rendezvous through an embedded etcd as in gpuKillTest.
//
//	shrink (3 GPUs): ranks 0 and 1 survive a SIGKILL of rank 2 and shrink;
//	                 rank 1 is SIGKILLed as it starts its Shrink.
//	grow   (2 GPUs): rank 0 grows its one-rank comm to two; the joiner is
//	                 SIGKILLed as it starts its init.

const reconfigDeadline = 5 * time.Second

type deathResult struct {
	Err      string `json:"err"`       // the reconfiguration's error
	Took     int64  `json:"took"`      // how long it took to fail, ns
	Released int64  `json:"released"`  // Close → Released, ns (-1: not within ReleaseTimeout)
	GPUOK    bool   `json:"gpu_ok"`    // a fresh one-rank comm all-reduced correctly afterwards
	Returned bool   `json:"returned"`  // the call returned (with an error) at all
	OpErr    string `json:"op_err"`    // the op the first death failed (shrink)
	Mode     string `json:"comm_mode"` // the nccl.Mode under test
}

func TestGPUShrinkSecondDeath(t *testing.T) { gpuDeathTest(t, "shrink", 3) }

func TestGPUGrowJoinerDies(t *testing.T) { gpuDeathTest(t, "grow", 2) }

func gpuDeathTest(t *testing.T, scenario string, gpus int) {
	gpuLib(t, gpus)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
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
	prefix := "nccl-death-" + scenario
	store := membership.NewStore(cli, prefix)
	ep := strings.Join(etcd.Endpoints(), ",")
	env := func(role string, rank int) []string {
		return append(rankEnvs(role, ep, prefix, scenario), cycleRankEnv+"="+strconv.Itoa(rank))
	}
	survivor := startProc(t, "survivor", env("death-survivor", 0))
	switch scenario {
	case "shrink":
		second := startProc(t, "second", env("death-second", 1))
		victim := startProc(t, "victim", env("death-victim", 2))
		for r := range 3 {
			if _, err := store.Get(ctx, fmt.Sprintf("ready/%d", r)); err != nil {
				t.Fatal(err)
			}
		}
		if err := victim.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		if err := store.Set(ctx, "notify/kill", nil); err != nil {
			t.Fatal(err)
		}
		if _, err := store.Get(ctx, "shrinking/1"); err != nil {
			t.Fatal(err)
		}
		if err := second.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	case "grow":
		if _, err := store.Get(ctx, "ready/0"); err != nil {
			t.Fatal(err)
		}
		joiner := startProc(t, "joiner", env("death-joiner", 1))
		if err := store.Set(ctx, "ctl/grow", nil); err != nil {
			t.Fatal(err)
		}
		if _, err := store.Get(ctx, "joining/1"); err != nil {
			t.Fatal(err)
		}
		if err := joiner.cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
	var res deathResult
	getJSON(t, ctx, store, "result/death", &res)
	t.Logf("%s (%s): %s failed after %s: %s", scenario, res.Mode, scenario, time.Duration(res.Took), res.Err)
	figure(t, scenario+": second death -> reconfiguration returned", time.Duration(res.Took))
	figure(t, scenario+": close -> released", time.Duration(res.Released))
	if !res.Returned || time.Duration(res.Took) > reconfigDeadline+2*time.Second {
		t.Errorf("the %s did not return by its %s deadline (took %s)", scenario, reconfigDeadline, time.Duration(res.Took))
	}
	if res.Released < 0 {
		t.Error("the comm was not released within ReleaseTimeout after Close")
	}
	if !res.GPUOK {
		t.Error("the GPU did not serve a fresh comm afterwards")
	}
	if err := survivor.wait(t, time.Minute); err != nil {
		t.Errorf("survivor: %v", err)
	}
}

// deathMain runs a rank of gpuDeathTest.
func deathMain(role string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Second)
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
	log, _ := zap.NewDevelopment()
	rank, _ := strconv.Atoi(os.Getenv(cycleRankEnv))
	cfg := DefaultConfig()
	cfg.Library = L
	opts := func(rank, size int, epoch uint64) comm.Options {
		return comm.Options{Name: "death", Rank: rank, Size: size, Epoch: epoch, Store: store, Prefix: "comm",
			Device: rank, Logger: log, BackendConfig: &cfg, Timeout: time.Minute}
	}
	buf, err := L.Alloc(rank, 16<<20)
	if err != nil {
		return err
	}
	defer buf.Free()
	loop := func(c *comm.Comm) error {
		for i := 1; ; i++ {
			if err := c.AllReduce(ctx, buf.Tensor(comm.Float32), comm.Sum); err != nil {
				return err
			}
			if i == 20 {
				if err := store.Set(ctx, fmt.Sprintf("ready/%d", rank), nil); err != nil {
					return err
				}
			}
		}
	}
	switch role {
	case "death-victim":
		c, err := comm.New(ctx, "nccl", opts(rank, 3, 1))
		if err != nil {
			return err
		}
		return loop(c) // until killed
	case "death-joiner":
		if err := store.Set(ctx, "joining/1", nil); err != nil {
			return err
		}
		c, err := comm.New(ctx, "nccl", opts(1, 2, 2)) // killed in here
		if err == nil {
			c.Close()
		}
		return err
	case "death-second", "death-survivor":
	default:
		return fmt.Errorf("unknown role %q", role)
	}
	res := deathResult{Mode: cfg.Mode.String()}
	var c *comm.Comm
	var reconfig func(context.Context) (*comm.Comm, error)
	if os.Getenv(scenarioEnv) == "shrink" {
		if c, err = comm.New(ctx, "nccl", opts(rank, 3, 1)); err != nil {
			return err
		}
		go func() {
			if _, err := store.Get(ctx, "notify/kill"); err == nil {
				c.Revoke(errors.New("membership: rank 2 was killed"))
			}
		}()
		opErr := loop(c)
		res.OpErr = opErr.Error()
		if err := store.Set(ctx, fmt.Sprintf("shrinking/%d", rank), nil); err != nil {
			return err
		}
		reconfig = func(ctx context.Context) (*comm.Comm, error) { return c.Shrink(ctx, []int{2}, 2) }
	} else {
		if c, err = comm.New(ctx, "nccl", opts(0, 1, 1)); err != nil {
			return err
		}
		if err := store.Set(ctx, "ready/0", nil); err != nil {
			return err
		}
		if _, err := store.Get(ctx, "ctl/grow"); err != nil {
			return err
		}
		reconfig = func(ctx context.Context) (*comm.Comm, error) { return c.Grow(ctx, 2, 2) }
	}
	rctx, rcancel := context.WithTimeout(ctx, reconfigDeadline)
	t0 := time.Now()
	nc, err := reconfig(rctx)
	rcancel()
	res.Took, res.Returned = int64(time.Since(t0)), true
	if role == "death-second" {
		return nil // killed before it gets here, or its peer is gone: nothing to report
	}
	if err == nil {
		nc.Close()
		err = errors.New("succeeded without its peer")
	}
	res.Err = err.Error()
	b := c.Backend().(*Backend)
	t1 := time.Now()
	c.Close()
	select {
	case <-b.Released():
		res.Released = int64(time.Since(t1))
	case <-time.After(cfg.ReleaseTimeout + 5*time.Second):
		res.Released = -1
	}
	fresh, err := comm.New(ctx, "nccl", comm.Options{Name: "after", Rank: 0, Size: 1, Device: rank, BackendConfig: &cfg})
	if err == nil {
		res.GPUOK, err = checkSum(ctx, L, fresh, rank)
		fresh.Close()
	}
	if err != nil {
		res.Err += "; fresh comm: " + err.Error()
	}
	b2, _ := json.Marshal(res)
	return store.Set(ctx, "result/death", b2)
}
