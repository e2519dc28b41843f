package gloo

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

// Lanes: a large all-reduce over shared memory spread over several cores.
//
// One goroutine moving one ring all-reduce through one ring per link runs
// at one core's copy and reduction speed, far below what a host with many
// cores can move. A segment may therefore hold extra lanes: further ring
// pairs, each used by one lane helper goroutine of each end. A large
// all-reduce whose ring neighbours are both shared-memory links is cut
// into L contiguous parts; the op goroutine runs part 0 as usual (lane 0,
// through the posted receives), and helper i runs part i as its own
// pipelined ring through lane i of the same two links, polling its rings
// and parking like the op goroutine. L is agreed on in the descriptor
// agreement (the minimum over the ranks of what each can use: the lanes
// of its two ring links, its share of the host's CPUs, Config's bound, and
// one lane per laneMinBytes of message), so every rank cuts alike.
//
// Lane frames carry the op's descriptor, sequence number and step as lane
// 0's do, and are checked before a byte is used; since they flow only
// after the agreement, one that does not match is malformed (the link is
// dropped). A failure or abort breaks the backend, which every helper
// watches; the op returns only once every helper has stopped touching its
// buffer. A helper cut off mid-frame leaves its lane out of step until the
// resync of the next epoch, whose frame carries every lane's position.
//
// Helpers are started by the first all-reduce that uses lanes and exit in
// Close.

const (
	// laneMinBytes: a lane gets at least this much of the message.
	laneMinBytes = 1 << 20
	// laneRing is the size of each ring of lanes 1.. (lane 0's is
	// Config.SharedMemoryRing).
	laneRing = 512 << 10
	// autoLanesMax bounds the lanes Config.SharedMemoryLanes 0 picks.
	autoLanesMax = 8
	// laneSpin is how long a lane helper polls before it parks: longer
	// than the op goroutine's shmSpin, since a helper waits only inside a
	// large all-reduce that its partner lane is running too, and every
	// lane's wake goes through the link's one TCP connection and reader,
	// so parked lanes wait for each other's wakes in turn. (Against 100 µs
	// on the 16-core host, 2 interleaved rounds, 2026-11-23: no difference
	// beyond the noise; it did not stop the 2-rank swings between rounds.)
	laneSpin = time.Millisecond
)

// autoLanes is how many lanes a rank of a comm of size ranks on this host
// may use: its share of the CPUs, no more than this process's GOMAXPROCS
// (lanes beyond it cannot run at once), at most autoLanesMax. (Leaving one
// core in eight to the rest of the host was tried on the 16-core host,
// 2026-11-23: 8 ranks × 1 lane moved 1.6–1.9 GB/s at 16–64 MiB against
// 2.0–2.8 for 8 × 2, 4 × 3 no better than 4 × 4, and the swings between
// rounds stayed.)
func autoLanes(size int) int {
	return max(1, min(autoLanesMax, runtime.GOMAXPROCS(0), runtime.NumCPU()/max(size, 1)))
}

// shmLanes is the lane count and lane ring size of the segments this node
// offers to a comm of size ranks.
func (n *node) shmLanes(size int) (int, int) {
	k := n.cfg.SharedMemoryLanes
	if k == 0 {
		k = autoLanes(size)
	}
	if k <= 1 {
		return 1, 0
	}
	return min(k, shmMaxLanes), laneRing
}

// laneJob is one helper's share of an all-reduce.
type laneJob struct {
	d   desc
	seq uint64
	t   []byte
	seg int // the pipelining unit agreed on
	err error
}

// lanesWanted is how many lanes this rank can use for an all-reduce of
// nbytes (1: none).
func (b *Backend) lanesWanted(nbytes int) int {
	n, r := b.size, b.rank
	left, right := b.links[mod(r-1, n)], b.links[mod(r+1, n)]
	if left.shm == nil || right.shm == nil {
		return 1
	}
	k := b.cfg.SharedMemoryLanes
	if k == 0 {
		onHost := 1
		for _, l := range b.links {
			if l != nil && l.shm != nil {
				onHost++
			}
		}
		k = autoLanes(onHost)
	}
	return max(1, min(k, len(left.shm.lanes), len(right.shm.lanes), nbytes/laneMinBytes))
}

