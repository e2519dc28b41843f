package gloo

import (
	"context"
	"math/bits"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

// ---- AllReduce ----

// AllReduce implements comm.Backend.
func (b *Backend) AllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) error {
	if err := b.begin(ctx, comm.OpAllReduce); err != nil {
		return err
	}
	if b.size == 1 {
		return b.end(nil)
	}
	buf := t.Bytes()
	d := desc{op: comm.OpAllReduce, dtype: t.DType(), redop: op, algo: b.pick(len(buf)), root: -1, count: uint64(t.Count())}
	if d.algo == AlgorithmRecursiveDoubling && b.cfg.Algorithm == AlgorithmAuto && len(buf)*(b.size-1) <= b.cfg.OneShotBytes && len(buf) <= maxOneShot {
		d.algo = algoOneShot
		return b.end(b.allReduceOneShot(ctx, d, buf))
	}
	if d.algo == AlgorithmRecursiveDoubling {
		return b.end(b.allReduceRD(ctx, d, buf))
	}
	return b.end(b.allReduceRing(ctx, d, buf))
}

// allReduceRD is recursive doubling. With n = 2^k + m ranks, the first 2m
// pair up: even ranks hand their data to the odd neighbour first and get
// the result back last. Intermediate sums live in scratch, and t is only
// written when the last exchange arrives: that exchange proves (through
// the butterfly) that every rank issued d, since each frame carries it and
// a rank that sees a different one stops.
func (b *Backend) allReduceRD(ctx context.Context, d desc, t []byte) error {
	n, r := b.size, b.rank
	p2 := 1 << (bits.Len(uint(n)) - 1)
	m := n - p2
	rounds := bits.Len(uint(p2)) - 1
	virt := func(v int) int {
		if v < m {
			return 2*v + 1
		}
		return v + m
	}
	if r < 2*m && r%2 == 0 { // extra rank
		b.want[r+1] = 1
		seq := b.collective(d, false)
		_, done := b.post(r+1, entry{seq: seq, tag: tagRDPost, d: d, mode: modeCopy, dst: t})
		if err := b.sendData(ctx, r+1, opHeader(d, seq, tagRDPre), t); err != nil {
			return err
		}
		return b.waitRx(ctx, r+1, 0, done)
	}
	odd := r < 2*m
	v := r - m
	if odd {
		v = r / 2
		b.want[r-1]++
	}
	for k := range rounds {
		b.want[virt(v^(1<<k))]++
	}
	seq := b.collective(d, false)
	N := len(t)
	recv := [2][]byte{b.buf(0, N), b.buf(1, N)}
	acc := [2][]byte{b.buf(2, N), b.buf(3, N)}
	var done [64]int64
	postRound := func(k int) {
		q := virt(v ^ (1 << k))
		_, done[k] = b.post(q, entry{seq: seq, tag: uint32(k), d: d, mode: modeCopy, dst: recv[k%2]})
	}
	cur, ai := t, 0
	if odd {
		pre := b.buf(4, N)
		_, pd := b.post(r-1, entry{seq: seq, tag: tagRDPre, d: d, mode: modeCopy, dst: pre})
		postRound(0)
		if rounds > 1 {
			postRound(1)
		}
		if err := b.waitRx(ctx, r-1, 0, pd); err != nil {
			return err
		}
		reduce.Into3(d.dtype, d.redop, acc[0], t, pre)
		cur, ai = acc[0], 1
	} else {
		postRound(0)
		if rounds > 1 {
			postRound(1)
		}
	}
	for k := range rounds {
		if k >= 1 && k+1 < rounds {
			postRound(k + 1)
		}
		q := virt(v ^ (1 << k))
		if err := b.sendData(ctx, q, opHeader(d, seq, k), cur); err != nil {
			return err
		}
		if err := b.waitRx(ctx, q, 0, done[k]); err != nil {
			return err
		}
		dst := t
		if k < rounds-1 {
			dst = acc[ai]
			ai ^= 1
		}
		reduce.Into3(d.dtype, d.redop, dst, cur, recv[k%2])
		cur = dst
	}
	if d.redop == comm.Avg {
		reduce.Divide(d.dtype, t, n)
	}
	if odd {
		return b.sendData(ctx, r-1, opHeader(d, seq, tagRDPost), t)
	}
	return nil
}

