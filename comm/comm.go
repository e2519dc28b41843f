package comm

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"
)

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

// Comm is one rank's communicator: a Backend wrapped with issue-order
// execution, per-op deadlines, revocation, validation, a flight recorder,
// metrics and logs.
//
// All methods are safe for concurrent use. Ops run one at a time in the
// order they were issued (the order their calls took c's lock); a sync op
// issued while the comm is idle runs on the caller's goroutine, anything
// else on the comm's worker goroutine, which starts with the first queued op
// and exits in Close.
type Comm struct {
	b       Backend
	opts    Options // with defaults; Rank/Size/Epoch track b
	log     *zap.Logger
	metrics Metrics
	rec     *flightRecorder

	mu       sync.Mutex
	idle     *sync.Cond // signalled when busy becomes false
	state    commState
	refusal  error // why ops are refused, when state != stateActive
	seq      uint64
	busy     bool        // an op is executing or the worker owns the queue
	acting   int         // deadline or ctx callbacks logging and aborting now
	queue    []*Work     // FIFO of ops waiting for the executor
	cur      *Work       // the op executing now
	deadline time.Time   // of the op executing now (zero: none)
	timer    *time.Timer // fires onDeadline; see armLocked
	timerAt  time.Time   // when timer fires (zero: stopped)
	worker   bool        // the worker goroutine is running
	enq      Enqueuer    // b, when it can start ops before earlier ones complete
	refuser  Refuser     // b, when it can tell its peers of a refused op
	ownCtx   bool        // b watches each op's ctx itself (CtxWatcher): no callback per op
	pending  int         // ops started on enq and not yet completed
	inflight chan *Work  // started ops, in order, to the completer goroutine
	wake     chan struct{}
	quit     chan struct{}
	wg       sync.WaitGroup
	shut     sync.Once     // shutdown runs once; a concurrent caller waits for it
	broken   chan struct{} // closed when state first leaves stateActive
}

// pipelineDepth bounds how many started ops an Enqueuer backend may have
// outstanding.
const pipelineDepth = 64

func wrap(b Backend, opts Options) *Comm {
	opts.Rank, opts.Size, opts.Epoch = b.Rank(), b.Size(), b.Epoch()
	c := &Comm{
		b:       b,
		opts:    opts,
		metrics: opts.Metrics,
		rec:     newFlightRecorder(opts.FlightRecorder),
		wake:    make(chan struct{}, 1),
		quit:    make(chan struct{}),
		broken:  make(chan struct{}),
	}
	c.log = opts.Logger.With(zap.String("comm", opts.Name), zap.String("backend", b.Name()),
		zap.Int("rank", opts.Rank), zap.Int("size", opts.Size), zap.Uint64("epoch", opts.Epoch))
	c.idle = sync.NewCond(&c.mu)
	if e, ok := b.(Enqueuer); ok {
		c.enq = e
		c.inflight = make(chan *Work, pipelineDepth)
	}
	if cw, ok := b.(CtxWatcher); ok {
		c.ownCtx = cw.WatchesCtx()
	}
	if r, ok := b.(Refuser); ok {
		c.refuser = r
	}
	c.timer = time.AfterFunc(time.Hour, c.onDeadline)
	c.timer.Stop()
	if fn, ok := b.(FailureNotifier); ok {
		// Exits when the backend breaks or the comm shuts down.
		c.wg.Add(1)
		go c.watchBackend(fn)
	}
	return c
}

// watchBackend moves the comm out of stateActive the moment its backend
// breaks on its own, with no op running to find out.
func (c *Comm) watchBackend(fn FailureNotifier) {
	defer c.wg.Done()
	select {
	case <-fn.Broken():
	case <-c.quit:
		return
	}
	err := fn.Err()
	if err == nil {
		err = errors.New("the backend broke")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	// An op running now fails with what the backend saw and classifies
	// its own error; act only on a failure no op found.
	for c.state == stateActive && (c.busy || c.acting > 0 || c.pending > 0) {
		c.idle.Wait()
	}
	if c.state != stateActive {
		return
	}
	if errors.Is(err, ErrRevoked) {
		c.breakLocked(stateRevoked, err)
		return
	}
	c.breakLocked(stateFailed, fmt.Errorf("%w: %w", ErrAborted, err))
}

// Broken is closed once the comm refuses collectives — failed, revoked
// or closed — whether an op found out, Abort, Revoke or Close was called,
// or the backend saw a peer fail with no op running (FailureNotifier).
// Err then says why. Layers above select on it to act on a failure at
// once (ft aborts a step's other comms and blames the dead peer).
func (c *Comm) Broken() <-chan struct{} { return c.broken }

// Rank is this process's rank in the comm.
func (c *Comm) Rank() int { return c.opts.Rank }

// Size is the number of ranks.
func (c *Comm) Size() int { return c.opts.Size }

// Epoch is the membership generation the comm was formed in.
func (c *Comm) Epoch() uint64 { return c.opts.Epoch }

// Name is the comm's name from Options.
func (c *Comm) Name() string { return c.opts.Name }

// Backend returns the wrapped backend, for probing optional capabilities.
// Calling its ops directly bypasses ordering and deadlines.
func (c *Comm) Backend() Backend { return c.b }

// Err returns nil while the comm accepts ops, else the error it refuses
// them with (wrapping ErrAborted, ErrTimeout, ErrRevoked or ErrClosed).
func (c *Comm) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.refusal
}

