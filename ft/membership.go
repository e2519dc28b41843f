package ft

import (
	"context"
	"errors"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// Membership is what ft.Comm needs of the membership service: one
// registered member's view of its job. *membership.Member provides it
// (through a thin adapter for Store); tests may provide another.
//
// ft also uses these methods of a Membership that has them, each
// optional: RequestQuorum (asked at the first Step), SetStepTime (the
// straggler policy's step times), Heartbeat, SetWaiting and ReportStall
// (reports to the coordinator), Settings (the job's settings), and
// RecordCommit with LastCommit, which Config.DurableCommit needs. Their
// signatures are *membership.Member's. Without one, ft does without what
// it is for.
type Membership interface {
	// ID and Incarnation identify this registration.
	ID() string
	Incarnation() int64
	// Quorum is the latest published quorum; Revocation an epoch's
	// revocation record. Changed is closed at the next change of either.
	Quorum() (membership.Quorum, bool)
	Revocation(epoch uint64) (membership.Revocation, bool)
	Changed() <-chan struct{}
	// Done is closed when the registration ends (left, evicted, lost);
	// Err says why.
	Done() <-chan struct{}
	Err() error
	// SetStep records the committed step; it reaches the coordinator with
	// the next heartbeat, not now.
	SetStep(step int64)
	// ReportCommitFailure tells the coordinator that epoch failed here,
	// blaming the members whose connections failed; the coordinator checks
	// those before it forms the next epoch.
	ReportCommitFailure(ctx context.Context, epoch uint64, blamed ...string) error
	// Revoke records that epoch must stop, blaming the members whose
	// connections failed; the coordinator removes a blamed member at once
	// when its address no longer accepts connections.
	Revoke(ctx context.Context, epoch uint64, reason string, failed ...string) error
	// SetHealth reports this member's health now; Critical takes it out
	// of the next quorum.
	SetHealth(ctx context.Context, h membership.Health, reason string) error
	// Finish records that this member's training loop ended the run at
	// step: the coordinator publishes the run's end (Quorum.Final).
	Finish(ctx context.Context, step int64) error
	// ReportFormed tells the coordinator now that this member holds what
	// epoch asked of it (its comms, or none when it sat out); the next
	// quorum's Base depends on it (membership.Quorum.Base).
	ReportFormed(ctx context.Context, epoch uint64) error
	// Store is the job's rendezvous store (shared by all epochs: a grow's
	// joiners and existing ranks must meet under the same keys).
	Store() comm.Store
	// Leave deregisters gracefully; Close releases what is left.
	Leave(ctx context.Context) error
	Close() error
}

// The optional capabilities of a Membership. Each is probed once, when a
// registration is bound (bindMember), and a Membership without it gets
// the fallback named here.

// quorumAsker is a membership whose registration takes part in quorums
// only once it asks: ft registers in New without asking, and asks at the
// first Step (Comm.askToTakePart). Without it (askedAlready) ft asks
// nothing: a Membership from Config asks as it was made to.
type quorumAsker interface {
	RequestQuorum(ctx context.Context, shrinkOnly bool) error
}

// stepTimer carries each step's compute time to the coordinator's
// straggler policy (Comm.stepTime). Without it (noStepTimes) the policy
// does not see this replica's steps.
type stepTimer interface{ SetStepTime(time.Duration) }

// heartbeater writes the member's record now rather than at its next
// heartbeat: a healed step reaches the coordinator at once. Without it
// (noReports) the step goes with the Membership's own reports.
type heartbeater interface{ Heartbeat(context.Context) error }

// waitReporter tells the coordinator that the member waits for a holder
// of the job's committed step, and why (DurableCommit's wait). Without
// it (noReports) the wait is only logged.
type waitReporter interface {
	SetWaiting(ctx context.Context, step int64, reason string) error
}

// stallReporter tells the coordinator at once of a step that stalled
// (stall.go). Without it (noReports) the stall is only logged.
type stallReporter interface {
	ReportStall(context.Context, membership.StepStall) error
}

// settingsSource holds the job settings documents an epoch names
// (Comm.Settings). Without it (noSettings) an epoch that names settings
// keeps the previous ones, with a warning.
type settingsSource interface {
	Settings(membership.SettingsRef) (membership.JobSettings, bool)
}

// durableCommitter is the job's per-step commit records, which
// Config.DurableCommit needs: New refuses DurableCommit without them, so
// their fallback (noCommitRecords) only fails.
type durableCommitter interface {
	RecordCommit(ctx context.Context, step int64, epoch uint64) (membership.CommitRecord, bool, error)
	LastCommit(ctx context.Context) (membership.CommitRecord, bool, error)
}

// What ft's own registration offers; memcoord's Member is checked in
// contract_test.go.
var (
	_ Membership       = (*etcdMember)(nil)
	_ quorumAsker      = (*membership.Member)(nil)
	_ stepTimer        = (*membership.Member)(nil)
	_ heartbeater      = (*membership.Member)(nil)
	_ waitReporter     = (*membership.Member)(nil)
	_ stallReporter    = (*membership.Member)(nil)
	_ settingsSource   = (*membership.Member)(nil)
	_ durableCommitter = (*membership.Member)(nil)
)

// member is a registration as ft uses it: the Membership, and each
// optional capability as the Membership's own or its fallback, chosen
// once in bindMember. ft calls the capabilities through it and never
// asks the Membership what it can do again.
type member struct {
	Membership
	asker    quorumAsker
	timer    stepTimer
	beat     heartbeater
	waits    waitReporter
	stalls   stallReporter
	settings settingsSource
	records  durableCommitter
	// keepsRecords: records is the Membership's own (DurableCommit may
	// be set).
	keepsRecords bool
	// etcd is ft's own registration through Config.Coordinator, which it
	// can make again when it ends (driver.registrationEnded); nil: not
	// one.
	etcd *etcdMember
}

// bindMember probes m's optional capabilities and chooses the fallback
// of each it lacks.
func bindMember(m Membership) *member {
	b := &member{Membership: m}
	b.asker, _ = capability[quorumAsker](m, askedAlready{})
	b.timer, _ = capability[stepTimer](m, noStepTimes{})
	b.beat, _ = capability[heartbeater](m, noReports{})
	b.waits, _ = capability[waitReporter](m, noReports{})
	b.stalls, _ = capability[stallReporter](m, noReports{})
	b.settings, _ = capability[settingsSource](m, noSettings{})
	b.records, b.keepsRecords = capability[durableCommitter](m, noCommitRecords{})
	b.etcd, _ = m.(*etcdMember)
	return b
}

// capability returns m as C, and true, when m has C; else fallback.
func capability[C any](m Membership, fallback C) (C, bool) {
	if c, ok := m.(C); ok {
		return c, true
	}
	return fallback, false
}

// The fallbacks of a Membership without a capability.
type (
	askedAlready    struct{} // quorumAsker: the Membership asks as it was made to
	noStepTimes     struct{} // stepTimer: no step times
	noReports       struct{} // heartbeater, waitReporter, stallReporter: nothing reported
	noSettings      struct{} // settingsSource: no settings held
	noCommitRecords struct{} // durableCommitter: fails (New refuses DurableCommit)
)

func (askedAlready) RequestQuorum(context.Context, bool) error            { return nil }
func (noStepTimes) SetStepTime(time.Duration)                             {}
func (noReports) Heartbeat(context.Context) error                         { return nil }
func (noReports) SetWaiting(context.Context, int64, string) error         { return nil }
func (noReports) ReportStall(context.Context, membership.StepStall) error { return nil }

func (noSettings) Settings(membership.SettingsRef) (membership.JobSettings, bool) {
	return membership.JobSettings{}, false
}

var errNoCommitRecords = errors.New("ft: the Membership keeps no commit records (DurableCommit needs RecordCommit and LastCommit)")

func (noCommitRecords) RecordCommit(context.Context, int64, uint64) (membership.CommitRecord, bool, error) {
	return membership.CommitRecord{}, false, errNoCommitRecords
}

func (noCommitRecords) LastCommit(context.Context) (membership.CommitRecord, bool, error) {
	return membership.CommitRecord{}, false, errNoCommitRecords
}
