package nccl

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
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
	ctl, data    libapi.Comm
	ctlBlocking  bool // ctl was made with blocking = 1 (ModeBlocking)
	dataBlocking bool // data was made with blocking = 1
	quiescent    bool // a native revoke completed: Shrink needs no NCCL_SHRINK_ABORT
	splits       int  // Split calls so far (they are collective, so every rank counts alike)
	// revokeNative: Revoke runs the native revoke (Config.Revoke resolved
	// against the library's Recovery).
	revokeNative bool
	// abortQ hands the watchdog a data comm to abort (Shrink after a
	// failure takes it out of service at once, then shrinks ctl while
	// the watchdog aborts it).
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
	// Agree: the vote between NCCL's native shrink or grow and a fresh
	// init (Store round trips; 0 for New and Split).
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
		wake: make(chan struct{}), revokeReq: make(chan struct{}, 1), abortQ: make(chan libapi.Comm, 1),
		closing: make(chan struct{}), released: make(chan struct{}),
		ctlBlocking: cfg.Mode == ModeBlocking, dataBlocking: cfg.Mode == ModeBlocking || separateData(cfg.Mode, size),
		revokeNative: cfg.Revoke.nativeRevoke(L.info.Recovery),
	}
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
	r := b.lib.CommSplit(b.ctl, 0, b.rank, cell, libapi.SplitConfig{Blocking: true})
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

// ---- failure ----

// fail records the comm's first failure and wakes the running op. It
// reports whether err was the first.
func (b *Backend) fail(err error) bool {
	b.fmu.Lock()
	defer b.fmu.Unlock()
	if b.failErr != nil {
		return false
	}
	b.failErr, b.failAt = err, time.Now()
	b.failed.Store(true)
	close(b.wake)
	if b.opActive.Load() || b.nOrdered.Load() > 0 {
		b.dirty.Store(true)
	}
	return true
}

// failure is the error ops fail with once the comm has failed.
func (b *Backend) failure() error {
	b.fmu.Lock()
	defer b.fmu.Unlock()
	return b.failErr
}

// Abort implements comm.Backend: the running op fails at once; the NCCL
// comm is cancelled by the next Shrink, by Close, or by the watchdog after
// Config.AbortDelay.
func (b *Backend) Abort(cause error) {
	if cause == nil {
		cause = errors.New("abort requested")
	}
	if b.fail(fmt.Errorf("nccl: %w: %w", comm.ErrAborted, cause)) {
		b.log.Info("aborted", zap.Error(cause))
	}
}

// Revoke implements comm.Revoker: the running op and every later one fail
// with comm.ErrRevoked at once. What happens on the GPU follows
// Config.Revoke. Peers learn of the revocation from the membership layer,
// not through NCCL (ncclCommRevoke is local).
func (b *Backend) Revoke(cause error) {
	if cause == nil {
		cause = errors.New("revoke requested")
	}
	if !b.fail(fmt.Errorf("nccl: %w: %w", comm.ErrRevoked, cause)) {
		return
	}
	b.log.Info("revoked", zap.Error(cause))
	if b.revokeNative {
		select {
		case b.revokeReq <- struct{}{}:
		default:
		}
	}
}

// Close implements comm.Backend. It fails a running op; the watchdog then
// aborts the NCCL comm, waits for the stream to drain and frees it
// (Released is closed when done). Safe to call twice.
//
// On a comm that has not failed, Close first waits for the stream-ordered
// ops (StreamOrder) that returned once enqueued: the caller holds them as
// done, and the abort would cancel their kernels half-way and leave their
// outputs wrong with no op left to say so. The wait ends with the ops or
// at their deadline (ReleaseTimeout for one that has none); if they do
// not complete, Close returns the error that names them. On a comm that
// has failed, its error (returned by the next op or by Err) already says
// that its ordered ops may not have completed, and Close returns at once.
func (b *Backend) Close() error {
	var err error
	b.closeOnce.Do(func() {
		err = b.settleOrdered()
		b.fail(fmt.Errorf("nccl: %w", comm.ErrClosed))
		close(b.closing)
	})
	return err
}

