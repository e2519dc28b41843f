package ncclsim

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
)

// Simulation is NCCL and the CUDA runtime simulated in Go memory, for
// tests that run without a GPU (package nccl's own, and those of packages
// built on it, such as ft's): a machine with some GPUs whose device memory
// is Go byte slices at made-up addresses. nccl.OpenSimulation returns a
// *nccl.Library that drives it exactly as nccl.Open's drives the real
// libraries, so every comm, copy and health watch of package nccl works
// on it unchanged. In the style of memberlist's MockNetwork and go-nvml's
// mock package, it is an ordinary exported type, so that other packages'
// tests can run whole jobs of GPU ranks in one process.
//
// What it models:
//
//   - Streams are queues of work that run in order when someone polls the
//     stream (or any event); a collective completes once every rank's
//     stream has reached it, with the reduction computed on the host.
//   - Communicators follow NCCL's nonblocking rules: every init and
//     enqueue leaves the comm ncclInProgress for a few polls
//     (SetInProgressPolls), and a call made while the comm is still in
//     progress is a fault (NCCL would poison the comm). Blocking comms
//     block in the calls that wait for peers (init, split, shrink, grow)
//     until the rendezvous completes, as real ones do; a point-to-point
//     call on a blocking data comm (one split off with a blocking config of
//     its own) is a fault, since NCCL would connect to the peer inside it.
//   - Page-locked host memory (PinnedHost) is copied asynchronously, on a
//     later poll of its stream (never, while StallCopies holds them); Go
//     memory synchronously, as CUDA stages it.
//   - The NCCL version and its optional entry points (WithVersion): by
//     default 2.28.3 with ncclCommShrink, ncclCommSplit and the native
//     all-to-all, gather and scatter, and without ncclCommRevoke and
//     ncclCommGrow (so Grow takes its fallback), as on the GPU machines.
//   - NVML, for the health watch: NVML returns a go-nvml Interface whose
//     devices are the simulation's GPUs, and InjectXid and AddECCErrors
//     drive it.
//
// Faults are injected with Kill (the process on a GPU is SIGKILLed: its
// streams never advance again, so its peers' collectives never complete,
// as on real hardware; its calls that wait for peers never return),
// KillDuring, Restart (a new process on a GPU whose process was killed),
// InjectAsyncError and StallCopies. Misuse that the real library would
// punish (a call on a comm still in progress, an illegal address, freeing
// memory a queued op uses, ranks that disagree on a collective) is
// collected as a fault: Faults lists them, and a test should fail if any
// appear.
//
// A Simulation is safe for concurrent use; it starts no goroutines (work
// advances only inside the calls of the libraries it backs). Two
// Simulations share nothing.
type Simulation struct {
	mu   sync.Mutex
	ver  int
	syms map[string]bool
	nDev int
	// inProgressPolls is how many ncclCommGetAsyncError calls report
	// ncclInProgress after each nonblocking call.
	inProgressPolls int

	cond *sync.Cond // on mu: broadcast when a rendezvous gains an arrival

	next   uintptr
	allocs map[uintptr]*simAlloc
	pinned map[*byte]*simPinned
	// stallCopies holds copies of page-locked memory on their streams.
	stallCopies bool
	// stallAborts holds ncclCommAbort of the comms on these devices.
	stallAborts map[int]bool
	hostAllocs  int // live page-locked allocations
	comms       map[libapi.Comm]*simComm
	streams     map[libapi.Stream]*simStream
	nullStreams map[int]libapi.Stream // device → its legacy default stream (handle 0)
	events      map[libapi.Event]*simEvent
	cells       map[libapi.Cell]libapi.Comm
	inits       map[libapi.UniqueID]*simRdv
	growIDs     map[libapi.UniqueID]*simRdv
	dead        map[int]bool
	killOn      map[string]int // call name → device (+1) whose process dies as it makes the call
	faults      []string
	calls       map[string]int
	// growCells are joiners' cells, filled when their grow completes.
	growCells []simGrowCell

	nvml *simNVML // made by the first NVML call
}

// library is a Simulation as package nccl sees it: the libapi.Library
// that nccl.OpenSimulation drives. Its methods are the NCCL and CUDA
// runtime calls; they are not Simulation's, so that a test reaches the
// simulated GPUs as a process does, through a nccl.Library, besides the
// Simulation's own methods that inject faults and inspect its state.
type library struct{ *Simulation }

