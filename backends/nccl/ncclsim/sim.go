package ncclsim

import (
	"context"
	"crypto/rand"
	"fmt"
	"slices"
	"sort"
	"sync"
	"unsafe"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
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

type simGrowCell struct {
	cell libapi.Cell
	rdv  *simRdv
	key  int
}

type simAlloc struct {
	dev  int
	base uintptr
	mem  []byte
}

type simPinned struct {
	buf   []byte
	freed bool
}

type simStream struct {
	dev   int
	items []simItem
}

type simEvent struct {
	done bool
	last *simEventItem // the latest record
}

// simClique is one NCCL communicator across its ranks.
type simClique struct {
	size    int
	members []*simComm
	rounds  map[uint64]*simRound
	mail    map[[2]int][]simMsg
	reconf  map[uint64]*simRdv
}

type simComm struct {
	h        libapi.Comm
	cl       *simClique
	rank     int
	dev      int
	blocking bool
	dataComm bool // split off with a blocking config of its own
	state    libapi.Result
	pending  *simPending
	seq      uint64 // collectives issued
	rseq     uint64 // Shrink/Split/Grow calls
	killed   bool   // its GPU work was terminated (abort, revoke, shrink-abort)
	revoked  bool
}

type simPending struct {
	polls int
	ready func() bool
	done  func() libapi.Result
}

// simRdv is a rendezvous of several calls (init, shrink, split, grow).
type simRdv struct {
	want     int
	arrived  map[int]any // key: rank (joiners: their new rank + 1<<20)
	complete bool
	children map[int]*simComm
}

type simMsg struct {
	dtype libapi.DataType
	data  []byte
}

type simItem interface {
	// step advances the item; it reports whether the item is complete.
	step(w *Simulation) bool
}

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

// StallCopies holds (true) or releases (false) every copy of page-locked
// memory on its stream, as a busy copy engine would.
func (w *Simulation) StallCopies(stall bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stallCopies = stall
}

// StallAborts holds (true) or releases (false) every ncclCommAbort of a
// comm on GPU dev in the call: the comm's GPU work goes on until the call
// returns. (A real abort took 0.5 s after a peer's death on 2×H200; its
// kernels are certain to have stopped only when it returns.)
func (w *Simulation) StallAborts(dev int, stall bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stallAborts[dev] = stall
	w.cond.Broadcast()
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

// Kill makes the process on GPU dev die, as by SIGKILL: its streams never
// advance again (its peers' collectives never complete), and its calls
// that wait for peers (shrink, split) never return. What it left behind
// may still be used by the test (closing its comms, say) without a fault.
func (w *Simulation) Kill(dev int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.dead[dev] = true
}

// KillDuring makes the process on GPU dev die as it calls name (e.g.
// "ncclCommShrink", "ncclCommSplit"): the call never arrives at its
// rendezvous.
func (w *Simulation) KillDuring(name string, dev int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.killOn[name] = dev + 1
}

// Killed reports whether the process on GPU dev is dead.
func (w *Simulation) Killed(dev int) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.dead[dev]
}

// Restart starts a new process on GPU dev after Kill: the dead process's
// GPU work is gone (its comms' work is terminated and everything queued
// on its streams is dropped, as the driver does when a process exits), and
// the GPU serves new comms, copies and streams. The dead process's objects
// (comms, streams, memory) stay valid for the test to close or free.
func (w *Simulation) Restart(dev int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range w.comms {
		if c.dev == dev {
			w.terminate(c)
			c.pending = nil
		}
	}
	for _, st := range w.streams {
		if st.dev != dev {
			continue
		}
		for _, it := range st.items {
			if e, ok := it.(*simEventItem); ok {
				e.step(w)
			}
		}
		st.items = nil
	}
	delete(w.dead, dev)
	for name, d := range w.killOn {
		if d == dev+1 {
			delete(w.killOn, name)
		}
	}
}

// InjectAsyncError makes every live comm on GPU dev report the
// ncclResult_t code (e.g. 6, ncclRemoteError) from ncclCommGetAsyncError.
func (w *Simulation) InjectAsyncError(dev int, code int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range w.comms {
		if c.dev == dev {
			c.state, c.pending = libapi.Result(code), nil
		}
	}
}

// ReadDevice returns a copy of the bytes of device tensor t, read directly
// from the simulated memory (no stream, no copy engine): what a test
// checks device state with.
func (w *Simulation) ReadDevice(t comm.Tensor) ([]byte, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	m, err := w.lookup(t)
	if err != nil {
		return nil, err
	}
	return slices.Clone(m), nil
}

// WriteDevice writes p into device tensor t from its start, directly into
// the simulated memory; p must not be longer than t.
func (w *Simulation) WriteDevice(t comm.Tensor, p []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	m, err := w.lookup(t)
	if err != nil {
		return err
	}
	if len(p) > len(m) {
		return fmt.Errorf("ncclsim: %w: %d bytes into a %d-byte tensor", comm.ErrInvalidArgument, len(p), len(m))
	}
	copy(m, p)
	return nil
}

// lookup returns the simulated memory of device tensor t.
func (w *Simulation) lookup(t comm.Tensor) ([]byte, error) {
	if !t.IsDevice() {
		return nil, fmt.Errorf("ncclsim: %w: %s is not a device tensor", comm.ErrInvalidArgument, t)
	}
	n, p := t.NumBytes(), t.Ptr()
	for _, a := range w.allocs {
		if a.dev == t.Device() && p >= a.base && p+uintptr(n) <= a.base+uintptr(len(a.mem)) {
			off := p - a.base
			return a.mem[off : off+uintptr(n)], nil
		}
	}
	return nil, fmt.Errorf("ncclsim: %w: %s is not allocated memory of device %d", comm.ErrInvalidArgument, t, t.Device())
}

func (w *Simulation) faultf(format string, args ...any) {
	w.faults = append(w.faults, fmt.Sprintf(format, args...))
}

// dies reports whether a call by c is made by a dead process (dying now
// if KillDuring says so); such a call stays in progress forever.
func (w *Simulation) dies(c *simComm, name string) bool {
	if w.killOn[name] == c.dev+1 {
		w.dead[c.dev] = true
	}
	if !w.dead[c.dev] {
		return false
	}
	c.pending = &simPending{ready: func() bool { return false }}
	return true
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

// mem returns the simulated device memory [p, p+n), or nil (and a fault).
func (w *Simulation) mem(p uintptr, n int, what string) []byte {
	if n == 0 {
		return []byte{}
	}
	for _, a := range w.allocs {
		if p >= a.base && p+uintptr(n) <= a.base+uintptr(len(a.mem)) {
			off := p - a.base
			return a.mem[off : off+uintptr(n)]
		}
	}
	w.faultf("%s: illegal address %#x (+%d bytes)", what, p, n)
	return nil
}

// ---- libapi.NCCL ----

func (w library) Version() int               { return w.ver }
func (w library) HasSymbol(name string) bool { return w.syms[name] }

func (w library) GetUniqueID(id *libapi.UniqueID) libapi.Result {
	if _, err := rand.Read(id[:]); err != nil {
		return libapi.SystemError
	}
	return libapi.Success
}

func (w *Simulation) newComm(cl *simClique, rank, dev int, blocking bool) *simComm {
	c := &simComm{h: libapi.Comm(w.handle()), cl: cl, rank: rank, dev: dev, blocking: blocking}
	w.comms[c.h] = c
	return c
}

// begin applies the nonblocking rules to a call on c: a call while the
// comm is in progress is a fault. It reports whether the call may go on.
func (w *Simulation) begin(c *simComm, what string) bool {
	if c.pending != nil {
		w.faultf("%s on comm %#x (rank %d) before the previous operation returned ncclSuccess", what, c.h, c.rank)
		c.state, c.pending = libapi.InvalidUsage, nil
		return false
	}
	if c.state != libapi.Success {
		return false
	}
	return true
}

// settleLater leaves c in progress for inProgressPolls polls, then until
// ready, then in done's state. A blocking comm instead waits in the call
// until ready (called with mu held).
func (w *Simulation) settleLater(c *simComm, ready func() bool, done func() libapi.Result) libapi.Result {
	if c.blocking {
		for ready != nil && !ready() {
			w.cond.Wait()
		}
		if done != nil {
			c.state = done()
		}
		return c.state
	}
	c.pending = &simPending{polls: w.inProgressPolls, ready: ready, done: done}
	return libapi.InProgress
}

func (w library) CommInitRank(dev int, out libapi.Cell, nranks int, id *libapi.UniqueID, rank int, cfg libapi.CommConfig) libapi.Result {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls["ncclCommInitRankConfig"]++
	if dev < 0 || dev >= w.nDev || rank < 0 || rank >= nranks {
		return libapi.InvalidArgument
	}
	rdv := w.inits[*id]
	if rdv == nil {
		rdv = &simRdv{want: nranks, arrived: map[int]any{}, children: map[int]*simComm{}}
		w.inits[*id] = rdv
		rdv.children[-1] = &simComm{cl: &simClique{size: nranks, members: make([]*simComm, nranks),
			rounds: map[uint64]*simRound{}, mail: map[[2]int][]simMsg{}, reconf: map[uint64]*simRdv{}}}
	}
	if rdv.want != nranks {
		w.faultf("init: rank %d says %d ranks, others %d", rank, nranks, rdv.want)
		return libapi.InvalidArgument
	}
	if _, dup := rdv.arrived[rank]; dup {
		w.faultf("init: rank %d joined twice", rank)
		return libapi.InvalidArgument
	}
	cl := rdv.children[-1].cl
	c := w.newComm(cl, rank, dev, cfg.Blocking)
	cl.members[rank] = c
	rdv.arrived[rank] = nil
	if len(rdv.arrived) == nranks {
		rdv.complete = true
	}
	w.cells[out] = c.h
	c.state = libapi.Success
	w.cond.Broadcast()
	return w.settleLater(c, func() bool { return rdv.complete }, func() libapi.Result { return libapi.Success })
}

func (w *Simulation) comm(h libapi.Comm, what string) *simComm {
	c := w.comms[h]
	if c == nil {
		w.faultf("%s: comm %#x is not a live communicator (aborted or never made)", what, h)
	}
	return c
}

func (w library) CommGetAsyncError(h libapi.Comm) (async, r libapi.Result) {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.comm(h, "ncclCommGetAsyncError")
	if c == nil {
		return 0, libapi.InvalidArgument
	}
	if p := c.pending; p != nil {
		switch {
		case p.polls > 0:
			p.polls--
			return libapi.InProgress, libapi.Success
		case p.ready != nil && !p.ready():
			return libapi.InProgress, libapi.Success
		}
		c.pending = nil
		if p.done != nil {
			c.state = p.done()
		}
	}
	return c.state, libapi.Success
}

func (w library) CommCount(h libapi.Comm) (int, libapi.Result) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if c := w.comm(h, "ncclCommCount"); c != nil {
		return c.cl.size, libapi.Success
	}
	return 0, libapi.InvalidArgument
}

func (w library) CommUserRank(h libapi.Comm) (int, libapi.Result) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if c := w.comm(h, "ncclCommUserRank"); c != nil {
		return c.rank, libapi.Success
	}
	return 0, libapi.InvalidArgument
}

