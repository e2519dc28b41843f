package gloo

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm/reduce"
)

// How a link uses its shared-memory segment (see shm.go for the layout).
//
// The op goroutine writes op frames into the tx ring (under smu), instead
// of the socket; a second reader goroutine per link (the shm reader) takes
// them from the rx ring and delivers them into the posted receives exactly
// as the socket reader does for TCP links: same descriptor checks, same
// holding of frames nobody has posted a receive for, same mismatch
// detection. It copies or reduces straight from the ring into the
// destination. The TCP connection stays for everything else: handshake,
// heartbeats, notices (abort, revoke, peer failed, mismatch), resync and
// bye, and for liveness: a peer that dies resets it, and closing it wakes
// both readers and any writer waiting on the rings.
//
// Ordering between the two channels, where it matters:
//   - resync: the frame carries the sender's tx position; the receiver
//     drops everything before it (what a failed op left, whole or half
//     written) and reads the new epoch's frames from there.
//   - bye: everything the peer wrote before its bye is still delivered
//     (as over TCP, where the bye follows the data in the stream); the link
//     closes once the shm reader runs out of data, or at once if it has
//     lost its place in the stream (an op was cancelled mid-frame).
//   - notices need no order: they fail the comm.

const (
	shmSpin    = 100 * time.Microsecond // poll this long before sleeping on a futex
	shmPublish = 64 << 10               // a producer publishes its head at least every this many bytes
)

// spin polls ready for up to shmSpin before the caller sleeps in a futex
// (a futex wake and the thread's way back to a P cost tens of µs). Each
// round yields: to this process's goroutines (the op goroutine the reader
// has just readied is queued on this P, and would otherwise wait until
// this thread blocks in the futex and sysmon hands the P over), and, when
// this host runs more ranks of the comm than it has CPUs, to other
// processes too (sched_yield), so that polling does not take a CPU from
// the peer it waits for. Measured on 2 cores, 4 KiB all-reduce: without
// the yields 2 ranks took 40–90 µs, 4 ranks 150–480 µs; with them 13–20
// and 80–120 µs. The spin is long enough to cover a peer that answers
// within one op's work: against 20 µs, 100 µs took the medians of seven
// interleaved runs from 7.4 to 5.4 µs (2 ranks) and 129 to 94 µs (4 ranks);
// 250 µs was no better. A link's reader spins only while an op waits on
// it, so idle links cost nothing.
func (l *link) spin(ready func() bool) bool {
	runtime.Gosched()
	crowded := l.shm.crowded.Load()
	deadline := time.Now().Add(shmSpin)
	for time.Now().Before(deadline) {
		if ready() {
			return true
		}
		runtime.Gosched()
		if crowded {
			syscall.Syscall(syscall.SYS_SCHED_YIELD, 0, 0, 0)
		}
	}
	return ready()
}

var errByeDeferred = errors.New("peer said goodbye; its shared-memory data is still being read")

// shmState is a link's shared-memory side.
type shmState struct {
	seg *shmSeg

	mu   sync.RWMutex // guards the mapping: wakers hold it shared, releaseShm exclusively
	live bool         // the mapping is valid (mu)
	done chan struct{}

	gen     atomic.Uint64 // bumped by events the shm reader must look at (posts, modes, cancels)
	byeSeen atomic.Bool   // the peer's bye arrived (TCP reader)
	crowded atomic.Bool   // more ranks of the owner's comm on this host than CPUs (see spin)

	// resync position handed from the TCP reader to the shm reader (link.mu)
	skipTo  uint64
	skipSet bool

	// producer (link.smu)
	tx      ring
	txPos   uint64
	txPub   uint64 // last published head
	txIntr  atomic.Bool
	txHdr   [headerSize]byte
	txSleep syscall.Timespec

	// consumer (shm reader goroutine)
	rx      ring
	rxPos   uint64
	rxHdr   [headerSize]byte
	rxSleep syscall.Timespec
	lost    bool // an op was cancelled mid-frame: wait for a resync position
}

