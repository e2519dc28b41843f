package quorum

import (
	"fmt"

	"github.com/ftcomm/ftcomm/membership"
)

// The stall rule: a live participant whose training loop stopped stepping
// (a hung data loader, a paused loop) while its peers wait for it in the
// step's collectives. Both sides say so themselves (MemberRecord.Stall),
// each once its own bound has passed, a bound derived from the job's own
// step times (ft: Config.Stall): the peers that wait, and the participant
// that does not step. Only the two together leave it out: a replica that
// is merely slow is in its step, not idle, and its peers wait less than a
// few of their own steps; a loop that pauses for everyone at once (an
// evaluation between steps) has no one waiting in a collective.

// stallMark is why a member was left out for its stall, and in which
// epoch: it stays out until it shows life after that epoch (it formed, or
// sat out, a later one: its loop called Step again).
type stallMark struct {
	epoch uint64
	why   string
}

// stalls adds to out the candidates that do not step at a step a peer
// waits in, and keeps out those left out before until they show life.
// Only members with a stall report, or left out for one, can be: those
// are walked.
func (m *Machine) stalls(candidate func(string) bool, out map[string]string) {
	if m.prev == nil {
		return
	}
	e := m.prev.Epoch
	waiter := map[int64]string{} // step → the first survivor that waits in it
	for id := range m.agg.stalling {
		// While a prepared grow forms, its survivors step on in its Base.
		if s := m.members[id].Stall; s.Waiting && (s.Epoch == e || m.prev.Prepared && s.Epoch == m.prev.Base) && m.survives(id) {
			if w, ok := waiter[s.Step]; !ok || id < w {
				waiter[s.Step] = id
			}
		}
	}
	check := func(id string) {
		if !candidate(id) {
			return
		}
		if mark, ok := m.stalled[id]; ok {
			out[id] = mark.why
			return
		}
		r := m.members[id]
		s := r.Stall
		// A report of this epoch, or of an older one while the member
		// has not moved on since (it formed no later epoch).
		if s == nil || s.Waiting || s.Epoch > e || s.Epoch < e && r.Formed >= e || !m.inPrev(id, r.Incarnation) {
			return
		}
		w, ok := waiter[s.Step]
		if !ok {
			return
		}
		why := fmt.Sprintf("stalled (its loop %s; %s %s)", s.String(), w, m.members[w].Stall.String())
		m.stalled[id] = stallMark{epoch: e, why: why}
		out[id] = why
	}
	for id := range m.stalled {
		check(id)
	}
	for id := range m.agg.stalling {
		check(id)
	}
}

// stallEnded forgets a stall once the member shows life after it.
func (m *Machine) stallEnded(r *membership.MemberRecord) {
	if mark, ok := m.stalled[r.ID]; ok && r.Formed > mark.epoch {
		delete(m.stalled, r.ID)
	}
}
