package ft

import (
	"errors"
	"fmt"
	"time"
)

// The step machine's agreement on the epoch's step, and healing: the
// ranks' step records gathered, the step agreed (with DurableCommit, the
// job's last commit record read), the state fetched by a rank behind, and
// the replica group's check that its ranks hold the same step (or a
// restored peer snapshot).

// gatherRecords starts the step agreement on the epoch's FT comms.
func (m *machine) gatherRecords() {
	m.do(gatherRecords{task: m.start(stageGather), epoch: m.epoch, step: m.step, last: m.hist.last()})
}

func (m *machine) onGathered(now time.Time, in recordsGathered) {
	if in.err != nil {
		m.failReconfig(now, fmt.Errorf("ft: step agreement in epoch %d: %w", m.epoch, in.err), in)
		return
	}
	m.agreed = agree(in.recs)
	if m.agreed.Step == 0 && m.target.RunStep > 0 && !m.cfg.snapshots {
		// No participant holds any step of a run that reached one: going
		// on would restart the run's history from step 0 under its name.
		m.logf(true, "the job's run reached step %d, and no participant holds any step of it", m.target.RunStep)
		m.fatal = &StaleRunError{Step: m.target.RunStep}
		return
	}
	if m.agreed.Step < m.target.RunStep {
		m.logf(true, "continuing the run from step %d; it had reached step %d: the steps after %d are taken again",
			m.agreed.Step, m.target.RunStep, m.agreed.Step)
	}
	if m.cfg.durable {
		m.do(readLastCommit{task: m.start(stageLastCommit)})
		return
	}
	m.afterAgreement(now)
}

func (m *machine) onLastCommit(now time.Time, in lastCommitRead) {
	if in.err != nil {
		m.failReconfig(now, fmt.Errorf("ft: step agreement in epoch %d: %w", m.epoch, in.err), in)
		return
	}
	if in.ok && in.rec.Step > m.agreed.Step {
		if m.agreed.Step == 0 {
			// No participant holds anything of the run: a wait could
			// only end if replicas that hold it come back.
			m.logf(true, "the job's run committed step %d (epoch %d), and no participant holds any step", in.rec.Step, in.rec.Epoch)
			m.fatal = &StaleRunError{Step: in.rec.Step, Epoch: in.rec.Epoch, By: in.rec.By, At: in.rec.At}
			return
		}
		if m.waitingFor != in.rec.Step {
			m.waitingFor = in.rec.Step
			reason := fmt.Sprintf("step %d was committed by epoch %d; no participant holds it", in.rec.Step, in.rec.Epoch)
			m.logf(true, "the job committed step %d (epoch %d), which no participant holds (they hold %d); waiting for a quorum with one of its replicas",
				in.rec.Step, in.rec.Epoch, m.agreed.Step)
			m.emit(Event{Kind: EventWaiting, Epoch: m.epoch, Reason: reason})
			m.do(reportWaiting{step: in.rec.Step, reason: reason + fmt.Sprintf(" (the participants hold %d)", m.agreed.Step)})
		}
		m.failReconfig(now, errHolderAbsent, in)
		return
	}
	if m.waitingFor != 0 {
		m.waitingFor = 0
		m.do(reportWaiting{}) // a participant holds the step now
	}
	m.afterAgreement(now)
}

func (m *machine) afterAgreement(now time.Time) {
	if m.cancelled != nil {
		m.failReconfig(now, m.cancelled, nil)
		return
	}
	if m.agreed.heals(m.step, m.hist.last()) {
		m.logf(false, "healing from step %d (epoch %d) to step %d (epoch %d) from %d sources", m.step, m.hist.last(),
			m.agreed.Step, m.agreed.Epoch, len(m.agreed.Sources))
		m.do(fetchState{task: m.start(stageHeal), epoch: m.epoch, agreement: m.agreed})
		return
	}
	m.checkGroupSteps(now)
}

func (m *machine) onHealed(now time.Time, in stateHealed) {
	if in.err != nil {
		m.failReconfig(now, fmt.Errorf("ft: heal to step %d: %w", m.agreed.Step, in.err), in)
		return
	}
	from := m.step
	lostFrom, lostTo, rolledBack := diverged(m.hist, m.step, in.hist)
	m.hist, m.step = in.hist, m.agreed.Step
	m.do(setStep{step: m.step})
	m.emit(Event{Kind: EventHealed, Epoch: m.epoch, FromStep: from, Bytes: in.bytes, Took: in.took})
	// Tell the coordinator now rather than at the next heartbeat, so
	// its dashboard stops showing this replica as healing.
	m.do(reportHeartbeat{})
	if rolledBack {
		m.do(observe{what: metricRollback, value: float64(lostTo - lostFrom + 1)})
		m.logf(true, "rolled back committed steps %d..%d: the job's history has other contents for them; now at step %d (epoch %d)",
			lostFrom, lostTo, m.agreed.Step, m.agreed.Epoch)
		m.emit(Event{Kind: EventRolledBack, Epoch: m.epoch, FromStep: lostFrom, ToStep: lostTo})
		epoch, _ := in.hist.epochOf(lostFrom)
		m.noteRollback(&RollbackError{FromStep: lostFrom, ToStep: lostTo, Step: m.agreed.Step, Epoch: epoch})
	}
	m.checkGroupSteps(now)
}

