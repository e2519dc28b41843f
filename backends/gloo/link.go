package gloo

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/internal/silence"
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

	rxBytes  atomic.Int64     // payload bytes delivered into completed frames
	rxDone   atomic.Int64     // entries completed
	heardAt  silence.Arrivals // when the peer was last heard, ns since born
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
	l.heardAt.Mark(now)
	l.lastSend.Store(now)
	if seg != nil {
		l.shm = newShmState(seg)
	}
	go l.run()
	return l
}

func (l *link) now() int64 { return int64(time.Since(l.born)) }

// heard records that something arrived from the peer (reader goroutine).
func (l *link) heard() { l.heardAt.Arrived(l.now()) }

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

// ---- ownership (Shrink, Grow: reconfig.go) ----

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
