package membership

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// A group's leader holds every registration on its lease to a link
// (MemberConfig.GroupLease). A member registers on the group's lease
// before it links to the leader; one that dies in between (or whose link
// ended with a goodbye and that never links again) ends no link, and the
// lease it is bound to lives on, renewed by the leader: it would stay
// registered for ever, and the coordinator would count a dead rank.
//
// So each write that binds a registration to a group's lease (a member's
// registration, its move to a lease taken over) also writes the group's
// joined key (etcdkeys.Layout.GroupJoined), naming the member, bound to the
// same lease. The leader watches that key from the revision at which it
// took the lease (created it, or took it over), so it sees every
// registration on its lease but its own; it keeps a roll of them and of
// their links (groupRoll), and removes a registration that has been
// without a link for MemberConfig.unlinkedBound since the leader saw it
// appear or since its last link ended with a goodbye. A link whose hello
// the leader has not read yet (an attempt in progress, whose member the
// hello names) holds every removal back until it is read. The removal is
// fenced as a death's (incarnation and lease) and given up when a link
// names the registration before the delete is sent; a member whose hello
// comes later loses the race: it sees its registration deleted (the
// watch of its own key), its membership ends with ErrEvicted, as any
// removed member's does, and its link ends with a goodbye.
//
// The bound runs from when the leader sees the registration, on its own
// clock: a leader that is slow to see it, or slow to run its timer, only
// gives the member longer. A leader whose watch of the joined record
// broke reads the registrations on its lease (the lease's keys) and
// watches again from then.
//
// What it costs etcd: one key per group, one put more in each
// registration's transaction (no round trip more), and one watcher per
// group, the leader's, of one key.

// unlinkedBound is how long a registration on a group's lease may go
// without a link to the group's leader: LeaseTTL, what a member with a
// lease of its own is given before its death counts, and four
// GroupLinkTimeouts, time for a dial, a hello, a refusal and a second
// try on a loaded host (each bounded by GroupLinkTimeout). 9 s by default.
func (c MemberConfig) unlinkedBound() time.Duration {
	return c.LeaseTTL + 4*c.GroupLinkTimeout
}

// groupJoined is the record at etcdkeys.Layout.GroupJoined.
type groupJoined struct {
	ID string `json:"id"`
	// Incarnation is the registration's; 0: the revision of the write of
	// this record, which created the registration.
	Incarnation int64 `json:"inc,omitempty"`
}

// joinedOp says that this member's registration, incarnation inc (0: the
// one the same transaction creates), binds to lease.
func (e *memberEnv) joinedOp(inc int64, lease clientv3.LeaseID) clientv3.Op {
	val, _ := json.Marshal(groupJoined{ID: e.cfg.ID, Incarnation: inc})
	return clientv3.OpPut(e.keys.GroupJoined(e.cfg.Job, e.cfg.Group), string(val), clientv3.WithLease(lease))
}

// groupRoll is a group leader's roll of the registrations bound to its
// lease, other than its own, and of their links. Its rule: a registration
// without a link for bound is due for removal, unless a hello is unread.
// Pure: time is an input; the watch, the links and etcd are the caller's
// (rollGroup, linkServer.serve). The Member holds it in its leaderRoll.
type groupRoll struct {
	self   string // the leader's own id: never on the roll
	bound  time.Duration
	regs   map[rollKey]*rollEntry
	hellos int // links accepted whose hello is not read yet
}

// rollKey is one registration: a member id and an incarnation. A stale
// one (an older incarnation, a stranger's hello) is an entry like any
// other: its removal, fenced, finds nothing and drops it.
type rollKey struct {
	id  string
	inc int64
}

type rollEntry struct {
	links    int       // live links whose hello named it
	since    time.Time // without a link since then (when links is 0)
	removing bool      // due: its removal is under way
}

func newGroupRoll(self string, bound time.Duration) groupRoll {
	return groupRoll{self: self, bound: bound, regs: map[rollKey]*rollEntry{}}
}

func (r *groupRoll) entry(k rollKey, now time.Time) *rollEntry {
	if k.id == r.self {
		return nil
	}
	e := r.regs[k]
	if e == nil {
		e = &rollEntry{since: now}
		r.regs[k] = e
	}
	return e
}

// joined: registration k bound itself to the lease (its joined record,
// seen at now). Unlinked, it has the whole bound from now to link.
func (r *groupRoll) joined(k rollKey, now time.Time) {
	if e := r.entry(k, now); e != nil && e.links == 0 && !e.removing {
		e.since = now
	}
}

// found: registration k is on the lease (read from etcd at now); on the
// roll already, it keeps its time.
func (r *groupRoll) found(k rollKey, now time.Time) { r.entry(k, now) }

// linked: a link's hello named k.
func (r *groupRoll) linked(k rollKey, now time.Time) {
	if e := r.entry(k, now); e != nil {
		e.links++
	}
}

