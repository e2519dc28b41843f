package membership

import (
	"bufio"
	"context"
	"io"
	"net"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.uber.org/zap"
)

// linkPair is a member's end (c) and its peer's (p) of a TCP link on
// loopback.
func linkPair(t *testing.T) (c, p net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		a, _ := l.Accept()
		accepted <- a
	}()
	c, err = net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	p = <-accepted
	t.Cleanup(func() { c.Close(); p.Close() })
	return c, p
}

// A member that ends its link by choice (its group's record moved: stop)
// ends it at once, though the leader at the other end is alive and keeps
// pinging, and says goodbye first: the leader is not to take it for dead.
// (A forced read deadline once did this; the silence verdict took it for
// a silence to judge and the link went on, the member never moving to the
// group's new lease.)
func TestPingLinkStopEndsALiveLink(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m := newMember(&memberEnv{cfg: MemberConfig{GroupLinkInterval: 20 * time.Millisecond, GroupLinkTimeout: time.Second}, lg: zap.NewNop(), life: ctx})
	c, peer := linkPair(t)
	pinging := make(chan struct{})
	go func() { // the leader: pings until the link closes
		defer close(pinging)
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for range t.C {
			if _, err := peer.Write([]byte{linkPing}); err != nil {
				return
			}
		}
	}()
	up := make(chan struct{})
	heard := make(chan []byte, 1)
	go func() { // what the leader reads: a first ping (the link is up), then all to the end
		var first [1]byte
		io.ReadFull(peer, first[:])
		close(up)
		b, _ := io.ReadAll(peer)
		heard <- append(first[:], b...)
	}()
	stop := make(chan struct{})
	ended := make(chan linkEnd, 1)
	go func() {
		end, _ := m.links.pingLink(c, bufio.NewReader(c), time.Second, nil, nil, func(*mvccpb.KeyValue) {}, stop)
		ended <- end
	}()
	<-up
	close(stop)
	select {
	case end := <-ended:
		if end != linkOver {
			t.Fatalf("ended %v, want linkOver", end)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("stop did not end a link whose peer is alive")
	}
	b := <-heard
	if len(b) == 0 || b[len(b)-1] != linkBye {
		t.Fatalf("the leader read %q last, want the goodbye", b[max(0, len(b)-4):])
	}
	peer.Close()
	<-pinging
}
