package ncclsim

import (
	"fmt"
	"slices"
	"unsafe"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// Device memory (Go byte slices at made-up addresses), page-locked host
// memory, and the copies between them.

type simAlloc struct {
	dev  int
	base uintptr
	mem  []byte
}

type simPinned struct {
	buf   []byte
	freed bool
}

// ReadDevice returns a copy of the bytes of device tensor t, read directly
// from the simulated memory (no stream, no copy engine): what a test
// checks device state with.
func (w *Simulation) ReadDevice(t comm.Tensor) ([]byte, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	m, err := w.lookup(t)
	if err != nil {
		return nil, err
	}
	return slices.Clone(m), nil
}

// WriteDevice writes p into device tensor t from its start, directly into
// the simulated memory; p must not be longer than t.
func (w *Simulation) WriteDevice(t comm.Tensor, p []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	m, err := w.lookup(t)
	if err != nil {
		return err
	}
	if len(p) > len(m) {
		return fmt.Errorf("ncclsim: %w: %d bytes into a %d-byte tensor", comm.ErrInvalidArgument, len(p), len(m))
	}
	copy(m, p)
	return nil
}

// lookup returns the simulated memory of device tensor t.
func (w *Simulation) lookup(t comm.Tensor) ([]byte, error) {
	if !t.IsDevice() {
		return nil, fmt.Errorf("ncclsim: %w: %s is not a device tensor", comm.ErrInvalidArgument, t)
	}
	n, p := t.NumBytes(), t.Ptr()
	for _, a := range w.allocs {
		if a.dev == t.Device() && p >= a.base && p+uintptr(n) <= a.base+uintptr(len(a.mem)) {
			off := p - a.base
			return a.mem[off : off+uintptr(n)], nil
		}
	}
	return nil, fmt.Errorf("ncclsim: %w: %s is not allocated memory of device %d", comm.ErrInvalidArgument, t, t.Device())
}

// mem returns the simulated device memory [p, p+n), or nil (and a fault).
func (w *Simulation) mem(p uintptr, n int, what string) []byte {
	if n == 0 {
		return []byte{}
	}
	for _, a := range w.allocs {
		if p >= a.base && p+uintptr(n) <= a.base+uintptr(len(a.mem)) {
			off := p - a.base
			return a.mem[off : off+uintptr(n)]
		}
	}
	w.faultf("%s: illegal address %#x (+%d bytes)", what, p, n)
	return nil
}

type simCopyItem struct {
	dst, src uintptr
	n        int
}

func (it *simCopyItem) step(w *Simulation) bool {
	if src := w.mem(it.src, it.n, "memcpy src"); src != nil {
		copy(w.mem(it.dst, it.n, "memcpy dst"), src)
	}
	return true
}

func (w library) Malloc(dev int, n int) (uintptr, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.checkDev(dev); err != nil {
		return 0, err
	}
	w.next = (w.next + 4095) &^ 4095
	base := w.next
	w.next += uintptr(n) + 4096
	w.allocs[base] = &simAlloc{dev: dev, base: base, mem: make([]byte, n)}
	return base, nil
}

func (w library) Free(dev int, p uintptr) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if a := w.allocs[p]; a == nil || a.dev != dev {
		w.faultf("cudaFree(%#x) of memory not allocated on device %d", p, dev)
		return &libapi.CUDAError{Op: "cudaFree", Code: 1, Msg: "invalid argument"}
	}
	for _, s := range w.streams {
		for _, it := range s.items {
			if ci, ok := it.(*simCollItem); ok && !ci.c.killed {
				for _, a := range ci.ops {
					if w.allocs[p].contains(a.Send) || w.allocs[p].contains(a.Recv) {
						w.faultf("cudaFree(%#x) while a queued NCCL op still uses it", p)
					}
				}
			}
		}
	}
	delete(w.allocs, p)
	return nil
}

func (a *simAlloc) contains(p uintptr) bool { return p >= a.base && p < a.base+uintptr(len(a.mem)) }

