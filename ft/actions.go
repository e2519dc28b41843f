package ft

import (
	"fmt"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// The step machine's actions: what handle decides, for the driver to
// carry out in order (exec.go), and describe, their text in script tests
// and logs. An action of a task names the task; its result comes back as
// an input.

// action is one thing the machine decided.
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
