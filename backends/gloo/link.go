package gloo

import (
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

// entryMode says what the reader does with the payload of a posted entry.
type entryMode uint8

const (
	modeCopy    entryMode = iota + 1 // dst = payload
	modeReduce                       // dst = src ⊕ payload (src nil: dst ⊕= payload)
	modeDiscard                      // the payload is dropped (shared memory: the rest of a frame whose op failed)
)

// entry is a receive posted by the op goroutine: the frames that fill it
// must carry exactly this descriptor, sequence number and tag.
type entry struct {
	seq  uint64
	tag  uint32
	d    desc
	mode entryMode
	dst  []byte
	src  []byte
	done int         // bytes filled so far
	ref  *p2pRefusal // a receive the peer refused: completes empty, in its turn (refuse.go)
}

type rxMode uint8

const (
	rxNormal rxMode = iota
	rxSync          // discarding old frames until the peer's resync for want
)

// Reader states, for the liveness check: only a reader blocked on the
// socket can observe that a peer went silent.
const (
	rsBusy    int32 = 0
	rsReading int32 = 1
	rsStalled int32 = 2
)

var (
	errCancelled = errors.New("gloo: receive cancelled")
	errPeerBye   = errors.New("peer closed its communicator")
	errLocal     = errors.New("connection closed locally")
	aLongTimeAgo = time.Unix(1, 0)
)

const (
	rbufSize   = 64 << 10
	bounceSize = 256 << 10
	smallFrame = 16 << 10 // frames up to this size are coalesced into one write
)

// zeros is filler for the rest of an abandoned frame. Never written.
var zeros [64 << 10]byte

// link is the connection to one peer. It outlives the comm that created
// it when Shrink or Grow takes it over. One goroutine reads it (run), and
// exits when the connection closes; writes are serialised by wmu.
type link struct {
	conn   net.Conn // a *net.TCPConn, except in fuzz tests
	peerID identity // the peer's, from the handshake
	remote string
	log    *zap.Logger
	born   time.Time

	mu       sync.Mutex
	owner    *Backend
	peer     int    // the peer's rank in owner's numbering
	epoch    uint64 // owner's epoch
	posts    []entry
	phead    int
	planSeq  uint64
	planLeft int
	active   bool // the reader is writing into posts[phead].dst
	mode     rxMode
	want     resyncInfo
	syncCh   chan error // result of a resync (cap 1)
	err      error      // why the link closed

	wake   chan struct{} // posts or mode changed (cap 1)
	cancel atomic.Bool
	ack    chan struct{} // the reader dropped its entry (cap 1)

	rxBytes  atomic.Int64 // payload bytes delivered into completed frames
	rxDone   atomic.Int64 // entries completed
	lastRecv atomic.Int64 // ns since born
	maxGap   atomic.Int64 // longest recent gap between arrivals, ns (decays; see decayGap)
	rstate   atomic.Int32
	departed atomic.Bool // the peer closed its comm, and everything it sent was delivered (set under mu)

	// refused point-to-point messages (refuse.go)
	rxRef     []*p2pRefusal // (mu) receives refused by the peer, not yet posted; stray ones
	txRef     []*p2pRefusal // (mu) this rank's messages the peer refused to receive
	nTxRef    atomic.Int32  // len(txRef)
	nStray    atomic.Int32  // stray refusals in rxRef
	strayFrom uint64        // (mu) the lowest receive number a stray refusal took in this op
	strayTook atomic.Bool   // (set under mu) a stray refusal took receives of this op
	dropBelow atomic.Uint64 // messages from the peer numbered below this were refused here: dropped

	// reader-private
	rbuf       []byte
	rpos, rend int
	bounce     []byte
	poisoned   bool // the last op frame was abandoned; a notice or resync must follow

	// writer state (wmu)
	wmu        sync.Mutex
	hdr        [headerSize]byte
	trailOK    [1]byte
	iov        [3][]byte
	bufs       net.Buffers
	small      []byte
	ctlTx      []byte
	owedHdr    int // header bytes of an interrupted frame still to send
	owedPay    int // filler bytes still to send
	owedTrail  bool
	wdl        atomic.Bool  // a write deadline may be set
	abandoned  atomic.Int64 // frames finished with filler (for tests and debugging)
	lastSend   atomic.Int64
	p2pTx      uint64 // next point-to-point message number sent (op goroutine)
	p2pRx      uint64 // next expected (op goroutine)
	closed     chan struct{}
	closeOnce  sync.Once
	readerDone chan struct{} // closed when the reader(s) exited (and the shared memory is unmapped)

	// shared-memory data path, nil for TCP-only links (see shmlink.go)
	shm *shmState
	smu sync.Mutex // serialises writers of the shm tx ring
}

// newLink starts the reader(s) of conn, whose op frames go through seg
// when it is not nil.
func newLink(conn net.Conn, owner *Backend, peer int, peerID identity, seg *shmSeg) *link {
	l := &link{
		conn: conn, peerID: peerID, remote: conn.RemoteAddr().String(), log: owner.log, born: time.Now(),
		owner: owner, peer: peer, epoch: owner.epoch,
		syncCh: make(chan error, 1), wake: make(chan struct{}, 1), ack: make(chan struct{}, 1),
		rbuf: make([]byte, rbufSize), small: make([]byte, smallFrame), ctlTx: make([]byte, headerSize+maxNoticeLen+1),
		closed: make(chan struct{}), readerDone: make(chan struct{}),
	}
	l.trailOK[0] = trailerOK
	now := l.now()
	l.lastRecv.Store(now)
	l.lastSend.Store(now)
	if seg != nil {
		l.shm = newShmState(seg)
	}
	go l.run()
	return l
}

func (l *link) now() int64 { return int64(time.Since(l.born)) }

// heard records that something arrived from the peer (reader goroutine).
func (l *link) heard() {
	now := l.now()
	if gap := now - l.lastRecv.Swap(now); gap > l.maxGap.Load() {
		l.maxGap.Store(gap)
	}
}

// decayGap lets the longest recent gap fade (monitor, once per heartbeat
// interval: half-life about 44 intervals).
func (l *link) decayGap() {
	if g := l.maxGap.Load(); g > 0 {
		l.maxGap.CompareAndSwap(g, g-g/64-1)
	}
}

func (l *link) poke() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

func (l *link) isClosed() bool {
	select {
	case <-l.closed:
		return true
	default:
		return false
	}
}

func (l *link) ownedBy(b *Backend) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.owner == b
}