// settleOrdered waits until the comm's stream-ordered ops have completed
// or the comm has failed (an op past its deadline fails it). Called by
// Close before the comm is failed.
func (b *Backend) settleOrdered() error {
	if b.nOrdered.Load() == 0 || b.failed.Load() {
		return nil
	}
	b.settling.Store(true)
	n := b.nOrdered.Load()
	ctx, cancel := context.WithTimeout(context.Background(), b.orderedBound())
	defer cancel()
	err := pollDone(ctx, b.wake, func() (bool, error) {
		b.checkOrdered() // retires completed ops, fails the comm at an op's deadline
		return b.nOrdered.Load() == 0 || b.failed.Load(), nil
	})
	switch {
	case b.nOrdered.Load() == 0:
		return nil
	case b.failed.Load():
		return fmt.Errorf("nccl: closing with %d stream-ordered ops not completed: %w", n, b.failure())
	default:
		return fmt.Errorf("nccl: %w: closing: %d stream-ordered ops still running: %w", comm.ErrTimeout, b.nOrdered.Load(), err)
	}
}

// orderedBound is how long Close may wait for the ordered ops: until the
// latest deadline among them, or ReleaseTimeout from now if one has none.
func (b *Backend) orderedBound() time.Duration {
	b.ordMu.Lock()
	defer b.ordMu.Unlock()
	var last time.Time
	for _, o := range b.ordered {
		if o.deadline.IsZero() {
			return b.cfg.ReleaseTimeout
		}
		if o.deadline.After(last) {
			last = o.deadline
		}
	}
	// A little past the last deadline, so that the watchdog's check at the
	// deadline (which names the op) decides, not this bound.
	return time.Until(last) + 2*b.cfg.WatchdogInterval + time.Millisecond
}

// ncclError turns a failed NCCL result into an error the comm layer can
// branch on, with NCCL's own last-error text.
func (b *Backend) ncclError(h libapi.Comm, what string, r libapi.Result) error {
	msg := b.lib.ErrorString(r)
	if h != 0 {
		if last := b.lib.LastError(h); last != "" {
			msg += ": " + last
		}
	}
	sentinel := comm.ErrAborted
	switch r {
	case libapi.RemoteError:
		sentinel = comm.ErrPeerFailed
	case libapi.Timeout:
		sentinel = comm.ErrTimeout
	}
	return fmt.Errorf("nccl: %w: %s: %s (%s)", sentinel, what, r, msg)
}

// ctxError is the error of an op abandoned because ctx ended.
func ctxError(ctx context.Context, what string) error {
	cause := context.Cause(ctx)
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("nccl: %w: %s: %w", comm.ErrTimeout, what, cause)
	}
	return fmt.Errorf("nccl: %w: %s: %w", comm.ErrAborted, what, cause)
}

// ---- the watchdog ----

// watchdog runs for the Backend's life: it reads NCCL's async error while
// an op runs, performs the native revoke, aborts a failed comm after
// AbortDelay, and on Close releases everything and exits.
func (b *Backend) watchdog() {
	defer close(b.released)
	tick := time.NewTicker(b.cfg.WatchdogInterval)
	defer tick.Stop()
	for {
		select {
		case <-b.closing:
			b.relErr = b.release()
			return
		case <-b.revokeReq:
			b.nativeRevoke()
		case h := <-b.abortQ:
			b.abortData(h, "the control comm is being shrunk after a failure")
		case <-tick.C:
			ordered := b.nOrdered.Load() > 0
			if (b.opActive.Load() || ordered) && !b.failed.Load() {
				b.checkAsync()
			}
			if ordered {
				b.checkOrdered()
			}
			if b.cfg.AbortDelay > 0 && b.dirty.Load() {
				b.fmu.Lock()
				due := !b.failAt.IsZero() && time.Since(b.failAt) >= b.cfg.AbortDelay
				b.fmu.Unlock()
				if due {
					b.abortComms("no Shrink or Close within AbortDelay after the failure")
				}
			}
		}
	}
}