func newShmState(seg *shmSeg) *shmState {
	s := &shmState{seg: seg, live: true, done: make(chan struct{}), tx: seg.tx(), rx: seg.rx()}
	s.txSleep = syscall.NsecToTimespec(int64(shmWaitSlice))
	s.rxSleep = s.txSleep
	// A new segment's positions are zero on both sides.
	return s
}

// wakeReader wakes the shm reader if it is (about to be) asleep; always
// for rare events whose waiter may not have announced itself.
func (l *link) wakeReader(always bool) {
	s := l.shm
	s.mu.RLock()
	if s.live && (always || s.rx.consWait.Load() != 0) {
		s.rx.wakeConsumer()
	}
	s.mu.RUnlock()
}

// interruptTx makes a writer waiting for ring space give up (Abort,
// Revoke, failures: as a past write deadline does for TCP).
func (l *link) interruptTx() {
	s := l.shm
	s.txIntr.Store(true)
	s.mu.RLock()
	if s.live {
		s.tx.wakeProducer()
	}
	s.mu.RUnlock()
}

// pokeShm tells the shm reader that posts or modes changed.
func (l *link) pokeShm() {
	l.shm.gen.Add(1)
	l.wakeReader(false)
}

// shmPending reports whether the peer has written data this side has not
// read yet (for the liveness check, like SIOCINQ for TCP).
func (l *link) shmPending() bool {
	s := l.shm
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.live && s.rx.head.Load() != s.rx.tail.Load()
}

// releaseShm unmaps the segment once no writer and no waker can touch it.
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

// ---- producer (op goroutine, l.smu held) ----

// shmWriteLocked writes one frame into the tx ring: header, payload, padding.
func (l *link) shmWriteLocked(h *header, payload []byte) error {
	s := l.shm
	if !s.live || l.isClosed() {
		return errLocal
	}
	h.length = uint32(len(payload))
	h.encode(s.txHdr[:])
	err := l.txPut(s.txHdr[:])
	if err == nil {
		err = l.txPut(payload)
	}
	if pad := uint64(pad8(len(payload)) - len(payload)); err == nil && pad > 0 {
		if err = l.txSpace(pad); err == nil {
			s.txPos += pad
		}
	}
	// Interrupted or not, publish what was written: a resync tells the
	// peer this position, which must not lie past the published head.
	l.txPublish()
	return err
}

// txPublish makes the bytes written so far visible and wakes the consumer
// if it sleeps.
func (l *link) txPublish() {
	s := l.shm
	if s.txPub == s.txPos {
		return
	}
	raceRelease()
	s.tx.head.Store(s.txPos)
	s.txPub = s.txPos
	if s.tx.consWait.Load() != 0 {
		s.tx.wakeConsumer()
	}
}

