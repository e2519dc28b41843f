package nccl

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

func init() {
	comm.Register("nccl", func(ctx context.Context, o comm.Options) (comm.Backend, error) {
		return New(ctx, o)
	})
}

var (
	_ comm.Enqueuer      = (*Backend)(nil)
	_ comm.HostCopier    = (*Backend)(nil)
	_ comm.HealthWatcher = (*Backend)(nil)
	_ comm.Backend       = (*Backend)(nil)
	_ comm.Revoker       = (*Backend)(nil)
	_ comm.Shrinker      = (*Backend)(nil)
	_ comm.Grower        = (*Backend)(nil)
	_ comm.Splitter      = (*Backend)(nil)
)

// scratchBytes is the device scratch each comm keeps for Barrier and the
// warm-up.
const scratchBytes = 256

// Backend is one rank of an NCCL communicator. See the package doc for the
// lifecycle and the concurrency rules.
type Backend struct {
	L     *Library
	lib   libapi.Library
	cfg   Config
	log   *zap.Logger
	opts  comm.Options // as given, for the comms Shrink, Grow and Split make
	store comm.Store   // opts.Store under opts.Prefix; nil for a lone rank without one
	rank  int
	size  int
	dev   int
	epoch uint64

	stream  libapi.Stream // every op of this comm runs on it
	scratch uintptr       // scratchBytes of device memory

	// hmu serialises every use of the NCCL handles (enqueues, Shrink,
	// Grow, Split, the watchdog's reads) with their abort.
	hmu sync.Mutex
	// ctl is the comm that init, Shrink, Grow, Split, the native revoke
	// and (in ModeBlockingData) the point-to-point ops use; data is where
	// collectives are enqueued: a blocking comm split from ctl in
	// ModeBlockingData with two or more ranks (see separateData), ctl
	// itself otherwise. 0 once aborted.
	ctl, data libapi.Comm
	// ctlDone is closed once ctl is there or will not be: at once, except
	// for a comm a shrink made with its data comm first, whose control
	// comm is made in the background (dataChild, makeControl); ctlErr and
	// ctlTook (written before it closes) say how that went.
	ctlDone      chan struct{}
	ctlErr       error
	ctlTook      time.Duration
	ctlBlocking  bool // ctl was made with blocking = 1 (ModeBlocking)
	dataBlocking bool // data was made with blocking = 1
	quiescent    bool // a native revoke completed: Shrink needs no NCCL_SHRINK_ABORT
	// local: a comm of one rank that a shrink made without NCCL (Shrink):
	// ctl and data stay 0, and each op is the device copy NCCL would make
	// of it (launchLocal).
	local  bool
	splits int // Split calls so far (they are collective, so every rank counts alike)
	// revokeNative: Revoke runs the native revoke (Config.Revoke resolved
	// against the library's Recovery).
	revokeNative bool
	// abortQ hands the watchdog NCCL comms to abort, at most two in all: a
	// data comm (Shrink after a failure takes it out of service at once,
	// then shrinks ctl while the watchdog aborts it), then the shrunk ctl,
	// or both comms at once (a shrink to a local one-rank comm, a fresh
	// one after a failure or a refusal; see retire).
	abortQ chan libapi.Comm

	fmu     sync.Mutex
	failErr error     // the first failure; the comm refuses ops from then on
	failAt  time.Time // when it happened
	failed  atomic.Bool
	wake    chan struct{} // closed at the first failure
	// dirty: an op was abandoned, so GPU work may still be running on
	// stream (a kernel waiting for a dead peer, say).
	dirty    atomic.Bool
	opActive atomic.Bool
	// evMu guards the pool of completion events of started ops.
	evMu     sync.Mutex
	events   []libapi.Event
	evClosed bool

	// opMu is held while an op uses the stream (launch and wait), so the
	// release never destroys the stream under a waiting op.
	opMu sync.Mutex

	// ordered are the ops that returned once enqueued (StreamOrder), in
	// order, for the watchdog to follow; nOrdered is their number.
	ordMu    sync.Mutex
	ordered  []orderedOp
	nOrdered atomic.Int64

	revokeReq chan struct{} // to the watchdog: run the native revoke
	started   bool          // the watchdog runs (start was called)
	closeOnce sync.Once
	settling  atomic.Bool   // Close is waiting for the ordered ops (settleOrdered)
	closing   chan struct{} // closed by Close: the watchdog releases and exits
	released  chan struct{} // closed when the watchdog has released everything
	relErr    error         // what the release ran into; read after released

	group []libapi.CollArgs // reused by grouped ops (ops never overlap, by contract)

	stats opStats
	made  Creation // written before the Backend is returned, read-only after
}

