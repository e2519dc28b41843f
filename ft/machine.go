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

// This file is the step protocol of one rank as a state machine with no
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

// ---- inputs ----

type input interface{ isInput() }

type (
	// quorumSeen: the membership published q.
	quorumSeen struct{ q membership.Quorum }
	// revocationSeen: epoch r.Epoch was revoked.
	revocationSeen struct{ r membership.Revocation }
	// reregistered: the registration ended and this rank registered again
	// as incarnation inc.
	reregistered struct{ inc int64 }
	// membershipLost: the registration ended for good.
	membershipLost struct{ err error }
	// stepCalled: the training loop called Step; state is what it
	// registered (Comm.Register), for the driver to serve and heal.
	stepCalled struct{ state []registered }
	// stepCancelled: the training loop's Step ctx ended before the step started.
	stepCancelled struct{ err error }
	// commitCalled: the training loop called Commit; errs are its step's
	// collectives' errors, silent the FT ranks its backend hears nothing
	// from (comm.SilenceReporter).
	commitCalled struct {
		errs   []error
		silent []int
	}
	// finishCalled: the training loop called Finish (between Commit and
	// Step).
	finishCalled struct{}
	// stepFailed: the training loop failed its step (Comm.FailStep); err
	// wraps ErrStepFailed with its reason.
	stepFailed struct{ err error }
	// tick: the time the machine asked for (armTimer) came. pending is
	// when the oldest op of the epoch's comms still running was issued
	// (zero: none), silent the FT ranks its backend hears nothing from.
	tick struct {
		pending time.Time
		silent  []int
	}
	// commitCancelled: the training loop's Commit ctx ended.
	commitCancelled struct{ err error }
	// closeCalled: Close was called.
	closeCalled struct{}
	// commsFormed: task formed dim's comms for epoch (err nil), or failed.
	// split says whether data and control are separate comms; failed
	// which one failed.
	commsFormed struct {
		task   int
		dim    dim
		epoch  uint64
		split  bool
		failed part
		err    error
	}
	// commFailed: a comm this rank holds stopped accepting ops
	// (Comm.Broken); silent are the FT ranks its backend hears nothing
	// from.
	commFailed struct {
		dim    dim
		epoch  uint64
		part   part
		err    error
		silent []int
	}
	// recordsGathered: the epoch's step records, in FT rank order.
	recordsGathered struct {
		task int
		recs []stepRecord
		err  error
	}
	// lastCommitRead: with DurableCommit, the job's newest commit record.
	lastCommitRead struct {
		task int
		rec  membership.CommitRecord
		ok   bool
		err  error
	}
	// stateHealed: the state of the agreed step arrived; hist is the
	// sources' history.
	stateHealed struct {
		task  int
		hist  history
		bytes int64
		took  time.Duration
		err   error
	}
	// groupKept: the replica group's ranks agreed (ok) to keep the group
	// comms they hold into the new epoch, or not (ok false, or err: the
	// vote failed), in which case they form new ones.
	groupKept struct {
		task int
		ok   bool
		err  error
	}
	// stepAgreed: the replica group's ranks told each other, at Step,
	// the newest epoch each knows (known: the highest), whether each
	// could start the step in its current epoch (ready: all could), and
	// whether they stand in one epoch (same); err: the exchange failed.
	stepAgreed struct {
		task        int
		known       uint64
		ready, same bool
		err         error
	}
	// groupChecked: the lowest and highest committed step in the group.
	groupChecked struct {
		task   int
		lo, hi int64
		err    error
		// With peer snapshots: what the group restored (nil: nothing),
		// or why it could not (a *SnapshotLostError).
		restored *restored
		lost     error
	}
	// switchAgreed: the ranks of a prepared epoch agreed to move to it
	// once they committed step at (and not before).
	switchAgreed struct {
		task int
		at   int64
		err  error
	}
	// voted: the group's vote (every rank yes).
	voted struct {
		task int
		yes  bool
		err  error
	}
	// commitRecorded: with DurableCommit, whether this epoch owns the step.
	commitRecorded struct {
		task   int
		ok     bool
		reason string
	}
	// outcomeShared: with DurableCommit in a replica group, the group's
	// leader (group rank 0) told its ranks whether it recorded the commit
	// (ok); err: the message failed.
	outcomeShared struct {
		task int
		ok   bool
		err  error
	}
	// withdrawn: the recovery server stopped serving the step's state.
	withdrawn struct {
		task int
		err  error
	}
)

