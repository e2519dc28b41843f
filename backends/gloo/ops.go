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
