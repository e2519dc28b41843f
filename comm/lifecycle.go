package comm

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"
)

// lifecycle is what a Comm's goroutines share about its ops: whether the
// comm takes them (its health), the order they run in, and who runs them.
// It owns the comm's only lock for that state. Comm's methods, its worker
// and completer goroutines, its deadline timer and its ctx callbacks change
// it only through the methods below, each of which takes l.mu and releases
// it before returning; none calls the backend, and none blocks but next,
// shutdown and backendBroke, which wait for the state they name.
//
// # Who runs ops
//
// One goroutine at a time owns the executor (owner):
//
//	idle    no op runs, none is queued and none is started
//	caller  a sync op issued on an idle comm runs on its caller's goroutine;
//	        ops issued meanwhile queue behind it
//	worker  the worker goroutine runs the queued ops in order; on an
//	        Enqueuer it starts those it can (startable) without waiting for
//	        them, and runs any other op only once every started op has ended
//
// The moves:
//
//	idle   → caller  issue of a sync op (issue returns here = true)
//	idle   → worker  issue of an async op, or of a sync op on a busy comm;
//	                 the first hand-off to the worker calls spawn
//	caller → idle    release, with nothing queued
//	caller → worker  release, with ops queued behind the caller's
//	worker → idle    ran, or next, once the queue is empty and no started op
//	                 is pending; ran goes idle before the op's Done is closed,
//	                 so a caller that saw its ops done finds the comm idle
//
// Only the owner leaves its state, and only the owner takes ops off the
// queue (the caller runs the one op issue gave it; the worker takes them
// with next). Idle implies an empty queue, no op running and none pending.
//
// # An op
//
//	issued   issue gave it the next seq and recorded it (the issue order is
//	         the order issue took l.mu); it runs here or is queued
//	running  begin admitted it: it is cur, on the owner's goroutine
//	started  begin admitted it for the Enqueuer: counted in pending, it runs
//	         on the device while the worker moves on; the completer ends it
//	ended    end (startFailed, for a start the Enqueuer refused) turned the
//	         backend's error into the op's and moved the comm's health as
//	         that error implies
//
// begin refuses an op, which then never runs, when the comm is broken
// (unless the op is a Shrink or Grow, which repair it) or closed, or when
// its ctx ended while it was queued (unless it is a refusal, which its peers
// wait for). A refused op (opDesc.refused) runs only to tell its peers
// (Refuser) and fails with the caller's mistake first.
//
// # Breaking, closing and the callbacks
//
// Health moves as health says: an op's error (end), the deadline timer
// (overdue: the running op is past its deadline), the running op's ctx
// ending (ctxEnded), Abort (abort), Revoke (revoke), the backend breaking
// with no op running (backendBroke, which waits for the executor to settle
// first so that an op classifies its own failure), Close (close) and a Shrink
// or Grow that replaced the comm (replace). overdue and ctxEnded count an
// action in acting that the callback ends with doneActing once it has logged
// and aborted the backend.
//
// close tells Comm.Close whether the backend must be aborted to end what
// runs: an op running or started, but not a refusal being told to the peers,
// which finishes under its deadline (its peers wait for it, its caller has
// no Work to wait on, and an abort would reach the peers' comms). Once closed,
// issue refuses new ops and begin every queued one; shutdown then waits until
// the executor is idle and no callback acts, and stops the worker: next
// returns nil.
//
// # Who may touch what
//
//   - seq, queue, owner, spawned, stopped: issue, release (the caller that
//     owns the executor), next and ran (the worker), shutdown.
//   - cur: begin and end, on the owner's goroutine; overdue, ctxEnded and
//     close read it.
//   - pending: begin (the worker) adds, end and startFailed (the completer,
//     the worker) take away.
//   - acting: overdue and ctxEnded add, doneActing takes away.
//   - health: any method; broken is never reassigned, so it is read unlocked.
//   - A Work's t0, deadline and wasActive are set by begin and then only read;
//     timedOut is set by overdue while the op is cur, and read by end.
//
// settled is broadcast when owner goes idle or pending or acting drops
// (backendBroke and shutdown wait on it); ready is signalled when the worker
// may have an op to take, or is stopped (next waits on it).
type lifecycle struct {
	rec       *flightRecorder  // each op is recorded as issue queues it
	spawn     func()           // starts the worker (and completer) goroutines
	startable func(*Work) bool // an op the worker starts without waiting for those before it; nil: none

	mu      sync.Mutex
	settled *sync.Cond
	ready   *sync.Cond
	h       health
	seq     uint64
	owner   owner
	spawned bool
	stopped bool
	queue   []*Work // issued, not yet taken by the worker
	cur     *Work   // running on the owner's goroutine
	pending int     // started on the Enqueuer and not yet ended
	acting  int     // deadline and ctx callbacks logging and aborting now
}

