package nccl

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// Closing a comm and releasing its NCCL comms, stream and scratch memory.

// Close implements comm.Backend. It fails a running op; the watchdog then
// aborts the NCCL comm, waits for the stream to drain and frees it
// (Released is closed when done). Safe to call twice.
//
// On a comm that has not failed, Close first waits for the stream-ordered
// ops (StreamOrder) that returned once enqueued: the caller holds them as
// done, and the abort would cancel their kernels half-way and leave their
// outputs wrong with no op left to say so. The wait ends with the ops or
// at their deadline (ReleaseTimeout for one that has none); if they do
// not complete, Close returns the error that names them. On a comm that
// has failed, its error (returned by the next op or by Err) already says
// that its ordered ops may not have completed, and Close returns at once.
func (b *Backend) Close() error {
	var err error
	b.closeOnce.Do(func() {
		err = b.settleOrdered()
		b.fail(fmt.Errorf("nccl: %w", comm.ErrClosed))
		close(b.closing)
	})
	return err
}

// settleOrdered waits until the comm's stream-ordered ops have completed
// or the comm has failed (an op past its deadline fails it). Called by
// Close before the comm is failed.
func (b *Backend) settleOrdered() error {
	if b.nOrdered.Load() == 0 || b.failed.Load() {
		return nil
	}
	b.settling.Store(true)
	n := b.nOrdered.Load()
	ctx, cancel := context.WithTimeout(context.Background(), b.orderedBound())
	defer cancel()
	err := pollDone(ctx, b.wake, func() (bool, error) {
		b.checkOrdered() // retires completed ops, fails the comm at an op's deadline
		return b.nOrdered.Load() == 0 || b.failed.Load(), nil
	})
	switch {
	case b.nOrdered.Load() == 0:
		return nil
	case b.failed.Load():
		return fmt.Errorf("nccl: closing with %d stream-ordered ops not completed: %w", n, b.failure())
	default:
		return fmt.Errorf("nccl: %w: closing: %d stream-ordered ops still running: %w", comm.ErrTimeout, b.nOrdered.Load(), err)
	}
}

// orderedBound is how long Close may wait for the ordered ops: until the
// latest deadline among them, or ReleaseTimeout from now if one has none.
func (b *Backend) orderedBound() time.Duration {
	b.ordMu.Lock()
	defer b.ordMu.Unlock()
	var last time.Time
	for _, o := range b.ordered {
		if o.deadline.IsZero() {
			return b.cfg.ReleaseTimeout
		}
		if o.deadline.After(last) {
			last = o.deadline
		}
	}
	// A little past the last deadline, so that the watchdog's check at the
	// deadline (which names the op) decides, not this bound.
	return time.Until(last) + 2*b.cfg.WatchdogInterval + time.Millisecond
}

// abortComms calls ncclCommAbort on every NCCL comm of the Backend. After
// it their GPU work is cancelled.
func (b *Backend) abortComms(why string) {
	b.hmu.Lock()
	hs := b.handles()
	b.ctl, b.data = 0, 0
	b.hmu.Unlock()
	for _, h := range hs {
		t0 := time.Now()
		r := b.lib.CommAbort(h)
		b.log.Info("ncclCommAbort", zap.String("why", why), zap.Stringer("result", r), zap.Duration("took", time.Since(t0)))
	}
	b.dirty.Store(false)
}

// abortData aborts a comm a Shrink took out of service (b.data and b.ctl
// no longer name it). ncclCommAbort first raises the comm's abort flag,
// which its kernels poll, so a kernel stuck on a dead peer exits at once;
// freeing the comm takes longer (≈0.5 s after a peer's death on 2×H200).
func (b *Backend) abortData(h libapi.Comm, why string) {
	t0 := time.Now()
	r := b.lib.CommAbort(h)
	b.log.Info("ncclCommAbort (retired by a shrink)", zap.String("why", why), zap.Stringer("result", r), zap.Duration("took", time.Since(t0)))
	b.hmu.Lock()
	shrunk := b.ctl == 0 || b.quiescent
	b.hmu.Unlock()
	if shrunk {
		b.dirty.Store(false)
	}
}

// release aborts the comm, waits for the stream to drain and frees the
// stream and scratch memory.
func (b *Backend) release() error {
	// Close failed the comm, so a running op returns promptly; wait for it
	// to let go of the stream.
	b.opMu.Lock()
	defer b.opMu.Unlock()
	b.hmu.Lock()
	hs := b.handles()
	b.ctl, b.data = 0, 0
	b.hmu.Unlock()
	for len(b.abortQ) > 0 { // handed over by Shrink, not yet aborted
		hs = append([]libapi.Comm{<-b.abortQ}, hs...)
	}
	// ncclCommAbort rather than finalize+destroy: it is local and cannot
	// wait on a peer that is gone. The control and data comms share no
	// resources, so they are aborted at once (each took 0.5 s on an H100
	// even with one rank).
	errs := make([]error, len(hs), len(hs)+4)
	var wg sync.WaitGroup
	for i, h := range hs {
		wg.Go(func() {
			t0 := time.Now()
			if r := b.lib.CommAbort(h); r != libapi.Success {
				errs[i] = fmt.Errorf("nccl: ncclCommAbort: %s", r)
			}
			b.log.Debug("released NCCL comm", zap.Duration("abort", time.Since(t0)))
		})
	}
	wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.ReleaseTimeout)
	defer cancel()
	select { // a control comm still being made gives up at the close (makeControl)
	case <-b.ctlDone:
	case <-ctx.Done():
		errs = append(errs, fmt.Errorf("nccl: %w: the control comm's init did not give up", comm.ErrTimeout))
	}
	if err := pollDone(ctx, nil, func() (bool, error) { return b.lib.StreamQuery(b.dev, b.stream) }); err != nil {
		b.log.Error("stream did not drain after abort; leaking it and the scratch memory", zap.Error(err))
		return errors.Join(append(errs, fmt.Errorf("nccl: stream did not drain: %w", err))...)
	}
	b.dropOrdered()
	b.evMu.Lock()
	for _, ev := range b.events {
		errs = append(errs, b.lib.EventDestroy(b.dev, ev))
	}
	b.events, b.evClosed = nil, true
	b.evMu.Unlock()
	errs = append(errs, b.lib.Free(b.dev, b.scratch), b.lib.StreamDestroy(b.dev, b.stream))
	return errors.Join(errs...)
}
