package netns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// The test binary doubles as a server in a host: it accepts on the host's
// address, prints it, and answers every connection with "hi".
func TestMain(m *testing.M) {
	if addr := os.Getenv("FTCOMM_NETNS_SERVE"); addr != "" {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		fmt.Println(ln.Addr())
		go func() { io.Copy(io.Discard, os.Stdin); os.Exit(0) }()
		for {
			c, err := ln.Accept()
			if err != nil {
				os.Exit(1)
			}
			c.Write([]byte("hi"))
			c.Close()
		}
	}
	os.Exit(m.Run())
}

func TestCutAndHeal(t *testing.T) {
	if err := Available(); err != nil {
		t.Skip(err)
	}
	ctx := context.Background()
	n, err := New(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	h, err := n.AddHost(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	cmd := h.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "FTCOMM_NETNS_SERVE="+h.IP+":0")
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); cmd.Wait() }()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	addr := line[:len(line)-1]
	hello := func() error {
		c, err := net.DialTimeout("tcp", addr, 500*time.Millisecond)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(500 * time.Millisecond))
		b := make([]byte, 2)
		_, err = io.ReadFull(c, b)
		return err
	}
	if err := hello(); err != nil {
		t.Fatalf("the host is not reachable from the gateway: %v", err)
	}
	if err := n.Cut(ctx, []*Host{h}, nil, true); err != nil {
		t.Fatal(err)
	}
	if err := hello(); err == nil {
		t.Fatal("the host answered across a cut")
	}
	if err := n.Heal(ctx); err != nil {
		t.Fatal(err)
	}
	if err := hello(); err != nil {
		t.Fatalf("the host is not reachable after healing: %v", err)
	}
	if err := h.Limit(ctx, "20mbit"); err != nil {
		t.Fatal(err)
	}
	if err := hello(); err != nil {
		t.Fatalf("a rate-limited host does not answer: %v", err)
	}
	// A 150 ms delay on the host's uplink shows in a round trip.
	// Without netem in the kernel, only the rate cap applies.
	err = h.Shape(ctx, Shape{Delay: 150 * time.Millisecond, Rate: "50mbit", Loss: 0.1})
	netem := !errors.Is(err, ErrNoNetem)
	if err != nil && netem {
		t.Fatal(err)
	}
	t0 := time.Now()
	if err := hello(); err != nil {
		t.Fatalf("a shaped host does not answer: %v", err)
	}
	if rtt := time.Since(t0); netem && rtt < 150*time.Millisecond {
		t.Errorf("connect and answer took %v through a 150 ms delay", rtt)
	}
	if err := h.Shape(ctx, Shape{}); err != nil {
		t.Fatal(err)
	}
	if err := hello(); err != nil {
		t.Fatalf("the host does not answer after its shape was removed: %v", err)
	}
}
