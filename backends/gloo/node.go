package gloo

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// node is one process's endpoint for a family of comms: the listener, its
// accept loop and the registrations of comms waiting for inbound
// connections. A comm made by New owns a node; the comms Shrink, Grow and
// Split derive from it share it (reference counted), so a process listens
// on one port however often it reconfigures.
type node struct {
	cfg    Config
	log    *zap.Logger
	job    string
	secret []byte
	ln     *net.TCPListener
	addr   string   // published address
	self   identity // this process, as told to peers in handshakes

	mu     sync.Mutex
	refs   int
	regs   map[regKey]*registration
	live   map[net.Conn]struct{} // connections in handshake
	closed bool
	wg     sync.WaitGroup
	sem    chan struct{}

	accepted atomic.Int64 // handshakes that produced a connection
	refused  atomic.Int64 // inbound connections refused
	late     atomic.Int64 // handshakes that completed after their comm stopped forming

	// beforeHandoff, if set (tests only), runs in serve after the dialer
	// was told it is connected and before the connection is handed over.
	beforeHandoff func(*net.TCPConn)
}

type regKey struct {
	prefix string
	epoch  uint64
	rank   int
}

// registration is a comm (prefix, epoch, rank) waiting for peers to dial it.
type registration struct {
	key  regKey
	size int
	want []bool // ranks still expected to dial (guarded by node.mu)
	// resync: ranks that would dial but whose connection of the comm
	// being replaced is resynchronised instead, until it breaks (expect)
	// (guarded by node.mu).
	resync []bool
	ch     chan inbound
}

type inbound struct {
	conn *net.TCPConn
	from int
	id   identity // the dialer's
	shm  *shmSeg  // the link's shared memory, or nil
}

func newNode(cfg *Config, log *zap.Logger, job string, secret []byte) (*node, error) {
	l, err := net.Listen("tcp", cfg.ListenAddr)
	if err != nil {
		return nil, fmt.Errorf("gloo: listen on %s: %w", cfg.ListenAddr, err)
	}
	ln := l.(*net.TCPListener)
	addr := ln.Addr().(*net.TCPAddr)
	host := addr.IP.String()
	if cfg.AdvertiseHost != "" {
		host = cfg.AdvertiseHost
	}
	n := &node{
		cfg: *cfg, log: log, job: job, secret: secret, ln: ln,
		addr: net.JoinHostPort(host, strconv.Itoa(addr.Port)),
		refs: 1, regs: map[regKey]*registration{}, live: map[net.Conn]struct{}{},
		sem:  make(chan struct{}, cfg.MaxPendingHandshakes),
		self: localIdentity(),
	}
	if cfg.SharedMemory {
		n.self.flags |= idFlagShm
	}
	n.wg.Add(1)
	go n.acceptLoop()
	return n, nil
}

func (n *node) ref() {
	n.mu.Lock()
	n.refs++
	n.mu.Unlock()
}

// release drops a reference; the last one closes the listener and waits
// for the accept loop and every handshake goroutine to exit.
func (n *node) release() {
	n.mu.Lock()
	n.refs--
	if n.refs > 0 || n.closed {
		n.mu.Unlock()
		return
	}
	n.closed = true
	for c := range n.live {
		c.Close()
	}
	n.mu.Unlock()
	n.ln.Close()
	n.wg.Wait()
}

func (n *node) register(prefix string, epoch uint64, rank, size int, want, resync []bool) (*registration, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	k := regKey{prefix, epoch, rank}
	if _, dup := n.regs[k]; dup {
		return nil, fmt.Errorf("gloo: rank %d of %s epoch %d is already forming here", rank, prefix, epoch)
	}
	r := &registration{key: k, size: size, want: want, resync: resync, ch: make(chan inbound, size)}
	n.regs[k] = r
	return r, nil
}

// expect lets rank from dial reg again (its reused connection broke).
func (n *node) expect(reg *registration, from int) {
	n.mu.Lock()
	reg.want[from] = true
	reg.resync[from] = false
	n.mu.Unlock()
}

