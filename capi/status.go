package main

/*
#include <stdint.h>
#include <string.h>

// Statuses: FTCOMM_OK, FTCOMM_PENDING (a bounded wait ended first), or an
// error kind; ftcomm_last_error has the details.
enum {
	FTCOMM_OK = 0,
	FTCOMM_PENDING = 1,
	FTCOMM_ERR_BAD_HANDLE = -1,
	FTCOMM_ERR_INVALID_ARGUMENT = -2,
	FTCOMM_ERR_INTERRUPTED = -3,
	FTCOMM_ERR_ROLLED_BACK = -4,
	FTCOMM_ERR_GROUP_DIVERGED = -5,
	FTCOMM_ERR_PEER_FAILED = -6,
	FTCOMM_ERR_MISMATCH = -7,
	FTCOMM_ERR_REVOKED = -8,
	FTCOMM_ERR_TIMEOUT = -9,
	FTCOMM_ERR_CLOSED = -10,
	FTCOMM_ERR_NOT_PARTICIPATING = -11,
	FTCOMM_ERR_TOO_MANY_COMMIT_FAILURES = -12,
	FTCOMM_ERR_MEMBERSHIP_LOST = -13,
	FTCOMM_ERR_BACKEND_UNAVAILABLE = -14,
	FTCOMM_ERR_ABORTED = -15,
	FTCOMM_ERR_SHORT_BUFFER = -16,
	FTCOMM_ERR_INTERNAL = -17,
	FTCOMM_ERR_OTHER = -18,
	FTCOMM_ERR_FINISHED = -19,
	FTCOMM_ERR_PEER_REFUSED = -20,
	FTCOMM_ERR_NO_STEP = -21,
	FTCOMM_ERR_SNAPSHOT_LOST = -22
};

// Ops of ftcomm_comm_op and ftcomm_ft_op.
enum {
	FTCOMM_OP_ALL_REDUCE = 1,
	FTCOMM_OP_REDUCE_SCATTER = 2,
	FTCOMM_OP_ALL_GATHER = 3,
	FTCOMM_OP_BROADCAST = 4,
	FTCOMM_OP_REDUCE = 5,
	FTCOMM_OP_SCATTER = 6,
	FTCOMM_OP_GATHER = 7,
	FTCOMM_OP_ALL_TO_ALL = 8,
	FTCOMM_OP_BARRIER = 9,
	FTCOMM_OP_SEND = 10,
	FTCOMM_OP_RECV = 11,
	FTCOMM_OP_ALL_GATHER_V = 12,     // ftcomm_comm_opv
	FTCOMM_OP_REDUCE_SCATTER_V = 13, // ftcomm_comm_opv
	FTCOMM_OP_ALL_TO_ALL_V = 14      // ftcomm_comm_opv
};

// Kinds of a ftcomm_comm_batch entry.
enum { FTCOMM_P2P_SEND = 1, FTCOMM_P2P_RECV = 2 };

// Op flags.
enum { FTCOMM_ASYNC = 1 };

// Element types (comm.DType) and reductions (comm.ReduceOp).
enum {
	FTCOMM_FLOAT32 = 1, FTCOMM_FLOAT64 = 2, FTCOMM_FLOAT16 = 3, FTCOMM_BFLOAT16 = 4,
	FTCOMM_INT8 = 5, FTCOMM_UINT8 = 6, FTCOMM_INT32 = 7, FTCOMM_INT64 = 8
};
enum {
	FTCOMM_SUM = 1, FTCOMM_PRODUCT = 2, FTCOMM_MIN = 3, FTCOMM_MAX = 4, FTCOMM_AVG = 5,
	FTCOMM_BAND = 6, FTCOMM_BOR = 7, FTCOMM_BXOR = 8
};
*/
import "C"

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime/debug"
	"syscall"
	"unsafe"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
)

// ABIVersion is what ftcomm_abi_version returns; it changes whenever an
// entry point's signature or meaning does.
const ABIVersion = 9 // 9: ftcomm_quiesce; 8: ftcomm_ft_group_comm, ft setting "group_backend"; 7: ftcomm_ft_fail_step; 6: peer snapshots (ft setting "snapshot_every", FTCOMM_ERR_SNAPSHOT_LOST, the "restored" event, "snapshot" in the rollback JSON), slot spares (group_rank -1 with spare; ftcomm_ft_group_rank); 3: FTCOMM_ERR_PEER_REFUSED, "refused" in the error JSON, ftcomm_comm_refuse, ftcomm_ft_refuse; 4: ft settings "spare" and "host", the "promoted" event; 5: the sampler (ftcomm_ft_sampler_new, ftcomm_sampler_*), FTCOMM_ERR_NO_STEP, the kind "sampler_mismatch"

