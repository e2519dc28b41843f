package ft

import (
	"context"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/netns"
)

// A partition with real processes: four replica
// processes (gloo over TCP, MinReplicas 1), each in its own network
// namespace; a and b's uplinks are rate-limited (tc tbf 20mbit) so that a
// step's all-reduce takes long on their side, and the link between {a, b}
// and {c, d} plus the coordinator is cut while state is being all-reduced,
// then healed, over and over. A cut can land after a and b received all
// they need and before c and d did: a and b commit the step, c and d fail
// it, lose a and b (whose leases expire), and commit the step again
// without them. Whatever the timing, the training loop must be told:
// every step committed with two different states must have been reported
// rolled back by every holder of the losing state (default mode), and with
// DurableCommit no step is ever committed twice.
//
// FTCOMM_PARTITION_CYCLES sets the number of cuts per mode (default 2;
// the reproduction used 12).
func TestPartitionProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts replica processes in network namespaces")
	}
	if err := netns.Available(); err != nil {
		t.Skip(err)
	}
	cycles := 2
	if n, err := strconv.Atoi(os.Getenv("FTCOMM_PARTITION_CYCLES")); err == nil && n > 0 {
		cycles = n
	}
	for _, mode := range []struct {
		name    string
		durable bool
	}{{"default", false}, {"durable", true}} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel() // mostly waiting for leases to expire
			runPartitionCycles(t, cycles, mode.durable)
		})
	}
}

func runPartitionCycles(t *testing.T, cycles int, durable bool) {
	ctx := context.Background()
	nw, err := netns.New(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := nw.Close(); err != nil {
			t.Errorf("removing the test network: %v", err)
		}
	})
	// etcd and the coordinator run here, reachable from every namespace.
	ln, err := net.Listen("tcp", net.JoinHostPort(nw.Gateway(), "0"))
	if err != nil {
		t.Fatal(err)
	}
	clientAddr := ln.Addr().String()
	ln.Close()
	j := newProcJobAt(t, clientAddr, false)
	hosts := map[string]*netns.Host{}
	for _, g := range []string{"a", "b", "c", "d"} {
		h, err := nw.AddHost(ctx, g)
		if err != nil {
			t.Fatal(err)
		}
		hosts[g] = h
	}
	const params = 1 << 18 // 1 MiB of state: a step's all-reduce takes ~0.5 s at 20 Mbit/s
	// Shared memory would carry the data around the cut: the namespaces
	// share a kernel and a pid namespace, which is what gloo checks.
	env := []string{"FTCOMM_FT_GOSSIP=0", "FTCOMM_FT_REPLICA_GRADS=1", "FTCOMM_GLOO_SHM=0"}
	if durable {
		env = append(env, "FTCOMM_FT_DURABLE=1")
	}
	spawn := func(g string) {
		h := hosts[g]
		j.spawnCmd(h.Command(os.Args[0], "-test.run=^$"), g, 0, 1, params, append(env, "FTCOMM_FT_HOST="+h.IP)...)
	}
	for _, g := range []string{"a", "b", "c", "d"} {
		spawn(g)
	}
	t.Cleanup(j.stopAll) // before the network goes (cleanups run last first)
	for _, g := range []string{"a", "b"} {
		if err := hosts[g].Limit(ctx, "20mbit"); err != nil {
			t.Fatal(err)
		}
	}
	sideA := []*netns.Host{hosts["a"], hosts["b"]}
	sideB := []*netns.Host{hosts["c"], hosts["d"]}
	together := func(what string) {
		seen := map[string]bool{}
		j.await(what, func(ev childEvent) bool {
			if ev.Kind == "" && ev.Participants == 4 {
				seen[ev.ID] = true
			}
			return len(seen) == 4
		})
	}
	together("all four replicas committing together")
	for cycle := range cycles {
		// Cut in the middle of a step: as soon as a or b reports committing
		// a step that c has not reported yet. c and d may still be waiting
		// for a and b's last bytes on the slow uplinks — the partial
		// completion that makes a and b's commit of that step a minority's.
		seen := map[int64]bool{}
		j.await("a or b committing a step before c", func(ev childEvent) bool {
			if ev.Kind != "" {
				return false
			}
			if ev.ID == "c.0" {
				seen[ev.Step] = true
			}
			return (ev.ID == "a.0" || ev.ID == "b.0") && !seen[ev.Step]
		})
		if err := nw.Cut(ctx, sideA, sideB, true); err != nil {
			t.Fatal(err)
		}
		cutAt := time.Now()
		if durable {
			// c and d may not redo a step that a and b committed: they
			// commit only if a and b did not get that far.
			j.await("c and d going on, or waiting for a holder", func(ev childEvent) bool {
				return ev.ID == "c.0" && (ev.Kind == "" && ev.Participants == 2 || ev.Kind == "waiting")
			})
		} else {
			n := 0
			j.await("c and d committing without a and b", func(ev childEvent) bool {
				if ev.Kind == "" && ev.ID == "c.0" && ev.Participants == 2 {
					n++
				}
				return n == 2
			})
		}
		if err := nw.Heal(ctx); err != nil {
			t.Fatal(err)
		}
		together("all four together again after cut " + strconv.Itoa(cycle+1))
		t.Logf("cycle %d: healed after %v", cycle+1, time.Since(cutAt).Round(time.Millisecond))
	}
	j.stopAll()
	checkPartitionHistory(t, j.drain(), durable)
}

