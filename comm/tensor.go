package comm

import (
	"fmt"
	"unsafe"
)

// Tensor names a contiguous buffer of Count elements of one DType, either in
// host memory (a Go slice) or in device memory (a pointer on a GPU).
//
// A Tensor is a view: it does not own or copy the memory, and the caller keeps
// the memory alive and untouched until the op that uses it has completed
// (for an async op, until its Work is done). The zero Tensor is "no tensor"
// and is rejected wherever a buffer is needed.
type Tensor struct {
	dtype  DType
	count  int
	host   unsafe.Pointer // first byte of host memory, nil for device tensors and empty host tensors
	ptr    uintptr        // device address
	device int            // CUDA device ordinal, or -1 for host memory
	valid  bool
	badLen int // byte length of a host buffer that is not a whole number of elements, else -1
}

// HostBytes makes a host Tensor of dtype dt over the raw bytes b. If len(b) is
// not a multiple of dt's size the Tensor is still returned, and every op it is
// passed to fails with ErrInvalidArgument.
func HostBytes(dt DType, b []byte) Tensor {
	t := Tensor{dtype: dt, device: -1, valid: true, badLen: -1, host: unsafe.Pointer(unsafe.SliceData(b))}
	if s := dt.Size(); s > 0 {
		t.count = len(b) / s
		if len(b)%s != 0 {
			t.badLen = len(b)
		}
	}
	return t
}

func hostOf[T any](dt DType, s []T) Tensor {
	return Tensor{dtype: dt, count: len(s), device: -1, valid: true, badLen: -1, host: unsafe.Pointer(unsafe.SliceData(s))}
}

// Float32s, Float64s, … make host Tensors over the given slices (no copy).
func Float32s(s []float32) Tensor { return hostOf(Float32, s) }
func Float64s(s []float64) Tensor { return hostOf(Float64, s) }
func Float16s(s []F16) Tensor     { return hostOf(Float16, s) }
func BFloat16s(s []BF16) Tensor   { return hostOf(BFloat16, s) }
func Int8s(s []int8) Tensor       { return hostOf(Int8, s) }
func Uint8s(s []uint8) Tensor     { return hostOf(Uint8, s) }
func Int32s(s []int32) Tensor     { return hostOf(Int32, s) }
func Int64s(s []int64) Tensor     { return hostOf(Int64, s) }

// DeviceTensor names count elements of dt at address ptr on GPU device.
func DeviceTensor(ptr uintptr, device, count int, dt DType) Tensor {
	return Tensor{dtype: dt, count: count, ptr: ptr, device: device, valid: true, badLen: -1}
}

// IsZero reports whether t is the zero Tensor (no buffer).
func (t Tensor) IsZero() bool { return !t.valid }

// DType is the element type.
func (t Tensor) DType() DType { return t.dtype }

// Count is the number of elements.
func (t Tensor) Count() int { return t.count }

// NumBytes is Count times the element size.
func (t Tensor) NumBytes() int { return t.count * t.dtype.Size() }

// IsDevice reports whether t lives in GPU memory.
func (t Tensor) IsDevice() bool { return t.valid && t.device >= 0 }

// Device is the GPU ordinal of a device Tensor, -1 for host memory.
func (t Tensor) Device() int { return t.device }

// Ptr is the address of the first element: the device address of a device
// Tensor, or the host address of a host Tensor (0 when empty).
func (t Tensor) Ptr() uintptr {
	if t.IsDevice() {
		return t.ptr
	}
	return uintptr(t.host)
}

// Bytes returns the host memory of t as a byte slice aliasing the original
// slice, or nil for a device or empty Tensor.
func (t Tensor) Bytes() []byte {
	if t.IsDevice() || t.host == nil {
		return nil
	}
	return unsafe.Slice((*byte)(t.host), t.NumBytes())
}

// Slice returns the elements [from, from+n) of t as a Tensor sharing memory.
// It panics if the range is out of bounds, like slicing a Go slice.
func (t Tensor) Slice(from, n int) Tensor {
	if from < 0 || n < 0 || from+n > t.count {
		panic(fmt.Sprintf("comm: Tensor.Slice(%d, %d) out of range [0, %d]", from, n, t.count))
	}
	off := from * t.dtype.Size()
	s := t
	s.count = n
	if t.IsDevice() {
		s.ptr += uintptr(off)
	} else if t.host != nil && n > 0 {
		s.host = unsafe.Add(t.host, off)
	}
	return s
}

// AsFloat32s returns the host memory of a Float32 Tensor as a []float32
// (nil if t is not a host Float32 Tensor). The same holds for the others.
func (t Tensor) AsFloat32s() []float32 { return viewAs[float32](t, Float32) }
func (t Tensor) AsFloat64s() []float64 { return viewAs[float64](t, Float64) }
func (t Tensor) AsFloat16s() []F16     { return viewAs[F16](t, Float16) }
func (t Tensor) AsBFloat16s() []BF16   { return viewAs[BF16](t, BFloat16) }
func (t Tensor) AsInt8s() []int8       { return viewAs[int8](t, Int8) }
func (t Tensor) AsUint8s() []uint8     { return viewAs[uint8](t, Uint8) }
func (t Tensor) AsInt32s() []int32     { return viewAs[int32](t, Int32) }
func (t Tensor) AsInt64s() []int64     { return viewAs[int64](t, Int64) }

func viewAs[T any](t Tensor, dt DType) []T {
	if t.dtype != dt || t.IsDevice() || t.host == nil {
		return nil
	}
	return unsafe.Slice((*T)(t.host), t.count)
}

func (t Tensor) String() string {
	if !t.valid {
		return "tensor(none)"
	}
	if t.IsDevice() {
		return fmt.Sprintf("tensor(cuda:%d %s[%d] @%#x)", t.device, t.dtype, t.count, t.ptr)
	}
	return fmt.Sprintf("tensor(host %s[%d])", t.dtype, t.count)
}

// check reports why t cannot be used as argument name, or nil.
func (t Tensor) check(name string) error {
	switch {
	case !t.valid:
		return invalidf("%s: no tensor", name)
	case !t.dtype.Valid():
		return invalidf("%s: invalid dtype %s", name, t.dtype)
	case t.badLen >= 0:
		return invalidf("%s: %d bytes is not a whole number of %s elements", name, t.badLen, t.dtype)
	case t.count < 0:
		return invalidf("%s: negative count %d", name, t.count)
	case t.IsDevice() && t.ptr == 0 && t.count > 0:
		return invalidf("%s: nil device pointer", name)
	case !t.IsDevice() && t.host == nil && t.count > 0:
		return invalidf("%s: nil host buffer", name)
	}
	return nil
}

// overlaps reports whether the memory of a and b intersects.
func overlaps(a, b Tensor) bool {
	if a.IsDevice() != b.IsDevice() || (a.IsDevice() && a.device != b.device) {
		return false
	}
	an, bn := uintptr(a.NumBytes()), uintptr(b.NumBytes())
	if an == 0 || bn == 0 {
		return false
	}
	ap, bp := a.Ptr(), b.Ptr()
	return ap < bp+bn && bp < ap+an
}
