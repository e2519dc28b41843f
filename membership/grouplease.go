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
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/internal/silence"
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
// GroupLinkInterval. A link closed without a goodbye, or silent past
// GroupLinkTimeout and judged dead (pingLink: a starved peer is given up
// to 10 timeouts), is a death:
//
//   - the leader deletes the registration of a member whose link ended
//     (fenced on its incarnation): the coordinator sees one member gone and
//     takes the group out in one epoch;
//   - the leader deletes a registration on its lease that has had no link
//     to it for MemberConfig.unlinkedBound (LeaseTTL and four
//     GroupLinkTimeouts) since it appeared there or since its last link
//     ended with a goodbye — a member that died before it linked, to this
//     leader or, after a takeover, to the new one (grouproll.go);
//   - a member whose link to the leader ended takes the lease over, in
//     turn (awaitTurn) and in two transactions, each fenced on the group's
//     record as it last knew it. The claim marks the record, still on the
//     old lease, as taken over by this member and deletes the old leader's
//     registration if it is still on the old lease: the coordinator sees
//     the leader gone after one write, and the group's other members, whose
//     turns come later, see the record move and wait for the claimer
//     (awaitClaim) instead of granting leases of their own. The takeover
//     then grants the group a new lease, names itself leader and moves its
//     own registration to the new lease. Each other member sees the record
//     move again: it moves its own registration to the new lease (its
//     incarnation unchanged) and links to the new leader. A claimer that
//     has not moved the record a GroupLinkTimeout after a member saw its
//     claim (it died, or etcd is that slow) is passed over: that member
//     takes the lease over in its turn, fenced on the claimed record. The
//     old lease, unrenewed, expires holding nothing.
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
	// Proc is the leader's process (nil from a leader that did not tell
	// it): a member on the same host asks its kernel about a leader gone
	// silent before it takes the lease over (pingLink).
	Proc *silence.Identity `json:"proc,omitempty"`
	// Claim is the member taking the lease over since its link to Leader
	// ended: written, still on Lease, before that member grants the new
	// one ("": none).
	Claim string `json:"claim,omitempty"`
}

// errGroupMoved: the group's lease record changed while the member
// registered.
var errGroupMoved = errors.New("membership: the group's lease moved")

// groupKey is the key of the group's lease record.
func (e *memberEnv) groupKey() string { return e.keys.GroupLease(e.cfg.Job, e.cfg.Group) }

// groupFollower is the part of a group's member that follows the group
// while it does not lead (followGroup): it links to the leader, moves its
// registration when the lease moves (rebind), and takes the lease over
// when the leader's link ends (takeOver), starting there what a leader
// runs. It has no state of its own: it drives the parts it holds.
type groupFollower struct {
	*memberEnv
	rec    *recordDraft
	lease  *leaseBinding
	roll   *leaderRoll
	epochs *epochs
	links  *linkServer
	live   *liveness
}