// allReduceRing is a pipelined ring: a reduce-scatter then an all-gather,
// n-1 steps each. The buffer is cut into pieces of about n segments, each
// with its own ring, and the (piece, step) blocks go out as a wavefront:
// diagonal by diagonal (piece + step), lower steps first. A block reduced
// on arrival is forwarded about one diagonal later, while it is still in
// cache, instead of after a whole step over the entire buffer (which at
// 64 MiB meant reading it back from memory). Every rank uses the same
// order, so the blocks on each link arrive in the order their receives
// were posted, and each send waits only for a block of the previous
// diagonal. The left link's reader reduces incoming blocks straight into
// t (or copies them, in the all-gather half).
//
// With shared memory to both ring neighbours, a large message is cut into
// parts run in parallel on lanes (lanes.go); the number of lanes is agreed
// on in the descriptor agreement.
func (b *Backend) allReduceRing(ctx context.Context, d desc, t []byte) error {
	n, r := b.size, b.rank
	left := mod(r-1, n)
	es, count := d.dtype.Size(), int(d.count)
	steps := 2 * (n - 1)
	per := max(b.cfg.SegmentSize/es, 1) * n
	// Planned before the agreement (a fast neighbour's blocks may come
	// while it runs), for one lane: no more than any lane count needs.
	b.want[left] += max(1, (count+per-1)/per) * steps
	seq := b.collective(d, true)
	// The agreement carries the lanes this rank can use and, above them,
	// whether both its ring neighbours are shared-memory links: the minimum
	// has that bit only if every rank has it (a rank without it offers 1
	// lane and no bit), and then every rank pipelines in
	// SharedMemorySegment. (A peer that offers only lanes, as before the
	// bit existed, turns it off for all.) Only a ring on one lane uses it.
	v := uint64(b.lanesWanted(len(t)))
	if b.links[left].shm != nil && b.links[mod(r+1, n)].shm != nil {
		v |= agreeShm
	}
	v, err := b.agreeMin(ctx, seq, d, v)
	if err != nil {
		return err
	}
	if k := int(v &^ agreeShm); k > 1 {
		// Lanes already run the parts side by side; within each, the
		// finer SegmentSize keeps a lane's steps pipelined.
		return b.allReduceLanes(ctx, d, seq, t, k, b.cfg.SegmentSize)
	}
	seg := b.cfg.SegmentSize
	if v&agreeShm != 0 && b.cfg.SharedMemorySegment > 0 {
		seg = b.cfg.SharedMemorySegment
	}
	return b.ringBody(ctx, d, seq, t, seg)
}

// agreeShm is the bit of the ring all-reduce's agreement that says every
// rank has shared memory to both its ring neighbours.
const agreeShm = 1 << 32

// ringBody runs the pipelined ring on t after the agreement; the left
// link's reader (or, over shared memory, the op goroutine as it waits)
// reduces incoming blocks straight into t (or copies them, in the
// all-gather half).
func (b *Backend) ringBody(ctx context.Context, d desc, seq uint64, t []byte, seg int) error {
	n, r := b.size, b.rank
	left, right := mod(r-1, n), mod(r+1, n)
	es := d.dtype.Size()
	count := len(t) / es
	steps := 2 * (n - 1)
	per := max(seg/es, 1) * n
	pieces := max(1, (count+per-1)/per)
	b.links[left].plan(seq, pieces*steps)
	g := ringGeom{n: n, r: r, es: es, count: count, pieces: pieces, steps: steps, t: t}
	done := b.markBuf(pieces * steps)
	for dg := 0; dg < pieces+steps-1; dg++ {
		for s := max(0, dg-pieces+1); s <= min(dg, steps-1); s++ {
			p, mode := dg-s, modeCopy
			if s < n-1 {
				mode = modeReduce
			}
			_, done[p*steps+s] = b.post(left, entry{seq: seq, tag: uint32(s), d: d, mode: mode, dst: g.chunk(p, g.recvChunk(s))})
		}
	}
	for dg := 0; dg < pieces+steps-1; dg++ {
		for s := max(0, dg-pieces+1); s <= min(dg, steps-1); s++ {
			p, c := dg-s, r
			if s > 0 {
				c = g.recvChunk(s - 1)
				if err := b.waitRx(ctx, left, 0, done[p*steps+s-1]); err != nil {
					return err
				}
			}
			data := g.chunk(p, c)
			if s == n-1 && d.redop == comm.Avg {
				reduce.Divide(d.dtype, data, n) // this rank's reduced block
			}
			if err := b.sendSegments(ctx, right, opHeader(d, seq, s), data, max(seg/es*es, es)); err != nil {
				return err
			}
		}
	}
	return b.waitAll(ctx)
}

