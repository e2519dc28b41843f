package nccl

import (
	"fmt"

	"github.com/ftcomm/ftcomm/comm"
)

// This file is the seam between the backend and the libraries it drives: a
// small unexported interface (library) with two implementations, the real
// one (dl.go: libnccl and libcudart opened with dlopen) and Simulation
// (sim.go), which simulates NCCL and CUDA in Go memory for tests here and
// in other packages. Nothing here keeps
// process-global state: each Library value owns its own function table.

// result is an ncclResult_t.
type result int32

// The ncclResult_t codes (nccl.h).
const (
	resSuccess         result = 0
	resUnhandledCuda   result = 1
	resSystemError     result = 2
	resInternalError   result = 3
	resInvalidArgument result = 4
	resInvalidUsage    result = 5
	resRemoteError     result = 6
	resInProgress      result = 7
	resTimeout         result = 8
)

var resultNames = [...]string{"ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
	"ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress", "ncclTimeout"}

func (r result) String() string {
	if r >= 0 && int(r) < len(resultNames) {
		return resultNames[r]
	}
	return fmt.Sprintf("ncclResult(%d)", int32(r))
}

// Handles are the C pointers, carried as integers so no Go pointer crosses
// into C and the simulation can number them.
type (
	commHandle   uintptr // ncclComm_t
	streamHandle uintptr // cudaStream_t
	eventHandle  uintptr // cudaEvent_t
	cellHandle   uintptr // C memory holding one ncclComm_t that NCCL fills in later
)

// uniqueID is an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
type uniqueID [128]byte

// ncclDataType_t and ncclRedOp_t values (nccl.h).
const (
	ncclInt8     int32 = 0
	ncclUint8    int32 = 1
	ncclInt32    int32 = 2
	ncclUint32   int32 = 3
	ncclInt64    int32 = 4
	ncclUint64   int32 = 5
	ncclFloat16  int32 = 6
	ncclFloat32  int32 = 7
	ncclFloat64  int32 = 8
	ncclBfloat16 int32 = 9

	ncclSum  int32 = 0
	ncclProd int32 = 1
	ncclMax  int32 = 2
	ncclMin  int32 = 3
	ncclAvg  int32 = 4
)

// ncclCommShrink flags.
const (
	shrinkDefault = 0
	shrinkAbort   = 1
)

// ncclDType maps a comm.DType to its ncclDataType_t; every comm.DType has one.
func ncclDType(d comm.DType) (int32, bool) {
	switch d {
	case comm.Float32:
		return ncclFloat32, true
	case comm.Float64:
		return ncclFloat64, true
	case comm.Float16:
		return ncclFloat16, true
	case comm.BFloat16:
		return ncclBfloat16, true
	case comm.Int8:
		return ncclInt8, true
	case comm.Uint8:
		return ncclUint8, true
	case comm.Int32:
		return ncclInt32, true
	case comm.Int64:
		return ncclInt64, true
	}
	return 0, false
}

// ncclRedOp maps a comm.ReduceOp to its ncclRedOp_t.
func ncclRedOp(o comm.ReduceOp) (int32, bool) {
	switch o {
	case comm.Sum:
		return ncclSum, true
	case comm.Prod:
		return ncclProd, true
	case comm.Max:
		return ncclMax, true
	case comm.Min:
		return ncclMin, true
	case comm.Avg:
		return ncclAvg, true
	}
	return 0, false
}

// collKind names one NCCL enqueue call.
type collKind int32

const (
	kAllReduce collKind = iota + 1
	kBroadcast
	kReduce
	kAllGather
	kReduceScatter
	kAllToAll
	kGather
	kScatter
	kSend
	kRecv
)

var collKindNames = [...]string{"", "ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
	"ncclReduceScatter", "ncclAlltoAll", "ncclGather", "ncclScatter", "ncclSend", "ncclRecv"}

func (k collKind) String() string {
	if k > 0 && int(k) < len(collKindNames) {
		return collKindNames[k]
	}
	return fmt.Sprintf("coll(%d)", int32(k))
}

// collArgs is one NCCL enqueue call. Its layout matches the C struct
// ft_gop in dl.go (checked there), so a []collArgs is passed to C as is.
// count is NCCL's count argument for kind (per rank for AllGather's send,
// ReduceScatter's receive, AllToAll/Gather/Scatter's block); peer is the
// root of rooted collectives and the peer of Send/Recv.
type collArgs struct {
	kind  collKind
	dtype int32
	redop int32
	peer  int32
	send  uintptr
	recv  uintptr
	count uint64
}

