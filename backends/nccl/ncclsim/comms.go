package ncclsim

import (
	"crypto/rand"
	"fmt"
	"slices"
	"sort"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
)

// NCCL's version and communicators: init, the async-error poll, abort, revoke,
// shrink, split and grow (each a rendezvous of its ranks), and the cells
// a nonblocking NCCL fills in later.

type simGrowCell struct {
	cell libapi.Cell
	rdv  *simRdv
	key  int
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

func (w library) Version() int { return w.ver }

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

// simShrinkArrival is one rank's ncclCommShrink: whom it excludes, and
// the config it gives its child.
type simShrinkArrival struct {
	exclude string
	cfg     libapi.ChildConfig
}

func (w library) CommShrink(h libapi.Comm, exclude []int32, out libapi.Cell, cfg libapi.ChildConfig, flags int) libapi.Result {
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
	rdv.arrived[c.rank] = simShrinkArrival{fmt.Sprint(exclude), cfg}
	for r, v := range rdv.arrived {
		if ex := v.(simShrinkArrival).exclude; ex != fmt.Sprint(exclude) {
			w.faultf("shrink: rank %d excludes %v, rank %d %v", c.rank, exclude, r, ex)
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
			blocking := old.blocking
			ccfg := rdv.arrived[or].(simShrinkArrival).cfg
			if !ccfg.Inherit {
				blocking = ccfg.Blocking
			}
			nc := w.newComm(ncl, nr, old.dev, blocking)
			nc.dataComm = blocking && !ccfg.Inherit
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

func (w library) CommSplit(h libapi.Comm, color, key int, out libapi.Cell, cfg libapi.ChildConfig) libapi.Result {
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
