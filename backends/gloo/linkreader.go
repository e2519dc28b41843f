package gloo

import (
	"errors"
	"fmt"
	"os"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

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
	l.heardAt.Mark(l.now())
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
//
// The counts are raised before l.mu is released: cancelPosts takes l.mu
// and returns at once when no entry is being filled, and the next op's
// begin reads the counts as its starting marks. Raised after the unlock,
// an entry of a cancelled op (a refused collective) could count towards
// the next op's first receive on this link, which would then "complete"
// with nothing in it: a silently wrong result.
func (l *link) finishLocked(n int, poke bool) {
	p := &l.posts[l.phead]
	seq := p.seq
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
	l.rxBytes.Add(int64(n))
	if complete {
		l.rxDone.Add(1)
	}
	b, peer := l.owner, l.peer
	l.mu.Unlock()
	if complete {
		if h := b.testDelivered.Load(); h != nil {
			(*h)(peer, seq)
		}
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
