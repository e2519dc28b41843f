package gloo

import (
	"context"
	"fmt"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

// maxOneShot bounds the vector of a one-shot all-reduce, which travels as
// one frame to each peer (whatever OneShotBytes and SmallThreshold allow).
const maxOneShot = 16 << 20

// allReduceOneShot: every rank sends its whole vector to every other rank
// and reduces the n vectors itself, in rank order (x₀ ⊕ x₁ ⊕ … ⊕ xₙ₋₁, so
// every rank computes the same bits). One step of latency instead of
// recursive doubling's ⌈log₂ n⌉, for (n − 1) × the bytes on the wire: the
// right trade for small messages (Config.OneShotBytes).
//
// t is written only once every peer's vector has arrived, and each one
// arrives in frames that carry d, so the op has been agreed on by then.
// From a shared-memory link the vector is reduced straight out of the ring
// (looked at in place until all have come, then consumed); from a TCP
// link, or a frame that is not the whole vector in one piece, it is
// copied into scratch first by the usual receive path.
func (b *Backend) allReduceOneShot(ctx context.Context, d desc, t []byte) error {
	n, r := b.size, b.rank
	for p := range n {
		if p != r {
			b.want[p] = 1
		}
	}
	seq := b.collective(d, false)
	N := len(t)
	srcs := b.srcBuf(n)
	srcs[r] = t
	// Receives: peers whose frames are read in place are "pending"; the
	// others get a posted entry into scratch.
	direct := b.flagBuf(n)
	done := b.markBuf(n)
	for p := range n {
		direct[p] = false
		if p == r {
			continue
		}
		if l := b.links[p]; l.shm != nil && uint64(headerSize+pad8(N)) <= l.shm.rx.size {
			direct[p] = true
			continue
		}
		srcs[p] = b.buf(16+p, N)
		_, done[p] = b.post(p, entry{seq: seq, tag: 0, d: d, mode: modeCopy, dst: srcs[p]})
	}
	// Sends, starting with the next rank so that not everyone writes to
	// rank 0 first.
	for k := 1; k < n; k++ {
		p := (r + k) % n
		if err := b.sendOne(ctx, p, opHeader(d, seq, 0), t); err != nil {
			return err
		}
	}
	// Wait for every vector: in place, or delivered into scratch.
	b.one = oneShotWait{b: b, seq: seq, d: d, t: t, srcs: srcs, direct: direct, done: done}
	w := shmWait{one: &b.one}
	var sp spinner
	for {
		ready, err := w.one.check()
		if err != nil {
			return err
		}
		if ready {
			break
		}
		if b.progressShm() {
			sp.reset()
			continue
		}
		if err := b.stopped(); err != nil {
			return err
		}
		if err := b.shmIdle(ctx, &w, &sp); err != nil {
			return err
		}
	}
	b.one = oneShotWait{}
	acc := b.buf(5, N)
	err := b.reduceInOrder(&d, t, srcs, direct, acc)
	if d.redop == comm.Avg {
		reduce.Divide(d.dtype, t, n)
	}
	return err
}

// sendOne sends data to p as a single frame (one-shot vectors are small:
// a peer reading shared memory in place wants it whole).
func (b *Backend) sendOne(ctx context.Context, p int, h header, data []byte) error {
	return b.sendFrame(ctx, p, &h, data)
}

// oneShotWait is what a one-shot all-reduce waits for.
type oneShotWait struct {
	b      *Backend
	seq    uint64
	d      desc
	t      []byte
	srcs   [][]byte
	direct []bool  // by rank: read from the ring in place
	done   []int64 // by rank: the entry count that completes its posted receive
	shm    bool    // the last check found a vector still missing on a shared-memory link
}

// check reports whether every peer's vector is there: a completed entry,
// or a whole frame in a shared-memory ring, checked against the op (a
// frame that cannot be this op's fails the comm with ErrMismatch; one that
// is only part of the vector is handed to the usual receive path).
func (w *oneShotWait) check() (bool, error) {
	b := w.b
	ready := true
	w.shm = false
	for p, l := range b.links {
		if l == nil {
			continue
		}
		if !w.direct[p] {
			if l.rxDone.Load() < w.done[p] {
				ready = false
				w.shm = w.shm || l.shm != nil
			}
			continue
		}
		st, err := l.shmPeek(w.seq, &w.d, w.t)
		switch {
		case err != nil:
			return false, err
		case st == peekNone:
			ready, w.shm = false, true
		case st == peekPart:
			// Not the whole vector in one frame: take it the usual way.
			w.direct[p] = false
			w.srcs[p] = b.buf(16+p, len(w.t))
			_, w.done[p] = b.post(p, entry{seq: w.seq, tag: 0, d: w.d, mode: modeCopy, dst: w.srcs[p]})
			ready, w.shm = false, true
		}
	}
	return ready, nil
}

// reduceInOrder sets t to srcs[0] ⊕ srcs[1] ⊕ … in rank order (srcs[r] is
// t itself; acc is scratch), reading the direct peers' vectors from their
// rings, which it then consumes.
func (b *Backend) reduceInOrder(d *desc, t []byte, srcs [][]byte, direct []bool, acc []byte) error {
	// Pin the mappings and point srcs at the rings' payloads.
	live := true
	for p, l := range b.links {
		if l != nil && direct[p] {
			l.shm.mu.RLock()
			if !l.shm.live {
				live = false
				continue
			}
			srcs[p] = l.shmPayload(len(t), b.buf(16+p, len(t)))
		}
	}
	if !live { // a link closed under the op (Close)
		for p, l := range b.links {
			if l != nil && direct[p] {
				l.shm.mu.RUnlock()
			}
		}
		if err := b.err(); err != nil {
			return err
		}
		return fmt.Errorf("gloo: %w: a shared-memory link closed during the op", comm.ErrAborted)
	}
	dt, op := d.dtype, d.redop
	n := len(srcs)
	if n == 2 {
		reduce.Into3(dt, op, t, srcs[0], srcs[1])
	} else {
		reduce.Into3(dt, op, acc, srcs[0], srcs[1])
		for k := 2; k < n-1; k++ {
			reduce.Into(dt, op, acc, srcs[k])
		}
		reduce.Into3(dt, op, t, acc, srcs[n-1])
	}
	for p, l := range b.links {
		if l != nil && direct[p] {
			l.shmTake(len(t))
			l.shm.mu.RUnlock()
			l.plan(b.collSeq, 0)
		}
	}
	return nil
}

func (b *Backend) srcBuf(n int) [][]byte {
	if cap(b.srcs) < n {
		b.srcs = make([][]byte, n)
	}
	b.srcs = b.srcs[:n]
	clear(b.srcs)
	return b.srcs
}

func (b *Backend) flagBuf(n int) []bool {
	if cap(b.flags) < n {
		b.flags = make([]bool, n)
	}
	return b.flags[:n]
}
