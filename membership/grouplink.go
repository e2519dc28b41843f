package membership

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/internal/silence"
)

// A replica group's links (MemberConfig.GroupLease, grouplease.go): each
// member that does not lead holds one to the group's leader; a link that
// ends without a goodbye is a death.

// The link protocol: a hello line (JSON linkHello) from the member, then
// single bytes both ways: linkPing every GroupLinkInterval, linkBye before
// an orderly close (a member that leaves, or that links elsewhere). A
// leader that does not hold the lease a hello names answers linkRefuse
// and closes: it is alive, so the member links again rather than take the
// lease over (which would delete a live leader's registration). A leader
// that takes a silent member for dead says linkDrop as it closes: a
// member alive after all (starved past the limit, or cut off one way)
// then learns that the leader is alive and its own registration going,
// and does not take the lease over from a live leader.
const (
	linkPing   byte = 'p'
	linkBye    byte = 'b'
	linkRefuse byte = 'n'
	linkDrop   byte = 'd'
)

// linkEnd is how a group link ended.
type linkEnd int

const (
	linkBroken  linkEnd = iota // closed or silent without a goodbye: the peer's death
	linkGoodbye                // the peer said goodbye
	linkRefused                // the leader refused the hello (linkRefuse)
	linkDropped                // the leader took this member for dead (linkDrop)
	linkOver                   // this end ended it: its membership ended, or it left (pingLink's stop)
)

type linkHello struct {
	ID          string `json:"id"`
	Incarnation int64  `json:"inc"`
	// Lease must be the group's current lease: only a reader of the job's
	// keys knows it, and a member of another lease links elsewhere.
	Lease int64 `json:"lease,string"`
	// Proc is the member's process (nil: not told): the leader asks its
	// kernel about a member on its host that has gone silent (pingLink).
	Proc *silence.Identity `json:"proc,omitempty"`
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

	// kept counts the verdicts that took a silent link's peer for
	// starved, not dead (pingLink; for the tests, export_test.go).
	kept atomic.Int64
	// spoke counts the silences so kept that ended with the peer heard
	// again.
	spoke atomic.Int64
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
	end, why := s.pingLink(c, r, timeout, h.Proc, out, nil, nil)
	s.epochs.detach(out)
	leading := s.lease.unlink()
	s.roll.unlinked(key)
	s.roll.poke()
	switch {
	case end == linkGoodbye:
		s.lg.Debug("a group member ended its link with a goodbye", zap.String("peer", h.ID))
	case leading && s.life.Err() == nil:
		s.reportGroupDeath(h, why)
		s.roll.settled(key)
	}
}

// pingLink sends a ping every GroupLinkInterval and reads the peer's until
// the link ends, and says how it ended (and, for a silent peer, why it was
// judged dead). At the end of the membership this end says goodbye
// (unless crashed) and closes. At the leader's end, out holds the records
// to forward (groupquorum.go); at a member's, onRecord takes those the
// leader forwards (nil: a record ends the link), and a closed stop ends
// the link by this member's choice (it says goodbye: the leader is not to
// take it for dead).
//
// A closed connection is the peer's death at once. A silent one is judged
// by package silence (linkSilence), not by the timeout alone: on a host
// starved of CPU (10,000 members on 2 cores) a live peer's pings, or this
// end's reading of them, come seconds late. peer is the other end's
// process (nil: not told). A member that gives up on a silent leader says
// goodbye as it goes, so that a leader merely starved does not take it
// for dead in turn.
func (s *linkServer) pingLink(c net.Conn, r *bufio.Reader, timeout time.Duration, peer *silence.Identity, out *groupLink,
	onRecord func(*mvccpb.KeyValue), stop <-chan struct{}) (linkEnd, string) {
	ls := newLinkSilence(timeout, s.cfg.GroupLinkInterval, peer)
	type ended struct {
		end linkEnd
		why string
	}
	got := make(chan ended, 1)
	go func() { // exits when c is closed or the peer is judged dead
		next, kept := timeout, false
		for {
			set := time.Now()
			c.SetReadDeadline(set.Add(next))
			b, err := r.ReadByte()
			if err != nil {
				if !errors.Is(err, os.ErrDeadlineExceeded) || s.life.Err() != nil {
					got <- ended{linkBroken, ""}
					return
				}
				// A reader that woke well after its deadline was itself
				// not scheduled: what it missed proves nothing yet.
				late := time.Since(set) > next+next/2
				dead, why := ls.verdict(late)
				if dead {
					got <- ended{linkBroken, why}
					return
				}
				if s.kept.Add(1); !kept {
					kept = true
					s.lg.Debug("a group link is silent, but its peer is taken for starved, not dead",
						zap.Duration("silent", ls.heard.Silent(ls.now())), zap.Bool("late", late))
				}
				next = s.cfg.GroupLinkInterval // look again soon
				continue
			}
			ls.arrived()
			if kept {
				s.spoke.Add(1)
				s.lg.Debug("a group link's peer taken for starved spoke again")
			}
			next, kept = timeout, false
			switch {
			case b == linkBye:
				got <- ended{linkGoodbye, ""}
				return
			case b == linkRefuse:
				got <- ended{linkRefused, ""}
				return
			case b == linkDrop:
				got <- ended{linkDropped, ""}
				return
			case b == linkRecord:
				// The body gets a timeout of its own: the deadline above
				// may be a look's short one, or mostly spent.
				c.SetReadDeadline(time.Now().Add(timeout))
				kv, err := readLinkRecord(r)
				if err != nil {
					got <- ended{linkBroken, ""}
					return
				}
				if onRecord != nil { // else not for this end: dropped
					onRecord(kv)
				}
			}
		}
	}()
	iv := s.cfg.GroupLinkInterval
	t := time.NewTicker(iv)
	defer t.Stop()
	last := time.Now()
	var wake chan struct{}
	if out != nil {
		wake = out.wake
	}
	for {
		select {
		case e := <-got:
			if e.why != "" && s.life.Err() == nil {
				// A silent peer judged dead: a member giving up on its
				// leader says goodbye, a leader dropping a member says so.
				word := linkBye
				if out != nil {
					word = linkDrop
				}
				c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
				c.Write([]byte{word})
			}
			c.Close()
			return e.end, e.why
		case <-wake:
			for _, f := range out.take() {
				// A large record (the whole list) takes longer than a ping.
				c.SetWriteDeadline(time.Now().Add(timeout + time.Duration(len(f))*time.Microsecond/64))
				if _, err := c.Write(f); err != nil {
					c.Close()
					e := <-got
					return e.end, e.why
				}
			}
		case now := <-t.C:
			ls.tick(now.Sub(last)-iv, iv)
			last = now
			if s.cfg.linkMuted != nil && s.cfg.linkMuted.Load() {
				continue // a test's starved end: it sends nothing
			}
			c.SetWriteDeadline(time.Now().Add(timeout))
			if _, err := c.Write([]byte{linkPing}); err != nil {
				c.Close()
				e := <-got
				return e.end, e.why
			}
		case <-s.life.Done():
			if !s.end.crashed.Load() {
				c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
				c.Write([]byte{linkBye})
			}
			c.Close()
			<-got
			return linkOver, ""
		case <-stop:
			if s.life.Err() == nil { // else a crash, or the membership's end: the case above
				c.SetWriteDeadline(time.Now().Add(timeout))
				c.Write([]byte{linkBye})
			}
			c.Close()
			<-got
			return linkOver, ""
		}
	}
}

