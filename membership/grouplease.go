package membership

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/membership/gossip"
)

// A replica group's members share one lease (MemberConfig.GroupLease).
// The group's record, at etcdkeys.Layout.GroupLease and bound to the lease itself,
// names the lease, the member that keeps it alive (the group's leader:
// whichever member created the record) and where the leader serves the
// group's liveness links. Every member keeps its own registration, bound
// to that lease, so quorums, incarnations and the coordinator's rules are
// those of any member; what the group saves is the leases, their
// keepalives, the periodic heartbeats and the gossip nodes of all but one
// member.
//
// Failure detection inside the group is the links: each other member
// holds a TCP connection to the leader, and both ends send a byte every
// GroupLinkInterval. A link silent for GroupLinkTimeout, or closed without
// a goodbye, is a death:
//
//   - the leader deletes the registration of a member whose link ended
//     (fenced on its incarnation): the coordinator sees one member gone and
//     takes the group out in one epoch;
//   - the leader deletes a registration on its lease that has had no link
//     to it for MemberConfig.unlinkedBound (LeaseTTL and four
//     GroupLinkTimeouts) since it appeared there or since its last link
//     ended with a goodbye — a member that died before it linked, to this
//     leader or, after a takeover, to the new one (grouproll.go);
//   - a member whose link to the leader ended takes the lease over: one
//     transaction, fenced on the group record it knew, grants the group a
//     new lease, names itself leader, moves its own registration to the new
//     lease and deletes the old leader's registration if it is still on the
//     old lease. The other members, racing, lose the transaction and see the
//     record move: each moves its own registration to the new lease (its
//     incarnation unchanged) and links to the new leader. The coordinator
//     sees the old leader gone, once; the old lease, unrenewed, expires
//     holding nothing.
//
// A member that is lost (its registration deleted, the lease expired)
// registers again as any member does.

// groupLease is the record of a replica group's shared lease.
type groupLease struct {
	// Lease is the group's etcd lease (decimal in JSON, as MemberRecord's).
	Lease int64 `json:"lease,string"`
	// Leader is the member that keeps the lease alive.
	Leader string `json:"leader"`
	// Link is where the leader serves the group's liveness links.
	Link  string    `json:"link"`
	Since time.Time `json:"since"`
}

// errGroupMoved: the group's lease record changed while the member
// registered.
var errGroupMoved = errors.New("membership: the group's lease moved")

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

func (m *Member) groupKey() string { return m.keys.GroupLease(m.cfg.Job, m.cfg.Group) }

// ownLease grants this member a lease of its own, keeps it alive from now
// (registering may wait for a previous incarnation longer than the TTL)
// and starts gossip under it.
func (m *Member) ownLease(ctx context.Context) error {
	// The first call to etcd waits for a connection (a member may start
	// before its coordinator): say what it waits for while it does.
	stopNotice := waitNotice(m.cli, m.lg, "grant a lease")
	lr, err := m.cli.Grant(ctx, m.ttlSeconds())
	stopNotice()
	if err != nil {
		return fmt.Errorf("membership: join %s/%s: grant lease: %w", m.cfg.Job, m.cfg.ID, ctxErr(ctx, err))
	}
	ka, err := m.cli.KeepAlive(m.life, lr.ID)
	if err != nil {
		m.revokeQuietly(lr.ID)
		return fmt.Errorf("membership: join %s/%s: keepalive: %w", m.cfg.Job, m.cfg.ID, err)
	}
	var g *gossip.Node
	if m.cfg.Gossip != nil {
		if g, err = gossip.Start(gossip.NodeName(m.cfg.Job, m.cfg.ID, int64(lr.ID)), *m.cfg.Gossip); err != nil {
			m.revokeQuietly(lr.ID)
			return err
		}
	}
	m.lease.own(lr.ID, ka, g)
	addr := ""
	if g != nil {
		addr = g.Addr()
	}
	m.rec.setLease(lr.ID, addr)
	return nil
}

