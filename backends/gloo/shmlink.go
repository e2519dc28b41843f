package gloo

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

// How a link uses its shared-memory segment (see shm.go for the layout).
//
// No goroutine reads the rings on its own. The op goroutine is both
// producer and consumer: it writes its frames into the tx ring (under
// smu), and whenever it waits — for a receive to complete, or for room in
// a tx ring — it takes what the rx rings hold and delivers it into the
// posted receives itself ("progress"), with the same descriptor checks,
// the same holding of frames nobody has posted a receive for and the same
// mismatch detection as the socket reader of a TCP link, copying or
// reducing straight from the ring into the destination. Handing a frame
// from a reader goroutine to the op costs several µs (a wakeup and a trip
// through the scheduler); looking at a ring position costs nanoseconds.
//
// Waiting: the op goroutine polls for up to shmSpin (yielding each round,
// see spin), then parks on its Go channel after setting its side's asleep
// word in every shared-memory link and looking once more. A side that
// publishes a position (data written, or space freed) and sees the
// other's asleep word set sends a wake frame over the TCP connection; the
// TCP reader, on that frame (and on a bye), pokes the owner's op. A
// failure, an abort or the ctx closes channels the parked op also waits on.
//
// The TCP connection stays for everything else: handshake, heartbeats,
// notices (abort, revoke, peer failed, mismatch), resync and bye, and for
// liveness: a peer that dies resets it.
//
// Ordering between the two channels, where it matters:
//   - resync: the frame carries the sender's tx position; the consumer
//     drops everything before it (what a failed op left, whole or half
//     written) and reads the new epoch's frames from there.
//   - bye: everything the peer wrote before its bye is still delivered (as
//     over TCP, where the bye follows the data in the stream). If the rx
//     ring holds nothing undelivered when the bye arrives, the TCP reader
//     closes the link at once; otherwise the op goroutine does once it has
//     drained the ring (or at the start or end of the next op).
//   - notices need no order: they fail the comm.
//
// The mapping lives until the TCP reader has exited and the link is
// closed; users of the mapping hold shmState.mu shared (the producer holds
// smu, which releaseShm also takes), so it is never unmapped under them.

const (
	shmPublish = 64 << 10 // a producer publishes its head at least every this many bytes
)

// shmSpin is how long a waiter polls before it parks. A wake through the
// TCP connection costs tens of µs (a write, the peer's reader, the
// scheduler); a peer that answers within one op's work should be caught
// polling. Measured on 2 cores, 4 KiB all-reduce, against the spin of the
// earlier reader goroutines: 100 µs took the medians of seven interleaved
// runs from 7.4 to 5.4 µs (2 ranks) and 129 to 94 µs (4 ranks) against
// 20 µs; 250 µs was no better.
const shmSpin = 100 * time.Microsecond

var errByeDeferred = errors.New("peer said goodbye; its shared-memory data is still being read")

// shmState is a link's shared-memory side. Lane 0 (embedded) carries the
// frames of every op; lanes[i] for i ≥ 1 belong to lane helper i (lanes.go).
type shmState struct {
	seg *shmSeg

	mu   sync.RWMutex // guards the mapping: users hold it shared, releaseShm exclusively
	live bool         // the mapping is valid (mu)

	byeSeen atomic.Bool // the peer's bye arrived (TCP reader)
	crowded atomic.Bool // more ranks of the owner's comm on this host than CPUs (see spin)
	txIntr  atomic.Bool // writers give up waiting for room (a failure)

	shmLane            // lane 0: producer the op goroutine (under link.smu), consumer the op goroutine
	lanes   []*shmLane // every lane, lanes[0] == &shmLane
}

// shmLane is one lane of a link: a ring each way, this side's positions
// in them, and the asleep words of its waiters.
type shmLane struct {
	myAsleep, peerAsleep *atomic.Uint32 // the asleep words of this lane (in the mapping)

	// resync position handed from the TCP reader to the consumer (link.mu;
	// skipSet may also be read without it, as a hint)
	skipTo  uint64
	skipSet atomic.Bool
	lost    bool // an op failed mid-frame: wait for a resync position (lane 0: link.mu; lanes ≥ 1: their helper's alone)

	// producer
	tx    ring
	txPos uint64
	txPub uint64 // last published head
	txHdr [headerSize]byte

	// consumer
	rx    ring
	rxPos uint64
	rxHdr [headerSize]byte
	cur   rxFrame // the frame being delivered (lane 0)
}

