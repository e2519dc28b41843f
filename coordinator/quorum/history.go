package quorum

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// The history rule: a quorum never restarts the job behind its back.

// lastStep is the job's last known step: the previous quorum's MaxStep, or
// a higher step one of its participants reported since. unknown: some
// participant went while no coordinator watched, so the job may be
// further.
func (m *Machine) lastStep() (step int64, unknown bool) {
	if m.prev == nil {
		return 0, false
	}
	if m.agg.stepStale {
		m.agg.stepSeen, m.agg.stepStale = m.prev.MaxStep, false
		for _, p := range m.prev.Participants {
			if r, ok := m.members[p.ID]; ok && r.Incarnation == p.Incarnation {
				m.agg.stepSeen = max(m.agg.stepSeen, r.Step)
			}
		}
	}
	step = m.agg.stepSeen
	for _, d := range m.removed {
		step, unknown = max(step, d.step), unknown || d.unknown
	}
	return step, unknown
}

// jobStep is what the rules know of the job's step.
type jobStep struct {
	step    int64
	unknown bool
}

// holds reports whether candidate p holds the job's step: a caught-up
// survivor, or any candidate that reported it.
func (m *Machine) holds(p membership.Participant, js jobStep) bool {
	return m.caughtUp[p.ID] == p.Incarnation && m.survives(p.ID) || !js.unknown && p.Step >= js.step
}

// awaitHolders applies the history rule: when no candidate holds the
// job's step, it says what the quorum waits for (and until when), or ""
// when it need not wait.
func (m *Machine) awaitHolders(now time.Time, candidates []membership.Participant, js jobStep) (string, time.Time) {
	grace := m.cfg.holderGrace()
	if grace <= 0 || m.prev == nil {
		return "", time.Time{}
	}
	var candMax int64 = -1
	for _, p := range candidates {
		if m.holds(p, js) {
			return "", time.Time{}
		}
		candMax = max(candMax, p.Step)
	}
	var awaited []string
	var until time.Time
	for id, d := range m.removed {
		if _, back := m.members[id]; back || !d.lapsed || d.step <= candMax && !d.unknown || !now.Before(d.at.Add(grace)) {
			continue
		}
		awaited = append(awaited, id)
		if end := d.at.Add(grace); until.IsZero() || end.Before(until) {
			until = end
		}
	}
	if len(awaited) == 0 {
		return "", time.Time{}
	}
	slices.Sort(awaited)
	have, at := "no candidate", fmt.Sprintf("step %d", js.step)
	if candMax >= 0 {
		have = fmt.Sprintf("the candidates hold step %d at most", candMax)
	}
	if js.unknown {
		at += " or beyond"
	}
	return fmt.Sprintf("%s, the job is at %s: waiting up to %v for %s to come back",
		have, at, until.Sub(now).Round(time.Millisecond), strings.Join(awaited, ",")), until
}
