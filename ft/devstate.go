package ft

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/recovery"
)

// deviceState is a registered device tensor as recovery sees it: chunks
// are staged through pinned host buffers on demand, from the live device
// state when serving and into it when healing. Nothing is copied per step.
type deviceState struct {
	copier comm.HostCopier
	t      comm.Tensor
	pool   *stagingPool
}

var _ recovery.Memory = (*deviceState)(nil)

func (d *deviceState) Len() int { return d.t.NumBytes() }

func (d *deviceState) Buffer(ctx context.Context, n int) ([]byte, func(), error) {
	return d.pool.get(ctx, n)
}

func (d *deviceState) ReadAt(ctx context.Context, p []byte, off int) error {
	return d.copier.CopyToHost(ctx, p, d.t, off)
}

func (d *deviceState) WriteAt(ctx context.Context, p []byte, off int) error {
	return d.copier.CopyFromHost(ctx, d.t, off, p)
}

// stagingPool hands out pinned host buffers of one size, allocated on
// first use up to max and kept until close: pinning memory is slow, so a
// transfer reuses the same few buffers for every chunk.
type stagingPool struct {
	copier comm.HostCopier
	size   int
	max    int

	mu     sync.Mutex
	free   chan []byte
	done   chan struct{} // closed by close: waiters for a buffer give up
	n      int
	frees  []func()
	closed bool
}

func newStagingPool(copier comm.HostCopier, size, max int) *stagingPool {
	return &stagingPool{copier: copier, size: size, max: max, free: make(chan []byte, max), done: make(chan struct{})}
}

// get returns a buffer of at least n bytes; it waits for one to come back
// when max are out. A request larger than the pool's size (a healer with
// a larger chunk size) gets a buffer of its own, freed when put back.
func (p *stagingPool) get(ctx context.Context, n int) ([]byte, func(), error) {
	if n > p.size {
		b, free, err := p.copier.PinnedHost(n)
		if err != nil {
			return nil, nil, fmt.Errorf("ft: pinned staging buffer of %d bytes: %w", n, err)
		}
		return b, free, nil
	}
	p.mu.Lock()
	if p.closed { // its buffers are freed (or being freed)
		p.mu.Unlock()
		return nil, nil, fmt.Errorf("ft: staging: %w", ErrClosed)
	}
	select {
	case b := <-p.free:
		p.mu.Unlock()
		return b, func() { p.free <- b }, nil
	default:
	}
	if p.n < p.max {
		p.n++
		p.mu.Unlock()
		b, free, err := p.copier.PinnedHost(p.size)
		p.mu.Lock()
		defer p.mu.Unlock()
		if err != nil {
			p.n--
			return nil, nil, fmt.Errorf("ft: pinned staging buffer of %d bytes: %w", p.size, err)
		}
		if p.closed {
			free()
			return nil, nil, fmt.Errorf("ft: staging: %w", ErrClosed)
		}
		p.frees = append(p.frees, free)
		return b, func() { p.free <- b }, nil
	}
	p.mu.Unlock()
	select {
	case b := <-p.free:
		return b, func() { p.free <- b }, nil
	case <-p.done:
		return nil, nil, fmt.Errorf("ft: staging: %w", ErrClosed)
	case <-ctx.Done():
		return nil, nil, context.Cause(ctx)
	}
}

// close frees every buffer; callers must have put back what they took.
// A device backend's free waits until no copy abandoned by a cancelled ctx
// runs on the GPU (the copy engine may still use the buffer, and the
// device state it copies to or from); close waits so until deadline, then
// leaves the frees to a goroutine that runs them when those copies end,
// and returns an error saying that device memory may still be in use.
func (p *stagingPool) close(deadline time.Time) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.done)
	frees := p.frees
	p.frees = nil
	p.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for _, f := range frees {
			f()
		}
	}()
	timeout := time.NewTimer(time.Until(deadline))
	defer timeout.Stop()
	select {
	case <-done:
		return nil
	case <-timeout.C:
		return fmt.Errorf("ft: pinned staging buffers not freed by the deadline: a device copy abandoned by a cancelled transfer still runs on the GPU and may use device memory (the buffers are freed when it ends)")
	}
}
