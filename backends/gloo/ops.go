package gloo

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

// Tags of the steps that are not numbered by the algorithm.
const (
	tagPreamble = 1 << 24 // + round: the descriptor agreement
	tagCounts   = 2 << 24 // AllToAllV: the counts each rank will send
	tagRDPre    = 3 << 24 // recursive doubling: fold an extra rank in
	tagRDPost   = 4 << 24 // recursive doubling: hand it the result
)

func mod(x, n int) int { return ((x % n) + n) % n }

func (b *Backend) poke() {
	select {
	case b.notify <- struct{}{}:
	default:
	}
}

// buf returns scratch buffer i with n bytes; scratch is kept for later ops.
func (b *Backend) buf(i, n int) []byte {
	for len(b.scratch) <= i {
		b.scratch = append(b.scratch, nil)
	}
	if cap(b.scratch[i]) < n {
		b.scratch[i] = make([]byte, n)
	}
	return b.scratch[i][:n]
}

// marks returns a scratch slice of k int64s.
func (b *Backend) markBuf(k int) []int64 {
	if cap(b.marks) < k {
		b.marks = make([]int64, k)
	}
	return b.marks[:k]
}

func (b *Backend) intBuf(k int) []int {
	if cap(b.ints) < k {
		b.ints = make([]int, k)
	}
	return b.ints[:k]
}

func (b *Backend) pick(nbytes int) Algorithm {
	if b.cfg.Algorithm != AlgorithmAuto {
		return b.cfg.Algorithm
	}
	if nbytes <= b.cfg.SmallThreshold {
		return AlgorithmRecursiveDoubling
	}
	return AlgorithmRing
}

// segFor is the pipelining unit for dt: SegmentSize rounded down to whole elements.
func (b *Backend) segFor(dt comm.DType) int {
	es := max(dt.Size(), 1)
	return max(b.cfg.SegmentSize/es*es, es)
}

// ---- op framing ----

// begin starts an op: it refuses if b is broken and arms ctx.
func (b *Backend) begin(ctx context.Context, op comm.OpType) error {
	if b.isBroken() {
		return b.err()
	}
	if peer := b.departed.Load(); peer > 0 && op != comm.OpSend && op != comm.OpRecv && op != comm.OpBatchP2P {
		b.peerGone(int(peer-1), false) // a collective needs every member (Config.KeepPointToPointAfterLeave)
		return b.err()
	}
	b.curOp.Store(uint32(op))
	if op != comm.OpSend && op != comm.OpRecv && op != comm.OpBatchP2P && b.size > 1 {
		// A collective: a peer may have refused it already (refuse.go).
		seq := b.collSeq + 1
		b.opColl.Store(seq)
		if b.nRefColl.Load() > 0 {
			if err := b.refusedAtBegin(ctx, seq); err != nil {
				return err
			}
		}
	}
	for p, l := range b.links {
		if l != nil {
			b.exp[p] = rxMark{l.rxBytes.Load(), l.rxDone.Load()}
			if l.nTxRef.Load() > 0 {
				l.pruneTx()
			}
		}
	}
	b.active.Store(true)
	return nil
}

// watchCtx has the op's ctx abort b when it ends (once per op, before the
// op first writes to a socket: a write blocked on a full socket buffer
// sees only a past write deadline). Waits select on the ctx themselves,
// shared-memory writes poll it and sendFrame looks at it, so ops over
// shared memory never pay for this (an allocation and a lock of the ctx).
func (b *Backend) watchCtx(ctx context.Context) {
	if b.ctxStop == nil && ctx.Done() != nil {
		b.ctxStop = context.AfterFunc(ctx, func() { b.Abort(ctxEnded(ctx)) })
	}
}

// ctxEnded says why the op's ctx ended: past its deadline is a timeout
// (comm.ErrTimeout, as the Comm's own deadline is), anything else is not.
func ctxEnded(ctx context.Context) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("%w: caller's deadline passed: %w", comm.ErrTimeout, context.Cause(ctx))
	}
	return fmt.Errorf("ctx ended: %w", context.Cause(ctx))
}