// terminate completes every outstanding item of c at once (its kernels
// were killed).
func (w *Simulation) terminate(c *simComm) { c.killed = true }

func (w *Simulation) outstanding(c *simComm) bool {
	for _, s := range w.streams {
		for _, it := range s.items {
			if ci, ok := it.(*simCollItem); ok && ci.c == c {
				return true
			}
		}
	}
	return false
}

func (w library) CommAbort(h libapi.Comm) libapi.Result {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls["ncclCommAbort"]++
	c := w.comm(h, "ncclCommAbort")
	if c == nil {
		return libapi.InvalidArgument
	}
	for w.stallAborts[c.dev] {
		w.cond.Wait()
	}
	w.terminate(c)
	delete(w.comms, h)
	return libapi.Success
}

func (w library) CommRevoke(h libapi.Comm) libapi.Result {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls["ncclCommRevoke"]++
	c := w.comm(h, "ncclCommRevoke")
	if c == nil || !w.syms["ncclCommRevoke"] {
		return libapi.InvalidUsage
	}
	w.terminate(c)
	c.revoked = true
	c.pending = nil
	return w.settleLater(c, nil, func() libapi.Result { return libapi.Success })
}

func (w *Simulation) reconfRdv(c *simComm, want int) *simRdv {
	rdv := c.cl.reconf[c.rseq]
	if rdv == nil {
		rdv = &simRdv{want: want, arrived: map[int]any{}, children: map[int]*simComm{}}
		c.cl.reconf[c.rseq] = rdv
	}
	c.rseq++
	return rdv
}

