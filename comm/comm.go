package comm

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Comm is one rank's communicator: a Backend wrapped with issue-order
// execution, per-op deadlines, revocation, validation, a flight recorder,
// metrics and logs.
//
// All methods are safe for concurrent use. Ops run one at a time in the
// order they were issued; a sync op issued while the comm is idle runs on
// the caller's goroutine, anything else on the comm's worker goroutine,
// which starts with the first queued op and exits in Close. Who runs an op,
// and whether the comm takes it, is its lifecycle's (see lifecycle): the
// one place that state and its lock live.
type Comm struct {
	b       Backend
	opts    Options // with defaults; Rank/Size/Epoch track b
	log     *zap.Logger
	metrics Metrics
	rec     *flightRecorder
	enq     Enqueuer // b, when it can start ops before earlier ones complete
	refuser Refuser  // b, when it can tell its peers of a refused op
	ownCtx  bool     // b watches each op's ctx itself (CtxWatcher): no callback per op

	life     *lifecycle
	timer    *deadlineTimer // fires onDeadline
	inflight chan *Work     // started ops, in order, to the completer goroutine
	wg       sync.WaitGroup // the worker, completer and backend-watching goroutines
	shut     sync.Once      // shutdown runs once; a concurrent caller waits for it
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
	}
	c.log = opts.Logger.With(zap.String("comm", opts.Name), zap.String("backend", b.Name()),
		zap.Int("rank", opts.Rank), zap.Int("size", opts.Size), zap.Uint64("epoch", opts.Epoch))
	var startable func(*Work) bool
	if e, ok := b.(Enqueuer); ok {
		c.enq = e
		c.inflight = make(chan *Work, pipelineDepth)
		startable = func(w *Work) bool { return w.d.refused == nil && e.CanStart(w.d.kind) }
	}
	if cw, ok := b.(CtxWatcher); ok {
		c.ownCtx = cw.WatchesCtx()
	}
	if r, ok := b.(Refuser); ok {
		c.refuser = r
	}
	c.life = newLifecycle(c.log, c.rec, c.spawn, startable)
	c.timer = newDeadlineTimer(c.onDeadline)
	if fn, ok := b.(FailureNotifier); ok {
		// Exits when the backend breaks or the comm does (Close included).
		c.wg.Add(1)
		go c.watchBackend(fn)
	}
	return c
}

// spawn starts the worker goroutine, and on an Enqueuer the completer; both
// exit in shutdown. The lifecycle calls it on its first hand-off to the
// worker.
func (c *Comm) spawn() {
	c.wg.Add(1)
	go c.work()
	if c.enq != nil {
		c.wg.Add(1)
		go c.complete()
	}
}

// watchBackend moves the comm out of stateActive the moment its backend
// breaks on its own, with no op running to find out.
func (c *Comm) watchBackend(fn FailureNotifier) {
	defer c.wg.Done()
	select {
	case <-fn.Broken():
	case <-c.life.broken(): // broken or closed already: nothing to add
		return
	}
	err := fn.Err()
	if err == nil {
		err = errors.New("the backend broke")
	}
	c.life.backendBroke(err)
}

// Broken is closed once the comm refuses collectives — failed, revoked
// or closed — whether an op found out, Abort, Revoke or Close was called,
// or the backend saw a peer fail with no op running (FailureNotifier).
// Err then says why. Layers above select on it to act on a failure at
// once (ft aborts a step's other comms and blames the dead peer).
func (c *Comm) Broken() <-chan struct{} { return c.life.broken() }

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
func (c *Comm) Err() error { return c.life.err() }

