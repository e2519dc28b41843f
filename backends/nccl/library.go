package nccl

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// Environment variables that override where the libraries are loaded from.
const (
	EnvNCCLLib   = "FTCOMM_NCCL_LIB"   // path or soname of libnccl (default libnccl.so.2)
	EnvCUDARTLib = "FTCOMM_CUDART_LIB" // path or soname of libcudart (default libcudart.so.13, then .12)
)

// LibraryConfig says where to load NCCL and the CUDA runtime from, and
// how NCCL sets up connections. Empty paths fall back to the environment
// (EnvNCCLLib, EnvCUDARTLib) and then to the default search: for NCCL, the
// newest of the system's and those bundled in Python environments (see
// the package doc, Loading).
type LibraryConfig struct {
	// NCCLPath names the libnccl to load (a path, or a soname the loader
	// resolves: "libnccl.so.2" is the loader's choice, as before the
	// search existed). A named library is the only one tried: if it does
	// not load, Open fails.
	NCCLPath        string
	CUDARuntimePath string

	// Logger receives the choice of library: every candidate considered,
	// its version and why it was or was not chosen, and what the chosen
	// one offers. nil: no logging (New passes comm.Options.Logger).
	Logger *zap.Logger
	// Registerer, if set, gets the library's info metric (see
	// Library.Collector). Registering an identical one again is not an
	// error.
	Registerer prometheus.Registerer

	// LazyConnect leaves NCCL's default of connecting each algorithm on
	// its first use (NCCL_RUNTIME_CONNECT=1). By default Open sets
	// NCCL_RUNTIME_CONNECT=0 (unless the environment already sets it), so
	// every comm connects its rings and trees while it is created, where
	// the call is nonblocking and abortable: a first use on a blocking
	// data comm (ModeBlockingData) would otherwise wait for peers inside
	// NCCL. NCCL reads the variable once per process, when the first
	// comm is created, so the first Library opened decides.
	LazyConnect bool

	// CopyStreams is how many CUDA streams per device the host copies
	// (CopyToHost, CopyFromHost and the helpers) run on, so that that many
	// copies proceed at once. Default 4.
	CopyStreams int
}

// envRuntimeConnect is NCCL's switch between lazy (1, its default) and
// eager (0) connection set-up.
const envRuntimeConnect = "NCCL_RUNTIME_CONNECT"

// Version is an NCCL version.
type Version struct{ Major, Minor, Patch int }

// versionFromCode decodes NCCL's version code (major*10000+minor*100+patch
// since 2.9; major*1000+minor*100+patch before).
func versionFromCode(code int) Version {
	if code >= 10000 {
		return Version{code / 10000, code / 100 % 100, code % 100}
	}
	return Version{code / 1000, code / 100 % 10, code % 100}
}

// Code is the version in NCCL's 2.9+ encoding.
func (v Version) Code() int { return v.Major*10000 + v.Minor*100 + v.Patch }

// AtLeast reports whether v is major.minor.patch or newer.
func (v Version) AtLeast(major, minor, patch int) bool {
	return v.Code() >= Version{major, minor, patch}.Code()
}

func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Patch) }

// Features are the native NCCL calls this library offers; where one is
// missing the backend uses its fallback.
type Features struct {
	Split    bool // ncclCommSplit (2.18+)
	Shrink   bool // ncclCommShrink (2.27.3+), else a fresh init among survivors
	Revoke   bool // ncclCommRevoke (2.28.7+), else abort
	Grow     bool // ncclCommGrow + ncclCommGetUniqueId (2.29.2+), else a fresh init with a new id
	AllToAll bool // ncclAlltoAll (2.28.3+), else grouped send/recv
	Gather   bool // ncclGather (2.28.3+), else grouped send/recv
	Scatter  bool // ncclScatter (2.28.3+), else grouped send/recv
}

// Recovery is how a comm on this library gets from a failed peer to a
// working comm of the survivors, as far as the library allows: the gate
// on its version and entry points (Features.Shrink, Features.Revoke).
// Which one a comm takes also follows its Config (Config.Revoke,
// DisableNativeShrink) and the other ranks' libraries (see Shrink).
type Recovery uint8

