package ft

import (
	"errors"
	"fmt"
	"time"
)

// EventKind says what happened to a replica.
type EventKind int

// The events a Comm reports through Config.OnEvent.
const (
	// EventReconfigured: the replica moved to a new epoch (How says
	// whether its comms were shrunk, grown or made anew).
	EventReconfigured EventKind = iota + 1
	// EventSatOut: the replica is left out of an epoch (its replica group
	// is incomplete, or it was not admitted); its collectives fail with
	// ErrNotParticipating until a later epoch takes it back.
	EventSatOut
	// EventHealed: the replica received the committed state of Step from
	// its peers (FromStep was its own).
	EventHealed
	// EventRolledBack: steps FromStep..ToStep that this replica committed
	// are not part of the job's history (another epoch committed those
	// steps again, with other contents); its state is now the job's
	// committed state of Step. Step also returns a *RollbackError.
	EventRolledBack
	// EventCommitFailed: a step did not commit (Reason says why).
	EventCommitFailed
	// EventWaiting: with DurableCommit, the job's newest committed step
	// is held by no participant of this epoch; Step waits for a quorum
	// that brings one of its holders back (Reason says which step).
	EventWaiting
	// EventSettings: the job's settings changed (`ftcoord job set`):
	// version Version is in force from step FromStep, the first step of
	// Epoch, at every participant of the epoch alike. Comm.Settings has
	// the values.
	EventSettings
	// EventPromoted: this spare (Config.Spare) was promoted into Epoch:
	// the job ran below its target. Reason says where it lands (its rank
	// in the FT comm, of how many) and whose place it takes; the replica
	// then reconfigures and heals like a joiner.
	EventPromoted
	// EventRestored: the replica group restored its peer snapshot of Step
	// (Config.SnapshotEvery): this rank held FromStep; Bytes came from
	// its buddy (0: from its own copy). A rank whose FromStep was newer
	// also reports EventRolledBack.
	EventRestored
)

func (k EventKind) String() string {
	switch k {
	case EventReconfigured:
		return "reconfigured"
	case EventSatOut:
		return "sat out"
	case EventHealed:
		return "healed"
	case EventRolledBack:
		return "rolled back"
	case EventCommitFailed:
		return "commit failed"
	case EventWaiting:
		return "waiting"
	case EventSettings:
		return "settings"
	case EventPromoted:
		return "promoted"
	case EventRestored:
		return "restored"
	}
	return fmt.Sprintf("event(%d)", int(k))
}

// Event is one thing that happened to a replica, for the training loop
// (progress displays, data-loader rewinds) and tools.
type Event struct {
	Kind         EventKind
	Time         time.Time
	Epoch        uint64
	Step         int64 // committed step after the event
	Participants int   // replica groups of the epoch (0 while sitting out)
	Rank         int   // this replica's rank in the FT comm after the event (-1: none)
	How          string
	FromStep     int64
	ToStep       int64
	Bytes        int64         // healed: bytes received
	Took         time.Duration // reconfigured, healed: how long it took
	Reason       string
	Version      uint64 // settings: the settings version in force from FromStep
}

func (e Event) String() string {
	switch e.Kind {
	case EventReconfigured:
		return fmt.Sprintf("epoch %d: %s to %d participants in %v", e.Epoch, e.How, e.Participants, e.Took.Round(time.Millisecond))
	case EventHealed:
		return fmt.Sprintf("epoch %d: healed %d → %d (%d bytes in %v)", e.Epoch, e.FromStep, e.Step, e.Bytes, e.Took.Round(time.Millisecond))
	case EventRolledBack:
		return fmt.Sprintf("epoch %d: rolled back steps %d..%d, now at %d", e.Epoch, e.FromStep, e.ToStep, e.Step)
	case EventSettings:
		return fmt.Sprintf("epoch %d: settings version %d from step %d", e.Epoch, e.Version, e.FromStep)
	case EventRestored:
		return fmt.Sprintf("epoch %d: restored the peer snapshot of step %d (held %d; %d bytes from its buddy in %v)",
			e.Epoch, e.Step, e.FromStep, e.Bytes, e.Took.Round(time.Millisecond))
	}
	s := fmt.Sprintf("epoch %d: %s", e.Epoch, e.Kind)
	if e.Reason != "" {
		s += ": " + e.Reason
	}
	return s
}

// ErrRolledBack is wrapped by *RollbackError.
var ErrRolledBack = errors.New("ft: committed steps rolled back")

// RollbackError is what Step returns when this replica's own committed
// steps FromStep..ToStep turned out not to be part of the job's history (a
// collective completed here and failed elsewhere, and a newer epoch
// committed those steps again). The replica has already healed to the
// job's committed state of Step and the step has started, exactly as
// after a nil return: the training loop should rewind what it keeps
// outside the registered state (its data position, say) to Step, then
// carry on with the collectives and Commit.
type RollbackError struct {
	FromStep, ToStep int64
	Step             int64 // the job's committed step this replica healed to
	// Epoch is the epoch that committed step FromStep in the job's
	// history (0 when the job's history no longer says).
	Epoch uint64
	// Snapshot: the replica group restored its peer snapshot of Step
	// (Config.SnapshotEvery) after one of its ranks was replaced; the
	// steps after it are lost to every rank of the group alike.
	Snapshot bool
}

