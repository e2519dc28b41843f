package ft

import (
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// The step protocol of one rank as a state machine with no
// goroutines, clock or I/O (the model is quorum.Machine and etcd-io/raft's
// Ready). Its inputs say what happened — a quorum or revocation published,
// the training loop calling Step, Commit or Close, a comm formed or failed,
// step records gathered, state healed, the vote counted — each with the
// time; handle returns the actions that follow. Comm runs it on one
// goroutine, which owns every comm, carries out the actions (exec.go) and
// feeds their results back. The decisions themselves are the pure
// functions of protocol.go and view.go.
//
// At most one task (forming comms, gathering records, healing, voting…)
// is in flight; its result is the next input about it. A newer quorum, a
// Close, or the training loop giving up cancels it, and the machine still
// waits for its result (it may hold comms) before it moves on.
//
// Here: the machine's state, handle and advance. Its inputs and actions
// are inputs.go's and actions.go's; what it does, by concern:
// failure.go (a newer quorum, a revocation, a failed comm),
// reconfigure.go (moving to an epoch), heal.go (the step agreement and
// healing), step.go (the gate, the step and its commit), prepare.go
// (grows prepared in the background), stall.go (stalled steps) and
// finish.go (the run's end and Close).

// dim is one dimension's comms: the fault-tolerant (replicate) dimension
// or the replica group (shard dimension).
type dim uint8

const (
	dimFT dim = iota
	dimGroup
)

func (d dim) String() string { return [...]string{"ft", "group"}[d] }

// part says which comm of a dimension: the data comm (the training loop's
// collectives) or the control comm (ft's own messages). With a host data
// backend one comm is both.
type part uint8

const (
	partData part = 1 << iota
	partCtl
	partBoth = partData | partCtl
)

func (p part) String() string {
	switch p {
	case partData:
		return "data"
	case partCtl:
		return "control"
	}
	return "data+control"
}

// stage is the task in flight.
type stage uint8

const (
	stageNone stage = iota
	stageFormGroup
	stageFormFT
	stageSwitch // a prepared epoch's ranks agree on the step to move at
	stageGather
	stageLastCommit
	stageHeal
	stageCheckGroup
	stageAgree // the group's agreement at Step (gate)
	stageVote
	stageRecord
	stageOutcome
	stageWithdraw
	stageFinalHeal // healing to the run's final state, to stop with it
)

func formStage(d dim) stage {
	if d == dimGroup {
		return stageFormGroup
	}
	return stageFormFT
}

func (s stage) reconfiguring() bool { return s >= stageFormGroup && s <= stageCheckGroup }

// phase is where the training loop stands with the step protocol, as
// raft's StateType names where a node stands: which call it waits in, or
// that a step it started runs.
type phase uint8

const (
	phaseIdle       phase = iota // between Commit (or New) and Step
	phaseStepping                // Step was called and waits for its answer
	phaseInStep                  // Step returned: the step runs until Commit
	phaseCommitting              // Commit was called and waits for its answer
)

// lifecycle is whether the Comm is closing: Close cancels the task in
// flight, and once none runs the machine closes every comm and stops.
type lifecycle uint8

const (
	running lifecycle = iota
	closing           // Close was called
	closed            // every comm is closed; the machine takes no more input
)

// readiness is the state of the current epoch's comms for a step.
type readiness uint8

const (
	unready     readiness = iota // forming, or never formed
	commsReady                   // formed and the step agreed: a step may start
	commsBroken                  // one failed or was revoked: the next step needs a new epoch
)

// machineConfig is what the machine needs of Config.
type machineConfig struct {
	id                string
	spare             bool // registered as a spare (Config.Spare), until promoted
	group             string
	groupRank         int
	groupSize         int
	minReplicas       int
	durable           bool
	maxCommitFailures int
	// stallFactor and stallMin make the stall bound (stall.go); a factor
	// of 0 or less turns stall reports off.
	stallFactor float64
	stallMin    time.Duration
	// linger bounds how long Close waits, after Finish, for the replicas
	// behind the final step to heal from this one.
	linger time.Duration
	// noGate turns the group's gate off: for the benchmark that measures
	// what it costs (BenchmarkGroupGate), never in a job.
	noGate bool
	// initialStep is the committed step of the state the loop registered
	// (Config.InitialStep: restored from a checkpoint; 0: the initial
	// state).
	initialStep int64
	// snapshots: peer snapshots (Config.SnapshotEvery); the group's step
	// check restores a snapshot where its ranks' steps differ.
	snapshots bool
}

// machine is the step protocol of one rank. Not safe for concurrent use.
type machine struct {
	cfg machineConfig
	inc int64

	latest  *membership.Quorum // newest quorum seen
	revoked uint64             // newest epoch whose revocation was acted on
	final   int64              // the run ended at this step (Quorum.Final); 0: it goes on

	// epoch is the epoch this rank is in: its comms formed or forming, or
	// none (it sat the epoch out or its formation failed). view is its
	// view of epoch (ftRank -1 until the FT comms formed).
	epoch uint64
	view  view
	// held is the view whose FT comms this rank holds (epoch 0: none),
	// group the epoch of the group comms it holds (0: none): they were
	// formed then among groupView, and serve epoch groupFor (kept from
	// one epoch to the next while the group's ranks stay the same).
	held      view
	group     uint64
	groupFor  uint64
	groupView []participant
	split     [2]bool // per dim: its data and control are separate comms
	// gated: the group's ranks agreed at this Step call (gate) in this
	// epoch; gateGo: to start the step in it.
	gated, gateGo bool
	// revokedParts: which of epoch's comms were revoked, per dim.
	revokedParts [2]part
	comms        readiness
	blamed       []string // members this rank blamed in epoch

	stage     stage
	task      int // the task in flight (0: none)
	lastTask  int
	cancelled error // why the task in flight was cancelled (nil: it was not)
	target    membership.Quorum
	tview     view
	agreed    agreement
	rollback  *RollbackError
	reconfAt  time.Time
	how       reconfig
	prevGroup uint64 // the group comms' epoch before this reconfiguration

	// The training loop.
	phase     phase
	life      lifecycle
	stepErrs  []error
	groupErrs []error
	vote      bool
	reason    string
	lost      error
	fatal     error
	gaveUp    error // the training loop's ctx ended: why

	step          int64
	hist          history
	failedCommits int
	failedAt      time.Time // first failure since the last commit
	stepAt        time.Time
	waitingFor    int64 // durable: the step no participant holds, logged once

	// Stalls (stall.go): recent steps' durations, the next look, what was
	// reported last.
	cycles      [stallWindow]time.Duration
	cycleN      int
	lastStart   time.Time // when the last step started
	reconfSince bool      // a reconfiguration came since lastStart
	idleSince   time.Time // when the loop last left Commit
	taskAt      time.Time // when the task in flight began
	seenTask    int
	stallLook   time.Time
	stallSent   membership.StepStall
	armed       time.Time // the tick the driver holds

	// The end of the run: Finish was called (this rank serves the final
	// state until Close, which waits for those behind, until lingerUntil),
	// and whether a heal to Final was tried.
	finishing      bool
	lingerUntil    time.Time
	finalHealTried bool

	settings *membership.SettingsRef // the job's settings in force

	// prep is the prepared grow this rank forms in the background while it
	// steps on in its epoch (nil: none).
	prep *preparation

	// spare: this rank waits as a spare — registered as one, or its
	// group's place was taken by a promoted spare (Quorum.Replaced) —
	// until a quorum takes it in.
	spare bool

	out []action
}

func newMachine(cfg machineConfig, inc int64) *machine {
	return &machine{cfg: cfg, inc: inc, view: view{ftRank: -1}, held: view{ftRank: -1}, step: cfg.initialStep, spare: cfg.spare}
}

// handle feeds one input to the machine and returns the actions to carry
// out, in order. The slice is reused by the next call.
func (m *machine) handle(now time.Time, in input) []action {
	m.out = m.out[:0]
	if m.life == closed {
		return m.out
	}
	switch in := in.(type) {
	case quorumSeen:
		m.onQuorum(now, in.q)
	case revocationSeen:
		m.onRevocation(in.r)
	case reregistered:
		m.inc = in.inc
	case membershipLost:
		m.lost = fmt.Errorf("%w: %w", ErrMembershipLost, in.err)
	case stepCalled:
		m.phase, m.gaveUp = phaseStepping, nil // a step that never reached Commit is abandoned
		m.gated = false
	case stepCancelled:
		m.giveUp(in.err, m.task != 0 && (m.stage.reconfiguring() || m.stage == stageAgree))
	case commitCalled:
		m.blameSilent(in.silent)
		m.onCommit(now, in.errs)
	case finishCalled:
		m.onFinish(now)
	case stepFailed:
		m.onStepFailed(now, in.err)
	case tick:
		m.onTick(now, in)
	case commitCancelled:
		m.giveUp(in.err, m.task != 0 && m.stage >= stageVote)
	case closeCalled:
		if m.life == running {
			m.life = closing
			if m.finishing && m.cfg.linger > 0 {
				m.lingerUntil = now.Add(m.cfg.linger)
			}
			m.cancel(ErrClosed)
			m.dropPrep(ErrClosed)
		}
	case commFailed:
		m.onCommFailed(in)
	case commsFormed:
		if m.done(in.task, formStage(in.dim)) {
			m.onFormed(now, in)
		} else if m.prepDone(in.task, stageFormFT) {
			m.onPrepFormed(now, in)
		}
	case switchAgreed:
		if m.done(in.task, stageSwitch) {
			m.onSwitchAgreed(now, in)
		} else if m.prepDone(in.task, stageSwitch) {
			m.onPrepAgreed(now, in)
		}
	case recordsGathered:
		if m.done(in.task, stageGather) {
			m.onGathered(now, in)
		}
	case lastCommitRead:
		if m.done(in.task, stageLastCommit) {
			m.onLastCommit(now, in)
		}
	case stateHealed:
		if m.done(in.task, stageHeal) {
			m.onHealed(now, in)
		}
	case groupKept:
		if m.done(in.task, stageFormGroup) {
			m.onGroupKept(now, in)
		}
	case stepAgreed:
		if m.done(in.task, stageAgree) {
			m.onStepAgreed(in)
		}
	case groupChecked:
		if m.done(in.task, stageCheckGroup) {
			m.onGroupChecked(now, in)
		}
	case voted:
		if m.done(in.task, stageVote) {
			m.onVoted(now, in)
		}
	case commitRecorded:
		if m.done(in.task, stageRecord) {
			m.onRecorded(now, in)
		}
	case outcomeShared:
		if m.done(in.task, stageOutcome) {
			m.onOutcome(now, in)
		}
	case withdrawn:
		if m.done(in.task, stageWithdraw) {
			m.onWithdrawn(now, in)
		}
	}
	if h, ok := in.(stateHealed); ok && m.done(h.task, stageFinalHeal) {
		m.onFinalHealed(now, h)
	}
	m.advance(now)
	if m.task != m.seenTask {
		m.seenTask, m.taskAt = m.task, now
		if m.task != 0 && formingStage(m.stage) {
			m.lookAt(now)
		}
	}
	if at := m.wakeAt(); !at.Equal(m.armed) && m.life != closed {
		m.armed = at
		m.do(armTimer{at: at})
	}
	return m.out
}

func (m *machine) do(a action) { m.out = append(m.out, a) }

func (m *machine) logf(warn bool, format string, args ...any) {
	m.do(logLine{warn: warn, msg: fmt.Sprintf(format, args...)})
}

// start begins a task and returns its id.
func (m *machine) start(s stage) int {
	m.lastTask++
	m.task, m.stage, m.cancelled = m.lastTask, s, nil
	return m.task
}

// done reports whether a result is that of the task in flight (its id
// and kind), and ends it.
func (m *machine) done(task int, s stage) bool {
	if task != m.task || task == 0 || s != m.stage {
		return false
	}
	m.task, m.stage = 0, stageNone
	return true
}

// cancel cancels the task in flight, if any.
func (m *machine) cancel(cause error) {
	if m.task != 0 && m.cancelled == nil {
		m.cancelled = cause
		m.do(cancelTask{task: m.task, cause: cause})
	}
}

// giveUp handles the training loop's ctx ending in Step (reconfiguring) or
// Commit (voting): the task is cancelled, and the call returns once it
// ended.
func (m *machine) giveUp(err error, running bool) {
	if m.phase != phaseStepping && m.phase != phaseCommitting {
		return
	}
	m.gaveUp = err
	if running {
		m.cancel(err)
		return
	}
	m.replyGaveUp()
}

func (m *machine) replyGaveUp() {
	err := m.gaveUp
	m.gaveUp = nil
	switch m.phase {
	case phaseStepping:
		m.phase = phaseIdle
		m.do(stepDone{err: fmt.Errorf("ft: step: %w", err)})
	case phaseCommitting:
		m.phase = phaseIdle
		m.do(commitDone{err: fmt.Errorf("ft: commit: %w", err)})
	}
}

func (m *machine) noteFailure(now time.Time) {
	if m.failedAt.IsZero() {
		m.failedAt = now
	}
}

// holds reports whether this rank holds dim's comms of the current epoch.
func (m *machine) holds(d dim) bool {
	if d == dimGroup {
		return m.group != 0 && m.groupFor == m.epoch
	}
	return m.held.epoch != 0 && m.held.epoch == m.epoch && m.held.ftRank >= 0
}

// commsEpoch is the epoch whose comms of dim this rank uses now: the
// current epoch's FT comms, and the group comms of the epoch they were
// formed in (kept since).
func (m *machine) commsEpoch(d dim) uint64 {
	if d == dimGroup {
		return m.group
	}
	return m.epoch
}

// revoke revokes parts of dim's current comms (once each).
func (m *machine) revoke(d dim, p part, cause string) {
	if !m.holds(d) {
		return
	}
	if !m.split[d] {
		p = partBoth
	}
	if p &^= m.revokedParts[d]; p == 0 {
		return
	}
	m.revokedParts[d] |= p
	m.comms = commsBroken
	m.do(revokeComms{dim: d, epoch: m.commsEpoch(d), part: p, cause: cause})
}

// advance decides what to do next when no task is in flight.
func (m *machine) advance(now time.Time) {
	if m.task != 0 {
		return
	}
	if m.cancelled != nil {
		m.cancelled = nil
	}
	if m.life != running {
		if m.lingering(now) || m.prep != nil {
			return // a preparation in flight may hold comms: its answer closes them
		}
		m.finishClose()
		return
	}
	if m.gaveUp != nil {
		m.replyGaveUp()
	}
	if m.phase != phaseStepping {
		return
	}
	switch {
	case m.fatal != nil:
		m.phase = phaseIdle
		m.do(stepDone{err: m.fatal})
		return
	case m.lost != nil:
		m.phase = phaseIdle
		m.do(stepDone{err: m.lost})
		return
	case m.final > 0 && m.step < m.final && !m.finalHealTried && m.latest != nil && len(m.latest.FinalFrom) > 0:
		// A replica finished the run ahead of this one: take the final
		// state from those that hold it, then stop with it.
		m.finalHealTried = true
		m.closeHeld()
		m.agreed = agreement{Step: m.final, Sources: m.latest.FinalFrom}
		m.logf(false, "the run finished at step %d; healing from step %d to it before stopping", m.final, m.step)
		m.do(fetchState{task: m.start(stageFinalHeal), epoch: m.latest.Epoch, agreement: m.agreed})
		return
	case m.final > 0:
		// A replica finished the run: nobody takes another step.
		m.phase = phaseIdle
		m.do(stepDone{err: &FinishedError{Final: m.final, Step: m.step}})
		return
	case m.comms == commsReady && m.latest != nil && (m.latest.Epoch == m.epoch || m.stepsBeside() || m.gated && m.gateGo):
		// (A group that agreed to start the step in its epoch does, even
		// if a prepared epoch's answer came meanwhile: it moves next Step.)
		if m.gate(true) {
			return
		}
		if !m.gates() || m.gateGo {
			m.startStep(now)
			return
		}
		// A rank of the group knows a newer epoch, or cannot start the
		// step: the group waits for that epoch together.
	}
	if m.gate(false) {
		return // about to wait or reconfigure: the group's ranks hear so first
	}
	q := m.latest
	if q == nil || q.Epoch <= m.epoch {
		return // wait for a newer quorum
	}
	v, err := deriveView(q.Epoch, participantsOf(*q), m.cfg.group, m.cfg.groupRank, m.cfg.groupSize)
	if err != nil {
		m.logf(true, "malformed quorum: %v", err)
	}
	if err != nil || !v.complete || !v.includes(m.cfg.id, m.inc) {
		m.sitOut(*q)
		return
	}
	m.reconfigure(now, *q, v)
}

func (m *machine) emit(e Event) {
	if e.Step == 0 {
		e.Step = m.step
	}
	e.Rank = -1
	if m.holds(dimFT) {
		e.Rank = m.view.ftRank
		if e.Participants == 0 {
			e.Participants = len(m.view.ft)
		}
	}
	m.do(emit{ev: e})
}

// status is what the machine tells readers on other goroutines.
func (m *machine) status() (epoch uint64, rank, participants int) {
	if !m.holds(dimFT) {
		return m.epoch, -1, 0
	}
	return m.epoch, m.view.ftRank, len(m.view.ft)
}