// Work is the handle of an async op.
type Work struct {
	c    *Comm
	seq  uint64
	d    opDesc
	ctx  context.Context
	done chan struct{}
	err  error
	t0   time.Time // started
	at   time.Time // enqueued, when it is executed at once (else zero)

	// Started on an Enqueuer: its completion, deadline and whether the comm
	// was active when it started.
	cpl       Completion
	deadline  time.Time
	wasActive bool
	// timedOut: a Shrink or Grow on a broken comm passed its deadline and
	// the backend was aborted (the comm's state, already broken, stays).
	timedOut error
}

// Wait blocks until the op has completed and returns its error, or returns
// ctx's error if ctx ends first. Returning early does not cancel the op: it
// stays bounded by the ctx it was issued with and the comm's timeout, and its
// buffers stay in use until Done is closed.
func (w *Work) Wait(ctx context.Context) error {
	select {
	case <-w.done:
		return w.err
	case <-ctx.Done():
		return fmt.Errorf("comm: wait for %s #%d: %w", w.d.kind, w.seq, context.Cause(ctx))
	}
}

// Done is closed when the op has completed, successfully or not.
func (w *Work) Done() <-chan struct{} { return w.done }

// Err is the op's error once Done is closed; nil before.
func (w *Work) Err() error {
	select {
	case <-w.done:
		return w.err
	default:
		return nil
	}
}

// Seq is the op's sequence number in its comm (1, 2, …); 0 if it was
// refused before it got one.
func (w *Work) Seq() uint64 { return w.seq }

// FailedWork returns a Work that is already done with err: for layers above
// a Comm that must hand back a Work without issuing an op (no comm exists
// at the moment, say).
func FailedWork(err error) *Work {
	w := &Work{done: make(chan struct{}), err: err}
	close(w.done)
	return w
}

var workPool = sync.Pool{New: func() any { return new(Work) }}

// check returns nil if d is valid here. Otherwise it returns the
// error to fail the op with at once, or sets d.refused and returns nil
// when the op must still take its place in the order to tell the peers
// (a Refuser backend, a collective or point-to-point op).
func (c *Comm) check(d *opDesc) error {
	err := validate(d, c.opts.Rank, c.opts.Size, c.b.Memory())
	if err == nil {
		return nil
	}
	if c.refuser == nil || !d.peerOp() {
		return c.wrapErr(d, 0, err)
	}
	d.refused = err
	return nil
}

// do runs d synchronously and returns its error.
func (c *Comm) do(ctx context.Context, d opDesc) (Backend, error) {
	if err := c.check(&d); err != nil {
		return nil, err
	}
	w := workPool.Get().(*Work)
	*w = Work{c: c, d: d, ctx: ctx}
	c.mu.Lock()
	if c.state == stateClosed {
		c.mu.Unlock()
		workPool.Put(w)
		if d.refused != nil {
			return nil, c.wrapErr(&d, 0, d.refused)
		}
		return nil, c.wrapErr(&d, 0, ErrClosed)
	}
	now := c.enqueueLocked(w)
	if !c.busy && len(c.queue) == 0 {
		c.busy = true
		c.mu.Unlock()
		w.at = now // it starts now: one clock read less per op
		c.execute(w)
		c.mu.Lock()
		c.releaseLocked()
		c.mu.Unlock()
	} else {
		w.done = make(chan struct{})
		c.pushLocked(w)
		c.mu.Unlock()
		<-w.done // bounded: every op ahead has a deadline, and so does this one
	}
	nb, err := w.d.newComm, w.err
	*w = Work{}
	workPool.Put(w)
	return nb, err
}