// checkAsync fails the comm if NCCL reports an asynchronous error on
// either of its NCCL comms.
func (b *Backend) checkAsync() {
	if !b.hmu.TryLock() {
		return // an enqueue is reading it right now
	}
	var err error
	for _, h := range b.handles() {
		a, r := b.lib.CommGetAsyncError(h)
		switch {
		case r != libapi.Success:
			err = b.ncclError(h, "ncclCommGetAsyncError", r)
		case a != libapi.Success && a != libapi.InProgress:
			err = b.ncclError(h, "asynchronous error", a)
		}
		if err != nil {
			break
		}
	}
	b.hmu.Unlock()
	if err != nil && b.fail(err) {
		b.log.Warn("NCCL reported an asynchronous error", zap.Error(err))
	}
}

// handles lists the live NCCL comms, data first. Called with hmu held.
func (b *Backend) handles() []libapi.Comm {
	var hs []libapi.Comm
	if b.data != 0 {
		hs = append(hs, b.data)
	}
	if b.ctl != 0 && b.ctl != b.data {
		hs = append(hs, b.ctl)
	}
	return hs
}

// nativeRevoke runs ncclCommRevoke on the control comm and waits for it to
// quiesce (a separate data comm is aborted first: its kernels are its
// own), or aborts the comms where the library has no revoke.
func (b *Backend) nativeRevoke() {
	if !b.L.info.Features.Revoke {
		b.abortComms("revoke without ncclCommRevoke")
		return
	}
	b.hmu.Lock()
	h, d := b.ctl, b.data
	if d == h {
		d = 0
	} else {
		b.data = 0
	}
	b.hmu.Unlock()
	if d != 0 {
		b.abortData(d, "revoke")
	}
	b.hmu.Lock()
	defer b.hmu.Unlock()
	if h == 0 || b.ctl != h {
		return
	}
	t0 := time.Now()
	r := b.lib.CommRevoke(h)
	if r == libapi.Success || r == libapi.InProgress {
		ctx, cancel := context.WithTimeout(context.Background(), b.cfg.ReleaseTimeout)
		defer cancel()
		r = b.pollAsync(ctx, h, b.closing)
	}
	if r != libapi.Success {
		b.log.Warn("ncclCommRevoke failed", zap.Stringer("result", r), zap.String("nccl", b.lib.LastError(h)))
		return
	}
	b.quiescent = true
	b.dirty.Store(false)
	b.log.Info("ncclCommRevoke done", zap.Duration("took", time.Since(t0)))
}

// pollAsync waits until the comm's async state leaves ncclInProgress and
// returns it, or ncclInProgress if ctx ended or stop closed first.
func (b *Backend) pollAsync(ctx context.Context, h libapi.Comm, stop <-chan struct{}) libapi.Result {
	state := libapi.InProgress
	_ = pollDone(ctx, stop, func() (bool, error) {
		a, r := b.lib.CommGetAsyncError(h)
		if r != libapi.Success {
			state = r
			return true, nil
		}
		state = a
		return a != libapi.InProgress, nil
	})
	return state
}

// abortComms calls ncclCommAbort on every NCCL comm of the Backend. After
// it their GPU work is cancelled.
func (b *Backend) abortComms(why string) {
	b.hmu.Lock()
	hs := b.handles()
	b.ctl, b.data = 0, 0
	b.hmu.Unlock()
	for _, h := range hs {
		t0 := time.Now()
		r := b.lib.CommAbort(h)
		b.log.Info("ncclCommAbort", zap.String("why", why), zap.Stringer("result", r), zap.Duration("took", time.Since(t0)))
	}
	b.dirty.Store(false)
}

