package comm

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// OpType names a communicator operation (for errors, logs, metrics and the
// flight recorder).
type OpType uint8

// The operations of a communicator.
const (
	OpNone OpType = iota
	OpAllReduce
	OpReduceScatter
	OpAllGather
	OpAllGatherV
	OpBroadcast
	OpReduce
	OpScatter
	OpGather
	OpAllToAll
	OpAllToAllV
	OpBarrier
	OpSend
	OpRecv
	OpBatchP2P
	OpShrink
	OpGrow
	OpSplit
	OpReduceScatterV // last: the numbers above are on the wire (gloo's frames)
	numOpTypes
)

var opNames = [numOpTypes]string{
	OpNone: "none", OpAllReduce: "allreduce", OpReduceScatter: "reducescatter",
	OpAllGather: "allgather", OpAllGatherV: "allgatherv", OpBroadcast: "broadcast",
	OpReduce: "reduce", OpScatter: "scatter", OpGather: "gather", OpAllToAll: "alltoall",
	OpAllToAllV: "alltoallv", OpBarrier: "barrier", OpSend: "send", OpRecv: "recv",
	OpBatchP2P: "batchp2p", OpShrink: "shrink", OpGrow: "grow", OpSplit: "split",
	OpReduceScatterV: "reducescatterv",
}

func (o OpType) String() string {
	if o >= numOpTypes {
		return fmt.Sprintf("op(%d)", uint8(o))
	}
	return opNames[o]
}

// Memory says which memory a backend's tensors live in.
type Memory uint8

// The memory kinds.
const (
	HostMemory Memory = iota
	DeviceMemory
)

func (m Memory) String() string {
	if m == DeviceMemory {
		return "device"
	}
	return "host"
}

// P2PKind is the direction of one point-to-point op in a batch.
type P2PKind uint8

// The point-to-point directions.
const (
	P2PSend P2PKind = iota + 1
	P2PRecv
)

// P2POp is one send or receive in a BatchP2P call.
type P2POp struct {
	Kind   P2PKind
	Tensor Tensor
	Peer   int
}

// Backend is what a transport implements; Comm wraps it with ordering,
// deadlines, revocation, validation, the flight recorder and metrics.
//
// Contract: Comm calls at most one op at a time, in issue order, from any
// goroutine; arguments arrive validated (ranks in range, sizes consistent,
// dtype/op pairs supported, memory kind matching Memory()). An op blocks until
// it has completed locally, failed, or been woken by Abort (or Revoke) called
// from another goroutine, or until ctx is done; it must then return promptly
// with an error. After a failed op the backend may be in any state short of
// corrupting memory it was not given: Comm issues no further collectives on it,
// only Shrink, Grow, Split, Abort and Close. Rank, Size, Epoch, Name and Memory
// are immutable. Errors wrap the sentinels of this package; a peer's failure is
// a *RankError wrapping ErrPeerFailed.
type Backend interface {
	Name() string
	Rank() int
	Size() int
	Epoch() uint64
	Memory() Memory

	AllReduce(ctx context.Context, t Tensor, op ReduceOp) error
	// ReduceScatter reduces in (Size()*out.Count() elements) and leaves block
	// Rank() of the result in out.
	ReduceScatter(ctx context.Context, out, in Tensor, op ReduceOp) error
	// ReduceScatterV is ReduceScatter with blocks of counts[r] elements,
	// packed in rank order in in; out holds counts[Rank()].
	ReduceScatterV(ctx context.Context, out, in Tensor, counts []int, op ReduceOp) error
	// AllGather concatenates every rank's in (equal counts) into out in rank order.
	AllGather(ctx context.Context, out, in Tensor) error
	// AllGatherV concatenates in from every rank; rank r contributes counts[r] elements.
	AllGatherV(ctx context.Context, out, in Tensor, counts []int) error
	Broadcast(ctx context.Context, t Tensor, root int) error
	// Reduce leaves the reduction in t on root; other ranks' t is unchanged.
	Reduce(ctx context.Context, t Tensor, op ReduceOp, root int) error
	// Scatter sends block r of root's in to rank r's out; in is ignored off root.
	Scatter(ctx context.Context, out, in Tensor, root int) error
	// Gather collects every rank's in into root's out in rank order; out is ignored off root.
	Gather(ctx context.Context, out, in Tensor, root int) error
	// AllToAll sends block r of in to rank r and receives rank r's block into block r of out.
	AllToAll(ctx context.Context, out, in Tensor) error
	// AllToAllV is AllToAll with per-peer counts; blocks are packed in rank order.
	AllToAllV(ctx context.Context, out Tensor, outCounts []int, in Tensor, inCounts []int) error
	Barrier(ctx context.Context) error
	Send(ctx context.Context, t Tensor, peer int) error
	Recv(ctx context.Context, t Tensor, peer int) error
	// BatchP2P runs the sends and receives concurrently and returns when all are done.
	BatchP2P(ctx context.Context, ops []P2POp) error

	// Abort wakes every blocked op with an error wrapping cause and leaves the
	// backend unusable for collectives. Safe from any goroutine, at any time,
	// any number of times.
	Abort(cause error)
	// Close releases everything the backend holds. Safe to call twice.
	Close() error
}