// start queues d and returns its Work.
func (c *Comm) start(ctx context.Context, d opDesc) *Work {
	w := &Work{c: c, d: d, ctx: ctx, done: make(chan struct{})}
	if err := c.check(&w.d); err != nil {
		w.err = err
		close(w.done)
		return w
	}
	return c.submit(w)
}

// submit queues w, whose op is validated (or refused), and returns it.
func (c *Comm) submit(w *Work) *Work {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.state == stateClosed {
		err := ErrClosed
		if w.d.refused != nil {
			err = w.d.refused
		}
		w.err = c.wrapErr(&w.d, 0, err)
		close(w.done)
		return w
	}
	c.enqueueLocked(w)
	c.pushLocked(w)
	return w
}

func (c *Comm) enqueueLocked(w *Work) time.Time {
	c.seq++
	w.seq = c.seq
	now := time.Now()
	c.rec.enqueue(w.seq, &w.d, now)
	return now
}

// pushLocked appends w to the queue and makes sure someone will run it.
func (c *Comm) pushLocked(w *Work) {
	c.queue = append(c.queue, w)
	if !c.busy {
		c.busy = true
		c.kickLocked()
	}
	c.idle.Broadcast() // a worker waiting for started ops to complete takes new work at once
}

// releaseLocked is called by an inline executor when its op is done: hand
// the queue to the worker, or go idle.
func (c *Comm) releaseLocked() {
	if len(c.queue) > 0 {
		c.kickLocked()
		return
	}
	c.busy = false
	c.idle.Broadcast()
}