// abortData aborts a data comm already taken out of service (b.data no
// longer names it). ncclCommAbort first raises the comm's abort flag,
// which its kernels poll, so a kernel stuck on a dead peer exits at once;
// freeing the comm takes longer (≈0.5 s after a peer's death on 2×H200).
func (b *Backend) abortData(h libapi.Comm, why string) {
	t0 := time.Now()
	r := b.lib.CommAbort(h)
	b.log.Info("ncclCommAbort (data comm)", zap.String("why", why), zap.Stringer("result", r), zap.Duration("took", time.Since(t0)))
	b.hmu.Lock()
	shrunk := b.ctl == 0 || b.quiescent
	b.hmu.Unlock()
	if shrunk {
		b.dirty.Store(false)
	}
}

// release aborts the comm, waits for the stream to drain and frees the
// stream and scratch memory.
func (b *Backend) release() error {
	// Close failed the comm, so a running op returns promptly; wait for it
	// to let go of the stream.
	b.opMu.Lock()
	defer b.opMu.Unlock()
	b.hmu.Lock()
	hs := b.handles()
	b.ctl, b.data = 0, 0
	b.hmu.Unlock()
	select {
	case h := <-b.abortQ: // handed over by Shrink, not yet aborted
		hs = append([]libapi.Comm{h}, hs...)
	default:
	}
	// ncclCommAbort rather than finalize+destroy: it is local and cannot
	// wait on a peer that is gone. The control and data comms share no
	// resources, so they are aborted at once (each took 0.5 s on an H100
	// even with one rank).
	errs := make([]error, len(hs), len(hs)+4)
	var wg sync.WaitGroup
	for i, h := range hs {
		wg.Go(func() {
			t0 := time.Now()
			if r := b.lib.CommAbort(h); r != libapi.Success {
				errs[i] = fmt.Errorf("nccl: ncclCommAbort: %s", r)
			}
			b.log.Debug("released NCCL comm", zap.Duration("abort", time.Since(t0)))
		})
	}
	wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.ReleaseTimeout)
	defer cancel()
	if err := pollDone(ctx, nil, func() (bool, error) { return b.lib.StreamQuery(b.dev, b.stream) }); err != nil {
		b.log.Error("stream did not drain after abort; leaking it and the scratch memory", zap.Error(err))
		return errors.Join(append(errs, fmt.Errorf("nccl: stream did not drain: %w", err))...)
	}
	b.dropOrdered()
	b.evMu.Lock()
	for _, ev := range b.events {
		errs = append(errs, b.lib.EventDestroy(b.dev, ev))
	}
	b.events, b.evClosed = nil, true
	b.evMu.Unlock()
	errs = append(errs, b.lib.Free(b.dev, b.scratch), b.lib.StreamDestroy(b.dev, b.stream))
	return errors.Join(errs...)
}

// ---- issuing ops ----

// usable returns why no op may run, or nil.
func (b *Backend) usable() error {
	if b.failed.Load() {
		return b.failure()
	}
	return nil
}