func (quorumSeen) isInput()      {}
func (revocationSeen) isInput()  {}
func (reregistered) isInput()    {}
func (membershipLost) isInput()  {}
func (stepCalled) isInput()      {}
func (stepCancelled) isInput()   {}
func (commitCalled) isInput()    {}
func (commitCancelled) isInput() {}
func (closeCalled) isInput()     {}
func (finishCalled) isInput()    {}
func (stepFailed) isInput()      {}
func (tick) isInput()            {}
func (commsFormed) isInput()     {}
func (commFailed) isInput()      {}
func (recordsGathered) isInput() {}
func (lastCommitRead) isInput()  {}
func (stateHealed) isInput()     {}
func (groupKept) isInput()       {}
func (stepAgreed) isInput()      {}
func (groupChecked) isInput()    {}
func (voted) isInput()           {}
func (switchAgreed) isInput()    {}
func (commitRecorded) isInput()  {}
func (outcomeShared) isInput()   {}
func (withdrawn) isInput()       {}

// ---- actions ----

type action interface{ isAction() }

type (
	// formComms forms dim's comms for epoch: shrinks or grows those of
	// epoch from, or makes new ones (from 0).
	formComms struct {
		task       int
		dim        dim
		epoch      uint64
		how        reconfig
		exclude    []int
		from       uint64
		rank, size int
		background bool // a prepared grow's survivor forms them beside its steps
	}
	// agreeSwitch: the ranks of prepared epoch agree, over its new FT
	// control comm, on the step after which they move to it (switchAgreed
	// answers). step is this rank's committed step, slowest its slowest
	// recent step (0: not known).
	agreeSwitch struct {
		task               int
		epoch              uint64
		step               int64
		slowest            time.Duration
		survivors, joiners int // the epoch's FT ranks that continue from its Base, and that join
	}
	// keepGroup asks the replica group's ranks, on the group control comm
	// of epoch, whether every one of them keeps the group comms it holds
	// (formed in epoch, healthy) into epoch into (groupKept answers).
	keepGroup struct {
		task        int
		epoch, into uint64
	}
	// agreeStep tells the replica group's ranks, over the group control
	// comm of epoch, the newest epoch this rank knows and whether it could
	// start the step in its current epoch now (stepAgreed answers).
	agreeStep struct {
		task  int
		epoch uint64
		known uint64
		now   uint64 // this rank's current epoch
		ready bool
	}
	closeComms struct {
		dim   dim
		epoch uint64
	}
	revokeComms struct {
		dim   dim
		epoch uint64
		part  part
		cause string
	}
	cancelTask struct {
		task  int
		cause error
	}
	gatherRecords struct {
		task  int
		epoch uint64
		step  int64
		last  uint64 // the epoch that committed step
	}
	readLastCommit struct{ task int }
	fetchState     struct {
		task  int
		epoch uint64
		agreement
	}
	checkGroup struct {
		task  int
		epoch uint64
		step  int64
	}
	castVote struct {
		task  int
		epoch uint64
		yes   bool
	}
	recordCommit struct {
		task  int
		step  int64
		epoch uint64
	}
	// shareOutcome: the group's leader (root) tells its ranks whether it
	// recorded the commit (ok); the others receive it. One broadcast on
	// the group's control comm of epoch.
	shareOutcome struct {
		task  int
		epoch uint64
		root  bool
		ok    bool
	}
	withdrawState struct{ task int }
	offerState    struct {
		step int64
		hist history
	}
	// Reports to the coordinator, carried out in order, best effort.
	reportFormed  struct{ epoch uint64 }
	reportFailure struct {
		epoch  uint64
		blamed []string
	}
	revokeEpoch struct {
		epoch  uint64
		reason string
		blamed []string
	}
	reportHeartbeat struct{}
	// reportWaiting: the rank waits for a holder of the job's committed
	// step (the coordinator shows it); step 0: it does not any more.
	reportWaiting struct {
		step   int64
		reason string
	}
	forgetRendezvous struct {
		dim   dim
		epoch uint64
	}
	setStep struct{ step int64 }
	emit    struct{ ev Event }
	observe struct {
		what  metric
		value float64
		label string
	}
	logLine struct {
		warn bool
		msg  string
	}
	stepDone   struct{ err error }
	commitDone struct {
		ok  bool
		err error
	}
	// stopped: Close is done with the comms; the driver's loop ends.
	stopped struct{}
	// armTimer: feed a tick at (zero: no tick wanted).
	armTimer struct{ at time.Time }
	// reportStall: tell the coordinator the step stalled
	// (membership.MemberRecord.Stall).
	reportStall struct{ s membership.StepStall }
	// reportFinish: tell the coordinator this rank finished the run at
	// step (it holds the final state and serves it until Close).
	reportFinish struct{ step int64 }
	// finishDone answers Finish.
	finishDone struct{ err error }
	// failStepDone answers FailStep.
	failStepDone struct{ err error }
	// applySettings: the job's settings ref are in force from step from
	// (the epoch's first step).
	applySettings struct {
		ref   *membership.SettingsRef
		epoch uint64
		from  int64
	}
)

