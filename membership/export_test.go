package membership

import (
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// Crash stops m as a killed process would: no key deletion, no lease
// revocation, no gossip leave (for the tests in package membership_test).
func (m *Member) Crash() {
	m.closeOnce.Do(func() {
		m.crashed.Store(true)
		m.finish(fmt.Errorf("%w: member crashed", comm.ErrClosed))
		if g := m.gossip(); g != nil {
			g.Close()
		}
		m.wg.Wait()
	})
}

// GossipStats returns the counters of m's gossip node (ok false without
// gossip).
func (m *Member) GossipStats() (s GossipStats, ok bool) {
	g := m.gossip()
	if g == nil {
		return GossipStats{}, false
	}
	return g.Stats(), true
}

// Durations formats measured durations: one, or n, min, median and max.
func Durations(ds []time.Duration) string { return durations(ds) }
