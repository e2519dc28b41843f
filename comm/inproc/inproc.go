package inproc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

func init() {
	comm.Register("inproc", func(ctx context.Context, o comm.Options) (comm.Backend, error) {
		cl, ok := o.BackendConfig.(*Cluster)
		if !ok || cl == nil {
			return nil, fmt.Errorf("%w: inproc: Options.BackendConfig must be an *inproc.Cluster", comm.ErrInvalidArgument)
		}
		return cl.Join(ctx, o.Prefix, o.Epoch, o.Rank, o.Size)
	})
}

// Cluster is the shared world of in-process ranks.
type Cluster struct {
	mu     sync.Mutex
	hubs   map[hubKey]*hub
	joined chan struct{} // closed and replaced whenever a rank joins a comm
}

type hubKey struct {
	prefix string
	epoch  uint64
}

// NewCluster returns an empty Cluster.
func NewCluster() *Cluster { return &Cluster{hubs: map[hubKey]*hub{}, joined: make(chan struct{})} }

// AwaitJoined waits until n ranks have joined one comm named prefix (of
// any epoch) or ctx is done. Tests use it to act while ranks wait for
// their peers in Join.
func (cl *Cluster) AwaitJoined(ctx context.Context, prefix string, n int) error {
	for {
		cl.mu.Lock()
		var hubs []*hub
		for k, h := range cl.hubs {
			if k.prefix == prefix {
				hubs = append(hubs, h)
			}
		}
		ch := cl.joined
		cl.mu.Unlock()
		for _, h := range hubs {
			h.mu.Lock()
			got := h.nJoined
			h.mu.Unlock()
			if got >= n {
				return nil
			}
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("inproc: await %d joined %s: %w", n, prefix, context.Cause(ctx))
		}
	}
}

func (cl *Cluster) hub(prefix string, epoch uint64, size int) (*hub, error) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	k := hubKey{prefix, epoch}
	h, ok := cl.hubs[k]
	if !ok {
		h = &hub{cl: cl, key: k, size: size, rounds: map[uint64]*round{}, joined: make([]bool, size),
			dead: make([]bool, size), left: make([]bool, size), boxes: map[[2]int]*mailbox{}, change: make(chan struct{})}
		cl.hubs[k] = h
	}
	if h.size != size {
		return nil, fmt.Errorf("%w: inproc: %s epoch %d has size %d, not %d", comm.ErrMismatch, prefix, epoch, h.size, size)
	}
	return h, nil
}

// Join creates rank's backend in the comm (prefix, epoch, size), waiting
// until all size ranks have joined or ctx is done.
func (cl *Cluster) Join(ctx context.Context, prefix string, epoch uint64, rank, size int) (*Backend, error) {
	h, err := cl.hub(prefix, epoch, size)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	if h.joined[rank] {
		h.mu.Unlock()
		return nil, fmt.Errorf("%w: inproc: rank %d joined %s epoch %d twice", comm.ErrInvalidArgument, rank, prefix, epoch)
	}
	h.joined[rank] = true
	h.nJoined++
	h.broadcastLocked()
	cl.mu.Lock() // after h.mu: the only order the two are taken in
	close(cl.joined)
	cl.joined = make(chan struct{})
	cl.mu.Unlock()
	for h.nJoined < size {
		ch := h.change
		h.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			err := fmt.Errorf("inproc: join %s epoch %d: %w", prefix, epoch, context.Cause(ctx))
			return nil, errors.Join(err, h.absent(ctx))
		}
		h.mu.Lock()
	}
	h.mu.Unlock()
	return &Backend{h: h, rank: rank, abort: make(chan struct{})}, nil
}

// absent names the ranks that never joined, when ctx ended by its
// deadline (not when it was cancelled: then nobody is to blame), as gloo
// does: a *comm.RankError wrapping comm.ErrPeerFailed each.
func (h *hub) absent(ctx context.Context) error {
	if !errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	var errs []error
	for r, ok := range h.joined {
		if !ok {
			errs = append(errs, &comm.RankError{Rank: r, Epoch: h.key.epoch,
				Err: fmt.Errorf("inproc: %w: rank %d never joined", comm.ErrPeerFailed, r)})
		}
	}
	return errors.Join(errs...)
}

