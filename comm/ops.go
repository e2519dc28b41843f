package comm

import "context"

// The ops. Each has a sync form, which returns when the op has completed, and
// an Async form, which queues it and returns its Work. Either way ops run in
// issue order, one at a time, each under its deadline: the comm's Timeout from
// when it starts, tightened by ctx. If ctx ends while the op runs, the op
// cannot be abandoned half-way, so the comm is aborted.

// AllReduce reduces t across all ranks in place; Avg divides by Size().
func (c *Comm) AllReduce(ctx context.Context, t Tensor, op ReduceOp) error {
	_, err := c.do(ctx, opDesc{kind: OpAllReduce, t: t, op: op})
	return err
}

// AllReduceAsync is the async form of AllReduce.
func (c *Comm) AllReduceAsync(ctx context.Context, t Tensor, op ReduceOp) *Work {
	return c.start(ctx, opDesc{kind: OpAllReduce, t: t, op: op})
}

// ReduceScatter reduces in (Size()×out.Count() elements) across ranks and leaves block Rank() of the result in out.
func (c *Comm) ReduceScatter(ctx context.Context, out, in Tensor, op ReduceOp) error {
	_, err := c.do(ctx, opDesc{kind: OpReduceScatter, t: out, in: in, op: op})
	return err
}

// ReduceScatterAsync is the async form of ReduceScatter.
func (c *Comm) ReduceScatterAsync(ctx context.Context, out, in Tensor, op ReduceOp) *Work {
	return c.start(ctx, opDesc{kind: OpReduceScatter, t: out, in: in, op: op})
}

// ReduceScatterV reduces in, whose block r has counts[r] elements (packed
// in rank order), and leaves block Rank() of the result in out (counts[Rank()]
// elements). Every rank passes the same counts.
func (c *Comm) ReduceScatterV(ctx context.Context, out, in Tensor, counts []int, op ReduceOp) error {
	_, err := c.do(ctx, opDesc{kind: OpReduceScatterV, t: out, in: in, counts: counts, op: op})
	return err
}

// ReduceScatterVAsync is the async form of ReduceScatterV.
func (c *Comm) ReduceScatterVAsync(ctx context.Context, out, in Tensor, counts []int, op ReduceOp) *Work {
	return c.start(ctx, opDesc{kind: OpReduceScatterV, t: out, in: in, counts: counts, op: op})
}

// AllGather gathers every rank's in into out (Size()×in.Count() elements) in rank order.
func (c *Comm) AllGather(ctx context.Context, out, in Tensor) error {
	_, err := c.do(ctx, opDesc{kind: OpAllGather, t: out, in: in})
	return err
}

// AllGatherAsync is the async form of AllGather.
func (c *Comm) AllGatherAsync(ctx context.Context, out, in Tensor) *Work {
	return c.start(ctx, opDesc{kind: OpAllGather, t: out, in: in})
}

// AllGatherV gathers in from every rank into out; rank r contributes counts[r] elements, packed in rank order. Every rank passes the same counts.
func (c *Comm) AllGatherV(ctx context.Context, out, in Tensor, counts []int) error {
	_, err := c.do(ctx, opDesc{kind: OpAllGatherV, t: out, in: in, counts: counts})
	return err
}

// AllGatherVAsync is the async form of AllGatherV.
func (c *Comm) AllGatherVAsync(ctx context.Context, out, in Tensor, counts []int) *Work {
	return c.start(ctx, opDesc{kind: OpAllGatherV, t: out, in: in, counts: counts})
}

// Broadcast copies root's t into every rank's t.
func (c *Comm) Broadcast(ctx context.Context, t Tensor, root int) error {
	_, err := c.do(ctx, opDesc{kind: OpBroadcast, t: t, root: root})
	return err
}

// BroadcastAsync is the async form of Broadcast.
func (c *Comm) BroadcastAsync(ctx context.Context, t Tensor, root int) *Work {
	return c.start(ctx, opDesc{kind: OpBroadcast, t: t, root: root})
}

// Reduce reduces t across ranks into root's t; other ranks' t is left unchanged.
func (c *Comm) Reduce(ctx context.Context, t Tensor, op ReduceOp, root int) error {
	_, err := c.do(ctx, opDesc{kind: OpReduce, t: t, op: op, root: root})
	return err
}

// ReduceAsync is the async form of Reduce.
func (c *Comm) ReduceAsync(ctx context.Context, t Tensor, op ReduceOp, root int) *Work {
	return c.start(ctx, opDesc{kind: OpReduce, t: t, op: op, root: root})
}

