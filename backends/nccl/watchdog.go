package nccl

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
)

// The watchdog: one goroutine per Backend that reads NCCL's async error
// while an op runs, revokes natively, aborts a failed comm and, after
// Close, releases everything.

// watchdog runs for the Backend's life: it reads NCCL's async error while
// an op runs, performs the native revoke, aborts a failed comm after
// AbortDelay, and on Close releases everything and exits.
func (b *Backend) watchdog() {
	defer close(b.released)
	tick := time.NewTicker(b.cfg.WatchdogInterval)
	defer tick.Stop()
	for {
		select {
		case <-b.closing:
			b.relErr = b.release()
			return
		case <-b.revokeReq:
			b.nativeRevoke()
		case h := <-b.abortQ:
			b.abortData(h, "a shrink retired it")
		case <-tick.C:
			ordered := b.nOrdered.Load() > 0
			if (b.opActive.Load() || ordered) && !b.failed.Load() {
				b.checkAsync()
			}
			if ordered {
				b.checkOrdered()
			}
			if b.cfg.AbortDelay > 0 && b.dirty.Load() {
				b.fmu.Lock()
				due := !b.failAt.IsZero() && time.Since(b.failAt) >= b.cfg.AbortDelay
				b.fmu.Unlock()
				if due {
					b.abortComms("no Shrink or Close within AbortDelay after the failure")
				}
			}
		}
	}
}

// checkAsync fails the comm if NCCL reports an asynchronous error on
// either of its NCCL comms.
func (b *Backend) checkAsync() {
	if !b.hmu.TryLock() {
		return // an enqueue is reading it right now
	}
	var err error
	for _, h := range b.handles() {
		a, r := b.lib.CommGetAsyncError(h)
		switch {
		case r != libapi.Success:
			err = b.ncclError(h, "ncclCommGetAsyncError", r)
		case a != libapi.Success && a != libapi.InProgress:
			err = b.ncclError(h, "asynchronous error", a)
		}
		if err != nil {
			break
		}
	}
	b.hmu.Unlock()
	if err != nil && b.fail(err) {
		b.log.Warn("NCCL reported an asynchronous error", zap.Error(err))
	}
}

// handles lists the live NCCL comms, data first. Called with hmu held.
func (b *Backend) handles() []libapi.Comm {
	var hs []libapi.Comm
	if b.data != 0 {
		hs = append(hs, b.data)
	}
	if b.ctl != 0 && b.ctl != b.data {
		hs = append(hs, b.ctl)
	}
	return hs
}

// pollAsync waits until the comm's async state leaves ncclInProgress and
// returns it, or ncclInProgress if ctx ended or stop closed first.
func (b *Backend) pollAsync(ctx context.Context, h libapi.Comm, stop <-chan struct{}) libapi.Result {
	state := libapi.InProgress
	_ = pollDone(ctx, stop, func() (bool, error) {
		a, r := b.lib.CommGetAsyncError(h)
		if r != libapi.Success {
			state = r
			return true, nil
		}
		state = a
		return a != libapi.InProgress, nil
	})
	return state
}
