package nccl

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// Host copies. Every copy between host and device memory (the HostCopier
// methods, the DeviceBuffer and Library helpers) runs on a stream of a
// small per-device pool owned by the Library, never on a comm's stream:
// copies neither wait for collectives nor hold them up, several run at
// once (as many as LibraryConfig.CopyStreams), and they go on working
// after the comm that offered them is closed. Page-locked memory from
// PinnedHost is copied by the copy engines directly; Go memory is staged
// by CUDA (slower, and a device-to-host copy into it returns only when
// done).

// copyPool is one device's copy streams; idle holds those free to use.
type copyPool struct {
	dev  int
	idle chan libapi.Stream
	all  []libapi.Stream
}

// pool returns dev's copy pool, creating its streams on first use.
func (l *Library) pool(dev int) (*copyPool, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if p := l.pools[dev]; p != nil {
		return p, nil
	}
	p := &copyPool{dev: dev, idle: make(chan libapi.Stream, l.nCopies)}
	for range l.nCopies {
		s, err := l.lib.StreamCreate(dev)
		if err != nil {
			for _, s := range p.all {
				_ = l.lib.StreamDestroy(dev, s)
			}
			return nil, fmt.Errorf("nccl: copy streams on device %d: %w", dev, err)
		}
		p.all = append(p.all, s)
		p.idle <- s
	}
	l.pools[dev] = p
	return p, nil
}

func checkDeviceTensor(t comm.Tensor, name string) error {
	switch {
	case !t.IsDevice():
		return fmt.Errorf("nccl: %w: %s is %s, not a device tensor", comm.ErrInvalidArgument, name, t)
	case t.NumBytes() > 0 && t.Ptr() == 0:
		return fmt.Errorf("nccl: %w: %s has a nil device pointer", comm.ErrInvalidArgument, name)
	}
	return nil
}

// checkRange validates n bytes at byte offset off of device tensor t.
func checkRange(t comm.Tensor, name string, off, n int) error {
	if err := checkDeviceTensor(t, name); err != nil {
		return err
	}
	if off < 0 || off > t.NumBytes() || n > t.NumBytes()-off {
		return fmt.Errorf("nccl: %w: %d bytes at offset %d of %s, which has %d bytes", comm.ErrInvalidArgument, n, off, name, t.NumBytes())
	}
	return nil
}

// runCopy takes a stream of dev's pool, issues the copy on it and waits
// until the stream is done or ctx ends. A copy abandoned by its ctx keeps
// its stream (and counts as an orphan, which PinnedHost's free waits for)
// until the GPU has finished it.
func (l *Library) runCopy(ctx context.Context, dev int, what string, bytes int, issue func(s libapi.Stream) error) error {
	if ctx.Err() != nil {
		return ctxError(ctx, what)
	}
	p, err := l.pool(dev)
	if err != nil {
		return err
	}
	var s libapi.Stream
	select {
	case s = <-p.idle:
	case <-ctx.Done():
		return ctxError(ctx, what+" (no copy stream free)")
	}
	if err := issue(s); err != nil {
		l.orphan(p, s) // nothing should be queued, but make sure before reuse
		return fmt.Errorf("nccl: %s: %w", what, err)
	}
	done, err := l.waitCopy(ctx, dev, s, bytes)
	if !done {
		l.orphan(p, s)
		if err == nil {
			err = ctxError(ctx, what)
		}
		return err
	}
	p.idle <- s
	return err
}

// copyPeak is a copy engine's best rate: about 55 GB/s measured from
// pinned memory on an H100 (PCIe 5); no copy of n bytes ends sooner than
// n/copyPeak.
const copyPeak = 60e9 // bytes per second