// hub is one comm: its ranks, their pending rounds and mailboxes.
type hub struct {
	cl      *Cluster
	key     hubKey
	size    int
	mu      sync.Mutex
	change  chan struct{} // closed and replaced on every state change
	joined  []bool
	nJoined int
	dead    []bool
	left    []bool // closed its comm: ops that still need it fail, as gloo's do
	revoked error
	rounds  map[uint64]*round
	boxes   map[[2]int]*mailbox
}

func (h *hub) broadcastLocked() {
	close(h.change)
	h.change = make(chan struct{})
}

// round is one collective: each rank's header and input, once all arrive.
type round struct {
	hdr    []header
	data   [][]byte
	extra  [][]int
	posted int
	read   int
}

type header struct {
	op    comm.OpType
	dtype comm.DType
	count int
	rop   comm.ReduceOp
	root  int
}

type mailbox struct{ msgs [][]byte }

// Backend is one rank of an in-process comm.
type Backend struct {
	h         *hub
	rank      int
	seq       uint64
	abortOnce sync.Once
	abort     chan struct{}
	abortErr  error
}

var _ comm.Backend = (*Backend)(nil)

var (
	_ comm.Backend  = (*Backend)(nil)
	_ comm.Shrinker = (*Backend)(nil)
	_ comm.Grower   = (*Backend)(nil)
	_ comm.Splitter = (*Backend)(nil)
	_ comm.Revoker  = (*Backend)(nil)
)

func (b *Backend) Name() string        { return "inproc" }
func (b *Backend) Rank() int           { return b.rank }
func (b *Backend) Size() int           { return b.h.size }
func (b *Backend) Epoch() uint64       { return b.h.key.epoch }
func (b *Backend) Memory() comm.Memory { return comm.HostMemory }

// Fail simulates this rank's death: every peer's pending and later op that
// needs it fails with comm.ErrPeerFailed naming this rank.
func (b *Backend) Fail() {
	b.h.mu.Lock()
	b.h.dead[b.rank] = true
	b.h.broadcastLocked()
	b.h.mu.Unlock()
	b.Abort(fmt.Errorf("inproc: rank %d failed", b.rank))
}

// Abort implements comm.Backend.
func (b *Backend) Abort(cause error) {
	b.abortOnce.Do(func() {
		b.abortErr = fmt.Errorf("%w: %w", comm.ErrAborted, cause)
		close(b.abort)
	})
}

// Revoke implements comm.Revoker: every rank's pending and later ops fail.
func (b *Backend) Revoke(cause error) {
	b.h.mu.Lock()
	if b.h.revoked == nil {
		b.h.revoked = fmt.Errorf("%w by rank %d: %w", comm.ErrRevoked, b.rank, cause)
		b.h.broadcastLocked()
	}
	b.h.mu.Unlock()
}

// Close implements comm.Backend. A peer's op that still needs this rank
// fails with comm.ErrPeerFailed naming it, as gloo's does when a peer
// closes its connections.
func (b *Backend) Close() error {
	b.h.mu.Lock()
	b.h.left[b.rank] = true
	b.h.broadcastLocked()
	b.h.mu.Unlock()
	b.Abort(comm.ErrClosed)
	return nil
}

