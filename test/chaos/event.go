package main

import (
	"fmt"
	"strings"
	"time"
)

// Event is one line of a run's timeline: what a replica reported (as a JSON
// line on its stdout) or what the harness did or saw.
type Event struct {
	T    int64  `json:"t"` // unix ns, stamped where it happened
	Kind string `json:"k"`
	// Replica events: the replica's name and launch (set by the harness),
	// process id.
	Replica string `json:"r,omitempty"`
	Launch  int    `json:"l,omitempty"`
	Pid     int    `json:"pid,omitempty"`

	Step  int64  `json:"step,omitempty"`
	Epoch uint64 `json:"epoch,omitempty"`
	// commit: the state before and after the step, who took part (a
	// bitmask of replica indexes, and each one's rank in the comm), and
	// the Comm's own count of participants.
	Hash  uint64 `json:"hash,omitempty"`
	Prev  uint64 `json:"prev,omitempty"`
	Mask  uint32 `json:"mask,omitempty"`
	Ranks []int  `json:"ranks,omitempty"`
	N     int    `json:"n,omitempty"`
	// reconf: how and this replica's rank (-1: none).
	How  string `json:"how,omitempty"`
	Rank int    `json:"rank,omitempty"`
	// rollback: the steps discarded.
	From int64 `json:"from,omitempty"`
	To   int64 `json:"to,omitempty"`
	// heal: bytes received.
	Bytes int64 `json:"bytes,omitempty"`
	// op, commitdur: how long it took (ns); op: its error's kind, the
	// ranks it names.
	Dur     int64  `json:"dur,omitempty"`
	ErrKind string `json:"errkind,omitempty"`
	Failed  []int  `json:"failed,omitempty"`
	Err     string `json:"err,omitempty"`
	Reason  string `json:"reason,omitempty"`
	// settings: the job's settings version in force from step From.
	Version uint64 `json:"ver,omitempty"`
	// commit: what the replica's sampler read in the step (nil: it had
	// no plan, Err says why). start, commit, fail, heal, final: the
	// sampler's position after it (nil: no sampler).
	Data *DataRead `json:"data,omitempty"`
	Pos  *int64    `json:"pos,omitempty"`

	// Harness events: a fault (its id, targets), a quorum (participants,
	// removed).
	Fault   int      `json:"fault,omitempty"`
	Targets []string `json:"targets,omitempty"`
	Members []string `json:"members,omitempty"`
	Removed []string `json:"removed,omitempty"`
	// quorum: the spares it promoted, the replica groups whose places
	// spares took, the job's target size in replica groups.
	Promoted []string `json:"promoted,omitempty"`
	Replaced []string `json:"replaced,omitempty"`
	Target   int      `json:"target,omitempty"`
}

// Replica event kinds.
const (
	evStart    = "start"     // registered with the coordinator
	evCommit   = "commit"    // a step committed
	evFail     = "fail"      // a step did not commit (Reason)
	evOp       = "op"        // an all-reduce failed or was slow
	evCommitD  = "commitdur" // Commit was slow
	evReconf   = "reconf"    // moved to a new epoch (How, Rank)
	evHeal     = "heal"      // healed to Step with state Hash
	evRollback = "rollback"  // committed steps From..To discarded
	evSatOut   = "satout"
	evWaiting  = "waiting"
	evTooMany  = "toomany"  // Commit returned ErrTooManyCommitFailures
	evFatal    = "fatal"    // the replica gave up (Err)
	evFinal    = "final"    // reached the target: its final state
	evSettings = "settings" // the job's settings Version in force from step From (epoch Epoch)
	evPromoted = "promoted" // a spare promoted into Epoch (Reason: whose place)
)

// Harness event kinds.
const (
	evFault   = "fault"   // a fault began (Reason: its kind)
	evHealed  = "healed"  // a fault ended
	evSpawn   = "spawn"   // a replica process started (Reason "spare": as a spare)
	evExit    = "exit"    // a replica process ended (Reason: how)
	evQuorum  = "quorum"  // the coordinator published an epoch
	evCoord   = "coord"   // a coordinator or etcd process changed (Reason)
	evNemesis = "nemesis" // the nemesis began or ended
)

func (e Event) Time() time.Time { return time.Unix(0, e.T) }

// who names the process an event came from.
func (e Event) who() string {
	if e.Replica == "" {
		return "harness"
	}
	return fmt.Sprintf("%s#%d", e.Replica, e.Launch)
}

// String is the event as one timeline line (without its time).
func (e Event) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-8s %-9s", e.who(), e.Kind)
	add := func(f string, a ...any) { fmt.Fprintf(&b, " "+f, a...) }
	switch e.Kind {
	case evCommit:
		add("step %d epoch %d n %d mask %04b hash %016x prev %016x", e.Step, e.Epoch, e.N, e.Mask, e.Hash, e.Prev)
		if d := e.Data; d != nil {
			add("read %d+%d slot %d", d.Pos, d.Samples, d.Slot)
		}
	case evFail:
		add("step %d epoch %d: %s", e.Step+1, e.Epoch, e.Reason)
	case evOp, evCommitD:
		add("epoch %d took %v", e.Epoch, time.Duration(e.Dur).Round(time.Millisecond))
		if e.ErrKind != "" {
			add("%s %v: %s", e.ErrKind, e.Failed, e.Err)
		}
	case evReconf:
		add("epoch %d %s rank %d of %d", e.Epoch, e.How, e.Rank, e.N)
	case evHeal:
		add("epoch %d to step %d hash %016x (%d bytes)", e.Epoch, e.Step, e.Hash, e.Bytes)
		if e.Pos != nil {
			add("position %d", *e.Pos)
		}
	case evRollback:
		add("epoch %d steps %d..%d now at %d", e.Epoch, e.From, e.To, e.Step)
	case evFault, evHealed:
		add("#%d %s %v %s", e.Fault, e.Reason, e.Targets, e.Err)
	case evQuorum:
		add("epoch %d %v removed %v (%s)", e.Epoch, e.Members, e.Removed, e.Reason)
		if len(e.Promoted) > 0 || len(e.Replaced) > 0 {
			add("promoted %v replaced %v target %d", e.Promoted, e.Replaced, e.Target)
		}
	case evPromoted:
		add("into epoch %d: %s", e.Epoch, e.Reason)
	case evFinal, evStart, evSatOut, evWaiting:
		add("step %d epoch %d hash %016x %s", e.Step, e.Epoch, e.Hash, e.Reason)
	default:
		if e.Reason != "" {
			add("%s", e.Reason)
		}
		if e.Err != "" {
			add("%s", e.Err)
		}
	}
	return b.String()
}