// checkGroupSteps makes sure the replica group's ranks continue from one
// step. They heal independently (rank i from FT comm i), so they differ
// only when the group's vote completed at one rank and failed at the
// other and no other group holds the lagging shard's step: that shard's
// state is lost, and training on would mix steps silently.
func (m *machine) checkGroupSteps(now time.Time) {
	if m.cancelled != nil {
		m.failReconfig(now, m.cancelled, nil)
		return
	}
	if m.cfg.groupSize > 1 {
		m.do(checkGroup{task: m.start(stageCheckGroup), epoch: m.group, step: m.step})
		return
	}
	m.reconfigured(now)
}

func (m *machine) onGroupChecked(now time.Time, in groupChecked) {
	switch {
	case in.err != nil:
		m.failReconfig(now, fmt.Errorf("ft: the group's step check in epoch %d: %w", m.epoch, in.err), in)
	case in.lost != nil:
		m.logf(true, "%v", in.lost)
		m.fatal = in.lost
	case in.restored != nil:
		m.onRestored(now, in.restored)
	case m.cfg.snapshots && m.step == 0 && m.target.RunStep > 0:
		// No rank of the group holds any step, and no snapshot either.
		m.logf(true, "the job's run reached step %d, and no rank of the group holds any step of it or a snapshot", m.target.RunStep)
		m.fatal = &StaleRunError{Step: m.target.RunStep}
	case in.lo != in.hi:
		m.logf(true, "the replica group's ranks stand at steps %d..%d (this rank %d) and no replica holds the lagging shard's step",
			in.lo, in.hi, m.step)
		m.fatal = &GroupDivergedError{Group: m.cfg.group, Step: m.step, Min: in.lo, Max: in.hi}
	case m.cancelled != nil:
		m.failReconfig(now, m.cancelled, nil)
	default:
		m.reconfigured(now)
	}
}

// onRestored: the group restored a peer snapshot (Config.SnapshotEvery).
// A rank that held a newer step lost the steps after the snapshot's: the
// training loop hears it as a rollback.
func (m *machine) onRestored(now time.Time, r *restored) {
	from := m.step
	m.hist, m.step = r.hist, r.step
	m.do(setStep{step: m.step})
	m.logf(true, "restored the group's peer snapshot of step %d (this rank held step %d; %d bytes from its buddy) in %v",
		r.step, from, r.bytes, r.took.Round(time.Millisecond))
	m.emit(Event{Kind: EventRestored, Epoch: m.epoch, FromStep: from, Bytes: r.bytes, Took: r.took})
	m.do(reportHeartbeat{})
	if from > r.step {
		m.do(observe{what: metricRollback, value: float64(from - r.step)})
		m.emit(Event{Kind: EventRolledBack, Epoch: m.epoch, FromStep: r.step + 1, ToStep: from,
			Reason: fmt.Sprintf("the group restored its peer snapshot of step %d", r.step)})
		m.noteRollback(&RollbackError{FromStep: r.step + 1, ToStep: from, Step: r.step, Snapshot: true})
	}
	m.reconfigured(now)
}

// noteRollback keeps r for the next Step to return. A rollback still
// pending (its epoch was superseded before the loop's Step returned: a
// newer quorum arrived as the heal completed) is merged into it, so that
// the loop hears of every discarded step, once: from the earliest to the
// latest, now at r's step.
func (m *machine) noteRollback(r *RollbackError) {
	if p := m.rollback; p != nil {
		if p.FromStep < r.FromStep {
			r.FromStep, r.Epoch = p.FromStep, p.Epoch
		}
		r.ToStep = max(r.ToStep, p.ToStep)
		r.Snapshot = r.Snapshot || p.Snapshot
	}
	m.rollback = r
}

// errHolderAbsent: with DurableCommit, the job's newest committed step is
// held by no participant of this epoch; the rank waits for a quorum that
// brings one back.
var errHolderAbsent = errors.New("ft: the job's committed step is held by no participant")