func (w library) CommShrink(h libapi.Comm, exclude []int32, out libapi.Cell, flags int) libapi.Result {
	w.mu.Lock()
	defer w.mu.Unlock()
	name := "ncclCommShrink"
	if flags&libapi.ShrinkAbort != 0 {
		name = "ncclCommShrink(abort)"
	}
	w.calls[name]++
	c := w.comm(h, name)
	if c == nil || !w.syms["ncclCommShrink"] {
		return libapi.InvalidUsage
	}
	if c.pending != nil {
		w.faultf("%s on comm %#x before the previous operation returned ncclSuccess", name, h)
		return libapi.InvalidUsage
	}
	if w.dies(c, "ncclCommShrink") {
		return libapi.InProgress
	}
	if flags&libapi.ShrinkAbort != 0 {
		w.terminate(c)
	} else if w.outstanding(c) && !c.revoked {
		w.faultf("ncclCommShrink without NCCL_SHRINK_ABORT while ops are outstanding (rank %d)", c.rank)
		return libapi.InvalidUsage
	}
	ex := map[int]bool{}
	for _, e := range exclude {
		ex[int(e)] = true
	}
	rdv := w.reconfRdv(c, c.cl.size-len(ex))
	rdv.arrived[c.rank] = fmt.Sprint(exclude)
	for r, v := range rdv.arrived {
		if v != rdv.arrived[c.rank] {
			w.faultf("shrink: rank %d excludes %v, rank %d %v", c.rank, exclude, r, v)
		}
	}
	if len(rdv.arrived) == rdv.want {
		var keep []int
		for r := range c.cl.size {
			if !ex[r] {
				keep = append(keep, r)
			}
		}
		ncl := &simClique{size: len(keep), members: make([]*simComm, len(keep)), rounds: map[uint64]*simRound{},
			mail: map[[2]int][]simMsg{}, reconf: map[uint64]*simRdv{}}
		for nr, or := range keep {
			old := c.cl.members[or]
			nc := w.newComm(ncl, nr, old.dev, old.blocking)
			ncl.members[nr] = nc
			rdv.children[or] = nc
		}
		rdv.complete = true
	}
	rank := c.rank
	c.state = libapi.Success
	w.cond.Broadcast()
	// The new comm appears only when the parent's job has finished.
	return w.settleLater(c, func() bool { return rdv.complete }, func() libapi.Result {
		w.cells[out] = rdv.children[rank].h
		return libapi.Success
	})
}