// launch issues one NCCL call (a) or a group (ops) on the comm's stream
// and waits until NCCL has accepted it. Collectives go to the data comm;
// in ModeBlockingData point-to-point calls go to the nonblocking control
// comm, since connecting to a peer on a blocking comm would wait for the
// peer inside NCCL. Both comms enqueue on the one stream, so their work
// runs in issue order.
func (b *Backend) launch(ctx context.Context, what string, a *libapi.CollArgs, ops []libapi.CollArgs) error {
	if err := b.usable(); err != nil {
		return err
	}
	p2p := false
	if b.cfg.Mode == ModeBlockingData {
		if a != nil {
			p2p = a.Kind.PointToPoint()
		}
		for i := range ops {
			p2p = p2p || ops[i].Kind.PointToPoint()
		}
	}
	b.hmu.Lock()
	defer b.hmu.Unlock()
	h, blocking := b.data, b.dataBlocking
	if p2p {
		h, blocking = b.ctl, b.ctlBlocking
	}
	if h == 0 {
		return b.failure()
	}
	t0 := time.Now()
	var r libapi.Result
	if ops != nil {
		r = b.lib.Group(b.dev, h, b.stream, ops)
	} else {
		r = b.lib.Enqueue(b.dev, h, b.stream, a)
	}
	t1 := time.Now()
	var err error
	if blocking {
		// A blocking comm's call returns its final result.
		if r != libapi.Success {
			err = b.ncclError(h, what, r)
			b.fail(err)
		}
	} else {
		err = b.settle(ctx, h, what, r)
	}
	st := &b.stats
	st.ops.Add(1)
	st.enqueueNs.Add(int64(t1.Sub(t0)))
	st.settleNs.Add(int64(time.Since(t1)))
	return err
}

// settle checks an NCCL call's result and, as a nonblocking comm
// requires after every call, polls ncclCommGetAsyncError until it leaves
// ncclInProgress. Called with hmu held.
func (b *Backend) settle(ctx context.Context, h libapi.Comm, what string, r libapi.Result) error {
	if r != libapi.Success && r != libapi.InProgress {
		err := b.ncclError(h, what, r)
		b.fail(err)
		return err
	}
	if r == libapi.InProgress {
		b.stats.inProgress.Add(1)
	}
	var start time.Time
	for i := 0; ; i++ {
		a, cr := b.lib.CommGetAsyncError(h)
		b.stats.settlePolls.Add(1)
		if i == 1 && r != libapi.InProgress {
			b.stats.inProgress.Add(1)
		}
		switch {
		case cr != libapi.Success:
			err := b.ncclError(h, "ncclCommGetAsyncError", cr)
			b.fail(err)
			return err
		case a == libapi.Success:
			return nil
		case a != libapi.InProgress:
			err := b.ncclError(h, what, a)
			b.fail(err)
			return err
		}
		// Still in progress (connection setup, a large group): wait, but
		// stay abortable.
		if b.failed.Load() {
			b.dirty.Store(true)
			return b.failure()
		}
		if err := ctx.Err(); err != nil {
			err = ctxError(ctx, what+" still in progress")
			b.fail(err)
			b.dirty.Store(true)
			return err
		}
		if i == 0 {
			start = time.Now()
		}
		if el := time.Since(start); el > b.cfg.YieldWait {
			time.Sleep(b.cfg.PollInterval)
		} else if el > b.cfg.SpinWait {
			runtime.Gosched()
		}
	}
}

// waitStream waits until the comm's stream has run everything queued on
// it, the comm fails (Abort, Revoke, Close, an async error), or ctx ends.
// It polls busily for SpinWait, then yields until YieldWait, then sleeps
// PollInterval between polls.
func (b *Backend) waitStream(ctx context.Context, what string) error { return b.waitFor(ctx, what, 0) }

