package quorum

import "fmt"

// Cause is why a member's registration ended. The rules follow the cause,
// never the text a quorum's Reason shows for it:
//   - a lapse (Lapsed: LeaseExpired, GossipDeath) leaves a process that may
//     be alive and come back holding the job's step, so the history rule
//     waits a while for it (Config.HolderGrace);
//   - an orderly departure (Orderly: Left, Finished) came after the
//     member's last step, so the quorum without it names it Departed and
//     does not revoke the epoch it leaves;
//   - any other cause (PortClosed, Evicted) is gone for good and breaks
//     the epoch.
type Cause uint8

const (
	// LeaseExpired: the registration's lease expired. The process may
	// live on: an etcd outage lapses every lease.
	LeaseExpired Cause = iota + 1
	// GossipDeath: gossip declared the member dead. A paused process looks
	// the same.
	GossipDeath
	// PortClosed: a peer reported the member and its address refused a
	// connection: no process listens there any more.
	PortClosed
	// Evicted: an operator evicted the member (MemberRecord.Evicted).
	Evicted
	// Left: the member left gracefully (MemberRecord.Leaving).
	Left
	// Finished: the member finished the run (MemberRecord.Finished) and
	// left.
	Finished
)

// String is the cause's short name, as metrics label it.
func (c Cause) String() string {
	switch c {
	case LeaseExpired:
		return "lease"
	case GossipDeath:
		return "gossip"
	case PortClosed:
		return "reported"
	case Evicted:
		return "evicted"
	case Left:
		return "left"
	case Finished:
		return "finished"
	}
	return fmt.Sprintf("cause(%d)", uint8(c))
}

// Lapsed reports whether the member's process may be alive and come back.
func (c Cause) Lapsed() bool { return c == LeaseExpired || c == GossipDeath }

// Orderly reports whether the member went after its last step.
func (c Cause) Orderly() bool { return c == Left || c == Finished }

// Removal is the end of one member's registration: its cause, and what
// the cause's text in a quorum's Reason names.
type Removal struct {
	Cause Cause
	// By is who evicted the member (Evicted; "" when not known).
	By string
	// Step is the step the member finished the run at (Finished).
	Step int64
}

// String is the removal as a quorum's Reason shows it after the member's
// id: "lease expired", "died (gossip)", "evicted by admin", …
func (r Removal) String() string {
	switch r.Cause {
	case LeaseExpired:
		return "lease expired"
	case GossipDeath:
		return "died (gossip)"
	case PortClosed:
		return "died (reported by a peer, port closed)"
	case Evicted:
		if r.By == "" {
			return "evicted"
		}
		return "evicted by " + r.By
	case Left:
		return "left"
	case Finished:
		return fmt.Sprintf("finished at step %d", r.Step)
	}
	return r.Cause.String()
}