// Revoker is a backend that can revoke in band: peers learn of the
// revocation, pending ops everywhere fail with ErrRevoked, and what Shrink
// needs (live connections, a shrinkable NCCL comm) survives. Backends
// without it are aborted instead.
type Revoker interface {
	Revoke(cause error)
}

// Refuser is a backend that can tell its peers that this rank refused an
// op, so that their side of it fails at once with ErrPeerRefused instead
// of waiting for its deadline, and no comm breaks. Comm calls Refuse in
// the op's place in the issue order, for every collective and
// point-to-point op whose arguments failed validation here (and for
// Comm.Refuse): the op takes its place in the backend's sequence of
// ops, so every rank's next op runs as usual. op carries the refused
// op's kind and whatever of its arguments the backend needs to reach
// the peers it concerns (Root, Peer, the Kind and Peer of each P2P
// entry); nothing in it has been validated, and Refuse touches no
// tensor. Refuse returns once the peers have been told (it never waits
// for them to read it); an error means the backend broke (a dead peer,
// an abort), as any op's error would.
//
// What the peers see: each rank's matching op fails with a *RankError
// naming the refusing rank and wrapping ErrPeerRefused, with no buffer
// of a collective written; the backend's documentation says how
// point-to-point ops are matched.
type Refuser interface {
	Refuse(ctx context.Context, op Op, reason error) error
}

// CtxWatcher is a backend whose ops watch their ctx themselves: an op that
// is blocked, or polling, when its ctx ends returns promptly with an error
// (within microseconds, as it would on Abort), from every wait it can be
// in. Comm then arms nothing on the ctx of each op; without it, Comm
// registers a callback on every op's cancelable ctx (context.AfterFunc:
// allocations and a lock of the ctx per op) that aborts the backend. Either
// way an op whose ctx ends while it runs breaks the comm (see Deadlines in
// the package doc). WatchesCtx is fixed for the backend's life.
type CtxWatcher interface {
	WatchesCtx() bool
}

// FailureNotifier is a backend that can learn of a failure while no op
// runs: a reader goroutine sees a peer's connection reset, or a peer's
// revocation or abort notice arrives. Broken is closed at that moment and
// Err then says why (a *RankError wrapping ErrPeerFailed names a dead
// peer). Comm watches it, so that Comm.Broken and Comm.Err report such a
// failure at once rather than at the next op. Safe from any goroutine.
type FailureNotifier interface {
	Broken() <-chan struct{}
	Err() error
}

// Shrinker is a backend that can form a smaller communicator of the
// survivors: every rank not in exclude calls Shrink with the same exclude and
// epoch; survivors are renumbered contiguously in old-rank order. exclude is
// sorted, unique, in range and never contains Rank().
type Shrinker interface {
	Shrink(ctx context.Context, exclude []int, epoch uint64) (Backend, error)
}

// Grower is a backend that can admit joiners: existing ranks call Grow with
// the new size and epoch and keep their ranks; each joiner creates its
// backend with New (Options.Rank ≥ the old size, Options.Size = size, the same
// Epoch and Store prefix).
type Grower interface {
	Grow(ctx context.Context, size int, epoch uint64) (Backend, error)
}

// Splitter is a backend that can split like MPI_Comm_split: ranks with the
// same color form a comm ordered by (key, old rank). A rank passing NoColor
// takes part in the exchange and gets a nil Backend.
type Splitter interface {
	Split(ctx context.Context, color, key int) (Backend, error)
}

// Enqueuer is a backend whose ops run in order on a device queue (a CUDA
// stream), so an op may be started before the previous one has completed:
// Comm then enqueues async ops back to back and waits for their
// completions in order, each under its own deadline, instead of running
// them one at a time. Sync ops issued on an idle comm still use the
// blocking methods.
//
// Comm calls CanStart and Start from one goroutine, never while a blocking
// op of the backend runs; Abort and Revoke must wake every pending
// Completion.
type Enqueuer interface {
	// CanStart reports whether ops of this kind can be started.
	CanStart(kind OpType) bool
	// Start enqueues op and returns once the backend has accepted it.
	Start(ctx context.Context, op Op) (Completion, error)
}