func (e *RollbackError) Error() string {
	if e.Snapshot {
		return fmt.Sprintf("ft: committed steps %d..%d rolled back: the replica group restored its peer snapshot of step %d after a rank was replaced",
			e.FromStep, e.ToStep, e.Step)
	}
	if e.Epoch == 0 {
		return fmt.Sprintf("ft: committed steps %d..%d rolled back: the job's history has other contents for them; state healed to step %d",
			e.FromStep, e.ToStep, e.Step)
	}
	return fmt.Sprintf("ft: committed steps %d..%d rolled back: the job's history has them from epoch %d; state healed to step %d",
		e.FromStep, e.ToStep, e.Epoch, e.Step)
}

func (e *RollbackError) Unwrap() error { return ErrRolledBack }

// ErrGroupDiverged is matched by a *GroupDivergedError.
var ErrGroupDiverged = errors.New("ft: the replica group's shards stand at different steps")

// GroupDivergedError is returned by Step when the ranks of this replica
// group continue from different committed steps and healing cannot bring
// them together: the group's vote on a step completed at some of its ranks
// only, and no other replica group holds that step of the lagging shards.
// The job's state for those shards at Max is lost; restore the group from a
// checkpoint. Step keeps returning it (the Comm is not usable for training).
// See "Replica groups" in the package doc.
type GroupDivergedError struct {
	Group    string
	Step     int64 // this rank's committed step
	Min, Max int64 // the group's ranks' committed steps
}

func (e *GroupDivergedError) Error() string {
	return fmt.Sprintf("ft: replica group %s: its ranks stand at steps %d..%d (this rank %d) and no replica holds the lagging shards' step %d",
		e.Group, e.Min, e.Max, e.Step, e.Max)
}

func (e *GroupDivergedError) Unwrap() error { return ErrGroupDiverged }

// ErrFinished is matched by a *FinishedError.
var ErrFinished = errors.New("ft: the run has finished")

// FinishedError is what Step returns once a replica of the job called
// Finish: the run ended at step Final, and this replica, at Step, must not
// go on (its peers will never take another step, and a step it redid alone
// would not be the job's). The replicas that finished hold the run's final
// state; end the training loop and Close.
type FinishedError struct {
	Final int64 // the run's last step
	Step  int64 // this replica's committed step
}

func (e *FinishedError) Error() string {
	if e.Step == e.Final {
		return fmt.Sprintf("ft: the run finished at step %d", e.Final)
	}
	return fmt.Sprintf("ft: the run finished at step %d (a replica called Finish); this replica holds step %d", e.Final, e.Step)
}

func (e *FinishedError) Unwrap() error { return ErrFinished }

// ErrStaleRun is matched by a *StaleRunError.
var ErrStaleRun = errors.New("ft: the job's run recorded steps no replica holds")

// StaleRunError is what Step returns when the job's run reached step Step
// while no participant of this replica's epoch holds any committed state:
// every one starts from step 0, and going on would restart the run's
// history from step 0 under its name. In both modes alike: with
// DurableCommit the run's commit records say so (Epoch, By and At name
// the newest), by default the coordinator's quorums do
// (membership.Quorum.RunStep; Epoch 0 and By empty). Most likely a job
// was restarted against a coordinator that kept its data: start a new
// run (Config.Run set to a new id, or `ftcoord job new-run <job>`), or
// continue this one from a restored state (Config.InitialStep). Step
// keeps returning it.
type StaleRunError struct {
	Step  int64  // the run's newest step
	Epoch uint64 // the epoch that committed it (DurableCommit)
	By    string // the member that recorded it (DurableCommit)
	At    time.Time
}

func (e *StaleRunError) Error() string {
	where := "as the coordinator last saw it"
	if e.By != "" {
		where = fmt.Sprintf("epoch %d, recorded by %s at %s", e.Epoch, e.By, e.At.UTC().Format(time.RFC3339))
	}
	return fmt.Sprintf("ft: the job's run has committed steps up to %d (%s), and no participant of this epoch holds any step: "+
		"going on would restart the run's history from step 0 under its name. Choose: to start a new run of the job, "+
		"set ft.Config.Run to a new id or run `ftcoord job new-run <job>`; to continue this run, start the replicas from "+
		"a restored state (ft.Config.InitialStep: the step of the checkpoint they registered); if replicas that hold "+
		"step %d are coming back, start this one after them",
		e.Step, where, e.Step)
}

func (e *StaleRunError) Unwrap() error { return ErrStaleRun }