// Creation says how a comm was made and what each phase of it cost, for
// the fault path's breakdown (docs/measurements.md). The phases run one
// after the other; Total is from the start of New, Shrink, Grow or Split
// until the comm was returned.
type Creation struct {
	How string // "ncclCommInitRankConfig", "ncclCommShrink", "ncclCommShrink(NCCL_SHRINK_ABORT)", "fresh init", "ncclCommGrow", "ncclCommSplit"
	// Agree: the vote between NCCL's native grow and a fresh init (Store
	// round trips); for a shrink, the time until a survivor's refusal
	// sent this rank to a fresh init (0 for New, Split and a shrink
	// without a refusal).
	Agree time.Duration
	// Call: the NCCL call that makes the control comm, until it returns;
	// for an init, from the start of the unique id's rendezvous through
	// the Store. With NCCL_SHRINK_ABORT it includes the wait for the old
	// kernels.
	Call time.Duration
	// Ready: from that call's return until the control comm is ready
	// (NCCL's initialisation: bootstrap, topology, graphs, connections);
	// for a Split, the call and the wait together (Call is 0).
	Ready time.Duration
	// DataSplit: the data comm's ncclCommSplit until it is ready (0 for a
	// comm without one).
	DataSplit time.Duration
	// WarmUp: the first collective (a one-element all-reduce).
	WarmUp time.Duration
	Total  time.Duration
}

// Creation reports how this comm was made.
func (b *Backend) Creation() Creation { return b.made }

func (b *Backend) logCreation(msg string, fields ...zap.Field) {
	m := b.made
	b.log.Info(msg, append(fields, zap.String("how", m.How), zap.Duration("agree", m.Agree), zap.Duration("call", m.Call),
		zap.Duration("ready", m.Ready), zap.Duration("data_split", m.DataSplit), zap.Duration("warm_up", m.WarmUp),
		zap.Duration("total", m.Total))...)
}

var _ comm.Backend = (*Backend)(nil)

// opStats are counters of the op path, read by Stats.
type opStats struct {
	ops, inProgress, settlePolls, waitPolls atomic.Int64
	enqueueNs, settleNs, waitNs             atomic.Int64
}

// Stats are cumulative counters of a comm's op path, to see where an op's
// time goes: the NCCL enqueue call, the polling of ncclCommGetAsyncError
// that a nonblocking comm needs after it, and the wait for the stream.
type Stats struct {
	Ops         int64         // NCCL calls or groups issued
	InProgress  int64         // of them, returned ncclInProgress or left the comm in progress
	SettlePolls int64         // ncclCommGetAsyncError calls after enqueues
	WaitPolls   int64         // cudaStreamQuery calls while waiting
	Enqueue     time.Duration // total time in the enqueue calls
	Settle      time.Duration // total time polling the async state after them
	Wait        time.Duration // total time waiting for streams
}

// Stats returns the comm's op-path counters.
func (b *Backend) Stats() Stats {
	s := &b.stats
	return Stats{Ops: s.ops.Load(), InProgress: s.inProgress.Load(), SettlePolls: s.settlePolls.Load(),
		WaitPolls: s.waitPolls.Load(), Enqueue: time.Duration(s.enqueueNs.Load()),
		Settle: time.Duration(s.settleNs.Load()), Wait: time.Duration(s.waitNs.Load())}
}

// Name implements comm.Backend.
func (b *Backend) Name() string { return "nccl" }

// Rank implements comm.Backend.
func (b *Backend) Rank() int { return b.rank }

// Size implements comm.Backend.
func (b *Backend) Size() int { return b.size }

// Epoch implements comm.Backend.
func (b *Backend) Epoch() uint64 { return b.epoch }

// Memory implements comm.Backend: device memory only.
func (b *Backend) Memory() comm.Memory { return comm.DeviceMemory }

// Device is the CUDA ordinal this rank runs on.
func (b *Backend) Device() int { return b.dev }

// Library is the loaded NCCL this comm uses.
func (b *Backend) Library() *Library { return b.L }

