package main

import (
	"fmt"
	"unsafe"

	"github.com/ftcomm/ftcomm/comm"
)

// tensor makes the comm.Tensor for count elements of dtype at ptr: host
// memory when device < 0, else device memory on that CUDA ordinal. dtype
// is a comm.DType value (1 float32 … 8 int64).
func tensor(ptr unsafe.Pointer, count int64, dtype int32, device int32) (comm.Tensor, error) {
	dt := comm.DType(dtype)
	switch {
	case dtype < 0 || dtype > 255 || !dt.Valid():
		return comm.Tensor{}, fmt.Errorf("%w: dtype %d", comm.ErrInvalidArgument, dtype)
	case count < 0:
		return comm.Tensor{}, fmt.Errorf("%w: negative count %d", comm.ErrInvalidArgument, count)
	case count > 0 && ptr == nil:
		return comm.Tensor{}, fmt.Errorf("%w: null pointer for %d elements", comm.ErrInvalidArgument, count)
	case device >= 0:
		return comm.DeviceTensor(uintptr(ptr), int(device), int(count), dt), nil
	}
	if count == 0 {
		return comm.HostBytes(dt, nil), nil
	}
	return comm.HostBytes(dt, unsafe.Slice((*byte)(ptr), int(count)*dt.Size())), nil
}
