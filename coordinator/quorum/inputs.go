package quorum

import (
	"maps"
	"slices"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// The machine's inputs: what its owner reports (records, removals,
// suspicions, revocations) and what it stored (Published).

// Upsert records a member's registration or any change of its record: a
// join, a heartbeat (step, health, step time), a quorum request
// (WantQuorum, ShrinkOnly), a commit failure (CommitFailed, Blamed), a
// formed epoch or the end of its run (Finished). A record with a new
// incarnation replaces the old one, which thereby has died. It reports
// whether the change may alter Advance's decision (a heartbeat that only
// moves the step usually cannot).
func (m *Machine) Upsert(now time.Time, rec membership.MemberRecord) bool {
	old, had := m.members[rec.ID]
	if had && old.Incarnation > rec.Incarnation {
		return false // a stale record of an older incarnation
	}
	r := rec
	m.members[rec.ID] = &r
	m.track(r.ID, old, &r) // old: nil when it had no record
	if !had && r.Stragglers != nil || had && !samePolicy(old.Stragglers, r.Stragglers) {
		m.pol = nil // the job's straggler policy may change (policy)
	}
	if s, ok := m.suspects[rec.ID]; ok && s.inc != rec.Incarnation {
		delete(m.suspects, rec.ID)
	}
	if r.Finished {
		if r.Run != "" && r.Run != m.finalRun {
			m.final, m.finalRun = r.Step, r.Run
		} else {
			m.final = max(m.final, r.Step)
		}
	}
	if !had || old.Incarnation != r.Incarnation {
		m.forget(r.ID) // a new incarnation starts afresh
		delete(m.promoted, r.ID)
		m.observe(now, nil, &r)
		if !m.waitingSpare(&r) { // a spare's arrival batches nothing
			m.lastArrival = now
		}
		return true
	}
	if r.WantQuorum && !old.WantQuorum && !m.waitingSpare(&r) {
		m.lastArrival = now
	}
	wasSilent := m.silent[r.ID] > 0
	_, wasStalled := m.stalled[r.ID]
	m.observe(now, old, &r)
	switch {
	case old.Health != r.Health, old.WantQuorum != r.WantQuorum, old.ShrinkOnly != r.ShrinkOnly,
		old.CommitFailed != r.CommitFailed, !slices.Equal(old.Blamed, r.Blamed), old.MinReplicas != r.MinReplicas,
		old.Finished != r.Finished, !samePolicy(old.Stragglers, r.Stragglers), !sameStall(old.Stall, r.Stall),
		!maps.Equal(old.Reached, r.Reached):
		return true
	case old.Formed != r.Formed && (len(m.blame) > 0 || wasSilent || wasStalled || len(m.agg.ready) > 0):
		// It may clear a blame, be a silent or stalled member's sign of
		// life, or the last survivor holding the epoch a spare waits for
		// (promote); otherwise it only sets the next quorum's Base.
		return true
	case old.Step != r.Step && (m.waited || wasSilent):
		// The step matters to a quorum waiting for the job's step, and
		// as a sign of life from a member left out for its silence.
		return true
	case old.StepTime != r.StepTime && policyOn(m.policy()):
		return true
	}
	return false
}

// observe learns from a member's new record (old is nil for a new
// incarnation): whether it holds the job's step, signs of life, blame,
// and epochs formed together.
func (m *Machine) observe(now time.Time, old, r *membership.MemberRecord) {
	var epoch uint64
	inPrev := false
	if m.prev != nil {
		epoch = m.prev.Epoch
		inPrev = m.inPrev(r.ID, r.Incarnation)
	}
	if inPrev && r.Step >= m.prev.MaxStep {
		m.caughtUp[r.ID] = r.Incarnation
	}
	if old == nil {
		return
	}
	if r.Formed != old.Formed || r.CommitFailed != old.CommitFailed || r.Step > old.Step {
		m.active[r.ID] = max(m.active[r.ID], epoch)
		delete(m.silent, r.ID)
	}
	if s := r.Stall; s != nil && s.Waiting && !sameStall(old.Stall, s) {
		// A member waiting in its step's collectives is in the step: a
		// sign of life, whoever it waits for.
		m.active[r.ID] = max(m.active[r.ID], s.Epoch)
		delete(m.silent, r.ID)
	}
	m.stallEnded(r)
	if r.CommitFailed != 0 && len(r.Blamed) > 0 && (r.CommitFailed != old.CommitFailed || !slices.Equal(r.Blamed, old.Blamed)) {
		m.addBlame(now, r.CommitFailed, r.ID, r.Blamed)
	}
	for id, e := range r.Reached {
		if old.Reached[id] != e {
			m.reached(now, r.ID, id, e)
		}
	}
	if inPrev && r.Formed == epoch && old.Formed != epoch {
		m.formedTogether(r.ID)
	}
}

// forget drops what the machine learnt about an incarnation of id.
func (m *Machine) forget(id string) {
	delete(m.caughtUp, id)
	delete(m.active, id)
	delete(m.silent, id)
	delete(m.blamedIn, id)
	delete(m.slow, id)
	delete(m.stalled, id)
	m.forgetBlame(id)
}

func sameStall(a, b *membership.StepStall) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}