// startLanes makes sure helpers 1..k-1 run.
func (b *Backend) startLanes(k int) {
	for i := int(b.laneHelpers.Load()) + 1; i < k; i++ {
		b.laneGo[i] = make(chan struct{}, 1)
		b.laneWake[i] = make(chan struct{}, 1)
		b.wg.Add(1)
		go b.laneHelper(i)
		b.laneHelpers.Store(int32(i)) // publishes laneWake[i] to pokeLane
	}
}

// laneHelper runs lane i's share of each all-reduce it is handed; it exits
// when b is closed.
func (b *Backend) laneHelper(i int) {
	defer b.wg.Done()
	for {
		select {
		case <-b.laneGo[i]:
			j := &b.laneJobs[i]
			j.err = b.runLane(i, j)
			b.laneDone <- i
		case <-b.quit:
			return
		}
	}
}

// pokeLane wakes the waiter of lane i if it is parked.
func (b *Backend) pokeLane(i int) {
	if i == 0 || i > int(b.laneHelpers.Load()) {
		b.poke()
		return
	}
	select {
	case b.laneWake[i] <- struct{}{}:
	default:
	}
}

// pokeAll wakes every waiter (a link closed).
func (b *Backend) pokeAll() {
	b.poke()
	for i := 1; i <= int(b.laneHelpers.Load()); i++ {
		b.pokeLane(i)
	}
}

// allReduceLanes runs t as k parts: part 0 here, part i on helper i.
func (b *Backend) allReduceLanes(ctx context.Context, d desc, seq uint64, t []byte, k, seg int) error {
	es := d.dtype.Size()
	count := len(t) / es
	part := func(i int) []byte { return t[i*count/k*es : (i+1)*count/k*es] }
	b.startLanes(k)
	for i := 1; i < k; i++ {
		b.laneJobs[i] = laneJob{d: d, seq: seq, t: part(i), seg: seg}
		b.laneGo[i] <- struct{}{}
	}
	b.inLanes = true
	err := b.ringBody(ctx, d, seq, part(0), seg)
	b.inLanes = false
	if err != nil && !b.isBroken() {
		// The helpers must stop too (they watch b, not the ctx).
		b.breakWith(faultInfo{nt: abortNotice(b.opType(), b.rank, err), err: fmt.Errorf("gloo: %w: %w", comm.ErrAborted, err)})
	}
	for left := k - 1; left > 0; {
		select {
		case i := <-b.laneDone:
			left--
			if e := b.laneJobs[i].err; e != nil && err == nil {
				err = e
			}
			b.laneJobs[i] = laneJob{}
		case <-ctx.Done():
			if !b.isBroken() {
				b.Abort(ctxEnded(ctx))
			}
			ctx = context.Background() // now wait for the helpers to stop
		}
	}
	return err
}

// laneRun is helper i's state during one all-reduce: it receives lane i
// of link rl (from the left neighbour) and sends lane i of link tl (to the
// right one).
type laneRun struct {
	b    *Backend
	i    int
	g    ringGeom
	d    desc
	seq  uint64
	rl   *link
	rz   *shmLane
	tl   *link
	tz   *shmLane
	done []bool // by wavefront position... indexed p*steps+s: the block has arrived
	sp   spinner
	// the frame being taken: its block and how much of it is done
	on      bool
	p, s    int
	n, need uint64
	got     uint64
	next    int // wavefront position of the next block to take
}

// runLane is lane i's share of an all-reduce: a pipelined ring over j.t,
// in the same wavefront as ringBody runs lane 0's, through lane i of the
// links to the ring neighbours.
func (b *Backend) runLane(i int, j *laneJob) error {
	n, r := b.size, b.rank
	es, count := j.d.dtype.Size(), len(j.t)/j.d.dtype.Size()
	steps := 2 * (n - 1)
	per := max(j.seg/es, 1) * n
	pieces := max(1, (count+per-1)/per)
	rl, tl := b.links[mod(r-1, n)], b.links[mod(r+1, n)]
	w := &b.laneRuns[i]
	*w = laneRun{b: b, i: i, d: j.d, seq: j.seq, rl: rl, rz: rl.shm.lanes[i], tl: tl, tz: tl.shm.lanes[i],
		g:    ringGeom{n: n, r: r, es: es, count: count, pieces: pieces, steps: steps, t: j.t},
		done: b.laneMarks(i, pieces*steps)}
	defer func() { *w = laneRun{} }()
	for dg := 0; dg < pieces+steps-1; dg++ {
		for s := max(0, dg-pieces+1); s <= min(dg, steps-1); s++ {
			p := dg - s
			if s > 0 {
				if err := w.waitFor(p*steps + s - 1); err != nil {
					return err
				}
			}
			if err := w.send(p, s); err != nil {
				return err
			}
		}
	}
	for k := range w.done {
		if err := w.waitFor(k); err != nil {
			return err
		}
	}
	return nil
}

