package ft

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
	"github.com/ftcomm/ftcomm/membership"
)

// fakeCoord runs membership's real quorum machine in process, without etcd
// or gossip: members join, report and leave through method calls, and every
// decision is pushed to every member's channels. Tests use it to exercise
// ft's step protocol quickly and deterministically; the etcd-backed path is
// tested separately.
type fakeCoord struct {
	mu      sync.Mutex
	commits map[int64]membership.CommitRecord // durable commit records
	m       *membership.Machine
	members map[string]*fakeMember
	inc     int64
	store   *memstore.Store
	wake    *time.Timer
	history []membership.Quorum
}

func newFakeCoord(job string, cfg membership.QuorumConfig) *fakeCoord {
	return &fakeCoord{m: membership.NewMachine(job, cfg, nil), members: map[string]*fakeMember{}, store: memstore.New(),
		commits: map[int64]membership.CommitRecord{}}
}

type fakeMember struct {
	c       *fakeCoord
	id      string
	inc     int64
	mu      sync.Mutex
	quorum  *membership.Quorum
	revs    map[uint64]membership.Revocation
	changed chan struct{}
	done    chan struct{}
	step    int64
	closed  bool
	severed atomic.Bool // the process died: what it sends is lost (see sever)
}

// join registers id as a new incarnation asking for a quorum, with the
// fewest participants its job needs (minReplicas, as ft's register passes
// MinReplicas × GroupSize to the real coordinator; 0: the coordinator's
// default).
func (c *fakeCoord) join(id string, minReplicas int) *fakeMember {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.inc++
	m := &fakeMember{c: c, id: id, inc: c.inc, revs: map[uint64]membership.Revocation{}, changed: make(chan struct{}), done: make(chan struct{})}
	c.members[id] = m
	g, _, _ := parseMemberID(id)
	c.m.Upsert(time.Now(), membership.MemberRecord{ID: id, Group: g, Incarnation: m.inc, WantQuorum: true, MinReplicas: minReplicas, Joined: time.Now()})
	if len(c.history) > 0 { // a late joiner learns the current quorum, as from etcd
		m.setQuorum(c.history[len(c.history)-1])
	}
	c.advanceLocked()
	return m
}

// kill removes id as gossip would after a death.
// sever cuts member id off as a process death does, before the
// coordinator notices it (kill): the dead process's reports never arrive,
// but it stays a member until its session ends.
func (c *fakeCoord) sever(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m, ok := c.members[id]; ok {
		m.severed.Store(true)
	}
}

var errSevered = errors.New("fake member: the process is dead")

func (c *fakeCoord) kill(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m, ok := c.members[id]; ok {
		c.m.Remove(time.Now(), id, m.inc, "killed")
		delete(c.members, id)
		m.closeLocked()
	}
	c.advanceLocked()
}

func (c *fakeCoord) advanceLocked() {
	now := time.Now()
	d := c.m.Advance(now)
	if d.Revocation != nil {
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
	if !d.WakeAt.IsZero() {
		if c.wake != nil {
			c.wake.Stop()
		}
		c.wake = time.AfterFunc(d.WakeAt.Sub(now), func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			c.advanceLocked()
		})
	}
}

func (c *fakeCoord) latest() membership.Quorum {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.history) == 0 {
		return membership.Quorum{}
	}
	return c.history[len(c.history)-1]
}

func (c *fakeCoord) close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.wake != nil {
		c.wake.Stop()
	}
}

func (m *fakeMember) ID() string            { return m.id }
func (m *fakeMember) Incarnation() int64    { return m.inc }
func (m *fakeMember) Store() comm.Store     { return m.c.store }
func (m *fakeMember) Done() <-chan struct{} { return m.done }
func (m *fakeMember) Err() error            { return errors.New("fake member gone") }

func (m *fakeMember) Quorum() (membership.Quorum, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.quorum == nil {
		return membership.Quorum{}, false
	}
	return *m.quorum, true
}

func (m *fakeMember) Revocation(epoch uint64) (membership.Revocation, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.revs[epoch]
	return r, ok
}

func (m *fakeMember) Changed() <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.changed
}

func (m *fakeMember) setQuorum(q membership.Quorum) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.quorum = &q
	close(m.changed)
	m.changed = make(chan struct{})
}

func (m *fakeMember) setRevocation(r membership.Revocation) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.revs[r.Epoch] = r
	close(m.changed)
	m.changed = make(chan struct{})
}

func (m *fakeMember) Leave(ctx context.Context) error { return m.Close() }

// Revoke records a revocation of epoch; the fake trusts no blame (it has no
// addresses to check), so the blamed stay until killed.
func (m *fakeMember) Revoke(ctx context.Context, epoch uint64, reason string, failed ...string) error {
	if m.severed.Load() {
		return errSevered
	}
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	c.m.Revoke(time.Now(), membership.Revocation{Epoch: epoch, Reason: reason, Failed: failed, By: m.id, At: time.Now()})
	c.advanceLocked()
	return nil
}

func (m *fakeMember) SetHealth(ctx context.Context, h membership.Health, reason string) error {
	if m.severed.Load() {
		return errSevered
	}
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	rec, ok := c.m.Member(m.id)
	if !ok || rec.Incarnation != m.inc {
		return nil
	}
	rec.Health, rec.HealthReason = h, reason
	c.m.Upsert(time.Now(), rec)
	c.advanceLocked()
	return nil
}

func (m *fakeMember) SetStep(step int64) {
	m.mu.Lock()
	m.step = step
	m.mu.Unlock()
}

func (m *fakeMember) ReportCommitFailure(ctx context.Context, epoch uint64, blamed ...string) error {
	if m.severed.Load() {
		return errSevered
	}
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	rec, ok := c.m.Member(m.id)
	if !ok || rec.Incarnation != m.inc {
		return nil
	}
	rec.CommitFailed = epoch
	c.m.Upsert(time.Now(), rec)
	c.advanceLocked()
	return nil
}

func (m *fakeMember) ReportFormed(ctx context.Context, epoch uint64) error {
	if m.severed.Load() {
		return errSevered
	}
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	rec, ok := c.m.Member(m.id)
	if !ok || rec.Incarnation != m.inc {
		return nil
	}
	rec.Formed = epoch
	c.m.Upsert(time.Now(), rec)
	c.advanceLocked()
	return nil
}

// RecordCommit and LastCommit keep durable commit records as etcd would:
// the first epoch to record a step owns it.
func (m *fakeMember) RecordCommit(ctx context.Context, step int64, epoch uint64) (membership.CommitRecord, bool, error) {
	if m.severed.Load() {
		return membership.CommitRecord{}, false, errSevered
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

func (m *fakeMember) LastCommit(ctx context.Context) (membership.CommitRecord, bool, error) {
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

func (m *fakeMember) Close() error {
	c := m.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if cur, ok := c.members[m.id]; ok && cur == m {
		c.m.Remove(time.Now(), m.id, m.inc, "left")
		delete(c.members, m.id)
		c.advanceLocked()
	}
	m.closeLocked()
	return nil
}

func (m *fakeMember) closeLocked() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.closed {
		m.closed = true
		close(m.done)
	}
}
