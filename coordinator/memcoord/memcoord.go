// Package memcoord is a coordinator in memory: the real quorum machine
// (quorum.Machine) run in one process, with no etcd and no
// gossip. Members join, report and leave through method calls, and every
// decision reaches every member at once. A Member satisfies ft.Membership
// (and DurableCommit's records), so a whole job can run in one process:
// for examples, for tests of the step protocol that do not test etcd, and
// for trying ft without a cluster.
//
//	coord := memcoord.New("job", quorum.DefaultConfig())
//	defer coord.Close()
//	c, err := ft.New(ctx, ft.Config{Job: "job", Group: "g0", Secret: secret,
//		Membership: coord.Join("g0.0", "g0", 1)})
//
// What it leaves out is what the etcd-backed coordinator adds around the
// machine: leases (a member is gone only when it leaves, is killed or is
// removed here), gossip, checking a blamed member's address (blame is
// recorded, the blamed stay until removed), fencing and persistence.
//
// Concurrency: every method of Coordinator and Member is safe for
// concurrent use. A Coordinator runs no goroutine of its own except a
// timer for the machine's next wake-up, stopped by Close.
package memcoord

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership"
)

// Coordinator is one job's quorums, decided in memory.
type Coordinator struct {
	mu      sync.Mutex
	m       *quorum.Machine
	members map[string]*Member
	inc     int64
	store   *memstore.Store
	wake    *time.Timer
	history []membership.Quorum
	commits map[int64]membership.CommitRecord
	closed  bool
	timed   bool // a straggler policy needs the members' step times
}

// New returns the coordinator of job with the given quorum rules.
func New(job string, cfg quorum.Config) *Coordinator {
	return &Coordinator{m: quorum.NewMachine(job, cfg, nil), members: map[string]*Member{}, store: memstore.New(),
		commits: map[int64]membership.CommitRecord{}, timed: cfg.Stragglers.Factor > 0}
}

// Member is one registration with a Coordinator.
type Member struct {
	c       *Coordinator
	id      string
	inc     int64
	mu      sync.Mutex
	quorum  *membership.Quorum
	revs    map[uint64]membership.Revocation
	changed chan struct{}
	done    chan struct{}
	step    int64
	closed  bool
	severed atomic.Bool
}

// ErrSevered is what a severed member's reports fail with.
var ErrSevered = errors.New("memcoord: the member's process is dead")

// Join registers id (of replica group group) as a new incarnation asking
// to take part, needing at least minReplicas participants (0: the
// coordinator's default). A late joiner learns the current quorum at once.
func (c *Coordinator) Join(id, group string, minReplicas int) *Member {
	return c.join(id, group, minReplicas, false)
}

// JoinSpare is Join for a spare (membership.MemberRecord.Spare): it asks
// to take part and waits until the job runs below its target.
func (c *Coordinator) JoinSpare(id, group string, minReplicas int) *Member {
	return c.join(id, group, minReplicas, true)
}

func (c *Coordinator) join(id, group string, minReplicas int, spare bool) *Member {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.inc++
	m := &Member{c: c, id: id, inc: c.inc, revs: map[uint64]membership.Revocation{}, changed: make(chan struct{}), done: make(chan struct{})}
	if old := c.members[id]; old != nil {
		old.endLocked()
	}
	c.members[id] = m
	c.m.Upsert(time.Now(), membership.MemberRecord{ID: id, Group: group, Incarnation: m.inc, WantQuorum: true,
		MinReplicas: minReplicas, Joined: time.Now(), Spare: spare})
	if len(c.history) > 0 {
		m.setQuorum(c.history[len(c.history)-1])
	}
	c.advanceLocked()
	return m
}

// Sever cuts member id off as a process death does before anyone notices:
// what it reports from now on is lost, but it stays a member until it is
// removed (Remove).
func (c *Coordinator) Sever(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m, ok := c.members[id]; ok {
		m.severed.Store(true)
	}
}