// waitFor is waitStream for the work before event ev (0: the whole stream).
func (b *Backend) waitFor(ctx context.Context, what string, ev libapi.Event) error {
	b.opActive.Store(true)
	t0 := time.Now()
	polls := int64(0)
	defer func() {
		b.opActive.Store(false)
		b.stats.waitPolls.Add(polls)
		b.stats.waitNs.Add(int64(time.Since(t0)))
	}()
	done := ctx.Done()
	var start time.Time
	var timer *time.Timer
	for i := 0; ; i++ {
		var ok bool
		var err error
		if ev != 0 {
			ok, err = b.lib.EventQuery(ev)
		} else {
			ok, err = b.lib.StreamQuery(b.dev, b.stream)
		}
		polls++
		if err != nil {
			err = fmt.Errorf("nccl: %w: %s: %w", comm.ErrAborted, what, err)
			b.fail(err)
			return err
		}
		if ok {
			if timer != nil {
				timer.Stop()
			}
			// A revoke or abort also drains the stream, by killing the
			// kernels: a comm that failed meanwhile did not run the op.
			if b.failed.Load() {
				return b.failure()
			}
			return nil
		}
		if b.failed.Load() {
			b.dirty.Store(true)
			return b.failure()
		}
		if done != nil {
			select {
			case <-done:
				err := ctxError(ctx, what)
				b.fail(err)
				b.dirty.Store(true)
				return err
			default:
			}
		}
		if i == 0 {
			start = time.Now()
			continue
		}
		el := time.Since(start)
		if el < b.cfg.SpinWait {
			continue
		}
		if el < b.cfg.YieldWait {
			runtime.Gosched()
			continue
		}
		if timer == nil {
			timer = time.NewTimer(b.cfg.PollInterval)
		} else {
			timer.Reset(b.cfg.PollInterval)
		}
		select {
		case <-timer.C:
		case <-b.wake:
		case <-done:
		}
	}
}

// run issues one call and waits for it; with a StreamOrder (not Async)
// it returns once the call is enqueued.
func (b *Backend) run(ctx context.Context, what string, a libapi.CollArgs) error {
	b.opMu.Lock()
	defer b.opMu.Unlock()
	so, ordered := streamOrderOf(ctx)
	if ordered {
		if err := b.usable(); err != nil {
			return err
		}
		if err := b.waitOn(so.Stream, what); err != nil {
			return err
		}
	}
	if err := b.launch(ctx, what, &a, nil); err != nil {
		return err
	}
	if ordered && !so.Async && !a.Kind.PointToPoint() {
		return b.signal(ctx, so.Stream, what)
	}
	return b.waitStream(ctx, what)
}

// runGroup issues b.group (after an optional device-to-device copy on the
// stream) and waits for it.
func (b *Backend) runGroup(ctx context.Context, what string, copyDst, copySrc uintptr, copyBytes int) error {
	b.opMu.Lock()
	defer b.opMu.Unlock()
	if err := b.usable(); err != nil {
		return err
	}
	if so, ok := streamOrderOf(ctx); ok {
		// Waited for on the host below, so the stream needs no signal.
		if err := b.waitOn(so.Stream, what); err != nil {
			return err
		}
	}
	if copyBytes > 0 {
		if err := b.lib.CopyDtoD(b.dev, copyDst, copySrc, copyBytes, b.stream); err != nil {
			err = fmt.Errorf("nccl: %w: %s: %w", comm.ErrAborted, what, err)
			b.fail(err)
			return err
		}
	}
	if len(b.group) > 0 {
		if err := b.launch(ctx, what, nil, b.group); err != nil {
			return err
		}
	}
	return b.waitStream(ctx, what)
}

// allReduceScratch sums one int32 of scratch across the comm (warm-up and
// Barrier).
func (b *Backend) allReduceScratch(ctx context.Context) error {
	return b.run(ctx, "barrier", libapi.CollArgs{Kind: libapi.AllReduce, Type: libapi.Int32, Op: libapi.Sum,
		Send: b.scratch, Recv: b.scratch, Count: 1})
}

// CanStart implements comm.Enqueuer: the collectives that are one NCCL call
// can be started without waiting for the ones before them.
func (b *Backend) CanStart(kind comm.OpType) bool {
	switch kind {
	case comm.OpAllReduce, comm.OpReduceScatter, comm.OpAllGather, comm.OpBroadcast, comm.OpReduce:
		return true
	}
	return false
}