// unregister removes reg and closes connections delivered to it but not
// taken. Connections are delivered only under n.mu while reg is registered
// (see serve), so none can arrive after it returns.
func (n *node) unregister(reg *registration) {
	n.mu.Lock()
	if n.regs[reg.key] == reg {
		delete(n.regs, reg.key)
	}
	n.mu.Unlock()
	for {
		select {
		case in := <-reg.ch:
			in.conn.Close()
			in.shm.unmap()
		default:
			return
		}
	}
}

func (n *node) acceptLoop() {
	defer n.wg.Done()
	var delay time.Duration
	for {
		c, err := n.ln.AcceptTCP()
		if err != nil {
			n.mu.Lock()
			closed := n.closed
			n.mu.Unlock()
			if closed || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors or similar: back off briefly, keep serving.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			n.log.Warn("gloo: accept failed", zap.Error(err), zap.Duration("retry_in", delay))
			t := time.NewTimer(delay)
			<-t.C
			continue
		}
		delay = 0
		n.mu.Lock()
		if n.closed {
			n.mu.Unlock()
			c.Close()
			return
		}
		select {
		case n.sem <- struct{}{}:
		default:
			n.mu.Unlock()
			n.refused.Add(1)
			n.log.Warn("gloo: refused inbound connection", zap.String("remote", c.RemoteAddr().String()),
				zap.String("reason", "too many handshakes in progress"))
			writeRefusal(c, refuseBusy, "too many handshakes in progress")
			c.Close()
			continue
		}
		n.live[c] = struct{}{}
		n.wg.Add(1)
		n.mu.Unlock()
		go n.serve(c)
	}
}

func (n *node) refuse(c *net.TCPConn, code refusal, reason string, fields ...zap.Field) {
	n.refused.Add(1)
	n.log.Warn("gloo: refused inbound connection", append([]zap.Field{zap.String("remote", c.RemoteAddr().String()),
		zap.Stringer("code", code), zap.String("reason", reason)}, fields...)...)
	writeRefusal(c, code, reason)
}

// serve runs the listener's side of one handshake. It exits within
// HandshakeTimeout, or at once when the node closes.
func (n *node) serve(c *net.TCPConn) {
	handed := false
	var seg *shmSeg
	defer func() {
		n.mu.Lock()
		delete(n.live, c)
		n.mu.Unlock()
		if !handed {
			c.Close()
			seg.unmap()
		}
		<-n.sem
		n.wg.Done()
	}()
	c.SetDeadline(time.Now().Add(n.cfg.HandshakeTimeout))
	h, raw, code, err := readHello(c)
	if err != nil {
		n.refuse(c, code, err.Error())
		return
	}
	fields := []zap.Field{zap.String("job", h.job), zap.String("prefix", h.prefix), zap.Uint64("epoch", h.epoch),
		zap.Int32("from", h.from), zap.Int32("to", h.to)}
	if h.job != n.job {
		n.refuse(c, refuseJob, fmt.Sprintf("job %q is not this node's job", h.job), fields...)
		return
	}
	n.mu.Lock()
	reg := n.regs[regKey{h.prefix, h.epoch, int(h.to)}]
	var known []uint64
	if reg == nil {
		for k := range n.regs {
			if k.prefix == h.prefix {
				known = append(known, k.epoch)
			}
		}
	}
	n.mu.Unlock()
	if reg == nil {
		why := "no comm of that prefix and rank is forming here"
		if len(known) > 0 {
			why = fmt.Sprintf("epoch %d is not forming here (forming: %v)", h.epoch, known)
			if h.epoch < minU64(known) {
				why = fmt.Sprintf("stale epoch %d (forming: %v)", h.epoch, known)
			}
		}
		n.refuse(c, refuseEpoch, why, fields...)
		return
	}
	if int(h.size) != reg.size || h.from <= h.to || int(h.from) >= reg.size {
		n.refuse(c, refuseRank, fmt.Sprintf("rank %d of size %d may not dial rank %d of size %d", h.from, h.size, h.to, reg.size), fields...)
		return
	}
	if err := serverChallenge(c, n.secret, raw, n.self); err != nil {
		n.refused.Add(1)
		n.log.Warn("gloo: refused inbound connection", append([]zap.Field{zap.String("remote", c.RemoteAddr().String()), zap.Error(err)}, fields...)...)
		return
	}
	n.mu.Lock()
	if n.regs[reg.key] != reg {
		// The comm gave up forming (its ctx ended) during the handshake.
		n.mu.Unlock()
		n.refuse(c, refuseEpoch, fmt.Sprintf("epoch %d stopped forming here", h.epoch), fields...)
		return
	}
	if !reg.want[h.from] {
		resyncing := reg.resync[h.from]
		n.mu.Unlock()
		if resyncing {
			// The dialer has dropped the connection this end still
			// resynchronises (it broke there first); this end drops it
			// once it reads the close, and expects the dialer then: a
			// refusal to try again, not to give up on the comm.
			n.refuse(c, refuseBusy, fmt.Sprintf("rank %d's connection of the comm before is still being resynchronised here", h.from), fields...)
			return
		}
		n.refuse(c, refuseRank, fmt.Sprintf("rank %d is already connected", h.from), fields...)
		return
	}
	reg.want[h.from] = false
	n.mu.Unlock()
	_, err = c.Write([]byte{0})
	if err == nil {
		seg, err = n.serverShm(c, &h.id, int(h.size), fields)
	}
	if err != nil {
		n.expect(reg, int(h.from))
		n.log.Warn("gloo: inbound handshake failed", append([]zap.Field{zap.Error(err)}, fields...)...)
		return
	}
	c.SetDeadline(time.Time{})
	tune(c, &n.cfg)
	if n.beforeHandoff != nil {
		n.beforeHandoff(c)
	}
	// Hand over only while the comm still forms: a connection queued on a
	// registration that unregister has already drained would never be
	// taken or closed (until a GC finalizer closed it, at some random later
	// moment, under the dialer's feet).
	n.mu.Lock()
	if n.regs[reg.key] == reg {
		select {
		case reg.ch <- inbound{conn: c, from: int(h.from), id: h.id, shm: seg}: // capacity size: always room
			handed = true
			// Counted before the comm can have formed and run (a count
			// taken after its first op must include this connection).
			n.accepted.Add(1)
		default:
		}
	}
	n.mu.Unlock()
	if !handed {
		n.late.Add(1)
		n.log.Info("gloo: closing an inbound connection whose comm stopped forming during its handshake", fields...)
		return
	}
}