// waitFor takes arriving blocks until block k (p*steps+s) is complete.
func (w *laneRun) waitFor(k int) error {
	for !w.done[k] {
		moved, err := w.take()
		if err != nil {
			return err
		}
		if moved {
			w.sp.reset()
			continue
		}
		if err := w.idle(0); err != nil {
			return err
		}
	}
	return nil
}

// send writes block (p, s) as one frame into the tx lane, taking arriving
// blocks whenever the ring is full.
func (w *laneRun) send(p, s int) error {
	g, d := &w.g, &w.d
	c := g.r
	if s > 0 {
		c = g.recvChunk(s - 1)
	}
	data := g.chunk(p, c)
	if s == g.n-1 && d.redop == comm.Avg {
		reduce.Divide(d.dtype, data, g.n) // this rank's reduced block
	}
	h := header{typ: frameOp, d: *d, tag: uint32(s), seq: w.seq, length: uint32(len(data))}
	h.encode(w.tz.txHdr[:])
	if err := w.put(w.tz.txHdr[:]); err != nil {
		return err
	}
	if err := w.put(data); err != nil {
		return err
	}
	if pad := uint64(pad8(len(data)) - len(data)); pad > 0 {
		for {
			ok, err := w.b.lanePad(w.tl, w.tz, pad)
			if err != nil {
				return err
			}
			if ok {
				break
			}
			if err := w.stall(pad); err != nil {
				return err
			}
		}
	}
	w.b.lanePublish(w.tl, w.tz, w.i)
	return nil
}

// put copies src into the tx lane as room allows.
func (w *laneRun) put(src []byte) error {
	for len(src) > 0 {
		k, err := w.b.lanePut(w.tl, w.tz, w.i, src)
		if err != nil {
			return err
		}
		if k > 0 {
			src = src[k:]
			w.sp.reset()
			continue
		}
		if err := w.stall(1); err != nil {
			return err
		}
	}
	return nil
}

// stall waits for n bytes of room in the tx lane, taking arriving blocks
// meanwhile (the left neighbour may be waiting for room in its ring to
// this rank, and the right one for what it gets from it).
func (w *laneRun) stall(n uint64) error {
	moved, err := w.take()
	if err != nil {
		return err
	}
	if moved {
		w.sp.reset()
		return nil
	}
	return w.idle(n)
}

// take takes what has arrived of the blocks the rx lane brings, in
// wavefront order, reducing (reduce-scatter steps) or copying (all-gather
// steps) straight from the ring into the buffer; done is set as each
// block completes.
func (w *laneRun) take() (bool, error) {
	s := w.rl.shm
	s.mu.RLock()
	moved, err := w.takeLocked()
	s.mu.RUnlock()
	if err != nil {
		return moved, w.b.laneCorrupt(w.rl, err)
	}
	return moved, nil
}