// waitCopy polls s until it is done (true), fails, or ctx ends (false).
// Go's timers wake about 1 ms late when the process is idle (the runtime
// sleeps in epoll with a millisecond timeout: a 64 MiB copy waited for
// with 50 µs sleeps took 2.1 ms, not 1.2), so it sleeps only through the
// part of the copy that cannot be over yet, less a millisecond; then it
// polls, yielding the processor, until twice the copy's shortest time (at
// least 2 ms); past that (copies sharing the engine) it sleeps between
// polls.
func (l *Library) waitCopy(ctx context.Context, dev int, s libapi.Stream, bytes int) (bool, error) {
	start := time.Now()
	shortest := time.Duration(float64(bytes) / copyPeak * float64(time.Second))
	var timer *time.Timer
	sleep := func(d time.Duration) {
		if timer == nil {
			timer = time.NewTimer(d)
		} else {
			timer.Reset(d)
		}
		select {
		case <-timer.C:
		case <-ctx.Done():
		}
	}
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	if shortest > 2*time.Millisecond {
		sleep(shortest - time.Millisecond)
	}
	yieldFor := max(2*shortest, 2*time.Millisecond)
	for {
		ok, err := l.lib.StreamQuery(dev, s)
		if err != nil {
			return true, fmt.Errorf("nccl: %w: copy: %w", comm.ErrAborted, err)
		}
		if ok {
			return true, nil
		}
		if ctx.Err() != nil {
			return false, nil
		}
		switch el := time.Since(start); {
		case el < 20*time.Microsecond:
		case el < yieldFor:
			runtime.Gosched()
		default:
			sleep(100 * time.Microsecond)
		}
	}
}

// orphan keeps s out of the pool until the GPU is done with it. The
// goroutine it starts exits then (a copy cannot outlast the GPU).
func (l *Library) orphan(p *copyPool, s libapi.Stream) {
	l.mu.Lock()
	l.orphans++
	l.mu.Unlock()
	go func() {
		_ = pollDone(context.Background(), nil, func() (bool, error) { return l.lib.StreamQuery(p.dev, s) })
		p.idle <- s
		l.mu.Lock()
		l.orphans--
		l.orphansDone.Broadcast()
		l.mu.Unlock()
	}()
}

// PinnedHost returns n bytes of page-locked host memory (cudaHostAlloc,
// portable to every device; dev's context is the one initialised) and the
// function that frees it. The free function waits for copies abandoned by
// a cancelled ctx to finish on the GPU first, so the copy engine never
// writes freed memory; call it once, after the last copy using the bytes.
func (l *Library) PinnedHost(dev, n int) ([]byte, func(), error) {
	if n < 0 || dev < 0 {
		return nil, nil, fmt.Errorf("nccl: %w: %d bytes of pinned memory for device %d", comm.ErrInvalidArgument, n, dev)
	}
	if n == 0 {
		return []byte{}, func() {}, nil
	}
	buf, err := l.lib.HostAlloc(dev, n)
	if err != nil {
		return nil, nil, fmt.Errorf("nccl: pinned memory: %w", err)
	}
	var once sync.Once
	return buf, func() {
		once.Do(func() {
			l.mu.Lock()
			for l.orphans > 0 {
				l.orphansDone.Wait()
			}
			l.mu.Unlock()
			_ = l.lib.HostFree(buf)
		})
	}, nil
}

// CopyToHost copies len(dst) bytes of device tensor src, from byte offset
// off, into dst and waits for it (comm.HostCopier's contract: concurrent
// calls run at once on the pool's streams; bad ranges fail with
// comm.ErrInvalidArgument and touch nothing; if ctx ends first the copy
// may still land in dst).
func (l *Library) CopyToHost(ctx context.Context, dst []byte, src comm.Tensor, off int) error {
	if err := checkRange(src, "src", off, len(dst)); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	return l.runCopy(ctx, src.Device(), "copy to host", len(dst), func(s libapi.Stream) error {
		return l.lib.CopyDtoH(src.Device(), dst, src.Ptr()+uintptr(off), s)
	})
}

// CopyFromHost copies src into device tensor dst at byte offset off and
// waits for it (see CopyToHost).
func (l *Library) CopyFromHost(ctx context.Context, dst comm.Tensor, off int, src []byte) error {
	if err := checkRange(dst, "dst", off, len(src)); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	return l.runCopy(ctx, dst.Device(), "copy from host", len(src), func(s libapi.Stream) error {
		return l.lib.CopyHtoD(dst.Device(), dst.Ptr()+uintptr(off), src, s)
	})
}