// wait blocks until cond (checked under h.mu) holds, or fails. It returns
// with h.mu held on success.
func (b *Backend) wait(ctx context.Context, op comm.OpType, need func() (bool, int)) error {
	h := b.h
	h.mu.Lock()
	for {
		if h.revoked != nil {
			h.mu.Unlock()
			return h.revoked
		}
		ok, missing := need()
		if ok {
			return nil
		}
		if missing >= 0 && h.dead[missing] {
			h.mu.Unlock()
			return &comm.RankError{Rank: missing, Op: op, Epoch: h.key.epoch, Err: comm.ErrPeerFailed}
		}
		if missing >= 0 && h.left[missing] {
			h.mu.Unlock()
			return &comm.RankError{Rank: missing, Op: op, Epoch: h.key.epoch,
				Err: fmt.Errorf("inproc: %w: rank %d: %w", comm.ErrPeerFailed, missing, comm.ErrPeerClosed)}
		}
		ch := h.change
		h.mu.Unlock()
		select {
		case <-ch:
		case <-b.abort:
			return b.abortErr
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		h.mu.Lock()
	}
}

// exchange posts this rank's header and input for the next collective and
// returns everyone's, once all have posted. The first rank whose header
// differs from rank 0's makes the round fail with ErrMismatch on every rank.
func (b *Backend) exchange(ctx context.Context, hd header, in []byte, extra []int) (*round, error) {
	if err := b.aborted(); err != nil {
		return nil, err
	}
	h := b.h
	b.seq++
	seq := b.seq
	h.mu.Lock()
	r := h.rounds[seq]
	if r == nil {
		r = &round{hdr: make([]header, h.size), data: make([][]byte, h.size), extra: make([][]int, h.size)}
		h.rounds[seq] = r
	}
	r.hdr[b.rank], r.data[b.rank], r.extra[b.rank] = hd, bytes.Clone(in), extra
	r.posted++
	h.broadcastLocked()
	h.mu.Unlock()
	err := b.wait(ctx, hd.op, func() (bool, int) {
		if r.posted == h.size {
			return true, -1
		}
		missing := -1
		for i, hd := range r.hdr {
			if hd.op == comm.OpNone && (missing < 0 || h.dead[i] || h.left[i]) {
				missing = i
			}
		}
		return false, missing
	})
	if err != nil {
		return nil, err
	}
	r.read++
	if r.read == h.size {
		delete(h.rounds, seq)
	}
	h.mu.Unlock()
	for i, o := range r.hdr {
		if o.op != hd.op || o.dtype != hd.dtype || o.rop != hd.rop || o.root != hd.root ||
			(o.count != hd.count && hd.op != comm.OpAllGatherV && hd.op != comm.OpAllToAllV && hd.op != comm.OpBarrier) {
			return nil, &comm.RankError{Rank: i, Op: hd.op, Epoch: h.key.epoch,
				Err: fmt.Errorf("%w: rank %d issued %s %s[%d] %s root %d, rank %d issued %s %s[%d] %s root %d",
					comm.ErrMismatch, b.rank, hd.op, hd.dtype, hd.count, hd.rop, hd.root, i, o.op, o.dtype, o.count, o.rop, o.root)}
		}
	}
	return r, nil
}

func (b *Backend) aborted() error {
	select {
	case <-b.abort:
		return b.abortErr
	default:
		return nil
	}
}

func reduceAll(r *round, dt comm.DType, op comm.ReduceOp, n int) []byte {
	acc := bytes.Clone(r.data[0])
	for i := 1; i < len(r.data); i++ {
		reduce.Into(dt, op, acc, r.data[i])
	}
	if op == comm.Avg {
		reduce.Divide(dt, acc, n)
	}
	return acc
}

func (b *Backend) AllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) error {
	r, err := b.exchange(ctx, header{op: comm.OpAllReduce, dtype: t.DType(), count: t.Count(), rop: op}, t.Bytes(), nil)
	if err != nil {
		return err
	}
	copy(t.Bytes(), reduceAll(r, t.DType(), op, b.h.size))
	return nil
}

func (b *Backend) ReduceScatter(ctx context.Context, out, in comm.Tensor, op comm.ReduceOp) error {
	r, err := b.exchange(ctx, header{op: comm.OpReduceScatter, dtype: in.DType(), count: in.Count(), rop: op}, in.Bytes(), nil)
	if err != nil {
		return err
	}
	n := out.NumBytes()
	copy(out.Bytes(), reduceAll(r, in.DType(), op, b.h.size)[b.rank*n:(b.rank+1)*n])
	return nil
}

func (b *Backend) ReduceScatterV(ctx context.Context, out, in comm.Tensor, counts []int, op comm.ReduceOp) error {
	r, err := b.exchange(ctx, header{op: comm.OpReduceScatterV, dtype: in.DType(), count: in.Count(), rop: op}, in.Bytes(), counts)
	if err != nil {
		return err
	}
	if err := b.agree(r, comm.OpReduceScatterV, "counts"); err != nil {
		return err
	}
	es, off := in.DType().Size(), 0
	for _, c := range counts[:b.rank] {
		off += c * es
	}
	copy(out.Bytes(), reduceAll(r, in.DType(), op, b.h.size)[off:off+out.NumBytes()])
	return nil
}

func (b *Backend) AllGather(ctx context.Context, out, in comm.Tensor) error {
	r, err := b.exchange(ctx, header{op: comm.OpAllGather, dtype: in.DType(), count: in.Count()}, in.Bytes(), nil)
	if err != nil {
		return err
	}
	copy(out.Bytes(), bytes.Join(r.data, nil))
	return nil
}

