package comm

import (
	"sync"
	"time"
)

// deadlineTimer is a Comm's one timer for the deadline of the op that
// runs; when it fires, the Comm asks its lifecycle whether that op is
// overdue. It is lazy: resetting and stopping a runtime timer around every
// op cost about as much as a small shared-memory all-reduce itself, so the
// timer is left armed when an op ends, and reset only when the new deadline
// is earlier than the time it is armed for. Since every op's deadline is its
// start plus the same Timeout (a ctx may only make it earlier), a steady
// stream of ops resets nothing; the timer fires about once per Timeout, and
// the Comm arms it again for the running op's deadline, or lets it rest when
// no op runs.
type deadlineTimer struct {
	t  *time.Timer
	mu sync.Mutex
	at time.Time // when t fires (zero: stopped, or it fired)
}

func newDeadlineTimer(fire func()) *deadlineTimer {
	d := &deadlineTimer{t: time.AfterFunc(time.Hour, fire)}
	d.t.Stop()
	return d
}

// arm makes sure the timer fires no later than deadline (zero: none).
func (d *deadlineTimer) arm(deadline, now time.Time) {
	if deadline.IsZero() {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.at.IsZero() && !deadline.Before(d.at) {
		return
	}
	d.t.Reset(deadline.Sub(now))
	d.at = deadline
}

// fired is the first thing the timer's function does: the timer is no
// longer armed.
func (d *deadlineTimer) fired() {
	d.mu.Lock()
	d.at = time.Time{}
	d.mu.Unlock()
}

func (d *deadlineTimer) stop() { d.t.Stop() }
