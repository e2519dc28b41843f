package ncclsim

import (
	"slices"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

// NCCL's enqueue calls: a collective or a group is an item on the
// comm's stream; it completes once every rank's stream has reached it,
// the reduction computed on the host.

type simMsg struct {
	dtype libapi.DataType
	data  []byte
}

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