func (formComms) isAction()        {}
func (agreeSwitch) isAction()      {}
func (keepGroup) isAction()        {}
func (agreeStep) isAction()        {}
func (closeComms) isAction()       {}
func (revokeComms) isAction()      {}
func (cancelTask) isAction()       {}
func (gatherRecords) isAction()    {}
func (readLastCommit) isAction()   {}
func (fetchState) isAction()       {}
func (checkGroup) isAction()       {}
func (castVote) isAction()         {}
func (recordCommit) isAction()     {}
func (shareOutcome) isAction()     {}
func (withdrawState) isAction()    {}
func (offerState) isAction()       {}
func (reportFormed) isAction()     {}
func (reportFailure) isAction()    {}
func (revokeEpoch) isAction()      {}
func (reportHeartbeat) isAction()  {}
func (reportWaiting) isAction()    {}
func (forgetRendezvous) isAction() {}
func (setStep) isAction()          {}
func (emit) isAction()             {}
func (observe) isAction()          {}
func (logLine) isAction()          {}
func (stepDone) isAction()         {}
func (commitDone) isAction()       {}
func (stopped) isAction()          {}
func (armTimer) isAction()         {}
func (reportStall) isAction()      {}
func (reportFinish) isAction()     {}
func (finishDone) isAction()       {}
func (failStepDone) isAction()     {}
func (applySettings) isAction()    {}

// metric names what an observe action measures.
type metric uint8

const (
	metricEpochSeen       metric = iota // newest epoch seen
	metricDetect                        // first failure → the resolving epoch known (s)
	metricReconfig                      // reconfiguration took (s); label how
	metricReconfigs                     // one reconfiguration; label how
	metricCommit                        // one vote; label ok or failed
	metricFailureToCommit               // first failure → next commit (s)
	metricStepSeconds                   // Step → successful Commit (s)
	metricRollback                      // steps rolled back (value)
)

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

