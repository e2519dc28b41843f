package membership

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// QuorumConfig holds the rules of quorum formation for one job.
type QuorumConfig struct {
	// MinReplicas is the fewest participants a new (not fast) quorum may
	// have. Members may ask for more (MemberRecord.MinReplicas); the
	// largest wins. Default 1.
	MinReplicas int
	// JoinTimeout is how long a pending quorum waits for live members
	// that have not asked to take part yet (stragglers) before it forms
	// without them. Default 10 s.
	JoinTimeout time.Duration
	// FailureSettle is how long an epoch that failed with every
	// participant still alive (a commit failure, a revocation) waits for
	// more reports before the next one forms: when a replica dies, its
	// peers' failures arrive first and the blame naming it (checked by
	// the coordinator) a moment later, and waiting for it makes one death
	// cost one epoch, not two. Default 100 ms; 0: none.
	FailureSettle time.Duration
}

// DefaultQuorumConfig returns MinReplicas 1, JoinTimeout 10 s and
// FailureSettle 100 ms.
func DefaultQuorumConfig() QuorumConfig {
	return QuorumConfig{MinReplicas: 1, JoinTimeout: 10 * time.Second, FailureSettle: 100 * time.Millisecond}
}

// Validate says what is wrong with the configuration, if anything.
func (c QuorumConfig) Validate() error {
	if c.MinReplicas < 1 {
		return fmt.Errorf("%w: membership: MinReplicas %d must be at least 1", comm.ErrInvalidArgument, c.MinReplicas)
	}
	if c.FailureSettle < 0 {
		return fmt.Errorf("%w: membership: FailureSettle %v is negative", comm.ErrInvalidArgument, c.FailureSettle)
	}
	if c.JoinTimeout < 0 {
		return fmt.Errorf("%w: membership: JoinTimeout %v is negative", comm.ErrInvalidArgument, c.JoinTimeout)
	}
	return nil
}

// Machine is the quorum state machine of one job. It does no I/O and reads
// no clock: the caller feeds it inputs and the time, calls Advance, stores
// what Advance decided, and then calls Published. It is not safe for
// concurrent use.
//
// Rules (after torchft's lighthouse):
//   - A quorum is needed when there is none yet and someone asks to take
//     part, when the participants would change (a participant died, left,
//     was evicted or turned Critical; a joiner asks in), or when the
//     current epoch failed (a participant reported a commit failure or
//     revoked it).
//   - Fast quorum: when every participant of the previous quorum is still
//     live and fit, the next quorum forms at once.
//   - Otherwise it needs at least MinReplicas candidates and a strict
//     majority of live fit members among those taking part (no split
//     brain), and waits up to JoinTimeout for live members that have not
//     asked yet.
//   - While a participant holds ShrinkOnly, joiners are not admitted.
//   - Ranks: survivors keep their relative order, joiners follow sorted by
//     id. The epoch grows by one at every published quorum.
//   - Base: the previous epoch when every survivor reported holding its
//     communicators (MemberRecord.Formed), else 0 (see Quorum.Base).
type Machine struct {
	job     string
	cfg     QuorumConfig
	members map[string]*MemberRecord
	prev    *Quorum

	pendingSince time.Time
	failedSince  time.Time            // when the current epoch's failure was first seen
	removed      map[string]string    // id → why, since the last quorum
	suspects     map[string]suspicion // reported dead by a peer, being verified
	revokedBy    *Revocation          // a revocation of the current epoch
}

type suspicion struct {
	inc   int64
	until time.Time
}

// NewMachine returns the machine of a job whose last published quorum is
// prev (nil: none yet).
func NewMachine(job string, cfg QuorumConfig, prev *Quorum) *Machine {
	m := &Machine{job: job, cfg: cfg, members: map[string]*MemberRecord{}, removed: map[string]string{}, suspects: map[string]suspicion{}}
	if prev != nil {
		q := *prev
		m.prev = &q
	}
	return m
}

// Decision is what Advance decided.
type Decision struct {
	// Quorum to publish now; nil when none.
	Quorum *Quorum
	// Revocation of the current epoch to store (with Quorum when there is
	// one, else alone: the epoch is broken and its successor must wait).
	// Advance offers it again until Revoke or Published reports it
	// stored.
	Revocation *Revocation
	// Waiting says why a needed quorum has not formed ("" when none is
	// needed or one was decided).
	Waiting string
	// WakeAt is when Advance should run again even without new input
	// (zero: only on new input).
	WakeAt time.Time
}

// Upsert records a member's registration or any change of its record: a
// join, a heartbeat (step, health), a quorum request (WantQuorum,
// ShrinkOnly) or a commit failure (CommitFailed). A record with a new
// incarnation replaces the old one, which thereby has died.
func (m *Machine) Upsert(now time.Time, rec MemberRecord) {
	if old, ok := m.members[rec.ID]; ok && old.Incarnation > rec.Incarnation {
		return // a stale record of an older incarnation
	}
	r := rec
	m.members[rec.ID] = &r
	if s, ok := m.suspects[rec.ID]; ok && s.inc != rec.Incarnation {
		delete(m.suspects, rec.ID)
	}
}

