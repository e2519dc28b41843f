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
// The first loss after a quiet spell is not held: a single death (the
// common case, and the one a training job waits on) is published at once.
// Losses that follow a published loss within LossMaxWait are the rest of
// a mass failure (a rack: links resetting, group leases taken over, each
// seen a few milliseconds apart), and those are batched: one epoch for
// the first, one for the rest. A burst of MassLoss ranks or more waits
// longer (lossBounds): leases that lapse together come in etcd's ticks.
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
	window, bound := m.lossBounds(m.recentLosses(first) + pending)
	if first.IsZero() || m.lossEpochAt.IsZero() || first.Sub(m.lossEpochAt) > bound {
		return "", time.Time{}
	}
	at := last.Add(window)
	if limit := first.Add(bound); limit.Before(at) {
		at = limit
	}
	if !now.Before(at) {
		return "", time.Time{}
	}
	return fmt.Sprintf("%d lost: publishing once none was lost for %v", len(lost), window), at
}

// recentLosses is how many losses the published quorums dropped in the
// MassLossMaxWait before t: with the ones pending, what decides whether
// this is a mass failure. A rate, not the length of a chain: deaths that
// keep coming a second or two apart (one replica killed after another)
// each follow a published loss within LossMaxWait and are batched for
// LossWindow, but they never add up to MassLoss and its longer quiet
// (when the chain's whole length counted, a kill every 1.6 s waited
// 600 ms from the 16th on).
func (m *Machine) recentLosses(t time.Time) int {
	since := t.Add(-m.cfg.massLossMaxWait())
	n := 0
	for _, at := range m.lossTimes {
		if !at.Before(since) {
			n++
		}
	}
	return n
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
