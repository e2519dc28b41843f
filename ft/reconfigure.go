package ft

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// The step machine's reconfiguration: sitting an epoch out, or moving to
// it by keeping or forming the group's comms, then the FT comms
// (shrunk, grown or made anew), and how a reconfiguration ends:
// reconfigured, or failReconfig. The step agreement and healing between
// the two are heal.go's.

// sitOut leaves the comms the others are leaving, and holds what epoch
// asks of this rank: nothing.
func (m *machine) sitOut(q membership.Quorum) {
	m.spare = m.cfg.spare || slices.Contains(q.Replaced, m.cfg.group)
	m.reconfSince = true
	m.closeHeld()
	m.enter(q.Epoch, view{epoch: q.Epoch, ftRank: -1})
	m.held = view{epoch: q.Epoch, ftRank: -1}
	m.do(reportFormed{epoch: q.Epoch})
	m.emit(Event{Kind: EventSatOut, Epoch: q.Epoch, Reason: q.Reason})
}

// stepTarget is the target size (membership.Quorum.Target) of the quorum
// whose epoch this rank takes part in, 0 when it sits out.
func (m *machine) stepTarget() int {
	if m.target.Epoch != m.epoch || m.view.ftRank < 0 {
		return 0
	}
	return m.target.Target
}

// enter makes epoch the current one, with nothing of it formed yet.
func (m *machine) enter(epoch uint64, v view) {
	m.epoch, m.view = epoch, v
	m.comms, m.blamed, m.revokedParts = unready, nil, [2]part{}
	m.gated = false
}

func (m *machine) closeHeld() {
	if m.held.epoch != 0 && m.held.ftRank >= 0 {
		m.do(closeComms{dim: dimFT, epoch: m.held.epoch})
	}
	m.held = view{ftRank: -1}
	m.closeGroup()
}

func (m *machine) closeGroup() {
	if m.group != 0 {
		m.do(closeComms{dim: dimGroup, epoch: m.group})
		m.group, m.groupFor, m.groupView = 0, 0, nil
	}
}

// reconfigure moves to quorum q, whose view v includes this rank: the
// group's comms (kept when the group's ranks are those they were formed
// among and every rank of the group agrees, else made anew), then the FT
// comms (shrunk, grown or made anew as planFor decides), then the step
// agreement and, if behind, healing.
func (m *machine) reconfigure(now time.Time, q membership.Quorum, v view) {
	if !m.failedAt.IsZero() {
		m.do(observe{what: metricDetect, value: now.Sub(m.failedAt).Seconds()})
	}
	// A rollback not yet returned stays: the heal that made it happened,
	// whatever became of its epoch, and the loop hears of it at its next
	// Step (noteRollback).
	m.target, m.tview, m.reconfAt = q, v, now
	m.reconfSince = true
	if promoted := slices.Contains(q.Promoted, m.cfg.id); promoted || m.spare {
		// Where it lands: its rank in the FT comm it is about to form. A
		// spare that takes part unnamed was promoted in an epoch it never
		// saw or never formed (cut off then).
		var why []string
		if !promoted {
			why = append(why, "promoted in an earlier epoch this spare did not take part in")
		}
		if q.Reason != "" {
			why = append(why, q.Reason)
		}
		where := fmt.Sprintf("rank %d of %d", v.ftRank, len(v.ft))
		if len(why) > 0 {
			where += " (" + strings.Join(why, "; ") + ")"
		}
		m.emit(Event{Kind: EventPromoted, Epoch: q.Epoch, Participants: v.groups, Reason: where})
	}
	m.spare, m.cfg.spare = false, false // a replica from now on
	m.prevGroup = m.group
	m.enter(q.Epoch, view{epoch: q.Epoch, ftRank: -1})
	if m.cfg.groupSize > 1 {
		// Another group's death or return leaves this group's ranks as
		// they were: their comms stay (a fresh group comm costs a
		// connection set-up, most of a shrink on GPUs). Whether each rank
		// still holds them healthy is local, so the ranks vote on it.
		if m.group != 0 && sameParticipants(m.groupView, v.group) {
			m.do(keepGroup{task: m.start(stageFormGroup), epoch: m.group, into: q.Epoch})
			return
		}
		m.formGroup()
		return
	}
	m.formFT()
}