func (c *Comm) kickLocked() {
	if !c.worker {
		c.worker = true
		c.wg.Add(1)
		go c.work()
		if c.enq != nil {
			c.wg.Add(1)
			go c.complete()
		}
	}
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// work is the worker goroutine: it drains the queue whenever kicked and
// exits when the comm is closed. On an Enqueuer it starts the ops it can
// without waiting for them (the completer goroutine finishes them) and runs
// any other op only once those have completed; it stays busy until then.
func (c *Comm) work() {
	defer c.wg.Done()
	for {
		select {
		case <-c.wake:
		case <-c.quit:
			return
		}
		for {
			c.mu.Lock()
			for len(c.queue) == 0 && c.pending > 0 {
				c.idle.Wait()
			}
			if len(c.queue) == 0 {
				c.busy = false
				c.idle.Broadcast()
				c.mu.Unlock()
				break
			}
			w := c.queue[0]
			c.queue[0] = nil
			c.queue = c.queue[1:]
			if c.enq != nil && w.d.refused == nil && c.enq.CanStart(w.d.kind) {
				c.mu.Unlock()
				c.startOn(w)
				continue
			}
			for c.pending > 0 {
				c.idle.Wait()
			}
			c.mu.Unlock()
			c.execute(w)
			// With nothing queued behind it, go idle before the op is
			// done, as an inline op does: a caller whose ops are all done
			// finds the comm idle, and its next sync op runs inline.
			// (Nothing is pending: only this goroutine starts ops.)
			c.mu.Lock()
			last := len(c.queue) == 0
			if last {
				c.busy = false
				c.idle.Broadcast()
			}
			c.mu.Unlock()
			close(w.done)
			if last {
				break
			}
		}
	}
}

// startOn starts w on the Enqueuer and hands it to the completer.
func (c *Comm) startOn(w *Work) {
	c.mu.Lock()
	if err := c.refuseLocked(&w.d); err != nil {
		c.mu.Unlock()
		c.finish(w, err)
		close(w.done)
		return
	}
	if err := w.ctx.Err(); err != nil {
		c.mu.Unlock()
		c.finish(w, fmt.Errorf("not started: %w", context.Cause(w.ctx)))
		close(w.done)
		return
	}
	now := time.Now()
	w.t0, w.wasActive = now, c.state == stateActive
	if c.opts.Timeout > 0 {
		w.deadline = now.Add(c.opts.Timeout)
	}
	if d, ok := w.ctx.Deadline(); ok && (w.deadline.IsZero() || d.Before(w.deadline)) {
		w.deadline = d
	}
	c.rec.start(w.seq, now)
	c.pending++
	c.mu.Unlock()
	d := &w.d
	cpl, err := c.enq.Start(w.ctx, Op{Kind: d.kind, Out: d.t, In: d.in, ReduceOp: d.op, Root: d.root, Peer: d.peer,
		Counts: d.counts, InCounts: d.inCounts, P2P: d.p2p})
	if err != nil {
		c.mu.Lock()
		c.pending--
		c.idle.Broadcast()
		err = c.classifyLocked(w, err, w.wasActive)
		c.mu.Unlock()
		c.finish(w, err)
		close(w.done)
		return
	}
	w.cpl = cpl
	c.inflight <- w
}

// complete is the completer goroutine of an Enqueuer comm: it waits for the
// started ops in order, each under its deadline, and finishes them. It exits
// when the comm is closed, after the worker.
func (c *Comm) complete() {
	defer c.wg.Done()
	for w := range c.inflight {
		wctx, cancel := w.ctx, context.CancelFunc(func() {})
		if !w.deadline.IsZero() {
			wctx, cancel = context.WithDeadline(w.ctx, w.deadline)
		}
		err := w.cpl.Wait(wctx)
		expired := wctx.Err() != nil // before cancel, which would set it
		cancel()
		c.mu.Lock()
		var abort error
		if err != nil && w.wasActive && c.state == stateActive {
			switch {
			case w.ctx.Err() != nil:
				abort = c.ctxBreakLocked(w)
			case expired: // our deadline
				abort = fmt.Errorf("%w: %s #%d still running at its deadline (%s after start)",
					ErrTimeout, w.d.kind, w.seq, w.deadline.Sub(w.t0).Round(time.Millisecond))
				c.breakLocked(stateFailed, fmt.Errorf("%w after %w", ErrAborted, abort))
			}
		}
		err = c.classifyLocked(w, err, w.wasActive)
		c.pending--
		c.idle.Broadcast()
		c.mu.Unlock()
		if abort != nil {
			if errors.Is(abort, ErrTimeout) {
				c.log.Error("op timed out; aborting the comm", zap.Uint64("seq", w.seq), zap.Stringer("op", w.d.kind),
					zap.ByteString("flight_recorder", c.Dump()))
			}
			c.b.Abort(abort)
		}
		c.finish(w, err)
		close(w.done)
	}
}

// execute runs one op on the backend under its deadline. The caller owns the
// executor (busy is set).
func (c *Comm) execute(w *Work) {
	c.mu.Lock()
	if err := c.refuseLocked(&w.d); err != nil {
		c.mu.Unlock()
		if w.d.refused != nil {
			err = w.d.refused // the caller's own mistake comes first
		}
		c.finish(w, err)
		return
	}
	// A refused op is told to the peers even when its ctx has ended: they
	// wait for it.
	if err := w.ctx.Err(); err != nil && w.d.refused == nil { // gave up while queued: nothing was sent
		c.mu.Unlock()
		c.finish(w, fmt.Errorf("not started: %w", context.Cause(w.ctx)))
		return
	}
	now := w.at
	if now.IsZero() {
		now = time.Now()
	}
	w.t0 = now
	c.deadline = time.Time{}
	if c.opts.Timeout > 0 {
		c.deadline = now.Add(c.opts.Timeout)
	}
	if d, ok := w.ctx.Deadline(); ok && (c.deadline.IsZero() || d.Before(c.deadline)) {
		c.deadline = d
	}
	c.armLocked(now)
	c.cur = w
	wasActive := c.state == stateActive
	c.rec.start(w.seq, now)
	c.mu.Unlock()

	// A backend that watches the ctx itself returns promptly when it ends,
	// and the check below then breaks the comm: no callback is needed.
	var stop func() bool
	if !c.ownCtx && w.ctx.Done() != nil && w.d.refused == nil {
		seq := w.seq // w may be recycled before a late callback runs: match by seq
		stop = context.AfterFunc(w.ctx, func() { c.onCtxDone(seq) })
	}
	err := c.dispatch(w)
	if stop != nil {
		stop()
	}

	c.mu.Lock()
	c.cur = nil // the timer stays armed: see armLocked
	var abort error
	if err != nil && wasActive && c.state == stateActive && w.ctx.Err() != nil {
		// The backend saw the ctx end (before onCtxDone did, or with no
		// callback armed: a CtxWatcher).
		abort = c.ctxBreakLocked(w)
	}
	err = c.classifyLocked(w, err, wasActive)
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
	c.mu.Unlock()
	if abort != nil {
		c.b.Abort(abort)
	}
	c.finish(w, err)
}

// refuseLocked returns why d cannot run now, or nil.
func (c *Comm) refuseLocked(d *opDesc) error {
	switch {
	case c.state == stateActive:
		return nil
	case c.state == stateClosed:
		return c.refusal
	case d.reconfig:
		return nil // Shrink and Grow are how a broken comm is repaired
	}
	return c.refusal
}

// classifyLocked turns a backend error into the op's error and moves the
// comm to the state the error implies.
func (c *Comm) classifyLocked(w *Work, err error, wasActive bool) error {
	if err == nil {
		return nil
	}
	if (wasActive && c.state != stateActive) || c.state == stateClosed {
		// Aborted, revoked or closed while running: that is the cause; what
		// the backend saw stays matchable (a dead peer's RankError).
		return fmt.Errorf("%w (backend: %w)", c.refusal, err)
	}
	switch {
	case !wasActive:
		// a failed Shrink or Grow leaves the broken comm as it was
	case errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrPeerRefused):
		// refused, here or by a peer, before any data moved: the backend
		// (a Refuser) kept every rank in step, and the comm is still good
	case errors.Is(err, ErrRevoked):
		c.breakLocked(stateRevoked, err)
	default:
		c.breakLocked(stateFailed, fmt.Errorf("%w after %s #%d failed: %w", ErrAborted, w.d.kind, w.seq, err))
	}
	return err
}

