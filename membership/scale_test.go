package membership

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/testutil"
)

var gossipCell = flag.Int("membership.cell", 0, "nodes in the gossip cell detection test (0: skip)")

// TestGossipCellDetection: a cell of N gossip nodes in this process; one
// stops without leaving; how long until the others declare it dead.
//
//	go test -run TestGossipCellDetection ./membership -args -membership.cell=256
func TestGossipCellDetection(t *testing.T) {
	if *gossipCell == 0 {
		t.Skip("gossip cell test: enable with -membership.cell=256")
	}
	n := *gossipCell
	cfg := DefaultGossipConfig()
	cfg.TCPTimeout = 10 * time.Second // n nodes share this machine's cores
	ctx := testutil.Ctx(t, 5*time.Minute)
	nodes := make([]*Gossip, n)
	start := time.Now()
	for i := range nodes {
		g, err := StartGossip(fmt.Sprintf("node-%03d", i), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { g.Close() })
		nodes[i] = g
		// Drain events of all but the observer (node 0).
		if i > 0 {
			go func() {
				for range g.Events() {
				}
			}()
		}
	}
	// Join in parallel, each node through node 0 and a random other.
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 1; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			if _, err := nodes[i].Join(ctx, []string{nodes[0].Addr(), nodes[rand.IntN(i)].Addr()}); err != nil {
				errs <- err
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	joins := waitGossipEvents(t, ctx, nodes[0], GossipJoin, n)
	t.Logf("cell of %d formed in %v (observer saw %d joins)", n, time.Since(start).Round(time.Millisecond), len(joins))
	var before GossipStats
	for _, g := range nodes[:n-5] {
		s := g.Stats()
		before.Suspicions += s.Suspicions
		before.Deaths += s.Deaths
	}
	var times []time.Duration
	for round := 0; round < 5; round++ {
		victim := nodes[n-1-round]
		stopped := time.Now()
		victim.Close()
		for {
			ev := waitGossipEvents(t, ctx, nodes[0], GossipDead, 1)[0]
			if ev.Name == victim.Name() {
				times = append(times, ev.At.Sub(stopped))
				break
			}
			t.Errorf("false death of %s", ev.Name)
		}
	}
	var after GossipStats
	for _, g := range nodes[:n-5] {
		s := g.Stats()
		after.Suspicions += s.Suspicions
		after.Deaths += s.Deaths
	}
	t.Logf("cell of %d: stopped node declared dead at the observer after %s; suspicions during the rounds %d",
		n, durations(times), after.Suspicions-before.Suspicions)
}

func durations(ds []time.Duration) string {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 1 {
		return s[0].Round(time.Millisecond).String()
	}
	return fmt.Sprintf("n=%d min %v median %v max %v", len(s), s[0].Round(time.Millisecond),
		s[len(s)/2].Round(time.Millisecond), s[len(s)-1].Round(time.Millisecond))
}