// Remove takes member id out as the coordinator would after its death,
// for the given cause (quorum.PortClosed for a killed process; the next
// quorum's reason names it); its Done channel closes.
func (c *Coordinator) Remove(id string, cause quorum.Cause) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m, ok := c.members[id]; ok {
		c.m.Remove(time.Now(), id, m.inc, quorum.Removal{Cause: cause})
		delete(c.members, id)
		m.endLocked()
	}
	c.advanceLocked()
}

// Update changes member id's record as a report of its own would (health,
// step…), and lets the machine decide.
func (c *Coordinator) Update(id string, f func(*membership.MemberRecord)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	rec, ok := c.m.Member(id)
	if !ok {
		return
	}
	f(&rec)
	c.m.Upsert(time.Now(), rec)
	c.advanceLocked()
}

// Record returns member id's record, if it is a member.
func (c *Coordinator) Record(id string) (membership.MemberRecord, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m.Member(id)
}

// Latest returns the newest published quorum.
func (c *Coordinator) Latest() (membership.Quorum, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.history) == 0 {
		return membership.Quorum{}, false
	}
	return c.history[len(c.history)-1], true
}

// Store is the job's rendezvous store, shared by its members.
func (c *Coordinator) Store() comm.Store { return c.store }

// Close stops the coordinator's timer; members stay as they are.
func (c *Coordinator) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.wake != nil {
		c.wake.Stop()
	}
}

// advanceLocked lets the machine decide and tells every member.
func (c *Coordinator) advanceLocked() {
	now := time.Now()
	d := c.m.Advance(now)
	if d.Revocation != nil {
		c.m.Revoke(now, *d.Revocation)
		for _, m := range c.members {
			m.setRevocation(*d.Revocation)
		}
	}
	if d.Quorum != nil {
		c.m.Published(*d.Quorum)
		c.history = append(c.history, *d.Quorum)
		for _, m := range c.members {
			m.setQuorum(*d.Quorum)
		}
	}
	if !d.WakeAt.IsZero() && !c.closed {
		if c.wake != nil {
			c.wake.Stop()
		}
		c.wake = time.AfterFunc(d.WakeAt.Sub(now), func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if !c.closed {
				c.advanceLocked()
			}
		})
	}
}

// report applies one of m's reports to its record, unless m is severed or
// no longer the registered incarnation.
func (m *Member) report(f func(*membership.MemberRecord)) error {
	if m.severed.Load() {
		return ErrSevered
	}
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	rec, ok := c.m.Member(m.id)
	if !ok || rec.Incarnation != m.inc {
		return nil
	}
	f(&rec)
	c.m.Upsert(time.Now(), rec)
	c.advanceLocked()
	return nil
}

// ID is the member's id.
func (m *Member) ID() string { return m.id }

// Incarnation is this registration's number (a new one at every Join).
func (m *Member) Incarnation() int64 { return m.inc }

// Store is the job's rendezvous store.
func (m *Member) Store() comm.Store { return m.c.store }

// Done is closed when the registration ends (it left or was removed).
func (m *Member) Done() <-chan struct{} { return m.done }

// Err says why the registration ended.
func (m *Member) Err() error { return errors.New("memcoord: the member left or was removed") }

// Severed reports whether Sever cut this member off.
func (m *Member) Severed() bool { return m.severed.Load() }

// Quorum is the latest quorum this member has seen.
func (m *Member) Quorum() (membership.Quorum, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.quorum == nil {
		return membership.Quorum{}, false
	}
	return *m.quorum, true
}

// Revocation returns epoch's revocation record, if any.
func (m *Member) Revocation(epoch uint64) (membership.Revocation, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.revs[epoch]
	return r, ok
}

// Changed is closed at the next quorum or revocation.
func (m *Member) Changed() <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.changed
}

func (m *Member) setQuorum(q membership.Quorum) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.quorum = &q
	close(m.changed)
	m.changed = make(chan struct{})
}