const (
	// RecoveryFreshInit: no ncclCommShrink (NCCL < 2.27.3): the survivors
	// initialise a new comm; a native Revoke aborts.
	RecoveryFreshInit Recovery = iota
	// RecoveryShrinkAbort: ncclCommShrink with NCCL_SHRINK_ABORT ends the
	// failed comm's kernels and shrinks it (2.27.3+); no ncclCommRevoke.
	RecoveryShrinkAbort
	// RecoveryRevokeShrink: ncclCommRevoke too (2.28.7+), so RevokeAuto
	// revokes natively at the failure and the Shrink that follows uses
	// NCCL_SHRINK_DEFAULT. The shrink does not reuse the parent's
	// connections: NCCL shares no resources with a revoked parent (see
	// the package doc, Facts relied on).
	RecoveryRevokeShrink
)

func (r Recovery) String() string {
	switch r {
	case RecoveryFreshInit:
		return "fresh-init"
	case RecoveryShrinkAbort:
		return "shrink-abort"
	case RecoveryRevokeShrink:
		return "revoke+shrink"
	}
	return fmt.Sprintf("recovery(%d)", uint8(r))
}

// recoveryOf is the gate: what the features allow.
func recoveryOf(f Features) Recovery {
	switch {
	case f.Shrink && f.Revoke:
		return RecoveryRevokeShrink
	case f.Shrink:
		return RecoveryShrinkAbort
	}
	return RecoveryFreshInit
}

// Info describes a loaded library.
type Info struct {
	NCCLPath string
	// NCCLSource says how NCCLPath was chosen; Candidates are the
	// libraries the search considered (none when one was named).
	NCCLSource      NCCLSource
	Candidates      []NCCLCandidate
	CUDARuntimePath string
	NCCL            Version
	CUDARuntime     int // cudaRuntimeGetVersion, e.g. 13000
	CUDADriver      int // cudaDriverGetVersion
	Symbols         map[string]bool
	Features        Features
	Recovery        Recovery
	// EagerConnect: NCCL_RUNTIME_CONNECT was 0 when the library was
	// opened (see LibraryConfig.LazyConnect).
	EagerConnect bool
}

func (i Info) String() string {
	var present, absent []string
	for s, ok := range i.Symbols {
		if ok {
			present = append(present, s)
		} else {
			absent = append(absent, s)
		}
	}
	sort.Strings(present)
	sort.Strings(absent)
	return fmt.Sprintf("NCCL %s (%s, source %s), CUDA runtime %d (%s), driver %d; eager connect %v; recovery %s; optional symbols present %v, absent %v; features %+v",
		i.NCCL, i.NCCLPath, i.NCCLSource, i.CUDARuntime, i.CUDARuntimePath, i.CUDADriver, i.EagerConnect, i.Recovery,
		present, absent, i.Features)
}

// Library is a loaded NCCL + CUDA runtime. It is safe for concurrent use
// and may be shared by any number of communicators (Config.Library). There
// is no Close: NCCL's threads and atexit handlers must outlive every
// communicator, so the libraries stay loaded; the streams the copy helpers
// use are released by Release.
type Library struct {
	lib     libapi.Library
	info    Info
	nCopies int // streams per device in a copy pool

	mu    sync.Mutex
	pools map[int]*copyPool
	// orphans counts copies whose caller's ctx ended before the GPU was
	// done: the copy engine cannot be stopped, so their streams and the
	// page-locked memory they use stay reserved until they finish.
	orphans     int
	orphansDone *sync.Cond // signalled when orphans drops
}