// formGroup replaces the group comms this rank holds, if any, with new
// ones for the epoch it reconfigures to.
func (m *machine) formGroup() {
	m.closeGroup()
	m.do(formComms{task: m.start(stageFormGroup), dim: dimGroup, epoch: m.epoch, how: freshComm,
		rank: m.cfg.groupRank, size: m.cfg.groupSize})
}

// onGroupKept acts on the group's vote on keeping its comms: kept, they
// serve the new epoch, and the FT comms are formed next; otherwise new
// ones are formed first.
func (m *machine) onGroupKept(now time.Time, in groupKept) {
	if m.cancelled != nil {
		m.failReconfig(now, m.cancelled, nil)
		return
	}
	if in.err != nil || !in.ok {
		why := "a rank's comms are not healthy"
		if in.err != nil {
			why = in.err.Error()
		}
		m.logf(false, "group comms of epoch %d not kept into epoch %d (%s): forming new ones", m.group, m.epoch, why)
		m.formGroup()
		return
	}
	m.groupFor = m.epoch
	m.formFT()
}

func (m *machine) formFT() {
	if m.prep != nil && m.prep.epoch == m.epoch && !m.prep.dropped {
		m.joinPrep(m.reconfAt)
		return
	}
	how, exclude := planFor(m.target.Base, m.held, m.tview, m.cfg.id, m.inc)
	if m.target.Prepared {
		// As its survivors do in the background: the same comms, made
		// the same way, and the same agreement on them.
		how, exclude = preparedGrow, nil
	}
	from := uint64(0)
	if how.fresh() {
		if m.held.epoch != 0 && m.held.ftRank >= 0 {
			m.do(closeComms{dim: dimFT, epoch: m.held.epoch})
		}
	} else {
		from = m.held.epoch
	}
	m.how = how
	m.do(formComms{task: m.start(stageFormFT), dim: dimFT, epoch: m.epoch, how: how, exclude: exclude, from: from,
		rank: m.tview.ftRank, size: len(m.tview.ft)})
}

func (m *machine) onFormed(now time.Time, in commsFormed) {
	if in.dim == dimGroup {
		if in.err != nil {
			m.failReconfig(now, fmt.Errorf("ft: group comm for epoch %d: %w", in.epoch, in.err), in)
			return
		}
		m.group, m.groupFor, m.groupView, m.split[dimGroup] = in.epoch, in.epoch, m.tview.group, in.split
		if m.cancelled != nil {
			m.failReconfig(now, m.cancelled, commsFormed{})
			return
		}
		m.formFT()
		return
	}
	oldEpoch := m.held.epoch
	if in.err != nil {
		// A failed Shrink or Grow leaves the old comms as they were;
		// a failed fresh formation closed them already.
		if !m.how.fresh() && oldEpoch != 0 {
			m.do(closeComms{dim: dimFT, epoch: oldEpoch})
		}
		m.held = view{epoch: in.epoch, ftRank: -1}
		m.closeGroup()
		m.failReconfig(now, fmt.Errorf("ft: %s the FT comm to epoch %d: %w", m.how, in.epoch, in.err), in)
		return
	}
	m.held, m.view, m.split[dimFT] = m.tview, m.tview, in.split
	if m.cancelled != nil {
		m.failReconfig(now, m.cancelled, commsFormed{})
		return
	}
	m.announceFormed(now, in.epoch, oldEpoch)
	if m.how == preparedGrow {
		m.do(m.agreeSwitch(m.start(stageSwitch), m.epoch))
		return
	}
	m.gatherRecords()
}