// CopyToDevice copies src (its first dst.NumBytes() bytes; it must have at
// least that many) into the device tensor dst, and waits for it.
func (l *Library) CopyToDevice(ctx context.Context, dst comm.Tensor, src []byte) error {
	if err := checkDeviceTensor(dst, "dst"); err != nil {
		return err
	}
	if len(src) < dst.NumBytes() {
		return fmt.Errorf("nccl: %w: %d host bytes for a %d-byte tensor", comm.ErrInvalidArgument, len(src), dst.NumBytes())
	}
	return l.CopyFromHost(ctx, dst, 0, src[:dst.NumBytes()])
}

// CopyFromDevice copies the device tensor src into dst (which must hold at
// least src.NumBytes() bytes) and waits for it.
func (l *Library) CopyFromDevice(ctx context.Context, dst []byte, src comm.Tensor) error {
	if err := checkDeviceTensor(src, "src"); err != nil {
		return err
	}
	if len(dst) < src.NumBytes() {
		return fmt.Errorf("nccl: %w: %d host bytes for a %d-byte tensor", comm.ErrInvalidArgument, len(dst), src.NumBytes())
	}
	return l.CopyToHost(ctx, dst[:src.NumBytes()], src, 0)
}

// Memset sets every byte of the device tensor t to v and waits for it.
func (l *Library) Memset(ctx context.Context, t comm.Tensor, v byte) error {
	if err := checkDeviceTensor(t, "tensor"); err != nil {
		return err
	}
	if t.NumBytes() == 0 {
		return nil
	}
	return l.runCopy(ctx, t.Device(), "memset", 0, func(s libapi.Stream) error {
		return l.lib.Memset(t.Device(), t.Ptr(), v, t.NumBytes(), s)
	})
}

func (l *Library) syncStream(ctx context.Context, dev int, s libapi.Stream) error {
	return pollDone(ctx, nil, func() (bool, error) { return l.lib.StreamQuery(dev, s) })
}

// Release destroys the copy streams. Call it when no copy runs (it fails,
// destroying nothing of that device, if one does). The Library stays
// usable: the streams are recreated on demand.
func (l *Library) Release() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	var errs []error
	for dev, p := range l.pools {
		if len(p.idle) != len(p.all) {
			errs = append(errs, fmt.Errorf("nccl: release: %d copies still running on device %d", len(p.all)-len(p.idle), dev))
			continue
		}
		for _, s := range p.all {
			<-p.idle
			errs = append(errs, l.lib.StreamDestroy(dev, s))
		}
		delete(l.pools, dev)
	}
	return errors.Join(errs...)
}

// ---- comm.HostCopier ----

// checkOwn refuses a tensor that is not on the comm's device.
func (b *Backend) checkOwn(t comm.Tensor, name string) error {
	if t.IsDevice() && t.Device() != b.dev {
		return fmt.Errorf("nccl: %w: %s is on device %d, this comm runs on device %d", comm.ErrInvalidArgument, name, t.Device(), b.dev)
	}
	return nil
}

// PinnedHost implements comm.HostCopier: page-locked memory for copies to
// and from this comm's GPU (Library.PinnedHost).
func (b *Backend) PinnedHost(n int) ([]byte, func(), error) { return b.L.PinnedHost(b.dev, n) }

// CopyToHost implements comm.HostCopier on the Library's copy streams
// (Library.CopyToHost): it works on while the comm runs collectives, and
// after it is aborted or closed. src must be on the comm's GPU.
func (b *Backend) CopyToHost(ctx context.Context, dst []byte, src comm.Tensor, off int) error {
	if err := b.checkOwn(src, "src"); err != nil {
		return err
	}
	return b.L.CopyToHost(ctx, dst, src, off)
}

// CopyFromHost implements comm.HostCopier (Library.CopyFromHost). dst
// must be on the comm's GPU.
func (b *Backend) CopyFromHost(ctx context.Context, dst comm.Tensor, off int, src []byte) error {
	if err := b.checkOwn(dst, "dst"); err != nil {
		return err
	}
	return b.L.CopyFromHost(ctx, dst, off, src)
}