// unlinked: a link whose hello named k ended at now.
func (r *groupRoll) unlinked(k rollKey, now time.Time) {
	e := r.regs[k]
	if e == nil || e.links == 0 {
		return
	}
	if e.links--; e.links == 0 {
		e.since = now
	}
}

// helloOpened and helloRead bracket the read of a link's hello.
func (r *groupRoll) helloOpened() { r.hellos++ }
func (r *groupRoll) helloRead()   { r.hellos-- }

// settled: an attempt to remove k ended (removed, found gone or moved,
// or given up for a link). k leaves the roll unless a link names it.
func (r *groupRoll) settled(k rollKey) {
	e := r.regs[k]
	switch {
	case e == nil:
	case e.links == 0:
		delete(r.regs, k)
	default:
		e.removing = false
	}
}

// unlinkedNow reports whether k is on the roll without a link: its
// removal goes on.
func (r *groupRoll) unlinkedNow(k rollKey) bool {
	e := r.regs[k]
	return e != nil && e.links == 0
}

// due returns the registrations due for removal at now (by id), marked
// as under way, and when the next one falls due (zero: none is timed).
// While a hello is unread none is due: it may be a due member's.
func (r *groupRoll) due(now time.Time) (out []rollKey, next time.Time) {
	if r.hellos > 0 {
		return nil, time.Time{}
	}
	for k, e := range r.regs {
		if e.links > 0 || e.removing {
			continue
		}
		at := e.since.Add(r.bound)
		if !at.After(now) {
			e.removing = true
			out = append(out, k)
			continue
		}
		if next.IsZero() || at.Before(next) {
			next = at
		}
	}
	slices.SortFunc(out, func(a, b rollKey) int { return strings.Compare(a.id, b.id) })
	return out, next
}

// leaderRoll is a group leader's roll (groupRoll) as the member keeps it:
// fed by the watch of the joined record and by the links (linkServer.serve),
// it removes the registrations it finds due (rollGroup) from the lease it
// reads, and removes from, by the member's leaseBinding.
type leaderRoll struct {
	*memberEnv
	lease *leaseBinding

	mu   sync.Mutex // guards roll
	roll groupRoll
	wake chan struct{} // the roll changed: rollGroup looks again (capacity 1)
}

// init readies the roll of the leader self (MemberConfig.GroupLease).
func (l *leaderRoll) init(self string, bound time.Duration) {
	l.roll = newGroupRoll(self, bound)
	l.wake = make(chan struct{}, 1)
}

// poke wakes rollGroup to look at the roll again.
func (l *leaderRoll) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// joined and found: the registrations ks bound themselves to the lease
// (their joined records), or were read on it (groupRoll.joined, found).
func (l *leaderRoll) joined(ks ...rollKey) { l.each(ks, (*groupRoll).joined) }
func (l *leaderRoll) found(ks ...rollKey)  { l.each(ks, (*groupRoll).found) }

func (l *leaderRoll) each(ks []rollKey, f func(*groupRoll, rollKey, time.Time)) {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range ks {
		f(&l.roll, k, now)
	}
}

// helloOpened: a link was accepted; helloRead: its hello was read, and
// named k if linked (the link counts for k from now).
func (l *leaderRoll) helloOpened() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.roll.helloOpened()
}

func (l *leaderRoll) helloRead(k rollKey, linked bool) {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.roll.helloRead()
	if linked {
		l.roll.linked(k, now)
	}
}

func (l *leaderRoll) unlinked(k rollKey) {
	now := time.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.roll.unlinked(k, now)
}

func (l *leaderRoll) settled(k rollKey) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.roll.settled(k)
}

func (l *leaderRoll) unlinkedNow(k rollKey) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.roll.unlinkedNow(k)
}

func (l *leaderRoll) due(now time.Time) (out []rollKey, next time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.roll.due(now)
}

// rollGroup keeps the roll of the lease this member took at revision rev
// (see the top of this file): it watches the group's joined record from
// rev+1 and removes the registrations the roll finds due. It exits when
// the membership ends; the removals it started run on goroutines of
// their own, which end with it too.
func (l *leaderRoll) rollGroup(rev int64) {
	key := l.keys.GroupJoined(l.cfg.Job, l.cfg.Group)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, 2*time.Second, 0
	for {
		ctx, cancel := context.WithCancel(l.life)
		wch := l.cli.Watch(clientv3.WithRequireLeader(ctx), key, clientv3.WithRev(rev+1), clientv3.WithFilterDelete())
		began := time.Now()
		l.followRoll(wch, timer)
		cancel()
		if time.Since(began) > bo.MaxInterval {
			bo.Reset()
		}
		select {
		case <-time.After(bo.NextBackOff()):
		case <-l.life.Done():
			return
		}
		// The watch broke (etcd lost its leader, or compacted past it).
		// Watching again from where it was would start far in the past
		// when no member joined for long, and etcd serves such a watch
		// from its log, a scan under the lock its applies take (a burst
		// of them, one per group, tipped etcd over at 100,000 ranks:
		// docs/capacity.md): read what is on the lease now instead, and
		// watch from then.
		if rev = l.readRollRetrying(); rev == 0 {
			return // the membership ended
		}
	}
}