// Statuses. The order of kinds below is their priority: a call's status
// is the first kind its error matches; the JSON lists all of them.
const (
	statusOK      = 0
	statusPending = 1

	errBadHandle        = -1
	errInvalidArgument  = -2
	errInterrupted      = -3
	errRolledBack       = -4
	errGroupDiverged    = -5
	errPeerFailed       = -6
	errMismatch         = -7
	errRevoked          = -8
	errTimeout          = -9
	errClosed           = -10
	errNotParticipating = -11
	errTooManyFailures  = -12
	errMembershipLost   = -13
	errBackendUnavail   = -14
	errAborted          = -15
	errShortBuffer      = -16
	errInternal         = -17
	errOther            = -18
	errFinished         = -19
	errPeerRefused      = -20
	errNoStep           = -21
	errSnapshotLost     = -22
)

// Sentinels of the ABI itself.
var (
	// ErrBadHandle: an unknown handle, one already freed, or one of
	// another kind.
	ErrBadHandle = errors.New("ftcomm: bad handle")
	// ErrInterrupted: the call was ended by ftcomm_interrupt (SIGINT).
	ErrInterrupted = errors.New("ftcomm: interrupted")
	// errPanic marks a recovered panic.
	errPanic = errors.New("ftcomm: internal error")
	// errShort: the caller's buffer is too small.
	errShort = errors.New("ftcomm: buffer too small")
)

// Op kinds of ftcomm_comm_op and ftcomm_ft_op.
const (
	opAllReduce      = C.FTCOMM_OP_ALL_REDUCE
	opReduceScatter  = C.FTCOMM_OP_REDUCE_SCATTER
	opAllGather      = C.FTCOMM_OP_ALL_GATHER
	opBroadcast      = C.FTCOMM_OP_BROADCAST
	opReduce         = C.FTCOMM_OP_REDUCE
	opScatter        = C.FTCOMM_OP_SCATTER
	opGather         = C.FTCOMM_OP_GATHER
	opAllToAll       = C.FTCOMM_OP_ALL_TO_ALL
	opBarrier        = C.FTCOMM_OP_BARRIER
	opSend           = C.FTCOMM_OP_SEND
	opRecv           = C.FTCOMM_OP_RECV
	opAllGatherV     = C.FTCOMM_OP_ALL_GATHER_V
	opReduceScatterV = C.FTCOMM_OP_REDUCE_SCATTER_V
	opAllToAllV      = C.FTCOMM_OP_ALL_TO_ALL_V
	// opBatch is ftcomm_comm_batch's (not a value of the C enum).
	opBatch = 100
)

// Kinds of a ftcomm_comm_batch entry.
const (
	p2pSend = C.FTCOMM_P2P_SEND
	p2pRecv = C.FTCOMM_P2P_RECV
)

// flagAsync: return a work handle at once instead of completing the op.
const flagAsync = C.FTCOMM_ASYNC

type kind struct {
	status int32
	name   string
	match  func(error) bool
}

func is(target error) func(error) bool { return func(err error) bool { return errors.Is(err, target) } }

var kinds = []kind{
	{errBadHandle, "bad_handle", is(ErrBadHandle)},
	{errInvalidArgument, "invalid_argument", is(comm.ErrInvalidArgument)},
	// A refinement of invalid_argument (which comes first, so it is never
	// a status of its own): the sampler's state came from another config.
	{errInvalidArgument, "sampler_mismatch", func(err error) bool {
		var m *ft.SamplerMismatchError
		return errors.As(err, &m)
	}},
	{errNoStep, "no_step", is(ft.ErrNoStep)},
	{errPeerRefused, "peer_refused", is(comm.ErrPeerRefused)},
	{errInterrupted, "interrupted", is(ErrInterrupted)},
	{errRolledBack, "rolled_back", is(ft.ErrRolledBack)},
	{errFinished, "finished", is(ft.ErrFinished)},
	{errGroupDiverged, "group_diverged", is(ft.ErrGroupDiverged)},
	{errSnapshotLost, "snapshot_lost", is(ft.ErrSnapshotLost)},
	{errPeerFailed, "peer_failed", is(comm.ErrPeerFailed)},
	{errMismatch, "mismatch", is(comm.ErrMismatch)},
	{errRevoked, "revoked", is(comm.ErrRevoked)},
	{errTimeout, "timeout", func(err error) bool {
		return errors.Is(err, comm.ErrTimeout) || errors.Is(err, context.DeadlineExceeded)
	}},
	{errClosed, "closed", func(err error) bool { return errors.Is(err, comm.ErrClosed) || errors.Is(err, ft.ErrClosed) }},
	{errNotParticipating, "not_participating", is(ft.ErrNotParticipating)},
	{errTooManyFailures, "too_many_commit_failures", is(ft.ErrTooManyCommitFailures)},
	{errMembershipLost, "membership_lost", is(ft.ErrMembershipLost)},
	{errBackendUnavail, "backend_unavailable", is(comm.ErrBackendUnavailable)},
	{errAborted, "aborted", is(comm.ErrAborted)},
	{errShortBuffer, "short_buffer", is(errShort)},
	{errInternal, "internal", is(errPanic)},
}

