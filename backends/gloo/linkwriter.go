package gloo

import (
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

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
