package gossip

import (
	"context"
	"errors"
	"io"
	"log"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"

	"github.com/ftcomm/ftcomm/comm"
)

// Leave after Close (or a Close that wins a race with a concurrent Leave)
// returns ErrClosed. Before, it reached memberlist, which panics "leave
// after shutdown".
func TestGossipLeaveAfterClose(t *testing.T) {
	g, err := Start("a", DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	g.Close()
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("Leave after Close panicked: %v", r)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if err := g.Leave(ctx); !errors.Is(err, comm.ErrClosed) {
		t.Fatalf("Leave after Close: %v, want ErrClosed", err)
	}
}

// Leave returns when its ctx is cancelled, even when a peer never
// acknowledges the leave handshake (a frozen process, a node that does
// not speak it). Before, it waited a third of the ctx's deadline.
func TestGossipLeaveHonoursCancel(t *testing.T) {
	g, err := Start("a", DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	// A peer that accepts the handshake's TCP message and never answers:
	// a plain memberlist node without a delegate drops user messages.
	mc := memberlist.DefaultLANConfig()
	mc.Name, mc.BindAddr, mc.BindPort = "mute", "127.0.0.1", 0
	mc.Logger = log.New(io.Discard, "", 0)
	mute, err := memberlist.Create(mc)
	if err != nil {
		t.Fatal(err)
	}
	defer mute.Shutdown()
	if _, err := g.Join(context.Background(), []string{mute.LocalNode().Address()}); err != nil {
		t.Fatal(err)
	}
	if g.NumAlive() != 2 {
		t.Fatalf("alive %v", g.Alive())
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	cancel() // already cancelled: Leave should give up at once
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- g.Leave(ctx) }()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Leave with a cancelled ctx: %v", err)
		}
		t.Logf("Leave returned after %v: %v", time.Since(start), err)
	case <-time.After(10 * time.Second): // a hang, not a slow machine
		t.Fatalf("Leave with a cancelled ctx still blocked after 10s (it waits deadline/3 = 20 min for an ack)")
	}
}

// After Join returned on its ctx and Close returned, nothing of the node
// still runs. Before, memberlist.Join went on in Join's goroutine (up to
// TCPTimeout per seed) after Close, and could advertise the closed node.
func TestGossipCloseWaitsForJoin(t *testing.T) {
	cfg := DefaultConfig()
	cfg.TCPTimeout = 3 * time.Second // Close waits this long for the seed being contacted
	g, err := Start("a", cfg)
	if err != nil {
		t.Fatal(err)
	}
	// A seed that accepts and never answers the push/pull.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	joined := make(chan error, 1)
	go func() { _, err := g.Join(ctx, []string{ln.Addr().String()}); joined <- err }()
	conn := <-accepted // memberlist.Join is now waiting for the seed
	defer conn.Close()
	cancel()
	t.Logf("Join: %v", <-joined)
	g.Close()

	buf := make([]byte, 1<<20)
	stacks := string(buf[:runtime.Stack(buf, true)])
	for _, s := range strings.Split(stacks, "\n\n") {
		// The goroutine may still be on its way out (past the wait group
		// Close waits for); what must not run is memberlist's Join.
		if strings.Contains(s, "(*Node).Join.func") && strings.Contains(s, "memberlist.(*Memberlist).Join") {
			t.Fatalf("after Close returned, Join's goroutine still runs memberlist.Join:\n%s", s)
		}
	}
}