func minU64(v []uint64) uint64 {
	m := v[0]
	for _, x := range v[1:] {
		m = min(m, x)
	}
	return m
}

func tune(c *net.TCPConn, cfg *Config) {
	c.SetNoDelay(true)
	if cfg.SocketBuffer > 0 {
		c.SetReadBuffer(cfg.SocketBuffer)
		c.SetWriteBuffer(cfg.SocketBuffer)
	}
	c.SetKeepAliveConfig(net.KeepAliveConfig{Enable: true, Idle: 5 * time.Second, Interval: time.Second, Count: 5})
}

// dial connects to addr and runs the dialer's handshake, retrying with
// exponential backoff while the peer is not ready, until ctx ends. It
// returns the connection and the listener's identity.
func (n *node) dial(ctx context.Context, addr string, h hello) (*net.TCPConn, identity, *shmSeg, error) {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = 10 * time.Millisecond
	bo.MaxInterval = 500 * time.Millisecond
	bo.MaxElapsedTime = 0 // bounded by ctx
	d := net.Dialer{Timeout: n.cfg.HandshakeTimeout}
	h.id = n.self
	var peerID identity
	var seg *shmSeg
	attempt := func() (*net.TCPConn, error) {
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		tc := c.(*net.TCPConn)
		stop := context.AfterFunc(ctx, func() { tc.SetDeadline(time.Unix(1, 0)) })
		peerID, err = clientHandshake(tc, n.secret, h, n.cfg.HandshakeTimeout)
		if err == nil {
			seg, err = n.clientShm(tc, &peerID, h.to)
		}
		if !stop() && err == nil {
			// The ctx ended as the handshake finished: its deadline may land
			// after the one the handshake cleared, leaving a connection whose
			// every read and write times out.
			err = fmt.Errorf("gloo: handshake: %w", context.Cause(ctx))
		}
		if err != nil {
			tc.Close()
			seg.unmap()
			seg = nil
			var r *errRefused
			if errors.As(err, &r) && !r.retryable() {
				return nil, backoff.Permanent(err)
			}
			return nil, err
		}
		tune(tc, &n.cfg)
		return tc, nil
	}
	c, err := backoff.RetryWithData(attempt, backoff.WithContext(bo, ctx))
	if err != nil {
		if ctx.Err() != nil {
			return nil, identity{}, nil, fmt.Errorf("gloo: connect to rank %d at %s: %w (last attempt: %v)", h.to, addr, context.Cause(ctx), err)
		}
		return nil, identity{}, nil, fmt.Errorf("gloo: connect to rank %d at %s: %w", h.to, addr, err)
	}
	return c, peerID, seg, nil
}