// HostCopier is a device backend that copies between its device tensors
// and host memory outside the op order. ft serves and receives a replica's
// device state through it when a peer heals: chunk by chunk, from the live
// state, with no copy per step.
//
// Its methods are safe for concurrent use, with each other and with the
// backend's ops, and keep working after the backend that returned it is
// aborted or closed (they use the device, not the communicator). Each
// blocks until its copy is done or ctx ends; a copy that fails leaves the
// target's bytes unspecified but touches nothing else.
type HostCopier interface {
	// PinnedHost returns n bytes of page-locked host memory, the fastest
	// source and target of device copies, and the function that frees it
	// (call it once, after the last copy that uses the bytes).
	PinnedHost(n int) (buf []byte, free func(), err error)
	// CopyToHost copies len(dst) bytes of device tensor src, starting at
	// byte offset off, into dst.
	CopyToHost(ctx context.Context, dst []byte, src Tensor, off int) error
	// CopyFromHost copies src into device tensor dst at byte offset off.
	CopyFromHost(ctx context.Context, dst Tensor, off int, src []byte) error
}

// HealthEvent is a change of a device's health, as a HealthWatcher reports it.
type HealthEvent struct {
	Device   int
	Critical bool   // the device is unfit: its collectives may hang or corrupt data
	Reason   string // e.g. "XID 79 (GPU has fallen off the bus)"
}

// HealthWatcher is a device backend that can watch the health of the
// device it runs on (on GPUs: XID events, uncorrectable ECC errors, lost
// NVLinks), so that a replica can leave the job before a fault hangs its
// peers. ft watches through it by default.
type HealthWatcher interface {
	// WatchHealth calls report from one goroutine of its own with every
	// change of the device's health, until ctx ends; it returns once
	// watching has started (an error if it cannot), and the goroutine exits
	// when ctx ends. It keeps working after the backend is closed.
	WatchHealth(ctx context.Context, report func(HealthEvent)) error
}

// SilenceReporter is a backend whose peers send it something regularly
// (data or heartbeats, whether or not an op runs), so it can tell which of
// them have gone silent: a link cut somewhere between the two hosts, or a
// peer process stopped. ft names them when a step fails or stalls, so the
// coordinator sees a cut from both of its sides at once.
type SilenceReporter interface {
	// SilentPeers returns the ranks from which nothing has arrived for
	// longer than a live, connected peer stays silent (a few heartbeat
	// intervals), or nil when this process's own timers run late (a
	// starved process hears from no one, and that proves nothing).
	SilentPeers() []int
}

// Completion is an op started by an Enqueuer.
type Completion interface {
	// Wait blocks until the op has completed (nil), failed, been woken by
	// Abort or Revoke, or ctx ends. It is called once.
	Wait(ctx context.Context) error
}

// Op is an op with its arguments, as an Enqueuer receives it: the fields
// the Backend method of the same kind takes (Out holds the tensor of
// single-buffer ops).
type Op struct {
	Kind     OpType
	Out, In  Tensor
	ReduceOp ReduceOp
	Root     int
	Peer     int
	Counts   []int // AllGatherV counts, AllToAllV outCounts
	InCounts []int // AllToAllV inCounts
	P2P      []P2POp
}

// NoColor is the Split color of a rank that joins no new comm.
const NoColor = -1

// Options configures a communicator. Backends read the fields they need;
// BackendConfig carries backend-specific settings (e.g. *gloo.Config).
type Options struct {
	Name   string // for logs and metrics; default "comm"
	Rank   int
	Size   int
	Epoch  uint64 // generation of the membership this comm belongs to
	JobID  string // peers of another job are refused
	Secret []byte // shared by the job's ranks; authenticates peers where the backend supports it

	// Store and Prefix: where ranks rendezvous. Keys are written under
	// Prefix (default "comm/<Name>"); required when Size > 1.
	Store  Store
	Prefix string

	// Timeout is the default deadline of each op, counted from when it
	// starts executing; a caller's ctx deadline can only tighten it.
	// Default 60 s. Negative disables the default (the caller's ctx then
	// bounds ops alone).
	Timeout time.Duration

	Device int // GPU ordinal for device backends

	Logger         *zap.Logger // default: no logging
	Metrics        Metrics     // default: none
	FlightRecorder int         // ops remembered per comm; default 256

	BackendConfig any
}

