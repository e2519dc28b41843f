package gloo

import (
	"context"
	"math/bits"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

// ---- Broadcast ----

// Broadcast implements comm.Backend.
func (b *Backend) Broadcast(ctx context.Context, t comm.Tensor, root int) error {
	if err := b.begin(ctx, comm.OpBroadcast); err != nil {
		return err
	}
	if b.size == 1 {
		return b.end(nil)
	}
	buf := t.Bytes()
	d := desc{op: comm.OpBroadcast, dtype: t.DType(), algo: b.pick(len(buf)), root: int32(root), count: uint64(t.Count())}
	if d.algo == AlgorithmRecursiveDoubling {
		return b.end(b.broadcastTree(ctx, d, buf, root))
	}
	return b.end(b.broadcastChain(ctx, d, buf, root))
}

// broadcastChain pipelines segments along root → root+1 → … → root-1.
func (b *Backend) broadcastChain(ctx context.Context, d desc, t []byte, root int) error {
	n, r := b.size, b.rank
	pos, prev, next := mod(r-root, n), mod(r-1, n), mod(r+1, n)
	if pos > 0 {
		b.want[prev]++
	}
	seq := b.collective(d, true)
	if err := b.agree(ctx, seq, d); err != nil {
		return err
	}
	if pos == 0 {
		return b.sendData(ctx, next, opHeader(d, seq, 0), t)
	}
	start, done := b.post(prev, entry{seq: seq, d: d, mode: modeCopy, dst: t})
	if pos < n-1 {
		if err := b.forward(ctx, prev, start, next, opHeader(d, seq, 0), t, 0); err != nil {
			return err
		}
	}
	return b.waitRx(ctx, prev, 0, done)
}

// broadcastTree is a binomial tree: in round k, every position below 2^k
// sends to position + 2^k.
func (b *Backend) broadcastTree(ctx context.Context, d desc, t []byte, root int) error {
	n, r := b.size, b.rank
	pos := mod(r-root, n)
	hb := 0
	if pos > 0 {
		hb = 1 << (bits.Len(uint(pos)) - 1)
		b.want[mod(pos-hb+root, n)]++
	}
	seq := b.collective(d, true)
	if err := b.agree(ctx, seq, d); err != nil {
		return err
	}
	if pos > 0 {
		parent := mod(pos-hb+root, n)
		_, done := b.post(parent, entry{seq: seq, tag: uint32(bits.Len(uint(hb)) - 1), d: d, mode: modeCopy, dst: t})
		if err := b.waitRx(ctx, parent, 0, done); err != nil {
			return err
		}
	}
	dist := 1
	if hb > 0 {
		dist = hb << 1
	}
	for ; pos+dist < n; dist <<= 1 {
		if err := b.sendData(ctx, mod(pos+dist+root, n), opHeader(d, seq, bits.Len(uint(dist))-1), t); err != nil {
			return err
		}
	}
	return nil
}

// ---- Reduce ----

// Reduce implements comm.Backend; only root's t changes.
func (b *Backend) Reduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp, root int) error {
	if err := b.begin(ctx, comm.OpReduce); err != nil {
		return err
	}
	if b.size == 1 {
		return b.end(nil)
	}
	buf := t.Bytes()
	d := desc{op: comm.OpReduce, dtype: t.DType(), redop: op, algo: b.pick(len(buf)), root: int32(root), count: uint64(t.Count())}
	if d.algo == AlgorithmRecursiveDoubling {
		return b.end(b.reduceTree(ctx, d, buf, root))
	}
	return b.end(b.reduceChain(ctx, d, buf, root))
}

// reduceChain pipelines partial sums along root-1 → root-2 → … → root+1 →
// root; intermediate ranks reduce into scratch so their t is untouched.
func (b *Backend) reduceChain(ctx context.Context, d desc, t []byte, root int) error {
	n, r := b.size, b.rank
	pos, from, to := mod(r-root, n), mod(r+1, n), mod(r-1, n)
	if pos < n-1 {
		b.want[from]++
	}
	seq := b.collective(d, true)
	if err := b.agree(ctx, seq, d); err != nil {
		return err
	}
	switch {
	case pos == n-1:
		return b.sendData(ctx, to, opHeader(d, seq, 0), t)
	case pos == 0:
		_, done := b.post(from, entry{seq: seq, d: d, mode: modeReduce, dst: t})
		if err := b.waitRx(ctx, from, 0, done); err != nil {
			return err
		}
		if d.redop == comm.Avg {
			reduce.Divide(d.dtype, t, n)
		}
		return nil
	}
	acc := b.buf(0, len(t))
	start, done := b.post(from, entry{seq: seq, d: d, mode: modeReduce, dst: acc, src: t})
	if err := b.forward(ctx, from, start, to, opHeader(d, seq, 0), acc, 0); err != nil {
		return err
	}
	return b.waitRx(ctx, from, 0, done)
}