// end finishes an op. On failure it makes sure b is broken (so peers learn
// of it), takes every posted receive back from the readers before the
// caller's buffers are returned, and reports the root cause. An op that a
// peer refused (refuse.go) breaks nothing: a collective gives its
// receives back and tells every peer it has given the op up; a
// point-to-point op fails once the rest of it is done.
func (b *Backend) end(err error) error {
	if b.ctxStop != nil {
		b.ctxStop()
		b.ctxStop = nil
	}
	b.curColl.Store(0)
	refused, halt := b.settleOp()
	if refused != nil && !b.isBroken() && (err == nil || halt != nil) {
		return b.endRefused(refused, halt)
	}
	if err != nil {
		if !b.isBroken() {
			b.breakWith(faultInfo{
				nt:  abortNotice(b.opType(), b.rank, err),
				err: fmt.Errorf("gloo: %w: %w", comm.ErrAborted, err),
			})
		}
		for _, l := range b.links {
			if l != nil {
				l.cancelPosts(false)
			}
		}
		err = b.err()
	}
	b.clearStrays()
	b.active.Store(false)
	if peer := b.left.Load(); peer > 0 {
		b.peerGone(int(peer-1), false) // see peerClosed
	}
	return err
}

// endRefused ends an op that a peer refused: a collective (halt) takes
// its receives back, keeping every stream in step, and tells every peer
// it has given the collective up, before anything of a later op is sent.
func (b *Backend) endRefused(refused error, halt *collRefusal) error {
	if halt != nil {
		for _, l := range b.links {
			if l != nil {
				l.cancelPosts(true)
			}
		}
		b.settleColl(halt.seq)
		if err := b.sendRefusals(context.Background(), halt.op, halt.seq, halt.origin, halt.reason); err != nil {
			refused = err
		}
	}
	b.clearStrays()
	b.active.Store(false)
	if peer := b.left.Load(); peer > 0 {
		b.peerGone(int(peer-1), false) // see peerClosed
	}
	if err := b.err(); err != nil {
		return err
	}
	return refused
}

// collective numbers a collective, plans the entries each link will
// receive (b.want, plus the preamble when agree will run) and publishes the
// sequence number to the readers.
func (b *Backend) collective(d desc, preamble bool) uint64 {
	b.collSeq++
	seq := b.collSeq
	b.curDMu.Lock()
	b.curD = d
	b.curDMu.Unlock()
	n, r := b.size, b.rank
	if preamble {
		for dist := 1; dist < n; dist <<= 1 {
			b.want[mod(r-dist, n)]++
		}
	}
	for p, k := range b.want {
		if k > 0 {
			b.links[p].plan(seq, k)
			b.want[p] = 0
		}
	}
	b.curColl.Store(seq)
	return seq
}

// post queues e on link p and returns the byte mark where the entry starts
// and the entry count at which it is complete.
func (b *Backend) post(p int, e entry) (int64, int64) {
	m := &b.exp[p]
	start := m.bytes
	m.bytes += int64(len(e.dst))
	m.done++
	if !b.links[p].post(e) {
		b.peerGone(p, true) // the wait for this entry ends at once
	}
	return start, m.done
}

// waitRx waits until link p has delivered payload up to byte mark bytes
// and completed done entries.
func (b *Backend) waitRx(ctx context.Context, p int, bytes, done int64) error {
	l := b.links[p]
	if l.shm != nil {
		return b.waitRxShm(ctx, p, bytes, done)
	}
	for l.rxBytes.Load() < bytes || l.rxDone.Load() < done {
		if b.halted.Load() {
			if err := b.haltError(); err != nil {
				return err // a peer refused the collective
			}
		}
		select {
		case <-b.notify:
		case <-b.broken:
			return b.err()
		case <-ctx.Done():
			return fmt.Errorf("gloo: %w: %w", comm.ErrAborted, ctxEnded(ctx))
		}
	}
	return nil
}

// waitAll waits until every link has completed every entry posted.
func (b *Backend) waitAll(ctx context.Context) error {
	for p, l := range b.links {
		if l != nil {
			if err := b.waitRx(ctx, p, 0, b.exp[p].done); err != nil {
				return err
			}
		}
	}
	return nil
}

