package main

import (
	"context"
	"fmt"
	"unsafe"

	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/comm"
)

// deviceMemory is what ftbench needs from a device backend (nccl) to run
// it: buffers on the rank's GPU and copies between them and host memory.
// The checker always works on host bytes; device buffers are filled by
// copying in and checked by copying out, outside the timed loop.
type deviceMemory interface {
	Alloc(nbytes int) (uintptr, error)
	Free(ptr uintptr) error
	CopyToDevice(dst uintptr, src []byte) error
	CopyToHost(dst []byte, src uintptr) error
}

// deviceMemoryFor returns the device memory helpers of backend b for GPU
// device; a device backend without helpers here is refused with a clear error.
func deviceMemoryFor(b comm.Backend, device int) (deviceMemory, error) {
	if nb, ok := b.(*nccl.Backend); ok {
		return &ncclMemory{l: nb.Library(), dev: device, bufs: map[uintptr]*nccl.DeviceBuffer{}}, nil
	}
	return nil, fmt.Errorf("%w: ftbench: backend %s keeps tensors in device memory (GPU %d), and no device memory helpers are wired into ftbench for it",
		comm.ErrBackendUnavailable, b.Name(), device)
}

// ncclMemory is deviceMemory on the NCCL backend's CUDA helpers.
type ncclMemory struct {
	l    *nccl.Library
	dev  int
	bufs map[uintptr]*nccl.DeviceBuffer
}

func (m *ncclMemory) Alloc(n int) (uintptr, error) {
	b, err := m.l.Alloc(m.dev, n)
	if err != nil {
		return 0, err
	}
	m.bufs[b.Ptr()] = b
	return b.Ptr(), nil
}

func (m *ncclMemory) Free(ptr uintptr) error {
	b, ok := m.bufs[ptr]
	if !ok {
		return fmt.Errorf("%w: ftbench: free of unknown device pointer %#x", comm.ErrInvalidArgument, ptr)
	}
	delete(m.bufs, ptr)
	return b.Free()
}

func (m *ncclMemory) CopyToDevice(dst uintptr, src []byte) error {
	return m.l.CopyToDevice(context.Background(), comm.DeviceTensor(dst, m.dev, len(src), comm.Uint8), src)
}

func (m *ncclMemory) CopyToHost(dst []byte, src uintptr) error {
	return m.l.CopyFromDevice(context.Background(), dst, comm.DeviceTensor(src, m.dev, len(dst), comm.Uint8))
}

// buffer is one benchmark buffer of up to cap bytes: host bytes the data
// generator and the checker use, and, for a device backend, the GPU copy
// the ops run on.
type buffer struct {
	host   []byte
	dev    deviceMemory // nil: the ops run on host directly
	ptr    uintptr
	device int
}

// newBuffer allocates nbytes, 8-byte aligned so every dtype can view it.
func newBuffer(nbytes int, dev deviceMemory, device int) (*buffer, error) {
	words := make([]uint64, (nbytes+7)/8)
	b := &buffer{host: unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(words))), len(words)*8)[:nbytes], dev: dev, device: device}
	if dev != nil && nbytes > 0 {
		p, err := dev.Alloc(nbytes)
		if err != nil {
			return nil, fmt.Errorf("ftbench: allocate %d bytes on GPU %d: %w", nbytes, device, err)
		}
		b.ptr = p
	}
	return b, nil
}

// tensor is the first count elements of dt, as the op gets them.
func (b *buffer) tensor(dt comm.DType, count int) comm.Tensor {
	if b.dev != nil {
		return comm.DeviceTensor(b.ptr, b.device, count, dt)
	}
	return comm.HostBytes(dt, b.host[:count*dt.Size()])
}

// bytes is the host view of the first n bytes.
func (b *buffer) bytes(n int) []byte { return b.host[:n] }

// upload makes the op's memory hold the host bytes [0, n).
func (b *buffer) upload(n int) error {
	if b.dev == nil || n == 0 {
		return nil
	}
	return b.dev.CopyToDevice(b.ptr, b.host[:n])
}

// download makes the host bytes [0, n) hold the op's memory.
func (b *buffer) download(n int) error {
	if b.dev == nil || n == 0 {
		return nil
	}
	return b.dev.CopyToHost(b.host[:n], b.ptr)
}

func (b *buffer) free() error {
	if b.dev == nil || b.ptr == 0 {
		return nil
	}
	p := b.ptr
	b.ptr = 0
	return b.dev.Free(p)
}
