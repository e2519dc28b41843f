package gloo

import (
	"fmt"
	"time"
)

// The liveness check decides whether a peer from which nothing (data or
// heartbeat) has arrived for a while, while an op is pending, has failed.
// Silence alone is weak evidence on a loaded machine: on 2 saturated cores
// with the race detector, ranks of one process went 4–12 s without being
// scheduled, and separate processes over a second, though nothing had
// failed. So the check asks for more before it declares a peer failed:
//
//   - A peer on this host (same kernel and pid namespace, learnt in the
//     handshake) is looked up in /proc once it has been silent for
//     Config.PeerTimeout. Stopped (SIGSTOP, a tracer) or gone: failed. A
//     thread of it running or runnable: alive — a starved process wants a
//     CPU, so it is never declared failed for its silence (the op deadline
//     bounds that case; a crash resets its connections at once anyway). No
//     thread runnable in any look for another PeerTimeout: it is neither
//     running nor trying to (a cgroup freezer, a hang in the kernel), and
//     it is declared failed.
//   - Any other peer is declared failed after a timeout that stretches with
//     how late this process's own timers run (a Lifeguard-style local health
//     score: when this process is starved, its view of others is unreliable)
//     and with the longest gap recently seen between arrivals from that peer,
//     up to maxStretch × Config.PeerTimeout.

const (
	maxHealthScore = 8  // the timeout stretches up to (1 + score) ×
	healthRecover  = 10 // timely ticks that take one point off the score
	maxStretch     = 10 // × PeerTimeout: the longest the timeout stretches
	gapFactor      = 3  // the timeout is at least this × the recent longest gap
)

// localHealth scores how late this process's monitor ticks run: each tick
// later than half an interval adds a point, each healthRecover timely
// ticks in a row take one off.
type localHealth struct {
	score  int
	timely int
}

func (h *localHealth) tick(late, interval time.Duration) {
	if late > interval/2 {
		h.score = min(h.score+1, maxHealthScore)
		h.timely = 0
		return
	}
	h.timely++
	if h.timely >= healthRecover {
		h.timely = 0
		h.score = max(h.score-1, 0)
	}
}

// silenceVerdict says whether a peer that has been silent for silent (past
// base = Config.PeerTimeout) is to be declared failed, and why. gap is the
// longest recent gap between arrivals from it, health this process's
// localHealth score, proc what this kernel says about the peer's process
// now, and blocked how long every look has found it procBlocked.
func silenceVerdict(silent, base, gap time.Duration, health int, proc peerProc, blocked time.Duration) (bool, string) {
	ms := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	switch proc {
	case procGone:
		return silent > base, fmt.Sprintf("no data or heartbeat for %v, and its process has exited", ms(silent))
	case procStopped:
		return silent > base, fmt.Sprintf("no data or heartbeat for %v, and its process is stopped", ms(silent))
	case procRunnable:
		return false, ""
	case procBlocked:
		return silent > base && blocked >= base, fmt.Sprintf("no data or heartbeat for %v, and its process has not been runnable for %v (frozen or hung)", ms(silent), ms(blocked))
	}
	limit := min(max(base, gapFactor*gap)*time.Duration(1+health), maxStretch*base)
	return silent > limit, fmt.Sprintf("no data or heartbeat for %v (peer timeout %v, stretched to %v by load)", ms(silent), base, ms(limit))
}