func (b *Backend) sendFrame(ctx context.Context, p int, h *header, payload []byte) error {
	if b.halted.Load() {
		if err := b.haltError(); err != nil {
			return err // a peer refused the collective: nothing more of it is sent
		}
	}
	if ctx.Err() != nil {
		// An op that streams without ever waiting still stops within a
		// frame of its ctx's end (comm.CtxWatcher; an atomic load).
		b.Abort(ctxEnded(ctx))
		return b.err()
	}
	l := b.links[p]
	if l.departed.Load() {
		b.peerGone(p, true)
		return b.err()
	}
	var err error
	if l.shm != nil {
		l.smu.Lock()
		l.shm.txIntr.Store(false) // an interruption left by an earlier failure
		if b.isBroken() {
			l.smu.Unlock()
			return b.err()
		}
		err = l.shmWriteLocked(ctx, b, h, payload)
		l.smu.Unlock()
	} else {
		b.watchCtx(ctx) // a blocked socket write sees only a deadline in the past
		l.wmu.Lock()
		l.clearDeadline()
		if b.isBroken() {
			l.wmu.Unlock()
			return b.err()
		}
		err = l.writeLocked(h, payload)
		l.wmu.Unlock()
	}
	if err == nil {
		return nil
	}
	if !(isTimeout(err) && b.isBroken()) {
		l.fail(err)
	}
	if e := b.err(); e != nil {
		return e
	}
	return &comm.RankError{Rank: p, Op: b.opType(), Epoch: b.epoch, Err: fmt.Errorf("gloo: %w: %w", comm.ErrPeerFailed, err)}
}

// sendData sends data to p in frames of at most one segment (one empty
// frame if data is empty).
func (b *Backend) sendData(ctx context.Context, p int, h header, data []byte) error {
	return b.sendSegments(ctx, p, h, data, b.segFor(h.d.dtype))
}

// sendSegments is sendData in frames of at most seg bytes (whole elements).
func (b *Backend) sendSegments(ctx context.Context, p int, h header, data []byte, seg int) error {
	if len(data) == 0 {
		return b.sendFrame(ctx, p, &h, nil)
	}
	for off := 0; off < len(data); off += seg {
		if err := b.sendFrame(ctx, p, &h, data[off:min(off+seg, len(data))]); err != nil {
			return err
		}
	}
	return nil
}

// forward sends data to p segment by segment, each as soon as link from
// has delivered it (data is filled by the entry that starts at byte mark
// start). avg > 0 divides each segment by avg first.
func (b *Backend) forward(ctx context.Context, from int, start int64, to int, h header, data []byte, avg int) error {
	if len(data) == 0 {
		return b.sendFrame(ctx, to, &h, nil)
	}
	seg := b.segFor(h.d.dtype)
	for off := 0; off < len(data); off += seg {
		end := min(off+seg, len(data))
		if err := b.waitRx(ctx, from, start+int64(end), 0); err != nil {
			return err
		}
		if avg > 0 {
			reduce.Divide(h.d.dtype, data[off:end], avg)
		}
		if err := b.sendFrame(ctx, to, &h, data[off:end]); err != nil {
			return err
		}
	}
	return nil
}

// agree runs the descriptor agreement (a dissemination barrier whose frames
// carry d): when it returns nil, every rank has issued d, so buffers may be
// written. A rank that sees a different descriptor fails and tells the
// others, which therefore never complete it.
func (b *Backend) agree(ctx context.Context, seq uint64, d desc) error {
	n, r := b.size, b.rank
	for k, dist := 0, 1; dist < n; k, dist = k+1, dist<<1 {
		b.post(mod(r-dist, n), entry{seq: seq, tag: tagPreamble + uint32(k), d: d})
	}
	for k, dist := 0, 1; dist < n; k, dist = k+1, dist<<1 {
		h := header{typ: frameOp, d: d, tag: tagPreamble + uint32(k), seq: seq}
		if err := b.sendFrame(ctx, mod(r+dist, n), &h, nil); err != nil {
			return err
		}
		// Each link carries at most one preamble entry (the distances are
		// distinct powers of two below n), and it is the last one posted.
		from := mod(r-dist, n)
		if err := b.waitRx(ctx, from, 0, b.exp[from].done); err != nil {
			return err
		}
	}
	return nil
}