// breakLocked moves the comm out of stateActive (or from failed to revoked).
func (c *Comm) breakLocked(s commState, refusal error) {
	if c.state == stateClosed || (c.state == stateRevoked && s == stateFailed) {
		return
	}
	if c.state == stateActive {
		c.log.Warn("comm refuses further collectives", zap.String("state", s.String()), zap.Error(refusal))
		close(c.broken)
	}
	c.state, c.refusal = s, refusal
}

func (c *Comm) finish(w *Work, err error) {
	now := time.Now()
	if err != nil {
		err = c.wrapErr(&w.d, w.seq, err)
	}
	w.err = err
	c.rec.finish(w.seq, now, err)
	if c.metrics != nil && !w.t0.IsZero() {
		c.metrics.ObserveOp(c.opts.Name, w.d.kind, w.d.count()*w.d.dtype().Size(), now.Sub(w.t0), err)
	}
}

func (c *Comm) wrapErr(d *opDesc, seq uint64, err error) error {
	if seq == 0 {
		return fmt.Errorf("comm %s rank %d: %s: %w", c.opts.Name, c.opts.Rank, d.kind, err)
	}
	return fmt.Errorf("comm %s rank %d epoch %d: %s #%d: %w", c.opts.Name, c.opts.Rank, c.opts.Epoch, d.kind, seq, err)
}

// armLocked makes sure the timer fires no later than the deadline of the
// op about to execute. It is lazy: resetting and stopping a runtime timer
// around every op cost about as much as a small shared-memory all-reduce
// itself, so the timer is left armed when an op ends, and reset only when
// the new deadline is earlier than the time it is armed for. Since every
// op's deadline is its start plus the same Timeout (a ctx may only make it
// earlier), a steady stream of ops resets nothing; the timer fires about
// once per Timeout, and onDeadline moves it on to the current op's
// deadline, or lets it rest when no op runs.
func (c *Comm) armLocked(now time.Time) {
	if c.deadline.IsZero() || (!c.timerAt.IsZero() && !c.deadline.Before(c.timerAt)) {
		return
	}
	c.timer.Reset(c.deadline.Sub(now))
	c.timerAt = c.deadline
}

// onDeadline runs on the timer's goroutine when the executing op's deadline
// may have passed.
func (c *Comm) onDeadline() {
	c.mu.Lock()
	c.timerAt = time.Time{}
	w := c.cur
	if w == nil || c.deadline.IsZero() {
		c.mu.Unlock() // no op executes: the timer rests until the next one
		return
	}
	if now := time.Now(); now.Before(c.deadline) {
		c.armLocked(now) // an earlier op's deadline, or an early firing
		c.mu.Unlock()
		return
	}
	// A refusal that Close lets finish keeps its deadline.
	closing := c.state == stateClosed && w.d.refused != nil && w.timedOut == nil
	if !closing && (c.state == stateClosed || (c.state != stateActive && (!w.d.reconfig || w.timedOut != nil))) {
		c.mu.Unlock()
		return
	}
	cause := fmt.Errorf("%w: %s #%d still running at its deadline (%s after start)",
		ErrTimeout, w.d.kind, w.seq, c.deadline.Sub(w.t0).Round(time.Millisecond))
	if c.state == stateActive {
		c.breakLocked(stateFailed, fmt.Errorf("%w after %w", ErrAborted, cause))
	} else {
		// A Shrink or Grow repairing a broken comm, or a refusal Close
		// waits for: its deadline holds too, and the comm stays as it was.
		w.timedOut = cause
	}
	seq, kind := w.seq, w.d.kind
	c.acting++
	c.mu.Unlock()
	defer c.doneActing()
	c.log.Error("op timed out; aborting the comm", zap.Uint64("seq", seq), zap.Stringer("op", kind),
		zap.ByteString("flight_recorder", c.Dump()))
	c.b.Abort(cause)
}

