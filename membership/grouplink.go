package membership

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.uber.org/zap"
)

// A replica group's links (MemberConfig.GroupLease, grouplease.go): each
// member that does not lead holds one to the group's leader; a link that
// ends without a goodbye is a death.

// The link protocol: a hello line (JSON linkHello) from the member, then
// single bytes both ways: linkPing every GroupLinkInterval, linkBye before
// an orderly close (a member that leaves, or that links elsewhere). A
// leader that does not hold the lease a hello names answers linkRefuse
// and closes: it is alive, so the member links again rather than take the
// lease over (which would delete a live leader's registration).
const (
	linkPing   byte = 'p'
	linkBye    byte = 'b'
	linkRefuse byte = 'n'
)

// linkEnd is how a group link ended.
type linkEnd int

const (
	linkBroken  linkEnd = iota // closed or silent without a goodbye: the peer's death
	linkGoodbye                // the peer said goodbye
	linkRefused                // the leader refused the hello (linkRefuse)
	linkOver                   // this end's membership ended
)

type linkHello struct {
	ID          string `json:"id"`
	Incarnation int64  `json:"inc"`
	// Lease must be the group's current lease: only a reader of the job's
	// keys knows it, and a member of another lease links elsewhere.
	Lease int64 `json:"lease,string"`
}

// linkServer is the part of a group's member that serves the group's
// links while it leads (every member listens: any may come to lead), and
// speaks the link protocol at either end (pingLink). It owns the
// listener, which Join opens (listen) before any goroutine starts and
// Leave closes; the links it serves it counts on the lease, puts on the
// roll and attaches to the epochs it forwards.
type linkServer struct {
	*memberEnv
	end    *ending
	lease  *leaseBinding
	roll   *leaderRoll
	epochs *epochs

	l net.Listener // nil: no group lease
}

// listen opens the listener for the group's links, on the host of the
// member's Addr (or GroupLinkAddr).
func (s *linkServer) listen() error {
	addr := s.cfg.GroupLinkAddr
	if addr == "" {
		host, _, err := net.SplitHostPort(s.cfg.Addr)
		if err != nil {
			host = ""
		}
		addr = net.JoinHostPort(host, "0")
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("membership: join %s/%s: group link listener: %w", s.cfg.Job, s.cfg.ID, err)
	}
	s.l = l
	return nil
}

// addr is where the listener serves the group's links.
func (s *linkServer) addr() string { return s.l.Addr().String() }

// close closes the listener, if there is one: accept returns.
func (s *linkServer) close() {
	if s.l != nil {
		s.l.Close()
	}
}

// accept serves the group's links until the membership ends (Leave and
// Close close the listener).
func (s *linkServer) accept() {
	go func() { <-s.life.Done(); s.l.Close() }()
	for {
		c, err := s.l.Accept()
		if err != nil {
			return
		}
		s.spawn(func() { s.serve(c) })
	}
}

// serve is the leader's end of one member's link. A link that
// ends without a goodbye while this member leads is that member's death.
// The roll (grouproll.go) counts the link from its hello to its end, and
// a hello being read holds its removals back.
func (s *linkServer) serve(c net.Conn) {
	defer c.Close()
	s.roll.helloOpened()
	timeout := s.cfg.GroupLinkTimeout
	c.SetReadDeadline(time.Now().Add(timeout))
	r := bufio.NewReader(c)
	line, err := r.ReadBytes('\n')
	var h linkHello
	read := err == nil && json.Unmarshal(line, &h) == nil
	key := rollKey{h.ID, h.Incarnation}
	out := newGroupLink()
	ok := read && s.life.Err() == nil && s.lease.link(h.Lease)
	s.roll.helloRead(key, ok)
	if ok {
		s.epochs.attach(out) // what the leader holds, first
	}
	s.roll.poke()
	if !read {
		return
	}
	if !ok {
		// Not the lease this member holds: not yet (it is taking the
		// group over, and the member saw the record move before this
		// member's transaction returned) or not any more. Say so: a link
		// that ends without a word is the leader's death.
		if s.life.Err() == nil {
			c.SetWriteDeadline(time.Now().Add(timeout))
			c.Write([]byte{linkRefuse})
		}
		return
	}
	end := s.pingLink(c, r, timeout, out, nil)
	s.epochs.detach(out)
	leading := s.lease.unlink()
	s.roll.unlinked(key)
	s.roll.poke()
	switch {
	case end == linkGoodbye:
		s.lg.Debug("a group member ended its link with a goodbye", zap.String("peer", h.ID))
	case leading && s.life.Err() == nil:
		s.reportGroupDeath(h)
		s.roll.settled(key)
	}
}

// pingLink sends a ping every GroupLinkInterval and reads the peer's until
// the link ends, and says how it ended. At the end of the membership this
// end says goodbye (unless crashed) and closes. At the leader's end, out
// holds the records to forward (groupquorum.go); at a member's, onRecord
// takes those the leader forwards (nil: a record ends the link).
func (s *linkServer) pingLink(c net.Conn, r *bufio.Reader, timeout time.Duration, out *groupLink, onRecord func(*mvccpb.KeyValue)) linkEnd {
	got := make(chan linkEnd, 1)
	go func() { // exits when c is closed or the peer goes quiet
		for {
			c.SetReadDeadline(time.Now().Add(timeout))
			b, err := r.ReadByte()
			if err != nil {
				got <- linkBroken
				return
			}
			switch {
			case b == linkBye:
				got <- linkGoodbye
				return
			case b == linkRefuse:
				got <- linkRefused
				return
			case b == linkRecord:
				kv, err := readLinkRecord(r)
				if err != nil {
					got <- linkBroken
					return
				}
				if onRecord != nil { // else not for this end: dropped
					onRecord(kv)
				}
			}
		}
	}()
	t := time.NewTicker(s.cfg.GroupLinkInterval)
	defer t.Stop()
	var wake chan struct{}
	if out != nil {
		wake = out.wake
	}
	for {
		select {
		case end := <-got:
			c.Close()
			return end
		case <-wake:
			for _, f := range out.take() {
				// A large record (the whole list) takes longer than a ping.
				c.SetWriteDeadline(time.Now().Add(timeout + time.Duration(len(f))*time.Microsecond/64))
				if _, err := c.Write(f); err != nil {
					c.Close()
					return <-got
				}
			}
		case <-t.C:
			c.SetWriteDeadline(time.Now().Add(timeout))
			if _, err := c.Write([]byte{linkPing}); err != nil {
				c.Close()
				return <-got
			}
		case <-s.life.Done():
			if !s.end.crashed.Load() {
				c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
				c.Write([]byte{linkBye})
			}
			c.Close()
			<-got
			return linkOver
		}
	}
}

// reportGroupDeath deletes the registration of a member whose link ended:
// the group's own failure detection, seen by the coordinator as that
// member gone (removeFromLease).
func (s *linkServer) reportGroupDeath(h linkHello) {
	if removed, tries := s.lease.removeFromLease(h, "link ended", func() bool { return true }); removed {
		s.lg.Info("group member's link ended without a goodbye: removed its registration", zap.String("peer", h.ID),
			zap.Int64("incarnation", h.Incarnation), zap.Int("tries", tries))
	}
}