// agreeMin is agree that also computes the minimum of v over the ranks:
// its frames carry what the sender knows so far (8 bytes), and after the
// ⌈log₂ n⌉ rounds every rank has heard, through the others, from all.
func (b *Backend) agreeMin(ctx context.Context, seq uint64, d desc, v uint64) (uint64, error) {
	n, r := b.size, b.rank
	rounds := bits.Len(uint(n - 1))
	slots := b.buf(15, 16*rounds)
	for k, dist := 0, 1; dist < n; k, dist = k+1, dist<<1 {
		b.post(mod(r-dist, n), entry{seq: seq, tag: tagPreamble + uint32(k), d: d, mode: modeCopy, dst: slots[16*k : 16*k+8]})
	}
	for k, dist := 0, 1; dist < n; k, dist = k+1, dist<<1 {
		out := slots[16*k+8 : 16*k+16]
		binary.LittleEndian.PutUint64(out, v)
		h := header{typ: frameOp, d: d, tag: tagPreamble + uint32(k), seq: seq}
		if err := b.sendFrame(ctx, mod(r+dist, n), &h, out); err != nil {
			return 0, err
		}
		from := mod(r-dist, n)
		if err := b.waitRx(ctx, from, 0, b.exp[from].done); err != nil {
			return 0, err
		}
		v = min(v, binary.LittleEndian.Uint64(slots[16*k:16*k+8]))
	}
	return v, nil
}

func opHeader(d desc, seq uint64, tag int) header {
	return header{typ: frameOp, d: d, tag: uint32(tag), seq: seq}
}

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

// ---- Barrier ----

// Barrier implements comm.Backend: the descriptor agreement alone.
func (b *Backend) Barrier(ctx context.Context) error {
	if err := b.begin(ctx, comm.OpBarrier); err != nil {
		return err
	}
	if b.size == 1 {
		return b.end(nil)
	}
	d := desc{op: comm.OpBarrier, root: -1}
	seq := b.collective(d, true)
	return b.end(b.agree(ctx, seq, d))
}

// ---- point to point ----

func p2pDesc(t comm.Tensor) desc {
	return desc{op: comm.OpSend, dtype: t.DType(), root: -1, count: uint64(t.Count())}
}

// Send implements comm.Backend. It returns once the data is in the kernel's
// socket buffers (for messages larger than those, once the peer receives).
func (b *Backend) Send(ctx context.Context, t comm.Tensor, peer int) error {
	if err := b.begin(ctx, comm.OpSend); err != nil {
		return err
	}
	l := b.links[peer]
	seq := l.p2pTx
	l.p2pTx++
	return b.end(b.sendMessage(ctx, peer, seq, t))
}

// Recv implements comm.Backend.
func (b *Backend) Recv(ctx context.Context, t comm.Tensor, peer int) error {
	if err := b.begin(ctx, comm.OpRecv); err != nil {
		return err
	}
	l := b.links[peer]
	seq := l.p2pRx
	l.p2pRx++
	_, done := b.post(peer, entry{seq: seq, d: p2pDesc(t), mode: modeCopy, dst: t.Bytes()})
	return b.end(b.waitRx(ctx, peer, 0, done))
}

// BatchP2P implements comm.Backend: all receives are posted, then the sends
// go out in order, then it waits for the receives.
func (b *Backend) BatchP2P(ctx context.Context, ops []comm.P2POp) error {
	if err := b.begin(ctx, comm.OpBatchP2P); err != nil {
		return err
	}
	for _, o := range ops {
		if o.Kind == comm.P2PRecv {
			l := b.links[o.Peer]
			b.post(o.Peer, entry{seq: l.p2pRx, d: p2pDesc(o.Tensor), mode: modeCopy, dst: o.Tensor.Bytes()})
			l.p2pRx++
		}
	}
	for _, o := range ops {
		if o.Kind == comm.P2PSend {
			l := b.links[o.Peer]
			seq := l.p2pTx
			l.p2pTx++
			if err := b.sendMessage(ctx, o.Peer, seq, o.Tensor); err != nil {
				return b.end(err)
			}
		}
	}
	return b.end(b.waitAll(ctx))
}