// Released is closed once a closed Backend has aborted its NCCL comm and
// freed its stream and scratch memory (ncclCommAbort took 0.5 s after a
// peer's death on 2×H200, so Close does not wait for it).
func (b *Backend) Released() <-chan struct{} { return b.released }

// ReleaseErr is what the release ran into, once Released is closed.
func (b *Backend) ReleaseErr() error {
	select {
	case <-b.released:
		return b.relErr
	default:
		return nil
	}
}

// configFrom reads Options.BackendConfig.
func configFrom(v any) (Config, error) {
	var cfg Config
	switch c := v.(type) {
	case nil:
		cfg = DefaultConfig()
	case *Config:
		if c == nil {
			cfg = DefaultConfig()
		} else {
			cfg = *c
		}
	case Config:
		cfg = c
	default:
		return cfg, fmt.Errorf("nccl: %w: Options.BackendConfig is %T, want *nccl.Config", comm.ErrInvalidArgument, v)
	}
	if err := cfg.Validate(); err != nil {
		return cfg, err
	}
	return cfg.withDefaults(), nil
}

// New creates this rank's communicator: it rendezvouses through o.Store
// (rank 0 publishes a fresh NCCL unique id under o.Prefix for o.Epoch),
// initialises a nonblocking NCCL comm on GPU o.Device and warms it up. It
// is what comm.New("nccl", …) calls. A joiner of a Grow calls it too, with
// its new rank, the new size and the Grow's epoch.
func New(ctx context.Context, o comm.Options) (*Backend, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	cfg, err := configFrom(o.BackendConfig)
	if err != nil {
		return nil, err
	}
	if o.Name == "" {
		o.Name = "comm"
	}
	if o.Prefix == "" {
		o.Prefix = "comm/" + o.Name
	}
	L := cfg.Library
	if L == nil {
		lc := cfg.LibraryConfig
		if lc.Logger == nil {
			lc.Logger = o.Logger
		}
		if L, err = Open(lc); err != nil {
			return nil, err
		}
		cfg.Library = L
	}
	n, err := L.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("nccl: %w: %w", comm.ErrBackendUnavailable, err)
	}
	if o.Device >= n {
		return nil, fmt.Errorf("nccl: %w: device %d, but %d CUDA devices are visible", comm.ErrInvalidArgument, o.Device, n)
	}
	if err := checkEnv(cfg.Mode); err != nil {
		return nil, err
	}
	b, err := newBackend(L, cfg, o, o.Rank, o.Size, o.Epoch)
	if err != nil {
		return nil, err
	}
	if cfg.Mode == ModeBlockingData && !L.info.EagerConnect {
		b.log.Warn("NCCL connects lazily (" + envRuntimeConnect + " is not 0): the first use of an algorithm on the " +
			"blocking data comm can wait for peers inside NCCL, past an op's deadline")
	}
	t0 := time.Now()
	h, err := b.rendezvous(ctx, o.Rank, o.Size, o.Epoch)
	if err == nil {
		err = b.start(ctx, h)
	}
	if err != nil {
		b.discard()
		return nil, fmt.Errorf("nccl: init rank %d/%d on device %d, epoch %d: %w", o.Rank, o.Size, o.Device, o.Epoch, err)
	}
	b.made.Total = time.Since(t0)
	return b, nil
}

// envCommBlocking is NCCL's override of ncclConfig_t.blocking for every
// comm of the process.
const envCommBlocking = "NCCL_COMM_BLOCKING"

// checkEnv refuses an NCCL_COMM_BLOCKING that would override mode's
// blocking settings: a data comm turned nonblocking behind the backend's
// back would be used without the polling NCCL requires, and a control
// comm turned blocking could not be abandoned.
func checkEnv(mode Mode) error {
	v := os.Getenv(envCommBlocking)
	if v != "0" && v != "1" {
		return nil
	}
	if (mode == ModeNonblocking && v == "0") || (mode == ModeBlocking && v == "1") {
		return nil
	}
	return fmt.Errorf("nccl: %w: %s=%s overrides the blocking mode of every NCCL comm, which mode %s sets itself; unset it",
		comm.ErrInvalidArgument, envCommBlocking, v, mode)
}