// pinnedOf returns the page-locked allocation holding b, or nil.
func (w *Simulation) pinnedOf(b []byte) *simPinned {
	if len(b) == 0 {
		return nil
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	for _, pa := range w.pinned {
		base := uintptr(unsafe.Pointer(unsafe.SliceData(pa.buf)))
		if p >= base && p+uintptr(len(b)) <= base+uintptr(len(pa.buf)) {
			return pa
		}
	}
	return nil
}

// simHostCopyItem is a copy between page-locked memory and the device, done
// by the "copy engine" when its stream is polled.
type simHostCopyItem struct {
	pin    *simPinned
	host   []byte
	dev    uintptr
	toHost bool
}

func (it *simHostCopyItem) step(w *Simulation) bool {
	if w.stallCopies {
		return false
	}
	if it.pin.freed {
		w.faultf("copy engine used page-locked memory after cudaFreeHost")
		return true
	}
	m := w.mem(it.dev, len(it.host), "cudaMemcpyAsync")
	if m == nil {
		return true
	}
	if it.toHost {
		copy(it.host, m)
	} else {
		copy(m, it.host)
	}
	return true
}

func (w library) CopyHtoD(dev int, dst uintptr, src []byte, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaMemcpyAsync")
	if err != nil {
		return err
	}
	if w.mem(dst, len(src), "cudaMemcpyAsync(HtoD)") == nil {
		return &libapi.CUDAError{Op: "cudaMemcpyAsync", Code: 1, Msg: "invalid argument"}
	}
	if pa := w.pinnedOf(src); pa != nil {
		st.items = append(st.items, &simHostCopyItem{pin: pa, host: src, dev: dst})
		return nil
	}
	copy(w.mem(dst, len(src), "cudaMemcpyAsync(HtoD)"), src) // staged at once, as CUDA does for pageable memory
	return nil
}

func (w library) CopyDtoH(dev int, dst []byte, src uintptr, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaMemcpyAsync")
	if err != nil {
		return err
	}
	if w.mem(src, len(dst), "cudaMemcpyAsync(DtoH)") == nil {
		return &libapi.CUDAError{Op: "cudaMemcpyAsync", Code: 1, Msg: "invalid argument"}
	}
	if pa := w.pinnedOf(dst); pa != nil {
		st.items = append(st.items, &simHostCopyItem{pin: pa, host: dst, dev: src, toHost: true})
		return nil
	}
	w.progress(st)
	if len(st.items) > 0 {
		w.faultf("copy to host on a busy stream")
	}
	copy(dst, w.mem(src, len(dst), "cudaMemcpyAsync(DtoH)"))
	return nil
}

func (w library) CopyDtoD(dev int, dst, src uintptr, n int, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaMemcpyAsync")
	if err != nil {
		return err
	}
	st.items = append(st.items, &simCopyItem{dst: dst, src: src, n: n})
	return nil
}

func (w library) Memset(dev int, p uintptr, v byte, n int, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, err := w.stream(dev, s, "cudaMemsetAsync"); err != nil {
		return err
	}
	m := w.mem(p, n, "cudaMemsetAsync")
	for i := range m {
		m[i] = v
	}
	return nil
}

func (w library) HostAlloc(dev int, n int) ([]byte, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.checkDev(dev); err != nil {
		return nil, err
	}
	if n <= 0 {
		w.faultf("cudaHostAlloc of %d bytes", n)
	}
	buf := make([]byte, n)
	w.pinned[unsafe.SliceData(buf)] = &simPinned{buf: buf}
	w.hostAllocs++
	return buf, nil
}

func (w library) HostFree(buf []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	pa := w.pinned[unsafe.SliceData(buf)]
	if pa == nil {
		w.faultf("cudaFreeHost of memory cudaHostAlloc did not return")
		return &libapi.CUDAError{Op: "cudaFreeHost", Code: 1, Msg: "invalid argument"}
	}
	for _, st := range w.streams {
		for _, it := range st.items {
			if hc, ok := it.(*simHostCopyItem); ok && hc.pin == pa {
				w.faultf("cudaFreeHost of page-locked memory a queued copy still uses")
			}
		}
	}
	pa.freed = true
	delete(w.pinned, unsafe.SliceData(buf))
	w.hostAllocs--
	return nil
}