// rxFrame is a frame whose header the consumer has taken and whose payload
// it is delivering into e (l.active is set meanwhile).
type rxFrame struct {
	on   bool
	n    uint64 // payload bytes
	need uint64 // payload and padding
	done uint64
	e    entry
}

func newShmState(seg *shmSeg) *shmState {
	s := &shmState{seg: seg, live: true}
	s.lanes = make([]*shmLane, seg.lanes)
	for i := range s.lanes {
		z := &s.shmLane
		if i > 0 {
			z = new(shmLane)
		}
		z.tx, z.rx = seg.tx(i), seg.rx(i)
		z.myAsleep, z.peerAsleep = seg.asleep(seg.side(), i), seg.asleep(1-seg.side(), i)
		s.lanes[i] = z
	}
	// A new segment's positions are zero on both sides.
	return s
}

// spin is what a waiter does between two polls. When this host runs more
// ranks of the comm than it has CPUs (crowded), it yields every round: to
// this process's goroutines and to other processes (sched_yield), so that
// polling does not take a CPU from the peer it waits for. Measured on 2
// cores, 4 KiB all-reduce, 4 ranks: without the yields 150–480 µs, with
// them 80–120 µs. Otherwise it yields to this process's goroutines (a TCP
// reader, the monitor) only every spinYield rounds: runtime.Gosched takes
// the scheduler's global lock and wakes an idle P's thread to look for
// work, so yielding every round made the waiters (and lane helpers) of
// one process contend on that lock and kept extra threads awake on CPUs
// the other ranks wanted. Measured on the 16-core host (4 KiB all-reduce,
// 3 interleaved rounds against yielding every round): 2 ranks 4.0 µs
// against 6.5–7.0, 4 ranks 9.3–15 against 13–20.
//
// A waiter on a goroutine locked to its OS thread (Config.LockedCallers)
// never calls runtime.Gosched: the scheduler hands a locked thread's P to
// another thread and back, which costs more than the wait it fills.
func spin(crowded, locked bool, round int) {
	switch {
	case crowded:
		if !locked {
			runtime.Gosched()
		}
		syscall.Syscall(syscall.SYS_SCHED_YIELD, 0, 0, 0)
	case round%spinYield == 0 && !locked:
		runtime.Gosched()
	}
}

// spinYield: a waiter on a host that is not crowded yields every this
// many polls (a few µs).
const spinYield = 32

// interruptTx makes a writer waiting for ring space give up (Abort,
// Revoke, failures: as a past write deadline does for TCP). The writer
// polls the flag, or is parked and woken by the failure itself.
func (l *link) interruptTx() { l.shm.txIntr.Store(true) }

// shmPending reports whether the peer has written data this side has not
// consumed yet (for the liveness check, like SIOCINQ for TCP).
func (l *link) shmPending() bool {
	s := l.shm
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.live && s.rx.head.Load() != s.rx.tail.Load()
}

// shmIdle reports whether everything the peer wrote has been delivered
// (TCP reader, on the peer's bye): nothing unconsumed, no frame half
// delivered, or the stream abandoned until a resync that will not come.
func (l *link) shmIdle() bool {
	s := l.shm
	s.mu.RLock()
	defer s.mu.RUnlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	return !s.live || !l.active && (s.lost || s.rx.head.Load() == s.rx.tail.Load())
}

// releaseShm unmaps the segment once no user can touch it.
func (l *link) releaseShm() {
	s := l.shm
	l.smu.Lock()
	s.mu.Lock()
	if s.live {
		s.live = false
		s.seg.unmap()
	}
	s.mu.Unlock()
	l.smu.Unlock()
}