// Open loads NCCL and the CUDA runtime with dlopen. The NCCL is the one
// LibraryConfig.NCCLPath or EnvNCCLLib names, else the newest found (see
// the package doc, Loading). Without them (or without cgo) it returns an
// error wrapping comm.ErrBackendUnavailable and the loader's message.
func Open(cfg LibraryConfig) (*Library, error) {
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	np, cp := cfg.NCCLPath, cfg.CUDARuntimePath
	src := SourceConfig
	if np == "" {
		np, src = os.Getenv(EnvNCCLLib), SourceEnv
	}
	if cp == "" {
		cp = os.Getenv(EnvCUDARTLib)
	}
	if err := checkCopyStreams(cfg.CopyStreams); err != nil {
		return nil, err
	}
	if !cfg.LazyConnect && os.Getenv(envRuntimeConnect) == "" {
		// Before NCCL's first comm, which is when NCCL reads it.
		if err := os.Setenv(envRuntimeConnect, "0"); err != nil {
			return nil, fmt.Errorf("nccl: set %s: %w", envRuntimeConnect, err)
		}
	}
	var d *dlLibrary
	var cands []NCCLCandidate
	var err error
	if np != "" {
		if d, err = openLibrary(np, cp); err != nil {
			log.Warn("the NCCL named does not load (no other is tried)", zap.String("path", np),
				zap.String("named_by", string(src)), zap.Error(err))
			return nil, err
		}
	} else if d, src, cands, err = openNewest(defaultSearch(), cp, log); err != nil {
		return nil, err
	}
	l := newLibrary(d, d.ncclPath, d.cudartPath, cfg.CopyStreams, os.Getenv(envRuntimeConnect) == "0")
	l.info.NCCLSource, l.info.Candidates = src, cands
	if err := l.announce(log, cfg.Registerer); err != nil {
		return nil, err
	}
	return l, nil
}

func checkCopyStreams(n int) error {
	if n < 0 || n > 64 {
		return fmt.Errorf("nccl: %w: CopyStreams %d outside [0, 64]", comm.ErrInvalidArgument, n)
	}
	return nil
}

// OpenSimulation returns a Library on sim, NCCL and the CUDA runtime
// simulated in Go memory (a *ncclsim.Simulation), as Open returns one on
// the real libraries: with cfg's CopyStreams and LazyConnect, logged to
// cfg.Logger and registered with cfg.Registerer (the paths are ignored:
// the version is the simulation's). Give each simulated process its own
// Library, as each real process opens its own: a Library's copy pools
// and its wait for abandoned copies are per process.
//
// It is the hook package ncclsim plugs into. Only tests import ncclsim,
// so no production binary links the simulation; sim's type is internal
// to backends/nccl, so ncclsim's is the one implementation.
func OpenSimulation(sim libapi.Simulator, cfg LibraryConfig) (*Library, error) {
	if err := checkCopyStreams(cfg.CopyStreams); err != nil {
		return nil, err
	}
	l := simulatedLibrary(sim, cfg.CopyStreams, !cfg.LazyConnect)
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	if err := l.announce(log, cfg.Registerer); err != nil {
		return nil, err
	}
	return l, nil
}

// simulatedLibrary is OpenSimulation's Library, neither checked nor
// announced.
func simulatedLibrary(sim libapi.Simulator, copyStreams int, eager bool) *Library {
	l := newLibrary(sim.SimulatedLibrary(), "sim-libnccl", "sim-libcudart", copyStreams, eager)
	l.info.NCCLSource = SourceSimulation
	return l
}

// openNewest loads the newest libnccl search finds (chooseNCCL), trying
// the next best where one does not load, and the loader's own choice
// (libnccl.so.2) where none could be read. Every candidate and why it was
// or was not chosen is logged.
func openNewest(search ncclSearch, cudartPath string, log *zap.Logger) (*dlLibrary, NCCLSource, []NCCLCandidate, error) {
	cands := search.candidates()
	driver := 0
	for _, c := range cands {
		if c.CUDA > 0 {
			driver = probeDriverCUDA(cudartPath) // the CUDA version the driver supports, 0 if unknown
			break
		}
	}
	ranked := chooseNCCL(cands, driver)
	defer func() {
		for _, c := range cands {
			f := []zap.Field{zap.String("path", c.Path), zap.String("source", string(c.Source)),
				zap.String("found_by", c.Where), zap.Bool("chosen", c.Chosen), zap.String("reason", c.Reason)}
			if c.Err == nil {
				f = append(f, zap.Stringer("version", c.Version))
			}
			if c.CUDA > 0 {
				f = append(f, zap.String("built_for_cuda", fmt.Sprintf("%d.%d", c.CUDA/1000, c.CUDA%1000/10)))
			}
			log.Info("NCCL library candidate", f...)
		}
	}()
	var first error
	for k, i := range ranked {
		c := &cands[i]
		d, err := openLibrary(c.Path, cudartPath)
		if err == nil {
			if got := versionFromCode(d.Version()); got != c.Version {
				log.Warn("NCCL reports another version than its file says", zap.String("path", c.Path),
					zap.Stringer("file", c.Version), zap.Stringer("ncclGetVersion", got))
			}
			return d, c.Source, cands, nil
		}
		var le *ncclLoadError
		if !errors.As(err, &le) {
			return nil, "", cands, err // not this candidate's fault (the CUDA runtime, say)
		}
		first = cmp.Or(first, err)
		c.Chosen, c.Reason = false, "chosen, but does not load: "+err.Error()
		if k+1 < len(ranked) {
			next := &cands[ranked[k+1]]
			next.Chosen, next.Reason = true, "the newest that loads"
		}
	}
	if first != nil {
		return nil, "", cands, first
	}
	// Nothing found, or no version read: the loader decides, as it did
	// before the search existed.
	d, err := openLibrary(ncclSoname, cudartPath)
	if err != nil {
		return nil, "", cands, err
	}
	return d, SourceLoader, cands, nil
}