// dropOwnLease undoes ownLease for a Join that did not complete with it.
func (m *Member) dropOwnLease() {
	lease, holds, g := m.lease.drop()
	m.rec.setLease(0, "")
	if g != nil {
		g.Close()
	}
	if holds && lease != 0 {
		m.revokeQuietly(lease)
	}
}

func (m *Member) revokeQuietly(lease clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	m.cli.Revoke(ctx, lease)
}

func (m *Member) ttlSeconds() int64 {
	return int64((m.cfg.LeaseTTL + time.Second - 1) / time.Second)
}

// enterGroup binds the registration to the group's lease: the current
// one, or a new one this member holds when the group has none.
func (m *Member) enterGroup(ctx context.Context) error {
	stopNotice := waitNotice(m.cli, m.lg, "read the group's lease")
	resp, err := m.cli.Get(ctx, m.groupKey())
	stopNotice()
	if err != nil {
		return fmt.Errorf("membership: join %s/%s: read the group's lease: %w", m.cfg.Job, m.cfg.ID, ctxErr(ctx, err))
	}
	if len(resp.Kvs) == 0 {
		m.lease.forgetGroup()
		return m.ownLease(ctx) // the registration creates the record
	}
	var g groupLease
	if err := json.Unmarshal(resp.Kvs[0].Value, &g); err != nil || g.Lease == 0 {
		return fmt.Errorf("membership: join %s/%s: unreadable group lease record %s", m.cfg.Job, m.cfg.ID, m.groupKey())
	}
	m.lease.follow(g, resp.Kvs[0].ModRevision, resp.Header.Revision)
	m.rec.setLease(clientv3.LeaseID(g.Lease), "")
	return nil
}

// groupBinding is what registering adds for the group lease: a leader
// creates the group's record (none may exist), a member checks that the
// record it binds under is still current and tells the leader that it
// joined the lease (grouproll.go).
func (m *Member) groupBinding() (clientv3.Cmp, []clientv3.Op) {
	k := m.groupKey()
	lease, holds := m.lease.current()
	if !holds {
		_, rev, _ := m.lease.groupRecord()
		return clientv3.Compare(clientv3.ModRevision(k), "=", rev), []clientv3.Op{m.joinedOp(0, lease)}
	}
	g := groupLease{Lease: int64(lease), Leader: m.cfg.ID, Link: m.link.Addr().String(), Since: time.Now()}
	m.lease.setGroup(g)
	val, _ := json.Marshal(g)
	op := clientv3.OpPut(k, string(val), clientv3.WithLease(lease))
	return clientv3.Compare(clientv3.CreateRevision(k), "=", 0), []clientv3.Op{op}
}

// listenGroupLink opens the listener for the group's links, on the host
// of the member's Addr (or GroupLinkAddr).
func (m *Member) listenGroupLink() error {
	addr := m.cfg.GroupLinkAddr
	if addr == "" {
		host, _, err := net.SplitHostPort(m.cfg.Addr)
		if err != nil {
			host = ""
		}
		addr = net.JoinHostPort(host, "0")
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("membership: join %s/%s: group link listener: %w", m.cfg.Job, m.cfg.ID, err)
	}
	m.link = l
	m.roll.init(m.cfg.ID, m.cfg.unlinkedBound())
	return nil
}

// acceptGroupLinks serves the group's links until the membership ends
// (Leave and Close close the listener).
func (m *Member) acceptGroupLinks() {
	go func() { <-m.life.Done(); m.link.Close() }()
	for {
		c, err := m.link.Accept()
		if err != nil {
			return
		}
		m.spawn(func() { m.serveGroupLink(c) })
	}
}

