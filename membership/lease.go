package membership

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/cenkalti/backoff/v4"
	"github.com/ftcomm/ftcomm/membership/gossip"
)

// leaseBinding is the lease a member's registration is bound to: its own,
// or its replica group's (MemberConfig.GroupLease, grouplease.go), and
// for a group's lease the group's record it is bound under and the links
// that hold the group together. Join binds it (ownLease, enterGroup); a
// group's member moves it when the group's lease moves or takes the lease
// over (groupFollower's rebind and takeOver); while it holds the lease it
// removes the registrations of dead members from it (removeFromLease).
type leaseBinding struct {
	*memberEnv
	rec *recordDraft // told the lease the registration is bound to

	mu sync.Mutex // guards the fields below
	// lease is the lease the registration is bound to; holds says
	// whether this member keeps it alive (always, without GroupLease; the
	// group's leader, with it), ka is its keepalive as Join started it,
	// and gsp the gossip node that runs under it (nil: none, or not the
	// holder).
	lease clientv3.LeaseID
	holds bool
	ka    <-chan *clientv3.LeaseKeepAliveResponse
	gsp   *gossip.Node
	// group and groupRev are the group lease record the registration is
	// bound under and its mod revision; groupSeen is a revision at which
	// that record was known to be still at groupRev (a fenced write's),
	// where a follower's watch of it starts: a watch from groupRev+1,
	// which may be the group's first revision, is one etcd must catch up
	// from its log, under the lock its applies take (at 100,000 ranks,
	// tens of thousands of revisions for each of 87,500 followers).
	group     groupLease
	groupRev  int64
	groupSeen int64
	links     int  // the group links this member serves as leader
	linked    bool // a member that does not lead: its link to the leader is up
}

// ownLease grants this member a lease of its own, keeps it alive from now
// (registering may wait for a previous incarnation longer than the TTL)
// and starts gossip under it.
func (b *leaseBinding) ownLease(ctx context.Context) error {
	// The first call to etcd waits for a connection (a member may start
	// before its coordinator): say what it waits for while it does.
	stopNotice := waitNotice(b.cli, b.lg, "grant a lease")
	lr, err := b.cli.Grant(ctx, b.ttlSeconds())
	stopNotice()
	if err != nil {
		return fmt.Errorf("membership: join %s/%s: grant lease: %w", b.cfg.Job, b.cfg.ID, ctxErr(ctx, err))
	}
	ka, err := b.cli.KeepAlive(b.life, lr.ID)
	if err != nil {
		b.revokeQuietly(lr.ID)
		return fmt.Errorf("membership: join %s/%s: keepalive: %w", b.cfg.Job, b.cfg.ID, err)
	}
	var g *gossip.Node
	if b.cfg.Gossip != nil {
		if g, err = gossip.Start(gossip.NodeName(b.cfg.Job, b.cfg.ID, int64(lr.ID)), *b.cfg.Gossip); err != nil {
			b.revokeQuietly(lr.ID)
			return err
		}
	}
	b.own(lr.ID, ka, g)
	addr := ""
	if g != nil {
		addr = g.Addr()
	}
	b.rec.setLease(lr.ID, addr)
	return nil
}

// dropOwnLease undoes ownLease for a Join that did not complete with it.
func (b *leaseBinding) dropOwnLease() {
	lease, holds, g := b.drop()
	b.rec.setLease(0, "")
	if g != nil {
		g.Close()
	}
	if holds && lease != 0 {
		b.revokeQuietly(lease)
	}
}

// revokeQuietly revokes a lease this member granted and will not use,
// for at most 2 s, whatever etcd answers.
func (b *leaseBinding) revokeQuietly(lease clientv3.LeaseID) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	b.cli.Revoke(ctx, lease)
}

// ttlSeconds is LeaseTTL in whole seconds, rounded up: a lease's TTL.
func (b *leaseBinding) ttlSeconds() int64 {
	return int64((b.cfg.LeaseTTL + time.Second - 1) / time.Second)
}

