package membership

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership/gossip"
)

// Crash stops m as a killed process would: no key deletion, no lease
// revocation, no gossip leave (for the tests in package membership_test).
func (m *Member) Crash() {
	m.closeOnce.Do(func() {
		m.end.crashed.Store(true)
		m.end.finish(fmt.Errorf("%w: member crashed", comm.ErrClosed))
		if g := m.lease.gossip(); g != nil {
			g.Close()
		}
		m.wg.Wait()
	})
}

// GossipStats returns the counters of m's gossip node (ok false without
// gossip).
func (m *Member) GossipStats() (s gossip.Stats, ok bool) {
	g := m.lease.gossip()
	if g == nil {
		return gossip.Stats{}, false
	}
	return g.Stats(), true
}

// WatchesEpochs reports whether m watches the job's epochs in etcd (a
// replica group's follower takes them from its leader instead).
func (m *Member) WatchesEpochs() bool { return m.epochs.watching.Load() > 0 }

// GroupWatchFrom returns the revision after which a group member that
// does not hold the lease watches the group's record.
func (m *Member) GroupWatchFrom() int64 { return m.lease.watchFrom() }

// HoldLinks makes the member cfg configures hold its group links back
// until release is closed (never, if it is not): it registers on its
// group's lease and follows the group's record, moving its registration
// when the lease moves, but links to no leader.
func HoldLinks(cfg *MemberConfig, release <-chan struct{}) { cfg.linkHeld = release }

// HoldTakeover makes the member cfg configures stop a takeover of its
// group's lease after its claim, before it grants the new lease, until
// release is closed (never, if it is not).
func HoldTakeover(cfg *MemberConfig, release <-chan struct{}) { cfg.takeoverHeld = release }

// MuteLinks makes the member cfg configures send no pings on its group
// links while muted is true: its process runs, but its links go silent,
// as a process starved of CPU.
func MuteLinks(cfg *MemberConfig, muted *atomic.Bool) { cfg.linkMuted = muted }

// SilencesKept counts the times m's group links found their peer silent
// past the timeout and took it for starved, not dead.
func SilencesKept(m *Member) int64 { return m.links.kept.Load() }

// SilencesEnded counts the silences SilencesKept counts that ended with
// the peer heard again.
func SilencesEnded(m *Member) int64 { return m.links.spoke.Load() }

// UnlinkedBound is how long the leader of a group whose members cfg
// configures lets a registration on its lease go without a link.
func UnlinkedBound(cfg MemberConfig) time.Duration { return cfg.unlinkedBound() }
