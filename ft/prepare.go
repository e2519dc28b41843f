package ft

import (
	"fmt"
	"slices"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// Prepared grows, as the step machine sees them. An epoch that only adds
// whole replica groups to the one before (membership.Quorum.Prepared) is
// a grow whose cost today is the joiners': a new process's first comm
// (NCCL loads its kernels), its connections, its heal. Its survivors
// need not stop for it. Each survivor forms the epoch's FT comms anew in
// the background, beside the steps it keeps taking in its current epoch,
// and once they are formed every rank of the new epoch agrees over its
// new control comm on the step after which all of them move (switchStep).
// Survivors move at their first Step after that step: they close the old
// comms and gather the step records on the new ones, where the joiners
// wait for them; the joiners heal from them as any joiner does. A survivor
// that cannot take part in the background (its comms broke, it was still
// reconfiguring) forms the same comms and takes part in the same
// agreement when it reconfigures, so every rank of the epoch runs the same
// collectives on the new comms in the same order.
//
// Nothing of the new epoch is reported formed until a survivor moves, so
// the coordinator never takes an epoch's comms as the base of the next
// while some of its ranks still step on the old ones: a newer epoch drops
// the preparation and is reached as without one.

// switchMargin is how many steps past the most advanced rank's committed
// step the ranks of a prepared epoch move, at least. Ranks that step
// together are at most one step apart, and each reads its committed step
// as it posts the agreement, so when the agreement completes none has
// committed more than the maximum plus one, and none has started the step
// after maximum + switchMargin: a rank hears the answer a step before it
// needs it. Where steps are shorter than switchSlack, the margin grows to
// about switchSlack of them, time for the answer to reach each rank's
// driver on a loaded host too.
const (
	switchMargin = 2
	switchSlack  = 25 * time.Millisecond
)

// switchStep is the step after which the ranks of a prepared epoch move
// to it, from the maximum over them of their committed step and of their
// slowest recent step (0 where not known), the op timeout, and how many
// of the epoch's FT ranks survive from its Base and how many join. 0
// means at once: a survivor's step in flight fails, as when any new epoch
// begins mid-step. The joiners wait for the survivors in a collective
// bounded by the timeout, so the ranks move at once where the steps up to
// the move could come near it, or their length is not known. And they
// move at once where that costs less device time than waiting: waiting,
// the joiners idle from the agreement to the move, 1 to switchMargin
// steps (1.5 on average); at once, each survivor loses the part of its
// step in flight it had done (half a step on average) — so at once while
// the survivors are at most three times the joiners (the jobs of 2 to 4
// replicas one of which is replaced), waiting for larger ones.
func switchStep(maxStep int64, slowest, timeout time.Duration, survivors, joiners int) int64 {
	if slowest <= 0 || timeout <= 0 || survivors <= 3*joiners {
		return 0
	}
	margin := int64(switchMargin)
	if slowest < switchSlack {
		margin += int64((switchSlack+slowest-1)/slowest) - 1
	}
	if time.Duration(margin+1)*slowest > timeout/2 {
		return 0
	}
	return maxStep + margin
}

// preparation is a prepared grow a survivor forms in the background.
type preparation struct {
	epoch   uint64
	task    int   // the task in flight (0: none): its formation, then the agreement
	stage   stage // stageFormFT or stageSwitch
	formed  bool  // the driver holds epoch's FT comms
	split   bool
	at      int64 // the agreed step to move after (-1: not agreed yet)
	err     error // it failed, or its comms broke: this rank does not move to them
	since   time.Time
	dropped bool // superseded: what its task in flight formed is closed when it answers
}

// prepare starts forming q's comms in the background if q is a prepared
// grow of the epoch this rank steps in, with comms that work and a group
// that stays as it is; it reports whether it did.
func (m *machine) prepare(now time.Time, q membership.Quorum) bool {
	if !q.Prepared || m.prep != nil || m.life != running || q.Base != m.epoch || !m.holds(dimFT) ||
		m.comms != commsReady || m.revokedParts[dimFT] != 0 || m.final > 0 {
		return false
	}
	v, err := deriveView(q.Epoch, participantsOf(q), m.cfg.group, m.cfg.groupRank, m.cfg.groupSize)
	if err != nil || !v.complete || !v.includes(m.cfg.id, m.inc) || v.ftRank != m.view.ftRank {
		return false
	}
	if m.cfg.groupSize > 1 && !(m.holds(dimGroup) && sameParticipants(m.groupView, v.group)) {
		return false
	}
	m.prep = &preparation{epoch: q.Epoch, at: -1, since: now}
	m.logf(false, "epoch %d grows epoch %d to %d participants: forming its comms in the background while stepping on", q.Epoch, m.epoch, len(v.ft))
	m.do(formComms{task: m.startPrep(stageFormFT), dim: dimFT, epoch: q.Epoch, how: preparedGrow,
		rank: v.ftRank, size: len(v.ft), background: true})
	return true
}

// growsFormed reports whether q is a prepared grow of the epoch this rank
// reconfigures to, whose FT comms it formed already: the reconfiguration
// goes on (its peers' does too), and the grow is prepared once it is done
// (the coordinator publishes a grow as soon as the survivors report their
// comms formed, before they agreed on the step and healed).
func (m *machine) growsFormed(q membership.Quorum) bool {
	return q.Prepared && q.Base == m.target.Epoch && m.target.Epoch == m.epoch && m.held.epoch == m.epoch &&
		m.held.ftRank >= 0 && m.stage >= stageGather
}

// startPrep begins the preparation's next task and returns its id.
func (m *machine) startPrep(s stage) int {
	m.lastTask++
	m.prep.task, m.prep.stage = m.lastTask, s
	return m.lastTask
}

// prepDone reports whether a result is that of the preparation's task in
// flight, and ends it.
func (m *machine) prepDone(task int, s stage) bool {
	p := m.prep
	if p == nil || task == 0 || task != p.task || s != p.stage {
		return false
	}
	p.task = 0
	return true
}

// dropPrep gives the preparation up: its comms are closed now, or when
// its task in flight answers.
func (m *machine) dropPrep(cause error) {
	p := m.prep
	if p == nil || p.dropped {
		return
	}
	p.dropped = true
	if p.task != 0 {
		m.do(cancelTask{task: p.task, cause: cause})
		return
	}
	if p.formed {
		m.do(closeComms{dim: dimFT, epoch: p.epoch})
	}
	m.prep = nil
}

// endDropped ends a dropped preparation whose task answered; formed says
// whether it holds comms of the epoch.
func (m *machine) endDropped(formed bool) {
	if formed {
		m.do(closeComms{dim: dimFT, epoch: m.prep.epoch})
	}
	m.prep = nil
}

func (m *machine) onPrepFormed(now time.Time, in commsFormed) {
	p := m.prep
	if p.dropped {
		m.endDropped(in.err == nil)
		return
	}
	if in.err != nil {
		p.err = in.err
		m.logf(true, "forming epoch %d's comms in the background failed; stepping on in epoch %d: %v", p.epoch, m.epoch, in.err)
		return
	}
	p.formed, p.split = true, in.split
	m.do(m.agreeSwitch(m.startPrep(stageSwitch), p.epoch))
}

func (m *machine) onPrepAgreed(now time.Time, in switchAgreed) {
	p := m.prep
	if p.dropped {
		m.endDropped(true)
		return
	}
	if in.err != nil {
		p.err = in.err
		m.logf(true, "epoch %d's ranks did not agree when to move to it; stepping on in epoch %d: %v", p.epoch, m.epoch, in.err)
		return
	}
	p.at = in.at
	when := fmt.Sprintf("after step %d (committed: %d)", p.at, m.step)
	if p.at == 0 {
		when = "at once"
	}
	m.logf(false, "epoch %d formed in the background in %v; moving to it %s", p.epoch, now.Sub(p.since).Round(time.Millisecond), when)
	if m.phase == phaseInStep && m.step >= p.at {
		// This rank's step is past the agreed one: its peers will not
		// take it in this epoch.
		m.revoke(dimFT, partData, fmt.Sprintf("ft: moving to epoch %d %s; its peers take no later step in epoch %d", p.epoch, when, m.epoch))
	}
}

// prepBroken: a comm of the preparation stopped (a joiner died, say):
// this rank does not move to it, and the next epoch comes as without one.
func (m *machine) prepBroken(in commFailed) {
	if m.prep.err == nil && !m.prep.dropped {
		m.prep.err = fmt.Errorf("its %s comm failed: %w", in.part, in.err)
		m.logf(true, "epoch %d's comms, formed in the background, failed; stepping on in epoch %d: %v", m.prep.epoch, m.epoch, in.err)
	}
}

// stepsBeside reports whether this rank steps on in its epoch while the
// newest one is prepared: its comms work, and the agreed step has not
// come (or the preparation failed, and the next epoch will say more).
func (m *machine) stepsBeside() bool {
	p := m.prep
	return p != nil && !p.dropped && m.latest != nil && p.epoch == m.latest.Epoch && m.comms == commsReady &&
		(p.err != nil || p.at < 0 || m.step < p.at)
}

// joinPrep moves this rank to the prepared epoch it reconfigures to, at
// whatever point its preparation stands: it takes the task in flight
// over, or goes on from the comms already formed and agreed on.
func (m *machine) joinPrep(now time.Time) {
	p := m.prep
	m.prep = nil
	m.how = preparedGrow
	oldEpoch := m.held.epoch
	if oldEpoch != 0 && m.held.ftRank >= 0 {
		m.do(closeComms{dim: dimFT, epoch: oldEpoch})
	}
	switch {
	case p.err != nil:
		if p.formed {
			m.do(closeComms{dim: dimFT, epoch: p.epoch})
		}
		m.held = view{epoch: p.epoch, ftRank: -1}
		m.closeGroup()
		m.failReconfig(now, fmt.Errorf("ft: epoch %d, formed in the background: %w", p.epoch, p.err), nil)
	case p.stage == stageFormFT && p.task != 0:
		m.task, m.stage, m.cancelled = p.task, stageFormFT, nil // onFormed goes on
	default:
		m.held, m.view, m.split[dimFT] = m.tview, m.tview, p.split
		m.announceFormed(now, p.epoch, oldEpoch)
		if p.task != 0 {
			m.task, m.stage, m.cancelled = p.task, stageSwitch, nil // onSwitchAgreed goes on
			return
		}
		m.gatherRecords()
	}
}

// onSwitchAgreed: a rank that formed the prepared epoch's comms in its
// reconfiguration took part in its ranks' agreement; the step records
// come next (survivors that formed them in the background join there).
func (m *machine) onSwitchAgreed(now time.Time, in switchAgreed) {
	if in.err != nil {
		m.failReconfig(now, fmt.Errorf("ft: agreeing when to move to epoch %d: %w", m.epoch, in.err), in)
		return
	}
	if m.cancelled != nil {
		m.failReconfig(now, m.cancelled, nil)
		return
	}
	m.gatherRecords()
}

// agreeSwitch is the agreement on when to move to prepared epoch (the
// newest quorum): this rank's committed step and slowest recent step, and
// how many of the epoch's FT ranks join (their ids are the quorum's Added,
// alike at every rank).
func (m *machine) agreeSwitch(task int, epoch uint64) agreeSwitch {
	a := agreeSwitch{task: task, epoch: epoch, step: m.step, slowest: m.slowestStep()}
	if q := m.latest; q != nil && q.Epoch == epoch {
		if v, err := deriveView(q.Epoch, participantsOf(*q), m.cfg.group, m.cfg.groupRank, m.cfg.groupSize); err == nil {
			for _, p := range v.ft {
				if slices.Contains(q.Added, p.ID) {
					a.joiners++
				}
			}
			a.survivors = len(v.ft) - a.joiners
		}
	}
	return a
}

// slowestStep is the slowest of this rank's recent steps, 0 while too few
// are known.
func (m *machine) slowestStep() time.Duration {
	if m.cycleN < stallMinSteps {
		return 0
	}
	var slowest time.Duration
	for _, c := range m.cycles[:min(m.cycleN, stallWindow)] {
		slowest = max(slowest, c)
	}
	return slowest
}
