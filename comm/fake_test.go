package comm_test

import (
	"context"
	"fmt"
	"sync"

	"github.com/ftcomm/ftcomm/comm"
)

// fake is a one-process Backend whose ops do nothing but record their order
// and, when gated, block until released, aborted or their ctx ends. It lets
// tests drive the Comm wrapper deterministically.
type fake struct {
	rank, size int
	epoch      uint64

	mu       sync.Mutex
	order    []comm.OpType
	gate     chan struct{}    // when non-nil, ops wait for it to close
	started  chan comm.OpType // receives each op as it starts (if non-nil)
	failNext error            // returned by the next op
	after    int              // when this many ops have run, reached is closed
	reached  chan struct{}
	abort    chan struct{}
	abortErr error
	revoked  int
	closed   int
}

func newFake(rank, size int) *fake {
	return &fake{rank: rank, size: size, abort: make(chan struct{})}
}

func (f *fake) Name() string        { return "fake" }
func (f *fake) Rank() int           { return f.rank }
func (f *fake) Size() int           { return f.size }
func (f *fake) Epoch() uint64       { return f.epoch }
func (f *fake) Memory() comm.Memory { return comm.HostMemory }

func (f *fake) run(ctx context.Context, op comm.OpType) error {
	f.mu.Lock()
	f.order = append(f.order, op)
	if f.reached != nil && len(f.order) == f.after {
		close(f.reached)
	}
	gate, started, fail := f.gate, f.started, f.failNext
	f.failNext = nil
	f.mu.Unlock()
	if started != nil {
		started <- op
	}
	if fail != nil {
		return fail
	}
	if gate == nil {
		select {
		case <-f.abort:
			return f.abortErr
		default:
			return nil
		}
	}
	select {
	case <-gate:
		return nil
	case <-f.abort:
		return f.abortErr
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (f *fake) ops() []comm.OpType {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]comm.OpType(nil), f.order...)
}

func (f *fake) AllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) error {
	return f.run(ctx, comm.OpAllReduce)
}
func (f *fake) ReduceScatter(ctx context.Context, out, in comm.Tensor, op comm.ReduceOp) error {
	return f.run(ctx, comm.OpReduceScatter)
}
func (f *fake) ReduceScatterV(ctx context.Context, out, in comm.Tensor, counts []int, op comm.ReduceOp) error {
	return f.run(ctx, comm.OpReduceScatterV)
}
func (f *fake) AllGather(ctx context.Context, out, in comm.Tensor) error {
	return f.run(ctx, comm.OpAllGather)
}
func (f *fake) AllGatherV(ctx context.Context, out, in comm.Tensor, counts []int) error {
	return f.run(ctx, comm.OpAllGatherV)
}
func (f *fake) Broadcast(ctx context.Context, t comm.Tensor, root int) error {
	return f.run(ctx, comm.OpBroadcast)
}
func (f *fake) Reduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp, root int) error {
	return f.run(ctx, comm.OpReduce)
}
func (f *fake) Scatter(ctx context.Context, out, in comm.Tensor, root int) error {
	return f.run(ctx, comm.OpScatter)
}
func (f *fake) Gather(ctx context.Context, out, in comm.Tensor, root int) error {
	return f.run(ctx, comm.OpGather)
}
func (f *fake) AllToAll(ctx context.Context, out, in comm.Tensor) error {
	return f.run(ctx, comm.OpAllToAll)
}
func (f *fake) AllToAllV(ctx context.Context, out comm.Tensor, oc []int, in comm.Tensor, ic []int) error {
	return f.run(ctx, comm.OpAllToAllV)
}
func (f *fake) Barrier(ctx context.Context) error { return f.run(ctx, comm.OpBarrier) }
func (f *fake) Send(ctx context.Context, t comm.Tensor, peer int) error {
	return f.run(ctx, comm.OpSend)
}
func (f *fake) Recv(ctx context.Context, t comm.Tensor, peer int) error {
	return f.run(ctx, comm.OpRecv)
}
func (f *fake) BatchP2P(ctx context.Context, ops []comm.P2POp) error {
	return f.run(ctx, comm.OpBatchP2P)
}

func (f *fake) Abort(cause error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	select {
	case <-f.abort:
	default:
		f.abortErr = fmt.Errorf("fake aborted: %w", cause)
		close(f.abort)
	}
}

func (f *fake) Close() error {
	f.mu.Lock()
	f.closed++
	f.mu.Unlock()
	f.Abort(comm.ErrClosed)
	return nil
}

// revoker adds in-band revocation to fake.
type revoker struct{ *fake }

func (r revoker) Revoke(cause error) {
	r.mu.Lock()
	r.revoked++
	r.mu.Unlock()
	r.fake.Abort(fmt.Errorf("%w: %w", comm.ErrRevoked, cause))
}

// watcher is a fake that declares it watches its ops' ctx (it does: a
// gated op returns when its ctx ends).
type watcher struct{ *fake }

func (watcher) WatchesCtx() bool { return true }

// shrinker adds Shrink to fake: the new backend is a fresh fake.
type shrinker struct{ *fake }

func (s shrinker) Shrink(ctx context.Context, exclude []int, epoch uint64) (comm.Backend, error) {
	s.mu.Lock()
	s.order = append(s.order, comm.OpShrink)
	s.mu.Unlock()
	nf := newFake(s.rank-countBelow(exclude, s.rank), s.size-len(exclude))
	nf.epoch = epoch
	return nf, nil
}

func countBelow(xs []int, r int) int {
	n := 0
	for _, x := range xs {
		if x < r {
			n++
		}
	}
	return n
}

// refuser adds Refuse to fake: it records each refused op in the order
// (as OpNone) with its kind and reason, and fails it if failRefuse is set.
// When hold is non-nil, Refuse closes holding and waits for hold to close
// (it returns nil) or for an abort (it returns the abort's error); heldErr
// is what it returned.
type refuser struct {
	*fake
	refused    []comm.Op
	reasons    []error
	failRefuse error
	hold       chan struct{}
	holding    chan struct{}
	heldErr    error
}

func (r *refuser) Refuse(ctx context.Context, op comm.Op, reason error) error {
	r.mu.Lock()
	r.order = append(r.order, comm.OpNone)
	r.refused = append(r.refused, op)
	r.reasons = append(r.reasons, reason)
	fail, hold, abort := r.failRefuse, r.hold, r.abort
	r.mu.Unlock()
	if fail != nil {
		r.fake.Abort(fail)
		return fail
	}
	if hold == nil {
		return nil
	}
	close(r.holding)
	var err error
	select {
	case <-hold:
	case <-abort:
		r.mu.Lock()
		err = r.abortErr
		r.mu.Unlock()
	}
	r.mu.Lock()
	r.heldErr = err
	r.mu.Unlock()
	return err
}