// enterGroup binds the registration to the group's lease: the current
// one, or a new one this member holds when the group has none.
func (b *leaseBinding) enterGroup(ctx context.Context) error {
	stopNotice := waitNotice(b.cli, b.lg, "read the group's lease")
	resp, err := b.cli.Get(ctx, b.groupKey())
	stopNotice()
	if err != nil {
		return fmt.Errorf("membership: join %s/%s: read the group's lease: %w", b.cfg.Job, b.cfg.ID, ctxErr(ctx, err))
	}
	if len(resp.Kvs) == 0 {
		b.forgetGroup()
		return b.ownLease(ctx) // the registration creates the record
	}
	var g groupLease
	if err := json.Unmarshal(resp.Kvs[0].Value, &g); err != nil || g.Lease == 0 {
		return fmt.Errorf("membership: join %s/%s: unreadable group lease record %s", b.cfg.Job, b.cfg.ID, b.groupKey())
	}
	b.follow(g, resp.Kvs[0].ModRevision, resp.Header.Revision)
	b.rec.setLease(clientv3.LeaseID(g.Lease), "")
	return nil
}

// groupBinding is what registering adds for the group lease: a leader
// creates the group's record (none may exist), naming link as where it
// serves the group's links; a member checks that the record it binds
// under is still current and tells the leader that it joined the lease
// (grouproll.go).
func (b *leaseBinding) groupBinding(link string) (clientv3.Cmp, []clientv3.Op) {
	k := b.groupKey()
	lease, holds := b.current()
	if !holds {
		_, rev, _ := b.groupRecord()
		return clientv3.Compare(clientv3.ModRevision(k), "=", rev), []clientv3.Op{b.joinedOp(0, lease)}
	}
	g := groupLease{Lease: int64(lease), Leader: b.cfg.ID, Link: link, Since: time.Now(), Proc: selfProc()}
	b.setGroup(g)
	val, _ := json.Marshal(g)
	op := clientv3.OpPut(k, string(val), clientv3.WithLease(lease))
	return clientv3.Compare(clientv3.CreateRevision(k), "=", 0), []clientv3.Op{op}
}

// current returns the lease and whether this member keeps it alive.
func (b *leaseBinding) current() (clientv3.LeaseID, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.lease, b.holds
}

func (b *leaseBinding) holdsLease() bool {
	_, holds := b.current()
	return holds
}

// shared reports whether other members are bound to the lease this
// member holds (they linked to it).
func (b *leaseBinding) shared() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.holds && b.links > 0
}

func (b *leaseBinding) gossip() *gossip.Node {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.gsp
}

// keepAlive returns the lease and the keepalive Join started.
func (b *leaseBinding) keepAlive() (clientv3.LeaseID, <-chan *clientv3.LeaseKeepAliveResponse) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.lease, b.ka
}

// own binds the registration to a lease this member keeps alive (ka) and
// runs gossip under (g, nil: none).
func (b *leaseBinding) own(lease clientv3.LeaseID, ka <-chan *clientv3.LeaseKeepAliveResponse, g *gossip.Node) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.lease, b.holds, b.ka, b.gsp = lease, true, ka, g
}

// drop unbinds the registration, and returns what it was bound to.
func (b *leaseBinding) drop() (lease clientv3.LeaseID, holds bool, g *gossip.Node) {
	b.mu.Lock()
	defer b.mu.Unlock()
	lease, holds, g = b.lease, b.holds, b.gsp
	b.lease, b.holds, b.ka, b.gsp = 0, false, nil, nil
	return lease, holds, g
}

// groupRecord returns the group's record the registration is bound
// under, its mod revision and the revision at which it was last seen
// still there.
func (b *leaseBinding) groupRecord() (g groupLease, rev, seen int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.group, b.groupRev, b.groupSeen
}

// watchFrom returns the revision after which a member that does not
// hold the lease watches the group's record.
func (b *leaseBinding) watchFrom() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return max(b.groupRev, b.groupSeen)
}

// follow binds the registration to the group's record g, read at seen
// with mod revision rev, on the group's lease (this member does not keep
// it alive).
func (b *leaseBinding) follow(g groupLease, rev, seen int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.group, b.groupRev, b.groupSeen = g, rev, seen
	b.lease, b.holds = clientv3.LeaseID(g.Lease), false
}

// forgetGroup forgets the group's record: the group has none (this
// member's registration creates it).
func (b *leaseBinding) forgetGroup() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.group, b.groupRev, b.groupSeen = groupLease{}, 0, 0
}

// setGroup records the group record this member, its leader, creates.
func (b *leaseBinding) setGroup(g groupLease) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.group = g
}

