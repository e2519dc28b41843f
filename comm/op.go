package comm

// opDesc is one op with its arguments, as queued and dispatched.
type opDesc struct {
	kind     OpType
	t        Tensor // the tensor of single-buffer ops; out of two-buffer ops
	in       Tensor
	op       ReduceOp
	root     int
	peer     int
	counts   []int // AllGatherV counts; AllToAllV outCounts
	inCounts []int // AllToAllV inCounts
	p2p      []P2POp
	exclude  []int  // Shrink
	size     int    // Grow
	epoch    uint64 // Shrink, Grow
	color    int    // Split
	key      int    // Split
	reconfig bool   // Shrink/Grow: allowed on a broken comm
	newComm  Backend
	// refused: why this rank refuses the op (validation, or Comm.Refuse);
	// set, the op runs in its place in the order only to tell the peers
	// (Refuser) and fails with it.
	refused error
}

// peerOp reports whether d is a collective or point-to-point op: one
// whose refusal its peers must learn of.
func (d *opDesc) peerOp() bool {
	return d.kind != OpNone && (d.kind < OpShrink || d.kind == OpReduceScatterV)
}

func (d *opDesc) dtype() DType {
	if d.t.valid {
		return d.t.dtype
	}
	if d.in.valid {
		return d.in.dtype
	}
	if len(d.p2p) > 0 {
		return d.p2p[0].Tensor.dtype
	}
	return 0
}

func (d *opDesc) count() int {
	switch {
	case d.t.valid:
		return d.t.count
	case d.in.valid:
		return d.in.count
	}
	n := 0
	for _, p := range d.p2p {
		n += p.Tensor.count
	}
	return n
}

func (d *opDesc) rootOrNone() int {
	switch d.kind {
	case OpBroadcast, OpReduce, OpScatter, OpGather:
		return d.root
	}
	return -1
}

func (d *opDesc) peerOrNone() int {
	switch d.kind {
	case OpSend, OpRecv:
		return d.peer
	}
	return -1
}