// kick sends a wake frame for lane: the peer's waiter on it is parked.
// It is called by a producer or consumer right after publishing, so it
// never waits long for wmu (the other writers are bounded control writes);
// a failed write is left to the TCP reader, which sees the broken
// connection.
func (l *link) kick(lane int) {
	l.wmu.Lock()
	h := header{typ: frameWake, tag: uint32(lane)}
	l.writeBounded(&h, nil, kickTimeout)
	l.wmu.Unlock()
}

const kickTimeout = 100 * time.Millisecond

// ---- producer (op goroutine, l.smu held) ----

// shmWriteLocked writes one frame into the tx ring: header, payload, padding.
func (l *link) shmWriteLocked(ctx context.Context, b *Backend, h *header, payload []byte) error {
	s := l.shm
	if !s.live || l.isClosed() {
		return errLocal
	}
	h.length = uint32(len(payload))
	h.encode(s.txHdr[:])
	err := l.txPut(ctx, b, s.txHdr[:])
	if err == nil {
		err = l.txPut(ctx, b, payload)
	}
	if pad := uint64(pad8(len(payload)) - len(payload)); err == nil && pad > 0 {
		if err = l.txSpace(ctx, b, pad); err == nil {
			s.txPos += pad
		}
	}
	// Interrupted or not, publish what was written: a resync tells the
	// peer this position, which must not lie past the published head.
	l.txPublish()
	return err
}

// txPublish makes the bytes written so far on lane 0 visible, and wakes
// the peer if it is parked.
func (l *link) txPublish() { l.publish(&l.shm.shmLane, 0) }

// publish makes the bytes written so far on lane z (number lane) visible,
// and wakes the peer's waiter on that lane if it is parked.
func (l *link) publish(z *shmLane, lane int) {
	if z.txPub == z.txPos {
		return
	}
	raceRelease()
	z.tx.head.Store(z.txPos)
	z.txPub = z.txPos
	if z.peerAsleep.Load() != 0 {
		l.kick(lane)
	}
}

// txPut copies src into the ring as space allows, publishing as it goes.
func (l *link) txPut(ctx context.Context, b *Backend, src []byte) error {
	s := l.shm
	r := &s.tx
	for len(src) > 0 {
		if err := l.txSpace(ctx, b, 1); err != nil {
			return err
		}
		used := s.txPos - r.tail.Load()
		if used > r.size {
			return errShmCorrupt
		}
		off := s.txPos & r.mask
		k := min(uint64(len(src)), r.size-used, r.size-off)
		copy(r.data[off:off+k], src[:k])
		s.txPos += k
		src = src[k:]
		if s.txPos-s.txPub >= shmPublish {
			l.txPublish()
		}
	}
	return nil
}

// txFree is how many bytes the lane's tx ring can take now.
func (z *shmLane) txFree() (uint64, error) {
	used := z.txPos - z.tx.tail.Load()
	if used > z.tx.size {
		return 0, errShmCorrupt
	}
	raceAcquire()
	return z.tx.size - used, nil
}

// txSpace waits until n bytes are free in the tx ring. Meanwhile it
// delivers what this rank receives on its other shared-memory links (and
// on this one): a peer whose own ring to this rank is full waits for that,
// and it may be the one this rank waits for.
func (l *link) txSpace(ctx context.Context, b *Backend, n uint64) error {
	s := l.shm
	f, err := s.txFree()
	if err != nil || f >= n {
		return err
	}
	l.txPublish() // the consumer may be waiting for what this side holds back
	w := shmWait{tx: l, n: n}
	var sp spinner
	for {
		if f, err = s.txFree(); err != nil || f >= n {
			return err
		}
		if s.txIntr.Load() {
			return errShmInterrupted
		}
		if l.isClosed() {
			return errLocal
		}
		if b.progressShm() {
			sp.reset()
			continue
		}
		if err := b.shmIdle(ctx, &w, &sp); err != nil {
			// As a past write deadline does for TCP: the comm is aborted
			// and the write gives up.
			b.Abort(ctxEnded(ctx))
			return errShmInterrupted
		}
	}
}

// ---- consumer (op goroutine) ----

