package gloo

import (
	"context"

	"github.com/ftcomm/ftcomm/comm"
)

// ---- AllGather, AllGatherV ----

// AllGather implements comm.Backend.
func (b *Backend) AllGather(ctx context.Context, out, in comm.Tensor) error {
	if err := b.begin(ctx, comm.OpAllGather); err != nil {
		return err
	}
	n := b.size
	off := b.intBuf(n + 1)
	for i := range off {
		off[i] = i * in.NumBytes()
	}
	d := desc{op: comm.OpAllGather, dtype: in.DType(), algo: AlgorithmRing, root: -1, count: uint64(in.Count())}
	return b.end(b.allGatherRing(ctx, d, out.Bytes(), in.Bytes(), off))
}

// AllGatherV implements comm.Backend.
func (b *Backend) AllGatherV(ctx context.Context, out, in comm.Tensor, counts []int) error {
	if err := b.begin(ctx, comm.OpAllGatherV); err != nil {
		return err
	}
	n, es := b.size, in.DType().Size()
	off := b.intBuf(n + 1)
	off[0] = 0
	for i := range n {
		off[i+1] = off[i] + counts[i]*es
	}
	d := desc{op: comm.OpAllGatherV, dtype: in.DType(), algo: AlgorithmRing, root: -1, count: uint64(out.Count()), aux: uint32(hashInts(counts))}
	return b.end(b.allGatherRing(ctx, d, out.Bytes(), in.Bytes(), off))
}

// allGatherRing: block i of out is out[off[i]:off[i+1]]. Step s sends
// block r-s and receives block r-s-1 straight into out.
func (b *Backend) allGatherRing(ctx context.Context, d desc, out, in []byte, off []int) error {
	n, r := b.size, b.rank
	if n == 1 {
		copy(out, in)
		return nil
	}
	left, right := mod(r-1, n), mod(r+1, n)
	b.want[left] += n - 1
	seq := b.collective(d, true)
	if err := b.agree(ctx, seq, d); err != nil {
		return err
	}
	copy(out[off[r]:off[r+1]], in)
	marks := b.markBuf(n - 1)
	for s := 0; s < n-1; s++ {
		c := mod(r-s-1, n)
		marks[s], _ = b.post(left, entry{seq: seq, tag: uint32(s), d: d, mode: modeCopy, dst: out[off[c]:off[c+1]]})
	}
	for s := 0; s < n-1; s++ {
		var err error
		if s == 0 {
			err = b.sendData(ctx, right, opHeader(d, seq, s), in)
		} else {
			c := mod(r-s, n)
			err = b.forward(ctx, left, marks[s-1], right, opHeader(d, seq, s), out[off[c]:off[c+1]], 0)
		}
		if err != nil {
			return err
		}
	}
	return b.waitAll(ctx)
}

// ---- AllToAll, AllToAllV ----

// AllToAll implements comm.Backend: every receive is posted, then the
// blocks go out pairwise (rank r+1 first, then r+2, …) while each peer's
// reader fills its block of out.
func (b *Backend) AllToAll(ctx context.Context, out, in comm.Tensor) error {
	if err := b.begin(ctx, comm.OpAllToAll); err != nil {
		return err
	}
	n := b.size
	off := b.intBuf(2 * (n + 1))
	B := in.NumBytes() / n
	for i := 0; i <= n; i++ {
		off[i], off[n+1+i] = i*B, i*B
	}
	d := desc{op: comm.OpAllToAll, dtype: in.DType(), root: -1, count: uint64(in.Count())}
	return b.end(b.allToAll(ctx, d, out.Bytes(), in.Bytes(), off[:n+1], off[n+1:], nil, nil))
}

// AllToAllV implements comm.Backend. Before any data moves, each pair
// checks that what one sends is what the other expects, and then all ranks
// agree, so a count mismatch anywhere leaves every out untouched.
func (b *Backend) AllToAllV(ctx context.Context, out comm.Tensor, outCounts []int, in comm.Tensor, inCounts []int) error {
	if err := b.begin(ctx, comm.OpAllToAllV); err != nil {
		return err
	}
	n, es := b.size, in.DType().Size()
	off := b.intBuf(2 * (n + 1))
	oo, io := off[:n+1], off[n+1:]
	oo[0], io[0] = 0, 0
	for i := range n {
		oo[i+1] = oo[i] + outCounts[i]*es
		io[i+1] = io[i] + inCounts[i]*es
	}
	d := desc{op: comm.OpAllToAllV, dtype: in.DType(), root: -1}
	return b.end(b.allToAll(ctx, d, out.Bytes(), in.Bytes(), oo, io, outCounts, inCounts))
}

func (b *Backend) allToAll(ctx context.Context, d desc, out, in []byte, oo, io []int, outCounts, inCounts []int) error {
	n, r := b.size, b.rank
	if n == 1 {
		copy(out, in)
		return nil
	}
	v := outCounts != nil
	for p := range n {
		if p != r {
			b.want[p]++
			if v {
				b.want[p]++
			}
		}
	}
	seq := b.collective(d, true)
	if v {
		for p := range n {
			if p != r {
				cd := d
				cd.count = uint64(outCounts[p])
				b.post(p, entry{seq: seq, tag: tagCounts, d: cd})
			}
		}
		for i := 1; i < n; i++ {
			p := (r + i) % n
			cd := d
			cd.count = uint64(inCounts[p])
			h := opHeader(cd, seq, tagCounts)
			if err := b.sendFrame(ctx, p, &h, nil); err != nil {
				return err
			}
		}
		if err := b.waitAll(ctx); err != nil {
			return err
		}
	}
	if err := b.agree(ctx, seq, d); err != nil {
		return err
	}
	copy(out[oo[r]:oo[r+1]], in[io[r]:io[r+1]])
	for p := range n {
		if p != r {
			b.post(p, entry{seq: seq, d: d, mode: modeCopy, dst: out[oo[p]:oo[p+1]]})
		}
	}
	for i := 1; i < n; i++ {
		p := (r + i) % n
		if err := b.sendData(ctx, p, opHeader(d, seq, 0), in[io[p]:io[p+1]]); err != nil {
			return err
		}
	}
	return b.waitAll(ctx)
}