// Scatter sends block r of root's in (Size()×out.Count() elements) to rank r's out. in is ignored off root and may be the zero Tensor there.
func (c *Comm) Scatter(ctx context.Context, out, in Tensor, root int) error {
	_, err := c.do(ctx, opDesc{kind: OpScatter, t: out, in: in, root: root})
	return err
}

// ScatterAsync is the async form of Scatter.
func (c *Comm) ScatterAsync(ctx context.Context, out, in Tensor, root int) *Work {
	return c.start(ctx, opDesc{kind: OpScatter, t: out, in: in, root: root})
}

// Gather collects every rank's in into root's out (Size()×in.Count() elements) in rank order. out is ignored off root and may be the zero Tensor there.
func (c *Comm) Gather(ctx context.Context, out, in Tensor, root int) error {
	_, err := c.do(ctx, opDesc{kind: OpGather, t: out, in: in, root: root})
	return err
}

// GatherAsync is the async form of Gather.
func (c *Comm) GatherAsync(ctx context.Context, out, in Tensor, root int) *Work {
	return c.start(ctx, opDesc{kind: OpGather, t: out, in: in, root: root})
}

// AllToAll sends block r of in to rank r, receiving rank r's block into block r of out. Counts are equal and divisible by Size().
func (c *Comm) AllToAll(ctx context.Context, out, in Tensor) error {
	_, err := c.do(ctx, opDesc{kind: OpAllToAll, t: out, in: in})
	return err
}

// AllToAllAsync is the async form of AllToAll.
func (c *Comm) AllToAllAsync(ctx context.Context, out, in Tensor) *Work {
	return c.start(ctx, opDesc{kind: OpAllToAll, t: out, in: in})
}

// AllToAllV is AllToAll with per-peer counts: inCounts[r] elements go to rank r, outCounts[r] arrive from it, blocks packed in rank order.
func (c *Comm) AllToAllV(ctx context.Context, out Tensor, outCounts []int, in Tensor, inCounts []int) error {
	_, err := c.do(ctx, opDesc{kind: OpAllToAllV, t: out, in: in, counts: outCounts, inCounts: inCounts})
	return err
}

// AllToAllVAsync is the async form of AllToAllV.
func (c *Comm) AllToAllVAsync(ctx context.Context, out Tensor, outCounts []int, in Tensor, inCounts []int) *Work {
	return c.start(ctx, opDesc{kind: OpAllToAllV, t: out, in: in, counts: outCounts, inCounts: inCounts})
}

// Barrier returns once every rank has entered it.
func (c *Comm) Barrier(ctx context.Context) error {
	_, err := c.do(ctx, opDesc{kind: OpBarrier})
	return err
}

// BarrierAsync is the async form of Barrier.
func (c *Comm) BarrierAsync(ctx context.Context) *Work {
	return c.start(ctx, opDesc{kind: OpBarrier})
}

// Send sends t to peer, which must post a matching Recv.
func (c *Comm) Send(ctx context.Context, t Tensor, peer int) error {
	_, err := c.do(ctx, opDesc{kind: OpSend, t: t, peer: peer})
	return err
}

// SendAsync is the async form of Send.
func (c *Comm) SendAsync(ctx context.Context, t Tensor, peer int) *Work {
	return c.start(ctx, opDesc{kind: OpSend, t: t, peer: peer})
}

// Recv receives from peer into t; the sizes must match.
func (c *Comm) Recv(ctx context.Context, t Tensor, peer int) error {
	_, err := c.do(ctx, opDesc{kind: OpRecv, t: t, peer: peer})
	return err
}

// RecvAsync is the async form of Recv.
func (c *Comm) RecvAsync(ctx context.Context, t Tensor, peer int) *Work {
	return c.start(ctx, opDesc{kind: OpRecv, t: t, peer: peer})
}

// BatchP2P runs the sends and receives of ops concurrently and completes when all have (the only way to overlap point-to-point ops, as in torchcomms).
func (c *Comm) BatchP2P(ctx context.Context, ops []P2POp) error {
	_, err := c.do(ctx, opDesc{kind: OpBatchP2P, p2p: ops})
	return err
}

// BatchP2PAsync is the async form of BatchP2P.
func (c *Comm) BatchP2PAsync(ctx context.Context, ops []P2POp) *Work {
	return c.start(ctx, opDesc{kind: OpBatchP2P, p2p: ops})
}
