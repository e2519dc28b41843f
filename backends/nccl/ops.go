package nccl

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// Issuing ops: launching NCCL calls on the comm's stream, settling a
// nonblocking comm, and waiting for the stream, in the waited-for and
// stream-ordered modes.

// usable returns why no op may run, or nil.
func (b *Backend) usable() error {
	if b.failed.Load() {
		return b.failure()
	}
	return nil
}

// launch issues one NCCL call (a) or a group (ops) on the comm's stream
// and waits until NCCL has accepted it. Collectives go to the data comm;
// in ModeBlockingData point-to-point calls go to the nonblocking control
// comm, since connecting to a peer on a blocking comm would wait for the
// peer inside NCCL. Both comms enqueue on the one stream, so their work
// runs in issue order.
func (b *Backend) launch(ctx context.Context, what string, a *libapi.CollArgs, ops []libapi.CollArgs) error {
	if err := b.usable(); err != nil {
		return err
	}
	if b.local {
		return b.launchLocal(what, a, ops)
	}
	p2p := false
	if b.cfg.Mode == ModeBlockingData {
		if a != nil {
			p2p = a.Kind.PointToPoint()
		}
		for i := range ops {
			p2p = p2p || ops[i].Kind.PointToPoint()
		}
	}
	if p2p {
		if err := b.awaitControl(ctx); err != nil {
			return err
		}
	}
	b.hmu.Lock()
	defer b.hmu.Unlock()
	h, blocking := b.data, b.dataBlocking
	if p2p {
		h, blocking = b.ctl, b.ctlBlocking
	}
	if h == 0 {
		return b.failure()
	}
	t0 := time.Now()
	var r libapi.Result
	if ops != nil {
		r = b.lib.Group(b.dev, h, b.stream, ops)
	} else {
		r = b.lib.Enqueue(b.dev, h, b.stream, a)
	}
	t1 := time.Now()
	var err error
	if blocking {
		// A blocking comm's call returns its final result.
		if r != libapi.Success {
			err = b.ncclError(h, what, r)
			b.fail(err)
		}
	} else {
		err = b.settle(ctx, h, what, r)
	}
	st := &b.stats
	st.ops.Add(1)
	st.enqueueNs.Add(int64(t1.Sub(t0)))
	st.settleNs.Add(int64(time.Since(t1)))
	return err
}

// settle checks an NCCL call's result and, as a nonblocking comm
// requires after every call, polls ncclCommGetAsyncError until it leaves
// ncclInProgress. Called with hmu held.
func (b *Backend) settle(ctx context.Context, h libapi.Comm, what string, r libapi.Result) error {
	if r != libapi.Success && r != libapi.InProgress {
		err := b.ncclError(h, what, r)
		b.fail(err)
		return err
	}
	if r == libapi.InProgress {
		b.stats.inProgress.Add(1)
	}
	var start time.Time
	for i := 0; ; i++ {
		a, cr := b.lib.CommGetAsyncError(h)
		b.stats.settlePolls.Add(1)
		if i == 1 && r != libapi.InProgress {
			b.stats.inProgress.Add(1)
		}
		switch {
		case cr != libapi.Success:
			err := b.ncclError(h, "ncclCommGetAsyncError", cr)
			b.fail(err)
			return err
		case a == libapi.Success:
			return nil
		case a != libapi.InProgress:
			err := b.ncclError(h, what, a)
			b.fail(err)
			return err
		}
		// Still in progress (connection setup, a large group): wait, but
		// stay abortable.
		if b.failed.Load() {
			b.dirty.Store(true)
			return b.failure()
		}
		if err := ctx.Err(); err != nil {
			err = ctxError(ctx, what+" still in progress")
			b.fail(err)
			b.dirty.Store(true)
			return err
		}
		if i == 0 {
			start = time.Now()
		}
		if el := time.Since(start); el > b.cfg.YieldWait {
			time.Sleep(b.cfg.PollInterval)
		} else if el > b.cfg.SpinWait {
			runtime.Gosched()
		}
	}
}