// fail closes the link for good and tells its owner. Safe from any
// goroutine, any number of times.
func (l *link) fail(err error) {
	l.closeOnce.Do(func() {
		l.mu.Lock()
		l.err = err
		b, peer, syncing := l.owner, l.peer, l.mode == rxSync
		l.mu.Unlock()
		close(l.closed)
		l.conn.Close()
		if syncing {
			select {
			case l.syncCh <- fmt.Errorf("connection to rank %d broke: %w", peer, err):
			default:
			}
		}
		if b != nil {
			b.linkFailed(l, peer, err)
			b.pokeAll() // an op or lane helper parked on this link's shared memory looks again
		}
	})
}

// ---- reader ----

func (l *link) run() {
	defer close(l.readerDone)
	err := l.readLoop()
	if errors.Is(err, errMalformed) {
		l.log.Warn("gloo: dropping connection after a malformed frame", zap.String("remote", l.remote), zap.Error(err))
	}
	if err != errByeDeferred {
		l.fail(err)
	}
	if l.shm != nil {
		// After a deferred bye the op goroutine closes the link once it has
		// delivered the rest (or Close does); then nobody uses the mapping.
		<-l.closed
		l.releaseShm()
	}
}

func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

// read reads into p, absorbing read-deadline interruptions unless the
// reader was asked to drop its entry. The cancel flag is only ever set
// while the reader holds an entry (l.active), so reads between frames
// never see it.
func (l *link) read(p []byte) (int, error) {
	for {
		l.rstate.Store(rsReading)
		n, err := l.conn.Read(p)
		l.rstate.Store(rsBusy)
		if n > 0 {
			raceAcquire() // see race.go
			l.heard()
			return n, nil
		}
		if err == nil {
			continue
		}
		if !isTimeout(err) {
			return 0, err
		}
		l.conn.SetReadDeadline(time.Time{})
		if l.cancel.Load() {
			return 0, errCancelled
		}
	}
}