// serveGroupLink is the leader's end of one member's link. A link that
// ends without a goodbye while this member leads is that member's death.
// The roll (grouproll.go) counts the link from its hello to its end, and
// a hello being read holds its removals back.
func (m *Member) serveGroupLink(c net.Conn) {
	defer c.Close()
	m.roll.helloOpened()
	timeout := m.cfg.GroupLinkTimeout
	c.SetReadDeadline(time.Now().Add(timeout))
	r := bufio.NewReader(c)
	line, err := r.ReadBytes('\n')
	var h linkHello
	read := err == nil && json.Unmarshal(line, &h) == nil
	key := rollKey{h.ID, h.Incarnation}
	out := newGroupLink()
	ok := read && m.life.Err() == nil && m.lease.link(h.Lease)
	m.roll.helloRead(key, ok)
	if ok {
		m.epochs.attach(out) // what the leader holds, first
	}
	m.roll.poke()
	if !read {
		return
	}
	if !ok {
		// Not the lease this member holds: not yet (it is taking the
		// group over, and the member saw the record move before this
		// member's transaction returned) or not any more. Say so: a link
		// that ends without a word is the leader's death.
		if m.life.Err() == nil {
			c.SetWriteDeadline(time.Now().Add(timeout))
			c.Write([]byte{linkRefuse})
		}
		return
	}
	end := m.pingLink(c, r, timeout, out, nil)
	m.epochs.detach(out)
	leading := m.lease.unlink()
	m.roll.unlinked(key)
	m.roll.poke()
	switch {
	case end == linkGoodbye:
		m.lg.Debug("a group member ended its link with a goodbye", zap.String("peer", h.ID))
	case leading && m.life.Err() == nil:
		m.reportGroupDeath(h)
		m.roll.settled(key)
	}
}