// ncclLoadError is a libnccl that dlopen refused or that lacks a required
// entry point: the next candidate may do better.
type ncclLoadError struct{ err error }

func (e *ncclLoadError) Error() string { return e.err.Error() }
func (e *ncclLoadError) Unwrap() error { return e.err }

// announce logs what was loaded and registers its info metric.
func (l *Library) announce(log *zap.Logger, reg prometheus.Registerer) error {
	i := l.info
	log.Info("NCCL library", zap.String("path", i.NCCLPath), zap.Stringer("version", i.NCCL),
		zap.String("source", string(i.NCCLSource)), zap.Stringer("recovery", i.Recovery),
		zap.String("cudart", i.CUDARuntimePath), zap.Int("cuda_runtime", i.CUDARuntime), zap.Int("cuda_driver", i.CUDADriver),
		zap.Bool("eager_connect", i.EagerConnect))
	if reg == nil {
		return nil
	}
	if err := reg.Register(l.Collector()); err != nil {
		if are := (prometheus.AlreadyRegisteredError{}); errors.As(err, &are) {
			return nil // the same library, already reported
		}
		return fmt.Errorf("nccl: register the library's metric: %w", err)
	}
	return nil
}

// Collector is the library's Prometheus info metric, for a caller's
// registry (or LibraryConfig.Registerer):
//
//	ftcomm_nccl_library_info{path,version,source,recovery} 1
//
// path, version and source say which libnccl was loaded and how it was
// chosen (NCCLSource); recovery is what it allows after a failure
// (Recovery: fresh-init, shrink-abort or revoke+shrink). Every call
// returns an equal collector: registering a second one for the same
// library is prometheus.AlreadyRegisteredError.
func (l *Library) Collector() prometheus.Collector {
	i := l.info
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "ftcomm_nccl_library_info",
		Help: "The NCCL library loaded (always 1): its path, version, how it was chosen and how a comm on it recovers from a failure.",
		ConstLabels: prometheus.Labels{"path": i.NCCLPath, "version": i.NCCL.String(), "source": string(i.NCCLSource),
			"recovery": i.Recovery.String()},
	})
	g.Set(1)
	return g
}

func newLibrary(lib libapi.Library, ncclPath, cudartPath string, copyStreams int, eager bool) *Library {
	if copyStreams == 0 {
		copyStreams = 4
	}
	l := &Library{lib: lib, nCopies: copyStreams, pools: map[int]*copyPool{}}
	l.orphansDone = sync.NewCond(&l.mu)
	l.info = Info{NCCLPath: ncclPath, CUDARuntimePath: cudartPath, NCCL: versionFromCode(lib.Version()),
		CUDARuntime: lib.RuntimeVersion(), CUDADriver: lib.DriverVersion(), Symbols: map[string]bool{},
		EagerConnect: eager}
	for _, s := range []string{"ncclCommSplit", "ncclCommShrink", "ncclCommRevoke", "ncclCommGrow",
		"ncclCommGetUniqueId", "ncclAlltoAll", "ncclGather", "ncclScatter", "ncclGetLastError"} {
		l.info.Symbols[s] = lib.HasSymbol(s)
	}
	v, has := l.info.NCCL, l.info.Symbols
	l.info.Features = Features{
		Split:    has["ncclCommSplit"] && v.AtLeast(2, 18, 0),
		Shrink:   has["ncclCommShrink"] && v.AtLeast(2, 27, 3),
		Revoke:   has["ncclCommRevoke"] && v.AtLeast(2, 28, 7),
		Grow:     has["ncclCommGrow"] && has["ncclCommGetUniqueId"] && v.AtLeast(2, 29, 2),
		AllToAll: has["ncclAlltoAll"] && v.AtLeast(2, 28, 3),
		Gather:   has["ncclGather"] && v.AtLeast(2, 28, 3),
		Scatter:  has["ncclScatter"] && v.AtLeast(2, 28, 3),
	}
	l.info.Recovery = recoveryOf(l.info.Features)
	return l
}