// commConfig is what the backend sets in ncclConfig_t.
type commConfig struct {
	blocking bool
}

// splitConfig is the config of a comm made by ncclCommSplit: inherit
// passes NULL (the child takes the parent's config); otherwise the child
// gets blocking as given. Whether the split call itself blocks follows the
// parent.
type splitConfig struct {
	inherit  bool
	blocking bool
}

// ncclAPI is the part of NCCL the backend uses. Calls that create a
// communicator write it into a cell (C memory), because a nonblocking NCCL
// may fill it in after the call returns.
type ncclAPI interface {
	version() int
	// hasSymbol reports whether an optional entry point (e.g.
	// "ncclCommShrink") was found.
	hasSymbol(name string) bool
	getUniqueID(id *uniqueID) result
	commInitRank(dev int, out cellHandle, nranks int, id *uniqueID, rank int, cfg commConfig) result
	commSplit(c commHandle, color, key int, out cellHandle, cfg splitConfig) result
	commShrink(c commHandle, exclude []int32, out cellHandle, flags int) result
	// commGrow: existing ranks pass c and rank -1 (id only at the root);
	// joiners pass c == 0, id and their rank.
	commGrow(dev int, c commHandle, nranks int, id *uniqueID, rank int, out cellHandle, cfg commConfig) result
	commGetUniqueID(c commHandle, id *uniqueID) result
	commCount(c commHandle) (int, result)
	commUserRank(c commHandle) (int, result)
	commRevoke(c commHandle) result
	commAbort(c commHandle) result
	// commGetAsyncError returns the comm's asynchronous state (ncclSuccess,
	// ncclInProgress or an error) and the call's own result.
	commGetAsyncError(c commHandle) (async, r result)
	errorString(r result) string
	lastError(c commHandle) string
	// enqueue issues one call; group issues several between
	// ncclGroupStart and ncclGroupEnd in one go (NCCL's group state is
	// per OS thread, so a group must not span goroutine switches).
	// dev is made current first, in the same C call, so NCCL does not
	// switch devices back and forth inside.
	enqueue(dev int, c commHandle, s streamHandle, a *collArgs) result
	group(dev int, c commHandle, s streamHandle, ops []collArgs) result

	newCell() cellHandle
	loadCell(cell cellHandle) commHandle
	freeCell(cell cellHandle)
}

// cudaAPI is the part of the CUDA runtime the backend and the memory
// helpers use. dev selects the device current for the call.
type cudaAPI interface {
	runtimeVersion() int
	driverVersion() int
	deviceCount() (int, error)
	malloc(dev int, n int) (uintptr, error)
	free(dev int, p uintptr) error
	// copyHtoD and copyDtoH start a copy between host memory and the
	// device on s; the copy is done when s is. Go (pageable) memory is not
	// referenced after the call returns (CUDA stages it: an HtoD returns
	// once staged, a DtoH once done); page-locked memory from hostAlloc is
	// read or written by the copy engine until s is done.
	copyHtoD(dev int, dst uintptr, src []byte, s streamHandle) error
	copyDtoH(dev int, dst []byte, src uintptr, s streamHandle) error
	copyDtoD(dev int, dst, src uintptr, n int, s streamHandle) error
	memset(dev int, p uintptr, v byte, n int, s streamHandle) error
	// hostAlloc returns n bytes of page-locked host memory
	// (cudaHostAlloc, portable to every device); hostFree frees it.
	hostAlloc(dev int, n int) ([]byte, error)
	hostFree(buf []byte) error
	// pciBusID is the device's PCI address as CUDA prints it
	// ("0000:3b:00.0").
	pciBusID(dev int) (string, error)
	streamCreate(dev int) (streamHandle, error)
	streamDestroy(dev int, s streamHandle) error
	// streamQuery reports whether all work queued on s has completed.
	streamQuery(dev int, s streamHandle) (bool, error)
	eventCreate(dev int, timing bool) (eventHandle, error)
	eventDestroy(dev int, ev eventHandle) error
	eventRecord(dev int, ev eventHandle, s streamHandle) error
	// streamWaitEvent makes the work queued on s from now on wait for the
	// event's latest record (cudaStreamWaitEvent).
	streamWaitEvent(dev int, s streamHandle, ev eventHandle) error
	// eventQuery reports whether the work before the event's record is done.
	eventQuery(ev eventHandle) (bool, error)
	// eventElapsed is the time between two recorded timing events, in ms.
	eventElapsed(start, end eventHandle) (float32, error)
}

// library is everything the backend needs.
type library interface {
	ncclAPI
	cudaAPI
}