// reduceTree is a binomial tree: position p receives from p + 2^k for
// every k below its lowest set bit, then sends to p - lowbit(p).
func (b *Backend) reduceTree(ctx context.Context, d desc, t []byte, root int) error {
	n, r := b.size, b.rank
	pos := mod(r-root, n)
	for dist := 1; pos&dist == 0 && pos+dist < n; dist <<= 1 {
		b.want[mod(pos+dist+root, n)]++
	}
	seq := b.collective(d, true)
	if err := b.agree(ctx, seq, d); err != nil {
		return err
	}
	var done [64]int64
	k := 0
	for dist := 1; pos&dist == 0 && pos+dist < n; dist <<= 1 {
		_, done[k] = b.post(mod(pos+dist+root, n), entry{seq: seq, tag: uint32(k), d: d, mode: modeCopy, dst: b.buf(1+k, len(t))})
		k++
	}
	cur := t
	acc := t
	if pos > 0 {
		acc = b.buf(0, len(t))
	}
	k = 0
	for dist := 1; pos&dist == 0 && pos+dist < n; dist <<= 1 {
		child := mod(pos+dist+root, n)
		if err := b.waitRx(ctx, child, 0, done[k]); err != nil {
			return err
		}
		reduce.Into3(d.dtype, d.redop, acc, cur, b.buf(1+k, len(t)))
		cur = acc
		k++
	}
	if pos > 0 {
		low := pos & -pos
		return b.sendData(ctx, mod(pos-low+root, n), opHeader(d, seq, bits.Len(uint(low))-1), cur)
	}
	if d.redop == comm.Avg {
		reduce.Divide(d.dtype, t, n)
	}
	return nil
}

// ---- Gather, Scatter ----

// Gather implements comm.Backend: every rank sends straight to root, whose
// readers receive from all peers at once.
func (b *Backend) Gather(ctx context.Context, out, in comm.Tensor, root int) error {
	if err := b.begin(ctx, comm.OpGather); err != nil {
		return err
	}
	n, r := b.size, b.rank
	ib := in.Bytes()
	if n == 1 {
		copy(out.Bytes(), ib)
		return b.end(nil)
	}
	d := desc{op: comm.OpGather, dtype: in.DType(), root: int32(root), count: uint64(in.Count())}
	if r == root {
		for p := range n {
			if p != r {
				b.want[p]++
			}
		}
	}
	seq := b.collective(d, true)
	if err := b.agree(ctx, seq, d); err != nil {
		return b.end(err)
	}
	if r != root {
		return b.end(b.sendData(ctx, root, opHeader(d, seq, 0), ib))
	}
	ob, B := out.Bytes(), len(ib)
	for p := range n {
		if p != r {
			b.post(p, entry{seq: seq, d: d, mode: modeCopy, dst: ob[p*B : (p+1)*B]})
		}
	}
	copy(ob[r*B:(r+1)*B], ib)
	return b.end(b.waitAll(ctx))
}

// Scatter implements comm.Backend.
func (b *Backend) Scatter(ctx context.Context, out, in comm.Tensor, root int) error {
	if err := b.begin(ctx, comm.OpScatter); err != nil {
		return err
	}
	n, r := b.size, b.rank
	ob := out.Bytes()
	if n == 1 {
		copy(ob, in.Bytes())
		return b.end(nil)
	}
	d := desc{op: comm.OpScatter, dtype: out.DType(), root: int32(root), count: uint64(out.Count())}
	if r != root {
		b.want[root]++
	}
	seq := b.collective(d, true)
	if err := b.agree(ctx, seq, d); err != nil {
		return b.end(err)
	}
	if r != root {
		_, done := b.post(root, entry{seq: seq, d: d, mode: modeCopy, dst: ob})
		return b.end(b.waitRx(ctx, root, 0, done))
	}
	ib, B := in.Bytes(), len(ob)
	copy(ob, ib[r*B:(r+1)*B])
	for i := 1; i < n; i++ {
		p := (r + i) % n
		if err := b.sendData(ctx, p, opHeader(d, seq, 0), ib[p*B:(p+1)*B]); err != nil {
			return b.end(err)
		}
	}
	return b.end(nil)
}