// DefaultTimeout is the per-op deadline used when Options.Timeout is 0.
const DefaultTimeout = 60 * time.Second

// Validate reports what is wrong with o, or nil.
func (o *Options) Validate() error {
	switch {
	case o.Size < 1:
		return invalidf("options: size %d < 1", o.Size)
	case o.Rank < 0 || o.Rank >= o.Size:
		return invalidf("options: rank %d outside [0, %d)", o.Rank, o.Size)
	case o.Size > 1 && o.Store == nil:
		return invalidf("options: size %d needs a Store for rendezvous", o.Size)
	case o.FlightRecorder < 0:
		return invalidf("options: negative flight recorder size %d", o.FlightRecorder)
	case o.Device < 0:
		return invalidf("options: negative device %d", o.Device)
	case strings.ContainsAny(o.Name, "/ \t\n"):
		return invalidf("options: name %q contains '/' or whitespace", o.Name)
	}
	return nil
}

// withDefaults returns a copy of o with defaults filled in.
func (o Options) withDefaults() Options {
	if o.Name == "" {
		o.Name = "comm"
	}
	if o.Prefix == "" {
		o.Prefix = "comm/" + o.Name
	}
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	if o.FlightRecorder == 0 {
		o.FlightRecorder = 256
	}
	return o
}

// Factory creates the backend for one rank. It blocks until the backend is
// connected to its peers or ctx is done. Options arrive validated, with
// defaults filled in.
type Factory func(ctx context.Context, opts Options) (Backend, error)

// The registry is written by backends' init functions and read afterwards,
// as database/sql drivers are; it holds factories, never communicators.
var registry struct {
	sync.RWMutex
	m map[string]Factory
}

// Register makes a backend available by name. It panics if name is empty,
// f is nil, or name is taken: these are programming errors found at init.
func Register(name string, f Factory) {
	registry.Lock()
	defer registry.Unlock()
	if name == "" || f == nil {
		panic("comm: Register with empty name or nil factory")
	}
	if _, dup := registry.m[name]; dup {
		panic("comm: Register called twice for backend " + name)
	}
	if registry.m == nil {
		registry.m = map[string]Factory{}
	}
	registry.m[name] = f
}

// Backends lists the registered backend names, sorted.
func Backends() []string {
	registry.RLock()
	defer registry.RUnlock()
	names := make([]string, 0, len(registry.m))
	for n := range registry.m {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func lookup(name string) (Factory, error) {
	registry.RLock()
	f, ok := registry.m[name]
	registry.RUnlock()
	if !ok {
		return nil, fmt.Errorf("%w: unknown backend %q (registered: %s; import a backend package, e.g. _ \"github.com/ftcomm/ftcomm/backends/gloo\")",
			ErrBackendUnavailable, name, strings.Join(Backends(), ", "))
	}
	return f, nil
}

// New creates this rank's communicator on the named backend, blocking until
// it is connected to its peers or ctx is done.
func New(ctx context.Context, backend string, opts Options) (*Comm, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	f, err := lookup(backend)
	if err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	b, err := f(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("comm %s: init %s rank %d/%d epoch %d: %w", opts.Name, backend, opts.Rank, opts.Size, opts.Epoch, err)
	}
	return wrap(b, opts), nil
}

// Wrap puts a Comm around a backend made without the registry. opts supplies
// the name, timeout, logger, metrics and flight recorder size; rank and size
// come from b.
func Wrap(b Backend, opts Options) (*Comm, error) {
	if b == nil {
		return nil, invalidf("wrap: nil backend")
	}
	opts.Rank, opts.Size = b.Rank(), b.Size()
	if opts.Store == nil && opts.Size > 1 {
		opts.Store = noStore{} // the backend is already connected
	}
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	return wrap(b, opts.withDefaults()), nil
}

type noStore struct{ Store }

// exclusion checks a Shrink exclude list against rank and size.
func checkExclude(exclude []int, rank, size int) error {
	if len(exclude) == 0 {
		return invalidf("shrink: exclude is empty")
	}
	if !slices.IsSorted(exclude) {
		return invalidf("shrink: exclude %v is not sorted", exclude)
	}
	for i, r := range exclude {
		if r < 0 || r >= size {
			return invalidf("shrink: exclude rank %d outside [0, %d)", r, size)
		}
		if i > 0 && exclude[i-1] == r {
			return invalidf("shrink: exclude lists rank %d twice", r)
		}
		if r == rank {
			return invalidf("shrink: exclude contains this rank %d (excluded ranks do not call Shrink)", r)
		}
	}
	return nil
}