func (m *machine) onQuorum(now time.Time, q membership.Quorum) {
	if m.latest != nil && q.Epoch <= m.latest.Epoch {
		return
	}
	m.latest = &q
	m.final = max(m.final, q.Final)
	m.do(observe{what: metricEpochSeen, value: float64(q.Epoch)})
	if m.prep != nil {
		m.dropPrep(fmt.Errorf("ft: epoch %d superseded by %d", m.prep.epoch, q.Epoch))
	}
	if m.task != 0 && m.stage.reconfiguring() && q.Epoch > m.target.Epoch && !m.growsFormed(q) {
		m.cancel(fmt.Errorf("ft: epoch %d superseded by %d", m.target.Epoch, q.Epoch))
	}
	if q.Epoch <= m.epoch {
		return
	}
	// A member of the current comms is gone: revoke them at once, so no
	// survivor waits out a collective timeout for it. One that departed
	// (left or finished after its last step) is not waited for by any op
	// still running, and an op that needed it ends by its connection.
	gone := func(members []participant) bool {
		return slices.ContainsFunc(members, func(p participant) bool {
			return p.ID != "" && !q.Includes(p.ID, p.Incarnation) && !slices.Contains(q.Departed, p.ID)
		})
	}
	cause := fmt.Sprintf("ft: epoch %d: %s", q.Epoch, q.Reason)
	if m.holds(dimFT) && gone(m.view.ft) {
		m.revoke(dimFT, partBoth, cause)
	}
	if m.holds(dimGroup) && gone(m.view.group) {
		m.revoke(dimGroup, partBoth, cause)
	}
	if m.prepare(now, q) {
		return // the step in flight goes on: its peers step on too
	}
	// A new epoch in the middle of a step: FT peers that had not started
	// it move on and never post their part of its ops. gloo sees that as a
	// mismatch, but a device comm waits for them until the op's Timeout,
	// so the step's device ops stop now. Only the FT data comm: the
	// control comms keep the replica group's vote whole (a vote cut at one
	// rank but not the other would split the group's commit), and the
	// group's ranks started this step together (the gate), so a group-mate
	// still here posts its part of the group's ops (one that is gone
	// revoked the group's comms above).
	if m.phase == phaseInStep && m.split[dimFT] {
		m.revoke(dimFT, partData, fmt.Sprintf("ft: epoch %d began mid-step: the old epoch's device ops may wait for peers that moved on", q.Epoch))
	}
}

func (m *machine) onRevocation(r membership.Revocation) {
	if r.Epoch != m.epoch || r.Epoch <= m.revoked || !m.holds(dimFT) {
		return
	}
	m.revoked = r.Epoch
	m.revoke(dimFT, partBoth, fmt.Sprintf("ft: epoch %d revoked by %s: %s", r.Epoch, r.By, r.Reason))
}

// onCommFailed acts on a comm that stopped: the step's comms that could
// wait for the failed peer stop at once, and the peer the failure names is
// blamed, so the coordinator can confirm the death without waiting for
// gossip or its lease. A failed control comm fails the step; a peer that
// merely closed its comm after the ops that needed it fails nothing.
func (m *machine) onCommFailed(in commFailed) {
	if m.prep != nil && in.dim == dimFT && in.epoch == m.prep.epoch {
		m.prepBroken(in)
		return
	}
	if m.life != running || in.epoch != m.commsEpoch(in.dim) || !m.holds(in.dim) {
		return
	}
	m.comms = commsBroken
	orderly := errors.Is(in.err, comm.ErrPeerClosed)
	if m.phase == phaseInStep && !orderly && m.split[in.dim] {
		// The step's own ops report their errors through Commit; a comm
		// that broke after they completed does not undo them (revoking
		// the epoch is the coordinator's policy, not a failure of the
		// step). But a control comm that failed (not revoked) leaves the
		// step's vote nothing to stand on, and the loop's own ops on the
		// group's data comm (Group()) are not tracked: either fails the
		// step.
		err := fmt.Errorf("ft: %s %s comm: %w", in.dim, in.part, in.err)
		switch {
		case in.dim == dimFT && in.part == partCtl && !errors.Is(in.err, comm.ErrRevoked):
			m.stepErrs = append(m.stepErrs, err)
		case in.dim == dimGroup && in.part == partData:
			m.groupErrs = append(m.groupErrs, err)
		}
	}
	if m.split[in.dim] && in.part == partCtl {
		// The data comm's ops would wait for the failed peer (NCCL sees
		// no failure of its own). The group's control comm is never
		// stopped: it carries the group's vote.
		m.revoke(in.dim, partData, fmt.Sprintf("ft: the %s control comm failed: %v", in.dim, in.err))
	}
	if orderly {
		return
	}
	// Peers it hears nothing from at all are blamed too: when one rank's
	// op fails on a cut link, the others' ops end by the revocation and
	// name no one, and the coordinator would see the cut from one side.
	silent := m.blameSilent(in.silent)
	if ids := m.newlyBlamed(in.dim, []error{in.err}); len(ids) > 0 {
		m.do(revokeEpoch{epoch: m.epoch, reason: fmt.Sprintf("%s %s comm failed: %v", in.dim, in.part, in.err), blamed: append(ids, silent...)})
	} else if m.phase != phaseInStep && (!errors.Is(in.err, comm.ErrRevoked) || len(silent) > 0) {
		// Broken between steps: make sure the next step gets a new
		// epoch, and say whom this rank cannot hear.
		m.do(reportFailure{epoch: m.epoch, blamed: m.blamed})
	}
}