// doneActing ends a callback's action; shutdown waits for it, so nothing
// logs or touches the backend after Close returns.
func (c *Comm) doneActing() {
	c.mu.Lock()
	c.acting--
	c.idle.Broadcast()
	c.mu.Unlock()
}

// onCtxDone runs when the ctx of the executing op w ends: the op cannot be
// abandoned half-way, so the comm is aborted.
func (c *Comm) onCtxDone(seq uint64) {
	c.mu.Lock()
	w := c.cur
	if w == nil || w.seq != seq || c.state != stateActive {
		c.mu.Unlock()
		return
	}
	cause := c.ctxBreakLocked(w)
	c.acting++
	c.mu.Unlock()
	defer c.doneActing()
	c.log.Warn("ctx of a running op ended; aborting the comm", zap.Uint64("seq", seq), zap.Error(cause))
	c.b.Abort(cause)
}

// ctxBreakLocked breaks the comm because w's ctx ended while it ran and
// returns the cause to abort the backend with.
func (c *Comm) ctxBreakLocked(w *Work) error {
	if errors.Is(w.ctx.Err(), context.DeadlineExceeded) {
		cause := fmt.Errorf("%w: %s #%d: caller's deadline passed: %w", ErrTimeout, w.d.kind, w.seq, context.Cause(w.ctx))
		c.breakLocked(stateFailed, fmt.Errorf("%w after %w", ErrAborted, cause))
		return cause
	}
	cause := fmt.Errorf("%w: %s #%d: caller's ctx ended: %w", ErrAborted, w.d.kind, w.seq, context.Cause(w.ctx))
	c.breakLocked(stateFailed, cause)
	return cause
}

func (c *Comm) dispatch(w *Work) error {
	d, ctx, b := &w.d, w.ctx, c.b
	if d.refused != nil {
		// Bounded by the comm's deadline, not by a ctx the caller may have
		// given up on: the peers wait for this.
		return c.refuser.Refuse(context.WithoutCancel(ctx), Op{Kind: d.kind, Out: d.t, In: d.in, ReduceOp: d.op,
			Root: d.root, Peer: d.peer, Counts: d.counts, InCounts: d.inCounts, P2P: d.p2p}, d.refused)
	}
	switch d.kind {
	case OpAllReduce:
		return b.AllReduce(ctx, d.t, d.op)
	case OpReduceScatter:
		return b.ReduceScatter(ctx, d.t, d.in, d.op)
	case OpReduceScatterV:
		return b.ReduceScatterV(ctx, d.t, d.in, d.counts, d.op)
	case OpAllGather:
		return b.AllGather(ctx, d.t, d.in)
	case OpAllGatherV:
		return b.AllGatherV(ctx, d.t, d.in, d.counts)
	case OpBroadcast:
		return b.Broadcast(ctx, d.t, d.root)
	case OpReduce:
		return b.Reduce(ctx, d.t, d.op, d.root)
	case OpScatter:
		return b.Scatter(ctx, d.t, d.in, d.root)
	case OpGather:
		return b.Gather(ctx, d.t, d.in, d.root)
	case OpAllToAll:
		return b.AllToAll(ctx, d.t, d.in)
	case OpAllToAllV:
		return b.AllToAllV(ctx, d.t, d.counts, d.in, d.inCounts)
	case OpBarrier:
		return b.Barrier(ctx)
	case OpSend:
		return b.Send(ctx, d.t, d.peer)
	case OpRecv:
		return b.Recv(ctx, d.t, d.peer)
	case OpBatchP2P:
		return b.BatchP2P(ctx, d.p2p)
	case OpShrink:
		s, ok := b.(Shrinker)
		if !ok {
			return fmt.Errorf("%w: backend %s cannot shrink", ErrBackendUnavailable, b.Name())
		}
		nb, err := s.Shrink(ctx, d.exclude, d.epoch)
		d.newComm = nb
		return err
	case OpGrow:
		g, ok := b.(Grower)
		if !ok {
			return fmt.Errorf("%w: backend %s cannot grow", ErrBackendUnavailable, b.Name())
		}
		nb, err := g.Grow(ctx, d.size, d.epoch)
		d.newComm = nb
		return err
	case OpSplit:
		s, ok := b.(Splitter)
		if !ok {
			return fmt.Errorf("%w: backend %s cannot split", ErrBackendUnavailable, b.Name())
		}
		nb, err := s.Split(ctx, d.color, d.key)
		d.newComm = nb
		return err
	}
	return invalidf("unknown op %s", d.kind)
}