// fill makes at least n bytes available in rbuf[rpos:rend].
func (l *link) fill(n int) error {
	if l.rpos == l.rend {
		l.rpos, l.rend = 0, 0
	}
	for l.rend-l.rpos < n {
		if len(l.rbuf)-l.rpos < n {
			l.rend = copy(l.rbuf, l.rbuf[l.rpos:l.rend])
			l.rpos = 0
		}
		k, err := l.read(l.rbuf[l.rend:])
		l.rend += k
		if err != nil {
			return err
		}
	}
	return nil
}

func (l *link) skip(n int) error {
	for n > 0 {
		if l.rend > l.rpos {
			k := min(n, l.rend-l.rpos)
			l.rpos += k
			n -= k
			continue
		}
		if err := l.fill(1); err != nil {
			return err
		}
	}
	return nil
}

func (l *link) trailer() (byte, error) {
	if err := l.fill(1); err != nil {
		return 0, err
	}
	t := l.rbuf[l.rpos]
	l.rpos++
	if t != trailerOK && t != trailerAbandon {
		return t, fmt.Errorf("%w: trailer %#02x", errMalformed, t)
	}
	return t, nil
}

func (l *link) readLoop() error {
	for {
		if err := l.fill(headerSize); err != nil {
			return err
		}
		h, err := decodeHeader(l.rbuf[l.rpos : l.rpos+headerSize])
		if err != nil {
			return err
		}
		l.rpos += headerSize
		switch h.typ {
		case frameHeartbeat:
			if _, err := l.trailer(); err != nil {
				return err
			}
		case frameBye:
			if _, err := l.trailer(); err != nil {
				return err
			}
			if l.shm != nil {
				// What the peer wrote before its bye is still delivered: if
				// some of it is undelivered, the op goroutine closes the
				// link once it has delivered it.
				l.shm.byeSeen.Store(true)
				if !l.shmIdle() {
					l.pokeOwner()
					return errByeDeferred
				}
			}
			return errPeerBye
		case frameWake:
			if _, err := l.trailer(); err != nil {
				return err
			}
			if b := l.ownerB(); b != nil {
				b.pokeLane(int(h.tag))
			}
		case frameNotice:
			if err := l.fill(int(h.length) + 1); err != nil {
				return err
			}
			payload := l.rbuf[l.rpos : l.rpos+int(h.length)]
			l.rpos += int(h.length)
			t, err := l.trailer()
			if err != nil {
				return err
			}
			if t == trailerOK {
				nt, err := decodeNotice(payload)
				if err != nil {
					return err
				}
				l.poisoned = false
				l.onNotice(h.seq, nt)
			}
		case frameRefused:
			if l.poisoned {
				return fmt.Errorf("%w: refusal after an abandoned frame without a notice", errMalformed)
			}
			if l.shm != nil {
				return fmt.Errorf("%w: refusal on the socket of a shared-memory link", errMalformed)
			}
			if err := l.fill(int(h.length) + 1); err != nil {
				return err
			}
			reason := decodeReason(l.rbuf[l.rpos : l.rpos+int(h.length)])
			l.rpos += int(h.length)
			t, err := l.trailer()
			if err != nil {
				return err
			}
			if t == trailerOK {
				l.onRefused(&h, reason)
			}
		case frameResync, frameOp:
			if h.typ == frameOp && l.poisoned {
				return fmt.Errorf("%w: op frame after an abandoned frame without a notice", errMalformed)
			}
			if h.typ == frameOp && l.shm != nil {
				return fmt.Errorf("%w: op frame on the socket of a shared-memory link", errMalformed)
			}
			if err := l.dispatch(&h); err != nil {
				return err
			}
		}
	}
}