// txPut copies src into the ring as space allows, publishing as it goes.
func (l *link) txPut(src []byte) error {
	s := l.shm
	r := &s.tx
	for len(src) > 0 {
		if err := l.txSpace(1); err != nil {
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

// txSpace waits until n bytes are free in the tx ring.
func (l *link) txSpace(n uint64) error {
	s := l.shm
	r := &s.tx
	free := func() (uint64, error) {
		used := s.txPos - r.tail.Load()
		if used > r.size {
			return 0, errShmCorrupt
		}
		raceAcquire()
		return r.size - used, nil
	}
	f, err := free()
	if err != nil || f >= n {
		return err
	}
	l.txPublish() // the consumer may be waiting for what this side holds back
	for {
		if f, err = free(); err != nil || f >= n {
			return err
		}
		if s.txIntr.Load() {
			return errShmInterrupted
		}
		if l.isClosed() {
			return errLocal
		}
		if l.spin(func() bool { f, err := free(); return err != nil || f >= n || s.txIntr.Load() }) {
			continue
		}
		r.prodWait.Store(1)
		seq := r.spaceSeq.Load()
		if f, err = free(); err == nil && f < n && !s.txIntr.Load() && !l.isClosed() {
			futexWait(r.spaceSeq, seq, &s.txSleep)
		}
		r.prodWait.Store(0)
	}
}

// ---- consumer (shm reader goroutine) ----

// rxAvail is how many bytes the peer has published past rxPos.
func (s *shmState) rxAvail() (uint64, error) {
	a := s.rx.head.Load() - s.rxPos
	if a > s.rx.size {
		return 0, errShmCorrupt
	}
	raceAcquire()
	return a, nil
}

// rxConsume advances past n bytes and tells the producer.
func (s *shmState) rxConsume(n uint64) {
	s.rxPos += n
	raceRelease()
	s.rx.tail.Store(s.rxPos)
	if s.rx.prodWait.Load() != 0 {
		s.rx.wakeProducer()
	}
}

// rxBlock waits (spin, then futex) until ready() holds or something may
// have changed; callers loop.
func (l *link) rxBlock(ready func() bool) {
	s := l.shm
	if l.spin(ready) {
		return
	}
	s.rx.consWait.Store(1)
	seq := s.rx.dataSeq.Load()
	if !ready() {
		futexWait(s.rx.dataSeq, seq, &s.rxSleep)
	}
	s.rx.consWait.Store(0)
}

func (l *link) shmRun() {
	err := l.shmLoop()
	if errors.Is(err, errMalformed) {
		l.log.Warn("gloo: dropping connection after a malformed shared-memory frame", zap.String("remote", l.remote), zap.Error(err))
	}
	if errors.Is(err, errByeDeferred) {
		err = errPeerBye
	}
	l.fail(err)
	l.releaseShm()
	close(l.shm.done)
}

// shmLoop reads frames from the rx ring until the link closes.
func (l *link) shmLoop() error {
	s := l.shm
	for {
		// Between frames: apply a resync position, stop after a bye, wait
		// while resynchronising or out of step.
		l.mu.Lock()
		if s.skipSet && l.mode == rxNormal {
			pos := s.skipTo
			s.skipSet = false
			l.mu.Unlock()
			head := s.rx.head.Load()
			if pos-s.rxPos > s.rx.size || head-pos > s.rx.size {
				return errShmCorrupt
			}
			s.rxConsume(pos - s.rxPos)
			s.lost = false
			continue
		}
		waiting := l.mode == rxSync || s.lost
		l.mu.Unlock()
		if l.isClosed() {
			return errLocal
		}
		if waiting {
			if s.byeSeen.Load() {
				return errByeDeferred // no resync will come now
			}
			gen := s.gen.Load()
			l.rxBlock(func() bool { return s.gen.Load() != gen || s.byeSeen.Load() || l.isClosed() })
			continue
		}
		avail, err := s.rxAvail()
		if err != nil {
			return err
		}
		if avail < headerSize {
			if s.byeSeen.Load() {
				if avail, err = s.rxAvail(); err != nil || avail < headerSize {
					return errByeDeferred // all the peer wrote has been read
				}
				continue
			}
			gen := s.gen.Load()
			l.rxBlock(func() bool {
				a, err := s.rxAvail()
				return err != nil || a >= headerSize || s.gen.Load() != gen || s.byeSeen.Load() || l.isClosed()
			})
			continue
		}
		off := s.rxPos & s.rx.mask
		if n := copy(s.rxHdr[:], s.rx.data[off:]); n < headerSize {
			copy(s.rxHdr[n:], s.rx.data)
		}
		h, err := decodeHeader(s.rxHdr[:])
		if err != nil {
			return err
		}
		if h.typ != frameOp {
			return fmt.Errorf("%w: %s frame in shared memory", errMalformed, h.typ)
		}
		if err := l.shmDispatch(&h); err != nil {
			return err
		}
	}
}

// shmDispatch delivers the frame whose header is at rxPos into the posted
// receive it matches, or holds it (unconsumed) until the posts change.
func (l *link) shmDispatch(h *header) error {
	s := l.shm
	for {
		gen := s.gen.Load()
		l.mu.Lock()
		if l.mode != rxNormal || s.skipSet {
			// Resynchronising, or just resynchronised: the frame is the old
			// epoch's, and the skip (applied by shmLoop) drops it before
			// the new epoch's posts can see it.
			l.mu.Unlock()
			return nil
		}
		e, ok, mis := l.admitLocked(h)
		if ok {
			l.mu.Unlock()
			s.rxConsume(headerSize)
			l.heard()
			return l.shmDeliver(h, &e)
		}
		b, peer, epoch := l.owner, l.peer, l.epoch
		l.mu.Unlock()
		if mis != nil {
			b.mismatch(peer, epoch, mis) // hold the frame; nothing of it was written
		}
		if l.isClosed() {
			return errLocal
		}
		l.rxBlock(func() bool { return s.gen.Load() != gen || l.isClosed() })
	}
}

// shmDeliver copies or reduces the payload of a matched frame from the
// ring into its entry, as it arrives. l.active is set; it is cleared here.
func (l *link) shmDeliver(h *header, e *entry) error {
	s := l.shm
	n := uint64(h.length)
	es := uint64(max(e.d.dtype.Size(), 1))
	var dst, src []byte
	if n > 0 {
		dst = e.dst[e.done : e.done+int(n)]
		if e.src != nil {
			src = e.src[e.done : e.done+int(n)]
		}
	}
	need := uint64(pad8(int(n))) // payload and padding
	done := uint64(0)
	for done < need {
		avail, err := s.rxAvail()
		if err != nil {
			return err
		}
		want := es
		if done >= n {
			want = need - done // the padding, in one piece
		}
		if avail < want {
			if l.cancel.Load() {
				return l.shmCancelled()
			}
			if s.byeSeen.Load() {
				if avail, err = s.rxAvail(); err == nil && avail < want {
					return errByeDeferred // the rest of the frame will never come
				}
				continue
			}
			if l.isClosed() {
				return errLocal
			}
			l.rxBlock(func() bool {
				a, err := s.rxAvail()
				return err != nil || a >= want || l.cancel.Load() || s.byeSeen.Load() || l.isClosed()
			})
			continue
		}
		if done >= n {
			s.rxConsume(want)
			done += want
			break
		}
		off := s.rxPos & s.rx.mask
		k := min(avail, n-done, s.rx.size-off)
		k -= k % es
		chunk := s.rx.data[off : off+k]
		d := dst[done : done+k]
		switch {
		case e.mode == modeCopy:
			copy(d, chunk)
		case src == nil:
			reduce.Into(e.d.dtype, e.d.redop, d, chunk)
		default:
			reduce.Into3(e.d.dtype, e.d.redop, d, src[done:done+k], chunk)
		}
		s.rxConsume(k)
		done += k
		l.heard()
		if done < need && l.cancel.Load() {
			return l.shmCancelled()
		}
	}
	l.mu.Lock()
	l.active = false
	if l.cancel.Load() {
		l.mu.Unlock()
		l.dropEntry()
		return nil
	}
	l.finishLocked(int(n))
	return nil
}

// shmCancelled acknowledges a cancel in the middle of a frame: the rest of
// it stays in the ring, so the reader has lost its place until a resync.
func (l *link) shmCancelled() error {
	l.dropEntry()
	l.shm.lost = true
	return nil
}

// shmWakeAll wakes both sides' waiters of this process (the link closed).
func (l *link) shmWakeAll() {
	s := l.shm
	s.mu.RLock()
	if s.live {
		s.rx.wakeConsumer()
		s.tx.wakeProducer()
	}
	s.mu.RUnlock()
}