func (b *Backend) AllGatherV(ctx context.Context, out, in comm.Tensor, counts []int) error {
	r, err := b.exchange(ctx, header{op: comm.OpAllGatherV, dtype: in.DType(), count: in.Count()}, in.Bytes(), counts)
	if err != nil {
		return err
	}
	if err := b.agree(r, comm.OpAllGatherV, "counts"); err != nil {
		return err
	}
	copy(out.Bytes(), bytes.Join(r.data, nil))
	return nil
}

// agree checks that every rank passed the same count vector.
func (b *Backend) agree(r *round, op comm.OpType, what string) error {
	for i, e := range r.extra {
		if !slices.Equal(e, r.extra[b.rank]) {
			return &comm.RankError{Rank: i, Op: op, Epoch: b.h.key.epoch,
				Err: fmt.Errorf("%w: %s %v here, %v at rank %d", comm.ErrMismatch, what, r.extra[b.rank], e, i)}
		}
	}
	return nil
}

func (b *Backend) Broadcast(ctx context.Context, t comm.Tensor, root int) error {
	r, err := b.exchange(ctx, header{op: comm.OpBroadcast, dtype: t.DType(), count: t.Count(), root: root}, t.Bytes(), nil)
	if err != nil {
		return err
	}
	copy(t.Bytes(), r.data[root])
	return nil
}

func (b *Backend) Reduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp, root int) error {
	r, err := b.exchange(ctx, header{op: comm.OpReduce, dtype: t.DType(), count: t.Count(), rop: op, root: root}, t.Bytes(), nil)
	if err != nil {
		return err
	}
	if b.rank == root {
		copy(t.Bytes(), reduceAll(r, t.DType(), op, b.h.size))
	}
	return nil
}

func (b *Backend) Scatter(ctx context.Context, out, in comm.Tensor, root int) error {
	var data []byte
	if b.rank == root {
		data = in.Bytes()
	}
	r, err := b.exchange(ctx, header{op: comm.OpScatter, dtype: out.DType(), count: out.Count(), root: root}, data, nil)
	if err != nil {
		return err
	}
	n := out.NumBytes()
	copy(out.Bytes(), r.data[root][b.rank*n:(b.rank+1)*n])
	return nil
}

func (b *Backend) Gather(ctx context.Context, out, in comm.Tensor, root int) error {
	r, err := b.exchange(ctx, header{op: comm.OpGather, dtype: in.DType(), count: in.Count(), root: root}, in.Bytes(), nil)
	if err != nil {
		return err
	}
	if b.rank == root {
		copy(out.Bytes(), bytes.Join(r.data, nil))
	}
	return nil
}

func (b *Backend) AllToAll(ctx context.Context, out, in comm.Tensor) error {
	r, err := b.exchange(ctx, header{op: comm.OpAllToAll, dtype: in.DType(), count: in.Count()}, in.Bytes(), nil)
	if err != nil {
		return err
	}
	n := in.NumBytes() / b.h.size
	o := out.Bytes()
	for p := range b.h.size {
		copy(o[p*n:(p+1)*n], r.data[p][b.rank*n:(b.rank+1)*n])
	}
	return nil
}

func (b *Backend) AllToAllV(ctx context.Context, out comm.Tensor, outCounts []int, in comm.Tensor, inCounts []int) error {
	r, err := b.exchange(ctx, header{op: comm.OpAllToAllV, dtype: in.DType(), count: in.Count()}, in.Bytes(), inCounts)
	if err != nil {
		return err
	}
	es := in.DType().Size()
	o := out.Bytes()
	off := 0
	for p := range b.h.size {
		pin := r.extra[p]
		start := 0
		for q := range b.rank {
			start += pin[q]
		}
		if pin[b.rank] != outCounts[p] {
			return &comm.RankError{Rank: p, Op: comm.OpAllToAllV, Epoch: b.h.key.epoch,
				Err: fmt.Errorf("%w: rank %d sends %d elements here, outCounts[%d] = %d", comm.ErrMismatch, p, pin[b.rank], p, outCounts[p])}
		}
		copy(o[off*es:(off+outCounts[p])*es], r.data[p][start*es:(start+pin[b.rank])*es])
		off += outCounts[p]
	}
	return nil
}

func (b *Backend) Barrier(ctx context.Context) error {
	_, err := b.exchange(ctx, header{op: comm.OpBarrier}, nil, nil)
	return err
}