// followRoll feeds the roll from one watch of the joined record and
// removes what falls due, until the watch or the membership ends.
func (l *leaderRoll) followRoll(wch clientv3.WatchChan, timer *time.Timer) {
	for {
		l.removeDue(timer)
		select {
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil {
				return
			}
			l.applyJoined(wr.Events)
		case <-timer.C:
		case <-l.wake:
		case <-l.life.Done():
			return
		}
	}
}

// applyJoined puts on the roll the registrations the joined records of
// evs bound to the lease this member holds.
func (l *leaderRoll) applyJoined(evs []*clientv3.Event) {
	lease, _ := l.lease.current()
	var ks []rollKey
	for _, ev := range evs {
		var j groupJoined
		if ev.Type != mvccpb.PUT || ev.Kv.Lease != int64(lease) || json.Unmarshal(ev.Kv.Value, &j) != nil || j.ID == "" {
			continue // another lease's (this member's group moved on), or unreadable
		}
		inc := j.Incarnation
		if inc == 0 {
			inc = ev.Kv.ModRevision
		}
		ks = append(ks, rollKey{j.ID, inc})
	}
	l.joined(ks...)
}

// removeDue starts the removal of each registration the roll finds due
// and sets timer for the next.
func (l *leaderRoll) removeDue(timer *time.Timer) {
	now := time.Now()
	due, next := l.due(now)
	lease, _ := l.lease.current()
	for _, k := range due {
		l.spawn(func() { l.removeUnlinked(k, lease) })
	}
	timer.Stop()
	if !next.IsZero() {
		timer.Reset(next.Sub(now))
	}
}

// removeUnlinked removes registration k from lease: it was without a link
// for the bound. It gives up when a link names k meanwhile.
func (l *leaderRoll) removeUnlinked(k rollKey, lease clientv3.LeaseID) {
	still := func() bool { return l.unlinkedNow(k) }
	removed, tries := l.lease.removeFromLease(linkHello{ID: k.id, Incarnation: k.inc, Lease: int64(lease)}, "registration did not link", still)
	l.settled(k)
	l.poke()
	if removed {
		l.lg.Warn("group member registered on the group's lease but did not link to its leader in time: removed its registration",
			zap.String("peer", k.id), zap.Int64("incarnation", k.inc), zap.Duration("bound", l.cfg.unlinkedBound()), zap.Int("tries", tries))
	}
}

// readRollRetrying reads the lease's registrations onto the roll
// (readRoll), trying until etcd answers or the membership ends (then it
// returns 0).
func (l *leaderRoll) readRollRetrying() int64 {
	var rev int64
	read := func() (err error) {
		ctx, cancel := context.WithTimeout(l.life, l.cfg.LeaseTTL)
		defer cancel()
		rev, err = l.readRoll(ctx)
		return err
	}
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, 2*time.Second, 0
	if backoff.RetryNotify(read, backoff.WithContext(bo, l.life), func(err error, next time.Duration) {
		l.lg.Info("reading the registrations on the group's lease failed; trying again", zap.Error(err), zap.Duration("in", next))
	}) != nil {
		return 0
	}
	return rev
}

// readRoll puts on the roll every registration bound to the lease this
// member holds: the lease's keys, then the records among them. Those
// bound to it after rev came after the group's joined record was read at
// rev, and a watch of that record from rev+1 sees them.
func (l *leaderRoll) readRoll(ctx context.Context) (rev int64, err error) {
	lease, _ := l.lease.current()
	jr, err := l.cli.Get(ctx, l.keys.GroupJoined(l.cfg.Job, l.cfg.Group))
	if err != nil {
		return 0, err
	}
	ttl, err := l.cli.TimeToLive(ctx, lease, clientv3.WithAttachedKeys())
	if err != nil {
		return 0, err
	}
	prefix := l.keys.Members(l.cfg.Job)
	var gets []clientv3.Op
	for _, k := range ttl.Keys {
		if strings.HasPrefix(string(k), prefix) {
			gets = append(gets, clientv3.OpGet(string(k)))
		}
	}
	for len(gets) > 0 {
		n := min(len(gets), 64) // etcd takes 128 operations in a transaction by default
		resp, err := l.cli.Txn(ctx).Then(gets[:n]...).Commit()
		if err != nil {
			return 0, err
		}
		gets = gets[n:]
		var ks []rollKey
		for _, r := range resp.Responses {
			for _, kv := range r.GetResponseRange().Kvs {
				if kv.Lease == int64(lease) {
					ks = append(ks, rollKey{strings.TrimPrefix(string(kv.Key), prefix), kv.CreateRevision})
				}
			}
		}
		l.found(ks...)
	}
	l.poke()
	return jr.Header.Revision, nil
}