// owner is who runs a comm's ops now; see lifecycle.
type owner uint8

const (
	ownerIdle owner = iota
	ownerCaller
	ownerWorker
)

func (o owner) String() string { return [...]string{"idle", "caller", "worker"}[o] }

func newLifecycle(log *zap.Logger, rec *flightRecorder, spawn func(), startable func(*Work) bool) *lifecycle {
	l := &lifecycle{rec: rec, spawn: spawn, startable: startable,
		h: health{log: log, broken: make(chan struct{})}}
	l.settled = sync.NewCond(&l.mu)
	l.ready = sync.NewCond(&l.mu)
	return l
}

// issue gives w its seq and its place in the issue order. It returns here =
// true when w, a sync op, found the comm idle: its caller now owns the
// executor, runs w and then calls release. Otherwise w is queued for the
// worker (its done channel made if it has none). A closed comm takes no op:
// ErrClosed, and w has no seq.
func (l *lifecycle) issue(w *Work, sync bool) (here bool, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.h.state == stateClosed {
		return false, ErrClosed
	}
	l.seq++
	w.seq = l.seq
	now := time.Now()
	l.rec.enqueue(w.seq, &w.d, now)
	if sync && l.owner == ownerIdle {
		l.owner = ownerCaller
		w.at = now // it starts now: one clock read less per op
		return true, nil
	}
	if w.done == nil {
		w.done = make(chan struct{})
	}
	l.queue = append(l.queue, w)
	switch l.owner {
	case ownerIdle:
		l.toWorkerLocked()
	case ownerWorker:
		l.ready.Signal() // a worker waiting for started ops to end takes new work at once
	}
	return false, nil
}

// release ends the caller's turn as owner, once the op issue let it run
// has run: the worker takes the ops queued meanwhile, or the comm goes idle.
func (l *lifecycle) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.queue) > 0 {
		l.toWorkerLocked()
		return
	}
	l.owner = ownerIdle
	l.settled.Broadcast()
}

func (l *lifecycle) toWorkerLocked() {
	l.owner = ownerWorker
	if !l.spawned {
		l.spawned = true
		l.spawn()
	}
	l.ready.Signal()
}

// next is the worker's wait for its next op, which it takes off the queue:
// start says to start it on the Enqueuer (ops started before it may still
// be pending); otherwise no started op is pending and the worker runs it,
// then calls ran. next returns nil once shutdown has stopped the worker.
func (l *lifecycle) next() (w *Work, start bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for {
		w, start, wait := l.nextLocked()
		if !wait {
			return w, start
		}
		l.ready.Wait()
	}
}

// nextLocked is one step of next: the op to take now, or wait = true.
func (l *lifecycle) nextLocked() (w *Work, start, wait bool) {
	if l.owner == ownerWorker {
		if len(l.queue) == 0 {
			if l.pending == 0 {
				l.owner = ownerIdle
				l.settled.Broadcast()
			}
		} else {
			w := l.queue[0]
			start := l.startable != nil && l.startable(w)
			if start || l.pending == 0 {
				l.queue[0] = nil
				l.queue = l.queue[1:]
				return w, start, false
			}
		}
	}
	return nil, false, !l.stopped
}

