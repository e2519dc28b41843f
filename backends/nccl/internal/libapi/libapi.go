// Package libapi is the seam between package nccl and the libraries it
// drives: Library, the calls nccl makes into NCCL and the CUDA runtime,
// and the C types those calls carry. It has two implementations: the real
// libraries, opened with dlopen (nccl's dl.go), and the simulation in Go
// memory that tests use (package ncclsim). It lives here, under internal,
// so that the simulation can be a package of its own, which only tests
// import, without the types becoming part of nccl's API.
//
// Nothing here keeps state: each Library value owns its own function
// table.
package libapi

import (
	"fmt"

	"github.com/ftcomm/ftcomm/comm"
)

// Result is an ncclResult_t.
type Result int32

// The ncclResult_t codes (nccl.h).
const (
	Success            Result = 0
	UnhandledCudaError Result = 1
	SystemError        Result = 2
	InternalError      Result = 3
	InvalidArgument    Result = 4
	InvalidUsage       Result = 5
	RemoteError        Result = 6
	InProgress         Result = 7
	Timeout            Result = 8
)

var resultNames = [...]string{"ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
	"ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress", "ncclTimeout"}

func (r Result) String() string {
	if r >= 0 && int(r) < len(resultNames) {
		return resultNames[r]
	}
	return fmt.Sprintf("ncclResult(%d)", int32(r))
}

// Handles are the C pointers, carried as integers so no Go pointer crosses
// into C and the simulation can number them.
type (
	Comm   uintptr // ncclComm_t
	Stream uintptr // cudaStream_t
	Event  uintptr // cudaEvent_t
	Cell   uintptr // C memory holding one ncclComm_t that NCCL fills in later
)

// UniqueID is an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
type UniqueID [128]byte

// DataType is an ncclDataType_t.
type DataType int32

// The ncclDataType_t values (nccl.h).
const (
	Int8     DataType = 0
	Uint8    DataType = 1
	Int32    DataType = 2
	Uint32   DataType = 3
	Int64    DataType = 4
	Uint64   DataType = 5
	Float16  DataType = 6
	Float32  DataType = 7
	Float64  DataType = 8
	Bfloat16 DataType = 9
)

// Size is the size of one element of t in bytes (0 for a value nccl.h
// does not name).
func (t DataType) Size() int {
	switch t {
	case Int8, Uint8:
		return 1
	case Float16, Bfloat16:
		return 2
	case Int32, Uint32, Float32:
		return 4
	case Int64, Uint64, Float64:
		return 8
	}
	return 0
}

// RedOp is an ncclRedOp_t.
type RedOp int32

// The ncclRedOp_t values (nccl.h).
const (
	Sum  RedOp = 0
	Prod RedOp = 1
	Max  RedOp = 2
	Min  RedOp = 3
	Avg  RedOp = 4
)

// pairs maps comm's values to NCCL's and back.
type pairs[C, N comparable] []struct {
	c C
	n N
}

func (p pairs[C, N]) nccl(c C) (N, bool) {
	for _, e := range p {
		if e.c == c {
			return e.n, true
		}
	}
	var zero N
	return zero, false
}

func (p pairs[C, N]) comm(n N) C {
	for _, e := range p {
		if e.n == n {
			return e.c
		}
	}
	var zero C
	return zero
}

// dataTypes pairs every comm.DType with its ncclDataType_t.
var dataTypes = pairs[comm.DType, DataType]{
	{comm.Float32, Float32}, {comm.Float64, Float64}, {comm.Float16, Float16}, {comm.BFloat16, Bfloat16},
	{comm.Int8, Int8}, {comm.Uint8, Uint8}, {comm.Int32, Int32}, {comm.Int64, Int64},
}

// redOps pairs every comm.ReduceOp with its ncclRedOp_t.
var redOps = pairs[comm.ReduceOp, RedOp]{
	{comm.Sum, Sum}, {comm.Prod, Prod}, {comm.Max, Max}, {comm.Min, Min}, {comm.Avg, Avg},
}