// Refuse fails an op that this rank's caller refused before issuing it,
// as an op whose arguments fail validation here is failed: a layer above
// Comm that checks arguments of its own (the Python API does) calls
// Refuse instead of the op, so that the peers learn of it. op names the
// op (Kind: a collective or point-to-point op) and whom it concerns
// (Root; Peer; the Kind and Peer of each P2P entry; tensors are
// ignored). Refuse returns at once with the op's error, reason wrapped in
// ErrInvalidArgument; on a Refuser backend the refusal takes the op's
// place in the issue order, as an async op would, and the peers' matching
// op fails with ErrPeerRefused naming this rank. On other backends it
// does nothing more.
func (c *Comm) Refuse(ctx context.Context, op Op, reason error) error {
	if reason == nil {
		reason = errors.New("refused by the caller")
	}
	if !errors.Is(reason, ErrInvalidArgument) {
		reason = fmt.Errorf("%w: %w", ErrInvalidArgument, reason)
	}
	d := opDesc{kind: op.Kind, root: op.Root, peer: op.Peer, p2p: op.P2P, refused: reason}
	if c.refuser == nil || !d.peerOp() {
		return c.wrapErr(&d, 0, reason)
	}
	w := c.submit(&Work{c: c, d: d, ctx: ctx, done: make(chan struct{})})
	return c.wrapErr(&d, w.seq, reason)
}

// Abort aborts the comm: the executing op fails at once, and the comm
// refuses further collectives (ErrAborted wrapping cause) until it is shrunk,
// grown or closed. Non-collective; safe from any goroutine, any number of times.
func (c *Comm) Abort(cause error) {
	if cause == nil {
		cause = errors.New("abort requested")
	}
	c.mu.Lock()
	c.breakLocked(stateFailed, fmt.Errorf("%w: %w", ErrAborted, cause))
	closed := c.state == stateClosed
	c.mu.Unlock()
	if !closed {
		c.b.Abort(cause)
	}
}

// Revoke revokes the comm (MPI ULFM semantics): non-collective; the
// executing op and every later op fail with ErrRevoked, here at once and at
// the peers once the revocation reaches them (backends that implement
// Revoker tell their peers; others are aborted). Shrink and Close still
// work. Revoking twice is harmless.
func (c *Comm) Revoke(cause error) {
	if cause == nil {
		cause = errors.New("revoke requested")
	}
	c.mu.Lock()
	if c.state == stateClosed || c.state == stateRevoked {
		c.mu.Unlock()
		return
	}
	c.breakLocked(stateRevoked, fmt.Errorf("%w: %w", ErrRevoked, cause))
	c.mu.Unlock()
	if r, ok := c.b.(Revoker); ok {
		r.Revoke(cause)
	} else {
		c.b.Abort(fmt.Errorf("%w: %w", ErrRevoked, cause))
	}
}

// Close aborts any executing op, fails queued ops with ErrClosed, waits for
// the executor to go idle, stops the worker and closes the backend. A
// refusal (Refuse) that is executing is not aborted but finishes, under its
// deadline: the peers wait for it, its caller has no Work to wait on, and
// aborting the backend would abort the peers' comms too. Safe to call
// twice; the second call returns nil.
func (c *Comm) Close() error {
	c.mu.Lock()
	if c.state == stateClosed {
		c.mu.Unlock()
		c.shutdown() // waits for a shutdown in progress (a Shrink or Grow that replaced c)
		return nil
	}
	running := (c.cur != nil && c.cur.d.refused == nil) || c.pending > 0
	if c.state == stateActive {
		close(c.broken)
	}
	c.state, c.refusal = stateClosed, ErrClosed
	c.mu.Unlock()
	if running {
		c.b.Abort(ErrClosed)
	}
	return c.shutdown()
}

