package silence

import (
	"fmt"
	"sync/atomic"
	"time"
)

const (
	MaxHealthScore = 8  // the timeout stretches up to (1 + score) ×
	healthRecover  = 10 // timely ticks that take one point off the score
	MaxStretch     = 10 // × the base timeout: the longest the timeout stretches
	gapFactor      = 3  // the timeout is at least this × the recent longest gap
)

// Health scores how late this process's own timer ticks run: each tick
// later than half an interval adds a point, each 10 timely ticks in a row
// take one off. Its owner ticks it from one goroutine.
type Health struct {
	score  int
	timely int
}

// Tick records one tick of a timer of period interval that ran late by
// late.
func (h *Health) Tick(late, interval time.Duration) {
	if late > interval/2 {
		h.score = min(h.score+1, MaxHealthScore)
		h.timely = 0
		return
	}
	h.timely++
	if h.timely >= healthRecover {
		h.timely = 0
		h.score = max(h.score-1, 0)
	}
}

// Score is 0 for a process whose timers run on time, up to MaxHealthScore.
func (h *Health) Score() int { return h.score }

// Silence is what a Verdict weighs.
type Silence struct {
	Silent time.Duration // since anything arrived from the peer
	Base   time.Duration // the configured timeout
	Gap    time.Duration // the longest recent gap between arrivals from it (Arrivals.Gap)
	Health int           // this process's Health score
	State  State         // what this kernel says about the peer's process now (Look)
	// Blocked is how long every look has found the peer Blocked.
	Blocked time.Duration
	// RunnableLimit bounds how long a Runnable peer's silence is taken for
	// starvation (0: for ever; the caller's own deadlines bound it).
	RunnableLimit time.Duration
}

// Verdict says whether the peer is to be declared failed, and why.
func Verdict(s Silence) (bool, string) {
	ms := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	switch s.State {
	case Gone:
		return s.Silent > s.Base, fmt.Sprintf("nothing arrived for %v, and its process has exited", ms(s.Silent))
	case Stopped:
		return s.Silent > s.Base, fmt.Sprintf("nothing arrived for %v, and its process is stopped", ms(s.Silent))
	case Runnable:
		return s.RunnableLimit > 0 && s.Silent > s.RunnableLimit,
			fmt.Sprintf("nothing arrived for %v, though its process is runnable (limit %v)", ms(s.Silent), s.RunnableLimit)
	case Blocked:
		return s.Silent > s.Base && s.Blocked >= s.Base, fmt.Sprintf("nothing arrived for %v, and its process has not been runnable for %v (frozen or hung)", ms(s.Silent), ms(s.Blocked))
	}
	limit := Limit(s.Base, s.Gap, s.Health)
	return s.Silent > limit, fmt.Sprintf("nothing arrived for %v (timeout %v, stretched to %v by load)", ms(s.Silent), s.Base, ms(limit))
}

// Limit is how long a peer this kernel cannot look at may stay silent:
// base, at least gapFactor × the recent longest gap, times (1 + health),
// at most MaxStretch × base.
func Limit(base, gap time.Duration, health int) time.Duration {
	return min(max(base, gapFactor*gap)*time.Duration(1+health), MaxStretch*base)
}

// Arrivals tracks when data last arrived from a peer and the longest
// recent gap between arrivals. Arrived may be called from one goroutine
// while another reads; times are nanoseconds on any monotonic clock.
type Arrivals struct {
	last   atomic.Int64
	maxGap atomic.Int64 // decays; see Decay
}

// Mark makes now the last arrival without counting a gap: silence counts
// from now (a link just made, or one nobody was expected to speak on).
func (a *Arrivals) Mark(now int64) { a.last.Store(now) }

// Arrived records an arrival at now.
func (a *Arrivals) Arrived(now int64) {
	if gap := now - a.last.Swap(now); gap > a.maxGap.Load() {
		a.maxGap.Store(gap)
	}
}

// Decay shrinks the longest gap by 1/64: called once per monitor tick, an
// old stall is forgotten over a few hundred ticks.
func (a *Arrivals) Decay() {
	if g := a.maxGap.Load(); g > 0 {
		a.maxGap.CompareAndSwap(g, g-g/64-1)
	}
}

// Silent is the time since the last arrival.
func (a *Arrivals) Silent(now int64) time.Duration { return time.Duration(now - a.last.Load()) }

// Gap is the longest recent gap between arrivals.
func (a *Arrivals) Gap() time.Duration { return time.Duration(a.maxGap.Load()) }