// waitStream waits until the comm's stream has run everything queued on
// it, the comm fails (Abort, Revoke, Close, an async error), or ctx ends.
// It polls busily for SpinWait, then yields until YieldWait, then sleeps
// PollInterval between polls.
func (b *Backend) waitStream(ctx context.Context, what string) error { return b.waitFor(ctx, what, 0) }

// waitFor is waitStream for the work before event ev (0: the whole stream).
func (b *Backend) waitFor(ctx context.Context, what string, ev libapi.Event) error {
	b.opActive.Store(true)
	t0 := time.Now()
	polls := int64(0)
	defer func() {
		b.opActive.Store(false)
		b.stats.waitPolls.Add(polls)
		b.stats.waitNs.Add(int64(time.Since(t0)))
	}()
	done := ctx.Done()
	var start time.Time
	var timer *time.Timer
	for i := 0; ; i++ {
		var ok bool
		var err error
		if ev != 0 {
			ok, err = b.lib.EventQuery(ev)
		} else {
			ok, err = b.lib.StreamQuery(b.dev, b.stream)
		}
		polls++
		if err != nil {
			err = fmt.Errorf("nccl: %w: %s: %w", comm.ErrAborted, what, err)
			b.fail(err)
			return err
		}
		if ok {
			if timer != nil {
				timer.Stop()
			}
			// A revoke or abort also drains the stream, by killing the
			// kernels: a comm that failed meanwhile did not run the op.
			if b.failed.Load() {
				return b.failure()
			}
			return nil
		}
		if b.failed.Load() {
			b.dirty.Store(true)
			return b.failure()
		}
		if done != nil {
			select {
			case <-done:
				err := ctxError(ctx, what)
				b.fail(err)
				b.dirty.Store(true)
				return err
			default:
			}
		}
		if i == 0 {
			start = time.Now()
			continue
		}
		el := time.Since(start)
		if el < b.cfg.SpinWait {
			continue
		}
		if el < b.cfg.YieldWait {
			runtime.Gosched()
			continue
		}
		if timer == nil {
			timer = time.NewTimer(b.cfg.PollInterval)
		} else {
			timer.Reset(b.cfg.PollInterval)
		}
		select {
		case <-timer.C:
		case <-b.wake:
		case <-done:
		}
	}
}

// run issues one call and waits for it; with a StreamOrder (not Async)
// it returns once the call is enqueued.
func (b *Backend) run(ctx context.Context, what string, a libapi.CollArgs) error {
	b.opMu.Lock()
	defer b.opMu.Unlock()
	so, ordered := streamOrderOf(ctx)
	if ordered {
		if err := b.usable(); err != nil {
			return err
		}
		if err := b.waitOn(so.Stream, what); err != nil {
			return err
		}
	}
	if err := b.launch(ctx, what, &a, nil); err != nil {
		return err
	}
	if ordered && !so.Async && !a.Kind.PointToPoint() {
		return b.signal(ctx, so.Stream, what)
	}
	return b.waitStream(ctx, what)
}

// runGroup issues b.group (after an optional device-to-device copy on the
// stream) and waits for it.
func (b *Backend) runGroup(ctx context.Context, what string, copyDst, copySrc uintptr, copyBytes int) error {
	b.opMu.Lock()
	defer b.opMu.Unlock()
	if err := b.usable(); err != nil {
		return err
	}
	if so, ok := streamOrderOf(ctx); ok {
		// Waited for on the host below, so the stream needs no signal.
		if err := b.waitOn(so.Stream, what); err != nil {
			return err
		}
	}
	if copyBytes > 0 {
		if err := b.lib.CopyDtoD(b.dev, copyDst, copySrc, copyBytes, b.stream); err != nil {
			err = fmt.Errorf("nccl: %w: %s: %w", comm.ErrAborted, what, err)
			b.fail(err)
			return err
		}
	}
	if len(b.group) > 0 {
		if err := b.launch(ctx, what, nil, b.group); err != nil {
			return err
		}
	}
	return b.waitStream(ctx, what)
}

