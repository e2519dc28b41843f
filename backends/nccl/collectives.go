package nccl

import (
	"context"
	"fmt"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// The collectives. comm.Comm validates arguments before they arrive here;
// these checks repeat what a direct caller could get wrong about device
// memory (host tensors, tensors on another GPU) and the dtype/op mapping.

func (b *Backend) checkTensor(t comm.Tensor, name string) (libapi.DataType, error) {
	switch {
	case t.IsZero():
		return 0, fmt.Errorf("nccl: %w: %s: no tensor", comm.ErrInvalidArgument, name)
	case !t.IsDevice():
		return 0, fmt.Errorf("nccl: %w: %s: %s is host memory; the nccl backend takes device tensors", comm.ErrInvalidArgument, name, t)
	case t.Device() != b.dev:
		return 0, fmt.Errorf("nccl: %w: %s: %s is on device %d, this comm runs on device %d", comm.ErrInvalidArgument, name, t, t.Device(), b.dev)
	case t.Count() > 0 && t.Ptr() == 0:
		return 0, fmt.Errorf("nccl: %w: %s: nil device pointer", comm.ErrInvalidArgument, name)
	}
	dt, ok := libapi.DataTypeOf(t.DType())
	if !ok {
		return 0, fmt.Errorf("nccl: %w: %s: dtype %s has no NCCL type", comm.ErrInvalidArgument, name, t.DType())
	}
	return dt, nil
}

func (b *Backend) checkPair(out, in comm.Tensor) (libapi.DataType, error) {
	dt, err := b.checkTensor(out, "out")
	if err != nil {
		return 0, err
	}
	if _, err := b.checkTensor(in, "in"); err != nil {
		return 0, err
	}
	if out.DType() != in.DType() {
		return 0, fmt.Errorf("nccl: %w: out dtype %s differs from in dtype %s", comm.ErrInvalidArgument, out.DType(), in.DType())
	}
	return dt, nil
}

func redOp(op comm.ReduceOp, dt comm.DType) (libapi.RedOp, error) {
	r, ok := libapi.RedOpOf(op)
	if !ok || !op.Supports(dt) {
		return 0, fmt.Errorf("nccl: %w: reduce op %s on %s", comm.ErrInvalidArgument, op, dt)
	}
	return r, nil
}

func (b *Backend) allReduceArgs(t comm.Tensor, op comm.ReduceOp) (libapi.CollArgs, error) {
	dt, err := b.checkTensor(t, "tensor")
	if err != nil {
		return libapi.CollArgs{}, err
	}
	rop, err := redOp(op, t.DType())
	if err != nil {
		return libapi.CollArgs{}, err
	}
	return libapi.CollArgs{Kind: libapi.AllReduce, Type: dt, Op: rop, Send: t.Ptr(), Recv: t.Ptr(), Count: uint64(t.Count())}, nil
}

// AllReduce implements comm.Backend (Avg is ncclAvg).
func (b *Backend) AllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) error {
	a, err := b.allReduceArgs(t, op)
	if err != nil || a.Count == 0 {
		return err
	}
	return b.run(ctx, "allreduce", a)
}

func (b *Backend) reduceScatterArgs(out, in comm.Tensor, op comm.ReduceOp) (libapi.CollArgs, error) {
	dt, err := b.checkPair(out, in)
	if err != nil {
		return libapi.CollArgs{}, err
	}
	rop, err := redOp(op, out.DType())
	if err != nil {
		return libapi.CollArgs{}, err
	}
	if in.Count() != out.Count()*b.size {
		return libapi.CollArgs{}, fmt.Errorf("nccl: %w: reducescatter: in has %d elements, want %d", comm.ErrInvalidArgument, in.Count(), out.Count()*b.size)
	}
	return libapi.CollArgs{Kind: libapi.ReduceScatter, Type: dt, Op: rop, Send: in.Ptr(), Recv: out.Ptr(), Count: uint64(out.Count())}, nil
}

