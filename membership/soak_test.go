package membership_test

import (
	"flag"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/membership/gossip"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

var (
	soakFor     = flag.Duration("membership.soak", 0, "run the gossip soak test this long (0: skip)")
	soakMembers = flag.Int("membership.soak.members", 8, "member processes in the soak test")
)

// TestGossipSoak keeps every core busy (one spinning process per core)
// while member processes and an in-process coordinator gossip, and counts
// false suspicions and false deaths. Run it with
//
//	go test -run TestGossipSoak ./membership -args -membership.soak=10m
func TestGossipSoak(t *testing.T) {
	if *soakFor == 0 {
		t.Skip("soak test: enable with -membership.soak=10m")
	}
	// Production timeouts: leases of 5 s, a leader session of 3 s.
	tj := clustertest.StartJobTTL(t, quorum.Config{MinReplicas: 1, JoinTimeout: time.Second}, true, coordinator.DefaultConfig().SessionTTL)
	obs := tj.Join("observer", func(c *membership.MemberConfig) { c.LeaseTTL = membership.DefaultMemberConfig().LeaseTTL })
	var procs []*memberProc
	for i := 0; i < *soakMembers; i++ {
		procs = append(procs, startMemberProc(t, tj.Etcd.Endpoints(), tj.Name, "m"+string(rune('a'+i)), membership.DefaultMemberConfig().LeaseTTL, true))
	}
	want := []string{"observer"}
	for _, p := range procs {
		want = append(want, p.id)
	}
	q := clustertest.WaitQuorum(t, obs, 0, want...)
	// Burn every core.
	for i := 0; i < runtime.NumCPU(); i++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "FTCOMM_TEST_BUSY=1")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	}
	t.Logf("soak: %d member processes + observer + coordinator, %d busy processes, for %v, epoch %d",
		len(procs), runtime.NumCPU(), *soakFor, q.Epoch)
	obsStats := func() gossip.Stats { s, _ := obs.GossipStats(); return s }
	// Count only what happens under load.
	total := func() gossip.Stats {
		var sum gossip.Stats
		add := func(s gossip.Stats) {
			sum.Suspicions += s.Suspicions
			sum.Refutations += s.Refutations
			sum.Deaths += s.Deaths
		}
		add(tj.Coord.GossipStats())
		add(obsStats())
		for _, p := range procs {
			add(p.gossipStats(t))
		}
		return sum
	}
	perNode := func() map[string]gossip.Stats {
		m := map[string]gossip.Stats{"coordinator": tj.Coord.GossipStats(), "observer": obsStats()}
		for _, p := range procs {
			m[p.id] = p.gossipStats(t)
		}
		return m
	}
	nodesBefore := perNode()
	before := total()
	start := time.Now()
	timer := time.NewTimer(*soakFor)
	defer timer.Stop()
	var changes []string
	for done := false; !done; {
		select {
		case <-obs.Changed():
			if nq, ok := obs.Quorum(); ok && nq.Epoch != q.Epoch {
				changes = append(changes, time.Since(start).Round(time.Second).String()+": "+nq.Reason)
				q = nq
				// Who else was using the machine then.
				if out, err := exec.Command("ps", "-eo", "pcpu,etime,comm", "--sort=-pcpu").Output(); err == nil {
					lines := strings.SplitN(string(out), "\n", 7)
					t.Logf("epoch %d at %v; top processes:\n%s", nq.Epoch, time.Since(start).Round(time.Second), strings.Join(lines[:min(6, len(lines))], "\n"))
				}
			}
		case <-timer.C:
			done = true
		}
	}
	after := total()
	for name, st := range perNode() {
		b := nodesBefore[name]
		if d := (gossip.Stats{Suspicions: st.Suspicions - b.Suspicions, Refutations: st.Refutations - b.Refutations, Deaths: st.Deaths - b.Deaths}); d != (gossip.Stats{}) {
			t.Logf("  %s: suspected others %d, refuted suspicion of itself %d, deaths seen %d", name, d.Suspicions, d.Refutations, d.Deaths)
		}
	}
	susp, refute, deaths := after.Suspicions-before.Suspicions, after.Refutations-before.Refutations, after.Deaths-before.Deaths
	t.Logf("soak over %v: %d epoch changes, gossip suspicions %d, refutations %d, deaths seen %d", *soakFor, len(changes), susp, refute, deaths)
	for _, c := range changes {
		t.Logf("  %s", c)
	}
	if len(changes) > 0 {
		t.Errorf("%d false epoch changes under load", len(changes))
	}
}
