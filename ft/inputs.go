package ft

import (
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// The step machine's inputs: what happened, each fed to machine.handle
// with the time. A task's result names its task (machine.done).

// input is one thing that happened, for the machine.
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