// followGroup is a non-leader's side of the group: it links to the leader
// and follows the group's record until the membership ends, moving its
// registration when the lease moves and taking the lease over when the
// leader's link ends. Once this member holds the lease it has nothing
// more to follow.
func (f *groupFollower) followGroup() {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, time.Second, 0
	for f.life.Err() == nil && !f.lease.holdsLease() {
		g, rev, seen := f.lease.groupRecord()
		seen = max(rev, seen)
		var err error
		end := leaderGone // this member claimed the takeover: it goes on with it
		switch {
		case g.Claim == "":
			end = f.followLeader(g, seen)
		case g.Claim != f.cfg.ID:
			end = f.awaitClaim(g, seen)
		}
		switch end {
		case leaderGone:
			if g.Claim != f.cfg.ID && f.awaitTurn(g, seen) {
				err = f.rebind() // another member claimed it or took it over while this one waited
				break
			}
			if err = f.takeOver(g, rev); err == nil && !f.lease.holdsLease() {
				err = f.rebind() // another member claimed it or took it over
			}
		case recordMoved:
			err = f.rebind()
		case leaderRefused:
			err = errLinkRefused // link again, after a pause
		}
		if err == nil {
			bo.Reset()
			continue
		}
		if f.life.Err() == nil {
			f.lg.Info("group lease", zap.Error(err))
		}
		select {
		case <-time.After(bo.NextBackOff()):
		case <-f.life.Done():
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
func (f *groupFollower) followLeader(g groupLease, seen int64) followEnd {
	ctx, cancel := context.WithCancel(f.life)
	defer cancel()
	moved := make(chan struct{})
	go func() { // exits with ctx
		for wr := range f.cli.Watch(clientv3.WithRequireLeader(ctx), f.groupKey(), clientv3.WithRev(seen+1)) {
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
		if f.cfg.linkHeld != nil {
			select {
			case <-f.cfg.linkHeld:
			case <-ctx.Done():
				return
			}
		}
		timeout := f.cfg.GroupLinkTimeout
		d := net.Dialer{Timeout: timeout}
		c, err := d.DialContext(ctx, "tcp", g.Link)
		if err != nil {
			return
		}
		hello, _ := json.Marshal(linkHello{ID: f.cfg.ID, Incarnation: f.inc, Lease: g.Lease, Proc: selfProc()})
		c.SetWriteDeadline(time.Now().Add(timeout))
		if _, err := c.Write(append(hello, '\n')); err != nil {
			c.Close()
			return
		}
		var onRecord func(*mvccpb.KeyValue)
		if f.cfg.GroupLease && !f.cfg.GroupEachWatches && !f.lease.holdsLease() {
			// It takes the quorum from its leader instead of watching etcd.
			onRecord = f.epochs.applyForwarded
		}
		f.lease.setLinked(true)
		defer f.lease.setLinked(false)
		// A moved record (or a broken watch of it) ends the link by this
		// member's choice (ctx): it says goodbye, or the leader, alive,
		// would take it for dead and delete its registration.
		end, _ = f.links.pingLink(c, bufio.NewReader(c), timeout, g.Proc, nil, onRecord, ctx.Done())
	}()
	select {
	case <-linkEnded:
		if f.life.Err() != nil {
			return membershipOver
		}
		select {
		case <-moved:
			return recordMoved
		default:
		}
		if end == linkRefused || end == linkDropped {
			return leaderRefused // alive: link again (a dropped member's registration is going)
		}
		return leaderGone
	case <-moved:
		cancel()
		<-linkEnded
		return recordMoved
	case <-f.life.Done():
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
func (f *groupFollower) awaitTurn(g groupLease, seen int64) bool {
	q, _ := f.epochs.latest()
	var ps []Participant
	if q != nil {
		ps = q.Participants
	}
	turn := takeoverTurn(ps, f.cfg.Group, f.cfg.ID, g.Leader)
	if turn == 0 {
		return false
	}
	ctx, cancel := context.WithTimeout(f.life, time.Duration(turn)*f.cfg.GroupLinkInterval)
	defer cancel()
	for wr := range f.cli.Watch(clientv3.WithRequireLeader(ctx), f.groupKey(), clientv3.WithRev(seen+1)) {
		if wr.Err() != nil {
			return false
		}
		if len(wr.Events) > 0 {
			return true
		}
	}
	return false
}

// awaitClaim waits for the takeover that the group's record g claims for
// another member (its leader's link ended) to move the record, watching
// it after seen for a GroupLinkTimeout: recordMoved when it moved (rebind
// follows), leaderGone when it did not (the claimer is passed over).
func (f *groupFollower) awaitClaim(g groupLease, seen int64) followEnd {
	ctx, cancel := context.WithTimeout(f.life, f.cfg.GroupLinkTimeout)
	defer cancel()
	for wr := range f.cli.Watch(clientv3.WithRequireLeader(ctx), f.groupKey(), clientv3.WithRev(seen+1)) {
		if wr.Err() != nil || len(wr.Events) > 0 {
			return recordMoved
		}
	}
	if f.life.Err() != nil {
		return membershipOver
	}
	f.lg.Info("a claimed takeover of the group's lease did not move the record: passed over", zap.String("claim", g.Claim), zap.Duration("waited", f.cfg.GroupLinkTimeout))
	return leaderGone
}

// rebind binds the registration to the group's current record: another
// member took the lease over. The incarnation stays. A record that moved
// on the lease the registration is already bound to (a takeover's claim)
// is only followed.
func (f *groupFollower) rebind() error {
	ctx, cancel := context.WithTimeout(f.life, f.cfg.LeaseTTL)
	defer cancel()
	resp, err := f.cli.Get(ctx, f.groupKey())
	if err != nil {
		return fmt.Errorf("read the group's lease: %w", err)
	}
	if len(resp.Kvs) == 0 {
		// The lease ended, and the registration with it: watchSelf sees
		// it go. A record gone without it (deleted by hand) is taken over.
		g, _, _ := f.lease.groupRecord()
		return f.takeOver(g, 0)
	}
	var g groupLease
	if err := json.Unmarshal(resp.Kvs[0].Value, &g); err != nil {
		return fmt.Errorf("unreadable group lease record: %w", err)
	}
	rev := resp.Kvs[0].ModRevision
	if f.lease.stillAt(rev, resp.Header.Revision) {
		return errors.New("the group's leader is unreachable and its record has not moved")
	}
	if lease, _ := f.lease.current(); int64(lease) == g.Lease {
		f.lease.follow(g, rev, resp.Header.Revision)
		return nil
	}
	unlock := f.rec.lockWrites()
	defer unlock()
	rec := f.rec.get()
	rec.Lease = g.Lease
	val, _ := json.Marshal(rec)
	tr, err := f.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(f.key), "=", f.inc),
		clientv3.Compare(clientv3.ModRevision(f.groupKey()), "=", rev)).
		Then(clientv3.OpPut(f.key, string(val), clientv3.WithLease(clientv3.LeaseID(g.Lease))),
			f.joinedOp(f.inc, clientv3.LeaseID(g.Lease))).Commit()
	if err != nil {
		return fmt.Errorf("move to the group's new lease: %w", err)
	}
	if !tr.Succeeded {
		return nil // moved again, or this registration is gone: follow again
	}
	f.lease.rebound(g, rev, tr.Header.Revision)
	f.rec.setLease(clientv3.LeaseID(g.Lease), "")
	f.lg.Info("moved to the group's new lease", zap.String("leader", g.Leader), zap.Int64("lease", g.Lease))
	return nil
}

// takeOver makes this member the group's leader after the leader's link
// ended. Unless this member claimed it already (old.Claim), it claims the
// takeover first (claim: the old leader's registration goes there), then
// grants a new lease and, in one transaction fenced on the group record
// at rev (0: none, and no claim), names itself leader on it and moves its
// registration to it. Losing the race is not an error: the winner's
// record moves the others.
func (f *groupFollower) takeOver(old groupLease, rev int64) error {
	if rev != 0 && old.Claim != f.cfg.ID {
		won, at, err := f.claim(old, rev)
		if err != nil || !won {
			return err
		}
		rev = at
	}
	if f.cfg.takeoverHeld != nil {
		select {
		case <-f.cfg.takeoverHeld:
		case <-f.life.Done():
			return nil
		}
	}
	ctx, cancel := context.WithTimeout(f.life, f.cfg.LeaseTTL)
	defer cancel()
	lr, err := f.cli.Grant(ctx, f.lease.ttlSeconds())
	if err != nil {
		return fmt.Errorf("take the group's lease over: grant: %w", err)
	}
	g := groupLease{Lease: int64(lr.ID), Leader: f.cfg.ID, Link: f.links.addr(), Since: time.Now(), Proc: selfProc()}
	gval, _ := json.Marshal(g)
	var gsp *gossip.Node
	if f.cfg.Gossip != nil {
		if gsp, err = gossip.Start(gossip.NodeName(f.cfg.Job, f.cfg.ID, int64(lr.ID)), *f.cfg.Gossip); err != nil {
			f.lease.revokeQuietly(lr.ID)
			return err
		}
	}
	unlock := f.rec.lockWrites()
	rec := f.rec.get()
	rec.Lease = int64(lr.ID)
	if gsp != nil {
		rec.Gossip = gsp.Addr()
	}
	val, _ := json.Marshal(rec)
	cmp := clientv3.Compare(clientv3.ModRevision(f.groupKey()), "=", rev)
	if rev == 0 {
		cmp = clientv3.Compare(clientv3.CreateRevision(f.groupKey()), "=", 0)
	}
	// The old leader's registration went with the claim; a registration
	// of its id on the old lease now is a new process's, bound under the
	// claimed record, which moves with the others.
	then := []clientv3.Op{
		clientv3.OpPut(f.groupKey(), string(gval), clientv3.WithLease(lr.ID)),
		clientv3.OpPut(f.key, string(val), clientv3.WithLease(lr.ID)),
	}
	tr, err := f.cli.Txn(ctx).If(cmp, clientv3.Compare(clientv3.CreateRevision(f.key), "=", f.inc)).Then(then...).Commit()
	won, at := err == nil && tr.Succeeded, int64(0)
	if err == nil {
		at = tr.Header.Revision
	} else if f.life.Err() == nil {
		// No answer is not a refusal: etcd may have applied the
		// transaction and the answer come too late (a loaded etcd, past
		// ctx). Revoking the lease then would delete the group's record
		// and this member's registration, now bound to it: a survivor
		// counted dead, and the group's other members moved to a lease
		// that is gone.
		var g groupLease
		g, at = f.readRecord()
		if won = g.Lease == int64(lr.ID); won {
			f.lg.Info("a takeover whose transaction got no answer took effect", zap.Int64("lease", g.Lease))
		}
	}
	if !won {
		unlock()
		if gsp != nil {
			gsp.Close()
		}
		f.lease.revokeQuietly(lr.ID)
		if err != nil {
			return fmt.Errorf("take the group's lease over: %w", err)
		}
		return nil // another member was faster, or this registration is gone
	}
	// Lead at once: the others see the record move and link here within
	// a round trip or two, and a hello this member does not yet take as
	// its lease's would end their link (and make one of them take over
	// from this member).
	f.epochs.lead()
	f.lease.lead(g, at, lr.ID, gsp)
	f.rec.setLease(lr.ID, rec.Gossip)
	unlock()
	ka, kerr := f.cli.KeepAlive(f.life, lr.ID)
	if kerr != nil { // only when the membership is over
		return nil
	}
	f.lg.Info("took the group's lease over", zap.String("previous_leader", old.Leader), zap.Int64("lease", int64(lr.ID)))
	f.spawn(func() { f.live.renew(lr.ID, ka) })
	f.spawn(f.epochs.leadEpochs) // the group now takes the quorum from this member
	f.spawn(func() { f.roll.rollGroup(at) })
	if f.cfg.HeartbeatInterval > 0 {
		f.spawn(f.live.heartbeats)
	}
	if gsp != nil {
		f.spawn(f.live.drainGossip)
		if err := f.live.joinGossip(ctx); err != nil {
			f.lg.Warn("gossip join failed; lease expiry remains the failure detector", zap.Error(err))
		}
	}
	return nil
}

// claim marks the group's record, at rev and still on the old lease it
// names, as taken over by this member, and deletes the old leader's
// registration if it is still on that lease: one transaction, fenced on
// rev and on this member's registration. It reports whether the claim
// holds and the record's revision with it; a claim that lost the race is
// no error (the record moved: rebind follows).
func (f *groupFollower) claim(old groupLease, rev int64) (won bool, at int64, err error) {
	ctx, cancel := context.WithTimeout(f.life, f.cfg.LeaseTTL)
	defer cancel()
	c := old
	c.Claim = f.cfg.ID
	cval, _ := json.Marshal(c)
	then := []clientv3.Op{clientv3.OpPut(f.groupKey(), string(cval), clientv3.WithLease(clientv3.LeaseID(old.Lease)))}
	if old.Leader != "" && old.Leader != f.cfg.ID {
		lk := f.keys.Member(f.cfg.Job, old.Leader)
		then = append(then, clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.LeaseValue(lk), "=", old.Lease)},
			[]clientv3.Op{clientv3.OpDelete(lk)}, nil))
	}
	tr, err := f.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(f.groupKey()), "=", rev),
		clientv3.Compare(clientv3.CreateRevision(f.key), "=", f.inc)).Then(then...).Commit()
	switch {
	case err == nil && !tr.Succeeded:
		return false, 0, nil
	case err == nil:
		at = tr.Header.Revision
	case errors.Is(err, rpctypes.ErrLeaseNotFound) || f.life.Err() != nil:
		// The old lease expired, and the record with it: rebind takes
		// the group over afresh.
		return false, 0, fmt.Errorf("claim the group's lease: %w", err)
	default:
		// As for the takeover: the claim may have been applied.
		var g groupLease
		if g, at = f.readRecord(); g.Lease != old.Lease || g.Claim != f.cfg.ID {
			return false, 0, fmt.Errorf("claim the group's lease: %w", err)
		}
	}
	f.lease.follow(c, at, at)
	f.lg.Info("claimed the group's lease", zap.String("previous_leader", old.Leader), zap.Int64("lease", old.Lease))
	return true, at, nil
}

// readRecord reads the group's record and its mod revision, retrying
// until etcd answers, for at most a LeaseTTL (past it, a lease no one
// renewed has expired, and the record with it) or until the membership
// ends; a zero record when there is none or it could not be read.
func (f *groupFollower) readRecord() (g groupLease, at int64) {
	ctx, cancel := context.WithTimeout(f.life, f.cfg.LeaseTTL)
	defer cancel()
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, time.Second, 0
	var resp *clientv3.GetResponse
	read := func() (err error) {
		resp, err = f.cli.Get(ctx, f.groupKey())
		return err
	}
	if backoff.Retry(read, backoff.WithContext(bo, ctx)) != nil || len(resp.Kvs) == 0 {
		return groupLease{}, 0
	}
	if json.Unmarshal(resp.Kvs[0].Value, &g) != nil {
		return groupLease{}, 0
	}
	return g, resp.Kvs[0].ModRevision
}
