package ft

import "github.com/ftcomm/ftcomm/coordinator/memcoord"

// What memcoord's Member offers ft (ft's own registration is checked in
// membership.go). It has no RequestQuorum, Heartbeat, SetWaiting,
// ReportStall or Settings: ft uses their fallbacks (bindMember).
var (
	_ Membership       = (*memcoord.Member)(nil)
	_ stepTimer        = (*memcoord.Member)(nil)
	_ durableCommitter = (*memcoord.Member)(nil)
)