// registered records that the registration, written at rev, compared the
// group's record (or created it, at the leader): still current at rev.
func (b *leaseBinding) registered(rev int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.holds {
		b.groupRev = rev // the record this registration created
	}
	b.groupSeen = rev
}

// moved reports whether the group's record (kvs: as read when a
// registration failed) is no longer the one the member bound under.
func (b *leaseBinding) moved(kvs []*mvccpb.KeyValue) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.holds {
		return len(kvs) > 0
	}
	return len(kvs) == 0 || kvs[0].ModRevision != b.groupRev
}

// stillAt reports whether the group's record is still at mod revision
// rev, as read at revision at; if so it was seen there at at.
func (b *leaseBinding) stillAt(rev, at int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if rev != b.groupRev {
		return false
	}
	b.groupSeen = max(b.groupSeen, at)
	return true
}

// rebound records the registration's move to the group's record g (mod
// revision rev), written at seen: another member took the lease over.
func (b *leaseBinding) rebound(g groupLease, rev, seen int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.group, b.groupRev, b.groupSeen, b.lease = g, rev, seen, clientv3.LeaseID(g.Lease)
}

// lead records that this member took the group's lease over: g, written
// at at, names it; it keeps lease alive and runs gossip under it (gsp,
// nil: none).
func (b *leaseBinding) lead(g groupLease, at int64, lease clientv3.LeaseID, gsp *gossip.Node) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.group, b.groupRev, b.groupSeen = g, at, at
	b.lease, b.holds, b.gsp = lease, true, gsp
}

// link counts a link whose hello named lease, if this member keeps that
// lease alive; it reports whether it did.
func (b *leaseBinding) link(lease int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.holds || lease != int64(b.lease) {
		return false
	}
	b.links++
	return true
}

// unlink uncounts a link that ended, and reports whether this member
// still leads.
func (b *leaseBinding) unlink() (leads bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.links--
	return b.holds
}

func (b *leaseBinding) setLinked(up bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.linked = up
}

// state fills in what s says of the member's lease.
func (b *leaseBinding) state(s *MemberState) {
	b.mu.Lock()
	defer b.mu.Unlock()
	s.Leads, s.Lease, s.Leader, s.GroupRev = b.holds, int64(b.lease), b.group.Leader, b.groupRev
	s.Linked, s.Links = b.linked, b.links
	if !b.holds {
		s.Claim = b.group.Claim
	}
}

// removeFromLease deletes the registration h names, fenced on the
// incarnation it names and on the group's lease: a hello naming a member
// of another group (or a stranger's that knew the lease) can delete no
// registration but one on this lease. why says what happened to the
// member, for the log of a try that failed.
//
// It tries until etcd answers, while this member leads and still()
// holds: the registration is bound to the lease this member renews, so
// nothing else removes it (the group's other members run no gossip, and a
// peer's blame may come after the coordinator revoked the epoch, and be
// dropped). A death whose delete etcd refused once (shedding load under a
// mass death's burst of takeovers) otherwise stayed registered, and the
// job waited for it for ever. When this member stops leading, the
// registration is on a lease no one renews, and expires with it. removed
// says whether it deleted the registration, tries how many tries it took.
func (b *leaseBinding) removeFromLease(h linkHello, why string, still func() bool) (removed bool, tries int) {
	k := b.keys.Member(b.cfg.Job, h.ID)
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, 2*time.Second, 0
	for try := 1; b.life.Err() == nil && b.holdsLease() && still(); try++ {
		ctx, cancel := context.WithTimeout(b.life, 5*time.Second)
		tr, err := b.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", h.Incarnation),
			clientv3.Compare(clientv3.LeaseValue(k), "=", clientv3.LeaseID(h.Lease))).
			Then(clientv3.OpDelete(k)).Commit()
		cancel()
		switch {
		case err == nil && tr.Succeeded:
			return true, try
		case err == nil:
			return false, try // gone already, or moved to another lease: not this group's to remove
		}
		if try == 1 || try%10 == 0 { // a drowning etcd fails thousands of them at once
			b.lg.Warn("could not remove a group member whose "+why+"; trying again", zap.String("peer", h.ID), zap.Int("tries", try), zap.Error(err))
		}
		select {
		case <-time.After(bo.NextBackOff()):
		case <-b.life.Done():
		}
	}
	return false, 0
}