// rxAvail is how many bytes the peer has published past rxPos on the lane.
func (z *shmLane) rxAvail() (uint64, error) {
	a := z.rx.head.Load() - z.rxPos
	if a > z.rx.size {
		return 0, errShmCorrupt
	}
	raceAcquire()
	return a, nil
}

// rxConsume advances past n bytes of lane 0 and tells the producer (waking
// it if it is parked for room).
func (l *link) rxConsume(n uint64) { l.consume(&l.shm.shmLane, 0, n) }

// consume advances past n bytes of lane z (number lane) and tells the
// producer, waking its waiter on that lane if it is parked.
func (l *link) consume(z *shmLane, lane int, n uint64) {
	z.rxPos += n
	raceRelease()
	z.rx.tail.Store(z.rxPos)
	if z.peerAsleep.Load() != 0 {
		l.kick(lane)
	}
}

// shmProgress delivers what the rx ring holds into the posted receives, as
// far as it goes without waiting. It reports whether it consumed anything.
// A malformed ring fails the link; a frame that proves the peer runs
// another op fails the comm (ErrMismatch); a peer that said goodbye and
// whose data is all delivered closes the link.
func (l *link) shmProgress() bool {
	s := l.shm
	s.mu.RLock()
	if !s.live {
		s.mu.RUnlock()
		return false
	}
	moved, mis, err := l.shmProgressLocked()
	reap := err == nil && s.byeSeen.Load() && !s.cur.on && l.shmDrainedLocked()
	s.mu.RUnlock()
	if mis != nil {
		mis.b.mismatch(mis.peer, mis.epoch, mis.err)
	}
	switch {
	case err != nil:
		if errors.Is(err, errMalformed) {
			l.log.Warn("gloo: dropping connection after a malformed shared-memory frame", zap.String("remote", l.remote), zap.Error(err))
		}
		l.fail(err)
	case reap:
		l.fail(errPeerBye)
	}
	return moved
}

// shmDrainedLocked (s.mu held shared): nothing more will be delivered.
func (l *link) shmDrainedLocked() bool {
	s := l.shm
	l.mu.Lock()
	lost := s.lost
	l.mu.Unlock()
	return lost || s.rx.head.Load() == s.rxPos
}

// rxMismatch is a mismatch found while delivering, reported once the
// mapping is no longer held.
type rxMismatch struct {
	b     *Backend
	peer  int
	epoch uint64
	err   error
}

func (l *link) shmProgressLocked() (moved bool, mis *rxMismatch, err error) {
	s := l.shm
	for {
		if s.cur.on {
			k, err := l.shmDeliver()
			if err != nil {
				return moved, nil, err
			}
			if k == 0 || s.cur.on {
				return moved || k > 0, nil, nil
			}
			moved = true
			continue
		}
		avail, err := s.rxAvail()
		if err != nil {
			return moved, nil, err
		}
		if avail == 0 && !s.skipPending() {
			return moved, nil, nil
		}
		// Between frames: apply a resync position, wait while
		// resynchronising or out of step.
		l.mu.Lock()
		if s.skipSet.Load() && l.mode == rxNormal {
			pos := s.skipTo
			s.lost = false
			s.skipSet.Store(false)
			l.mu.Unlock()
			head := s.rx.head.Load()
			if pos-s.rxPos > s.rx.size || head-pos > s.rx.size {
				return moved, nil, errShmCorrupt
			}
			if pos != s.rxPos {
				l.rxConsume(pos - s.rxPos)
				moved = true
			}
			continue
		}
		if l.mode == rxSync || s.lost || avail < headerSize {
			l.mu.Unlock()
			return moved, nil, nil
		}
		l.mu.Unlock()
		off := s.rxPos & s.rx.mask
		if n := copy(s.rxHdr[:], s.rx.data[off:]); n < headerSize {
			copy(s.rxHdr[n:], s.rx.data)
		}
		h, err := decodeHeader(s.rxHdr[:])
		if err != nil {
			return moved, nil, err
		}
		if h.typ != frameOp && h.typ != frameRefused {
			return moved, nil, fmt.Errorf("%w: %s frame in shared memory", errMalformed, h.typ)
		}
		l.mu.Lock()
		if l.mode != rxNormal || s.skipSet.Load() {
			l.mu.Unlock()
			continue // a resync arrived meanwhile: the frame is the old epoch's
		}
		if h.typ == frameRefused {
			l.mu.Unlock()
			need := uint64(headerSize + pad8(int(h.length)))
			if avail < need {
				return moved, nil, nil // the rest of it is on its way
			}
			reason := decodeReason(l.shmPayload(int(h.length), make([]byte, h.length)))
			l.rxConsume(need)
			l.heard()
			l.onRefused(&h, reason)
			moved = true
			continue
		}
		if l.staleLocked(&h) {
			// Of a refused op: consumed and dropped, as it comes.
			l.mu.Unlock()
			l.rxConsume(headerSize)
			l.heard()
			n := uint64(h.length)
			s.cur = rxFrame{on: true, n: n, need: uint64(pad8(int(n))), e: entry{mode: modeDiscard}}
			moved = true
			continue
		}
		e, ok, why := l.admitLocked(&h)
		if !ok {
			// Hold the frame: nothing of it was written.
			if why != nil {
				mis = &rxMismatch{l.owner, l.peer, l.epoch, why}
			}
			l.mu.Unlock()
			return moved, mis, nil
		}
		l.mu.Unlock()
		l.rxConsume(headerSize)
		l.heard()
		n := uint64(h.length)
		s.cur = rxFrame{on: true, n: n, need: uint64(pad8(int(n))), e: e}
		moved = true
	}
}