// allReduceScratch sums one int32 of scratch across the comm (warm-up and
// Barrier).
func (b *Backend) allReduceScratch(ctx context.Context) error {
	return b.run(ctx, "barrier", libapi.CollArgs{Kind: libapi.AllReduce, Type: libapi.Int32, Op: libapi.Sum,
		Send: b.scratch, Recv: b.scratch, Count: 1})
}

// CanStart implements comm.Enqueuer: the collectives that are one NCCL call
// can be started without waiting for the ones before them.
func (b *Backend) CanStart(kind comm.OpType) bool {
	switch kind {
	case comm.OpAllReduce, comm.OpReduceScatter, comm.OpAllGather, comm.OpBroadcast, comm.OpReduce:
		return true
	}
	return false
}

// Start implements comm.Enqueuer: it enqueues op on the comm's stream,
// records an event behind it and returns a completion that waits for the
// event, so comm.Comm can keep the stream full (nccl-tests' pipelined
// latency instead of one op's round trip).
func (b *Backend) Start(ctx context.Context, op comm.Op) (comm.Completion, error) {
	var a libapi.CollArgs
	var err error
	what := op.Kind.String()
	switch op.Kind {
	case comm.OpAllReduce:
		a, err = b.allReduceArgs(op.Out, op.ReduceOp)
	case comm.OpReduceScatter:
		a, err = b.reduceScatterArgs(op.Out, op.In, op.ReduceOp)
	case comm.OpAllGather:
		a, err = b.allGatherArgs(op.Out, op.In)
	case comm.OpBroadcast:
		a, err = b.broadcastArgs(op.Out, op.Root)
	case comm.OpReduce:
		a, err = b.reduceArgs(op.Out, op.ReduceOp, op.Root)
	default:
		return nil, fmt.Errorf("nccl: %w: %s cannot be started without waiting", comm.ErrInvalidArgument, op.Kind)
	}
	if err != nil {
		return nil, err
	}
	if a.Count == 0 {
		return doneCompletion{}, nil
	}
	b.opMu.Lock()
	defer b.opMu.Unlock()
	so, ordered := streamOrderOf(ctx)
	if ordered {
		if err := b.usable(); err != nil {
			return nil, err
		}
		if err := b.waitOn(so.Stream, what); err != nil {
			return nil, err
		}
	}
	if err := b.launch(ctx, what, &a, nil); err != nil {
		return nil, err
	}
	ev, err := b.event()
	if err == nil {
		err = b.lib.EventRecord(b.dev, ev, b.stream)
		if err == nil && ordered && !so.Async {
			err = b.lib.StreamWaitEvent(b.dev, libapi.Stream(so.Stream), ev)
		}
		if err != nil {
			b.putEvent(ev)
		}
	}
	if err != nil {
		err = fmt.Errorf("nccl: %w: %s: record completion event: %w", comm.ErrAborted, what, err)
		b.fail(err)
		return nil, err
	}
	return &started{b: b, ev: ev, what: what}, nil
}

// started is an op enqueued by Start.
type started struct {
	b    *Backend
	ev   libapi.Event
	what string
}

// Wait implements comm.Completion.
func (s *started) Wait(ctx context.Context) error {
	defer s.b.putEvent(s.ev)
	return s.b.waitFor(ctx, s.what, s.ev)
}

type doneCompletion struct{}

func (doneCompletion) Wait(context.Context) error { return nil }

// event takes a completion event from the pool (or makes one).
func (b *Backend) event() (libapi.Event, error) {
	b.evMu.Lock()
	if n := len(b.events); n > 0 {
		ev := b.events[n-1]
		b.events = b.events[:n-1]
		b.evMu.Unlock()
		return ev, nil
	}
	b.evMu.Unlock()
	return b.lib.EventCreate(b.dev, false)
}

