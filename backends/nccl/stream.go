package nccl

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// StreamOrder orders one op with a CUDA stream the caller owns, as
// torch.distributed orders a collective with PyTorch's current stream; the
// Python package passes it for every op on CUDA tensors. Attach it to the
// op's ctx with WithStreamOrder.
//
//   - Before the op is enqueued, the comm's stream waits for the work
//     queued on Stream so far (an event recorded there and
//     cudaStreamWaitEvent): the op reads what that work wrote.
//   - Unless Async, Stream then waits for the op (an event recorded behind
//     it), so work queued on Stream afterwards sees its result; and the
//     ops that are one NCCL call (AllReduce, ReduceScatter, AllGather,
//     Broadcast, Reduce, Barrier) return as soon as they are enqueued,
//     without waiting on the host: the watchdog follows their completion
//     and fails the comm with comm.ErrTimeout (aborting its NCCL comms, so
//     Stream is released) if one is still running at its deadline, which
//     is the ctx's deadline or else now + comm.Options.Timeout. Failures
//     after the return reach the caller through the comm's next op. Other
//     ops (point-to-point, grouped) still return when complete.
//   - With Async the op returns (or its Work completes) when it has
//     completed, as without a StreamOrder; only the first point holds.
//
// Stream is a cudaStream_t of the CUDA runtime this package loaded, on the
// comm's device; 0 is the legacy default stream. No device-wide
// synchronisation is involved.
type StreamOrder struct {
	Stream uintptr
	Async  bool
}

type streamOrderKey struct{}

// WithStreamOrder returns ctx carrying o for the op it is passed to.
func WithStreamOrder(ctx context.Context, o StreamOrder) context.Context {
	return context.WithValue(ctx, streamOrderKey{}, o)
}

func streamOrderOf(ctx context.Context) (StreamOrder, bool) {
	o, ok := ctx.Value(streamOrderKey{}).(StreamOrder)
	return o, ok
}

// orderedOp is an op that returned once enqueued (StreamOrder without
// Async); the watchdog follows it.
type orderedOp struct {
	ev       libapi.Event
	deadline time.Time
	what     string
}

// waitOn makes the comm's stream wait for the work queued on s so far.
// Called with opMu held, before the op is enqueued; nothing was enqueued
// if it fails, so the comm stays usable.
func (b *Backend) waitOn(s uintptr, what string) error {
	ev, err := b.event()
	if err == nil {
		if err = b.lib.EventRecord(b.dev, ev, libapi.Stream(s)); err == nil {
			err = b.lib.StreamWaitEvent(b.dev, b.stream, ev)
		}
		b.putEvent(ev) // the wait took the record; the event may be recorded again
	}
	if err != nil {
		return fmt.Errorf("nccl: %w: %s: order after stream %#x: %w", comm.ErrInvalidArgument, what, s, err)
	}
	return nil
}

// signal makes s wait for everything enqueued on the comm's stream so far
// and hands the op to the watchdog, to be done by deadline. Called with
// opMu held, after the op was enqueued: a failure here fails the comm.
func (b *Backend) signal(ctx context.Context, s uintptr, what string) error {
	ev, err := b.event()
	if err == nil {
		err = b.lib.EventRecord(b.dev, ev, b.stream)
		if err == nil {
			err = b.lib.StreamWaitEvent(b.dev, libapi.Stream(s), ev)
		}
		if err != nil {
			b.putEvent(ev)
		}
	}
	if err != nil {
		err = fmt.Errorf("nccl: %w: %s: order stream %#x after the op: %w", comm.ErrAborted, what, s, err)
		b.fail(err)
		return err
	}
	deadline, ok := ctx.Deadline()
	if t := b.opts.Timeout; t > 0 && (!ok || time.Now().Add(t).Before(deadline)) {
		deadline, ok = time.Now().Add(t), true
	}
	if !ok {
		deadline = time.Time{}
	}
	b.ordMu.Lock()
	b.ordered = append(b.ordered, orderedOp{ev: ev, deadline: deadline, what: what})
	b.nOrdered.Store(int64(len(b.ordered)))
	b.ordMu.Unlock()
	return nil
}

// checkOrdered retires the ordered ops that completed and fails the comm
// if the oldest still running passed its deadline. Run by the watchdog.
func (b *Backend) checkOrdered() {
	b.ordMu.Lock()
	defer b.ordMu.Unlock()
	n := 0
	for _, o := range b.ordered {
		done, err := b.lib.EventQuery(o.ev)
		if err != nil && b.fail(fmt.Errorf("nccl: %w: %s: %w", comm.ErrAborted, o.what, err)) {
			b.dirty.Store(true)
		}
		if !done {
			break
		}
		b.putEvent(o.ev)
		n++
	}
	b.ordered = b.ordered[n:]
	b.nOrdered.Store(int64(len(b.ordered)))
	if len(b.ordered) == 0 {
		return
	}
	o := b.ordered[0]
	if o.deadline.IsZero() || time.Now().Before(o.deadline) || b.failed.Load() {
		return
	}
	err := fmt.Errorf("nccl: %w: %s (stream-ordered) still running at its deadline", comm.ErrTimeout, o.what)
	if b.fail(err) {
		b.log.Error("stream-ordered op timed out; aborting the NCCL comms", zap.String("op", o.what))
		b.dirty.Store(true)
		b.abortComms("a stream-ordered op passed its deadline")
	}
}

// dropOrdered forgets the ordered ops after the stream drained (release).
func (b *Backend) dropOrdered() {
	b.ordMu.Lock()
	defer b.ordMu.Unlock()
	for _, o := range b.ordered {
		b.putEvent(o.ev)
	}
	b.ordered = nil
	b.nOrdered.Store(0)
}