// skipPending reports (as a hint; the caller looks again under link.mu)
// whether a resync position waits to be applied.
func (s *shmState) skipPending() bool { return s.skipSet.Load() }

// shmDeliver copies or reduces what has arrived of the current frame's
// payload into its entry; when the frame is complete, the entry is
// finished. It returns how many bytes it consumed.
func (l *link) shmDeliver() (uint64, error) {
	s := l.shm
	c := &s.cur
	e := &c.e
	es := uint64(max(e.d.dtype.Size(), 1))
	var took uint64
	for c.done < c.need {
		avail, err := s.rxAvail()
		if err != nil {
			return took, err
		}
		if c.done >= c.n { // the padding, in one piece
			want := c.need - c.done
			if avail < want {
				return took, nil
			}
			l.rxConsume(want)
			c.done += want
			took += want
			break
		}
		off := s.rxPos & s.rx.mask
		k := min(avail, c.n-c.done, s.rx.size-off)
		k -= k % es
		if k == 0 {
			return took, nil
		}
		chunk := s.rx.data[off : off+k]
		if e.mode == modeDiscard {
			l.rxConsume(k)
			c.done += k
			took += k
			continue
		}
		d := e.dst[e.done+int(c.done) : e.done+int(c.done+k)]
		switch {
		case e.mode == modeCopy:
			copy(d, chunk)
		case e.src == nil:
			reduce.Into(e.d.dtype, e.d.redop, d, chunk)
		default:
			reduce.Into3(e.d.dtype, e.d.redop, d, e.src[e.done+int(c.done):e.done+int(c.done+k)], chunk)
		}
		l.rxConsume(k)
		c.done += k
		took += k
	}
	n, discard := c.n, e.mode == modeDiscard
	*c = rxFrame{}
	l.heard()
	if discard {
		return took, nil // delivered nowhere: no entry is finished
	}
	l.mu.Lock()
	l.active = false
	l.finishLocked(int(n), false)
	return took, nil
}

// shmCancel drops a frame half delivered when the op fails (op goroutine,
// l.mu held): the rest of it stays in the ring, so the consumer has lost
// its place in the stream until a resync.
func (l *link) shmCancelLocked() {
	s := l.shm
	if s.cur.on {
		s.cur = rxFrame{}
		s.lost = true
	}
	l.active = false
}

// Results of shmPeek.
const (
	peekNone  = iota // no whole frame for the op yet
	peekWhole        // the op's whole vector is there, in one frame
	peekPart         // the next frame carries only part of the vector
)