// shutdown waits for the executor to drain (every queued op is refused now),
// stops the worker and closes the backend. It runs once: Close and a
// Shrink or Grow that replaces c may both call it; the later caller waits
// until the first is done and gets nil.
func (c *Comm) shutdown() error {
	var err error
	c.shut.Do(func() {
		c.mu.Lock()
		for c.busy || c.acting > 0 {
			c.idle.Wait()
		}
		c.mu.Unlock()
		close(c.quit)
		if c.inflight != nil {
			close(c.inflight) // after busy went false the worker sends no more
		}
		c.wg.Wait()
		c.timer.Stop()
		err = c.b.Close()
	})
	return err
}

// Shrink forms a new comm of the ranks not in exclude, renumbered
// contiguously in old-rank order, at the given epoch (which must be larger
// than this comm's). Every survivor calls it with the same exclude and
// epoch; excluded ranks do not call it. It works on a failed or revoked comm
// (that is its purpose). On success the old comm is closed and must not be
// used; on failure it is left as it was.
func (c *Comm) Shrink(ctx context.Context, exclude []int, epoch uint64) (*Comm, error) {
	if epoch <= c.opts.Epoch {
		return nil, c.wrapErr(&opDesc{kind: OpShrink}, 0, invalidf("shrink: epoch %d is not after the comm's %d", epoch, c.opts.Epoch))
	}
	return c.reconfigure(ctx, opDesc{kind: OpShrink, exclude: exclude, epoch: epoch, reconfig: true}, true)
}

// Grow forms a comm of size ranks at the given epoch: this comm's ranks keep
// their numbers, and size-Size() joiners, which call New with the same
// backend, Store, Prefix, epoch and the new size, take the ranks above. Every
// existing rank calls it. It works on a failed or revoked comm too, as long
// as no rank is missing. On success the old comm is closed.
func (c *Comm) Grow(ctx context.Context, size int, epoch uint64) (*Comm, error) {
	if epoch <= c.opts.Epoch {
		return nil, c.wrapErr(&opDesc{kind: OpGrow}, 0, invalidf("grow: epoch %d is not after the comm's %d", epoch, c.opts.Epoch))
	}
	return c.reconfigure(ctx, opDesc{kind: OpGrow, size: size, epoch: epoch, reconfig: true}, true)
}

// Split forms new comms like MPI_Comm_split: every rank calls it; ranks with
// the same color form one comm, ordered by (key, old rank). A rank passing
// NoColor gets (nil, nil). The parent comm stays usable.
func (c *Comm) Split(ctx context.Context, color, key int) (*Comm, error) {
	return c.reconfigure(ctx, opDesc{kind: OpSplit, color: color, key: key}, false)
}

func (c *Comm) reconfigure(ctx context.Context, d opDesc, replace bool) (*Comm, error) {
	nb, err := c.do(ctx, d)
	if err != nil || nb == nil {
		return nil, err
	}
	opts := c.opts
	opts.Rank, opts.Size, opts.Epoch = nb.Rank(), nb.Size(), nb.Epoch()
	if d.kind == OpSplit {
		opts.Name = fmt.Sprintf("%s.split%d", c.opts.Name, d.color)
	}
	nc := wrap(nb, opts)
	if replace {
		c.mu.Lock()
		if c.state == stateClosed {
			// Close came as the op completed: the new comm is not wanted.
			c.mu.Unlock()
			nc.Close()
			return nil, c.wrapErr(&d, 0, fmt.Errorf("%w while the %s completed", ErrClosed, d.kind))
		}
		if c.state == stateActive {
			close(c.broken)
		}
		c.state, c.refusal = stateClosed, fmt.Errorf("%w: replaced by %s to epoch %d", ErrClosed, d.kind, d.epoch)
		c.mu.Unlock()
		if err := c.shutdown(); err != nil {
			c.log.Warn("closing the replaced backend", zap.Error(err))
		}
	}
	return nc, nil
}

// FlightRecord returns the last ops this comm ran, oldest first.
func (c *Comm) FlightRecord() FlightDump {
	c.mu.Lock()
	st := c.state
	c.mu.Unlock()
	return FlightDump{Comm: c.opts.Name, Rank: c.opts.Rank, Size: c.opts.Size, Epoch: c.opts.Epoch,
		State: st.String(), Ops: c.rec.entries()}
}

// Dump returns FlightRecord as JSON.
func (c *Comm) Dump() []byte { return c.FlightRecord().json() }