func (b *Backend) box(src, dst int) *mailbox {
	k := [2]int{src, dst}
	m := b.h.boxes[k]
	if m == nil {
		m = &mailbox{}
		b.h.boxes[k] = m
	}
	return m
}

func (b *Backend) Send(ctx context.Context, t comm.Tensor, peer int) error {
	if err := b.aborted(); err != nil {
		return err
	}
	h := b.h
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.revoked != nil {
		return h.revoked
	}
	if h.dead[peer] {
		return &comm.RankError{Rank: peer, Op: comm.OpSend, Epoch: h.key.epoch, Err: comm.ErrPeerFailed}
	}
	m := b.box(b.rank, peer)
	m.msgs = append(m.msgs, bytes.Clone(t.Bytes()))
	h.broadcastLocked()
	return nil
}

func (b *Backend) Recv(ctx context.Context, t comm.Tensor, peer int) error {
	m := func() *mailbox { b.h.mu.Lock(); defer b.h.mu.Unlock(); return b.box(peer, b.rank) }()
	if err := b.wait(ctx, comm.OpRecv, func() (bool, int) { return len(m.msgs) > 0, peer }); err != nil {
		return err
	}
	msg := m.msgs[0]
	m.msgs = m.msgs[1:]
	b.h.mu.Unlock()
	if len(msg) != t.NumBytes() {
		return &comm.RankError{Rank: peer, Op: comm.OpRecv, Epoch: b.h.key.epoch,
			Err: fmt.Errorf("%w: rank %d sent %d bytes, receive buffer holds %d", comm.ErrMismatch, peer, len(msg), t.NumBytes())}
	}
	copy(t.Bytes(), msg)
	return nil
}

func (b *Backend) BatchP2P(ctx context.Context, ops []comm.P2POp) error {
	for _, o := range ops { // sends are eager, so posting them all first cannot deadlock
		if o.Kind == comm.P2PSend {
			if err := b.Send(ctx, o.Tensor, o.Peer); err != nil {
				return err
			}
		}
	}
	for _, o := range ops {
		if o.Kind == comm.P2PRecv {
			if err := b.Recv(ctx, o.Tensor, o.Peer); err != nil {
				return err
			}
		}
	}
	return nil
}

// movedOn tells this comm's other ranks that this one posts nothing more
// on it (it is shrinking or growing into a new epoch): a peer still in an
// op that waits for it fails at once with ErrPeerClosed, as gloo's peers
// do when its links are handed to the new comm, instead of waiting out
// the op's timeout while this rank waits for it in the new epoch.
func (b *Backend) movedOn() {
	b.h.mu.Lock()
	b.h.left[b.rank] = true
	b.h.broadcastLocked()
	b.h.mu.Unlock()
}

// Shrink implements comm.Shrinker.
func (b *Backend) Shrink(ctx context.Context, exclude []int, epoch uint64) (comm.Backend, error) {
	b.movedOn()
	newRank := b.rank
	for _, x := range exclude {
		if x < b.rank {
			newRank--
		}
	}
	return b.h.cl.Join(ctx, b.h.key.prefix, epoch, newRank, b.h.size-len(exclude))
}

// Grow implements comm.Grower.
func (b *Backend) Grow(ctx context.Context, size int, epoch uint64) (comm.Backend, error) {
	b.movedOn()
	return b.h.cl.Join(ctx, b.h.key.prefix, epoch, b.rank, size)
}

// Split implements comm.Splitter.
func (b *Backend) Split(ctx context.Context, color, key int) (comm.Backend, error) {
	r, err := b.exchange(ctx, header{op: comm.OpSplit}, nil, []int{color, key})
	if err != nil {
		return nil, err
	}
	if color == comm.NoColor {
		return nil, nil
	}
	type member struct{ key, rank int }
	var ms []member
	for p, e := range r.extra {
		if e[0] == color {
			ms = append(ms, member{e[1], p})
		}
	}
	sort.Slice(ms, func(i, j int) bool {
		if ms[i].key != ms[j].key {
			return ms[i].key < ms[j].key
		}
		return ms[i].rank < ms[j].rank
	})
	newRank := slices.IndexFunc(ms, func(m member) bool { return m.rank == b.rank })
	prefix := fmt.Sprintf("%s/split%d/color%d", b.h.key.prefix, b.seq, color)
	return b.h.cl.Join(ctx, prefix, b.h.key.epoch, newRank, len(ms))
}