// ReduceScatter implements comm.Backend.
func (b *Backend) ReduceScatter(ctx context.Context, out, in comm.Tensor, op comm.ReduceOp) error {
	a, err := b.reduceScatterArgs(out, in, op)
	if err != nil || a.Count == 0 {
		return err
	}
	return b.run(ctx, "reducescatter", a)
}

// ReduceScatterV implements comm.Backend as one group of reduces, one per
// rank with a non-empty block (NCCL has no reduce-scatter with uneven
// blocks; torchcomms' NCCL backend does the same).
func (b *Backend) ReduceScatterV(ctx context.Context, out, in comm.Tensor, counts []int, op comm.ReduceOp) error {
	dt, err := b.checkPair(out, in)
	if err != nil {
		return err
	}
	rop, err := redOp(op, out.DType())
	if err != nil {
		return err
	}
	if len(counts) != b.size || counts[b.rank] != out.Count() {
		return fmt.Errorf("nccl: %w: reducescatterv: counts %v do not fit size %d and out's %d elements", comm.ErrInvalidArgument, counts, b.size, out.Count())
	}
	es := uintptr(in.DType().Size())
	b.group = b.group[:0]
	off := 0
	for r, c := range counts {
		if c < 0 || off+c > in.Count() {
			return fmt.Errorf("nccl: %w: reducescatterv: counts %v overflow in's %d elements", comm.ErrInvalidArgument, counts, in.Count())
		}
		if c > 0 {
			var recv uintptr
			if r == b.rank {
				recv = out.Ptr()
			}
			b.group = append(b.group, libapi.CollArgs{Kind: libapi.Reduce, Type: dt, Op: rop, Peer: int32(r), Send: in.Ptr() + uintptr(off)*es, Recv: recv, Count: uint64(c)})
		}
		off += c
	}
	return b.runGroup(ctx, "reducescatterv", 0, 0, 0)
}

func (b *Backend) allGatherArgs(out, in comm.Tensor) (libapi.CollArgs, error) {
	dt, err := b.checkPair(out, in)
	if err != nil {
		return libapi.CollArgs{}, err
	}
	if out.Count() != in.Count()*b.size {
		return libapi.CollArgs{}, fmt.Errorf("nccl: %w: allgather: out has %d elements, want %d", comm.ErrInvalidArgument, out.Count(), in.Count()*b.size)
	}
	return libapi.CollArgs{Kind: libapi.AllGather, Type: dt, Send: in.Ptr(), Recv: out.Ptr(), Count: uint64(in.Count())}, nil
}

// AllGather implements comm.Backend.
func (b *Backend) AllGather(ctx context.Context, out, in comm.Tensor) error {
	a, err := b.allGatherArgs(out, in)
	if err != nil || a.Count == 0 {
		return err
	}
	return b.run(ctx, "allgather", a)
}

// AllGatherV implements comm.Backend as one group of broadcasts, one per
// rank with a non-empty block.
func (b *Backend) AllGatherV(ctx context.Context, out, in comm.Tensor, counts []int) error {
	dt, err := b.checkPair(out, in)
	if err != nil {
		return err
	}
	if len(counts) != b.size || counts[b.rank] != in.Count() {
		return fmt.Errorf("nccl: %w: allgatherv: counts %v do not fit size %d and in's %d elements", comm.ErrInvalidArgument, counts, b.size, in.Count())
	}
	es := uintptr(out.DType().Size())
	b.group = b.group[:0]
	off := 0
	for r, c := range counts {
		if c < 0 || off+c > out.Count() {
			return fmt.Errorf("nccl: %w: allgatherv: counts %v overflow out's %d elements", comm.ErrInvalidArgument, counts, out.Count())
		}
		if c > 0 {
			dst := out.Ptr() + uintptr(off)*es
			src := dst
			if r == b.rank {
				src = in.Ptr()
			}
			b.group = append(b.group, libapi.CollArgs{Kind: libapi.Broadcast, Type: dt, Peer: int32(r), Send: src, Recv: dst, Count: uint64(c)})
		}
		off += c
	}
	return b.runGroup(ctx, "allgatherv", 0, 0, 0)
}