// Shared-memory setup, after a successful handshake, when both ends want
// it and run on one kernel in one pid namespace (see shm.go):
//
//	S→C offer:  status:u8 (0 offer, 1 none) fd:u32 ringSize:u32 lanes:u32 laneRing:u32 token[16]
//	C→S answer: status:u8 (0 mapped, 1 not)
//
// The link uses the segment if the listener offered it and the dialer
// mapped it; otherwise TCP. Both ends decide alike, from both identities.
const shmOfferLen = 1 + 4 + 4 + 4 + 4 + shmTokenLen

// shmWith reports whether a link with peer sets up shared memory.
func (n *node) shmWith(peer *identity) bool {
	return n.self.flags&idFlagShm != 0 && peer.flags&idFlagShm != 0 && n.self.SameProcessSpace(peer.Identity)
}

// serverShm runs the listener's side of the setup: the segment the link
// will use, nil for TCP, or an error if the connection broke.
func (n *node) serverShm(c net.Conn, peer *identity, size int, fields []zap.Field) (*shmSeg, error) {
	if !n.shmWith(peer) {
		return nil, nil
	}
	var offer [shmOfferLen]byte
	lanes, laneRing := n.shmLanes(size)
	seg, fd, token, err := createShm(n.cfg.SharedMemoryRing, lanes, laneRing)
	if err != nil {
		n.log.Info("gloo: no shared memory for a link to this host; it uses TCP", append([]zap.Field{zap.Error(err)}, fields...)...)
		offer[0] = 1
		_, err = c.Write(offer[:])
		return nil, err
	}
	defer unix.Close(fd) // the peer has opened it (or never will) once the answer is in
	binary.LittleEndian.PutUint32(offer[1:], uint32(fd))
	binary.LittleEndian.PutUint32(offer[5:], uint32(seg.ringSize))
	binary.LittleEndian.PutUint32(offer[9:], uint32(seg.lanes))
	binary.LittleEndian.PutUint32(offer[13:], uint32(seg.laneRing))
	copy(offer[17:], token[:])
	var ans [1]byte
	if _, err = c.Write(offer[:]); err == nil {
		_, err = io.ReadFull(c, ans[:])
	}
	if err != nil || ans[0] != 0 {
		seg.unmap()
		if err == nil {
			n.log.Info("gloo: the peer could not map the link's shared memory; it uses TCP", fields...)
		}
		return nil, err
	}
	return seg, nil
}

// clientShm runs the dialer's side of the setup with the listener, rank to.
func (n *node) clientShm(c net.Conn, peer *identity, to int32) (*shmSeg, error) {
	if !n.shmWith(peer) {
		return nil, nil
	}
	c.SetDeadline(time.Now().Add(n.cfg.HandshakeTimeout))
	defer c.SetDeadline(time.Time{})
	var offer [shmOfferLen]byte
	if _, err := io.ReadFull(c, offer[:]); err != nil {
		return nil, fmt.Errorf("gloo: shared-memory offer: %w", err)
	}
	if offer[0] != 0 {
		return nil, nil
	}
	var token [shmTokenLen]byte
	copy(token[:], offer[17:])
	le := binary.LittleEndian
	seg, err := openShm(peer.Pid, int(le.Uint32(offer[1:])), int(le.Uint32(offer[5:])), int(le.Uint32(offer[9:])), int(le.Uint32(offer[13:])), token)
	ans := []byte{0}
	if err != nil {
		n.log.Info("gloo: cannot map the shared memory of a link; it uses TCP", zap.Int32("to", to), zap.Error(err))
		ans[0] = 1
	}
	if _, werr := c.Write(ans); werr != nil {
		seg.unmap()
		return nil, fmt.Errorf("gloo: shared-memory answer: %w", werr)
	}
	return seg, nil
}
