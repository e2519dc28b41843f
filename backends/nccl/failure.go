package nccl

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// How a comm fails: the first failure is sticky and wakes the running
// op; Abort and Revoke fail it from outside; NCCL's results become
// errors.

// fail records the comm's first failure and wakes the running op. It
// reports whether err was the first.
func (b *Backend) fail(err error) bool {
	b.fmu.Lock()
	defer b.fmu.Unlock()
	if b.failErr != nil {
		return false
	}
	b.failErr, b.failAt = err, time.Now()
	b.failed.Store(true)
	close(b.wake)
	if b.opActive.Load() || b.nOrdered.Load() > 0 {
		b.dirty.Store(true)
	}
	return true
}

// failure is the error ops fail with once the comm has failed.
func (b *Backend) failure() error {
	b.fmu.Lock()
	defer b.fmu.Unlock()
	return b.failErr
}

// Abort implements comm.Backend: the running op fails at once; the NCCL
// comm is cancelled by the next Shrink, by Close, or by the watchdog after
// Config.AbortDelay.
func (b *Backend) Abort(cause error) {
	if cause == nil {
		cause = errors.New("abort requested")
	}
	if b.fail(fmt.Errorf("nccl: %w: %w", comm.ErrAborted, cause)) {
		b.log.Info("aborted", zap.Error(cause))
	}
}

// Revoke implements comm.Revoker: the running op and every later one fail
// with comm.ErrRevoked at once. What happens on the GPU follows
// Config.Revoke. Peers learn of the revocation from the membership layer,
// not through NCCL (ncclCommRevoke is local).
func (b *Backend) Revoke(cause error) {
	if cause == nil {
		cause = errors.New("revoke requested")
	}
	if !b.fail(fmt.Errorf("nccl: %w: %w", comm.ErrRevoked, cause)) {
		return
	}
	b.log.Info("revoked", zap.Error(cause))
	if b.revokeNative {
		select {
		case b.revokeReq <- struct{}{}:
		default:
		}
	}
}

// ncclError turns a failed NCCL result into an error the comm layer can
// branch on, with NCCL's own last-error text.
func (b *Backend) ncclError(h libapi.Comm, what string, r libapi.Result) error {
	msg := b.lib.ErrorString(r)
	if h != 0 {
		if last := b.lib.LastError(h); last != "" {
			msg += ": " + last
		}
	}
	sentinel := comm.ErrAborted
	switch r {
	case libapi.RemoteError:
		sentinel = comm.ErrPeerFailed
	case libapi.Timeout:
		sentinel = comm.ErrTimeout
	}
	return fmt.Errorf("nccl: %w: %s: %s (%s)", sentinel, what, r, msg)
}

// ctxError is the error of an op abandoned because ctx ended.
func ctxError(ctx context.Context, what string) error {
	cause := context.Cause(ctx)
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("nccl: %w: %s: %w", comm.ErrTimeout, what, cause)
	}
	return fmt.Errorf("nccl: %w: %s: %w", comm.ErrAborted, what, cause)
}

// nativeRevoke runs ncclCommRevoke on the control comm and waits for it to
// quiesce (a separate data comm is aborted first: its kernels are its
// own), or aborts the comms where the library has no revoke.
func (b *Backend) nativeRevoke() {
	if !b.L.info.Features.Revoke {
		b.abortComms("revoke without ncclCommRevoke")
		return
	}
	b.hmu.Lock()
	h, d := b.ctl, b.data
	if d == h {
		d = 0
	} else {
		b.data = 0
	}
	b.hmu.Unlock()
	if d != 0 {
		b.abortData(d, "revoke")
	}
	b.hmu.Lock()
	defer b.hmu.Unlock()
	if h == 0 || b.ctl != h {
		return
	}
	t0 := time.Now()
	r := b.lib.CommRevoke(h)
	if r == libapi.Success || r == libapi.InProgress {
		ctx, cancel := context.WithTimeout(context.Background(), b.cfg.ReleaseTimeout)
		defer cancel()
		r = b.pollAsync(ctx, h, b.closing)
	}
	if r == libapi.InProgress && isClosed(b.closing) {
		// The comm is being closed: its abort ends the revoke's work.
		b.log.Info("ncclCommRevoke left to the close's abort", zap.Duration("after", time.Since(t0)))
		return
	}
	if r != libapi.Success {
		b.log.Warn("ncclCommRevoke failed", zap.Stringer("result", r), zap.String("nccl", b.lib.LastError(h)))
		return
	}
	b.quiescent = true
	b.dirty.Store(false)
	b.log.Info("ncclCommRevoke done", zap.Duration("took", time.Since(t0)))
}

// isClosed says whether ch is closed (nil: no).
func isClosed(ch <-chan struct{}) bool {
	if ch == nil {
		return false
	}
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