// Remove records the end of incarnation inc of member id (0 matches any;
// an older incarnation's end is ignored) and why: the rules follow its
// cause (see Cause), and the next quorum's Reason names it.
func (m *Machine) Remove(now time.Time, id string, inc int64, r Removal) {
	m.remove(now, id, inc, departure{why: r.String(), lapsed: r.Cause.Lapsed(), left: r.Cause.Orderly()})
}

// remove ends a member's registration; a participant of the previous
// quorum is recorded as departed (d, with its time and last step).
func (m *Machine) remove(now time.Time, id string, incarnation int64, d departure) {
	old, ok := m.members[id]
	if !ok || incarnation != 0 && old.Incarnation != incarnation {
		return
	}
	delete(m.members, id)
	if old.Stragglers != nil {
		m.pol = nil
	}
	delete(m.suspects, id)
	m.forget(id)
	if _, inPrev := m.agg.prevPos[id]; inPrev {
		if _, seen := m.removed[id]; !seen {
			d.at, d.step, d.host = now, old.Step, old.Host
			m.removed[id] = d
		}
	}
	m.track(id, old, nil)
	delete(m.promoted, id)
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
// forces the next one (like a commit failure); older epochs are over. A
// member's revocation is also a sign of its life and carries its blame.
func (m *Machine) Revoke(now time.Time, r membership.Revocation) {
	if m.prev != nil && r.Epoch == m.prev.Epoch && m.revokedBy == nil {
		rr := r
		m.revokedBy = &rr
	}
	if _, member := m.members[r.By]; member && m.prev != nil && r.Epoch == m.prev.Epoch {
		m.active[r.By] = max(m.active[r.By], r.Epoch)
		delete(m.silent, r.By)
		m.addBlame(now, r.Epoch, r.By, r.Failed)
	}
}

// Published tells the machine that q was stored: it becomes the previous
// quorum of the next decision.
func (m *Machine) Published(q membership.Quorum) {
	if old := m.prev; old != nil {
		// Silence is counted per epoch that ended. The blame that named a
		// silent member said it was silent, not that a link failed: it
		// must not keep the member out once it shows life. (Only members
		// blamed or silent can count: those are walked, not every
		// participant.)
		e := old.Epoch
		silentNow := func(id string) bool { return m.blamedIn[id] == e && m.active[id] < e }
		for id := range m.silent {
			if _, in := m.agg.prevPos[id]; in && !silentNow(id) {
				delete(m.silent, id)
			}
		}
		for id := range m.blamedIn {
			if i, in := m.agg.prevPos[id]; in && silentNow(id) {
				if r, ok := m.members[id]; ok && r.Incarnation == old.Participants[i].Incarnation {
					m.silent[id]++
					m.forgetBlame(id)
				}
			}
		}
		m.stragglersPublished(*old, q)
	}
	if m.formBound {
		m.formStreak++
	} else {
		m.formStreak = 0
	}
	m.formBound = false
	m.vacant, _ = m.sparesNext(m.prev, &q)
	m.replaced = nil
	if len(q.Replaced) > 0 {
		m.replaced = map[string]struct{}{}
		for _, g := range q.Replaced {
			m.replaced[g] = struct{}{}
		}
	}
	if m.prev != nil && q.Run != "" && m.prev.Run != "" && q.Run != m.prev.Run {
		m.natural = 0 // a new run: its own size
	}
	m.natural = max(m.natural, q.Target, replicasOf(q.Participants))
	qq := q
	m.setPrev(&qq)
	for id, inc := range m.promoted {
		if m.inPrev(id, inc) {
			delete(m.promoted, id)
		}
	}
	// When the newest loss this quorum drops happened, and when each did
	// (lossWait): the departures recorded are the old quorum's
	// participants'.
	var newest time.Time
	dropped := 0
	for id, d := range m.removed {
		if _, kept := m.agg.prevPos[id]; !kept && !d.at.IsZero() {
			dropped++
			newest = maxTime(newest, d.at)
		}
	}
	if dropped > 0 {
		for id, d := range m.removed {
			if _, kept := m.agg.prevPos[id]; !kept && !d.at.IsZero() {
				m.lossTimes = append(m.lossTimes, d.at)
			}
		}
		m.lossEpochAt = maxTime(m.lossEpochAt, newest)
		// Only the last MassLossMaxWait of them can make a mass failure.
		horizon := m.lossEpochAt.Add(-m.cfg.massLossMaxWait())
		m.lossTimes = slices.DeleteFunc(m.lossTimes, func(t time.Time) bool { return t.Before(horizon) })
	}
	if q.Run != "" && q.Run != m.finalRun {
		m.final, m.finalRun = q.Final, q.Run // a new run
	} else {
		m.final = max(m.final, q.Final)
	}
	for _, p := range q.Participants {
		if r, ok := m.members[p.ID]; ok && r.Incarnation == p.Incarnation && r.Step >= q.MaxStep && m.caughtUp[p.ID] != p.Incarnation {
			m.caughtUp[p.ID] = p.Incarnation
		}
	}
	m.pendingSince, m.failedSince = time.Time{}, time.Time{}
	clear(m.removed)
	m.revokedBy = nil
}