func (w *laneRun) takeLocked() (bool, error) {
	l, z, g, d := w.rl, w.rz, &w.g, &w.d
	if !l.shm.live || l.isClosed() {
		return false, errLocal
	}
	if w.b.isBroken() {
		return false, errLaneBroken
	}
	moved := false
	for {
		if !w.on {
			if w.next == len(w.done) {
				return moved, nil
			}
			if z.skipSet.Load() { // the first op after a resync
				l.mu.Lock()
				pos := z.skipTo
				z.skipSet.Store(false)
				z.lost = false
				l.mu.Unlock()
				if pos-z.rxPos > z.rx.size || z.rx.head.Load()-pos > z.rx.size {
					return moved, errShmCorrupt
				}
				if pos != z.rxPos {
					l.consume(z, w.i, pos-z.rxPos)
					moved = true
				}
			}
			if z.lost { // the helper's own: no lock on the polling path
				return moved, fmt.Errorf("%w: lane %d lost its place in the stream", errLaneLost, w.i)
			}
			avail, err := z.rxAvail()
			if err != nil {
				return moved, err
			}
			if avail < headerSize {
				return moved, nil
			}
			off := z.rxPos & z.rx.mask
			if k := copy(z.rxHdr[:], z.rx.data[off:]); k < headerSize {
				copy(z.rxHdr[k:], z.rx.data)
			}
			h, err := decodeHeader(z.rxHdr[:])
			if err != nil {
				return moved, err
			}
			p, st := g.wavefront(w.next)
			blk := g.chunk(p, g.recvChunk(st))
			if h.typ != frameOp || h.d != *d || h.seq != w.seq || h.tag != uint32(st) || int(h.length) != len(blk) {
				return moved, fmt.Errorf("%w: lane %d frame %s %s #%d step %d of %d bytes, expected %s #%d step %d of %d bytes",
					errMalformed, w.i, h.typ, h.d, h.seq, h.tag, h.length, *d, w.seq, st, len(blk))
			}
			l.consume(z, w.i, headerSize)
			w.on, w.p, w.s, w.n, w.need, w.got = true, p, st, uint64(len(blk)), uint64(pad8(len(blk))), 0
			z.lost = true // until the frame is complete: a failure leaves it half taken
			moved = true
		}
		avail, err := z.rxAvail()
		if err != nil {
			return moved, err
		}
		if w.got < w.n {
			off := z.rxPos & z.rx.mask
			k := min(avail, w.n-w.got, z.rx.size-off)
			k -= k % uint64(g.es)
			if k == 0 {
				return moved, nil
			}
			dst := g.chunk(w.p, g.recvChunk(w.s))[w.got : w.got+k]
			src := z.rx.data[off : off+k]
			if w.s < g.n-1 {
				reduce.Into(d.dtype, d.redop, dst, src)
			} else {
				copy(dst, src)
			}
			l.consume(z, w.i, k)
			w.got += k
			moved = true
			if w.got < w.n {
				continue
			}
			if avail, err = z.rxAvail(); err != nil {
				return moved, err
			}
		}
		pad := w.need - w.n
		if avail < pad {
			return moved, nil
		}
		if pad > 0 {
			l.consume(z, w.i, pad)
		}
		z.lost = false
		l.heard()
		w.done[w.p*g.steps+w.s] = true
		w.on = false
		w.next++
		moved = true
	}
}

// idle is one round of waiting with nothing to do, for data on the rx
// lane or (wantTx > 0) that much room on the tx lane: a poll while the
// spin (laneSpin) lasts, then a park until a wake frame for this lane or a failure,
// announced in both links and preceded by one more look.
func (w *laneRun) idle(wantTx uint64) error {
	b := w.b
	if b.isBroken() {
		return b.err()
	}
	sp := &w.sp
	sp.rounds++
	if sp.rounds%spinClock == 1 {
		now := time.Now()
		if sp.since.IsZero() {
			sp.since = now
		}
		if now.Sub(sp.since) >= laneSpin {
			sp.reset()
			setLaneAsleep(w.rl, w.rz, 1)
			setLaneAsleep(w.tl, w.tz, 1)
			moved, err := w.take()
			if err == nil && !moved && !w.roomFor(wantTx) && !b.isBroken() && !w.rl.isClosed() && !w.tl.isClosed() {
				select {
				case <-b.laneWake[w.i]:
				case <-b.broken:
				}
			}
			setLaneAsleep(w.rl, w.rz, 0)
			setLaneAsleep(w.tl, w.tz, 0)
			return err
		}
	}
	spin(b.crowded, false, sp.rounds)
	return nil
}

// roomFor reports whether the tx lane has n bytes of room (n > 0).
func (w *laneRun) roomFor(n uint64) bool {
	if n == 0 {
		return false
	}
	s := w.tl.shm
	s.mu.RLock()
	defer s.mu.RUnlock()
	if !s.live {
		return true
	}
	f, err := w.tz.txFree()
	return err != nil || f >= n
}

func setLaneAsleep(l *link, z *shmLane, v uint32) {
	l.shm.mu.RLock()
	if l.shm.live {
		z.myAsleep.Store(v)
	}
	l.shm.mu.RUnlock()
}

// laneMarks returns lane i's scratch of k flags, cleared.
func (b *Backend) laneMarks(i, k int) []bool {
	if cap(b.laneDoneFlags[i]) < k {
		b.laneDoneFlags[i] = make([]bool, k)
	}
	m := b.laneDoneFlags[i][:k]
	clear(m)
	return m
}

// ringGeom is the shape of a pipelined ring all-reduce over t (see ringBody).
type ringGeom struct {
	n, r, es, count, pieces, steps int
	t                              []byte
}

