package ft

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// What the driver releases once its loop has ended (Close), and the
// device comms whose release Close waits for.

// releaser is a backend that frees its device resources in the background
// after Close (nccl's Backend: ncclCommAbort took 0.5 s after a peer's
// death on 2×H200). Released is closed once the comm's GPU work has
// stopped and its resources are freed; ReleaseErr then says whether that
// went wrong (its GPU work may still run).
type releaser interface {
	Released() <-chan struct{}
	ReleaseErr() error
}

// shutdown releases what the driver held once its loop has ended (Close):
// the registration, the recovery server, the metrics, and — with device
// comms — waits until their GPU work stopped, Config.Timeout at most.
func (d *driver) shutdown() error {
	if d.health != nil {
		d.health()
	}
	if d.stopReg != nil {
		d.stopReg()
	}
	d.rereg.Wait()
	d.warm.stop()
	if d.warm != nil && d.warm.comm != nil {
		d.track(d.warm.comm) // its device release is awaited below
	}
	d.reports.stop()
	defer d.metrics.unregister()
	m := d.link.member()
	lctx, cancel := context.WithTimeout(context.Background(), leaveTimeout)
	defer cancel()
	var serr error
	if d.snaps != nil {
		serr = d.snaps.close() // before the device comms go: its copies use them
	}
	err := errors.Join(m.Leave(lctx), m.Close(), d.server.Close(), serr)
	deadline := time.Now().Add(d.cfg.Timeout)
	if d.staging != nil {
		// After the server: no chunk is staged any more.
		err = errors.Join(err, d.staging.close(deadline))
	}
	return errors.Join(err, d.awaitReleased(deadline))
}

// awaitReleased waits, until deadline at most, until every device comm
// this Comm formed has released its resources, so that no GPU op of it
// still uses the caller's device memory.
func (d *driver) awaitReleased(deadline time.Time) error {
	d.relMu.Lock()
	rs := d.releasing
	d.releasing = nil
	d.relMu.Unlock()
	timeout := time.NewTimer(time.Until(deadline))
	defer timeout.Stop()
	var errs []error
	for i, r := range rs {
		select {
		case <-r.Released():
			if err := r.ReleaseErr(); err != nil {
				errs = append(errs, fmt.Errorf("ft: releasing a device comm: %w (its GPU work may still use device memory)", err))
			}
		case <-timeout.C:
			return errors.Join(append(errs, fmt.Errorf("ft: %d device comms not released within %v of Close: their GPU work may still use device memory",
				len(rs)-i, d.cfg.Timeout))...)
		}
	}
	return errors.Join(errs...)
}

// track remembers a newly formed comm whose backend releases its device
// resources after Close, for Close to wait for. Every comm ft forms passes
// here, so the comms it closes along the way are waited for too; those
// already released are forgotten. Called from formation tasks.
func (d *driver) track(x *comm.Comm) {
	r, ok := x.Backend().(releaser)
	if !ok {
		return
	}
	d.relMu.Lock()
	defer d.relMu.Unlock()
	d.releasing = slices.DeleteFunc(d.releasing, func(r releaser) bool {
		select {
		case <-r.Released():
			return true
		default:
			return false
		}
	})
	d.releasing = append(d.releasing, r)
}