// Work is the handle of an async op.
type Work struct {
	seq  uint64
	d    opDesc
	ctx  context.Context
	done chan struct{}
	err  error
	at   time.Time // enqueued, when it runs at once on its caller's goroutine (else zero)

	// Set as the op is admitted (lifecycle.begin): when it started, its
	// deadline (zero: none) and whether the comm was active.
	t0        time.Time
	deadline  time.Time
	wasActive bool
	cpl       Completion // started on an Enqueuer: its completion
	// timedOut: a Shrink or Grow on a broken comm (or a refusal Close waits
	// for) passed its deadline and the backend was aborted (the comm's
	// state stays).
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
	*w = Work{d: d, ctx: ctx}
	here, err := c.life.issue(w, true)
	if err != nil {
		workPool.Put(w)
		return nil, c.wrapErr(&d, 0, refusedFirst(&d, err))
	}
	if here {
		c.execute(w)
		c.life.release()
	} else {
		<-w.done // bounded: every op ahead has a deadline, and so does this one
	}
	nb, err := w.d.newComm, w.err
	*w = Work{}
	workPool.Put(w)
	return nb, err
}

// start queues d and returns its Work.
func (c *Comm) start(ctx context.Context, d opDesc) *Work {
	w := &Work{d: d, ctx: ctx, done: make(chan struct{})}
	if err := c.check(&w.d); err != nil {
		w.err = err
		close(w.done)
		return w
	}
	return c.submit(w)
}

// submit queues w, whose op is validated (or refused), and returns it.
func (c *Comm) submit(w *Work) *Work {
	if _, err := c.life.issue(w, false); err != nil {
		w.err = c.wrapErr(&w.d, 0, refusedFirst(&w.d, err))
		close(w.done)
	}
	return w
}

// refusedFirst is the error of an op the comm would not take: this rank's
// own refusal of it, if any, comes before err.
func refusedFirst(d *opDesc, err error) error {
	if d.refused != nil {
		return d.refused
	}
	return err
}

// work is the worker goroutine: it runs the queued ops the lifecycle hands
// it, starting those it can on an Enqueuer (the completer goroutine ends
// them), and exits in shutdown.
func (c *Comm) work() {
	defer c.wg.Done()
	for {
		w, start := c.life.next()
		switch {
		case w == nil:
			return
		case start:
			c.startOn(w)
		default:
			c.execute(w)
			c.life.ran()
			close(w.done)
		}
	}
}

// startOn starts w on the Enqueuer and hands it to the completer.
func (c *Comm) startOn(w *Work) {
	now := time.Now()
	if err := c.life.begin(w, now, c.deadlineAt(w.ctx, now), true); err != nil {
		c.finish(w, err)
		close(w.done)
		return
	}
	c.rec.start(w.seq, now)
	d := &w.d
	cpl, err := c.enq.Start(w.ctx, Op{Kind: d.kind, Out: d.t, In: d.in, ReduceOp: d.op, Root: d.root, Peer: d.peer,
		Counts: d.counts, InCounts: d.inCounts, P2P: d.p2p})
	if err != nil {
		c.finish(w, c.life.startFailed(w, err))
		close(w.done)
		return
	}
	w.cpl = cpl
	c.inflight <- w
}

// complete is the completer goroutine of an Enqueuer comm: it waits for the
// started ops in order, each under its deadline, and ends them. It exits
// in shutdown, after the worker.
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
		err, abort := c.life.end(w, err, expired)
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

// execute runs one op on the backend under its deadline, on the goroutine
// of the executor's owner (see lifecycle).
func (c *Comm) execute(w *Work) {
	now := w.at
	if now.IsZero() {
		now = time.Now()
	}
	if err := c.life.begin(w, now, c.deadlineAt(w.ctx, now), false); err != nil {
		c.finish(w, err)
		return
	}
	c.timer.arm(w.deadline, now)
	c.rec.start(w.seq, now)

	// A backend that watches the ctx itself returns promptly when it ends,
	// and the lifecycle then breaks the comm: no callback is needed.
	var stop func() bool
	if !c.ownCtx && w.ctx.Done() != nil && w.d.refused == nil {
		seq := w.seq // w may be recycled before a late callback runs: match by seq
		stop = context.AfterFunc(w.ctx, func() { c.onCtxDone(seq) })
	}
	err := c.dispatch(w)
	if stop != nil {
		stop()
	}
	err, abort := c.life.end(w, err, false)
	if abort != nil {
		c.b.Abort(abort)
	}
	c.finish(w, err)
}