func (l *link) onNotice(epoch uint64, nt notice) {
	l.mu.Lock()
	b, peer, ok := l.owner, l.peer, l.mode == rxNormal && l.epoch == epoch
	l.mu.Unlock()
	if ok && b != nil {
		b.remoteFault(peer, nt)
	}
}

// stallLocked waits (l.mu held on entry, released on return) until posts or
// mode change. It returns false if the link closed.
func (l *link) stallLocked() bool {
	l.rstate.Store(rsStalled)
	l.mu.Unlock()
	select {
	case <-l.wake:
	case <-l.closed:
		return false
	}
	l.lastRecv.Store(l.now())
	l.rstate.Store(rsBusy)
	return true
}

// dispatch decides what to do with an op or resync frame whose header was
// read: deliver it into the posted entry, hold it until the op goroutine
// posts one, discard it (resynchronising), or report that the peer is
// running a different op.
func (l *link) dispatch(h *header) error {
	for {
		l.mu.Lock()
		if l.mode == rxSync {
			if h.typ == frameOp {
				l.mu.Unlock()
				return l.skip(int(h.length) + 1)
			}
			want := l.want
			l.mu.Unlock()
			n := int(h.length)
			if err := l.fill(n + 1); err != nil {
				return err
			}
			info, note, err := decodeResync(h.seq, l.rbuf[l.rpos:l.rpos+n], false)
			l.rpos += n
			if err != nil {
				return err
			}
			t, err := l.trailer()
			if err != nil {
				return err
			}
			l.poisoned = false
			if t != trailerOK || info.epoch < want.epoch {
				return nil // an interrupted or older resync: keep looking
			}
			var res error
			if l.shm != nil && note.lanes != len(l.shm.lanes) {
				return fmt.Errorf("%w: resync for %d shared-memory lanes on a link with %d", errMalformed, note.lanes, len(l.shm.lanes))
			}
			if info != want {
				res = fmt.Errorf("%w: rank %d resynchronised to epoch %d as rank %d of %d (members %#x), expected epoch %d rank %d of %d (members %#x)",
					comm.ErrMismatch, want.rank, info.epoch, info.rank, info.size, info.members, want.epoch, want.rank, want.size, want.members)
			}
			l.mu.Lock()
			if l.mode == rxSync && l.want == want {
				if res == nil {
					l.mode = rxNormal
					if l.shm != nil {
						// The consumers drop the peer's data before txPos.
						for i, z := range l.shm.lanes {
							z.skipTo = note.txPos[i]
							z.skipSet.Store(true)
						}
					}
				}
				select {
				case l.syncCh <- res:
				default:
				}
			}
			l.mu.Unlock()
			return nil
		}
		if h.typ == frameOp && l.staleLocked(h) {
			l.mu.Unlock()
			return l.skip(int(h.length) + 1)
		}
		if h.typ == frameResync {
			// The peer reconfigured before this end did: hold the frame
			// for this end's Shrink or Grow. Any op of this comm that
			// needs the peer can no longer complete; if the peer shrank,
			// the ranks it left out are why.
			if b, peer, epoch := l.owner, l.peer, l.epoch; b != nil && h.seq > epoch && !b.isBroken() {
				l.mu.Unlock()
				// Read the payload without consuming it (it stays in rbuf
				// for the resync proper).
				n := int(h.length)
				if err := l.fill(n + 1); err != nil {
					return err
				}
				_, note, err := decodeResync(h.seq, l.rbuf[l.rpos:l.rpos+n], true)
				if err != nil {
					return err
				}
				b.peerLeft(peer, h.seq, &note)
				l.mu.Lock()
			}
			if !l.stallLocked() {
				return errLocal
			}
			continue
		}
		e, ok, mis := l.admitLocked(h)
		if ok {
			l.mu.Unlock()
			return l.deliver(h, &e)
		}
		if mis != nil {
			b, peer, epoch := l.owner, l.peer, l.epoch
			l.mu.Unlock()
			b.mismatch(peer, epoch, mis)
			l.mu.Lock()
		}
		if !l.stallLocked() { // hold the frame; nothing of it was written
			return errLocal
		}
	}
}