func (b *Backend) broadcastArgs(t comm.Tensor, root int) (libapi.CollArgs, error) {
	dt, err := b.checkTensor(t, "tensor")
	if err != nil {
		return libapi.CollArgs{}, err
	}
	return libapi.CollArgs{Kind: libapi.Broadcast, Type: dt, Peer: int32(root), Send: t.Ptr(), Recv: t.Ptr(), Count: uint64(t.Count())}, nil
}

// Broadcast implements comm.Backend.
func (b *Backend) Broadcast(ctx context.Context, t comm.Tensor, root int) error {
	a, err := b.broadcastArgs(t, root)
	if err != nil || a.Count == 0 {
		return err
	}
	return b.run(ctx, "broadcast", a)
}

// reduceArgs: off root the receive buffer is NULL (nccl.h: "recvbuff may
// be NULL on all calls except for root"), so NCCL only reads t there and
// non-root buffers stay unchanged.
func (b *Backend) reduceArgs(t comm.Tensor, op comm.ReduceOp, root int) (libapi.CollArgs, error) {
	dt, err := b.checkTensor(t, "tensor")
	if err != nil {
		return libapi.CollArgs{}, err
	}
	rop, err := redOp(op, t.DType())
	if err != nil {
		return libapi.CollArgs{}, err
	}
	var recv uintptr
	if b.rank == root {
		recv = t.Ptr()
	}
	return libapi.CollArgs{Kind: libapi.Reduce, Type: dt, Op: rop, Peer: int32(root), Send: t.Ptr(), Recv: recv, Count: uint64(t.Count())}, nil
}

// Reduce implements comm.Backend; non-root buffers stay unchanged.
func (b *Backend) Reduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp, root int) error {
	a, err := b.reduceArgs(t, op, root)
	if err != nil || a.Count == 0 {
		return err
	}
	return b.run(ctx, "reduce", a)
}

func (b *Backend) native(f bool) bool { return f && !b.cfg.DisableNativeCollectives }

// Scatter implements comm.Backend: ncclScatter where the library has it,
// else the root sends each block in one group.
func (b *Backend) Scatter(ctx context.Context, out, in comm.Tensor, root int) error {
	dt, err := b.checkTensor(out, "out")
	if err != nil {
		return err
	}
	if b.rank == root {
		if _, err := b.checkPair(out, in); err != nil {
			return err
		}
		if in.Count() != out.Count()*b.size {
			return fmt.Errorf("nccl: %w: scatter: in has %d elements, want %d", comm.ErrInvalidArgument, in.Count(), out.Count()*b.size)
		}
	}
	n := out.Count()
	if n == 0 {
		return nil
	}
	var src uintptr
	if b.rank == root {
		src = in.Ptr()
	}
	if b.native(b.L.info.Features.Scatter) {
		return b.run(ctx, "scatter", libapi.CollArgs{Kind: libapi.Scatter, Type: dt, Peer: int32(root), Send: src, Recv: out.Ptr(), Count: uint64(n)})
	}
	bytes := uintptr(out.NumBytes())
	b.group = b.group[:0]
	if b.rank != root {
		b.group = append(b.group, libapi.CollArgs{Kind: libapi.Recv, Type: dt, Peer: int32(root), Recv: out.Ptr(), Count: uint64(n)})
		return b.runGroup(ctx, "scatter", 0, 0, 0)
	}
	for r := 0; r < b.size; r++ {
		if r != root {
			b.group = append(b.group, libapi.CollArgs{Kind: libapi.Send, Type: dt, Peer: int32(r), Send: src + uintptr(r)*bytes, Count: uint64(n)})
		}
	}
	return b.runGroup(ctx, "scatter", out.Ptr(), src+uintptr(root)*bytes, out.NumBytes())
}