// drain returns every event the replicas reported.
func (j *procJob) drain() []childEvent {
	for {
		select {
		case ev := <-j.events:
			j.all = append(j.all, ev)
		default:
			return j.all
		}
	}
}

// checkPartitionHistory fails on a step committed with two states that was
// not reported rolled back by the holders of all but one of them (among
// those that went on committing), and on any rollback at all with
// DurableCommit.
func checkPartitionHistory(t *testing.T, evs []childEvent, durable bool) {
	t.Helper()
	type holder struct {
		id  string
		pid int
	}
	states := map[int64]map[uint64][]holder{}
	rolledBack := map[holder][]childEvent{}
	last := map[int]int64{}
	for _, ev := range evs {
		h := holder{ev.ID, ev.Pid}
		switch ev.Kind {
		case "":
		case "rollback":
			rolledBack[h] = append(rolledBack[h], ev)
			continue
		default:
			continue // a wait, a heal, news of its registration: no commit
		}
		if ev.Step <= last[ev.Pid] {
			t.Errorf("%s (pid %d) committed step %d after %d", ev.ID, ev.Pid, ev.Step, last[ev.Pid])
		}
		last[ev.Pid] = ev.Step
		if states[ev.Step] == nil {
			states[ev.Step] = map[uint64][]holder{}
		}
		states[ev.Step][ev.Hash] = append(states[ev.Step][ev.Hash], h)
	}
	covered := func(h holder, step int64) bool {
		for _, rb := range rolledBack[h] {
			if rb.From <= step && step <= rb.To {
				return true
			}
		}
		return false
	}
	conflicts, waited := 0, 0
	for _, ev := range evs {
		if ev.Kind == "waiting" {
			waited++
		}
	}
	for step, byHash := range states {
		if len(byHash) < 2 {
			continue
		}
		conflicts++
		if durable {
			t.Errorf("DurableCommit: step %d committed with %d different states: %v", step, len(byHash), byHash)
			continue
		}
		// All but one state must have been rolled back by every holder
		// that went on training; a holder that never committed again (it
		// was stopped before it met the others) acted on nothing.
		unreported := 0
		for _, hs := range byHash {
			for _, h := range hs {
				if !covered(h, step) && last[h.pid] > step {
					unreported++
					break
				}
			}
		}
		if unreported > 1 {
			t.Errorf("step %d committed with %d states, and the loser was never told (silent divergence): %v; rollbacks %v",
				step, len(byHash), byHash, rolledBack)
		}
	}
	if durable && len(rolledBack) > 0 {
		t.Errorf("DurableCommit: rollbacks reported: %v", rolledBack)
	}
	n := 0
	for _, rbs := range rolledBack {
		n += len(rbs)
	}
	t.Logf("%d steps committed twice with different states; %d rollbacks reported; %d times a replica waited for the holder of a committed step",
		conflicts, n, waited)
}
