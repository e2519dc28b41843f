package ft

import (
	"fmt"
	"slices"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// Stalls, as the step machine sees them. A step that does not move is
// either waiting for peers (a collective of the step, or the epoch's
// formation, has waited long) or not being taken (the training loop is
// idle since its last Commit, or computes without having started the
// step's collectives). Past the stall bound — Config.StallFactor times the
// slowest recent step, at least Config.StallMin — the rank says which to
// the coordinator (membership.StepStall), once per step; a participant
// that does not step while a peer waits in that step is left out at once
// (coordinator/quorum, the stall rule). A rank that waits and hears
// nothing from some peers at all (comm.SilenceReporter: a cut link)
// blames them instead, as a failed op would: the coordinator's cut rule
// then keeps one side. The bound follows the job's own pace: a replica
// twice as slow as its peers makes every step of the job twice as long,
// and its peers wait about one of their own steps for it, well within the
// bound.

// stallWindow is how many recent steps the bound looks at; stallMinSteps
// how many it needs before it is known (the first steps of a Comm warm
// up).
const (
	stallWindow   = 64
	stallMinSteps = 3
)

// stallLookEvery bounds how often a rank that waits looks again for
// silent peers.
const stallLookEvery = 250 * time.Millisecond

// stallBound returns the stall bound, or 0 when it is off or not known
// yet.
func (m *machine) stallBound() time.Duration {
	slowest := m.slowestStep()
	if m.cfg.stallFactor <= 0 || slowest == 0 {
		return 0
	}
	return max(m.cfg.stallMin, time.Duration(m.cfg.stallFactor*float64(slowest)))
}

// noteStart records that a step started (Step returned): the time since
// the previous start is one step of the loop, compute, collectives,
// commit and the loop's own time between steps, unless a
// reconfiguration came between them.
func (m *machine) noteStart(now time.Time) {
	if !m.lastStart.IsZero() && !m.reconfSince {
		m.cycles[m.cycleN%stallWindow] = now.Sub(m.lastStart)
		m.cycleN++
	}
	m.lastStart, m.reconfSince = now, false
	m.lookAt(now)
}

// lookAt schedules the first look at a state that began now (a step
// started, the loop went idle, a formation began).
func (m *machine) lookAt(now time.Time) {
	m.stallLook = time.Time{}
	if b := m.stallBound(); b > 0 {
		m.stallLook = now.Add(b)
	}
}

// formingAt: a task that waits for every peer of the epoch (forming
// comms, the step agreement) began.
func formingStage(s stage) bool {
	return s == stageFormFT || s == stageFormGroup || s == stageSwitch || s == stageGather || s == stageAgree
}

// onTick looks at the step: whether it stalled, and (after Finish, in
// Close) whether the lingering ended.
func (m *machine) onTick(now time.Time, in tick) {
	if !m.stallLook.IsZero() && !now.Before(m.stallLook) {
		m.stallLook = time.Time{}
		m.lookAtStall(now, in)
	}
}

// lookAtStall decides what a stall look found.
func (m *machine) lookAtStall(now time.Time, in tick) {
	b := m.stallBound()
	if b == 0 || m.life != running {
		return
	}
	rep := membership.StepStall{Epoch: m.epoch, Step: m.step + 1, Bound: b}
	switch {
	case m.phase == phaseInStep && !in.pending.IsZero():
		rep.Waiting, rep.For = true, now.Sub(in.pending)
		if rep.For < b {
			m.stallLook = in.pending.Add(b)
			return
		}
		m.stallLook = now.Add(max(b/2, stallLookEvery)) // silence may come later
		if ids := m.blameSilent(in.silent); len(ids) > 0 {
			m.do(revokeEpoch{epoch: m.epoch, blamed: ids,
				reason: fmt.Sprintf("waited %v in step %d; nothing heard from %v (a cut link?)", rep.For.Round(time.Millisecond), rep.Step, ids)})
			return
		}
	case m.phase == phaseInStep:
		rep.For = now.Sub(m.stepAt) // computing, no collective started
		m.stallLook = now.Add(max(b/2, stallLookEvery))
	case m.phase == phaseIdle:
		rep.For = now.Sub(m.idleSince)
	case m.phase == phaseStepping && m.task != 0 && formingStage(m.stage):
		rep.Waiting, rep.For = true, now.Sub(m.taskAt)
		if rep.For < b {
			m.stallLook = m.taskAt.Add(b)
			return
		}
	default:
		return
	}
	if r := m.stallSent; r.Epoch == rep.Epoch && r.Step == rep.Step && r.Waiting == rep.Waiting {
		return
	}
	m.stallSent = rep
	m.logf(true, "step %d of epoch %d: %s", rep.Step, rep.Epoch, rep)
	m.do(reportStall{rep})
}

// blameSilent maps the FT ranks a backend found silent to member ids this
// rank has not blamed in the epoch yet, and blames them.
func (m *machine) blameSilent(ranks []int) []string {
	var ids []string
	for _, r := range ranks {
		if r < 0 || r >= len(m.view.ft) {
			continue
		}
		id := m.view.ft[r].ID
		if id == "" || id == m.cfg.id || slices.Contains(m.blamed, id) {
			continue
		}
		m.blamed = append(m.blamed, id)
		ids = append(ids, id)
	}
	return ids
}

// wakeAt is when the machine wants a tick: the next stall look, or the
// end of the lingering after Finish.
func (m *machine) wakeAt() time.Time {
	t := m.stallLook
	if !m.lingerUntil.IsZero() && m.life == closing && (t.IsZero() || m.lingerUntil.Before(t)) {
		t = m.lingerUntil
	}
	return t
}
