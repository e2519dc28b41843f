package ft

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl"
)

// childDevice is a replica process's state on a GPU: its parameters (the
// registered state) and gradients (the all-reduce's buffer), with the
// optimizer step taken on the host.
type childDevice struct {
	lib           *nccl.Library
	params, grads *nccl.DeviceBuffer
}

func openChildDevice(dev, n int) (*childDevice, error) {
	lib, err := nccl.Open(nccl.LibraryConfig{})
	if err != nil {
		return nil, err
	}
	d := &childDevice{lib: lib}
	if d.params, err = lib.Alloc(dev, 4*n); err != nil {
		return nil, err
	}
	if d.grads, err = lib.Alloc(dev, 4*n); err != nil {
		return nil, err
	}
	return d, nil
}

// load copies the host parameters to the device.
func (d *childDevice) load(ctx context.Context, params []float32) error {
	return d.params.CopyFromHost(ctx, f32bytes(params))
}

// stepIn starts a step: the host parameters from the device (a heal may
// have written them), the gradients to it.
func (d *childDevice) stepIn(ctx context.Context, params, grads []float32) error {
	b := make([]byte, 4*len(params))
	if err := d.params.CopyToHost(ctx, b); err != nil {
		return err
	}
	copy(params, f32s(b))
	return d.grads.CopyFromHost(ctx, f32bytes(grads))
}

// stepOut reads the all-reduced gradients back.
func (d *childDevice) stepOut(ctx context.Context, grads []float32) error {
	b := make([]byte, 4*len(grads))
	if err := d.grads.CopyToHost(ctx, b); err != nil {
		return err
	}
	copy(grads, f32s(b))
	return nil
}

// TestKillCycles SIGKILLs one replica process after another, restarting
// each, and measures the time from the kill to the survivors' next commit
// (without the dead replica); every committed step must hold the same
// state everywhere, and each restarted replica must heal and rejoin. It is
// a measurement (its FIGURE lines), run on demand:
//
//	FTCOMM_FT_KILL_CYCLES=10 go test -run TestKillCycles -v ./ft                  # gloo, 4 replicas
//	FTCOMM_FT_KILL_CYCLES=20 FTCOMM_FT_KILL_BACKEND=nccl ./ft.test -test.run TestKillCycles -test.v  # a replica per GPU
//
// FTCOMM_FT_KILL_REPLICAS (default 4, or one per GPU) and
// FTCOMM_FT_KILL_PARAMS (float32 state per replica, default 1 Mi) tune it.
func TestKillCycles(t *testing.T) {
	cycles, _ := strconv.Atoi(os.Getenv("FTCOMM_FT_KILL_CYCLES"))
	if cycles <= 0 {
		t.Skip("a measurement: set FTCOMM_FT_KILL_CYCLES")
	}
	backend := os.Getenv("FTCOMM_FT_KILL_BACKEND")
	replicas, _ := strconv.Atoi(os.Getenv("FTCOMM_FT_KILL_REPLICAS"))
	params, _ := strconv.Atoi(os.Getenv("FTCOMM_FT_KILL_PARAMS"))
	params = max(params, 0)
	if params == 0 {
		params = 1 << 20
	}
	if backend == "nccl" {
		lib, err := nccl.Open(nccl.LibraryConfig{})
		if err != nil {
			t.Fatal(err)
		}
		n, err := lib.DeviceCount()
		if err != nil || n < 2 {
			t.Skipf("%d GPUs (%v): the kill cycles need two", n, err)
		}
		if replicas == 0 || replicas > n {
			replicas = n
		}
		t.Logf("NCCL %s, %d GPUs", lib.Info().NCCL, n)
	} else {
		backend = "gloo"
	}
	if replicas < 2 {
		replicas = 4
	}
	j := newProcJob(t)
	groups := make([]string, replicas)
	spawn := func(i int) {
		j.spawnCmd(childCmd(), groups[i], 0, 1, params, "FTCOMM_FT_BACKEND="+backend, "FTCOMM_FT_DEVICE="+strconv.Itoa(i))
	}
	for i := range groups {
		groups[i] = string(rune('a' + i))
		spawn(i)
	}
	together := func(what string, since time.Time) {
		seen := map[string]bool{}
		j.await(what, func(ev childEvent) bool {
			if ev.Kind == "" && ev.Participants == replicas && time.Unix(0, ev.UnixNano).After(since) {
				seen[ev.ID] = true
			}
			return len(seen) == replicas
		})
	}
	together("every replica committing together", time.Time{})
	var perKill, perSurvivor []time.Duration
	for cycle := range cycles {
		victim := cycle % replicas
		id := memberID(groups[victim], 0)
		t0 := j.kill(id)
		got := map[string]time.Duration{}
		j.await(fmt.Sprintf("cycle %d: the survivors' next commits without %s", cycle, id), func(ev childEvent) bool {
			at := time.Unix(0, ev.UnixNano)
			if ev.Kind == "" && ev.ID != id && ev.Participants == replicas-1 && at.After(t0) {
				if _, ok := got[ev.ID]; !ok {
					got[ev.ID] = at.Sub(t0)
				}
			}
			return len(got) == replicas-1
		})
		var worst time.Duration
		for _, d := range got {
			perSurvivor = append(perSurvivor, d)
			worst = max(worst, d)
		}
		perKill = append(perKill, worst)
		t.Logf("cycle %d: SIGKILL %s → survivors' next commit in %v (%v)", cycle, id, worst.Round(time.Millisecond), got)
		restarted := time.Now()
		spawn(victim)
		together(fmt.Sprintf("cycle %d: %s healed and committing with the others", cycle, id), restarted)
	}
	j.stopAll()
	j.check()
	pct := func(ds []time.Duration, p float64) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[min(len(s)-1, int(p*float64(len(s))))].Round(time.Millisecond)
	}
	t.Logf("FIGURE %s, %d replicas, %d kills, %d float32 per replica: kill → survivors' next commit (all of them) p50 %v p99 %v max %v; per survivor p50 %v p99 %v",
		backend, replicas, cycles, params, pct(perKill, 0.5), pct(perKill, 0.99), pct(perKill, 1), pct(perSurvivor, 0.5), pct(perSurvivor, 0.99))
}
