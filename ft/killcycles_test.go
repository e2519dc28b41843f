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
// FTCOMM_FT_KILL_REPLICAS (default 4, or as many as the GPUs hold) and
// FTCOMM_FT_KILL_PARAMS (float32 state per process, default 1 Mi) tune it.
// FTCOMM_FT_KILL_GROUP_SIZE=2 makes each replica a group of two ranks
// (HSDP: one process and GPU per rank): a cycle kills one rank, the other
// groups commit without its group, then the whole group restarts, heals
// both shards and rejoins. FTCOMM_FT_KILL_DOUBLE=N kills two replicas at
// once in N of the cycles (every other one from the second; 3 or more
// replicas). FTCOMM_FT_KILL_WHOLE_GROUP=1 SIGKILLs every rank of a
// victim's group at once (the killed rank first, then its group-mates),
// as torchrun's agent ends a worker group, instead of the rest of the
// group after the survivors' commit. FTCOMM_FT_NCCL_ONE_RANK=nccl gives a
// lone survivor an NCCL comm of one rank (ncclCommShrink) instead of the
// default device copies, and FTCOMM_FT_NCCL_SHRINK=split makes a shrink to
// two or more ranks split its data comm off the shrunk control comm
// instead of making it as the shrink's child, for side-by-side runs
// (bench/faultpath.sh runs both).
func TestKillCycles(t *testing.T) {
	cycles, _ := strconv.Atoi(os.Getenv("FTCOMM_FT_KILL_CYCLES"))
	if cycles <= 0 {
		t.Skip("a measurement: set FTCOMM_FT_KILL_CYCLES")
	}
	backend := os.Getenv("FTCOMM_FT_KILL_BACKEND")
	replicas, _ := strconv.Atoi(os.Getenv("FTCOMM_FT_KILL_REPLICAS"))
	params, _ := strconv.Atoi(os.Getenv("FTCOMM_FT_KILL_PARAMS"))
	groupSize, _ := strconv.Atoi(os.Getenv("FTCOMM_FT_KILL_GROUP_SIZE"))
	doubles, _ := strconv.Atoi(os.Getenv("FTCOMM_FT_KILL_DOUBLE"))
	wholeGroup := os.Getenv("FTCOMM_FT_KILL_WHOLE_GROUP") == "1"
	groupSize = max(groupSize, 1)
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
		if err != nil || n < 2*groupSize {
			t.Skipf("%d GPUs (%v): the kill cycles need %d", n, err, 2*groupSize)
		}
		if replicas == 0 || replicas*groupSize > n {
			replicas = n / groupSize
		}
		t.Logf("NCCL %s, %d GPUs", lib.Info().NCCL, n)
	} else {
		backend = "gloo"
	}
	if replicas < 2 {
		replicas = 4
	}
	if doubles > 0 && replicas < 3 {
		t.Fatalf("two kills at once need 3 or more replicas, not %d", replicas)
	}
	j := newProcJob(t)
	groups := make([]string, replicas)
	spawn := func(g int) {
		for r := range groupSize {
			j.spawnCmd(childCmd(), groups[g], r, groupSize, params, "FTCOMM_FT_BACKEND="+backend,
				"FTCOMM_FT_DEVICE="+strconv.Itoa(g*groupSize+r))
		}
	}
	for g := range groups {
		groups[g] = string(rune('a' + g))
		spawn(g)
	}
	procs := replicas * groupSize
	var heals []childEvent
	var rejoins []time.Duration // restart → the restarted ranks committing with the others
	together := func(what string, since time.Time) {
		seen := map[string]bool{}
		j.await(what, func(ev childEvent) bool {
			at := time.Unix(0, ev.UnixNano)
			switch {
			case ev.Kind == "heal" && at.After(since):
				heals = append(heals, ev)
			case ev.Kind == "" && ev.Participants == replicas && at.After(since):
				seen[ev.ID] = true
			}
			return len(seen) == procs
		})
	}
	together("every replica committing together", time.Time{})
	var perKill, perSurvivor []time.Duration
	double := 0
	for cycle := range cycles {
		victims := []int{cycle % replicas}
		if double < doubles && cycle%2 == 1 {
			double++
			victims = append(victims, (cycle+1)%replicas)
		}
		var t0 time.Time
		var ids []string
		dead := map[string]bool{}
		for _, g := range victims {
			rank := cycle / replicas % groupSize // alternate the rank killed
			id := memberID(groups[g], rank)
			ids = append(ids, id)
			if at := j.kill(id); t0.IsZero() {
				t0 = at
			}
			dead[groups[g]] = true
		}
		if wholeGroup {
			for _, g := range victims {
				for r := range groupSize {
					if id := memberID(groups[g], r); !slices.Contains(ids, id) {
						j.kill(id)
						ids = append(ids, id)
					}
				}
			}
		}
		got := map[string]time.Duration{}
		want := (replicas - len(victims)) * groupSize
		j.await(fmt.Sprintf("cycle %d: the survivors' next commits without %v", cycle, ids), func(ev childEvent) bool {
			at := time.Unix(0, ev.UnixNano)
			if g, _, _ := parseMemberID(ev.ID); ev.Kind == "" && !dead[g] && ev.Participants == replicas-len(victims) && at.After(t0) {
				if _, ok := got[ev.ID]; !ok {
					got[ev.ID] = at.Sub(t0)
				}
			}
			return len(got) == want
		})
		var worst time.Duration
		for _, d := range got {
			perSurvivor = append(perSurvivor, d)
			worst = max(worst, d)
		}
		perKill = append(perKill, worst)
		t.Logf("cycle %d: SIGKILL %v → survivors' next commit in %v (%v)", cycle, ids, worst.Round(time.Millisecond), got)
		// The rest of a victim's group goes too: the group restarts whole.
		for _, g := range victims {
			for r := range groupSize {
				if id := memberID(groups[g], r); !slices.Contains(ids, id) {
					j.kill(id)
				}
			}
		}
		restarted := time.Now()
		for _, g := range victims {
			spawn(g)
		}
		together(fmt.Sprintf("cycle %d: %v healed and committing with the others", cycle, ids), restarted)
		rejoins = append(rejoins, time.Since(restarted))
		t.Logf("cycle %d: restarted %v → committing with the others in %v", cycle, ids, time.Since(restarted).Round(time.Millisecond))
	}
	j.stopAll()
	j.check()
	pct := func(ds []time.Duration, p float64) time.Duration {
		s := slices.Clone(ds)
		slices.Sort(s)
		return s[min(len(s)-1, int(p*float64(len(s))))].Round(time.Millisecond)
	}
	t.Logf("FIGURE %s, %d replicas of %d rank(s), %d kill cycles (%d of two at once), %d float32 per rank: kill → survivors' next commit (all of them) p50 %v p99 %v max %v; per survivor p50 %v p99 %v",
		backend, replicas, groupSize, cycles, double, params, pct(perKill, 0.5), pct(perKill, 0.99), pct(perKill, 1), pct(perSurvivor, 0.5), pct(perSurvivor, 0.99))
	if len(heals) > 0 {
		var took []time.Duration
		var bytes int64
		var secs float64
		for _, h := range heals {
			took = append(took, time.Duration(h.TookNs))
			bytes += h.Bytes
			secs += time.Duration(h.TookNs).Seconds()
		}
		t.Logf("FIGURE heals: %d, %d bytes each on average; took p50 %v max %v; %.2f GB/s over all of them",
			len(heals), bytes/int64(len(heals)), pct(took, 0.5), pct(took, 1), float64(bytes)/secs/1e9)
	}
	if len(rejoins) > 0 {
		t.Logf("FIGURE restart → the restarted group committing with the others: p50 %v max %v", pct(rejoins, 0.5), pct(rejoins, 1))
	}
}