// Info reports the loaded versions, paths, optional symbols and features.
func (l *Library) Info() Info {
	i := l.info
	i.Symbols = make(map[string]bool, len(l.info.Symbols))
	for k, v := range l.info.Symbols {
		i.Symbols[k] = v
	}
	i.Candidates = slices.Clone(l.info.Candidates)
	return i
}

// DeviceCount is the number of CUDA devices visible to this process.
func (l *Library) DeviceCount() (int, error) { return l.lib.DeviceCount() }

// ---- device memory ----

// DeviceBuffer is device memory allocated by Library.Alloc. Its methods are
// safe for concurrent use except Free, which must not race with the others
// (nor with an op still using the memory).
type DeviceBuffer struct {
	l     *Library
	dev   int
	ptr   uintptr
	n     int
	freed bool
}

// Alloc allocates n bytes on device dev (cudaMalloc).
func (l *Library) Alloc(dev, n int) (*DeviceBuffer, error) {
	if n < 0 || dev < 0 {
		return nil, fmt.Errorf("nccl: %w: alloc %d bytes on device %d", comm.ErrInvalidArgument, n, dev)
	}
	p, err := l.lib.Malloc(dev, max(n, 1))
	if err != nil {
		return nil, err
	}
	return &DeviceBuffer{l: l, dev: dev, ptr: p, n: n}, nil
}

// Ptr is the device address.
func (b *DeviceBuffer) Ptr() uintptr { return b.ptr }

// Len is the size in bytes.
func (b *DeviceBuffer) Len() int { return b.n }

// Device is the CUDA ordinal the memory lives on.
func (b *DeviceBuffer) Device() int { return b.dev }

// Tensor views the buffer as Len()/dt.Size() elements of dt.
func (b *DeviceBuffer) Tensor(dt comm.DType) comm.Tensor {
	n := 0
	if s := dt.Size(); s > 0 {
		n = b.n / s
	}
	return comm.DeviceTensor(b.ptr, b.dev, n, dt)
}

// CopyFromHost copies src to the start of the buffer and waits for it.
func (b *DeviceBuffer) CopyFromHost(ctx context.Context, src []byte) error {
	if len(src) > b.n {
		return fmt.Errorf("nccl: %w: copy of %d bytes into a %d-byte buffer", comm.ErrInvalidArgument, len(src), b.n)
	}
	return b.l.CopyToDevice(ctx, b.Tensor(comm.Uint8).Slice(0, len(src)), src)
}

// CopyToHost copies the start of the buffer into dst and waits for it.
func (b *DeviceBuffer) CopyToHost(ctx context.Context, dst []byte) error {
	if len(dst) > b.n {
		return fmt.Errorf("nccl: %w: copy of %d bytes out of a %d-byte buffer", comm.ErrInvalidArgument, len(dst), b.n)
	}
	return b.l.CopyFromDevice(ctx, dst, b.Tensor(comm.Uint8).Slice(0, len(dst)))
}

// Fill sets every byte of the buffer to v and waits for it.
func (b *DeviceBuffer) Fill(ctx context.Context, v byte) error {
	return b.l.Memset(ctx, b.Tensor(comm.Uint8), v)
}

// Free releases the memory (cudaFree). Freeing twice is harmless.
func (b *DeviceBuffer) Free() error {
	if b.freed {
		return nil
	}
	b.freed = true
	return b.l.lib.Free(b.dev, b.ptr)
}

// ---- streams and events ----