// DataTypeOf maps a comm.DType to its ncclDataType_t; every comm.DType has
// one.
func DataTypeOf(d comm.DType) (DataType, bool) { return dataTypes.nccl(d) }

// DType is the comm.DType of t (0 for a type comm has not).
func (t DataType) DType() comm.DType { return dataTypes.comm(t) }

// RedOpOf maps a comm.ReduceOp to its ncclRedOp_t.
func RedOpOf(o comm.ReduceOp) (RedOp, bool) { return redOps.nccl(o) }

// ReduceOp is the comm.ReduceOp of o (0 for an op comm has not).
func (o RedOp) ReduceOp() comm.ReduceOp { return redOps.comm(o) }

// ncclCommShrink flags.
const (
	ShrinkDefault = 0
	ShrinkAbort   = 1
)

// CollKind names one NCCL enqueue call.
type CollKind int32

const (
	AllReduce CollKind = iota + 1
	Broadcast
	Reduce
	AllGather
	ReduceScatter
	AllToAll
	Gather
	Scatter
	Send
	Recv
)

var collKindNames = [...]string{"", "ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
	"ncclReduceScatter", "ncclAlltoAll", "ncclGather", "ncclScatter", "ncclSend", "ncclRecv"}

func (k CollKind) String() string {
	if k > 0 && int(k) < len(collKindNames) {
		return collKindNames[k]
	}
	return fmt.Sprintf("coll(%d)", int32(k))
}

// PointToPoint reports whether an NCCL call is built from sends and
// receives (ncclAlltoAll, ncclGather and ncclScatter are, inside NCCL):
// their connections are made on first use of each peer, whatever
// NCCL_RUNTIME_CONNECT says.
func (k CollKind) PointToPoint() bool {
	switch k {
	case Send, Recv, AllToAll, Gather, Scatter:
		return true
	}
	return false
}

// CollArgs is one NCCL enqueue call. Its layout matches the C struct
// ft_gop in nccl's dl.go (checked there), so a []CollArgs is passed to C
// as is. Count is NCCL's count argument for Kind (per rank for
// AllGather's send, ReduceScatter's receive, AllToAll/Gather/Scatter's
// block); Peer is the root of rooted collectives and the peer of
// Send/Recv.
type CollArgs struct {
	Kind  CollKind
	Type  DataType
	Op    RedOp
	Peer  int32
	Send  uintptr
	Recv  uintptr
	Count uint64
}

// CommConfig is what the backend sets in ncclConfig_t.
type CommConfig struct {
	Blocking bool
	// SplitShare lets the comm's ncclCommSplit children share its
	// resources (splitShare = 1; the backend never sets it, a GPU test of
	// NCCL's rules does).
	SplitShare bool
}

// ChildConfig is the config of a comm made by ncclCommSplit or
// ncclCommShrink: Inherit passes NULL (the child takes the parent's
// config); otherwise the child gets Blocking as given. Whether the call
// itself blocks follows the parent.
type ChildConfig struct {
	Inherit  bool
	Blocking bool
}