// pingLink sends a ping every GroupLinkInterval and reads the peer's until
// the link ends, and says how it ended. At the end of the membership this
// end says goodbye (unless crashed) and closes. At the leader's end, out
// holds the records to forward (groupquorum.go); at a member's, onRecord
// takes those the leader forwards (nil: a record ends the link).
func (m *Member) pingLink(c net.Conn, r *bufio.Reader, timeout time.Duration, out *groupLink, onRecord func(*mvccpb.KeyValue)) linkEnd {
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
	t := time.NewTicker(m.cfg.GroupLinkInterval)
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
		case <-m.life.Done():
			if !m.crashed.Load() {
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
func (m *Member) reportGroupDeath(h linkHello) {
	if removed, tries := m.lease.removeFromLease(h, "link ended", func() bool { return true }); removed {
		m.lg.Info("group member's link ended without a goodbye: removed its registration", zap.String("peer", h.ID),
			zap.Int64("incarnation", h.Incarnation), zap.Int("tries", tries))
	}
}

// followGroup is a non-leader's side of the group: it links to the leader
// and follows the group's record until the membership ends, moving its
// registration when the lease moves and taking the lease over when the
// leader's link ends. Once this member holds the lease it has nothing
// more to follow.
func (m *Member) followGroup() {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, time.Second, 0
	for m.life.Err() == nil && !m.lease.holdsLease() {
		g, rev, seen := m.lease.groupRecord()
		seen = max(rev, seen)
		var err error
		switch m.followLeader(g, seen) {
		case leaderGone:
			if m.awaitTurn(g, seen) {
				err = m.rebind() // another member took it over while this one waited
				break
			}
			if err = m.takeOver(g, rev); err == nil && !m.lease.holdsLease() {
				err = m.rebind() // another member took it over
			}
		case recordMoved:
			err = m.rebind()
		case leaderRefused:
			err = errLinkRefused // link again, after a pause
		}
		if err == nil {
			bo.Reset()
			continue
		}
		if m.life.Err() == nil {
			m.lg.Info("group lease", zap.Error(err))
		}
		select {
		case <-time.After(bo.NextBackOff()):
		case <-m.life.Done():
		}
	}
}

type followEnd int

const (
	membershipOver followEnd = iota
	leaderGone               // the link ended: take over
	recordMoved              // the group's record changed: bind to it
	leaderRefused            // the leader is alive but refused the hello: link again
)

var errLinkRefused = errors.New("the group's leader refused the link: it does not hold the lease the record names, yet or any more")

// followLeader links to the leader g names and watches the group's record
// after seen (a revision at which it was still g) until one of them ends.
func (m *Member) followLeader(g groupLease, seen int64) followEnd {
	ctx, cancel := context.WithCancel(m.life)
	defer cancel()
	moved := make(chan struct{})
	go func() { // exits with ctx
		for wr := range m.cli.Watch(clientv3.WithRequireLeader(ctx), m.groupKey(), clientv3.WithRev(seen+1)) {
			if wr.Err() != nil || len(wr.Events) > 0 {
				close(moved)
				return
			}
		}
	}()
	linkEnded := make(chan struct{})
	// end is how the link ended (read after linkEnded).
	var end linkEnd
	go func() { // exits when the link ends, at the latest with the membership
		defer close(linkEnded)
		if m.cfg.linkHeld != nil {
			select {
			case <-m.cfg.linkHeld:
			case <-ctx.Done():
				return
			}
		}
		timeout := m.cfg.GroupLinkTimeout
		d := net.Dialer{Timeout: timeout}
		c, err := d.DialContext(ctx, "tcp", g.Link)
		if err != nil {
			return
		}
		hello, _ := json.Marshal(linkHello{ID: m.cfg.ID, Incarnation: m.inc, Lease: g.Lease})
		c.SetWriteDeadline(time.Now().Add(timeout))
		if _, err := c.Write(append(hello, '\n')); err != nil {
			c.Close()
			return
		}
		go func() {
			// A moved record (or a broken watch of it) ends the link by
			// this member's choice: it says goodbye, or the leader, alive,
			// would take it for dead and delete its registration.
			<-ctx.Done()
			if m.life.Err() == nil {
				c.SetWriteDeadline(time.Now().Add(timeout))
				c.Write([]byte{linkBye})
			}
			c.SetReadDeadline(time.Now())
		}()
		var onRecord func(*mvccpb.KeyValue)
		if m.cfg.GroupLease && !m.cfg.GroupEachWatches && !m.lease.holdsLease() {
			// It takes the quorum from its leader instead of watching etcd.
			onRecord = m.epochs.applyForwarded
		}
		m.lease.setLinked(true)
		defer m.lease.setLinked(false)
		end = m.pingLink(c, bufio.NewReader(c), timeout, nil, onRecord)
	}()
	select {
	case <-linkEnded:
		if m.life.Err() != nil {
			return membershipOver
		}
		select {
		case <-moved:
			return recordMoved
		default:
		}
		if end == linkRefused {
			return leaderRefused
		}
		return leaderGone
	case <-moved:
		cancel()
		<-linkEnded
		return recordMoved
	case <-m.life.Done():
		<-linkEnded
		return membershipOver
	}
}

// takeoverTurn is a member's place in line to take its group's lease over
// once the link to the leader ended: the number of the group's other
// members (the old leader aside) in the quorum ps that come before self
// by id; a member not in ps comes after all of them. Turn 0 goes at once.
func takeoverTurn(ps []Participant, group, self, leader string) int {
	before, after, in := 0, 0, false
	for _, p := range ps {
		switch {
		case p.Group != group || p.ID == leader:
		case p.ID == self:
			in = true
		case p.ID < self:
			before++
		default:
			after++
		}
	}
	if !in {
		return before + after
	}
	return before
}

// awaitTurn waits, before this member takes the lease over, for its turn
// (takeoverTurn link intervals), watching the group's record after seen;
// it reports whether the record moved meanwhile (another member took the
// lease over, or the record is gone: rebind follows either). Staggered
// turns let the first takeover move the record before the next member
// grants a lease of its own, so a group whose leader died costs etcd one
// lease, not one per member: at 100,000 ranks on a starved etcd, seven per
// group fed the collapse docs/capacity.md describes.
func (m *Member) awaitTurn(g groupLease, seen int64) bool {
	q, _ := m.Quorum()
	turn := takeoverTurn(q.Participants, m.cfg.Group, m.cfg.ID, g.Leader)
	if turn == 0 {
		return false
	}
	ctx, cancel := context.WithTimeout(m.life, time.Duration(turn)*m.cfg.GroupLinkInterval)
	defer cancel()
	for wr := range m.cli.Watch(clientv3.WithRequireLeader(ctx), m.groupKey(), clientv3.WithRev(seen+1)) {
		if wr.Err() != nil {
			return false
		}
		if len(wr.Events) > 0 {
			return true
		}
	}
	return false
}

// rebind binds the registration to the group's current record: another
// member took the lease over. The incarnation stays.
func (m *Member) rebind() error {
	ctx, cancel := context.WithTimeout(m.life, m.cfg.LeaseTTL)
	defer cancel()
	resp, err := m.cli.Get(ctx, m.groupKey())
	if err != nil {
		return fmt.Errorf("read the group's lease: %w", err)
	}
	if len(resp.Kvs) == 0 {
		// The lease ended, and the registration with it: watchSelf sees
		// it go. A record gone without it (deleted by hand) is taken over.
		g, _, _ := m.lease.groupRecord()
		return m.takeOver(g, 0)
	}
	var g groupLease
	if err := json.Unmarshal(resp.Kvs[0].Value, &g); err != nil {
		return fmt.Errorf("unreadable group lease record: %w", err)
	}
	rev := resp.Kvs[0].ModRevision
	if m.lease.stillAt(rev, resp.Header.Revision) {
		return errors.New("the group's leader is unreachable and its record has not moved")
	}
	unlock := m.rec.lockWrites()
	defer unlock()
	rec := m.rec.get()
	rec.Lease = g.Lease
	val, _ := json.Marshal(rec)
	tr, err := m.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(m.key), "=", m.inc),
		clientv3.Compare(clientv3.ModRevision(m.groupKey()), "=", rev)).
		Then(clientv3.OpPut(m.key, string(val), clientv3.WithLease(clientv3.LeaseID(g.Lease))),
			m.joinedOp(m.inc, clientv3.LeaseID(g.Lease))).Commit()
	if err != nil {
		return fmt.Errorf("move to the group's new lease: %w", err)
	}
	if !tr.Succeeded {
		return nil // moved again, or this registration is gone: follow again
	}
	m.lease.rebound(g, rev, tr.Header.Revision)
	m.rec.setLease(clientv3.LeaseID(g.Lease), "")
	m.lg.Info("moved to the group's new lease", zap.String("leader", g.Leader), zap.Int64("lease", g.Lease))
	return nil
}