// Stream is a nonblocking CUDA stream (cudaStreamNonBlocking).
type Stream struct {
	l   *Library
	dev int
	s   libapi.Stream
}

// NewStream creates a stream on device dev.
func (l *Library) NewStream(dev int) (*Stream, error) {
	s, err := l.lib.StreamCreate(dev)
	if err != nil {
		return nil, err
	}
	return &Stream{l: l, dev: dev, s: s}, nil
}

// Handle is the cudaStream_t, for passing to other CUDA code.
func (s *Stream) Handle() uintptr { return uintptr(s.s) }

// Device is the stream's device.
func (s *Stream) Device() int { return s.dev }

// Done reports whether all work queued on the stream has completed.
func (s *Stream) Done() (bool, error) { return s.l.lib.StreamQuery(s.dev, s.s) }

// Synchronize waits until the stream's work has completed or ctx is done.
func (s *Stream) Synchronize(ctx context.Context) error {
	return s.l.syncStream(ctx, s.dev, s.s)
}

// CopyToDevice queues a copy of src into dst on the stream (see
// Library.CopyToDevice for the sizes); src may be reused once this returns.
func (s *Stream) CopyToDevice(dst comm.Tensor, src []byte) error {
	if err := checkDeviceTensor(dst, "dst"); err != nil {
		return err
	}
	if len(src) < dst.NumBytes() {
		return fmt.Errorf("nccl: %w: %d host bytes for a %d-byte tensor", comm.ErrInvalidArgument, len(src), dst.NumBytes())
	}
	return s.l.lib.CopyHtoD(s.dev, dst.Ptr(), src[:dst.NumBytes()], s.s)
}

// Close destroys the stream.
func (s *Stream) Close() error { return s.l.lib.StreamDestroy(s.dev, s.s) }

// Event is a CUDA event.
type Event struct {
	l   *Library
	dev int
	ev  libapi.Event
}

// NewEvent creates an event on device dev; timing events can be passed to
// Elapsed, others are cheaper to record and query.
func (l *Library) NewEvent(dev int, timing bool) (*Event, error) {
	ev, err := l.lib.EventCreate(dev, timing)
	if err != nil {
		return nil, err
	}
	return &Event{l: l, dev: dev, ev: ev}, nil
}

// Record captures the work queued on s so far.
func (e *Event) Record(s *Stream) error { return e.l.lib.EventRecord(e.dev, e.ev, s.s) }

// Done reports whether the captured work has completed.
func (e *Event) Done() (bool, error) { return e.l.lib.EventQuery(e.ev) }

// Wait waits until the captured work has completed or ctx is done.
func (e *Event) Wait(ctx context.Context) error {
	return pollDone(ctx, nil, func() (bool, error) { return e.l.lib.EventQuery(e.ev) })
}

// Elapsed is the GPU time from start's record to e's (both timing events).
func (e *Event) Elapsed(start *Event) (time.Duration, error) {
	ms, err := e.l.lib.EventElapsed(start.ev, e.ev)
	if err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// Close destroys the event.
func (e *Event) Close() error { return e.l.lib.EventDestroy(e.dev, e.ev) }

// pollDone calls done until it reports true, fails, ctx ends or wake is
// closed: busy at first, then yielding, then sleeping in growing steps.
// Used off the hot path (copies, init); ops use Backend.waitStream.
func pollDone(ctx context.Context, wake <-chan struct{}, done func() (bool, error)) error {
	start := time.Now()
	sleep := 20 * time.Microsecond
	var timer *time.Timer
	for {
		ok, err := done()
		if err != nil || ok {
			return err
		}
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		switch el := time.Since(start); {
		case el < 50*time.Microsecond:
		case el < 2*time.Millisecond:
			runtime.Gosched()
		default:
			if timer == nil {
				timer = time.NewTimer(sleep)
				defer timer.Stop()
			} else {
				timer.Reset(sleep)
			}
			select {
			case <-timer.C:
			case <-wake:
				return errWoken
			case <-ctx.Done():
				return context.Cause(ctx)
			}
			sleep = min(sleep*2, 5*time.Millisecond)
		}
	}
}

// errWoken is returned by pollDone when its wake channel closed.
var errWoken = errors.New("nccl: woken")