// ran is the worker's report that the op next gave it to run has run: with
// nothing queued behind it, the comm goes idle (before the op's Done is
// closed, as after an op its caller ran: the caller's next sync op then
// finds the comm idle and runs on its own goroutine).
func (l *lifecycle) ran() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.queue) == 0 {
		l.owner = ownerIdle
		l.settled.Broadcast()
	}
}

// begin admits w, which its owner took to run at now under deadline (zero:
// none), or to start on the Enqueuer (started). It returns why w may not run
// (see lifecycle), or sets w's t0, deadline and wasActive and makes w cur (or
// counts it pending).
func (l *lifecycle) begin(w *Work, now, deadline time.Time, started bool) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.h.admits(&w.d); err != nil {
		if w.d.refused != nil {
			return w.d.refused // the caller's own mistake comes first
		}
		return err
	}
	// A refused op is told to the peers even when its ctx has ended: they
	// wait for it.
	if err := w.ctx.Err(); err != nil && w.d.refused == nil { // gave up while queued: nothing was sent
		return fmt.Errorf("not started: %w", context.Cause(w.ctx))
	}
	w.t0, w.deadline, w.wasActive = now, deadline, l.h.state == stateActive
	if started {
		l.pending++
	} else {
		l.cur = w
	}
	return nil
}

// end ends w, which begin admitted, with the backend's err (expired: w's
// deadline passed while the completer waited for it). It returns the op's
// error and, when w's end breaks the comm so, the cause to abort the backend
// with: w's ctx ended while it ran, or (expired) it timed out.
func (l *lifecycle) end(w *Work, err error, expired bool) (opErr, abort error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cur == w {
		l.cur = nil // the timer stays armed: see deadlineTimer
	} else {
		l.endStartedLocked()
	}
	if err != nil && w.wasActive && l.h.state == stateActive {
		switch {
		case w.ctx.Err() != nil:
			// The backend saw the ctx end (before ctxEnded did, or with no
			// callback armed: a CtxWatcher).
			abort = l.h.ctxBreak(w)
		case expired: // our deadline
			abort = timeoutCause(w)
			l.h.breakTo(stateFailed, fmt.Errorf("%w after %w", ErrAborted, abort))
		}
	}
	err = l.h.classify(w, err)
	if err != nil && w.timedOut != nil && !errors.Is(err, ErrTimeout) {
		err = fmt.Errorf("%w (backend: %w)", w.timedOut, err)
	}
	if w.d.refused != nil {
		if err == nil {
			err = w.d.refused
		} else {
			err = fmt.Errorf("%w (and telling the peers failed: %w)", w.d.refused, err)
		}
	}
	return err, abort
}

// startFailed ends w, which begin counted pending, when the Enqueuer would
// not start it, and returns the op's error.
func (l *lifecycle) startFailed(w *Work, err error) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.endStartedLocked()
	return l.h.classify(w, err)
}

func (l *lifecycle) endStartedLocked() {
	l.pending--
	l.settled.Broadcast()
	l.ready.Signal()
}

// overdue is the deadline timer's check of the running op at now. An op
// not yet due returns its deadline, to arm the timer for. An op past it
// whose deadline holds (the comm is active; or the op is a Shrink or Grow
// repairing the broken comm, or a refusal that Close waits for, when the
// op's timedOut is set and the comm stays as it was) counts an action, for
// the caller to end with doneActing, and returns the cause to abort the
// backend with and the op's seq and kind for the log.
func (l *lifecycle) overdue(now time.Time) (cause error, seq uint64, kind OpType, due time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	w := l.cur
	if w == nil || w.deadline.IsZero() {
		return nil, 0, 0, time.Time{} // no op runs: the timer rests until the next one
	}
	if now.Before(w.deadline) {
		return nil, 0, 0, w.deadline // an earlier op's deadline, or an early firing
	}
	// A refusal that Close lets finish keeps its deadline.
	closing := l.h.state == stateClosed && w.d.refused != nil && w.timedOut == nil
	if !closing && (l.h.state == stateClosed || (l.h.state != stateActive && (!w.d.reconfig || w.timedOut != nil))) {
		return nil, 0, 0, time.Time{}
	}
	cause = timeoutCause(w)
	if l.h.state == stateActive {
		l.h.breakTo(stateFailed, fmt.Errorf("%w after %w", ErrAborted, cause))
	} else {
		w.timedOut = cause // the comm stays as it was
	}
	l.acting++
	return cause, w.seq, w.d.kind, time.Time{}
}