// takeOver makes this member the group's leader after the leader's link
// ended: a new lease, the group's record naming this member, this
// member's registration moved to the lease, the old leader's registration
// deleted if it is still on the old lease — one transaction, fenced on the
// group record at rev (0: none). Losing the race is not an error: the
// winner's record moves the others.
func (m *Member) takeOver(old groupLease, rev int64) error {
	ctx, cancel := context.WithTimeout(m.life, m.cfg.LeaseTTL)
	defer cancel()
	lr, err := m.cli.Grant(ctx, m.ttlSeconds())
	if err != nil {
		return fmt.Errorf("take the group's lease over: grant: %w", err)
	}
	g := groupLease{Lease: int64(lr.ID), Leader: m.cfg.ID, Link: m.link.Addr().String(), Since: time.Now()}
	gval, _ := json.Marshal(g)
	var gsp *gossip.Node
	if m.cfg.Gossip != nil {
		if gsp, err = gossip.Start(gossip.NodeName(m.cfg.Job, m.cfg.ID, int64(lr.ID)), *m.cfg.Gossip); err != nil {
			m.revokeQuietly(lr.ID)
			return err
		}
	}
	unlock := m.rec.lockWrites()
	rec := m.rec.get()
	rec.Lease = int64(lr.ID)
	if gsp != nil {
		rec.Gossip = gsp.Addr()
	}
	val, _ := json.Marshal(rec)
	cmp := clientv3.Compare(clientv3.ModRevision(m.groupKey()), "=", rev)
	if rev == 0 {
		cmp = clientv3.Compare(clientv3.CreateRevision(m.groupKey()), "=", 0)
	}
	then := []clientv3.Op{
		clientv3.OpPut(m.groupKey(), string(gval), clientv3.WithLease(lr.ID)),
		clientv3.OpPut(m.key, string(val), clientv3.WithLease(lr.ID)),
	}
	if old.Leader != "" && old.Leader != m.cfg.ID {
		lk := m.keys.Member(m.cfg.Job, old.Leader)
		then = append(then, clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(lk), "=", old.Lease)},
			[]clientv3.Op{clientv3.OpDelete(lk)}, nil))
	}
	tr, err := m.cli.Txn(ctx).If(cmp, clientv3.Compare(clientv3.CreateRevision(m.key), "=", m.inc)).Then(then...).Commit()
	won, at := err == nil && tr.Succeeded, int64(0)
	if err == nil {
		at = tr.Header.Revision
	} else if m.life.Err() == nil {
		// No answer is not a refusal: etcd may have applied the
		// transaction and the answer come too late (a loaded etcd, past
		// ctx). Revoking the lease then would delete the group's record
		// and this member's registration, now bound to it: a survivor
		// counted dead, and the group's other members moved to a lease
		// that is gone.
		won, at = m.tookOver(lr.ID)
	}
	if !won {
		unlock()
		if gsp != nil {
			gsp.Close()
		}
		m.revokeQuietly(lr.ID)
		if err != nil {
			return fmt.Errorf("take the group's lease over: %w", err)
		}
		return nil // another member was faster, or this registration is gone
	}
	// Lead at once: the others see the record move and link here within
	// a round trip or two, and a hello this member does not yet take as
	// its lease's would end their link (and make one of them take over
	// from this member).
	m.epochs.lead()
	m.lease.lead(g, at, lr.ID, gsp)
	m.rec.setLease(lr.ID, rec.Gossip)
	unlock()
	ka, kerr := m.cli.KeepAlive(m.life, lr.ID)
	if kerr != nil { // only when the membership is over
		return nil
	}
	m.lg.Info("took the group's lease over", zap.String("previous_leader", old.Leader), zap.Int64("lease", int64(lr.ID)))
	m.spawn(func() { m.renew(lr.ID, ka) })
	m.spawn(m.epochs.leadEpochs) // the group now takes the quorum from this member
	m.spawn(func() { m.roll.rollGroup(at) })
	if m.cfg.HeartbeatInterval > 0 {
		m.spawn(m.heartbeats)
	}
	if gsp != nil {
		m.spawn(m.drainGossip)
		if err := m.joinGossip(ctx); err != nil {
			m.lg.Warn("gossip join failed; lease expiry remains the failure detector", zap.Error(err))
		}
	}
	return nil
}

// tookOver finds out whether a takeover whose transaction got no answer
// took effect: whether the group's record names lease (the one that
// transaction granted), reading it until etcd answers, for at most a
// LeaseTTL (past it, a lease no one renewed has expired, and the record
// with it) or until the membership ends. at is the record's revision.
func (m *Member) tookOver(lease clientv3.LeaseID) (won bool, at int64) {
	ctx, cancel := context.WithTimeout(m.life, m.cfg.LeaseTTL)
	defer cancel()
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, time.Second, 0
	var resp *clientv3.GetResponse
	read := func() (err error) {
		resp, err = m.cli.Get(ctx, m.groupKey())
		return err
	}
	if backoff.Retry(read, backoff.WithContext(bo, ctx)) != nil || len(resp.Kvs) == 0 {
		return false, 0
	}
	var g groupLease
	if json.Unmarshal(resp.Kvs[0].Value, &g) != nil || g.Lease != int64(lease) {
		return false, 0
	}
	m.lg.Info("a takeover whose transaction got no answer took effect", zap.Int64("lease", g.Lease))
	return true, resp.Kvs[0].ModRevision
}
