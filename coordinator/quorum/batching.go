package quorum

import (
	"fmt"
	"time"
)

// Batching: a quorum that only admits joiners, or that drops the rest
// of a burst of losses, waits a little for more of the same (formWait,
// lossWait), so that a mass join or a mass failure costs a few epochs.

// maxFormDoublings bounds how often FormMaxWait doubles while joins keep
// coming (8×: 16 s at the default).
const maxFormDoublings = 3

// formWait applies the batching of joins: it says what a quorum that
// only admits joiners waits for, and until when ("" when it need not).
// Each such quorum in a row that formed at its bound, joins still
// arriving, doubles the next one's bound (formStreak): a mass join of
// 100,000 ranks over half a minute is a few epochs, not one per
// FormMaxWait, and its last joiners are admitted a FormWindow after they
// stop all the same.
func (m *Machine) formWait(now time.Time) (string, time.Time) {
	window := m.cfg.formWindow()
	if window <= 0 {
		return "", time.Time{}
	}
	quiet, limit := m.lastArrival.Add(window), m.pendingSince.Add(m.cfg.formMaxWait()<<min(m.formStreak, maxFormDoublings))
	at := quiet
	if limit.Before(at) {
		at = limit
	}
	if !now.Before(at) {
		return "", time.Time{}
	}
	return fmt.Sprintf("forming: admitting joiners once none arrived for %v (at most %v more)",
		window, limit.Sub(now).Round(time.Millisecond)), at
}

// lossWait applies the batching of losses: while participants of the
// previous epoch are still being lost (the last loss less than LossWindow
// ago, the first less than LossMaxWait ago), it says what the quorum
// waits for and until when ("" when it need not). Only losses whose time
// the machine saw count (a removal), not a member that turned unfit.
//
// The first loss of a burst is not held: a single death (the common case,
// and the one a training job waits on) is published at once. Losses
// within LossMaxWait of a burst's first published loss are the rest of a
// mass failure (a rack: links resetting, group leases taken over, each
// seen a few milliseconds apart), and those are batched: one epoch for
// the first, one for the rest. A burst of MassLoss ranks or more waits
// longer (lossBounds): leases that lapse together come in etcd's ticks.
// A burst is measured from its first loss, not from its latest: deaths
// that keep coming a second or two apart (a flaky host killed again and
// again) are a burst each, so they never add up to a mass failure and
// its long waits (before 2026-11-30 they chained: a kill every 1.5 s
// waited 600 ms from the 16th on).
func (m *Machine) lossWait(now time.Time, lost []string) (string, time.Time) {
	if m.cfg.lossWindow() <= 0 || len(lost) == 0 {
		return "", time.Time{}
	}
	var first, last time.Time
	pending := 0
	for _, id := range lost {
		d, ok := m.removed[id]
		if !ok || d.at.IsZero() {
			continue
		}
		pending++
		if first.IsZero() || d.at.Before(first) {
			first = d.at
		}
		if d.at.After(last) {
			last = d.at
		}
	}
	if first.IsZero() || !m.inLossBurst(first) {
		return "", time.Time{} // the first loss of a new burst
	}
	window, bound := m.lossBounds(m.lossBurst + pending)
	at := last.Add(window)
	if limit := first.Add(bound); limit.Before(at) {
		at = limit
	}
	if !now.Before(at) {
		return "", time.Time{}
	}
	return fmt.Sprintf("%d lost: publishing once none was lost for %v", len(lost), window), at
}

// inLossBurst says whether a loss at t belongs to the current burst: it
// came within the burst's bound (by the ranks its published quorums
// dropped so far) of the burst's first loss.
func (m *Machine) inLossBurst(t time.Time) bool {
	_, bound := m.lossBounds(m.lossBurst)
	return !m.lossBurstAt.IsZero() && t.Sub(m.lossBurstAt) <= bound
}

// lossBounds are the quiet a burst of n lost ranks waits for, and the
// most it waits: LossWindow and LossMaxWait, or for a mass failure
// (MassLoss ranks or more) at least MassLossWindow and MassLossMaxWait.
func (m *Machine) lossBounds(n int) (window, bound time.Duration) {
	window, bound = m.cfg.lossWindow(), m.cfg.lossMaxWait()
	if mass := m.cfg.massLoss(); mass > 0 && n >= mass {
		window, bound = max(window, m.cfg.massLossWindow()), max(bound, m.cfg.massLossMaxWait())
	}
	return window, bound
}

// maxTime is the later of a and b.
func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