var _ libapi.Library = library{}

// SimulatedLibrary returns w as NCCL and the CUDA runtime, for
// nccl.OpenSimulation (it makes w a libapi.Simulator).
func (w *Simulation) SimulatedLibrary() libapi.Library { return library{w} }

// New returns a machine with devices simulated GPUs (CUDA
// ordinals 0 … devices-1) and NCCL 2.28.3.
func New(devices int) *Simulation {
	w := &Simulation{
		ver: 22803, nDev: devices, inProgressPolls: 1, next: 0x1000,
		syms: map[string]bool{"ncclGetLastError": true, "ncclCommSplit": true, "ncclCommShrink": true,
			"ncclAlltoAll": true, "ncclGather": true, "ncclScatter": true},
		allocs: map[uintptr]*simAlloc{}, comms: map[libapi.Comm]*simComm{}, streams: map[libapi.Stream]*simStream{},
		events: map[libapi.Event]*simEvent{}, cells: map[libapi.Cell]libapi.Comm{}, inits: map[libapi.UniqueID]*simRdv{},
		growIDs: map[libapi.UniqueID]*simRdv{}, dead: map[int]bool{}, calls: map[string]int{},
		pinned: map[*byte]*simPinned{}, killOn: map[string]int{}, stallAborts: map[int]bool{},
	}
	w.cond = sync.NewCond(&w.mu)
	return w
}

// WithVersion sets the NCCL version code (major*10000+minor*100+patch) and
// the optional entry points present (e.g. "ncclCommShrink",
// "ncclCommRevoke", "ncclCommGrow", "ncclCommGetUniqueId"), replacing the
// defaults. Call it before opening a Library on w. It returns w.
func (w *Simulation) WithVersion(code int, symbols ...string) *Simulation {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.ver = code
	w.syms = map[string]bool{}
	for _, s := range symbols {
		w.syms[s] = true
	}
	return w
}

// SetInProgressPolls sets how many ncclCommGetAsyncError calls report
// ncclInProgress after each nonblocking call (default 1).
func (w *Simulation) SetInProgressPolls(n int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.inProgressPolls = n
}

// Devices is the number of simulated GPUs.
func (w *Simulation) Devices() int { return w.nDev }

// Faults lists the misuse seen so far, in order: calls the real library
// would have failed, poisoned a comm for, or crashed on.
func (w *Simulation) Faults() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.faults)
}

// Calls is how many times the NCCL call name was made (e.g.
// "ncclCommShrink", "ncclCommShrink(abort)", "ncclCommAbort",
// "ncclAllReduce", "ncclCommInitRankConfig", "ncclCommSplit").
func (w *Simulation) Calls(name string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.calls[name]
}

// LiveComms is the number of NCCL communicators not yet aborted.
func (w *Simulation) LiveComms() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.comms)
}

// PinnedLive is the number of page-locked allocations not yet freed.
func (w *Simulation) PinnedLive() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.hostAllocs
}

// AwaitQueued waits until a collective of a comm on GPU dev is queued on
// a stream and waits there (for its peers, or to start), not terminated,
// or until ctx ends.
func (w *Simulation) AwaitQueued(ctx context.Context, dev int) error {
	stop := context.AfterFunc(ctx, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		w.cond.Broadcast()
	})
	defer stop()
	w.mu.Lock()
	defer w.mu.Unlock()
	for {
		for _, s := range w.streams {
			for _, it := range s.items {
				if ci, ok := it.(*simCollItem); ok && ci.c.dev == dev && !ci.c.killed && ci.waiting() {
					return nil
				}
			}
		}
		if ctx.Err() != nil {
			return fmt.Errorf("ncclsim: no collective queued on GPU %d: %w", dev, context.Cause(ctx))
		}
		w.cond.Wait()
	}
}

func (w *Simulation) faultf(format string, args ...any) {
	w.faults = append(w.faults, fmt.Sprintf(format, args...))
}

// StreamIdle reports whether CUDA stream s (the cudaStream_t a comm or a
// copy holds) has nothing queued, or was destroyed, after advancing it as
// a poll would.
func (w *Simulation) StreamIdle(s uintptr) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	st := w.streams[libapi.Stream(s)]
	if st == nil {
		return true
	}
	w.progress(st)
	return len(st.items) == 0
}

func (w *Simulation) handle() uintptr {
	w.next += 16
	return w.next
}