// errInfo is a failed call's error as ftcomm_last_error reports it.
type errInfo struct {
	Status   int32     `json:"status"`
	Kinds    []string  `json:"kinds"`
	Message  string    `json:"message"`
	Ranks    []int     `json:"ranks,omitempty"`
	Rollback *rollback `json:"rollback,omitempty"`
	Finished *finished `json:"finished,omitempty"`
	Refused  *refused  `json:"refused,omitempty"`
}

// refused is a comm.Refusal: a peer refused the op.
type refused struct {
	Rank   int    `json:"rank"`   // the rank that refused
	Op     string `json:"op"`     // its op, as comm.OpType names it
	Reason string `json:"reason"` // what it found wrong
}

type finished struct {
	Final int64 `json:"final"` // the run's last step
	Step  int64 `json:"step"`  // this replica's committed step
}

type rollback struct {
	FromStep int64  `json:"from_step"`
	ToStep   int64  `json:"to_step"`
	Step     int64  `json:"step"`
	Epoch    uint64 `json:"epoch"`
	// Snapshot: the replica group restored its peer snapshot of Step.
	Snapshot bool `json:"snapshot,omitempty"`
}

func classify(err error) errInfo {
	info := errInfo{Status: errOther, Message: err.Error(), Ranks: comm.FailedRanks(err)}
	for _, k := range kinds {
		if k.match(err) {
			if info.Status == errOther {
				info.Status = k.status
			}
			info.Kinds = append(info.Kinds, k.name)
		}
	}
	if info.Kinds == nil {
		info.Kinds = []string{"other"}
	}
	var rb *ft.RollbackError
	if errors.As(err, &rb) {
		info.Rollback = &rollback{FromStep: rb.FromStep, ToStep: rb.ToStep, Step: rb.Step, Epoch: rb.Epoch, Snapshot: rb.Snapshot}
	}
	var fe *ft.FinishedError
	if errors.As(err, &fe) {
		info.Finished = &finished{Final: fe.Final, Step: fe.Step}
	}
	var rf *comm.Refusal
	if errors.As(err, &rf) {
		info.Refused = &refused{Rank: rf.Rank, Op: rf.Op.String(), Reason: rf.Reason}
	}
	return info
}

// fail records err as the calling thread's last error and returns its
// status. The exported functions run on the caller's OS thread (cgo
// callbacks are bound to it), so the thread id names the caller.
func fail(err error) C.int32_t {
	info := classify(err)
	abi.setLastError(syscall.Gettid(), &info)
	return C.int32_t(info.Status)
}

// guard runs f and turns its error, or a panic, into a status.
func guard(f func() error) (st C.int32_t) {
	defer func() {
		if r := recover(); r != nil {
			st = fail(fmt.Errorf("%w: panic: %v\n%s", errPanic, r, debug.Stack()))
		}
	}()
	if err := f(); err != nil {
		return fail(err)
	}
	return statusOK
}

// putBytes copies b into the caller's buffer (cap bytes at buf, plus a
// NUL when it fits) and stores len(b) in *n; a buffer too small gets
// errShort and nothing copied.
func putBytes(b []byte, buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t) error {
	if n != nil {
		*n = C.int64_t(len(b))
	}
	if int64(len(b)) > int64(capacity) || (len(b) > 0 && buf == nil) {
		return fmt.Errorf("%w: %d bytes needed, %d given", errShort, len(b), capacity)
	}
	if len(b) > 0 {
		C.memcpy(buf, unsafe.Pointer(unsafe.SliceData(b)), C.size_t(len(b)))
	}
	if int64(len(b)) < int64(capacity) {
		*(*byte)(unsafe.Add(buf, len(b))) = 0
	}
	return nil
}

// putJSON marshals v into the caller's buffer as putBytes does.
func putJSON(v any, buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return putBytes(b, buf, capacity, n)
}

//export ftcomm_abi_version
func ftcomm_abi_version() C.int32_t { return ABIVersion }

// ftcomm_last_error copies the calling thread's last error (JSON) into
// buf and clears it; it returns the length of the JSON (0: none), and
// copies nothing when cap is smaller (call again with a larger buffer:
// the error is kept until it fits).
//
//export ftcomm_last_error
func ftcomm_last_error(buf unsafe.Pointer, capacity C.int64_t) C.int64_t {
	tid := syscall.Gettid()
	info := abi.lastError(tid)
	if info == nil {
		return 0
	}
	b, err := json.Marshal(info)
	if err != nil {
		b = []byte(`{"status":-17,"kinds":["internal"],"message":"ftcomm: cannot encode the error"}`)
	}
	var n C.int64_t
	if putBytes(b, buf, capacity, &n) == nil {
		abi.clearLastError(tid)
	}
	return n
}