// announceFormed says that this rank holds epoch's FT comms (formed from
// those of oldEpoch, or anew).
func (m *machine) announceFormed(now time.Time, epoch, oldEpoch uint64) {
	m.do(reportFormed{epoch: epoch})
	m.do(observe{what: metricReconfigs, value: 1, label: m.how.String()})
	if oldEpoch != 0 && m.tview.ftRank == 0 {
		m.do(forgetRendezvous{dim: dimFT, epoch: oldEpoch})
	}
	if m.prevGroup != 0 && m.prevGroup != m.group && m.cfg.groupRank == 0 {
		m.do(forgetRendezvous{dim: dimGroup, epoch: m.prevGroup})
	}
	m.logf(false, "reconfigured to epoch %d (base %d): %s, rank %d of %d, %d groups", epoch, m.target.Base, m.how,
		m.view.ftRank, len(m.view.ft), m.view.groups)
	m.emit(Event{Kind: EventReconfigured, Epoch: epoch, Participants: m.view.groups, How: m.how.String(),
		Took: now.Sub(m.reconfAt), Reason: m.target.Reason})
}

// reconfigured ends a reconfiguration that reached its step: the comms
// are ready (unless one broke meanwhile), the epoch's settings are in
// force from the next step, and advance starts it.
func (m *machine) reconfigured(now time.Time) {
	if m.comms != commsBroken { // a comm that broke meanwhile stays broken
		m.comms = commsReady
	}
	if m.latest != nil && m.latest.Epoch > m.epoch {
		m.prepare(now, *m.latest) // a grow of this epoch came while it formed
	}
	if s := m.target.Settings; s != nil && (m.settings == nil || *m.settings != *s) {
		// Every participant of the epoch agreed on this step: the
		// settings the epoch names are in force from the next one.
		m.settings = s
		m.do(applySettings{ref: s, epoch: m.epoch, from: m.step + 1})
		m.emit(Event{Kind: EventSettings, Epoch: m.epoch, FromStep: m.step + 1, Version: s.Version})
	}
	m.do(observe{what: metricReconfig, value: now.Sub(m.reconfAt).Seconds(), label: m.how.String()})
	// advance starts the step.
}

// failReconfig ends a reconfiguration that did not reach its step. res is
// the failed task's result (its error may name peers that never came).
func (m *machine) failReconfig(now time.Time, err error, res input) {
	if m.comms == commsReady {
		m.comms = unready
	}
	cancelled := m.cancelled
	switch {
	case m.life != running || errors.Is(err, ErrClosed):
		return
	case errors.Is(err, comm.ErrBackendUnavailable) || errors.Is(err, comm.ErrInvalidArgument):
		// A configuration error: no other epoch will do better.
		m.phase = phaseIdle
		m.do(stepDone{err: fmt.Errorf("ft: step: %w", err)})
		return
	case errors.Is(err, errHolderAbsent):
		m.noteFailure(now)
		return // wait for a quorum that brings back a holder; nothing failed
	}
	m.noteFailure(now)
	if cancelled != nil && m.gaveUp == nil {
		m.logf(false, "left epoch %d: %v", m.epoch, cancelled)
	} else {
		m.logf(true, "reconfiguration to epoch %d failed; waiting for the next epoch: %v", m.epoch, err)
	}
	// The peers that never came (a formation's timeout names them) are
	// blamed: the coordinator checks them before the next epoch.
	var blamed []string
	if f, ok := res.(commsFormed); ok && cancelled == nil && f.err != nil && errors.Is(f.err, comm.ErrPeerFailed) {
		members := m.tview.ft
		if f.dim == dimGroup {
			members = m.tview.group
		}
		for _, r := range comm.FailedRanks(f.err) {
			if r >= 0 && r < len(members) && members[r].ID != "" && members[r].ID != m.cfg.id && !slices.Contains(blamed, members[r].ID) {
				blamed = append(blamed, members[r].ID)
			}
		}
	}
	m.do(reportFailure{epoch: m.epoch, blamed: blamed})
}
