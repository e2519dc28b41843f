package ft

import (
	"context"
	"fmt"
	"runtime"
	"sort"
	"sync"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/recovery"
)

// Host memory for peer snapshots (snapshot.go): new buffers touched in
// parallel, chunked copies between host buffers and registered state, and
// the registered state seen as the one blob a snapshot server serves.

// prefaulted returns n bytes of new memory, each page touched by several
// goroutines at once: a fresh buffer's first copy page-faults once per
// page, which one thread does at about 1.3 GB/s (an H200 host: a 4 GiB
// snapshot took 3.3 s against 0.32 s into mapped memory).
func prefaulted(n int) []byte {
	b := make([]byte, n)
	const page = 4096
	workers := min(runtime.GOMAXPROCS(0), 8)
	per := (n/workers + page - 1) / page * page
	var wg sync.WaitGroup
	for w := range workers {
		lo, hi := min(w*per, n), min((w+1)*per, n)
		wg.Go(func() {
			for i := lo; i < hi; i += page {
				b[i] = 0
			}
		})
	}
	wg.Wait()
	return b
}

// snapChunk bounds one device copy of a snapshot.
const snapChunk = 64 << 20

func copyFromMemory(ctx context.Context, dst []byte, m recovery.Memory) error {
	for off := 0; off < len(dst); off += snapChunk {
		if err := m.ReadAt(ctx, dst[off:min(off+snapChunk, len(dst))], off); err != nil {
			return err
		}
	}
	return nil
}

func copyToMemory(ctx context.Context, m recovery.Memory, src []byte) error {
	for off := 0; off < len(src); off += snapChunk {
		if err := m.WriteAt(ctx, src[off:min(off+snapChunk, len(src))], off); err != nil {
			return err
		}
	}
	return nil
}

// concatMemory shows blobs (host or device memory) as one recovery.Memory,
// in order, for a fetch of a snapshot's one blob into them.
type concatMemory struct {
	blobs []recovery.Blob
	offs  []int // offs[i]: where blob i starts
	n     int
	host  sync.Pool // chunk buffers when no blob is device memory
}

func newConcatMemory(blobs []recovery.Blob) *concatMemory {
	m := &concatMemory{blobs: blobs}
	for _, b := range blobs {
		m.offs = append(m.offs, m.n)
		m.n += b.Len()
	}
	return m
}

func (m *concatMemory) Len() int { return m.n }

func (m *concatMemory) Buffer(ctx context.Context, n int) ([]byte, func(), error) {
	for _, b := range m.blobs {
		if b.Mem != nil {
			return b.Mem.Buffer(ctx, n) // pinned staging, for device copies
		}
	}
	if p, ok := m.host.Get().(*[]byte); ok && len(*p) >= n {
		return (*p)[:n], func() { m.host.Put(p) }, nil
	}
	p := make([]byte, n)
	return p, func() { m.host.Put(&p) }, nil
}

// span calls f for each piece of [off, off+len(p)) within one blob.
func (m *concatMemory) span(p []byte, off int, f func(b recovery.Blob, q []byte, boff int) error) error {
	i := max(sort.SearchInts(m.offs, off+1)-1, 0)
	for len(p) > 0 && i < len(m.blobs) {
		boff := off - m.offs[i]
		k := min(len(p), m.blobs[i].Len()-boff)
		if k > 0 {
			if err := f(m.blobs[i], p[:k], boff); err != nil {
				return err
			}
			p, off = p[k:], off+k
		}
		i++
	}
	if len(p) > 0 {
		return fmt.Errorf("%w: ft: %d bytes past the registered state's end", comm.ErrInvalidArgument, len(p))
	}
	return nil
}

func (m *concatMemory) ReadAt(ctx context.Context, p []byte, off int) error {
	return m.span(p, off, func(b recovery.Blob, q []byte, boff int) error {
		if b.Mem == nil {
			copy(q, b.Data[boff:])
			return nil
		}
		return b.Mem.ReadAt(ctx, q, boff)
	})
}

func (m *concatMemory) WriteAt(ctx context.Context, p []byte, off int) error {
	return m.span(p, off, func(b recovery.Blob, q []byte, boff int) error {
		if b.Mem == nil {
			copy(b.Data[boff:], q)
			return nil
		}
		return b.Mem.WriteAt(ctx, q, boff)
	})
}