// ctxEnded is the callback of the running op seq whose ctx ended: the op
// cannot be abandoned half-way, so an active comm breaks. It returns the
// cause to abort the backend with, having counted an action (doneActing), or
// nil when seq no longer runs or the comm is broken already.
func (l *lifecycle) ctxEnded(seq uint64) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	w := l.cur
	if w == nil || w.seq != seq || l.h.state != stateActive {
		return nil
	}
	l.acting++
	return l.h.ctxBreak(w)
}

// doneActing ends a callback's action; shutdown waits for it, so nothing
// logs or touches the backend after Close returns.
func (l *lifecycle) doneActing() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.acting--
	l.settled.Broadcast()
}

// backendBroke breaks an active comm whose backend broke on its own with
// err. It first waits until no op runs or is started and no callback acts:
// an op running then fails with what the backend saw and classifies its own
// error, so it acts only on a failure no op found.
func (l *lifecycle) backendBroke(err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for l.h.state == stateActive && (l.owner != ownerIdle || l.acting > 0 || l.pending > 0) {
		l.settled.Wait()
	}
	if l.h.state != stateActive {
		return
	}
	if errors.Is(err, ErrRevoked) {
		l.h.breakTo(stateRevoked, err)
		return
	}
	l.h.breakTo(stateFailed, fmt.Errorf("%w: %w", ErrAborted, err))
}

// abort moves the comm to failed with refusal (Comm.Abort), unless it is
// closed (closed: the backend is no longer the comm's to abort) or revoked.
func (l *lifecycle) abort(refusal error) (closed bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.h.breakTo(stateFailed, refusal)
	return l.h.state == stateClosed
}

// revoke moves the comm to revoked with refusal (Comm.Revoke). It returns
// false, doing nothing, when the comm is closed or revoked already.
func (l *lifecycle) revoke(refusal error) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.h.state == stateClosed || l.h.state == stateRevoked {
		return false
	}
	l.h.breakTo(stateRevoked, refusal)
	return true
}

// close closes the comm for Comm.Close: first is false when it was closed
// already; abort says whether the backend must be aborted to end what runs
// (see lifecycle).
func (l *lifecycle) close() (first, abort bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.h.state == stateClosed {
		return false, false
	}
	abort = (l.cur != nil && l.cur.d.refused == nil) || l.pending > 0
	l.h.close(ErrClosed)
	return true, abort
}

// replace closes the comm because a Shrink or Grow replaced it, with
// refusal; false when Close came first.
func (l *lifecycle) replace(refusal error) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.h.state == stateClosed {
		return false
	}
	l.h.close(refusal)
	return true
}

// shutdown waits, on a closed comm, until the executor is idle (every op
// queued since close is refused by begin) and no callback acts, and stops
// the worker: next returns nil from then on.
func (l *lifecycle) shutdown() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for l.owner != ownerIdle || l.acting > 0 {
		l.settled.Wait()
	}
	l.stopped = true
	l.ready.Broadcast()
}

// err is nil while the comm takes ops, else why it refuses them.
func (l *lifecycle) err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.h.refusal
}

func (l *lifecycle) state() commState {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.h.state
}

// broken is closed when the comm first leaves stateActive.
func (l *lifecycle) broken() <-chan struct{} { return l.h.broken }