// deadlineAt is when an op that starts at now must end: Options.Timeout
// later, or at its ctx's deadline if that is earlier; zero for none.
func (c *Comm) deadlineAt(ctx context.Context, now time.Time) time.Time {
	var deadline time.Time
	if c.opts.Timeout > 0 {
		deadline = now.Add(c.opts.Timeout)
	}
	if d, ok := ctx.Deadline(); ok && (deadline.IsZero() || d.Before(deadline)) {
		deadline = d
	}
	return deadline
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

// onDeadline runs on the timer's goroutine when the running op's deadline
// may have passed.
func (c *Comm) onDeadline() {
	c.timer.fired()
	now := time.Now()
	cause, seq, kind, due := c.life.overdue(now)
	if cause == nil {
		c.timer.arm(due, now)
		return
	}
	defer c.life.doneActing()
	c.log.Error("op timed out; aborting the comm", zap.Uint64("seq", seq), zap.Stringer("op", kind),
		zap.ByteString("flight_recorder", c.Dump()))
	c.b.Abort(cause)
}

// onCtxDone runs when the ctx of the running op seq ends: the op cannot be
// abandoned half-way, so the comm is aborted.
func (c *Comm) onCtxDone(seq uint64) {
	cause := c.life.ctxEnded(seq)
	if cause == nil {
		return
	}
	defer c.life.doneActing()
	c.log.Warn("ctx of a running op ended; aborting the comm", zap.Uint64("seq", seq), zap.Error(cause))
	c.b.Abort(cause)
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
	w := c.submit(&Work{d: d, ctx: ctx, done: make(chan struct{})})
	return c.wrapErr(&d, w.seq, reason)
}

// Abort aborts the comm: the executing op fails at once, and the comm
// refuses further collectives (ErrAborted wrapping cause) until it is shrunk,
// grown or closed. Non-collective; safe from any goroutine, any number of times.
func (c *Comm) Abort(cause error) {
	if cause == nil {
		cause = errors.New("abort requested")
	}
	if closed := c.life.abort(fmt.Errorf("%w: %w", ErrAborted, cause)); !closed {
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
	if !c.life.revoke(fmt.Errorf("%w: %w", ErrRevoked, cause)) {
		return
	}
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
	first, abort := c.life.close()
	if !first {
		c.shutdown() // waits for a shutdown in progress (a Shrink or Grow that replaced c)
		return nil
	}
	if abort {
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
		c.life.shutdown()
		if c.inflight != nil {
			close(c.inflight) // the worker has stopped: it sends no more
		}
		c.wg.Wait()
		c.timer.stop()
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
		if !c.life.replace(fmt.Errorf("%w: replaced by %s to epoch %d", ErrClosed, d.kind, d.epoch)) {
			// Close came as the op completed: the new comm is not wanted.
			nc.Close()
			return nil, c.wrapErr(&d, 0, fmt.Errorf("%w while the %s completed", ErrClosed, d.kind))
		}
		if err := c.shutdown(); err != nil {
			c.log.Warn("closing the replaced backend", zap.Error(err))
		}
	}
	return nc, nil
}

// FlightRecord returns the last ops this comm ran, oldest first.
func (c *Comm) FlightRecord() FlightDump {
	return FlightDump{Comm: c.opts.Name, Rank: c.opts.Rank, Size: c.opts.Size, Epoch: c.opts.Epoch,
		State: c.life.state().String(), Ops: c.rec.entries()}
}

// Dump returns FlightRecord as JSON.
func (c *Comm) Dump() []byte { return c.FlightRecord().json() }