func (w library) CommSplit(h libapi.Comm, color, key int, out libapi.Cell, cfg libapi.SplitConfig) libapi.Result {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls["ncclCommSplit"]++
	c := w.comm(h, "ncclCommSplit")
	if c == nil || !w.begin(c, "ncclCommSplit") {
		return libapi.InvalidUsage
	}
	if w.dies(c, "ncclCommSplit") {
		return libapi.InProgress
	}
	rdv := w.reconfRdv(c, c.cl.size)
	child := -1 // inherit
	if !cfg.Inherit {
		child = 0
		if cfg.Blocking {
			child = 1
		}
	}
	rdv.arrived[c.rank] = [3]int{color, key, child}
	if len(rdv.arrived) == rdv.want {
		byColor := map[int][]int{}
		for r, v := range rdv.arrived {
			ck := v.([3]int)
			if ck[0] >= 0 {
				byColor[ck[0]] = append(byColor[ck[0]], r)
			}
		}
		for _, ranks := range byColor {
			sort.Slice(ranks, func(i, j int) bool {
				ki, kj := rdv.arrived[ranks[i]].([3]int)[1], rdv.arrived[ranks[j]].([3]int)[1]
				if ki != kj {
					return ki < kj
				}
				return ranks[i] < ranks[j]
			})
			ncl := &simClique{size: len(ranks), members: make([]*simComm, len(ranks)), rounds: map[uint64]*simRound{},
				mail: map[[2]int][]simMsg{}, reconf: map[uint64]*simRdv{}}
			for nr, or := range ranks {
				old := c.cl.members[or]
				blocking := old.blocking
				if b := rdv.arrived[or].([3]int)[2]; b >= 0 {
					blocking = b == 1
				}
				nc := w.newComm(ncl, nr, old.dev, blocking)
				nc.dataComm = blocking && rdv.arrived[or].([3]int)[2] == 1
				ncl.members[nr] = nc
				rdv.children[or] = nc
			}
		}
		rdv.complete = true
	}
	rank := c.rank
	w.cond.Broadcast()
	return w.settleLater(c, func() bool { return rdv.complete }, func() libapi.Result {
		if nc := rdv.children[rank]; nc != nil {
			w.cells[out] = nc.h
		}
		return libapi.Success
	})
}

func (w library) CommGetUniqueID(h libapi.Comm, id *libapi.UniqueID) libapi.Result {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.comm(h, "ncclCommGetUniqueId")
	if c == nil || !w.syms["ncclCommGetUniqueId"] || !w.begin(c, "ncclCommGetUniqueId") {
		return libapi.InvalidUsage
	}
	if _, err := rand.Read(id[:]); err != nil {
		return libapi.SystemError
	}
	rdv := c.cl.reconf[c.rseq]
	if rdv == nil {
		rdv = &simRdv{arrived: map[int]any{}, children: map[int]*simComm{}}
		c.cl.reconf[c.rseq] = rdv
	}
	w.growIDs[*id] = rdv
	return libapi.Success
}

func (w library) CommGrow(dev int, h libapi.Comm, nranks int, id *libapi.UniqueID, rank int, out libapi.Cell, cfg libapi.CommConfig) libapi.Result {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls["ncclCommGrow"]++
	if !w.syms["ncclCommGrow"] {
		return libapi.InvalidUsage
	}
	var rdv *simRdv
	var c *simComm
	if h != 0 {
		if c = w.comm(h, "ncclCommGrow"); c == nil || !w.begin(c, "ncclCommGrow") {
			return libapi.InvalidUsage
		}
		rdv = w.reconfRdv(c, nranks)
		rdv.want = nranks
		rdv.arrived[c.rank] = c
		rdv.children[-2] = &simComm{cl: c.cl}
	} else {
		if rdv = w.growIDs[*id]; rdv == nil {
			w.faultf("ncclCommGrow: joiner with an unknown id")
			return libapi.InvalidArgument
		}
		rdv.want = nranks
		rdv.arrived[rank+1<<20] = dev
	}
	complete := func() {
		if rdv.complete || len(rdv.arrived) != rdv.want || rdv.children[-2] == nil {
			return
		}
		pcl := rdv.children[-2].cl
		ncl := &simClique{size: nranks, members: make([]*simComm, nranks), rounds: map[uint64]*simRound{},
			mail: map[[2]int][]simMsg{}, reconf: map[uint64]*simRdv{}}
		for k, v := range rdv.arrived {
			var nc *simComm
			if k >= 1<<20 {
				nc = w.newComm(ncl, k-1<<20, v.(int), false)
				rdv.children[k] = nc
			} else {
				old := pcl.members[k]
				nc = w.newComm(ncl, k, old.dev, old.blocking)
				rdv.children[k] = nc
			}
			ncl.members[nc.rank] = nc
		}
		rdv.complete = true
	}
	complete()
	w.cond.Broadcast()
	if c != nil {
		rank := c.rank
		return w.settleLater(c, func() bool { complete(); return rdv.complete }, func() libapi.Result {
			w.cells[out] = rdv.children[rank].h
			return libapi.Success
		})
	}
	// A joiner's comm appears in its cell when the grow completes; the test
	// world resolves that whenever the cell is read.
	w.growCells = append(w.growCells, simGrowCell{out, rdv, rank + 1<<20})
	return libapi.InProgress
}