// admitLocked (l.mu held) matches op frame h against the next posted
// receive. ok: deliver it into e (l.active is set). Otherwise the frame is
// held until the posts change; mis, if not nil, says why it proves that the
// peer runs another op than this rank.
func (l *link) admitLocked(h *header) (e entry, ok bool, mis error) {
	b := l.owner
	if l.phead < len(l.posts) {
		e = l.posts[l.phead]
		if err := matchFrame(h, &e); err != nil {
			if e.d.op != comm.OpSend && b != nil && b.collRefused(e.seq) {
				// A later op's frame, from a peer that has given up a
				// refused collective this rank still runs: held until
				// this rank gives it up too (refuse.go).
				return entry{}, false, nil
			}
			return entry{}, false, err
		}
		l.active = true
		return e, true, nil
	}
	if b != nil && h.d.op != comm.OpSend && !b.isBroken() && h.seq == b.curColl.Load() &&
		(l.planSeq != h.seq || l.planLeft == 0) {
		return entry{}, false, fmt.Errorf("rank %d sent %s step %d, which this rank does not expect in its %s", l.peer, h.d, h.tag, b.curOpDesc())
	}
	return entry{}, false, nil
}

// matchFrame checks a frame against the entry it would fill.
func matchFrame(h *header, e *entry) error {
	switch {
	case h.d != e.d:
		return fmt.Errorf("peer issued %s, this rank issued %s", h.d, e.d)
	case h.seq != e.seq:
		return fmt.Errorf("peer is at %s #%d, this rank at #%d", h.d.op, h.seq, e.seq)
	case h.tag != e.tag:
		return fmt.Errorf("peer sent step %d of %s, this rank expects step %d", h.tag, h.d, e.tag)
	case len(e.dst) == 0 && h.length != 0:
		return fmt.Errorf("peer sent %d bytes for %s step %d, this rank expects none", h.length, h.d, h.tag)
	case len(e.dst) > 0 && (h.length == 0 || int(h.length) > len(e.dst)-e.done):
		return fmt.Errorf("peer sent %d bytes for %s step %d, this rank expects %d more", h.length, h.d, h.tag, len(e.dst)-e.done)
	}
	return nil
}

// deliver reads the payload of a matched frame into its entry. l.active is
// set; it is cleared here (or by the cancel handshake).
func (l *link) deliver(h *header, e *entry) error {
	n := int(h.length)
	var left int
	var err error
	switch {
	case n == 0:
	case e.mode == modeCopy:
		left, err = l.readInto(e.dst[e.done : e.done+n])
	default:
		left, err = l.reduceInto(e, n)
	}
	if err == errCancelled {
		l.dropEntry()
		return l.skip(left + 1)
	}
	if err != nil {
		return err
	}
	t, err := l.trailer()
	if err == errCancelled {
		l.dropEntry()
		return l.skip(1)
	}
	if err != nil {
		return err
	}
	l.mu.Lock()
	l.active = false
	if l.cancel.Load() {
		l.mu.Unlock()
		l.dropEntry()
		return nil
	}
	if t != trailerOK {
		l.poisoned = true // the peer abandoned the frame; its notice follows
		l.mu.Unlock()
		return nil
	}
	l.finishLocked(n, true)
	return nil
}

// pokeOwner wakes the owner's op goroutine if it is parked.
func (l *link) pokeOwner() {
	l.mu.Lock()
	b := l.owner
	l.mu.Unlock()
	if b != nil {
		b.poke()
	}
}