// Remove records that a member is gone: it left, died (gossip, lease
// expiry) or was evicted. incarnation 0 matches any; a mismatch (an
// older incarnation) is ignored.
func (m *Machine) Remove(now time.Time, id string, incarnation int64, why string) {
	old, ok := m.members[id]
	if !ok || incarnation != 0 && old.Incarnation != incarnation {
		return
	}
	delete(m.members, id)
	delete(m.suspects, id)
	if m.prev != nil && m.prev.Rank(id) >= 0 {
		if _, seen := m.removed[id]; !seen {
			m.removed[id] = why
		}
	}
}

// Suspect records that a peer reported incarnation inc of member id dead
// and the coordinator is checking (until at the latest): a quorum that
// would keep it waits for the verdict rather than form an epoch that the
// verdict may end at once — one epoch per death instead of two.
func (m *Machine) Suspect(now time.Time, id string, inc int64, until time.Time) {
	if r, ok := m.members[id]; ok && r.Incarnation == inc {
		m.suspects[id] = suspicion{inc, until}
	}
}

// Unsuspect records that the check of id found it alive (or could not
// tell): quorums may keep it again.
func (m *Machine) Unsuspect(id string, inc int64) {
	if s, ok := m.suspects[id]; ok && s.inc == inc {
		delete(m.suspects, id)
	}
}

// Revoke records a stored revocation (a member's, or one Advance offered).
// A revoked epoch can never be used again, so revoking the current epoch
// forces the next one (like a commit failure); older epochs are over.
func (m *Machine) Revoke(now time.Time, r Revocation) {
	if m.prev != nil && r.Epoch == m.prev.Epoch && m.revokedBy == nil {
		rr := r
		m.revokedBy = &rr
	}
}

// Member returns the record of member id, if live.
func (m *Machine) Member(id string) (MemberRecord, bool) {
	r, ok := m.members[id]
	if !ok {
		return MemberRecord{}, false
	}
	return *r, true
}

// Len returns the number of live members.
func (m *Machine) Len() int { return len(m.members) }

// Current returns the last published quorum.
func (m *Machine) Current() (Quorum, bool) {
	if m.prev == nil {
		return Quorum{}, false
	}
	return *m.prev, true
}

// Published tells the machine that q was stored: it becomes the previous
// quorum of the next decision.
func (m *Machine) Published(q Quorum) {
	qq := q
	m.prev = &qq
	m.pendingSince, m.failedSince = time.Time{}, time.Time{}
	clear(m.removed)
	m.revokedBy = nil
}

func (m *Machine) minReplicas() int {
	n := max(m.cfg.MinReplicas, 1)
	for _, r := range m.members {
		n = max(n, r.MinReplicas)
	}
	return n
}

func fit(r *MemberRecord) bool { return r.Health != Critical }

