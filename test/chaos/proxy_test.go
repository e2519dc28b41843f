package main

import (
	"context"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// The proxy knows who dialed, stalls a cut link until it heals (nothing
// lost), and resets a replica's connections.
func TestProxyCutHealReset(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() { // an echo server; exits when ln closes
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
	w := newProxyNetwork()
	defer w.close()
	pln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Skipf("no 127.0.0.2 on the loopback: %v", err)
	}
	w.serve(&proxyLink{ln: pln, dst: ln.Addr().String(), owner: "b"})
	w.started("a", os.Getpid()) // this process dials: it is replica a
	c, err := net.Dial("tcp", pln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	echo := func(msg string, wait time.Duration) error {
		if _, err := c.Write([]byte(msg)); err != nil {
			return err
		}
		c.SetReadDeadline(time.Now().Add(wait))
		b := make([]byte, len(msg))
		_, err := io.ReadFull(c, b)
		if err == nil && string(b) != msg {
			t.Fatalf("echo %q, want %q", b, msg)
		}
		return err
	}
	if err := echo("hello", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	w.mu.Lock()
	var pc *proxyConn
	for x := range w.conns {
		pc = x
	}
	w.mu.Unlock()
	if pc == nil || pc.a != "a" || pc.b != "b" {
		t.Fatalf("the proxy saw the connection as %+v, want from a to b", pc)
	}
	ctx := context.Background()
	w.partition(ctx, []string{"a"}, []string{"b"}, false)
	if err := echo("cut", 300*time.Millisecond); err == nil {
		t.Fatal("an echo crossed a cut link")
	}
	w.heal(ctx)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, 3)
	if _, err := io.ReadFull(c, b); err != nil || string(b) != "cut" {
		t.Fatalf("after healing: %q, %v; want the stalled bytes", b, err)
	}
	w.reset("b")
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(b); err == nil {
		t.Fatal("read from a reset connection")
	}
}