// shmPeek looks at the next frame of the rx ring without consuming it (op
// goroutine): is it the whole vector t of a one-shot op (seq, d)? A frame
// that proves the peer runs another op fails the comm (ErrMismatch), a
// malformed one the link; the error is then returned.
func (l *link) shmPeek(seq uint64, d *desc, t []byte) (int, error) {
	s := l.shm
	s.mu.RLock()
	st, mis, err := l.shmPeekLocked(seq, d, t)
	s.mu.RUnlock()
	switch {
	case mis != nil:
		mis.b.mismatch(mis.peer, mis.epoch, mis.err)
		return peekNone, mis.b.err()
	case err != nil:
		if errors.Is(err, errMalformed) {
			l.log.Warn("gloo: dropping connection after a malformed shared-memory frame", zap.String("remote", l.remote), zap.Error(err))
		}
		l.fail(err)
		b := l.ownerB()
		if e := b.err(); e != nil {
			return peekNone, e
		}
		return peekNone, fmt.Errorf("gloo: %w: %w", comm.ErrAborted, err)
	}
	return st, nil
}

func (l *link) ownerB() *Backend {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.owner
}

func (l *link) shmPeekLocked(seq uint64, d *desc, t []byte) (int, *rxMismatch, error) {
	s := l.shm
	if !s.live {
		return peekNone, nil, errLocal
	}
	if s.cur.on || s.skipSet.Load() {
		return peekNone, nil, nil
	}
	l.mu.Lock()
	waiting, b := l.mode != rxNormal || s.lost, l.owner
	l.mu.Unlock()
	if waiting {
		return peekNone, nil, nil
	}
	avail, err := s.rxAvail()
	if err != nil || avail < headerSize {
		return peekNone, nil, err
	}
	off := s.rxPos & s.rx.mask
	if n := copy(s.rxHdr[:], s.rx.data[off:]); n < headerSize {
		copy(s.rxHdr[n:], s.rx.data)
	}
	h, err := decodeHeader(s.rxHdr[:])
	if err != nil {
		return peekNone, nil, err
	}
	if h.typ == frameRefused {
		return peekNone, nil, nil // the delivery path takes it (progressShm)
	}
	if h.typ != frameOp {
		return peekNone, nil, fmt.Errorf("%w: %s frame in shared memory", errMalformed, h.typ)
	}
	if h.d.op == comm.OpSend {
		return peekNone, nil, nil // a message nobody has received yet: held, as by the receive path
	}
	if b != nil && b.collRefused(h.seq) {
		return peekNone, nil, nil // of a refused collective: the delivery path drops it
	}
	e := entry{seq: seq, tag: 0, d: *d, dst: t}
	if why := matchFrame(&h, &e); why != nil {
		if b != nil && b.collRefused(seq) {
			// A later op's frame from a peer that has given up this
			// refused collective: held, as by the receive path.
			return peekNone, nil, nil
		}
		l.mu.Lock()
		mis := &rxMismatch{l.owner, l.peer, l.epoch, why}
		l.mu.Unlock()
		return peekNone, mis, nil
	}
	if int(h.length) < len(t) {
		return peekPart, nil, nil
	}
	if avail < uint64(headerSize+pad8(len(t))) {
		return peekNone, nil, nil
	}
	return peekWhole, nil, nil
}

// shmPayload returns the payload (n bytes) of the frame at rxPos, in place
// if it does not wrap around the ring's end, else copied into scratch (op
// goroutine, s.mu held shared).
func (l *link) shmPayload(n int, scratch []byte) []byte {
	s := l.shm
	start := (s.rxPos + headerSize) & s.rx.mask
	if start+uint64(n) <= s.rx.size {
		return s.rx.data[start : start+uint64(n)]
	}
	k := copy(scratch, s.rx.data[start:])
	copy(scratch[k:n], s.rx.data)
	return scratch[:n]
}

// shmTake consumes the frame at rxPos, whose payload is n bytes.
func (l *link) shmTake(n int) {
	l.rxConsume(uint64(headerSize + pad8(n)))
	l.heard()
}

// ---- waiting (op goroutine) ----