// newlyBlamed maps the ranks named by errs' peer failures in dim's comms
// to member ids this rank has not blamed in the epoch yet.
func (m *machine) newlyBlamed(d dim, errs []error) []string {
	members := m.view.ft
	if d == dimGroup {
		members = m.view.group
	}
	var ids []string
	for _, err := range errs {
		if !errors.Is(err, comm.ErrPeerFailed) || errors.Is(err, comm.ErrPeerClosed) {
			continue
		}
		for _, r := range comm.FailedRanks(err) {
			if r < 0 || r >= len(members) || members[r].ID == "" || members[r].ID == m.cfg.id {
				continue
			}
			if id := members[r].ID; !slices.Contains(m.blamed, id) {
				m.blamed = append(m.blamed, id)
				ids = append(ids, id)
			}
		}
	}
	return ids
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
	m.target, m.tview, m.reconfAt, m.rollback = q, v, now, nil
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
		m.rollback = &RollbackError{FromStep: lostFrom, ToStep: lostTo, Step: m.agreed.Step, Epoch: epoch}
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
		m.rollback = &RollbackError{FromStep: r.step + 1, ToStep: from, Step: r.step, Snapshot: true}
	}
	m.reconfigured(now)
}

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

// onFinish: the training loop ended the run at its committed step. This
// rank serves that state from now until Close, which waits (Config.
// Timeout at most) until no replica behind the final step is left to
// heal from it.
func (m *machine) onFinish(now time.Time) {
	if m.phase != phaseIdle || m.task != 0 {
		m.do(finishDone{err: fmt.Errorf("%w: ft: Finish between Commit and Step only", comm.ErrInvalidArgument)})
		return
	}
	m.finishing = true
	m.closeHeld()
	m.do(offerState{step: m.step, hist: m.hist})
	m.do(finishDone{})
}

// lingering reports whether Close still waits, after Finish, for replicas
// behind the final step: the latest quorum of the finished run still has
// participants (those that did not finish), and the wait's bound has not
// passed.
func (m *machine) lingering(now time.Time) bool {
	if !m.finishing || m.lingerUntil.IsZero() || !now.Before(m.lingerUntil) {
		return false
	}
	q := m.latest
	return q == nil || q.Final == 0 || len(q.Participants) > 0
}

// onFinalHealed: the final state arrived (or not); the run is over either
// way. A rank that holds the final state says so, and serves it too.
func (m *machine) onFinalHealed(now time.Time, in stateHealed) {
	if in.err != nil {
		m.logf(true, "could not heal to the run's final step %d (staying at %d): %v", m.final, m.step, in.err)
		return
	}
	from := m.step
	m.hist, m.step = in.hist, m.final
	m.do(setStep{step: m.step})
	m.emit(Event{Kind: EventHealed, Epoch: m.epoch, FromStep: from, Bytes: in.bytes, Took: in.took})
	m.finishing = true
	m.do(offerState{step: m.step, hist: m.hist})
	m.do(reportFinish{step: m.step})
}