// NCCL is the part of NCCL the backend uses. Calls that create a
// communicator write it into a cell (C memory), because a nonblocking NCCL
// may fill it in after the call returns.
type NCCL interface {
	Version() int
	// HasSymbol reports whether an optional entry point (e.g.
	// "ncclCommShrink") was found.
	HasSymbol(name string) bool
	GetUniqueID(id *UniqueID) Result
	CommInitRank(dev int, out Cell, nranks int, id *UniqueID, rank int, cfg CommConfig) Result
	CommSplit(c Comm, color, key int, out Cell, cfg ChildConfig) Result
	CommShrink(c Comm, exclude []int32, out Cell, cfg ChildConfig, flags int) Result
	// CommGrow: existing ranks pass c and rank -1 (id only at the root);
	// joiners pass c == 0, id and their rank.
	CommGrow(dev int, c Comm, nranks int, id *UniqueID, rank int, out Cell, cfg CommConfig) Result
	CommGetUniqueID(c Comm, id *UniqueID) Result
	CommCount(c Comm) (int, Result)
	CommUserRank(c Comm) (int, Result)
	CommRevoke(c Comm) Result
	CommAbort(c Comm) Result
	// CommGetAsyncError returns the comm's asynchronous state (ncclSuccess,
	// ncclInProgress or an error) and the call's own result.
	CommGetAsyncError(c Comm) (async, r Result)
	ErrorString(r Result) string
	LastError(c Comm) string
	// Enqueue issues one call; Group issues several between
	// ncclGroupStart and ncclGroupEnd in one go (NCCL's group state is
	// per OS thread, so a group must not span goroutine switches).
	// dev is made current first, in the same C call, so NCCL does not
	// switch devices back and forth inside.
	Enqueue(dev int, c Comm, s Stream, a *CollArgs) Result
	Group(dev int, c Comm, s Stream, ops []CollArgs) Result

	NewCell() Cell
	LoadCell(cell Cell) Comm
	FreeCell(cell Cell)
}

// CUDA is the part of the CUDA runtime the backend and the memory helpers
// use. dev selects the device current for the call.
type CUDA interface {
	RuntimeVersion() int
	DriverVersion() int
	DeviceCount() (int, error)
	Malloc(dev int, n int) (uintptr, error)
	Free(dev int, p uintptr) error
	// CopyHtoD and CopyDtoH start a copy between host memory and the
	// device on s; the copy is done when s is. Go (pageable) memory is not
	// referenced after the call returns (CUDA stages it: an HtoD returns
	// once staged, a DtoH once done); page-locked memory from HostAlloc is
	// read or written by the copy engine until s is done.
	CopyHtoD(dev int, dst uintptr, src []byte, s Stream) error
	CopyDtoH(dev int, dst []byte, src uintptr, s Stream) error
	CopyDtoD(dev int, dst, src uintptr, n int, s Stream) error
	Memset(dev int, p uintptr, v byte, n int, s Stream) error
	// HostAlloc returns n bytes of page-locked host memory
	// (cudaHostAlloc, portable to every device); HostFree frees it.
	HostAlloc(dev int, n int) ([]byte, error)
	HostFree(buf []byte) error
	// PCIBusID is the device's PCI address as CUDA prints it
	// ("0000:3b:00.0").
	PCIBusID(dev int) (string, error)
	StreamCreate(dev int) (Stream, error)
	StreamDestroy(dev int, s Stream) error
	// StreamQuery reports whether all work queued on s has completed.
	StreamQuery(dev int, s Stream) (bool, error)
	EventCreate(dev int, timing bool) (Event, error)
	EventDestroy(dev int, ev Event) error
	EventRecord(dev int, ev Event, s Stream) error
	// StreamWaitEvent makes the work queued on s from now on wait for the
	// event's latest record (cudaStreamWaitEvent).
	StreamWaitEvent(dev int, s Stream, ev Event) error
	// EventQuery reports whether the work before the event's record is done.
	EventQuery(ev Event) (bool, error)
	// EventElapsed is the time between two recorded timing events, in ms.
	EventElapsed(start, end Event) (float32, error)
}

// Library is everything the backend needs.
type Library interface {
	NCCL
	CUDA
}

// CUDAError is a failed CUDA runtime call.
type CUDAError struct {
	Op   string
	Code int
	Msg  string
}

func (e *CUDAError) Error() string {
	return fmt.Sprintf("nccl: %s: cuda error %d: %s", e.Op, e.Code, e.Msg)
}

// Simulator is NCCL and the CUDA runtime simulated in Go memory (package
// ncclsim's Simulation), which nccl.OpenSimulation drives in place of the
// real libraries.
type Simulator interface {
	// SimulatedLibrary is the simulation as the libraries nccl drives.
	SimulatedLibrary() Library
}