func (w library) ErrorString(r libapi.Result) string { return "sim: " + r.String() }
func (w library) LastError(c libapi.Comm) string {
	return ""
}

func (w library) NewCell() libapi.Cell {
	w.mu.Lock()
	defer w.mu.Unlock()
	cell := libapi.Cell(w.handle())
	w.cells[cell] = 0
	return cell
}

func (w library) LoadCell(cell libapi.Cell) libapi.Comm {
	w.mu.Lock()
	defer w.mu.Unlock()
	for i, gc := range w.growCells {
		if gc.cell == cell && gc.rdv.complete {
			w.cells[cell] = gc.rdv.children[gc.key].h
			w.growCells = slices.Delete(w.growCells, i, i+1)
			break
		}
	}
	return w.cells[cell]
}

func (w library) FreeCell(cell libapi.Cell) {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.cells, cell)
}

// ---- enqueue ----

func (w library) Enqueue(dev int, h libapi.Comm, s libapi.Stream, a *libapi.CollArgs) libapi.Result {
	return w.Group(dev, h, s, []libapi.CollArgs{*a})
}

func (w library) Group(dev int, h libapi.Comm, s libapi.Stream, ops []libapi.CollArgs) libapi.Result {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, a := range ops {
		w.calls[a.Kind.String()]++
	}
	c := w.comm(h, "enqueue")
	st := w.streams[s]
	if c == nil || st == nil {
		return libapi.InvalidArgument
	}
	if c.blocking {
		w.calls["enqueue(blocking)"]++
	} else {
		w.calls["enqueue(nonblocking)"]++
	}
	if !w.begin(c, ops[0].Kind.String()) {
		return c.state
	}
	if c.revoked {
		return libapi.InvalidUsage
	}
	if st.dev != c.dev || dev != c.dev {
		w.faultf("enqueue on device %d, stream of device %d, for a comm on device %d", dev, st.dev, c.dev)
		return libapi.InvalidArgument
	}
	if c.dataComm {
		for _, a := range ops {
			if a.Kind.PointToPoint() {
				w.faultf("%s on the blocking data comm (rank %d): NCCL would connect to the peer inside the call", a.Kind, c.rank)
			}
		}
	}
	for _, a := range ops {
		switch a.Kind {
		case libapi.AllToAll, libapi.Gather, libapi.Scatter:
			if !w.syms[map[libapi.CollKind]string{libapi.AllToAll: "ncclAlltoAll", libapi.Gather: "ncclGather", libapi.Scatter: "ncclScatter"}[a.Kind]] {
				w.faultf("%s called on a library without it", a.Kind)
				return libapi.InvalidUsage
			}
		}
	}
	it := &simCollItem{c: c, ops: slices.Clone(ops)}
	st.items = append(st.items, it)
	w.cond.Broadcast() // for AwaitQueued
	return w.settleLater(c, nil, nil)
}

// ---- the stream machine ----

// simCollItem is one NCCL call or group on a stream.
type simCollItem struct {
	c       *simComm
	ops     []libapi.CollArgs
	arrived bool
	rounds  []*simRound
	got     []bool // per op: a receive has its data
}

// simRound is one collective across the ranks of a clique.
type simRound struct {
	args     []*libapi.CollArgs
	in       [][]byte
	arrived  int
	complete bool
}

// waiting reports whether the item still waits for its peers' parts (or
// has not started).
func (it *simCollItem) waiting() bool {
	if !it.arrived {
		return true
	}
	for _, r := range it.rounds {
		if !r.complete {
			return true
		}
	}
	for i, a := range it.ops {
		if a.Kind == libapi.Recv && !it.got[i] {
			return true
		}
	}
	return false
}

