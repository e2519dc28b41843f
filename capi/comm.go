package main

/*
#include <stdint.h>
#include <stdlib.h>
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/comm"
)

// commSettings are ftcomm_comm_new's settings (JSON).
type commSettings struct {
	Rank     int     `json:"rank"`
	Size     int     `json:"size"`
	Name     string  `json:"name"`
	Prefix   string  `json:"prefix"`
	Epoch    uint64  `json:"epoch"`
	TimeoutS float64 `json:"timeout_s"` // per op; also bounds the rendezvous, unless:
	// RendezvousS bounds the rendezvous (connecting to the peers), when set.
	RendezvousS float64 `json:"rendezvous_timeout_s"`
	Device      *int    `json:"device"` // CUDA ordinal (nccl)
	JobID       string  `json:"job_id"`
	Secret      string  `json:"secret"`
	LogLevel    string  `json:"log_level"`
	// gloo
	ListenAddr   string `json:"listen_addr"`
	SharedMemory *bool  `json:"shared_memory"`
	// nccl
	NCCLLib   string `json:"nccl_lib"`
	CUDARTLib string `json:"cudart_lib"`
	Revoke    string `json:"revoke"` // "deferred" (default) or "native"
	// AbortProcess: a timeout or failure that breaks the comm aborts the
	// process (SIGABRT), as torchcomms' abort_process_on_timeout_or_error.
	AbortProcess bool `json:"abort_process_on_error"`
}

// commObj is what a comm handle names.
type commObj struct {
	c       *comm.Comm
	can     *canceler
	backend string
	device  int // -1: host memory
	log     *zap.Logger
	// abortProcess: the settings' abort_process_on_error (inherited by the
	// comms a shrink, grow or split makes); callerStopped: the caller
	// aborted or revoked the comm itself, which is no reason to abort.
	abortProcess  bool
	callerStopped atomic.Bool
	// borrowed: the comm is another owner's (ftcomm_ft_group_comm's is
	// ft's); freeing the handle leaves it open.
	borrowed bool
}

// watchFatal makes a comm that breaks on a timeout or a failure abort the
// process, with the reason and the flight recorder on stderr, unless the
// caller broke it (abort, revoke, an interrupt) or closed it. The goroutine exits when
// the comm breaks or is closed (Broken is closed either way).
func (o *commObj) watchFatal() {
	if !o.abortProcess {
		return
	}
	go func() {
		<-o.c.Broken()
		err := o.c.Err()
		if err == nil || errors.Is(err, comm.ErrClosed) || errors.Is(err, ErrInterrupted) || o.callerStopped.Load() {
			return
		}
		why := "error"
		if errors.Is(err, comm.ErrTimeout) {
			why = "timeout"
		}
		fmt.Fprintf(os.Stderr, "ftcomm: Aborting process due to %s (abort_process_on_timeout_or_error): comm %s rank %d of %d: %v\n",
			why, o.c.Name(), o.c.Rank(), o.c.Size(), err)
		os.Stderr.Write(o.c.Dump())
		os.Stderr.Write([]byte("\n"))
		C.abort()
	}()
}

// ncclLibrary is the NCCL every comm of this process shares (opened at
// the first nccl comm; libraries are never unloaded).
var ncclLibrary struct {
	sync.Mutex
	L *nccl.Library
}

func sharedNCCL(cfg nccl.LibraryConfig) (*nccl.Library, error) {
	ncclLibrary.Lock()
	defer ncclLibrary.Unlock()
	if ncclLibrary.L == nil {
		L, err := nccl.Open(cfg)
		if err != nil {
			return nil, err
		}
		ncclLibrary.L = L
	}
	return ncclLibrary.L, nil
}

func (s *commSettings) options(backend string, store comm.Store, log *zap.Logger) (comm.Options, error) {
	o := comm.Options{Rank: s.Rank, Size: s.Size, Name: s.Name, Prefix: s.Prefix, Epoch: s.Epoch,
		Timeout: seconds(s.TimeoutS), JobID: s.JobID, Secret: []byte(s.Secret), Store: store, Logger: log}
	switch backend {
	case "gloo":
		if s.Device != nil && *s.Device >= 0 {
			return o, fmt.Errorf("%w: backend gloo keeps host memory; device %d given", comm.ErrInvalidArgument, *s.Device)
		}
		g := gloo.DefaultConfig()
		g.LockedCallers = true // every op here runs on a cgo callback
		// torchcomms semantics: ranks done with their part may finalize
		// while others still exchange point to point.
		g.KeepPointToPointAfterLeave = true
		if s.ListenAddr != "" {
			g.ListenAddr = s.ListenAddr
		}
		if s.SharedMemory != nil {
			g.SharedMemory = *s.SharedMemory && g.SharedMemory
		}
		o.BackendConfig = g
	case "nccl":
		if s.Device == nil || *s.Device < 0 {
			return o, fmt.Errorf("%w: backend nccl needs a CUDA device", comm.ErrInvalidArgument)
		}
		o.Device = *s.Device
		L, err := sharedNCCL(ncclLibraryConfig(s.NCCLLib, s.CUDARTLib))
		if err != nil {
			return o, err
		}
		cfg := ncclConfigWith(L)
		switch s.Revoke {
		case "", "deferred":
		case "native":
			cfg.Revoke = nccl.RevokeNative
		default:
			return o, fmt.Errorf("%w: revoke %q (want deferred or native)", comm.ErrInvalidArgument, s.Revoke)
		}
		o.BackendConfig = cfg
	}
	return o, nil
}

func ncclLibraryConfig(ncclLib, cudartLib string) nccl.LibraryConfig {
	return nccl.LibraryConfig{NCCLPath: ncclLib, CUDARuntimePath: cudartLib}
}

func ncclConfigWith(L *nccl.Library) *nccl.Config {
	cfg := nccl.DefaultConfig()
	cfg.Library = L
	return &cfg
}

// ftcomm_nccl_info copies what NCCL and CUDA runtime this process's nccl
// comms use (JSON: nccl.Info, with "loaded": false before the first nccl
// comm) into buf: the library chosen ("nccl_path", "nccl_source": config,
// env, process (already loaded in it), system or python — the newest NCCL
// on the machine unless one was named, nccl.Open), every candidate the
// search considered
// ("candidates": path, source, where, version), and the fault path the
// version allows ("recovery": fresh-init, shrink-abort or revoke+shrink).
//
//export ftcomm_nccl_info
func ftcomm_nccl_info(buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t) C.int32_t {
	return guard(func() error {
		ncclLibrary.Lock()
		L := ncclLibrary.L
		ncclLibrary.Unlock()
		if L == nil {
			return putJSON(map[string]any{"loaded": false}, buf, capacity, n)
		}
		i := L.Info()
		cands := make([]map[string]any, len(i.Candidates))
		for k, c := range i.Candidates {
			cands[k] = map[string]any{"path": c.Path, "source": c.Source, "where": c.Where, "version": c.Version.String()}
		}
		return putJSON(map[string]any{"loaded": true, "nccl": i.NCCL.String(), "nccl_path": i.NCCLPath,
			"nccl_source": i.NCCLSource, "candidates": cands, "recovery": i.Recovery.String(),
			"cudart_path": i.CUDARuntimePath, "cuda_runtime": i.CUDARuntime, "cuda_driver": i.CUDADriver,
			"features": i.Features, "eager_connect": i.EagerConnect}, buf, capacity, n)
	})
}

func goString(p *C.char) string {
	if p == nil {
		return ""
	}
	return C.GoString(p)
}

// ftcomm_comm_new creates this rank's communicator on backend ("gloo" or
// "nccl") and blocks until it is connected to its peers (within the
// settings' timeout_s, default 300 s; interruptible). store is a store
// handle (ftcomm_store_*) the ranks rendezvous through, 0 only for a
// single rank.
//
//export ftcomm_comm_new
func ftcomm_comm_new(backend *C.char, settings *C.char, store C.uint64_t, out *C.uint64_t) C.int32_t {
	return guard(func() error {
		var s commSettings
		if err := decode(goString(settings), &s); err != nil {
			return err
		}
		b := goString(backend)
		var st comm.Store
		if store != 0 {
			so, err := lookup[*storeObj](uint64(store))
			if err != nil {
				return err
			}
			st = so.store
		}
		log, err := newLogger(s.LogLevel, "ftcomm."+b)
		if err != nil {
			return err
		}
		o, err := s.options(b, st, log)
		if err != nil {
			return err
		}
		can := newCanceler()
		ctx := can.enter()
		defer can.leave()
		limit := 300 * time.Second
		switch {
		case s.RendezvousS > 0:
			limit = seconds(s.RendezvousS)
		case o.Timeout > 0:
			limit = o.Timeout
		}
		ctx, cancel := context.WithTimeout(ctx, limit)
		defer cancel()
		c, err := comm.New(ctx, b, o)
		if err != nil {
			can.release()
			return interrupted(ctx, err)
		}
		dev := -1
		if c.Backend().Memory() == comm.DeviceMemory {
			dev = o.Device
		}
		obj := &commObj{c: c, can: can, backend: b, device: dev, log: log, abortProcess: s.AbortProcess}
		obj.watchFatal()
		*out = C.uint64_t(abi.put(obj))
		return nil
	})
}

// ftcomm_comm_free closes the comm (a pending op fails with ErrClosed)
// and frees its handle.
//
//export ftcomm_comm_free
func ftcomm_comm_free(h C.uint64_t) C.int32_t {
	return guard(func() error { return freeComm(uint64(h)) })
}

// freeComm is ftcomm_comm_free: it closes the comm of handle h. A backend
// that frees its device resources in the background after Close (nccl's:
// ncclCommAbort takes about half a second) is not waited for here, which
// would stall every shrink and grow by as much (the comm it replaces is
// freed there), but remembered for ftcomm_quiesce.
func freeComm(h uint64) error {
	o, err := take[*commObj](h)
	if err != nil {
		return err
	}
	o.can.release()
	if o.borrowed {
		return nil
	}
	b := o.c.Backend()
	err = o.c.Close()
	releases.track(b)
	o.log.Sync()
	return err
}

// releaser is a backend that frees its device resources in the background
// after Close; Released is closed once it has.
type releaser interface {
	Released() <-chan struct{}
	ReleaseErr() error
}

// releases are the backends of freed comms still releasing their device
// resources.
var releases pendingReleases

type pendingReleases struct {
	mu sync.Mutex
	rs []releaser
}

// track remembers b if it releases in the background, and forgets those
// already released.
func (p *pendingReleases) track(b comm.Backend) {
	r, ok := b.(releaser)
	if !ok {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rs = slices.DeleteFunc(p.rs, func(r releaser) bool { return isDone(r.Released()) })
	p.rs = append(p.rs, r)
}

// await waits, bound at most, until every backend tracked so far has
// released its device resources.
func (p *pendingReleases) await(bound time.Duration) error {
	p.mu.Lock()
	rs := p.rs
	p.rs = nil
	p.mu.Unlock()
	deadline := time.Now().Add(bound)
	var errs []error
	for i, r := range rs {
		if err := awaitReleased(r, time.Until(deadline)); err != nil {
			errs = append(errs, err)
			if errors.Is(err, comm.ErrTimeout) {
				return errors.Join(append(errs, fmt.Errorf("ftcomm: %d more comms not awaited", len(rs)-i-1))...)
			}
		}
	}
	return errors.Join(errs...)
}

func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// ftcomm_quiesce waits, timeout_ms at most, until every comm freed so far
// has released its device resources (an NCCL comm frees its NCCL comms in
// the background after its free). A process calls it before it exits
// (Python's package does, at exit): CUDA torn down under a release still
// running crashed the process (SIGSEGV in ncclCommAbort, seen at the end
// of train_hsdp's spare). FTCOMM_ERR_TIMEOUT when some did not finish.
//
//export ftcomm_quiesce
func ftcomm_quiesce(timeoutMs C.int64_t) C.int32_t {
	return guard(func() error { return releases.await(time.Duration(timeoutMs) * time.Millisecond) })
}

// awaitReleased waits, at most bound, until r has released its device
// resources: a typed timeout past bound.
func awaitReleased(r releaser, bound time.Duration) error {
	t := time.NewTimer(max(bound, 0))
	defer t.Stop()
	select {
	case <-r.Released():
		if err := r.ReleaseErr(); err != nil {
			return fmt.Errorf("ftcomm: releasing a comm's device resources: %w (its GPU work may still use device memory)", err)
		}
		return nil
	case <-t.C:
		return fmt.Errorf("ftcomm: %w: a freed comm's device resources were not released within %v: its GPU work may still use device memory",
			comm.ErrTimeout, bound)
	}
}

type commInfo struct {
	Rank    int    `json:"rank"`
	Size    int    `json:"size"`
	Epoch   uint64 `json:"epoch"`
	Name    string `json:"name"`
	Backend string `json:"backend"`
	Device  int    `json:"device"`
	Err     string `json:"error,omitempty"`
}

// ftcomm_comm_info copies {rank, size, epoch, name, backend, device,
// error} (JSON) into buf.
//
//export ftcomm_comm_info
func ftcomm_comm_info(h C.uint64_t, buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		info := commInfo{Rank: o.c.Rank(), Size: o.c.Size(), Epoch: o.c.Epoch(), Name: o.c.Name(), Backend: o.backend, Device: o.device}
		if e := o.c.Err(); e != nil {
			info.Err = e.Error()
		}
		return putJSON(info, buf, capacity, n)
	})
}

// ftcomm_comm_dump copies the comm's flight recorder (JSON) into buf.
//
//export ftcomm_comm_dump
func ftcomm_comm_dump(h C.uint64_t, buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		return putBytes(o.c.Dump(), buf, capacity, n)
	})
}

// opArgs are one op's arguments as they cross the ABI.
type opArgs struct {
	kind     int32
	out, in  comm.Tensor
	redop    comm.ReduceOp
	root     int
	counts   []int // all_gather_v, reduce_scatter_v; all_to_all_v's out counts
	inCounts []int // all_to_all_v
	p2p      []comm.P2POp
	stream   uintptr
	device   bool
	timeout  time.Duration
	async    bool
}

func makeArgs(kind C.int32_t, out unsafe.Pointer, outCount C.int64_t, in unsafe.Pointer, inCount C.int64_t,
	dtype, device, redop, root C.int32_t, stream C.uint64_t, timeoutNs C.int64_t, flags C.int32_t) (opArgs, error) {
	a := opArgs{kind: int32(kind), redop: comm.ReduceOp(redop), root: int(root), stream: uintptr(stream),
		device: device >= 0, timeout: time.Duration(timeoutNs), async: flags&flagAsync != 0}
	if redop < 0 || redop > 255 {
		return a, fmt.Errorf("%w: reduce op %d", comm.ErrInvalidArgument, redop)
	}
	var err error
	if kind != opBarrier {
		if a.out, err = tensor(out, int64(outCount), int32(dtype), int32(device)); err != nil {
			return a, err
		}
	}
	switch kind {
	case opReduceScatter, opAllGather, opAllToAll, opScatter, opGather, opAllGatherV, opReduceScatterV, opAllToAllV:
		// Two-tensor ops take in even when it is empty (0 elements at NULL).
	default:
		if in == nil && inCount == 0 {
			return a, nil
		}
	}
	if a.in, err = tensor(in, int64(inCount), int32(dtype), int32(device)); err != nil {
		return a, err
	}
	return a, nil
}

// issue starts the op on c: sync (returns nil once done) or async (w).
func (a *opArgs) issue(ctx context.Context, c *comm.Comm) (w *comm.Work, err error) {
	if a.async {
		switch a.kind {
		case opAllReduce:
			return c.AllReduceAsync(ctx, a.out, a.redop), nil
		case opReduceScatter:
			return c.ReduceScatterAsync(ctx, a.out, a.in, a.redop), nil
		case opAllGather:
			return c.AllGatherAsync(ctx, a.out, a.in), nil
		case opBroadcast:
			return c.BroadcastAsync(ctx, a.out, a.root), nil
		case opReduce:
			return c.ReduceAsync(ctx, a.out, a.redop, a.root), nil
		case opScatter:
			return c.ScatterAsync(ctx, a.out, a.in, a.root), nil
		case opGather:
			return c.GatherAsync(ctx, a.out, a.in, a.root), nil
		case opAllToAll:
			return c.AllToAllAsync(ctx, a.out, a.in), nil
		case opBarrier:
			return c.BarrierAsync(ctx), nil
		case opSend:
			return c.SendAsync(ctx, a.out, a.root), nil
		case opRecv:
			return c.RecvAsync(ctx, a.out, a.root), nil
		case opAllGatherV:
			return c.AllGatherVAsync(ctx, a.out, a.in, a.counts), nil
		case opReduceScatterV:
			return c.ReduceScatterVAsync(ctx, a.out, a.in, a.counts, a.redop), nil
		case opAllToAllV:
			return c.AllToAllVAsync(ctx, a.out, a.counts, a.in, a.inCounts), nil
		case opBatch:
			return c.BatchP2PAsync(ctx, a.p2p), nil
		}
		return nil, fmt.Errorf("%w: op kind %d", comm.ErrInvalidArgument, a.kind)
	}
	switch a.kind {
	case opAllReduce:
		return nil, c.AllReduce(ctx, a.out, a.redop)
	case opReduceScatter:
		return nil, c.ReduceScatter(ctx, a.out, a.in, a.redop)
	case opAllGather:
		return nil, c.AllGather(ctx, a.out, a.in)
	case opBroadcast:
		return nil, c.Broadcast(ctx, a.out, a.root)
	case opReduce:
		return nil, c.Reduce(ctx, a.out, a.redop, a.root)
	case opScatter:
		return nil, c.Scatter(ctx, a.out, a.in, a.root)
	case opGather:
		return nil, c.Gather(ctx, a.out, a.in, a.root)
	case opAllToAll:
		return nil, c.AllToAll(ctx, a.out, a.in)
	case opBarrier:
		return nil, c.Barrier(ctx)
	case opSend:
		return nil, c.Send(ctx, a.out, a.root)
	case opRecv:
		return nil, c.Recv(ctx, a.out, a.root)
	case opAllGatherV:
		return nil, c.AllGatherV(ctx, a.out, a.in, a.counts)
	case opReduceScatterV:
		return nil, c.ReduceScatterV(ctx, a.out, a.in, a.counts, a.redop)
	case opAllToAllV:
		return nil, c.AllToAllV(ctx, a.out, a.counts, a.in, a.inCounts)
	case opBatch:
		return nil, c.BatchP2P(ctx, a.p2p)
	}
	return nil, fmt.Errorf("%w: op kind %d", comm.ErrInvalidArgument, a.kind)
}

// ftcomm_comm_op runs one op on the comm. kind is FTCOMM_OP_*; out and in
// are the op's tensors (count elements of dtype each; in may be NULL for
// single-tensor ops); device is the CUDA ordinal of both, or -1 for host
// memory; redop a reduce op (1 sum, 2 product, 3 min, 4 max, 5 avg);
// root the root, or the peer of send and recv; timeout_ns the op's
// deadline (0: the comm's timeout). For CUDA tensors, stream is the
// caller's cudaStream_t: the op runs after the work queued there, and
// unless the op is async the stream waits for it and the call returns
// once it is enqueued (see nccl.StreamOrder). With FTCOMM_ASYNC in flags
// the call returns a work handle in *work at once; otherwise it returns
// when the op is done (host) or enqueued (CUDA), interruptibly.
//
//export ftcomm_comm_op
func ftcomm_comm_op(h C.uint64_t, kind C.int32_t, out unsafe.Pointer, outCount C.int64_t, in unsafe.Pointer, inCount C.int64_t,
	dtype, device, redop, root C.int32_t, stream C.uint64_t, timeoutNs C.int64_t, flags C.int32_t, work *C.uint64_t) C.int32_t {
	if diagOn { // a constant: gone from the build unless -tags ftcomm_diag
		defer diagEnd(time.Now())
	}
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		a, err := makeArgs(kind, out, outCount, in, inCount, dtype, device, redop, root, stream, timeoutNs, flags)
		if err != nil {
			return refuseArgs(o.c, int32(kind), int(root), nil, err)
		}
		return runOp(o.can, o.c, &a, work)
	})
}

// ftcomm_comm_opv runs an op with per-rank counts: FTCOMM_OP_ALL_GATHER_V
// (counts[r]: rank r's elements of out; in has counts[rank]),
// FTCOMM_OP_REDUCE_SCATTER_V (counts[r]: block r of in; out has
// counts[rank]) or FTCOMM_OP_ALL_TO_ALL_V (counts: the blocks of out, by
// source rank; in_counts: the blocks of in, by destination rank). Each
// counts array has one entry per rank (n and n_in). The other arguments
// are ftcomm_comm_op's.
//
//export ftcomm_comm_opv
func ftcomm_comm_opv(h C.uint64_t, kind C.int32_t, out unsafe.Pointer, outCount C.int64_t, in unsafe.Pointer, inCount C.int64_t,
	dtype, device, redop C.int32_t, counts *C.int64_t, n C.int64_t, inCounts *C.int64_t, nIn C.int64_t,
	stream C.uint64_t, timeoutNs C.int64_t, flags C.int32_t, work *C.uint64_t) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		switch kind {
		case opAllGatherV, opReduceScatterV, opAllToAllV:
		default:
			return refuseArgs(o.c, int32(kind), 0, nil,
				fmt.Errorf("%w: ftcomm_comm_opv: op kind %d has no counts", comm.ErrInvalidArgument, kind))
		}
		a, err := makeArgs(kind, out, outCount, in, inCount, dtype, device, redop, 0, stream, timeoutNs, flags)
		if err != nil {
			return refuseArgs(o.c, int32(kind), 0, nil, err)
		}
		if a.counts, err = ints(counts, n, "counts"); err != nil {
			return refuseArgs(o.c, int32(kind), 0, nil, err)
		}
		if kind == opAllToAllV {
			if a.inCounts, err = ints(inCounts, nIn, "in_counts"); err != nil {
				return refuseArgs(o.c, int32(kind), 0, nil, err)
			}
		}
		return runOp(o.can, o.c, &a, work)
	})
}

// ints copies n int64s from the caller's array.
func ints(p *C.int64_t, n C.int64_t, what string) ([]int, error) {
	if n < 0 || n > 1<<24 || (n > 0 && p == nil) {
		return nil, fmt.Errorf("%w: %s: %d entries at %p", comm.ErrInvalidArgument, what, n, p)
	}
	out := make([]int, int(n))
	for i, v := range unsafe.Slice((*int64)(unsafe.Pointer(p)), int(n)) {
		out[i] = int(v)
	}
	return out, nil
}

// ftcomm_comm_batch runs n sends and receives concurrently (torchcomms'
// batched point-to-point): entry i is kinds[i] (FTCOMM_P2P_SEND or
// FTCOMM_P2P_RECV) of counts[i] elements of dtypes[i] at ptrs[i] with
// peers[i]. device, stream, timeout_ns, flags and work are
// ftcomm_comm_op's; the op completes when every entry has.
//
//export ftcomm_comm_batch
func ftcomm_comm_batch(h C.uint64_t, n C.int64_t, kinds *C.int32_t, ptrs *unsafe.Pointer, counts *C.int64_t, dtypes, peers *C.int32_t,
	device C.int32_t, stream C.uint64_t, timeoutNs C.int64_t, flags C.int32_t, work *C.uint64_t) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		if n <= 0 || n > 1<<20 || kinds == nil || ptrs == nil || counts == nil || dtypes == nil || peers == nil {
			// Whom it concerns cannot be read: a refusal that names no peer.
			return refuseArgs(o.c, opBatch, 0, []comm.P2POp{{Kind: comm.P2PSend, Peer: -1}},
				fmt.Errorf("%w: ftcomm_comm_batch: %d entries", comm.ErrInvalidArgument, n))
		}
		a := opArgs{kind: opBatch, stream: uintptr(stream), device: device >= 0, timeout: time.Duration(timeoutNs),
			async: flags&flagAsync != 0, p2p: make([]comm.P2POp, int(n))}
		ks, ps := unsafe.Slice((*int32)(unsafe.Pointer(kinds)), int(n)), unsafe.Slice(ptrs, int(n))
		cs, ds := unsafe.Slice((*int64)(unsafe.Pointer(counts)), int(n)), unsafe.Slice((*int32)(unsafe.Pointer(dtypes)), int(n))
		peer := unsafe.Slice((*int32)(unsafe.Pointer(peers)), int(n))
		var bad error
		for i := range a.p2p {
			a.p2p[i].Peer = int(peer[i])
			switch ks[i] {
			case p2pSend:
				a.p2p[i].Kind = comm.P2PSend
			case p2pRecv:
				a.p2p[i].Kind = comm.P2PRecv
			default:
				if bad == nil {
					bad = fmt.Errorf("%w: ftcomm_comm_batch: entry %d: kind %d", comm.ErrInvalidArgument, i, ks[i])
				}
				continue
			}
			t, err := tensor(ps[i], cs[i], ds[i], int32(device))
			if err != nil && bad == nil {
				bad = fmt.Errorf("ftcomm_comm_batch: entry %d: %w", i, err)
			}
			a.p2p[i].Tensor = t
		}
		if bad != nil {
			return refuseArgs(o.c, opBatch, 0, a.p2p, bad)
		}
		return runOp(o.can, o.c, &a, work)
	})
}

// ftcomm_comm_run is ftcomm_comm_op's fast path for the common case: a
// sync op on one host tensor (all-reduce, broadcast, reduce, send, recv,
// barrier) under the comm's timeout, with its small arguments packed in
// desc: bits 0–7 the op kind, 8–15 the dtype, 16–23 the reduce op, 24–55
// the root or peer. Four arguments cross the ABI instead of fourteen,
// which is most of a Python call's cost.
//
//export ftcomm_comm_run
func ftcomm_comm_run(h C.uint64_t, desc C.uint64_t, ptr unsafe.Pointer, count C.int64_t) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		d := uint64(desc)
		a := opArgs{kind: int32(d & 0xff), redop: comm.ReduceOp(d >> 16 & 0xff), root: int(int32(uint32(d >> 24)))}
		switch a.kind {
		case opAllReduce, opBroadcast, opReduce, opSend, opRecv:
			if a.out, err = tensor(ptr, int64(count), int32(d>>8&0xff), -1); err != nil {
				return refuseArgs(o.c, a.kind, a.root, nil, err)
			}
		case opBarrier:
		default:
			return refuseArgs(o.c, a.kind, a.root, nil,
				fmt.Errorf("%w: ftcomm_comm_run: op kind %d takes two tensors", comm.ErrInvalidArgument, a.kind))
		}
		ctx := o.can.enter()
		_, err = a.issue(ctx, o.c)
		o.can.leave()
		return interrupted(ctx, err)
	})
}

// runOp issues a on c: sync under the canceler's ctx, or async as a work
// handle stored in *work.
func runOp(can *canceler, c *comm.Comm, a *opArgs, work *C.uint64_t) error {
	if a.async {
		if work == nil {
			return refuseArgs(c, a.kind, a.root, a.p2p, fmt.Errorf("%w: async op without a work pointer", comm.ErrInvalidArgument))
		}
		wk := newWork(can, a)
		w, err := a.issue(wk.ctx, c)
		if err != nil {
			wk.release()
			return err
		}
		wk.w = w
		*work = C.uint64_t(abi.put(wk))
		return nil
	}
	ctx := can.enter()
	defer can.leave()
	if a.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, a.timeout)
		defer cancel()
	}
	if a.device {
		ctx = nccl.WithStreamOrder(ctx, nccl.StreamOrder{Stream: a.stream})
	}
	_, err := a.issue(ctx, c)
	return interrupted(ctx, err)
}

// opTypes maps the ABI's op kinds to comm's.
var opTypes = map[int32]comm.OpType{
	opAllReduce: comm.OpAllReduce, opReduceScatter: comm.OpReduceScatter, opAllGather: comm.OpAllGather,
	opBroadcast: comm.OpBroadcast, opReduce: comm.OpReduce, opScatter: comm.OpScatter, opGather: comm.OpGather,
	opAllToAll: comm.OpAllToAll, opBarrier: comm.OpBarrier, opSend: comm.OpSend, opRecv: comm.OpRecv,
	opAllGatherV: comm.OpAllGatherV, opReduceScatterV: comm.OpReduceScatterV, opAllToAllV: comm.OpAllToAllV,
	opBatch: comm.OpBatchP2P,
}

// refuseArgs fails an op whose arguments the ABI itself refused (err, an
// invalid argument), as comm.Comm fails one it validates: through
// Comm.Refuse, which takes the op's place in the order and tells the
// peers (see comm.Refuser), so that their matching op fails at once
// instead of at its deadline. root is the root, or the peer of a send or
// receive; p2p a batch's entries. An op kind the ABI does not know
// concerns no peer.
func refuseArgs(c *comm.Comm, kind int32, root int, p2p []comm.P2POp, err error) error {
	k, ok := opTypes[kind]
	if !ok || !errors.Is(err, comm.ErrInvalidArgument) {
		return err
	}
	return c.Refuse(context.Background(), comm.Op{Kind: k, Root: root, Peer: root, P2P: p2p}, err)
}

// ftcomm_comm_refuse refuses an op that the caller will not issue because
// its own checks found an argument invalid (the Python package's, say):
// the op takes its place in the comm's order, and the peers' matching op
// fails at once with FTCOMM_ERR_PEER_REFUSED naming this rank and
// reason, instead of waiting for its deadline (on gloo; nccl cannot tell
// its peers). kind is FTCOMM_OP_*, or 100 for a batch; root is the root
// of a rooted collective or the peer of a send or receive; a batch's n
// entries are kinds (FTCOMM_P2P_*) and peers (either may be NULL when n is
// 0). It returns FTCOMM_OK once the refusal is queued (the caller raises
// its own error): it never waits for the ops ahead of it.
//
//export ftcomm_comm_refuse
func ftcomm_comm_refuse(h C.uint64_t, kind, root C.int32_t, n C.int64_t, kinds, peers *C.int32_t, reason *C.char) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		k, ok := opTypes[int32(kind)]
		if !ok {
			return fmt.Errorf("%w: ftcomm_comm_refuse: op kind %d", comm.ErrInvalidArgument, kind)
		}
		if n < 0 || n > 1<<20 || (n > 0 && (kinds == nil || peers == nil)) {
			return fmt.Errorf("%w: ftcomm_comm_refuse: %d entries", comm.ErrInvalidArgument, n)
		}
		var p2p []comm.P2POp
		if n > 0 {
			ks := unsafe.Slice((*int32)(unsafe.Pointer(kinds)), int(n))
			ps := unsafe.Slice((*int32)(unsafe.Pointer(peers)), int(n))
			p2p = make([]comm.P2POp, int(n))
			for i := range p2p {
				p2p[i].Peer = int(ps[i])
				switch ks[i] {
				case p2pSend:
					p2p[i].Kind = comm.P2PSend
				case p2pRecv:
					p2p[i].Kind = comm.P2PRecv
				}
			}
		}
		o.c.Refuse(context.Background(), comm.Op{Kind: k, Root: int(root), Peer: int(root), P2P: p2p},
			errors.New(defaultStr(goString(reason), "refused by the caller")))
		return nil
	})
}

// ftcomm_comm_loop runs a sync all-reduce of count elements of dtype at
// ptr (host memory) iters times in a loop in Go, and stores the time it
// took in *elapsed_ns: what the op costs through the Go API, next to the
// same op called from the caller's language (bench/python_overhead.py).
//
//export ftcomm_comm_loop
func ftcomm_comm_loop(h C.uint64_t, ptr unsafe.Pointer, count C.int64_t, dtype, redop C.int32_t, iters C.int64_t, elapsed *C.int64_t) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		t, err := tensor(ptr, int64(count), int32(dtype), -1)
		if err != nil {
			return err
		}
		ctx := o.can.enter()
		defer o.can.leave()
		op := comm.ReduceOp(redop)
		t0 := time.Now()
		for range int64(iters) {
			if err := o.c.AllReduce(ctx, t, op); err != nil {
				return err
			}
		}
		*elapsed = C.int64_t(time.Since(t0))
		return nil
	})
}

// ftcomm_comm_revoke revokes the comm (here and, as it propagates, at
// every rank): pending and later ops fail with ErrRevoked; shrink and
// free still work.
//
//export ftcomm_comm_revoke
func ftcomm_comm_revoke(h C.uint64_t, reason *C.char) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		o.callerStopped.Store(true)
		o.c.Revoke(fmt.Errorf("%s", defaultStr(goString(reason), "revoked by the caller")))
		return nil
	})
}

// ftcomm_comm_abort aborts the comm: the running op fails at once and
// the comm refuses collectives until shrunk, grown or freed.
//
//export ftcomm_comm_abort
func ftcomm_comm_abort(h C.uint64_t, reason *C.char) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		o.callerStopped.Store(true)
		o.c.Abort(fmt.Errorf("%s", defaultStr(goString(reason), "aborted by the caller")))
		return nil
	})
}

func defaultStr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// reconfigure runs f (a Shrink, Grow or Split) under an interruptible ctx
// with the given timeout and stores the new comm's handle in *out (0 when
// f returns none: a Split with no color).
func reconfigure(h C.uint64_t, timeoutNs C.int64_t, out *C.uint64_t, f func(ctx context.Context, c *comm.Comm) (*comm.Comm, error)) C.int32_t {
	return guard(func() error {
		o, err := lookup[*commObj](uint64(h))
		if err != nil {
			return err
		}
		if o.borrowed {
			// ft shrinks, grows and closes its group comm itself; a
			// reconfiguration here would consume it under ft.
			return fmt.Errorf("%w: comm %s is ft's group comm (ftcomm_ft_group_comm): ft reconfigures it at each epoch; it cannot be shrunk, grown or split here",
				comm.ErrInvalidArgument, o.c.Name())
		}
		ctx := o.can.enter()
		defer o.can.leave()
		if timeoutNs > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, time.Duration(timeoutNs))
			defer cancel()
		}
		nc, err := f(ctx, o.c)
		if err != nil {
			return interrupted(ctx, err)
		}
		*out = 0
		if nc != nil {
			no := &commObj{c: nc, can: newCanceler(), backend: o.backend, device: o.device, log: o.log, abortProcess: o.abortProcess}
			no.watchFatal()
			*out = C.uint64_t(abi.put(no))
		}
		return nil
	})
}

// ftcomm_comm_shrink: the survivors (every rank not in exclude[0:n],
// which is sorted) form a comm at epoch (< 0: this comm's epoch + 1),
// renumbered in old-rank order; this comm is closed. The handle of the
// new comm is stored in *out; the old handle must still be freed.
//
//export ftcomm_comm_shrink
func ftcomm_comm_shrink(h C.uint64_t, exclude *C.int64_t, n C.int64_t, epoch C.int64_t, timeoutNs C.int64_t, out *C.uint64_t) C.int32_t {
	return reconfigure(h, timeoutNs, out, func(ctx context.Context, c *comm.Comm) (*comm.Comm, error) {
		if n < 0 || (n > 0 && exclude == nil) {
			return nil, fmt.Errorf("%w: exclude list", comm.ErrInvalidArgument)
		}
		ex := make([]int, int(n))
		for i, r := range unsafe.Slice((*int64)(unsafe.Pointer(exclude)), int(n)) {
			ex[i] = int(r)
		}
		return c.Shrink(ctx, ex, nextEpoch(c, epoch))
	})
}

// ftcomm_comm_grow: this comm's ranks and size - (this size) joiners form
// a comm of size ranks at epoch (< 0: this epoch + 1); joiners call
// ftcomm_comm_new with rank ≥ the old size, the new size, the same prefix
// and that epoch. This comm is closed; *out gets the new one.
//
//export ftcomm_comm_grow
func ftcomm_comm_grow(h C.uint64_t, size C.int64_t, epoch C.int64_t, timeoutNs C.int64_t, out *C.uint64_t) C.int32_t {
	return reconfigure(h, timeoutNs, out, func(ctx context.Context, c *comm.Comm) (*comm.Comm, error) {
		return c.Grow(ctx, int(size), nextEpoch(c, epoch))
	})
}

// ftcomm_comm_split: ranks passing the same color form a comm ordered by
// (key, rank); color -1 takes part and gets none (*out = 0). This comm
// stays as it was.
//
//export ftcomm_comm_split
func ftcomm_comm_split(h C.uint64_t, color, key C.int64_t, timeoutNs C.int64_t, out *C.uint64_t) C.int32_t {
	return reconfigure(h, timeoutNs, out, func(ctx context.Context, c *comm.Comm) (*comm.Comm, error) {
		return c.Split(ctx, int(color), int(key))
	})
}

func nextEpoch(c *comm.Comm, e C.int64_t) uint64 {
	if e < 0 {
		return c.Epoch() + 1
	}
	return uint64(e)
}