// ---- ReduceScatter ----

// ReduceScatter implements comm.Backend. in is never modified.
func (b *Backend) ReduceScatter(ctx context.Context, out, in comm.Tensor, op comm.ReduceOp) error {
	if err := b.begin(ctx, comm.OpReduceScatter); err != nil {
		return err
	}
	off := b.intBuf(b.size + 1)
	for i := range off {
		off[i] = i * out.NumBytes()
	}
	d := desc{op: comm.OpReduceScatter, dtype: in.DType(), redop: op, root: -1, count: uint64(out.Count())}
	return b.end(b.reduceScatter(ctx, d, out.Bytes(), in.Bytes(), off))
}

// ReduceScatterV implements comm.Backend: ReduceScatter over blocks of
// counts[r] elements. in is never modified.
func (b *Backend) ReduceScatterV(ctx context.Context, out, in comm.Tensor, counts []int, op comm.ReduceOp) error {
	if err := b.begin(ctx, comm.OpReduceScatterV); err != nil {
		return err
	}
	es := in.DType().Size()
	off := b.intBuf(b.size + 1)
	off[0] = 0
	for i := range b.size {
		off[i+1] = off[i] + counts[i]*es
	}
	d := desc{op: comm.OpReduceScatterV, dtype: in.DType(), redop: op, root: -1, count: uint64(in.Count()), aux: uint32(hashInts(counts))}
	return b.end(b.reduceScatter(ctx, d, out.Bytes(), in.Bytes(), off))
}

// reduceScatter leaves block Rank() of the reduction of in in out, block r
// being in[off[r]:off[r+1]]: recursive doubling over a copy of the whole
// input for small messages, else the ring.
func (b *Backend) reduceScatter(ctx context.Context, d desc, out, in []byte, off []int) error {
	if b.size == 1 {
		copy(out, in)
		return nil
	}
	d.algo = b.pick(len(in))
	if d.algo == AlgorithmRecursiveDoubling {
		tmp := b.buf(5, len(in))
		copy(tmp, in)
		if err := b.allReduceRD(ctx, d, tmp); err != nil {
			return err
		}
		copy(out, tmp[off[b.rank]:off[b.rank+1]])
		return nil
	}
	return b.reduceScatterRing(ctx, d, out, in, off)
}

// reduceScatterRing: step s sends chunk r-s-1 (from in at step 0, else the
// partial sum received at step s-1) and receives chunk r-s-2, which the
// reader reduces with in into a scratch buffer (into out at the last step).
// Three rotating buffers, each as large as the largest block, let the
// reader run a step ahead of the sends. Chunk c is in[off[c]:off[c+1]].
func (b *Backend) reduceScatterRing(ctx context.Context, d desc, out, in []byte, off []int) error {
	n, r := b.size, b.rank
	left, right := mod(r-1, n), mod(r+1, n)
	B := 0
	for c := range n {
		B = max(B, off[c+1]-off[c])
	}
	b.want[left] += n - 1
	seq := b.collective(d, true)
	if err := b.agree(ctx, seq, d); err != nil {
		return err
	}
	bufs := [3][]byte{b.buf(6, B), b.buf(7, B), b.buf(8, B)}
	marks := b.markBuf(n - 1)
	chunk := func(c int) []byte { return in[off[c]:off[c+1]] }
	// dstOf is where step s's incoming chunk r-s-2 is reduced.
	dstOf := func(s int) []byte {
		if s == n-2 {
			return out
		}
		c := mod(r-s-2, n)
		return bufs[s%3][:off[c+1]-off[c]]
	}
	postStep := func(s int) {
		marks[s], _ = b.post(left, entry{seq: seq, tag: uint32(s), d: d, mode: modeReduce, dst: dstOf(s), src: chunk(mod(r-s-2, n))})
	}
	postStep(0)
	if n-1 > 1 {
		postStep(1)
	}
	for s := 0; s < n-1; s++ {
		if s >= 1 && s+1 < n-1 {
			postStep(s + 1)
		}
		var err error
		if s == 0 {
			err = b.sendData(ctx, right, opHeader(d, seq, s), chunk(mod(r-1, n)))
		} else {
			err = b.forward(ctx, left, marks[s-1], right, opHeader(d, seq, s), dstOf(s-1), 0)
		}
		if err != nil {
			return err
		}
	}
	if err := b.waitAll(ctx); err != nil {
		return err
	}
	if d.redop == comm.Avg {
		reduce.Divide(d.dtype, out, n)
	}
	return nil
}