func timeoutCause(w *Work) error {
	return fmt.Errorf("%w: %s #%d still running at its deadline (%s after start)",
		ErrTimeout, w.d.kind, w.seq, w.deadline.Sub(w.t0).Round(time.Millisecond))
}

type commState uint8

const (
	stateActive  commState = iota
	stateFailed            // aborted, timed out or a peer failed: refuses collectives
	stateRevoked           // revoked here or at a peer: refuses collectives
	stateClosed            // closed, or replaced by the comm Shrink or Grow returned
)

func (s commState) String() string {
	return [...]string{"active", "failed", "revoked", "closed"}[s]
}

// health is whether a comm takes ops. It moves one way:
//
//	active → failed   an op failed, timed out or its ctx ended while it ran;
//	                  Abort; the backend broke with no op running
//	active → revoked  Revoke, here or at a peer (an op failed with ErrRevoked)
//	failed → revoked  the same, later
//	any    → closed   Close, or a Shrink or Grow that replaced the comm
//
// broken is closed on the first move out of active, and refusal says why
// ops are refused from then on. A broken comm still runs Shrink and Grow,
// which repair it; a closed one runs nothing. health is a plain value: its
// lifecycle's lock guards it.
type health struct {
	log     *zap.Logger
	state   commState
	refusal error         // why ops are refused, when state != stateActive
	broken  chan struct{} // closed when state first leaves stateActive
}

// breakTo moves the comm to s (failed or revoked) with refusal, where the
// moves allow.
func (h *health) breakTo(s commState, refusal error) {
	if h.state == stateClosed || (h.state == stateRevoked && s == stateFailed) {
		return
	}
	if h.state == stateActive {
		h.log.Warn("comm refuses further collectives", zap.String("state", s.String()), zap.Error(refusal))
		close(h.broken)
	}
	h.state, h.refusal = s, refusal
}

func (h *health) close(refusal error) {
	if h.state == stateActive {
		close(h.broken)
	}
	h.state, h.refusal = stateClosed, refusal
}

// admits returns why d cannot run now, or nil.
func (h *health) admits(d *opDesc) error {
	switch {
	case h.state == stateActive:
		return nil
	case h.state == stateClosed:
		return h.refusal
	case d.reconfig:
		return nil // Shrink and Grow are how a broken comm is repaired
	}
	return h.refusal
}

// classify turns the backend's error for w into the op's error and moves
// the comm to the state the error implies.
func (h *health) classify(w *Work, err error) error {
	if err == nil {
		return nil
	}
	if (w.wasActive && h.state != stateActive) || h.state == stateClosed {
		// Aborted, revoked or closed while running: that is the cause; what
		// the backend saw stays matchable (a dead peer's RankError).
		return fmt.Errorf("%w (backend: %w)", h.refusal, err)
	}
	switch {
	case !w.wasActive:
		// a failed Shrink or Grow leaves the broken comm as it was
	case errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrPeerRefused):
		// refused, here or by a peer, before any data moved: the backend
		// (a Refuser) kept every rank in step, and the comm is still good
	case errors.Is(err, ErrRevoked):
		h.breakTo(stateRevoked, err)
	default:
		h.breakTo(stateFailed, fmt.Errorf("%w after %s #%d failed: %w", ErrAborted, w.d.kind, w.seq, err))
	}
	return err
}

// ctxBreak breaks the comm because w's ctx ended while it ran and returns
// the cause to abort the backend with.
func (h *health) ctxBreak(w *Work) error {
	if errors.Is(w.ctx.Err(), context.DeadlineExceeded) {
		cause := fmt.Errorf("%w: %s #%d: caller's deadline passed: %w", ErrTimeout, w.d.kind, w.seq, context.Cause(w.ctx))
		h.breakTo(stateFailed, fmt.Errorf("%w after %w", ErrAborted, cause))
		return cause
	}
	cause := fmt.Errorf("%w: %s #%d: caller's ctx ended: %w", ErrAborted, w.d.kind, w.seq, context.Cause(w.ctx))
	h.breakTo(stateFailed, cause)
	return cause
}