// chunk returns block c (mod n) of piece p.
func (g *ringGeom) chunk(p, c int) []byte {
	lo, hi := p*g.count/g.pieces, (p+1)*g.count/g.pieces
	pc := hi - lo
	c = mod(c, g.n)
	return g.t[(lo+c*pc/g.n)*g.es : (lo+(c+1)*pc/g.n)*g.es]
}

// recvChunk: step s receives chunk r-s-1 (reduce-scatter, s < n-1) or
// r-s+n-1 (all-gather).
func (g *ringGeom) recvChunk(s int) int {
	if s < g.n-1 {
		return g.r - s - 1
	}
	return g.r - s + g.n - 1
}

// wavefront returns the block at position k of the wavefront order
// (diagonal by diagonal, lower steps first), in which every rank sends,
// and so receives, its blocks.
func (g *ringGeom) wavefront(k int) (p, s int) {
	for dg := 0; ; dg++ {
		lo, hi := max(0, dg-g.pieces+1), min(dg, g.steps-1)
		if k <= hi-lo {
			s = lo + k
			return dg - s, s
		}
		k -= hi - lo + 1
	}
}

// lanePut copies what fits of src into lane z's tx ring (link l), and
// publishes every shmPublish bytes. It returns how much it took.
func (b *Backend) lanePut(l *link, z *shmLane, lane int, src []byte) (int, error) {
	s := l.shm
	s.mu.RLock()
	k, err := b.lanePutLocked(l, z, lane, src)
	s.mu.RUnlock()
	if err != nil {
		return 0, b.laneCorrupt(l, err)
	}
	return k, nil
}

func (b *Backend) lanePutLocked(l *link, z *shmLane, lane int, src []byte) (int, error) {
	if !l.shm.live || l.isClosed() {
		return 0, errLocal
	}
	if b.isBroken() {
		return 0, errLaneBroken
	}
	f, err := z.txFree()
	if err != nil {
		return 0, err
	}
	if f == 0 {
		l.publish(z, lane) // the consumer may be waiting for what this side holds back
		return 0, nil
	}
	off := z.txPos & z.tx.mask
	k := min(uint64(len(src)), f, z.tx.size-off)
	copy(z.tx.data[off:off+k], src[:k])
	z.txPos += k
	if z.txPos-z.txPub >= shmPublish {
		l.publish(z, lane)
	}
	return int(k), nil
}

// lanePad adds n bytes of padding to lane z's tx ring if there is room.
func (b *Backend) lanePad(l *link, z *shmLane, n uint64) (bool, error) {
	s := l.shm
	s.mu.RLock()
	ok, err := false, error(nil)
	switch {
	case !s.live || l.isClosed():
		err = errLocal
	case b.isBroken():
		err = errLaneBroken
	default:
		var f uint64
		if f, err = z.txFree(); err == nil && f >= n {
			z.txPos += n
			ok = true
		}
	}
	s.mu.RUnlock()
	if err != nil {
		return false, b.laneCorrupt(l, err)
	}
	return ok, nil
}

func (b *Backend) lanePublish(l *link, z *shmLane, lane int) {
	s := l.shm
	s.mu.RLock()
	if s.live {
		l.publish(z, lane)
	}
	s.mu.RUnlock()
}

var (
	errLaneBroken = errors.New("gloo: lane stopped: the comm failed")
	errLaneLost   = errors.New("gloo: shared-memory lane out of step")
)

// laneGone is the error of a helper whose link closed under it.
func (b *Backend) laneGone(l *link) error {
	if err := b.err(); err != nil {
		return err
	}
	return fmt.Errorf("gloo: %w: a shared-memory link closed during the op", comm.ErrAborted)
}

// laneCorrupt fails link l for a malformed lane (or returns the comm's
// error if that is why the helper stops).
func (b *Backend) laneCorrupt(l *link, err error) error {
	switch {
	case err == errLaneBroken:
		return b.err()
	case err == errLocal:
		return b.laneGone(l)
	case errors.Is(err, errLaneLost):
		return fmt.Errorf("gloo: %w: %w", comm.ErrAborted, err)
	}
	l.log.Warn("gloo: dropping connection after a malformed shared-memory lane", zap.String("remote", l.remote), zap.Error(err))
	l.fail(err)
	if e := b.err(); e != nil {
		return e
	}
	return fmt.Errorf("gloo: %w: %w", comm.ErrAborted, err)
}
