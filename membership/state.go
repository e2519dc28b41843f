package membership

import (
	"fmt"
	"strings"
)

// MemberState is what a member holds, for a tool that must say why a
// member has not seen what it waited for (cmd/ftload's waits, a test's):
// a snapshot under the member's locks, no I/O. What etcd holds for the
// member (its registration, its group's record) is the tool's to read.
type MemberState struct {
	ID string
	// Epoch and Participants are the quorum the member holds (0: none);
	// InQuorum says whether the member is one of those participants.
	Epoch        uint64
	Participants int
	InQuorum     bool
	// Watched, Forwarded and Read are the newest epochs of the quorum
	// records it received from its own etcd watch, from its group's
	// leader over the link, and by reading the record from etcd, whether
	// or not it could apply them (0: none).
	Watched, Forwarded, Read uint64
	// Watching says whether its watch of the job's epochs in etcd runs
	// (a group's leader, or a member without a group lease).
	Watching bool
	// With MemberConfig.GroupLease: Leads says whether it holds its
	// group's lease; Lease is the lease its registration is bound to;
	// Leader and GroupRev are the group's record it is bound under (the
	// leader it names and its mod revision); Linked, at a member that
	// does not lead, whether its link to that leader is up; Links, at a
	// leader, how many members are linked to it.
	GroupLease bool
	Leads      bool
	Lease      int64
	Leader     string
	GroupRev   int64
	Linked     bool
	Links      int
	// Claim, at a member that does not lead, is the member that claimed
	// the takeover of the group's lease in that record (its leader's link
	// ended), whose new lease it waits for ("": none).
	Claim string
	// Err is why the membership ended (nil while it lasts).
	Err error
}

// State returns what the member holds now (see MemberState).
func (m *Member) State() MemberState {
	s := MemberState{ID: m.cfg.ID, GroupLease: m.cfg.GroupLease, Err: m.Err()}
	m.epochs.state(&s)
	m.lease.state(&s)
	return s
}

// String says it in one line: "m000123 epoch 7 (9,899, in it) watch 0
// link 8 read 7, follows m000120 (linked) on lease 7f3a…@1234".
func (s MemberState) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s epoch %d (%d participants", s.ID, s.Epoch, s.Participants)
	if !s.InQuorum {
		b.WriteString(", not in it")
	}
	fmt.Fprintf(&b, "); received: watch %d, link %d, read %d", s.Watched, s.Forwarded, s.Read)
	if s.Watching {
		b.WriteString(" (watching)")
	}
	switch {
	case !s.GroupLease:
	case s.Leads:
		fmt.Fprintf(&b, "; leads its group on lease %x (record rev %d), %d linked", s.Lease, s.GroupRev, s.Links)
	default:
		link := "not linked"
		if s.Linked {
			link = "linked"
		}
		fmt.Fprintf(&b, "; follows %s (%s) on lease %x (record rev %d)", s.Leader, link, s.Lease, s.GroupRev)
		if s.Claim != "" {
			fmt.Fprintf(&b, ", taken over by %s (claimed)", s.Claim)
		}
	}
	if s.Err != nil {
		fmt.Fprintf(&b, "; ended: %v", s.Err)
	}
	return b.String()
}