// progressShm delivers what every shared-memory link of b holds; it
// reports whether anything moved.
func (b *Backend) progressShm() bool {
	moved := false
	for _, l := range b.links {
		if l != nil && l.shm != nil && l.shmProgress() {
			moved = true
		}
	}
	return moved
}

// shmWait is what a waiter on shared memory waits for: link rx to have
// delivered up to byte mark bytes and entry count done, link tx to have n
// bytes of room, or a one-shot all-reduce's vectors.
type shmWait struct {
	rx          *link
	bytes, done int64
	tx          *link
	n           uint64
	one         *oneShotWait
}

func (w *shmWait) ready() bool {
	switch {
	case w.rx != nil:
		return w.rx.rxBytes.Load() >= w.bytes && w.rx.rxDone.Load() >= w.done
	case w.one != nil:
		ok, err := w.one.check()
		return ok || err != nil
	}
	f, err := w.tx.shm.txFree()
	return err != nil || f >= w.n || w.tx.shm.txIntr.Load() || w.tx.isClosed()
}

// spinner paces a waiter: poll for shmSpin, then park. It reads the clock
// only every spinClock rounds (a read costs about as much as a poll).
type spinner struct {
	since  time.Time
	rounds int
}

const spinClock = 16

func (sp *spinner) reset() { sp.since, sp.rounds = time.Time{}, 0 }

// waitRxShm waits until shared-memory link p has delivered up to byte mark
// bytes and completed done entries, delivering meanwhile.
func (b *Backend) waitRxShm(ctx context.Context, p int, bytes, done int64) error {
	w := shmWait{rx: b.links[p], bytes: bytes, done: done}
	var sp spinner
	for {
		if w.ready() {
			return nil
		}
		if b.progressShm() {
			sp.reset()
			continue
		}
		if err := b.stopped(); err != nil {
			return err
		}
		if err := b.shmIdle(ctx, &w, &sp); err != nil {
			// As a past write deadline does for TCP: the comm is aborted
			// and the write gives up.
			b.Abort(ctxEnded(ctx))
			return errShmInterrupted
		}
	}
}

// shmIdle is one round of waiting with nothing to do: a yield while the
// spin lasts, then a park until a wake frame, a delivery on a TCP link, a
// failure or the ctx's end.
func (b *Backend) shmIdle(ctx context.Context, w *shmWait, sp *spinner) error {
	// Polling helps only while shared memory may bring what is missing:
	// TCP deliveries come through the channel.
	if w.one == nil || w.one.shm {
		sp.rounds++
		polling := true
		if sp.rounds%spinClock == 1 {
			now := time.Now()
			if sp.since.IsZero() {
				sp.since = now
			}
			limit := shmSpin
			if b.inLanes {
				limit = laneSpin
			}
			polling = now.Sub(sp.since) < limit
		}
		if polling {
			spin(b.crowded, b.cfg.LockedCallers, sp.rounds)
			if sp.rounds%spinClock == 0 && ctx.Err() != nil {
				return fmt.Errorf("gloo: %w: %w", comm.ErrAborted, ctxEnded(ctx))
			}
			return nil
		}
	}
	// Announce, then look once more: a peer that publishes after this
	// look sees the word and sends a wake frame.
	b.setAsleep(1)
	parked := false
	// A refused collective stops a receive at once; a write goes on to the
	// frame's end (its peer drops it) and parks as usual.
	if !w.ready() && !b.progressShm() && !b.isBroken() && (w.tx != nil || !b.halted.Load()) {
		parked = true
		select {
		case <-b.notify:
		case <-b.broken:
		case <-ctx.Done():
		}
	}
	b.setAsleep(0)
	if parked {
		sp.reset()
	}
	if ctx.Err() != nil {
		return fmt.Errorf("gloo: %w: %w", comm.ErrAborted, ctxEnded(ctx))
	}
	return nil
}

// setAsleep sets this side's lane-0 asleep word in every shared-memory link.
func (b *Backend) setAsleep(v uint32) {
	for _, l := range b.links {
		if l == nil || l.shm == nil {
			continue
		}
		s := l.shm
		s.mu.RLock()
		if s.live {
			s.myAsleep.Store(v)
		}
		s.mu.RUnlock()
	}
}