func (it *simCollItem) step(w *Simulation) bool {
	c := it.c
	if c.killed {
		return true
	}
	if !it.arrived {
		it.arrived = true
		it.got = make([]bool, len(it.ops))
		for i := range it.ops {
			a := &it.ops[i]
			switch a.Kind {
			case libapi.Send:
				es := a.Type.DType().Size()
				data := slices.Clone(w.mem(a.Send, int(a.Count)*es, "ncclSend"))
				key := [2]int{c.rank, int(a.Peer)}
				c.cl.mail[key] = append(c.cl.mail[key], simMsg{dtype: a.Type, data: data})
				it.got[i] = true
			case libapi.Recv:
			default:
				it.rounds = append(it.rounds, w.arrive(c, a))
			}
		}
	}
	done := true
	for _, r := range it.rounds {
		done = done && r.complete
	}
	for i := range it.ops {
		a := &it.ops[i]
		if a.Kind != libapi.Recv || it.got[i] {
			continue
		}
		key := [2]int{int(a.Peer), c.rank}
		q := c.cl.mail[key]
		if len(q) == 0 {
			done = false
			continue
		}
		m := q[0]
		c.cl.mail[key] = q[1:]
		es := a.Type.DType().Size()
		if m.dtype != a.Type || len(m.data) != int(a.Count)*es {
			w.faultf("recv from %d: %d bytes of type %d, expected %d of type %d", a.Peer, len(m.data), m.dtype, int(a.Count)*es, a.Type)
		}
		copy(w.mem(a.Recv, int(a.Count)*es, "ncclRecv"), m.data)
		it.got[i] = true
	}
	return done
}

// simInputBytes is how much of a rank's send buffer a collective reads.
func simInputBytes(a *libapi.CollArgs, rank, size int) int {
	n := int(a.Count) * a.Type.DType().Size()
	switch a.Kind {
	case libapi.ReduceScatter, libapi.AllToAll:
		return n * size
	case libapi.Scatter:
		if rank == int(a.Peer) {
			return n * size
		}
		return 0
	case libapi.Broadcast:
		if rank != int(a.Peer) {
			return 0
		}
	}
	return n
}

// arrive adds c's part of its next collective to the round and completes
// the round when every rank is there.
func (w *Simulation) arrive(c *simComm, a *libapi.CollArgs) *simRound {
	seq := c.seq
	c.seq++
	r := c.cl.rounds[seq]
	size := c.cl.size
	if r == nil {
		r = &simRound{args: make([]*libapi.CollArgs, size), in: make([][]byte, size)}
		c.cl.rounds[seq] = r
	}
	r.args[c.rank] = a
	r.in[c.rank] = slices.Clone(w.mem(a.Send, simInputBytes(a, c.rank, size), a.Kind.String()))
	r.arrived++
	if r.arrived == size {
		w.compute(r, size)
		r.complete = true
		delete(c.cl.rounds, seq)
	}
	return r
}

func (w *Simulation) compute(r *simRound, size int) {
	a0 := r.args[0]
	for i, a := range r.args {
		if a.Kind != a0.Kind || a.Count != a0.Count || a.Type != a0.Type || a.Op != a0.Op || a.Peer != a0.Peer {
			w.faultf("ranks disagree on a collective: rank 0 %+v, rank %d %+v", *a0, i, *a)
			return
		}
	}
	dt, op := a0.Type.DType(), a0.Op.ReduceOp()
	n := int(a0.Count) * dt.Size()
	root := int(a0.Peer)
	sum := func(parts [][]byte) []byte {
		acc := slices.Clone(parts[0])
		for _, p := range parts[1:] {
			reduce.Into(dt, op, acc, p)
		}
		if op == comm.Avg {
			reduce.Divide(dt, acc, size)
		}
		return acc
	}
	out := func(rank, bytes int) []byte { return w.mem(r.args[rank].Recv, bytes, a0.Kind.String()) }
	switch a0.Kind {
	case libapi.AllReduce:
		res := sum(r.in)
		for j := range size {
			copy(out(j, n), res)
		}
	case libapi.Broadcast:
		for j := range size {
			copy(out(j, n), r.in[root])
		}
	case libapi.Reduce:
		copy(out(root, n), sum(r.in))
	case libapi.AllGather:
		for j := range size {
			dst := out(j, n*size)
			for k := range size {
				copy(dst[k*n:], r.in[k])
			}
		}
	case libapi.ReduceScatter:
		res := sum(r.in)
		for j := range size {
			copy(out(j, n), res[j*n:(j+1)*n])
		}
	case libapi.AllToAll:
		for j := range size {
			dst := out(j, n*size)
			for k := range size {
				copy(dst[k*n:(k+1)*n], r.in[k][j*n:(j+1)*n])
			}
		}
	case libapi.Gather:
		dst := out(root, n*size)
		for k := range size {
			copy(dst[k*n:], r.in[k])
		}
	case libapi.Scatter:
		for j := range size {
			copy(out(j, n), r.in[root][j*n:(j+1)*n])
		}
	}
}

type simCopyItem struct {
	dst, src uintptr
	n        int
}

func (it *simCopyItem) step(w *Simulation) bool {
	if src := w.mem(it.src, it.n, "memcpy src"); src != nil {
		copy(w.mem(it.dst, it.n, "memcpy dst"), src)
	}
	return true
}