// Gather implements comm.Backend: ncclGather where the library has it,
// else the root receives each block in one group.
func (b *Backend) Gather(ctx context.Context, out, in comm.Tensor, root int) error {
	dt, err := b.checkTensor(in, "in")
	if err != nil {
		return err
	}
	if b.rank == root {
		if _, err := b.checkPair(out, in); err != nil {
			return err
		}
		if out.Count() != in.Count()*b.size {
			return fmt.Errorf("nccl: %w: gather: out has %d elements, want %d", comm.ErrInvalidArgument, out.Count(), in.Count()*b.size)
		}
	}
	n := in.Count()
	if n == 0 {
		return nil
	}
	var dst uintptr
	if b.rank == root {
		dst = out.Ptr()
	}
	if b.native(b.L.info.Features.Gather) {
		return b.run(ctx, "gather", libapi.CollArgs{Kind: libapi.Gather, Type: dt, Peer: int32(root), Send: in.Ptr(), Recv: dst, Count: uint64(n)})
	}
	bytes := uintptr(in.NumBytes())
	b.group = b.group[:0]
	if b.rank != root {
		b.group = append(b.group, libapi.CollArgs{Kind: libapi.Send, Type: dt, Peer: int32(root), Send: in.Ptr(), Count: uint64(n)})
		return b.runGroup(ctx, "gather", 0, 0, 0)
	}
	for r := 0; r < b.size; r++ {
		if r != root {
			b.group = append(b.group, libapi.CollArgs{Kind: libapi.Recv, Type: dt, Peer: int32(r), Recv: dst + uintptr(r)*bytes, Count: uint64(n)})
		}
	}
	return b.runGroup(ctx, "gather", dst+uintptr(root)*bytes, in.Ptr(), in.NumBytes())
}

// AllToAll implements comm.Backend: ncclAlltoAll where the library has
// it, else one group of sends and receives (the own block is copied).
func (b *Backend) AllToAll(ctx context.Context, out, in comm.Tensor) error {
	dt, err := b.checkPair(out, in)
	if err != nil {
		return err
	}
	if out.Count() != in.Count() || in.Count()%b.size != 0 {
		return fmt.Errorf("nccl: %w: alltoall: in %d and out %d elements must be equal and divisible by %d", comm.ErrInvalidArgument, in.Count(), out.Count(), b.size)
	}
	n := in.Count() / b.size
	if n == 0 {
		return nil
	}
	if b.native(b.L.info.Features.AllToAll) {
		return b.run(ctx, "alltoall", libapi.CollArgs{Kind: libapi.AllToAll, Type: dt, Send: in.Ptr(), Recv: out.Ptr(), Count: uint64(n)})
	}
	bytes := uintptr(n * in.DType().Size())
	b.group = b.group[:0]
	for r := 0; r < b.size; r++ {
		if r == b.rank {
			continue
		}
		b.group = append(b.group,
			libapi.CollArgs{Kind: libapi.Send, Type: dt, Peer: int32(r), Send: in.Ptr() + uintptr(r)*bytes, Count: uint64(n)},
			libapi.CollArgs{Kind: libapi.Recv, Type: dt, Peer: int32(r), Recv: out.Ptr() + uintptr(r)*bytes, Count: uint64(n)})
	}
	return b.runGroup(ctx, "alltoall", out.Ptr()+uintptr(b.rank)*bytes, in.Ptr()+uintptr(b.rank)*bytes, int(bytes))
}