// putEvent returns ev to the pool, or destroys it once the comm is released.
func (b *Backend) putEvent(ev libapi.Event) {
	b.evMu.Lock()
	defer b.evMu.Unlock()
	if b.evClosed {
		b.lib.EventDestroy(b.dev, ev)
		return
	}
	b.events = append(b.events, ev)
}

// EnqueueAllReduce queues an in-place all-reduce of t on the comm's stream
// and returns as soon as NCCL has accepted it, without waiting for it to
// complete; Synchronize waits for everything queued. It exists to measure
// what a stream-ordered (non-blocking) comm contract would gain over the
// blocking one (see the benchmark); use it only outside a comm.Comm, from
// one goroutine.
func (b *Backend) EnqueueAllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) error {
	a, err := b.allReduceArgs(t, op)
	if err != nil || a.Count == 0 {
		return err
	}
	b.opMu.Lock()
	defer b.opMu.Unlock()
	return b.launch(ctx, "allreduce", &a, nil)
}

// Synchronize waits until every op queued on the comm's stream is done.
func (b *Backend) Synchronize(ctx context.Context) error {
	b.opMu.Lock()
	defer b.opMu.Unlock()
	if err := b.usable(); err != nil {
		return err
	}
	return b.waitStream(ctx, "synchronize")
}

// launchLocal issues an op of a local one-rank comm (Backend.local) as
// what NCCL makes of a one-rank call: a device-to-device copy on the
// comm's stream from the send buffer to the receive buffer, none where
// they are the same (in place) or the op moves nothing. A reduction over
// one rank is its input, whatever the op; a root or peer can only be
// rank 0, which the argument checks ensured. The sends and receives of a
// group pair up in order (NCCL's order for one peer); a send without its
// receive, which NCCL would leave waiting, is refused.
func (b *Backend) launchLocal(what string, a *libapi.CollArgs, ops []libapi.CollArgs) error {
	if a != nil {
		return b.copyLocal(what, a.Type, a.Recv, a.Send, a.Count)
	}
	var sends, recvs []int
	for i := range ops {
		switch ops[i].Kind {
		case libapi.Send:
			sends = append(sends, i)
		case libapi.Recv:
			recvs = append(recvs, i)
		}
	}
	if len(sends) != len(recvs) {
		return fmt.Errorf("nccl: %w: %s: %d sends and %d receives on a one-rank comm: each send to itself needs its receive in the same group",
			comm.ErrInvalidArgument, what, len(sends), len(recvs))
	}
	for i, si := range sends {
		s, r := &ops[si], &ops[recvs[i]]
		if s.Count != r.Count || s.Type != r.Type {
			return fmt.Errorf("nccl: %w: %s: send %d of %d elements of type %d, its receive %d of type %d",
				comm.ErrMismatch, what, i, s.Count, s.Type, r.Count, r.Type)
		}
	}
	// Nothing is issued before the whole group is known to be valid.
	for i := range ops {
		if k := ops[i].Kind; k != libapi.Send && k != libapi.Recv {
			if err := b.copyLocal(what, ops[i].Type, ops[i].Recv, ops[i].Send, ops[i].Count); err != nil {
				return err
			}
		}
	}
	for i, si := range sends {
		s, r := &ops[si], &ops[recvs[i]]
		if err := b.copyLocal(what, s.Type, r.Recv, s.Send, s.Count); err != nil {
			return err
		}
	}
	return nil
}

// copyLocal copies count elements of t from src to dst on the stream.
func (b *Backend) copyLocal(what string, t libapi.DataType, dst, src uintptr, count uint64) error {
	b.stats.ops.Add(1)
	n := count * uint64(t.Size())
	if n == 0 || dst == src || dst == 0 {
		return nil
	}
	if err := b.lib.CopyDtoD(b.dev, dst, src, int(n), b.stream); err != nil {
		err = fmt.Errorf("nccl: %w: %s on one rank: %w", comm.ErrAborted, what, err)
		b.fail(err)
		return err
	}
	return nil
}