// finishLocked (l.mu held, released on return) records that n more bytes
// were delivered into the entry at the head of the posts, and tells the op
// goroutine (poke) unless it delivered them itself.
func (l *link) finishLocked(n int, poke bool) {
	p := &l.posts[l.phead]
	p.done += n
	complete := p.done == len(p.dst)
	if complete {
		*p = entry{}
		l.phead++
		if l.phead == len(l.posts) {
			l.posts, l.phead = l.posts[:0], 0
		}
		if l.phead < len(l.posts) && l.posts[l.phead].ref != nil && l.completeRefusedLocked() {
			poke = true
		}
	}
	b := l.owner
	l.mu.Unlock()
	l.rxBytes.Add(int64(n))
	if complete {
		l.rxDone.Add(1)
	}
	if poke {
		b.poke()
	}
}

// dropEntry acknowledges a cancel: the reader no longer touches the entry.
func (l *link) dropEntry() {
	l.mu.Lock()
	l.active = false
	l.cancel.Store(false)
	l.mu.Unlock()
	select {
	case l.ack <- struct{}{}:
	default:
	}
}

// readInto reads exactly len(dst) payload bytes into dst; on error it
// returns how many were not read.
func (l *link) readInto(dst []byte) (int, error) {
	if l.rend > l.rpos {
		k := copy(dst, l.rbuf[l.rpos:l.rend])
		l.rpos += k
		dst = dst[k:]
	}
	for len(dst) > 0 {
		if l.cancel.Load() {
			return len(dst), errCancelled
		}
		k, err := l.read(dst)
		dst = dst[k:]
		if err != nil {
			return len(dst), err
		}
	}
	return 0, nil
}

// reduceInto reads n payload bytes through the bounce buffer and reduces
// them into e.dst[e.done:] as they arrive.
func (l *link) reduceInto(e *entry, n int) (int, error) {
	if l.bounce == nil {
		l.bounce = make([]byte, bounceSize)
	}
	es := e.d.dtype.Size()
	dst := e.dst[e.done : e.done+n]
	var src []byte
	if e.src != nil {
		src = e.src[e.done : e.done+n]
	}
	left, done, carry := n, 0, 0
	for done < n {
		if l.cancel.Load() {
			return left, errCancelled
		}
		want := min(len(l.bounce)-carry, left)
		var k int
		if l.rend > l.rpos {
			k = copy(l.bounce[carry:carry+want], l.rbuf[l.rpos:l.rend])
			l.rpos += k
		} else {
			var err error
			k, err = l.read(l.bounce[carry : carry+want])
			if err != nil {
				return left, err
			}
		}
		left -= k
		avail := carry + k
		use := avail - avail%es
		if use > 0 {
			if src == nil {
				reduce.Into(e.d.dtype, e.d.redop, dst[done:done+use], l.bounce[:use])
			} else {
				reduce.Into3(e.d.dtype, e.d.redop, dst[done:done+use], src[done:done+use], l.bounce[:use])
			}
			done += use
		}
		carry = avail - use
		if carry > 0 {
			copy(l.bounce, l.bounce[use:avail])
		}
	}
	return 0, nil
}

// ---- posting (op goroutine) ----

func (l *link) plan(seq uint64, n int) {
	l.mu.Lock()
	l.planSeq, l.planLeft = seq, n
	l.mu.Unlock()
}

// post queues e for the reader; false if the peer has closed its comm
// (the entry can never be filled).
func (l *link) post(e entry) bool {
	l.mu.Lock()
	if l.phead > 0 && len(l.posts) == cap(l.posts) {
		k := copy(l.posts, l.posts[l.phead:])
		clear(l.posts[k:])
		l.posts, l.phead = l.posts[:k], 0
	}
	l.refuseEntryLocked(&e)
	l.posts = append(l.posts, e)
	l.planLeft--
	if e.ref != nil {
		l.completeRefusedLocked()
	}
	departed := l.departed.Load() // under mu: peerClosed sees this entry, or this sees its mark
	l.mu.Unlock()
	l.poke()
	return !departed
}