// AllToAllV implements comm.Backend as one group of sends and receives;
// the own block is copied on the stream.
func (b *Backend) AllToAllV(ctx context.Context, out comm.Tensor, outCounts []int, in comm.Tensor, inCounts []int) error {
	dt, err := b.checkPair(out, in)
	if err != nil {
		return err
	}
	if len(outCounts) != b.size || len(inCounts) != b.size {
		return fmt.Errorf("nccl: %w: alltoallv: %d outCounts and %d inCounts for %d ranks", comm.ErrInvalidArgument, len(outCounts), len(inCounts), b.size)
	}
	if outCounts[b.rank] != inCounts[b.rank] {
		return fmt.Errorf("nccl: %w: alltoallv: this rank sends itself %d elements but expects %d", comm.ErrInvalidArgument, inCounts[b.rank], outCounts[b.rank])
	}
	es := uintptr(in.DType().Size())
	b.group = b.group[:0]
	var selfDst, selfSrc uintptr
	inOff, outOff := 0, 0
	for r := 0; r < b.size; r++ {
		ic, oc := inCounts[r], outCounts[r]
		if ic < 0 || oc < 0 || inOff+ic > in.Count() || outOff+oc > out.Count() {
			return fmt.Errorf("nccl: %w: alltoallv: counts overflow the buffers", comm.ErrInvalidArgument)
		}
		src, dst := in.Ptr()+uintptr(inOff)*es, out.Ptr()+uintptr(outOff)*es
		switch {
		case r == b.rank:
			selfDst, selfSrc = dst, src
		default:
			if ic > 0 {
				b.group = append(b.group, libapi.CollArgs{Kind: libapi.Send, Type: dt, Peer: int32(r), Send: src, Count: uint64(ic)})
			}
			if oc > 0 {
				b.group = append(b.group, libapi.CollArgs{Kind: libapi.Recv, Type: dt, Peer: int32(r), Recv: dst, Count: uint64(oc)})
			}
		}
		inOff += ic
		outOff += oc
	}
	selfBytes := inCounts[b.rank] * int(es)
	if len(b.group) == 0 && selfBytes == 0 {
		return nil
	}
	return b.runGroup(ctx, "alltoallv", selfDst, selfSrc, selfBytes)
}

// Barrier implements comm.Backend: an all-reduce of one int32.
func (b *Backend) Barrier(ctx context.Context) error { return b.allReduceScratch(ctx) }

// Send implements comm.Backend.
func (b *Backend) Send(ctx context.Context, t comm.Tensor, peer int) error {
	dt, err := b.checkTensor(t, "tensor")
	if err != nil || t.Count() == 0 {
		return err
	}
	if err := b.checkPeer(peer); err != nil {
		return err
	}
	return b.run(ctx, "send", libapi.CollArgs{Kind: libapi.Send, Type: dt, Peer: int32(peer), Send: t.Ptr(), Count: uint64(t.Count())})
}

// Recv implements comm.Backend.
func (b *Backend) Recv(ctx context.Context, t comm.Tensor, peer int) error {
	dt, err := b.checkTensor(t, "tensor")
	if err != nil || t.Count() == 0 {
		return err
	}
	if err := b.checkPeer(peer); err != nil {
		return err
	}
	return b.run(ctx, "recv", libapi.CollArgs{Kind: libapi.Recv, Type: dt, Peer: int32(peer), Recv: t.Ptr(), Count: uint64(t.Count())})
}

func (b *Backend) checkPeer(peer int) error {
	if peer < 0 || peer >= b.size || peer == b.rank {
		return fmt.Errorf("nccl: %w: peer %d (rank %d of %d)", comm.ErrInvalidArgument, peer, b.rank, b.size)
	}
	return nil
}

// BatchP2P implements comm.Backend: all sends and receives in one NCCL
// group.
func (b *Backend) BatchP2P(ctx context.Context, ops []comm.P2POp) error {
	b.group = b.group[:0]
	for i, p := range ops {
		dt, err := b.checkTensor(p.Tensor, fmt.Sprintf("batch[%d]", i))
		if err != nil {
			return err
		}
		if err := b.checkPeer(p.Peer); err != nil {
			return err
		}
		n := uint64(p.Tensor.Count())
		if n == 0 {
			continue
		}
		switch p.Kind {
		case comm.P2PSend:
			b.group = append(b.group, libapi.CollArgs{Kind: libapi.Send, Type: dt, Peer: int32(p.Peer), Send: p.Tensor.Ptr(), Count: n})
		case comm.P2PRecv:
			b.group = append(b.group, libapi.CollArgs{Kind: libapi.Recv, Type: dt, Peer: int32(p.Peer), Recv: p.Tensor.Ptr(), Count: n})
		default:
			return fmt.Errorf("nccl: %w: batch[%d]: kind %d", comm.ErrInvalidArgument, i, p.Kind)
		}
	}
	if len(b.group) == 0 {
		return nil
	}
	return b.runGroup(ctx, "batchp2p", 0, 0, 0)
}