// newBackend allocates what a comm needs besides its NCCL handle.
func newBackend(L *Library, cfg Config, o comm.Options, rank, size int, epoch uint64) (*Backend, error) {
	log := o.Logger
	if log == nil {
		log = zap.NewNop()
	}
	b := &Backend{
		L: L, lib: L.lib, cfg: cfg, opts: o, rank: rank, size: size, dev: o.Device, epoch: epoch,
		wake: make(chan struct{}), revokeReq: make(chan struct{}, 1), abortQ: make(chan libapi.Comm, 2),
		closing: make(chan struct{}), released: make(chan struct{}), ctlDone: make(chan struct{}),
		ctlBlocking: cfg.Mode == ModeBlocking, dataBlocking: cfg.Mode == ModeBlocking || separateData(cfg.Mode, size),
		revokeNative: cfg.Revoke.nativeRevoke(L.info.Recovery),
	}
	close(b.ctlDone)
	b.log = log.With(zap.String("backend", "nccl"), zap.String("comm", o.Name), zap.Int("rank", rank),
		zap.Int("size", size), zap.Uint64("epoch", epoch), zap.Int("device", o.Device))
	if o.Store != nil {
		b.store = comm.WithPrefix(o.Store, o.Prefix)
	}
	var err error
	if b.stream, err = b.lib.StreamCreate(b.dev); err != nil {
		return nil, fmt.Errorf("nccl: %w: %w", comm.ErrBackendUnavailable, err)
	}
	if b.scratch, err = b.lib.Malloc(b.dev, scratchBytes); err != nil {
		_ = b.lib.StreamDestroy(b.dev, b.stream)
		return nil, fmt.Errorf("nccl: %w: %w", comm.ErrBackendUnavailable, err)
	}
	return b, nil
}

// start adopts the NCCL comm h as the control comm, starts the watchdog,
// splits the data comm off it (see separateData) and warms the comm up.
func (b *Backend) start(ctx context.Context, h libapi.Comm) error {
	b.ctl, b.data = h, h
	b.started = true
	go b.watchdog()
	t0 := time.Now()
	if separateData(b.cfg.Mode, b.size) {
		if err := b.splitData(ctx); err != nil {
			return err
		}
	}
	t1 := time.Now()
	if !b.cfg.NoWarmUp {
		if err := b.allReduceScratch(ctx); err != nil {
			return fmt.Errorf("warm-up: %w", err)
		}
	}
	b.made.DataSplit, b.made.WarmUp = t1.Sub(t0), time.Since(t1)
	b.log.Debug("comm ready", zap.Stringer("mode", b.cfg.Mode), zap.Bool("native_revoke", b.revokeNative),
		zap.Stringer("recovery", b.L.info.Recovery), zap.Duration("data_split", t1.Sub(t0)),
		zap.Duration("warm_up", time.Since(t1)))
	return nil
}

// separateData says whether a comm of size ranks in mode has a blocking
// data comm of its own. ModeBlockingData makes one only with two or more
// ranks: a one-rank collective is a local copy that NCCL runs without its
// group launch, so on the nonblocking control comm it costs what it costs
// on a blocking one (3.7–6.1 µs either way, TestGPULaunchCost), while the
// split costs 80 ms more per comm made (TestGPUOneRank, H100). This is
// the comm a survivor of a two-replica job shrinks to.
func separateData(mode Mode, size int) bool { return mode == ModeBlockingData && size > 1 }

// splitData makes the data comm: ncclCommSplit of the (nonblocking)
// control comm, every rank in one color in its own order, with a config of
// its own that says blocking = 1. The split runs as the control comm's
// job, so it is polled and, should it not finish, abandoned with the
// control comm (whose abort also stops the child's initialisation).
func (b *Backend) splitData(ctx context.Context) error {
	b.hmu.Lock()
	defer b.hmu.Unlock()
	cell := b.lib.NewCell()
	r := b.lib.CommSplit(b.ctl, 0, b.rank, cell, libapi.ChildConfig{Blocking: true})
	nh, err := b.awaitChild(ctx, b.ctl, cell, "ncclCommSplit (data comm)", r)
	if err == nil && nh == 0 {
		err = fmt.Errorf("nccl: %w: ncclCommSplit (data comm) finished without a new comm", comm.ErrAborted)
	}
	if err != nil {
		return fmt.Errorf("data comm: %w", err)
	}
	b.data = nh
	return nil
}

// discard releases a Backend that never became usable.
func (b *Backend) discard() {
	if b.started {
		b.Close()
		<-b.released
		return
	}
	_ = b.lib.Free(b.dev, b.scratch)
	_ = b.lib.StreamDestroy(b.dev, b.stream)
	close(b.released)
}