// cancelPosts drops every posted entry and returns once the reader is no
// longer writing into any of them. keep: the stream goes on (a refused
// op, refuse.go), so the rest of a frame half delivered over shared
// memory is consumed and dropped by the next delivery, instead of losing
// the stream's place until a resync (as after a failure). Over TCP the
// reader skips the rest of such a frame either way.
func (l *link) cancelPosts(keep bool) {
	l.mu.Lock()
	clear(l.posts)
	l.posts, l.phead, l.planLeft = l.posts[:0], 0, 0
	if l.shm != nil {
		// The op goroutine is the consumer: nothing else writes the entries.
		if keep && l.shm.cur.on {
			l.shm.cur.e = entry{mode: modeDiscard}
			l.active = false
		} else {
			l.shmCancelLocked()
		}
		l.mu.Unlock()
		return
	}
	if !l.active {
		l.mu.Unlock()
		return
	}
	l.cancel.Store(true)
	l.mu.Unlock()
	l.conn.SetReadDeadline(aLongTimeAgo)
	select {
	case <-l.ack:
	case <-l.readerDone:
	}
}

// ---- writer ----

// writeLocked sends one frame (wmu held), first completing any frame an
// earlier write left unfinished.
func (l *link) writeLocked(h *header, payload []byte) error {
	if l.owedHdr > 0 || l.owedPay > 0 || l.owedTrail {
		if err := l.flushLocked(); err != nil {
			return err
		}
	}
	h.length = uint32(len(payload))
	total := headerSize + len(payload) + 1
	var n int
	var err error
	raceRelease() // see race.go: a writev carries no edge for the detector
	if total <= len(l.small) {
		h.encode(l.small)
		copy(l.small[headerSize:], payload)
		l.small[total-1] = trailerOK
		n, err = l.conn.Write(l.small[:total])
	} else {
		h.encode(l.hdr[:])
		l.iov[0], l.iov[1], l.iov[2] = l.hdr[:], payload, l.trailOK[:]
		l.bufs = l.iov[:]
		var n64 int64
		n64, err = l.bufs.WriteTo(l.conn)
		n = int(n64)
		l.iov[1] = nil
	}
	if err != nil {
		if total <= len(l.small) {
			copy(l.hdr[:], l.small[:headerSize])
		}
		if n > 0 {
			l.abandoned.Add(1) // this frame will be finished as abandoned
		}
		switch {
		case n < headerSize:
			l.owedHdr, l.owedPay, l.owedTrail = headerSize-n, len(payload), true
		case n < headerSize+len(payload):
			l.owedPay, l.owedTrail = headerSize+len(payload)-n, true
		case n < total:
			l.owedTrail = true
		}
		return err
	}
	l.lastSend.Store(l.now())
	return nil
}

// flushLocked completes an interrupted frame: the rest of its header, then
// filler for the payload and an "abandoned" trailer, so the peer can skip it.
func (l *link) flushLocked() error {
	for l.owedHdr > 0 {
		k, err := l.conn.Write(l.hdr[headerSize-l.owedHdr:])
		l.owedHdr -= k
		if err != nil {
			return err
		}
	}
	for l.owedPay > 0 {
		k, err := l.conn.Write(zeros[:min(l.owedPay, len(zeros))])
		l.owedPay -= k
		if err != nil {
			return err
		}
	}
	if l.owedTrail {
		if _, err := l.conn.Write([]byte{trailerAbandon}); err != nil {
			return err
		}
		l.owedTrail = false
	}
	return nil
}

// writeBounded sends a control frame with a write deadline, for the
// monitor and for Close: it never blocks longer than d.
func (l *link) writeBounded(h *header, payload []byte, d time.Duration) error {
	l.wdl.Store(true)
	l.conn.SetWriteDeadline(time.Now().Add(d))
	return l.writeLocked(h, payload)
}

// clearDeadline removes a write deadline left by a bounded write or an
// abort before an op writes (wmu held).
func (l *link) clearDeadline() {
	if l.wdl.Load() {
		l.wdl.Store(false)
		l.conn.SetWriteDeadline(time.Time{})
	}
}

