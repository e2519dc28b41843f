package gossip

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/testutil"
)

var gossipCell = flag.Int("gossip.cell", 0, "nodes in the gossip cell detection test (0: skip)")

// TestGossipCellDetection: a cell of N gossip nodes in this process; one
// stops without leaving; how long until the others declare it dead.
//
//	go test -run TestGossipCellDetection ./membership/gossip -args -gossip.cell=256
func TestGossipCellDetection(t *testing.T) {
	if *gossipCell == 0 {
		t.Skip("gossip cell test: enable with -gossip.cell=256")
	}
	n := *gossipCell
	cfg := DefaultConfig()
	cfg.TCPTimeout = 10 * time.Second // n nodes share this machine's cores
	ctx := testutil.Ctx(t, 5*time.Minute)
	nodes := make([]*Node, n)
	start := time.Now()
	for i := range nodes {
		g, err := Start(fmt.Sprintf("node-%03d", i), cfg)
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
	joins := waitGossipEvents(t, ctx, nodes[0], Joined, n)
	t.Logf("cell of %d formed in %v (observer saw %d joins)", n, time.Since(start).Round(time.Millisecond), len(joins))
	var before Stats
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
			ev := waitGossipEvents(t, ctx, nodes[0], Dead, 1)[0]
			if ev.Name == victim.Name() {
				times = append(times, ev.At.Sub(stopped))
				break
			}
			t.Errorf("false death of %s", ev.Name)
		}
	}
	var after Stats
	for _, g := range nodes[:n-5] {
		s := g.Stats()
		after.Suspicions += s.Suspicions
		after.Deaths += s.Deaths
	}
	t.Logf("cell of %d: stopped node declared dead at the observer after %s; suspicions during the rounds %d",
		n, testutil.Durations(times), after.Suspicions-before.Suspicions)
}