// validate checks d against the comm's rank, size and memory kind. It runs
// before an op is queued, so an invalid op never reaches the backend.
func validate(d *opDesc, rank, size int, mem Memory) error {
	checkT := func(t Tensor, name string) error {
		if err := t.check(name); err != nil {
			return err
		}
		if (mem == DeviceMemory) != t.IsDevice() {
			return invalidf("%s: %s tensor given to a %s-memory backend", name, memOf(t), mem)
		}
		return nil
	}
	checkOp := func() error {
		if !d.op.Valid() {
			return invalidf("reduce op %s is not defined", d.op)
		}
		if !d.op.Supports(d.t.dtype) {
			return invalidf("reduce op %s is not supported for dtype %s", d.op, d.t.dtype)
		}
		return nil
	}
	checkRoot := func() error {
		if d.root < 0 || d.root >= size {
			return invalidf("root %d outside [0, %d)", d.root, size)
		}
		return nil
	}
	checkPair := func(outName, inName string) error {
		if err := checkT(d.t, outName); err != nil {
			return err
		}
		if err := checkT(d.in, inName); err != nil {
			return err
		}
		if d.t.dtype != d.in.dtype {
			return invalidf("%s dtype %s differs from %s dtype %s", outName, d.t.dtype, inName, d.in.dtype)
		}
		if overlaps(d.t, d.in) && !inPlace(d, rank) {
			return invalidf("%s and %s overlap", outName, inName)
		}
		return nil
	}
	checkCounts := func(counts []int, name string) (int, error) {
		if len(counts) != size {
			return 0, invalidf("%s has %d entries, want one per rank (%d)", name, len(counts), size)
		}
		sum := 0
		for r, c := range counts {
			if c < 0 {
				return 0, invalidf("%s[%d] = %d is negative", name, r, c)
			}
			sum += c
		}
		return sum, nil
	}

	switch d.kind {
	case OpAllReduce:
		if err := checkT(d.t, "tensor"); err != nil {
			return err
		}
		return checkOp()
	case OpReduce:
		if err := checkT(d.t, "tensor"); err != nil {
			return err
		}
		if err := checkOp(); err != nil {
			return err
		}
		return checkRoot()
	case OpBroadcast:
		if err := checkT(d.t, "tensor"); err != nil {
			return err
		}
		return checkRoot()
	case OpReduceScatter:
		if err := checkPair("out", "in"); err != nil {
			return err
		}
		if err := checkOp(); err != nil {
			return err
		}
		if d.in.count != d.t.count*size {
			return invalidf("in has %d elements, want out's %d × size %d = %d", d.in.count, d.t.count, size, d.t.count*size)
		}
	case OpReduceScatterV:
		if err := checkPair("out", "in"); err != nil {
			return err
		}
		if err := checkOp(); err != nil {
			return err
		}
		sum, err := checkCounts(d.counts, "counts")
		if err != nil {
			return err
		}
		if d.counts[rank] != d.t.count {
			return invalidf("counts[%d] = %d but out has %d elements", rank, d.counts[rank], d.t.count)
		}
		if sum != d.in.count {
			return invalidf("in has %d elements, want sum(counts) = %d", d.in.count, sum)
		}
	case OpAllGather:
		if err := checkPair("out", "in"); err != nil {
			return err
		}
		if d.t.count != d.in.count*size {
			return invalidf("out has %d elements, want in's %d × size %d = %d", d.t.count, d.in.count, size, d.in.count*size)
		}
	case OpAllGatherV:
		if err := checkPair("out", "in"); err != nil {
			return err
		}
		sum, err := checkCounts(d.counts, "counts")
		if err != nil {
			return err
		}
		if d.counts[rank] != d.in.count {
			return invalidf("counts[%d] = %d but in has %d elements", rank, d.counts[rank], d.in.count)
		}
		if sum != d.t.count {
			return invalidf("out has %d elements, want sum(counts) = %d", d.t.count, sum)
		}
	case OpScatter, OpGather:
		if err := checkRoot(); err != nil {
			return err
		}
		small, big, smallName, bigName := d.t, d.in, "out", "in"
		if d.kind == OpGather {
			small, big, smallName, bigName = d.in, d.t, "in", "out"
		}
		if err := checkT(small, smallName); err != nil {
			return err
		}
		if rank != d.root {
			return nil // the root-side buffer is ignored off root
		}
		if err := checkPair("out", "in"); err != nil {
			return err
		}
		if big.count != small.count*size {
			return invalidf("%s has %d elements, want %s's %d × size %d = %d", bigName, big.count, smallName, small.count, size, small.count*size)
		}
	case OpAllToAll:
		if err := checkPair("out", "in"); err != nil {
			return err
		}
		if d.t.count != d.in.count {
			return invalidf("out has %d elements, in has %d; they must be equal", d.t.count, d.in.count)
		}
		if d.in.count%size != 0 {
			return invalidf("in has %d elements, not divisible by size %d", d.in.count, size)
		}
	case OpAllToAllV:
		if err := checkPair("out", "in"); err != nil {
			return err
		}
		outSum, err := checkCounts(d.counts, "outCounts")
		if err != nil {
			return err
		}
		inSum, err := checkCounts(d.inCounts, "inCounts")
		if err != nil {
			return err
		}
		if outSum != d.t.count {
			return invalidf("out has %d elements, want sum(outCounts) = %d", d.t.count, outSum)
		}
		if inSum != d.in.count {
			return invalidf("in has %d elements, want sum(inCounts) = %d", d.in.count, inSum)
		}
	case OpBarrier:
	case OpSend, OpRecv:
		if err := checkT(d.t, "tensor"); err != nil {
			return err
		}
		return checkPeer(d.peer, rank, size)
	case OpBatchP2P:
		if len(d.p2p) == 0 {
			return invalidf("batch is empty")
		}
		for i, p := range d.p2p {
			if p.Kind != P2PSend && p.Kind != P2PRecv {
				return invalidf("batch[%d]: kind %d is neither send nor receive", i, p.Kind)
			}
			if err := checkT(p.Tensor, "batch tensor"); err != nil {
				return invalidf("batch[%d]: %w", i, err)
			}
			if err := checkPeer(p.Peer, rank, size); err != nil {
				return invalidf("batch[%d]: %w", i, err)
			}
			if p.Kind == P2PRecv {
				for j, q := range d.p2p {
					if j != i && overlaps(p.Tensor, q.Tensor) {
						return invalidf("batch[%d] receives into memory that batch[%d] also uses", i, j)
					}
				}
			}
		}
	case OpShrink:
		if err := checkExclude(d.exclude, rank, size); err != nil {
			return err
		}
		if len(d.exclude) >= size {
			return invalidf("shrink: excluding %d of %d ranks leaves none", len(d.exclude), size)
		}
	case OpGrow:
		if d.size <= size {
			return invalidf("grow: new size %d is not larger than %d", d.size, size)
		}
	case OpSplit:
		if d.color < NoColor {
			return invalidf("split: color %d is negative (use NoColor to opt out)", d.color)
		}
	default:
		return invalidf("unknown op %s", d.kind)
	}
	return nil
}

// inPlace reports whether d is an in-place all-gather (in is exactly block
// rank of out) or reduce-scatter (out is exactly block rank of in), the
// only overlaps allowed: NCCL runs them in place, and FSDP2 relies on it.
func inPlace(d *opDesc, rank int) bool {
	es := uintptr(d.t.dtype.Size())
	switch d.kind {
	case OpAllGather:
		return d.in.Ptr() == d.t.Ptr()+uintptr(rank*d.in.count)*es
	case OpReduceScatter:
		return d.in.Ptr() == d.t.Ptr()-uintptr(rank*d.t.count)*es
	}
	return false
}

func checkPeer(peer, rank, size int) error {
	if peer < 0 || peer >= size {
		return invalidf("peer %d outside [0, %d)", peer, size)
	}
	if peer == rank {
		return invalidf("peer %d is this rank", peer)
	}
	return nil
}

func memOf(t Tensor) Memory {
	if t.IsDevice() {
		return DeviceMemory
	}
	return HostMemory
}