// heartbeat sends a heartbeat if nothing was sent for interval and no op
// is writing (monitor goroutine).
func (l *link) heartbeat(b *Backend, interval time.Duration) {
	if time.Duration(l.now()-l.lastSend.Load()) < interval || l.byeSeen() || !l.wmu.TryLock() {
		return
	}
	defer l.wmu.Unlock()
	if !l.ownedBy(b) {
		return
	}
	h := header{typ: frameHeartbeat}
	if err := l.writeBounded(&h, nil, interval); err != nil && !isTimeout(err) {
		l.fail(err) // takes l.mu after wmu, the usual order; the owner never takes wmu
	}
}

// sendNotice tells the peer why b failed; false if it must be retried.
func (l *link) sendNotice(b *Backend, nt *notice, d time.Duration) bool {
	if l.byeSeen() {
		return true // the peer is gone; its socket is closed
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if !l.ownedBy(b) {
		return true
	}
	n := nt.encode(l.ctlTx[headerSize:])
	h := header{typ: frameNotice, seq: b.epoch}
	err := l.writeBounded(&h, l.ctlTx[headerSize:headerSize+n], d)
	if err != nil && !isTimeout(err) {
		l.fail(err)
		return true
	}
	return err == nil
}

// inq returns the bytes waiting unread in the socket (SIOCINQ), or -1.
func (l *link) inq() int {
	sc, ok := l.conn.(interface {
		SyscallConn() (syscall.RawConn, error)
	})
	if !ok {
		return -1
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return -1
	}
	n := -1
	rc.Control(func(fd uintptr) {
		if v, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ); err == nil {
			n = v
		}
	})
	return n
}

// byeSeen reports whether a shared-memory link's peer said goodbye (its
// socket is then closed, while its data is still being read).
func (l *link) byeSeen() bool { return l.shm != nil && l.shm.byeSeen.Load() }

// takeover hands the link to nb, which will use it at epoch want.epoch,
// where the peer has rank peer; the reader discards everything until the
// peer's matching resync frame.
func (l *link) takeover(nb *Backend, peer int, want resyncInfo) {
	l.mu.Lock()
	l.owner, l.peer, l.epoch = nb, peer, want.epoch
	l.mode, l.want = rxSync, want
	clear(l.posts)
	l.posts, l.phead, l.planLeft = l.posts[:0], 0, 0
	// Refusals are of the old epoch's ops (message numbers go on).
	l.rxRef, l.txRef = nil, nil
	l.strayTook.Store(false)
	l.nTxRef.Store(0)
	l.nStray.Store(0)
	select {
	case <-l.syncCh:
	default:
	}
	l.mu.Unlock()
	l.poke()
}

// giveBack returns a link to b after a failed reconfiguration.
func (l *link) giveBack(b *Backend, peer int) {
	l.mu.Lock()
	l.owner, l.peer, l.epoch = b, peer, b.epoch
	l.mu.Unlock()
}

// sendResync writes this end's resync frame (after any unfinished frame)
// with a deadline.
func (l *link) sendResync(info resyncInfo, note resyncNote, deadline time.Time) error {
	if l.shm != nil {
		// No op writes now: everything before these positions is the old
		// epoch's, and the peer drops it. (The lane helpers are idle
		// between ops.)
		l.smu.Lock()
		note.lanes = len(l.shm.lanes)
		for i, z := range l.shm.lanes {
			note.txPos[i] = z.txPos
		}
		l.smu.Unlock()
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	l.wdl.Store(true)
	l.conn.SetWriteDeadline(deadline)
	p := make([]byte, resyncLen(&note))
	encodeResync(p, &info, &note)
	h := header{typ: frameResync, seq: info.epoch}
	return l.writeLocked(&h, p)
}

// closeGraceful sends a bye (bounded by d) and closes the link. Writers
// holding wmu finish promptly: the owner was broken first, which set their
// write deadlines in the past, and control writes are bounded.
func (l *link) closeGraceful(d time.Duration) {
	l.wmu.Lock()
	h := header{typ: frameBye}
	l.writeBounded(&h, nil, d)
	l.wmu.Unlock()
	l.fail(errLocal)
}