// reportGroupDeath deletes the registration of a member whose link ended:
// the group's own failure detection, seen by the coordinator as that
// member gone (removeFromLease).
func (s *linkServer) reportGroupDeath(h linkHello, why string) {
	if why == "" {
		why = "closed"
	}
	if removed, tries := s.lease.removeFromLease(h, "link ended", func() bool { return true }); removed {
		s.lg.Info("group member's link ended without a goodbye: removed its registration", zap.String("peer", h.ID),
			zap.Int64("incarnation", h.Incarnation), zap.String("link", why), zap.Int("tries", tries))
	}
}

// linkSilence judges one group link's silence (pingLink): its reader
// records arrivals and asks for a verdict when its deadline passes; its
// ping loop scores how late this process's own ticks run.
type linkSilence struct {
	base  time.Duration
	fresh time.Duration    // how old a shared look at the peer's process may be
	peer  silence.Identity // zero: not told
	born  time.Time
	heard silence.Arrivals
	score atomic.Int32 // this end's silence.Health, kept by the ping loop

	health       silence.Health // the ping loop's
	blockedSince time.Time      // the reader's: when looks began to find the peer blocked
}

func newLinkSilence(base, interval time.Duration, peer *silence.Identity) *linkSilence {
	ls := &linkSilence{base: base, fresh: interval / 2, born: time.Now()}
	if peer != nil {
		ls.peer = *peer
	}
	ls.heard.Mark(0)
	return ls
}

func (ls *linkSilence) now() int64 { return int64(time.Since(ls.born)) }

// arrived records that something came from the peer (the reader).
func (ls *linkSilence) arrived() {
	ls.heard.Arrived(ls.now())
	ls.blockedSince = time.Time{}
}

// tick records one tick of the ping loop, late by late (the ping loop).
func (ls *linkSilence) tick(late, interval time.Duration) {
	ls.health.Tick(late, interval)
	ls.score.Store(int32(ls.health.Score()))
	ls.heard.Decay()
}

// verdict says whether the peer, silent past the read deadline, is dead,
// and why (the reader, late when it woke well after its deadline). A live
// peer whose process this kernel sees runnable is taken for starved, and a
// late reader's view for unreliable, for up to MaxStretch timeouts.
func (ls *linkSilence) verdict(late bool) (bool, string) {
	if late && ls.heard.Silent(ls.now()) <= silence.MaxStretch*ls.base {
		return false, ""
	}
	st := silence.LookShared(silence.Self(), ls.peer, ls.fresh)
	var blocked time.Duration
	switch {
	case st != silence.Blocked:
		ls.blockedSince = time.Time{}
	case ls.blockedSince.IsZero():
		ls.blockedSince = time.Now()
	default:
		blocked = time.Since(ls.blockedSince)
	}
	return silence.Verdict(silence.Silence{
		Silent: ls.heard.Silent(ls.now()), Base: ls.base, Gap: ls.heard.Gap(),
		Health: int(ls.score.Load()), State: st, Blocked: blocked,
		RunnableLimit: silence.MaxStretch * ls.base,
	})
}

// selfProc is this process's identity as a group link tells it (nil where
// /proc says nothing).
func selfProc() *silence.Identity {
	if id := silence.Self(); id.Known() {
		return &id
	}
	return nil
}