func (m *Member) setRevocation(r membership.Revocation) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.revs[r.Epoch] = r
	close(m.changed)
	m.changed = make(chan struct{})
}

// SetStep records the committed step (the next heartbeat would carry it).
func (m *Member) SetStep(step int64) {
	m.mu.Lock()
	m.step = step
	m.mu.Unlock()
}

// SetStepTime reports the member's own compute time of a step at once,
// as a heartbeat would carry it: the straggler policy's input
// (membership.StragglerPolicy, quorum.Config.Stragglers). Without a policy
// it does nothing (it would cost every step a decision).
func (m *Member) SetStepTime(d time.Duration) {
	if !m.c.timed {
		return
	}
	_ = m.report(func(r *membership.MemberRecord) { r.StepTime = d })
}

// Step is the step last given to SetStep.
func (m *Member) Step() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.step
}

// Revoke records a revocation of epoch. The blamed are recorded, not
// checked: they stay until removed.
func (m *Member) Revoke(ctx context.Context, epoch uint64, reason string, failed ...string) error {
	if m.severed.Load() {
		return ErrSevered
	}
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	c.m.Revoke(now, membership.Revocation{Epoch: epoch, Reason: reason, Failed: failed, By: m.id, At: now})
	c.advanceLocked()
	return nil
}

// SetHealth reports the member's health; Critical takes it out of the next
// quorum.
func (m *Member) SetHealth(ctx context.Context, h membership.Health, reason string) error {
	return m.report(func(r *membership.MemberRecord) { r.Health, r.HealthReason = h, reason })
}

// ReportCommitFailure reports that epoch failed here, blaming members.
func (m *Member) ReportCommitFailure(ctx context.Context, epoch uint64, blamed ...string) error {
	return m.report(func(r *membership.MemberRecord) { r.CommitFailed, r.Blamed = epoch, blamed })
}

// ReportFormed reports that the member holds what epoch asked of it.
func (m *Member) ReportFormed(ctx context.Context, epoch uint64) error {
	return m.report(func(r *membership.MemberRecord) { r.Formed = epoch })
}

// Finish records that the member ended the run at step.
func (m *Member) Finish(ctx context.Context, step int64) error {
	return m.report(func(r *membership.MemberRecord) { r.Step, r.Finished, r.WantQuorum = step, true, false })
}

// RecordCommit records that epoch committed step, unless another epoch did
// first (as etcd's transaction does for DurableCommit).
func (m *Member) RecordCommit(ctx context.Context, step int64, epoch uint64) (membership.CommitRecord, bool, error) {
	if m.severed.Load() {
		return membership.CommitRecord{}, false, ErrSevered
	}
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	rec, ok := c.commits[step]
	if !ok {
		rec = membership.CommitRecord{Step: step, Epoch: epoch, By: m.id, At: time.Now()}
		c.commits[step] = rec
	}
	return rec, rec.Epoch == epoch, nil
}

// LastCommit returns the newest commit record.
func (m *Member) LastCommit(ctx context.Context) (membership.CommitRecord, bool, error) {
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	var last membership.CommitRecord
	for s, r := range c.commits {
		if s > last.Step {
			last = r
		}
	}
	return last, last.Step > 0, nil
}

// Leave deregisters the member (as Close).
func (m *Member) Leave(ctx context.Context) error { return m.Close() }

// Close deregisters the member if it is still the registered incarnation.
// Safe to call twice.
func (m *Member) Close() error {
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if cur, ok := c.members[m.id]; ok && cur == m {
		c.m.Remove(time.Now(), m.id, m.inc, quorum.Removal{Cause: quorum.Left})
		delete(c.members, m.id)
		c.advanceLocked()
	}
	m.endLocked()
	return nil
}

func (m *Member) endLocked() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.closed {
		m.closed = true
		close(m.done)
	}
}
