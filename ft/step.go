package ft

import (
	"errors"
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// The step machine's step: the replica group's gate at Step, the step,
// and Commit: the vote, the durable record, the outcome shared in the
// group and the withdrawal of the served state.

// gates reports whether a Step of this rank goes through the group's gate:
// with a replica group whose control comm of the current epoch it holds.
// Each rank of the group decides alone whether to start a step, reconfigure
// or wait, from the epochs it has seen; ranks that decided differently
// would run different collectives on the comms they share outside ft (the
// shard dimension's, under FSDP) and wait for each other until a timeout.
// The gate is one host all-reduce at every Step by which the group's ranks
// decide together.
func (m *machine) gates() bool {
	return m.cfg.groupSize > 1 && !m.cfg.noGate && m.holds(dimGroup) && m.revokedParts[dimGroup]&partCtl == 0
}

// gate starts the group's agreement for this Step, once per Step and
// epoch, and reports whether it did; ready says whether this rank could
// start the step now.
func (m *machine) gate(ready bool) bool {
	if m.gated || !m.gates() {
		return false
	}
	known := m.epoch
	if m.latest != nil && !m.stepsBeside() {
		known = max(known, m.latest.Epoch)
	}
	m.do(agreeStep{task: m.start(stageAgree), epoch: m.group, known: known, now: m.epoch, ready: ready})
	return true
}

// onStepAgreed takes the group's answer: the step starts only when every
// rank could start it in the same epoch and none knows a newer one.
// Otherwise the group waits for the newest epoch any of them knows (a
// failed exchange: the group's comm broke, and its watcher says so).
func (m *machine) onStepAgreed(in stepAgreed) {
	m.gated = true
	m.gateGo = in.err == nil && in.ready && in.same && in.known <= m.epoch
	if in.err != nil {
		m.logf(false, "the group's agreement at step %d failed: %v", m.step+1, in.err)
	}
}

// startStep starts the step the training loop asked for.
func (m *machine) startStep(now time.Time) {
	m.phase = phaseInStep
	m.noteStart(now)
	m.stepErrs, m.groupErrs = m.stepErrs[:0], m.groupErrs[:0]
	m.stepAt = now
	m.do(offerState{step: m.step, hist: m.hist})
	var err error
	if m.rollback != nil {
		err, m.rollback = m.rollback, nil
	}
	m.do(stepDone{err: err})
}

// onCommit ends the step: the vote (no failure in the step, enough
// replica groups, every rank of the group yes), with DurableCommit the
// record, then the withdrawal of the served state.
func (m *machine) onCommit(now time.Time, errs []error) {
	if m.task != 0 {
		// Only a Step cut short leaves a task running here.
		m.do(commitDone{err: fmt.Errorf("%w: ft: Commit while the step is not started", comm.ErrInvalidArgument)})
		return
	}
	if m.phase != phaseInStep && m.life == running {
		m.do(commitDone{err: fmt.Errorf("%w: ft: Commit without a started step (call Step first)", comm.ErrInvalidArgument)})
		return
	}
	m.phase = phaseCommitting
	if m.life != running {
		return // advance replies
	}
	for _, err := range errs {
		m.stepErrs = append(m.stepErrs, err)
	}
	if len(errs) > 0 {
		m.noteFailure(now)
	}
	participating := m.holds(dimFT)
	m.vote = len(m.stepErrs) == 0 && len(m.groupErrs) == 0 && participating && m.view.groups >= m.cfg.minReplicas
	m.reason = ""
	if participating && m.holds(dimGroup) {
		if m.revokedParts[dimGroup]&partCtl == 0 {
			m.do(castVote{task: m.start(stageVote), epoch: m.group, yes: m.vote})
			return
		}
		m.vote = false // a rank of the group is gone
	}
	m.afterVote(now)
}

// onStepFailed: the training loop failed its step for a reason of its own
// (Comm.FailStep). This rank's vote is no, with err as the step's error;
// and, as when a collective of the step fails, the FT comms are revoked at
// once: a peer's op of the step that still needs this rank's part fails
// instead of completing, and fails the peer's commit (with GroupSize > 1,
// the peer's group vote carries that to its group). The group comms are
// not revoked: the group's vote says no on them, and the group keeps them
// into the next epoch.
func (m *machine) onStepFailed(now time.Time, err error) {
	switch {
	case m.life != running:
		m.do(failStepDone{err: ErrClosed})
		return
	case m.phase != phaseInStep:
		m.do(failStepDone{err: fmt.Errorf("%w: ft: FailStep without a started step (call it between Step and Commit)", comm.ErrInvalidArgument)})
		return
	}
	m.stepErrs = append(m.stepErrs, err)
	m.noteFailure(now)
	m.logf(true, "the training loop failed step %d in epoch %d: %v", m.step+1, m.epoch, err)
	m.revoke(dimFT, partBoth, err.Error())
	m.do(failStepDone{})
}

func (m *machine) onVoted(now time.Time, in voted) {
	if in.err != nil {
		m.groupErrs = append(m.groupErrs, in.err)
		m.noteFailure(now)
	}
	m.vote = in.err == nil && in.yes
	m.afterVote(now)
}

// afterVote makes a yes durable (DurableCommit): one record per replica
// group, written by its leader (group rank 0), which tells the group's
// other ranks the outcome over the group's control comm; without a group
// (GroupSize 1) each rank is its own leader.
func (m *machine) afterVote(now time.Time) {
	if m.vote && m.cfg.durable && m.cancelled == nil {
		if m.sharesRecord() && m.cfg.groupRank != 0 {
			m.do(shareOutcome{task: m.start(stageOutcome), epoch: m.group})
			return
		}
		m.do(recordCommit{task: m.start(stageRecord), step: m.step + 1, epoch: m.epoch})
		return
	}
	m.do(withdrawState{task: m.start(stageWithdraw)})
}

// sharesRecord: this rank's replica group voted over its group comm, so
// its leader records the commit for it.
func (m *machine) sharesRecord() bool {
	return m.cfg.groupSize > 1 && m.holds(dimGroup)
}

func (m *machine) onRecorded(now time.Time, in commitRecorded) {
	m.vote, m.reason = in.ok, in.reason
	if m.sharesRecord() && m.cancelled == nil {
		m.do(shareOutcome{task: m.start(stageOutcome), epoch: m.group, root: true, ok: in.ok})
		return
	}
	m.do(withdrawState{task: m.start(stageWithdraw)})
}

// onOutcome: the leader's record decides. The leader keeps its own
// outcome whatever became of the message (its record stands); another
// rank commits only on the leader's word that the record names this
// epoch.
func (m *machine) onOutcome(now time.Time, in outcomeShared) {
	switch {
	case m.cfg.groupRank == 0:
		if in.err != nil {
			m.logf(true, "could not tell the replica group the outcome of step %d's record: %v", m.step+1, in.err)
		}
	case in.err != nil:
		m.vote, m.reason = false, "the replica group's leader did not say whether it recorded the commit: "+in.err.Error()
		m.groupErrs = append(m.groupErrs, in.err)
	case !in.ok:
		m.vote, m.reason = false, "the replica group's leader could not record the commit (another epoch owns the step, or etcd failed)"
	}
	m.do(withdrawState{task: m.start(stageWithdraw)})
}

func (m *machine) onWithdrawn(now time.Time, in withdrawn) {
	if in.err != nil {
		m.stepErrs = append(m.stepErrs, in.err)
		m.vote = false
	}
	gaveUp := m.gaveUp
	if gaveUp != nil {
		m.gaveUp = nil
		m.vote = false // the caller gave up: its step does not commit
	}
	if m.phase != phaseCommitting {
		return
	}
	m.phase = phaseIdle
	m.idleSince = now
	m.lookAt(now)
	if m.vote {
		m.hist = m.hist.commit(m.step+1, m.epoch)
		m.step++
		m.failedCommits = 0
		m.do(setStep{step: m.step})
		m.do(observe{what: metricCommit, value: 1, label: "ok"})
		if !m.failedAt.IsZero() {
			m.do(observe{what: metricFailureToCommit, value: now.Sub(m.failedAt).Seconds()})
			m.logf(false, "committed step %d %v after a failure", m.step, now.Sub(m.failedAt).Round(time.Millisecond))
			m.failedAt = time.Time{}
		}
		m.do(observe{what: metricStepSeconds, value: now.Sub(m.stepAt).Seconds()})
		m.do(commitDone{ok: true})
		return
	}
	m.failedCommits++
	m.do(observe{what: metricCommit, value: 1, label: "failed"})
	m.noteFailure(now)
	reason := m.reason
	participating := m.holds(dimFT)
	switch {
	case reason != "":
	case gaveUp != nil:
		reason = "the caller's ctx ended: " + gaveUp.Error()
	case !participating:
		reason = "not participating"
	case len(m.stepErrs) > 0:
		reason = m.stepErrs[0].Error()
	case len(m.groupErrs) > 0:
		reason = "the replica group's vote failed: " + m.groupErrs[0].Error()
	case m.view.groups < m.cfg.minReplicas:
		reason = fmt.Sprintf("%d replica groups, %d needed", m.view.groups, m.cfg.minReplicas)
	default:
		reason = "a rank of the replica group voted no"
	}
	m.logf(true, "commit of step %d failed in epoch %d (%d in a row): %s", m.step+1, m.epoch, m.failedCommits, reason)
	m.emit(Event{Kind: EventCommitFailed, Epoch: m.epoch, Reason: reason})
	if participating {
		m.revoke(dimFT, partBoth, "ft: commit failed: "+reason)
		// Blame the peers the step's collectives saw fail (a reset
		// connection: their process is likely gone); the coordinator
		// checks and removes them without waiting for gossip. The record
		// revokes the epoch everywhere at once; the report carries the
		// blame even when another rank wrote the record first.
		blamed := m.newlyBlamed(dimFT, m.stepErrs)
		blamed = append(blamed, m.newlyBlamed(dimGroup, m.groupErrs)...)
		if len(blamed) > 0 {
			m.do(revokeEpoch{epoch: m.epoch, reason: reason, blamed: blamed})
		}
		m.do(reportFailure{epoch: m.epoch, blamed: m.blamed})
	}
	var err error
	switch {
	case gaveUp != nil:
		err = fmt.Errorf("ft: commit: %w", gaveUp)
	case m.failedCommits >= m.cfg.maxCommitFailures:
		// The loop's own failure (FailStep) stays typed; other step errors
		// stay text, or their kinds would change the error's class (the C
		// ABI's status is its first kind).
		var last error = errors.New(reason)
		if len(m.stepErrs) > 0 && errors.Is(m.stepErrs[0], ErrStepFailed) && reason == m.stepErrs[0].Error() {
			last = m.stepErrs[0]
		}
		err = fmt.Errorf("%w: %d in a row, last: %w", ErrTooManyCommitFailures, m.failedCommits, last)
	}
	m.do(commitDone{err: err})
}
