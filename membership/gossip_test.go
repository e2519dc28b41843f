package membership

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// startGossipCell starts n nodes joined into one cluster and waits until
// every node sees all of them.
func startGossipCell(t testing.TB, n int, cfg GossipConfig) []*Gossip {
	t.Helper()
	ctx := testCtx(t, 30*time.Second)
	nodes := make([]*Gossip, n)
	for i := range nodes {
		g, err := StartGossip(fmt.Sprintf("node-%d", i), cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { g.Close() })
		nodes[i] = g
		if i > 0 {
			if _, err := g.Join(ctx, []string{nodes[0].Addr()}); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, g := range nodes {
		waitGossipEvents(t, ctx, g, GossipJoin, n) // itself included
	}
	return nodes
}

// waitGossipEvents reads g's events until count of kind arrived.
func waitGossipEvents(t testing.TB, ctx context.Context, g *Gossip, kind GossipEventKind, count int) []GossipEvent {
	t.Helper()
	var got []GossipEvent
	for len(got) < count {
		select {
		case ev := <-g.Events():
			if ev.Kind == kind {
				got = append(got, ev)
			}
		case <-ctx.Done():
			t.Fatalf("%s saw %d of %d %v events", g.Name(), len(got), count, kind)
		}
	}
	return got
}

func TestGossipDetectsDeathAndLeave(t *testing.T) {
	nodes := startGossipCell(t, 5, DefaultGossipConfig())
	ctx := testCtx(t, 30*time.Second)
	// Node 4 stops without a word: the others declare it dead.
	stopped := time.Now()
	nodes[4].Close()
	ev := waitGossipEvents(t, ctx, nodes[0], GossipDead, 1)[0]
	if ev.Name != "node-4" {
		t.Fatalf("dead: %+v", ev)
	}
	t.Logf("death of a stopped node seen after %v", ev.At.Sub(stopped))
	// Node 3 leaves gracefully: a leave, not a death.
	if err := nodes[3].Leave(ctx); err != nil {
		t.Fatal(err)
	}
	ev = waitGossipEvents(t, ctx, nodes[0], GossipLeave, 1)[0]
	if ev.Name != "node-3" {
		t.Fatalf("leave: %+v", ev)
	}
	if n := nodes[0].NumAlive(); n != 3 {
		t.Fatalf("node 0 believes %d alive, want 3", n)
	}
	if s := nodes[0].Stats(); s.Deaths != 1 {
		t.Fatalf("stats %+v", s)
	}
}

// memberlist's gossip may bring a node's leave to a peer before the
// "leaving" metadata sent ahead of it, and the peer would then report a
// death (CI saw it once). The handshake alone must make every peer report
// a leave: here the metadata is left out entirely.
func TestGossipLeaveHandshake(t *testing.T) {
	nodes := startGossipCell(t, 4, DefaultGossipConfig())
	ctx := testCtx(t, 30*time.Second)
	// Strays on the user-message path change nothing.
	for _, msg := range [][]byte{nil, {msgLeaving}, {'x', 'n'}, {msgLeaving, 200, 1, 'n'},
		{msgLeaving, 1, 'n', ':', '1'}, append([]byte{msgLeaveAck, 6}, "node-9"...)} {
		nodes[0].receive(msg)
	}
	if len(nodes[0].leftBy) != 0 {
		t.Fatalf("strays were taken for leaves: %v", nodes[0].leftBy)
	}
	nodes[3].noLeaveMeta = true
	if err := nodes[3].Leave(ctx); err != nil {
		t.Fatal(err)
	}
	for _, g := range nodes[:3] {
		for ev := range g.Events() {
			if ev.Kind == GossipJoin {
				continue
			}
			if ev.Kind != GossipLeave || ev.Name != "node-3" {
				t.Fatalf("%s saw %v of %s, want a leave of node-3", g.Name(), ev.Kind, ev.Name)
			}
			break
		}
		if s := g.Stats(); s.Deaths != 0 {
			t.Fatalf("%s counted %d deaths", g.Name(), s.Deaths)
		}
	}
}

func TestGossipConfigValidate(t *testing.T) {
	base := DefaultGossipConfig()
	for name, mut := range map[string]func(*GossipConfig){
		"bind":     func(c *GossipConfig) { c.BindAddr = "x" },
		"timeout":  func(c *GossipConfig) { c.ProbeTimeout = c.ProbeInterval },
		"key":      func(c *GossipConfig) { c.SecretKey = []byte("short") },
		"nodes":    func(c *GossipConfig) { c.GossipNodes = 0 },
		"suspect":  func(c *GossipConfig) { c.SuspicionMult = 0 },
		"pushpull": func(c *GossipConfig) { c.PushPullInterval = 0 },
	} {
		c := base
		mut(&c)
		if err := c.Validate(); !errors.Is(err, comm.ErrInvalidArgument) {
			t.Errorf("%s: %v", name, err)
		}
		if _, err := StartGossip("x", c); !errors.Is(err, comm.ErrInvalidArgument) {
			t.Errorf("%s: start: %v", name, err)
		}
	}
}

func TestGossipEncryptedRejectsStranger(t *testing.T) {
	cfg := DefaultGossipConfig()
	cfg.SecretKey = []byte("0123456789abcdef")
	nodes := startGossipCell(t, 2, cfg)
	stranger, err := StartGossip("stranger", DefaultGossipConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer stranger.Close()
	ctx := testCtx(t, 10*time.Second)
	if _, err := stranger.Join(ctx, []string{nodes[0].Addr()}); err == nil {
		t.Fatal("a node without the key joined an encrypted cluster")
	}
	if n := nodes[0].NumAlive(); n != 2 {
		t.Fatalf("%d alive", n)
	}
}

// With a SecretKey, gossip is encrypted and authenticated: a node without
// the key (or with another) cannot join the cell, so it cannot report
// deaths that would delete registrations.
func TestGossipKeyKeepsStrangersOut(t *testing.T) {
	cfg := DefaultGossipConfig()
	cfg.SecretKey = []byte("0123456789abcdef0123456789abcdef")
	nodes := startGossipCell(t, 2, cfg)
	ctx := testCtx(t, 20*time.Second)
	for _, key := range [][]byte{nil, []byte("fedcba9876543210fedcba9876543210")} {
		sc := DefaultGossipConfig()
		sc.SecretKey, sc.TCPTimeout = key, time.Second
		stranger, err := StartGossip(fmt.Sprintf("stranger-%d", len(key)), sc)
		if err != nil {
			t.Fatal(err)
		}
		if n, err := stranger.Join(ctx, []string{nodes[0].Addr()}); err == nil || n != 0 {
			t.Errorf("a node with key %q joined (%d, %v)", key, n, err)
		}
		if got := nodes[0].NumAlive(); got != 2 {
			t.Errorf("the cell has %d nodes after a stranger's try", got)
		}
		stranger.Close()
	}
}