// finishClose closes every comm once no task runs, and answers the
// training loop.
func (m *machine) finishClose() {
	m.closeHeld()
	switch m.phase {
	case phaseStepping:
		m.do(stepDone{err: ErrClosed})
	case phaseCommitting:
		m.do(commitDone{err: ErrClosed})
	}
	m.phase, m.life = phaseIdle, closed
	m.do(stopped{})
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

// errHolderAbsent: with DurableCommit, the job's newest committed step is
// held by no participant of this epoch; the rank waits for a quorum that
// brings one back.
var errHolderAbsent = errors.New("ft: the job's committed step is held by no participant")

// describe renders an action for script tests and logs.
func describe(a action) string {
	switch a := a.(type) {
	case formComms:
		s := fmt.Sprintf("form %s e%d %s rank=%d size=%d", a.dim, a.epoch, a.how, a.rank, a.size)
		if a.background {
			s += " in the background"
		}
		if !a.how.fresh() {
			s += fmt.Sprintf(" from=e%d", a.from)
		}
		if len(a.exclude) > 0 {
			s += fmt.Sprintf(" exclude=%v", a.exclude)
		}
		return s
	case closeComms:
		return fmt.Sprintf("close %s e%d", a.dim, a.epoch)
	case revokeComms:
		return fmt.Sprintf("revoke %s e%d %s: %s", a.dim, a.epoch, a.part, a.cause)
	case cancelTask:
		return fmt.Sprintf("cancel: %v", a.cause)
	case gatherRecords:
		return fmt.Sprintf("gather e%d step=%d last=e%d", a.epoch, a.step, a.last)
	case readLastCommit:
		return "read last commit"
	case fetchState:
		return fmt.Sprintf("heal e%d to step %d (e%d) from %s", a.epoch, a.Step, a.Epoch, strings.Join(a.Sources, ","))
	case keepGroup:
		return fmt.Sprintf("keep group e%d into e%d", a.epoch, a.into)
	case agreeStep:
		return fmt.Sprintf("agree group e%d known=e%d now=e%d ready=%v", a.epoch, a.known, a.now, a.ready)
	case agreeSwitch:
		return fmt.Sprintf("agree switch e%d step=%d slowest=%v survivors=%d joiners=%d", a.epoch, a.step, a.slowest, a.survivors, a.joiners)
	case checkGroup:
		return fmt.Sprintf("check group e%d step=%d", a.epoch, a.step)
	case castVote:
		return fmt.Sprintf("vote e%d yes=%v", a.epoch, a.yes)
	case recordCommit:
		return fmt.Sprintf("record step %d e%d", a.step, a.epoch)
	case shareOutcome:
		if a.root {
			return fmt.Sprintf("tell group e%d recorded=%v", a.epoch, a.ok)
		}
		return fmt.Sprintf("hear group e%d", a.epoch)
	case withdrawState:
		return "withdraw"
	case offerState:
		return fmt.Sprintf("offer step %d", a.step)
	case reportFormed:
		return fmt.Sprintf("report formed e%d", a.epoch)
	case reportFailure:
		s := fmt.Sprintf("report failure e%d", a.epoch)
		if len(a.blamed) > 0 {
			s += " blame " + strings.Join(a.blamed, ",")
		}
		return s
	case revokeEpoch:
		return fmt.Sprintf("revoke epoch e%d blame %s", a.epoch, strings.Join(a.blamed, ","))
	case reportHeartbeat:
		return "heartbeat"
	case reportWaiting:
		if a.step == 0 {
			return "report not waiting"
		}
		return fmt.Sprintf("report waiting for step %d", a.step)
	case forgetRendezvous:
		return fmt.Sprintf("forget %s e%d", a.dim, a.epoch)
	case setStep:
		return fmt.Sprintf("step %d", a.step)
	case emit:
		return "event " + a.ev.String()
	case observe:
		return "" // metrics are not part of the protocol's script
	case logLine:
		return ""
	case stepDone:
		if a.err == nil {
			return "step started"
		}
		return fmt.Sprintf("step returns: %v", a.err)
	case commitDone:
		if a.err != nil {
			return fmt.Sprintf("commit returns %v: %v", a.ok, a.err)
		}
		return fmt.Sprintf("commit returns %v", a.ok)
	case stopped:
		return "stopped"
	case armTimer:
		if a.at.IsZero() {
			return "timer off"
		}
		return fmt.Sprintf("timer at %s", a.at.UTC().Format("15:04:05.000"))
	case reportStall:
		return "report stall: " + a.s.String()
	case reportFinish:
		return fmt.Sprintf("report finished at step %d", a.step)
	case finishDone:
		if a.err != nil {
			return fmt.Sprintf("finish returns: %v", a.err)
		}
		return "finish returns"
	case failStepDone:
		if a.err != nil {
			return fmt.Sprintf("fail-step returns: %v", a.err)
		}
		return "fail-step returns"
	case applySettings:
		return fmt.Sprintf("settings v%d from step %d (e%d)", a.ref.Version, a.from, a.epoch)
	}
	return fmt.Sprintf("%T", a)
}
