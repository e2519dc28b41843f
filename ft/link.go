package ft

import (
	"sync"
	"sync/atomic"
)

// link is the boundary between a Comm, the training loop's API, and its
// driver, the one goroutine that owns the step protocol's state (the
// machine, the comms, the registration, the recovery server and the
// reports): requests go in, answers and what other goroutines may read
// come out. Neither side touches the other's fields.
type link struct {
	in      chan input    // to the driver: calls, task results, failures
	replies chan reply    // from the driver: the answer to the call in flight
	done    chan struct{} // closed when the driver's loop has ended
	// released is closed once the driver has released what it held after
	// its loop ended (the registration, the recovery server, device
	// comms); closeErr says what went wrong then.
	released chan struct{}
	closeErr error

	// Published by the driver for readers on any goroutine.
	mem  atomic.Pointer[member] // the current registration
	snap atomic.Pointer[snapshot]
	step atomic.Int64 // the committed step (it changes every step: not in snap)
	// settings are the job's settings in force (nil: none yet).
	settings atomic.Pointer[Settings]

	// Events the driver emitted, for the training goroutine to hand to
	// Config.OnEvent while it waits in Step or Commit, or when it next
	// calls them.
	evMu   sync.Mutex
	evq    []Event
	evWake chan struct{}
}

func newLink(m *member) *link {
	l := &link{in: make(chan input), replies: make(chan reply, 1), done: make(chan struct{}), released: make(chan struct{}),
		evWake: make(chan struct{}, 1)}
	l.mem.Store(m)
	l.snap.Store(&snapshot{rank: -1})
	return l
}

// member returns the current registration.
func (l *link) member() *member { return l.mem.Load() }

// queueEvent is the driver's side of event delivery.
func (l *link) queueEvent(e Event) {
	l.evMu.Lock()
	l.evq = append(l.evq, e)
	l.evMu.Unlock()
	select {
	case l.evWake <- struct{}{}:
	default:
	}
}

// takeEvents is the training goroutine's side: the events queued so far.
func (l *link) takeEvents() []Event {
	l.evMu.Lock()
	defer l.evMu.Unlock()
	evs := l.evq
	l.evq = nil
	return evs
}