type simEventItem struct {
	ev    *simEvent
	fired bool
}

func (it *simEventItem) step(*Simulation) bool {
	it.fired = true
	if it.ev.last == it {
		it.ev.done = true
	}
	return true
}

// simWaitItem holds its stream until one record of an event has fired
// (cudaStreamWaitEvent).
type simWaitItem struct{ rec *simEventItem }

func (it *simWaitItem) step(*Simulation) bool { return it.rec.fired }

func (w *Simulation) progress(s *simStream) {
	if w.dead[s.dev] {
		return
	}
	for len(s.items) > 0 && s.items[0].step(w) {
		s.items = s.items[1:]
	}
}

// ---- libapi.CUDA ----

func (w library) RuntimeVersion() int { return 13000 }
func (w library) DriverVersion() int  { return 13000 }
func (w library) DeviceCount() (int, error) {
	return w.nDev, nil
}

func (w *Simulation) checkDev(dev int) error {
	if dev < 0 || dev >= w.nDev {
		return &libapi.CUDAError{Op: "cudaSetDevice", Code: 101, Msg: "invalid device ordinal"}
	}
	return nil
}

func (w library) Malloc(dev int, n int) (uintptr, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.checkDev(dev); err != nil {
		return 0, err
	}
	w.next = (w.next + 4095) &^ 4095
	base := w.next
	w.next += uintptr(n) + 4096
	w.allocs[base] = &simAlloc{dev: dev, base: base, mem: make([]byte, n)}
	return base, nil
}

func (w library) Free(dev int, p uintptr) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if a := w.allocs[p]; a == nil || a.dev != dev {
		w.faultf("cudaFree(%#x) of memory not allocated on device %d", p, dev)
		return &libapi.CUDAError{Op: "cudaFree", Code: 1, Msg: "invalid argument"}
	}
	for _, s := range w.streams {
		for _, it := range s.items {
			if ci, ok := it.(*simCollItem); ok && !ci.c.killed {
				for _, a := range ci.ops {
					if w.allocs[p].contains(a.Send) || w.allocs[p].contains(a.Recv) {
						w.faultf("cudaFree(%#x) while a queued NCCL op still uses it", p)
					}
				}
			}
		}
	}
	delete(w.allocs, p)
	return nil
}

func (a *simAlloc) contains(p uintptr) bool { return p >= a.base && p < a.base+uintptr(len(a.mem)) }

func (w *Simulation) stream(dev int, s libapi.Stream, what string) (*simStream, error) {
	if s == 0 {
		// The legacy default stream of dev (PyTorch's default stream is
		// this handle): a plain stream here, made on first use.
		if err := w.checkDev(dev); err != nil {
			return nil, err
		}
		if w.nullStreams == nil {
			w.nullStreams = map[int]libapi.Stream{}
		}
		h, ok := w.nullStreams[dev]
		if !ok {
			h = libapi.Stream(w.handle())
			w.streams[h] = &simStream{dev: dev}
			w.nullStreams[dev] = h
		}
		s = h
	}
	st := w.streams[s]
	if st == nil {
		w.faultf("%s: unknown stream %#x", what, s)
		return nil, &libapi.CUDAError{Op: what, Code: 400, Msg: "invalid resource handle"}
	}
	return st, nil
}