// Advance decides whether a new quorum forms now.
func (m *Machine) Advance(now time.Time) Decision {
	var (
		survivors []Participant // previous participants still live and fit
		joiners   []Participant // live fit askers not in the previous quorum
		asking    int           // survivors + every fit asker
		fitLive   int
		shrink    bool
		inPrev    = map[string]bool{}
		lost      []string // previous participants not surviving
	)
	part := func(r *MemberRecord) Participant {
		return Participant{ID: r.ID, Addr: r.Addr, Group: r.Group, Step: r.Step, Incarnation: r.Incarnation}
	}
	if m.prev != nil {
		for _, p := range m.prev.Participants {
			r, ok := m.members[p.ID]
			if ok && r.Incarnation == p.Incarnation && fit(r) {
				inPrev[p.ID] = true
				survivors = append(survivors, part(r))
				shrink = shrink || r.ShrinkOnly
			} else {
				lost = append(lost, p.ID)
			}
		}
	}
	for _, r := range m.members {
		if !fit(r) {
			continue
		}
		fitLive++
		if inPrev[r.ID] {
			asking++
			continue
		}
		if r.WantQuorum {
			asking++
			joiners = append(joiners, part(r))
		}
	}
	sort.Slice(joiners, func(i, j int) bool { return joiners[i].ID < joiners[j].ID })
	admitted := joiners
	if shrink {
		admitted = nil
	}
	epochFailed := false
	var failedBy []string
	if m.prev != nil {
		for _, r := range m.members {
			if r.CommitFailed == m.prev.Epoch && inPrev[r.ID] {
				failedBy = append(failedBy, r.ID)
			}
		}
		slices.Sort(failedBy)
		epochFailed = len(failedBy) > 0 || m.revokedBy != nil
	}

	needed := false
	switch {
	case m.prev == nil:
		needed = len(joiners) > 0
	default:
		needed = len(lost) > 0 || len(admitted) > 0 || epochFailed
	}
	if !needed {
		m.pendingSince = time.Time{}
		return Decision{}
	}
	if m.pendingSince.IsZero() {
		m.pendingSince = now
	}
	candidates := append(survivors[:len(survivors):len(survivors)], admitted...)
	fast := m.prev != nil && len(lost) == 0

	// Why the current epoch ends, for people and for the revocation.
	var why []string
	if m.prev == nil {
		why = append(why, "initial quorum")
	} else {
		for _, id := range lost {
			reason, ok := m.removed[id]
			if !ok {
				r, live := m.members[id]
				switch {
				case live && !fit(r):
					reason = "critical"
					if r.HealthReason != "" {
						reason += ": " + r.HealthReason
					}
				case live:
					reason = "restarted"
				default:
					reason = "gone"
				}
			}
			why = append(why, fmt.Sprintf("%s %s", id, reason))
		}
		if len(failedBy) > 0 {
			why = append(why, fmt.Sprintf("commit failed in epoch %d (%s)", m.prev.Epoch, strings.Join(failedBy, ",")))
		}
		if m.revokedBy != nil && len(why) == 0 {
			why = append(why, fmt.Sprintf("epoch %d revoked by %s: %s", m.prev.Epoch, m.revokedBy.By, m.revokedBy.Reason))
		}
	}
	// Revoke a broken epoch at once, even when its successor must wait:
	// members stop their collectives instead of waiting out a timeout. An
	// epoch that only gains joiners is not broken: its step in flight may
	// finish, and members grow at their next step.
	var rev *Revocation
	if m.prev != nil && m.revokedBy == nil && len(lost)+len(failedBy) > 0 {
		rev = &Revocation{Epoch: m.prev.Epoch, Reason: strings.Join(why, "; "), Failed: lost, At: now}
	}
	wait := func(w string, wake time.Time) Decision {
		return Decision{Waiting: w, WakeAt: wake, Revocation: rev}
	}

	// A failure with everyone alive: more reports (a blame) may follow.
	if epochFailed && len(lost) == 0 && len(admitted) == 0 && m.cfg.FailureSettle > 0 {
		if m.failedSince.IsZero() {
			m.failedSince = now
		}
		if settled := m.failedSince.Add(m.cfg.FailureSettle); now.Before(settled) {
			return wait(fmt.Sprintf("epoch %d failed; waiting %v for more reports", m.prev.Epoch, settled.Sub(now).Round(time.Millisecond)), settled)
		}
	}
	// A survivor a peer reported dead is being checked: wait for the
	// verdict (bounded) instead of forming an epoch it may end at once.
	var wakeAt time.Time
	var checking []string
	for _, p := range survivors {
		if s, ok := m.suspects[p.ID]; ok && s.inc == p.Incarnation && now.Before(s.until) {
			checking = append(checking, p.ID)
			if wakeAt.IsZero() || s.until.Before(wakeAt) {
				wakeAt = s.until
			}
		}
	}
	if len(checking) > 0 {
		slices.Sort(checking)
		return wait("verifying the reported death of "+strings.Join(checking, ","), wakeAt)
	}

	if !fast {
		if minN := m.minReplicas(); len(candidates) < minN {
			return wait(fmt.Sprintf("%d of %d replicas needed (min_replicas)", len(candidates), minN), time.Time{})
		}
		if asking*2 <= fitLive {
			return wait(fmt.Sprintf("%d of %d live members take part: not a strict majority", asking, fitLive), time.Time{})
		}
		if asking < fitLive {
			if deadline := m.pendingSince.Add(m.cfg.JoinTimeout); now.Before(deadline) {
				return wait(fmt.Sprintf("waiting up to %v for %d straggler(s)", deadline.Sub(now).Round(time.Millisecond), fitLive-asking), deadline)
			}
		}
	}

	q := &Quorum{Job: m.job, Epoch: 1, Participants: candidates, Created: now, Removed: lost}
	if m.prev != nil {
		q.Epoch = m.prev.Epoch + 1
	}
	for _, p := range candidates {
		q.MaxStep = max(q.MaxStep, p.Step)
	}
	for _, p := range admitted {
		q.Added = append(q.Added, p.ID)
	}
	if m.prev != nil && len(survivors) > 0 && !slices.ContainsFunc(survivors, func(p Participant) bool {
		return m.members[p.ID].Formed != m.prev.Epoch
	}) {
		q.Base = m.prev.Epoch
	}
	if len(q.Added) > 0 && m.prev != nil {
		why = append(why, "joined "+strings.Join(q.Added, ","))
	}
	q.Reason = strings.Join(why, "; ")
	if rev != nil {
		rev.Reason = q.Reason
	}
	return Decision{Quorum: q, Revocation: rev}
}
