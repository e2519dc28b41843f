package membership

import (
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// Errors callers branch on with errors.Is.
var (
	// ErrDuplicateMember: another live incarnation holds the member id;
	// found inside a *DuplicateMemberError.
	ErrDuplicateMember = errors.New("membership: member id already registered")
	// ErrEvicted: the member's registration is gone (evicted from the
	// dashboard or API, declared dead by gossip, or its lease expired);
	// rejoin as a new incarnation.
	ErrEvicted = errors.New("membership: member evicted")
	// ErrKeptOut: the member id was evicted and may not register again
	// yet; found inside a *KeptOutError.
	ErrKeptOut = errors.New("membership: evicted member kept out")
)

// DuplicateMemberError tells who holds a member id that Join wanted.
type DuplicateMemberError struct {
	Job, ID     string
	Incarnation int64  // the holder's incarnation
	Addr        string // the holder's address
}

func (e *DuplicateMemberError) Error() string {
	return fmt.Sprintf("membership: member %q of job %q is already registered (incarnation %d, address %s) and its lease is alive",
		e.ID, e.Job, e.Incarnation, e.Addr)
}

func (e *DuplicateMemberError) Unwrap() error { return ErrDuplicateMember }

// KeptOutError tells who evicted a member id that Join wanted, and until
// when it is kept out.
type KeptOutError struct {
	Job, ID, By string
	Until       time.Time
}

func (e *KeptOutError) Error() string {
	return fmt.Sprintf("membership: member %q of job %q was evicted by %s and is kept out until %s (%v from now)",
		e.ID, e.Job, e.By, e.Until.Format(time.RFC3339), time.Until(e.Until).Round(time.Second))
}

func (e *KeptOutError) Unwrap() error { return ErrKeptOut }

// Health is what a member says about itself.
type Health int

const (
	// Healthy: fit to take part.
	Healthy Health = iota
	// Degraded: fit, but worth a look (shown on the dashboard).
	Degraded
	// Critical: unfit (e.g. a GPU XID fault); excluded from the next
	// quorum until it reports Healthy or Degraded again.
	Critical
)

func (h Health) String() string {
	switch h {
	case Healthy:
		return "healthy"
	case Degraded:
		return "degraded"
	case Critical:
		return "critical"
	}
	return fmt.Sprintf("health(%d)", int(h))
}

// MarshalText writes the name, so JSON records read well.
func (h Health) MarshalText() ([]byte, error) { return []byte(h.String()), nil }

// UnmarshalText reads a name written by MarshalText.
func (h *Health) UnmarshalText(b []byte) error {
	switch string(b) {
	case "healthy", "":
		*h = Healthy
	case "degraded":
		*h = Degraded
	case "critical":
		*h = Critical
	default:
		return fmt.Errorf("%w: membership: unknown health %q", comm.ErrInvalidArgument, b)
	}
	return nil
}

// KeepOut is the record that keeps an evicted member out, at
// <root>/_coordinator/jobs/<job>/evicted/<id> and bound to a lease that ends with it: the coordinator's
// eviction writes it, and Join fails with a *KeptOutError while it
// exists.
type KeepOut struct {
	By    string    `json:"by"`
	Until time.Time `json:"until"`
}

// Participant is one member of a quorum.
type Participant struct {
	ID          string `json:"id"`
	Addr        string `json:"addr"`
	Group       string `json:"group,omitempty"`
	Step        int64  `json:"step"`        // as last reported by the member
	Incarnation int64  `json:"incarnation"` // etcd revision of its registration
}

// Quorum is one epoch's decision: who takes part, in rank order.
type Quorum struct {
	Job          string        `json:"job"`
	Epoch        uint64        `json:"epoch"`
	Participants []Participant `json:"participants"` // rank i is Participants[i]
	// MaxStep is the highest step any participant had reported when the
	// quorum was formed. Participants report steps on heartbeats and
	// requests, not every step, so it may lag; ft.Comm agrees on the exact
	// step among participants (e.g. an all-reduce of max).
	MaxStep int64     `json:"maxStep"`
	Created time.Time `json:"created"`
	// Why this epoch exists, for people: "initial", "member b died
	// (gossip)", "commit failed in epoch 4", …
	Reason string `json:"reason"`
	// Removed and Added are the member ids that left and joined since the
	// previous epoch.
	Removed []string `json:"removed,omitempty"`
	Added   []string `json:"added,omitempty"`
	// Departed are the members of Removed that went in an orderly way:
	// they left or finished the run, after their last step. Their going
	// does not revoke the previous epoch (a peer's step in flight that no
	// longer needs them may end), and ft does not stop its comms for them.
	Departed []string `json:"departed,omitempty"`
	// PublishedBy names the coordinator instance that wrote it.
	PublishedBy string `json:"publishedBy,omitempty"`
	// Base is the previous epoch when every participant that continues
	// from it reported holding that epoch's communicators (MemberRecord.
	// Formed), so they may shrink or grow them into this epoch's; 0 when
	// some did not, and every participant forms new ones. A member's own
	// memory of what it formed can differ from its peers' (a formation can
	// succeed at some ranks and fail at others), so the choice is made
	// here, once, from the reports, and every rank follows it.
	Base uint64 `json:"base,omitempty"`
	// Prepared says that this epoch only adds whole replica groups to Base
	// (every participant of Base continues, in its place; nothing else
	// changes): a grow. Its survivors form this epoch's communicators in
	// the background while they keep stepping in Base, and move to them at
	// a step they agree on, so the joiners' start-up (a process's first
	// NCCL comm, its connections) costs them no stall (ft: "Grows").
	Prepared bool `json:"prepared,omitempty"`
	// Final, when above 0, says the run ended at that step: a member
	// finished it there (MemberRecord.Finished). Every later quorum of the
	// run keeps it; a replica that reads it stops (ft: ErrFinished)
	// instead of redoing steps its peers will never take again.
	Final int64 `json:"final,omitempty"`
	// FinalFrom, with Final, are the addresses where members that finished
	// the run at Final serve its final state (MemberRecord.Addr): a
	// replica behind Final heals to it from them before it stops (ft:
	// ErrFinished with the final state).
	FinalFrom []string `json:"finalFrom,omitempty"`
	// Run is the run of the job the participants belong to
	// (MemberRecord.Run; "" before runs were recorded). A quorum of a new
	// run starts afresh: no Final, no wait for the last run's members.
	Run string `json:"run,omitempty"`
	// RunStep is the highest step the run is known to have reached before
	// this epoch (a previous quorum's MaxStep, or a higher step one of its
	// participants reported), 0 for a new run. Participants none of which
	// holds any step of a run whose RunStep is above 0 would restart its
	// history from step 0: ft refuses to (StaleRunError) and names the
	// choices (restore a state, or start a new run).
	RunStep int64 `json:"runStep,omitempty"`
	// Settings names the job's settings document in force from this
	// epoch's first step (nil: none was ever set). The document is at
	// etcdkeys.Layout.Settings; its digest, covered by the quorum's
	// signature, proves which one.
	Settings *SettingsRef `json:"settings,omitempty"`
	// Target is the most replica groups a quorum of this run had: the
	// size spares refill the job to when its settings name none
	// (SettingTargetReplicas). 0 in records written before spares.
	Target int `json:"target,omitempty"`
	// Promoted are the spares this quorum admits (a subset of Added):
	// ready spares promoted because the job ran below its target.
	Promoted []string `json:"promoted,omitempty"`
	// Replaced are the replica groups whose places promoted spares took:
	// a new process of such a group (a restart) waits as a spare until
	// the job needs it, instead of growing the job past its target.
	Replaced []string `json:"replaced,omitempty"`
	// Signature, when the coordinator signs its quorums
	// (coordinator.Config.QuorumSigner), proves that a coordinator holding
	// the key published this record; members with a QuorumVerifier act
	// on no other.
	Signature *QuorumSignature `json:"signature,omitempty"`
}

// Rank returns the rank of member id in q, or -1.
func (q Quorum) Rank(id string) int {
	for i, p := range q.Participants {
		if p.ID == id {
			return i
		}
	}
	return -1
}

// Includes reports whether the given incarnation of member id takes part.
func (q Quorum) Includes(id string, incarnation int64) bool {
	r := q.Rank(id)
	return r >= 0 && q.Participants[r].Incarnation == incarnation
}

// Revocation records that an epoch's communicators must stop: written by
// the coordinator when it publishes the next epoch, or by any member that
// saw the epoch fail. The first record of an epoch wins; later ones are
// dropped.
type Revocation struct {
	Epoch  uint64    `json:"epoch"`
	Reason string    `json:"reason"`
	Failed []string  `json:"failed,omitempty"` // member ids blamed, if known
	By     string    `json:"by"`               // member id or coordinator name
	At     time.Time `json:"at"`
}

// MemberRecord is what a member keeps in etcd under its lease. Members
// write it; the coordinator reads it.
type MemberRecord struct {
	Job   string `json:"job"`
	ID    string `json:"id"`
	Addr  string `json:"addr"`
	Group string `json:"group,omitempty"`
	// GroupSize, above 1, is how many ranks Group has: the coordinator
	// admits them only together (a replica group takes part whole), so
	// the rest of a group that lost a rank, or of one still arriving, is
	// left out of the epoch instead of taking part in it incomplete.
	GroupSize int `json:"groupSize,omitempty"`
	// Spare: the member is a warm standby of its job (MemberConfig.Spare).
	// While it waits, the coordinator counts it neither among the live
	// members nor among the joiners; it promotes a ready spare (one that
	// asks to take part, WantQuorum) when the job runs below its target
	// size, and the promoted incarnation is a replica like any other
	// from then on (docs/spares.md).
	Spare bool `json:"spare,omitempty"`
	// Host is where the member runs (a placement hint, MemberConfig.Host):
	// a spare on the host of the replica it replaces is promoted first.
	Host string `json:"host,omitempty"`
	// Gossip is the member's memberlist address ("" without gossip).
	Gossip string `json:"gossip,omitempty"`
	// Lease is the etcd lease of the registration. JSON carries it as a
	// decimal string: lease ids are often above 2^53, where JSON parsers
	// that read numbers as doubles lose digits.
	Lease int64 `json:"lease,string"`
	// SharedLease: the lease is the member's replica group's
	// (MemberConfig.GroupLease); removing the member must not revoke it.
	SharedLease bool   `json:"sharedLease,omitempty"`
	Step        int64  `json:"step"`
	Health      Health `json:"health"`
	// HealthReason says why the health is not Healthy.
	HealthReason string `json:"healthReason,omitempty"`
	// WantQuorum: the member asks to take part in the next quorum (set by
	// RequestQuorum and kept).
	WantQuorum bool `json:"wantQuorum"`
	// ShrinkOnly: while any participant holds it, no joiner is admitted.
	ShrinkOnly bool `json:"shrinkOnly,omitempty"`
	// MinReplicas the member's job needs (0: the coordinator's default).
	MinReplicas int `json:"minReplicas,omitempty"`
	// CommitFailed is the last epoch in which this member's commit failed.
	CommitFailed uint64 `json:"commitFailed,omitempty"`
	// Blamed are the members whose connections failed in this member's
	// CommitFailed epoch (a reset: their process is likely gone); the
	// coordinator checks them before forming the next epoch.
	Blamed []string `json:"blamed,omitempty"`
	// Formed is the epoch whose communicators the member formed and holds
	// (ReportFormed); the coordinator sets Quorum.Base from it.
	Formed uint64 `json:"formed,omitempty"`
	// Run is the run of the job the member belongs to (see RunRecord).
	Run string `json:"run,omitempty"`
	// WaitingFor, when above 0, is the job's committed step the member
	// waits for a holder of before it can take another step (ft's
	// DurableCommit: no participant of its epoch holds it); Waiting says
	// so for people. Member.SetWaiting sets them.
	WaitingFor int64  `json:"waitingFor,omitempty"`
	Waiting    string `json:"waiting,omitempty"`
	// Finished: the member's training loop ended the run at Step
	// (ft.Comm.Finish); it takes part in no further quorum, and the
	// coordinator publishes the run's end (Quorum.Final).
	Finished bool `json:"finished,omitempty"`
	// StepTime is the member's own compute time per step (SetStepTime),
	// the mean over the steps since its previous write; 0: not reported.
	// The straggler policy compares it with its peers'.
	StepTime time.Duration `json:"stepTimeNs,omitempty"`
	// Stragglers is the straggler policy the member asks for its job
	// (MemberConfig.Stragglers); nil: the coordinator's.
	Stragglers *StragglerPolicy `json:"stragglers,omitempty"`
	// Stall, when set, says that this member's step has not moved for
	// longer than its stall bound (ft: Config.Stall): it waits in a
	// collective for its peers (Waiting), or its training loop does not
	// step (idle since its last commit, or computing without having
	// started the step's collectives). A peer waiting in a step its loop
	// does not take leaves it out (docs/quorum.md, "Stalls"). Written once
	// per stall; a report of an older step is history.
	Stall *StepStall `json:"stall,omitempty"`
	// Reached are members this one blamed (Blamed, Revocation.Failed)
	// whose address it connected to again since, each with the epoch of
	// the blame it answers: the link works again, and the coordinator ends
	// the blame's hold (past its floor, Config.BlameMinHold).
	Reached map[string]uint64 `json:"reached,omitempty"`
	// Leaving: the member is leaving gracefully (its key goes next).
	Leaving bool `json:"leaving,omitempty"`
	// Evicted says who evicted the member (its key goes next).
	Evicted string    `json:"evicted,omitempty"`
	Joined  time.Time `json:"joined"`
	Updated time.Time `json:"updated"`
	// Incarnation is the etcd create revision of the record; filled when
	// read, not stored.
	Incarnation int64 `json:"-"`
}

// StepStall is a member's report of a step that did not move for longer
// than the member's stall bound (MemberRecord.Stall).
type StepStall struct {
	// Epoch and Step say where: the epoch the member is in and the step it
	// is on (its committed step + 1).
	Epoch uint64 `json:"epoch"`
	Step  int64  `json:"step"`
	// Waiting: a collective of the step (or the epoch's formation) has
	// waited For for its peers. Otherwise the member's own loop has not
	// stepped for For: idle since its last commit, or computing without
	// having issued the step's first collective.
	Waiting bool          `json:"waiting,omitempty"`
	For     time.Duration `json:"forNs"`
	// Bound is the member's stall bound: what its recent steps allow.
	Bound time.Duration `json:"boundNs"`
}

// String says what the report says, for reasons and logs.
func (s StepStall) String() string {
	what := "has not stepped"
	if s.Waiting {
		what = "waited in its collectives"
	}
	return fmt.Sprintf("%s for %v at step %d of epoch %d (bound %v)", what, s.For.Round(time.Millisecond), s.Step, s.Epoch,
		s.Bound.Round(time.Millisecond))
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ValidName reports whether s can be a job or member id: 1–128 characters
// of letters, digits, '.', '_' and '-', starting with a letter or digit.
func ValidName(s string) bool { return nameRE.MatchString(s) }

func checkName(kind, s string) error {
	if !ValidName(s) {
		return fmt.Errorf("%w: membership: %s %q: want 1–128 of [A-Za-z0-9._-], starting with a letter or digit", comm.ErrInvalidArgument, kind, s)
	}
	return nil
}