// Start implements comm.Enqueuer: it enqueues op on the comm's stream,
// records an event behind it and returns a completion that waits for the
// event, so comm.Comm can keep the stream full (nccl-tests' pipelined
// latency instead of one op's round trip).
func (b *Backend) Start(ctx context.Context, op comm.Op) (comm.Completion, error) {
	var a libapi.CollArgs
	var err error
	what := op.Kind.String()
	switch op.Kind {
	case comm.OpAllReduce:
		a, err = b.allReduceArgs(op.Out, op.ReduceOp)
	case comm.OpReduceScatter:
		a, err = b.reduceScatterArgs(op.Out, op.In, op.ReduceOp)
	case comm.OpAllGather:
		a, err = b.allGatherArgs(op.Out, op.In)
	case comm.OpBroadcast:
		a, err = b.broadcastArgs(op.Out, op.Root)
	case comm.OpReduce:
		a, err = b.reduceArgs(op.Out, op.ReduceOp, op.Root)
	default:
		return nil, fmt.Errorf("nccl: %w: %s cannot be started without waiting", comm.ErrInvalidArgument, op.Kind)
	}
	if err != nil {
		return nil, err
	}
	if a.Count == 0 {
		return doneCompletion{}, nil
	}
	b.opMu.Lock()
	defer b.opMu.Unlock()
	so, ordered := streamOrderOf(ctx)
	if ordered {
		if err := b.usable(); err != nil {
			return nil, err
		}
		if err := b.waitOn(so.Stream, what); err != nil {
			return nil, err
		}
	}
	if err := b.launch(ctx, what, &a, nil); err != nil {
		return nil, err
	}
	ev, err := b.event()
	if err == nil {
		err = b.lib.EventRecord(b.dev, ev, b.stream)
		if err == nil && ordered && !so.Async {
			err = b.lib.StreamWaitEvent(b.dev, libapi.Stream(so.Stream), ev)
		}
		if err != nil {
			b.putEvent(ev)
		}
	}
	if err != nil {
		err = fmt.Errorf("nccl: %w: %s: record completion event: %w", comm.ErrAborted, what, err)
		b.fail(err)
		return nil, err
	}
	return &started{b: b, ev: ev, what: what}, nil
}

// started is an op enqueued by Start.
type started struct {
	b    *Backend
	ev   libapi.Event
	what string
}

// Wait implements comm.Completion.
func (s *started) Wait(ctx context.Context) error {
	defer s.b.putEvent(s.ev)
	return s.b.waitFor(ctx, s.what, s.ev)
}

type doneCompletion struct{}

func (doneCompletion) Wait(context.Context) error { return nil }

// event takes a completion event from the pool (or makes one).
func (b *Backend) event() (libapi.Event, error) {
	b.evMu.Lock()
	if n := len(b.events); n > 0 {
		ev := b.events[n-1]
		b.events = b.events[:n-1]
		b.evMu.Unlock()
		return ev, nil
	}
	b.evMu.Unlock()
	return b.lib.EventCreate(b.dev, false)
}

// putEvent returns ev to the pool, or destroys it once the comm is released.
func (b *Backend) putEvent(ev libapi.Event) {
	b.evMu.Lock()
	defer b.evMu.Unlock()
	if b.evClosed {
		b.lib.EventDestroy(b.dev, ev)
		return
	}
	b.events = append(b.events, ev)
}

// EnqueueAllReduce queues an in-place all-reduce of t on the comm's stream
// and returns as soon as NCCL has accepted it, without waiting for it to
// complete; Synchronize waits for everything queued. It exists to measure
// what a stream-ordered (non-blocking) comm contract would gain over the
// blocking one (see the benchmark); use it only outside a comm.Comm, from
// one goroutine.
func (b *Backend) EnqueueAllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) error {
	a, err := b.allReduceArgs(t, op)
	if err != nil || a.Count == 0 {
		return err
	}
	b.opMu.Lock()
	defer b.opMu.Unlock()
	return b.launch(ctx, "allreduce", &a, nil)
}

// Synchronize waits until every op queued on the comm's stream is done.
func (b *Backend) Synchronize(ctx context.Context) error {
	b.opMu.Lock()
	defer b.opMu.Unlock()
	if err := b.usable(); err != nil {
		return err
	}
	return b.waitStream(ctx, "synchronize")
}