// pinnedOf returns the page-locked allocation holding b, or nil.
func (w *Simulation) pinnedOf(b []byte) *simPinned {
	if len(b) == 0 {
		return nil
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	for _, pa := range w.pinned {
		base := uintptr(unsafe.Pointer(unsafe.SliceData(pa.buf)))
		if p >= base && p+uintptr(len(b)) <= base+uintptr(len(pa.buf)) {
			return pa
		}
	}
	return nil
}

// simHostCopyItem is a copy between page-locked memory and the device, done
// by the "copy engine" when its stream is polled.
type simHostCopyItem struct {
	pin    *simPinned
	host   []byte
	dev    uintptr
	toHost bool
}

func (it *simHostCopyItem) step(w *Simulation) bool {
	if w.stallCopies {
		return false
	}
	if it.pin.freed {
		w.faultf("copy engine used page-locked memory after cudaFreeHost")
		return true
	}
	m := w.mem(it.dev, len(it.host), "cudaMemcpyAsync")
	if m == nil {
		return true
	}
	if it.toHost {
		copy(it.host, m)
	} else {
		copy(m, it.host)
	}
	return true
}

func (w library) CopyHtoD(dev int, dst uintptr, src []byte, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaMemcpyAsync")
	if err != nil {
		return err
	}
	if w.mem(dst, len(src), "cudaMemcpyAsync(HtoD)") == nil {
		return &libapi.CUDAError{Op: "cudaMemcpyAsync", Code: 1, Msg: "invalid argument"}
	}
	if pa := w.pinnedOf(src); pa != nil {
		st.items = append(st.items, &simHostCopyItem{pin: pa, host: src, dev: dst})
		return nil
	}
	copy(w.mem(dst, len(src), "cudaMemcpyAsync(HtoD)"), src) // staged at once, as CUDA does for pageable memory
	return nil
}

func (w library) CopyDtoH(dev int, dst []byte, src uintptr, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaMemcpyAsync")
	if err != nil {
		return err
	}
	if w.mem(src, len(dst), "cudaMemcpyAsync(DtoH)") == nil {
		return &libapi.CUDAError{Op: "cudaMemcpyAsync", Code: 1, Msg: "invalid argument"}
	}
	if pa := w.pinnedOf(dst); pa != nil {
		st.items = append(st.items, &simHostCopyItem{pin: pa, host: dst, dev: src, toHost: true})
		return nil
	}
	w.progress(st)
	if len(st.items) > 0 {
		w.faultf("copy to host on a busy stream")
	}
	copy(dst, w.mem(src, len(dst), "cudaMemcpyAsync(DtoH)"))
	return nil
}

func (w library) CopyDtoD(dev int, dst, src uintptr, n int, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaMemcpyAsync")
	if err != nil {
		return err
	}
	st.items = append(st.items, &simCopyItem{dst: dst, src: src, n: n})
	return nil
}

func (w library) Memset(dev int, p uintptr, v byte, n int, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, err := w.stream(dev, s, "cudaMemsetAsync"); err != nil {
		return err
	}
	m := w.mem(p, n, "cudaMemsetAsync")
	for i := range m {
		m[i] = v
	}
	return nil
}

func (w library) HostAlloc(dev int, n int) ([]byte, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.checkDev(dev); err != nil {
		return nil, err
	}
	if n <= 0 {
		w.faultf("cudaHostAlloc of %d bytes", n)
	}
	buf := make([]byte, n)
	w.pinned[unsafe.SliceData(buf)] = &simPinned{buf: buf}
	w.hostAllocs++
	return buf, nil
}

func (w library) HostFree(buf []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	pa := w.pinned[unsafe.SliceData(buf)]
	if pa == nil {
		w.faultf("cudaFreeHost of memory cudaHostAlloc did not return")
		return &libapi.CUDAError{Op: "cudaFreeHost", Code: 1, Msg: "invalid argument"}
	}
	for _, st := range w.streams {
		for _, it := range st.items {
			if hc, ok := it.(*simHostCopyItem); ok && hc.pin == pa {
				w.faultf("cudaFreeHost of page-locked memory a queued copy still uses")
			}
		}
	}
	pa.freed = true
	delete(w.pinned, unsafe.SliceData(buf))
	w.hostAllocs--
	return nil
}

func (w library) PCIBusID(dev int) (string, error) {
	if err := w.checkDev(dev); err != nil {
		return "", err
	}
	return fmt.Sprintf("0000:%02x:00.0", simBus(dev)), nil
}

func (w library) StreamCreate(dev int) (libapi.Stream, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.checkDev(dev); err != nil {
		return 0, err
	}
	s := libapi.Stream(w.handle())
	w.streams[s] = &simStream{dev: dev}
	return s, nil
}

func (w library) StreamDestroy(dev int, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaStreamDestroy")
	if err != nil {
		return err
	}
	if len(st.items) > 0 {
		w.faultf("cudaStreamDestroy of a stream with %d items still queued", len(st.items))
	}
	delete(w.streams, s)
	return nil
}

func (w library) StreamQuery(dev int, s libapi.Stream) (bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaStreamQuery")
	if err != nil {
		return false, err
	}
	w.progress(st)
	return len(st.items) == 0, nil
}

func (w library) EventCreate(dev int, timing bool) (libapi.Event, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	ev := libapi.Event(w.handle())
	w.events[ev] = &simEvent{}
	return ev, nil
}

func (w library) EventDestroy(dev int, ev libapi.Event) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.events, ev)
	return nil
}

func (w library) EventRecord(dev int, ev libapi.Event, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaEventRecord")
	if err != nil {
		return err
	}
	e := w.events[ev]
	e.done = false
	e.last = &simEventItem{ev: e}
	st.items = append(st.items, e.last)
	return nil
}

func (w library) StreamWaitEvent(dev int, s libapi.Stream, ev libapi.Event) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaStreamWaitEvent")
	if err != nil {
		return err
	}
	e := w.events[ev]
	if e == nil {
		w.faultf("cudaStreamWaitEvent: unknown event %#x", ev)
		return &libapi.CUDAError{Op: "cudaStreamWaitEvent", Code: 400, Msg: "invalid resource handle"}
	}
	if e.last != nil && !e.last.fired { // a never-recorded event is complete
		st.items = append(st.items, &simWaitItem{rec: e.last})
	}
	return nil
}

func (w library) EventQuery(ev libapi.Event) (bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, st := range w.streams {
		w.progress(st)
	}
	return w.events[ev].done, nil
}

func (w library) EventElapsed(start, end libapi.Event) (float32, error) { return 0.5, nil }
