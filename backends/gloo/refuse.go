package gloo

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/ftcomm/ftcomm/comm"
)

// Refused ops: a rank that refuses an op (its arguments failed
// validation: comm.Refuser) still takes the op's place in its sequence and
// says so on its links, so that the peers' matching op fails at once with
// comm.ErrPeerRefused instead of waiting for its deadline, and nothing
// breaks.
//
// The marker is a frameRefused, sent on the data path (the socket of a TCP
// link, the ring of a shared-memory one) by the op goroutine, so that on
// each link it lies between the frames of the ops before it and those of
// the ops after it. Its header carries the refused op's kind (op), the
// refusing rank (root), what is refused (tag: refusedColl, refusedRecv,
// refusedSend, refusedStray) and the collective or message number (seq);
// its payload is the reason.
//
// Collectives. The refusing rank consumes the op's number S and sends a
// marker for S to every peer. A rank that learns of it (from any marker)
// fails its op S — at once if it is running, at its start if it has not
// started — and, before it sends anything of a later op, sends its own
// marker for S on every link. So on every link exactly one marker for S
// arrives, after every frame its sender sent for S and before every frame
// of its later ops: a receiver drops frames numbered S once it knows S is
// refused, holds (rather than calls a mismatch) frames of later ops that
// meet a receive posted for S, and forgets S once every peer's marker for
// it has arrived and its own op S is over. No rank's op S can complete
// (each needs the refusing rank), so no buffer of it is written.
//
// Point-to-point messages are numbered per link and direction. A refused
// send to a peer consumes its number k and tells the peer (refusedRecv),
// whose receive numbered k — running or still to come — completes empty
// and fails. A refused receive from a peer consumes its number k, drops
// whatever the peer sends numbered below k+1, and tells the peer
// (refusedSend), whose send numbered k stops and fails if it has not
// finished; one that has (a send completes once its data is handed to the
// transport) succeeded, and its data is dropped. A batch's other sends and
// receives run to completion; then the batch fails with the refusal. A
// send refused for its peer (outside the comm, or this rank) names no one:
// every peer is told (refusedStray, seq this rank's next message number to
// it, not consumed), and there the next op that receives message seq from
// this rank fails, its receives from this rank numbered seq and up
// completing empty and giving their numbers back: the rank it was meant
// for fails, whenever it gets to it, and a rank it was not meant for
// fails its next receive from this rank once, loudly, rather than take the
// data of another send for it. A receive refused for its peer tells no
// one.

// What a frameRefused refuses (its tag).
const (
	refusedColl  = 0 // the collective numbered seq
	refusedRecv  = 1 // the sender's message seq to the receiver: the receive of it fails
	refusedSend  = 2 // the receiver's message seq to the sender: the send of it fails
	refusedStray = 3 // a send naming no valid peer; seq is the sender's next message number to the receiver
)

// refusable reports whether op is one a rank may refuse: a collective or
// a point-to-point op.
func refusable(op comm.OpType) bool {
	return op != comm.OpNone && (op <= comm.OpBatchP2P || op == comm.OpReduceScatterV)
}

// collRefusal is a collective some rank refused, as this rank knows it.
type collRefusal struct {
	seq     uint64
	origin  int // the refusing rank (the first one heard of)
	op      comm.OpType
	reason  string
	heard   int  // markers received for it (one from each peer)
	settled bool // this rank's op of that number is over (or was refused here)
}

// p2pRefusal is a point-to-point message that will not come (receive
// side) or must not be sent (send side).
type p2pRefusal struct {
	seq    uint64
	origin int
	op     comm.OpType
	reason string
	stray  bool // refusedStray: the receives numbered seq and up of one op, not consumed
	taken  bool // (stray) it took receives of the op in progress: forgotten when it ends
}

func refusedErr(op comm.OpType, epoch uint64, origin int, what comm.OpType, reason string) error {
	return &comm.RankError{Rank: origin, Op: op, Epoch: epoch,
		Err: fmt.Errorf("gloo: %w", &comm.Refusal{Rank: origin, Op: what, Reason: reason})}
}

// ---- the refusing rank ----

// Refuse implements comm.Refuser: op takes its place in this rank's
// sequence of collectives or point-to-point messages, and the peers it
// concerns are told (see the comment at the top of this file).
func (b *Backend) Refuse(ctx context.Context, op comm.Op, reason error) error {
	if b.isBroken() {
		return b.err()
	}
	if b.size == 1 || !refusable(op.Kind) {
		return nil
	}
	b.curOp.Store(uint32(op.Kind))
	why := strings.TrimPrefix(reason.Error(), comm.ErrInvalidArgument.Error()+": ")
	var err error
	switch op.Kind {
	case comm.OpSend:
		err = b.refuseP2P(ctx, []comm.P2POp{{Kind: comm.P2PSend, Peer: op.Peer}}, why)
	case comm.OpRecv:
		err = b.refuseP2P(ctx, []comm.P2POp{{Kind: comm.P2PRecv, Peer: op.Peer}}, why)
	case comm.OpBatchP2P:
		err = b.refuseP2P(ctx, op.P2P, why)
	default:
		seq := b.collSeq + 1
		b.collSeq = seq
		b.rmu.Lock()
		e := b.collEntryLocked(seq, b.rank, op.Kind, why)
		e.settled = true
		b.retireLocked(e)
		b.rmu.Unlock()
		err = b.sendRefusals(ctx, op.Kind, seq, b.rank, why)
	}
	b.clearStrays()
	if err != nil {
		return err
	}
	return b.err() // nil unless a peer failed meanwhile
}

// refuseP2P refuses a send or receive per entry of ops (in order, as a
// batch would run them).
func (b *Backend) refuseP2P(ctx context.Context, ops []comm.P2POp, why string) error {
	stray := false
	for _, o := range ops {
		valid := o.Peer >= 0 && o.Peer < b.size && o.Peer != b.rank
		switch {
		case o.Kind == comm.P2PSend && !valid:
			stray = true
		case o.Kind == comm.P2PSend:
			l := b.links[o.Peer]
			seq := l.p2pTx
			l.p2pTx++
			if err := b.sendRefused(ctx, o.Peer, comm.OpSend, refusedRecv, seq, b.rank, why); err != nil {
				return err
			}
		case o.Kind == comm.P2PRecv && valid:
			l := b.links[o.Peer]
			seq := l.p2pRx
			l.p2pRx++
			l.dropBelow.Store(seq + 1)
			l.poke() // a frame of it may be held
			if err := b.sendRefused(ctx, o.Peer, comm.OpRecv, refusedSend, seq, b.rank, why); err != nil {
				return err
			}
		}
	}
	if !stray {
		return nil
	}
	for p, l := range b.links {
		if l != nil {
			if err := b.sendRefused(ctx, p, comm.OpSend, refusedStray, l.p2pTx, b.rank, why); err != nil {
				return err
			}
		}
	}
	return nil
}

// sendRefusals sends the marker of collective seq, refused by origin, to
// every peer.
func (b *Backend) sendRefusals(ctx context.Context, op comm.OpType, seq uint64, origin int, why string) error {
	for p, l := range b.links {
		if l != nil {
			if err := b.sendRefused(ctx, p, op, refusedColl, seq, origin, why); err != nil {
				return err
			}
		}
	}
	return nil
}

func (b *Backend) sendRefused(ctx context.Context, p int, op comm.OpType, tag uint32, seq uint64, origin int, why string) error {
	if len(why) > maxNoticeLen {
		why = why[:maxNoticeLen]
	}
	h := header{typ: frameRefused, d: desc{op: op, root: int32(origin)}, tag: tag, seq: seq}
	// Not the caller's ctx: the peers wait for this (the Comm's deadline
	// still bounds it, by aborting b).
	return b.sendFrame(context.WithoutCancel(ctx), p, &h, []byte(why))
}

// ---- collectives, at every rank ----

// collEntryLocked returns the entry of collective seq, made if new (b.rmu held).
func (b *Backend) collEntryLocked(seq uint64, origin int, op comm.OpType, why string) *collRefusal {
	for _, e := range b.refColl {
		if e.seq == seq {
			return e
		}
	}
	e := &collRefusal{seq: seq, origin: origin, op: op, reason: why}
	b.refColl = append(b.refColl, e)
	b.nRefColl.Add(1)
	return e
}

// retireLocked forgets e once no frame of its collective can arrive any
// more: every peer's marker is in and this rank's op is over (b.rmu held).
func (b *Backend) retireLocked(e *collRefusal) {
	if e.settled && e.heard >= b.size-1 {
		b.refColl = slices.DeleteFunc(b.refColl, func(x *collRefusal) bool { return x == e })
		b.nRefColl.Add(-1)
	}
}

// collRefused reports whether collective seq is known to be refused (its
// frames are dropped). Cheap while none is.
func (b *Backend) collRefused(seq uint64) bool {
	if b.nRefColl.Load() == 0 {
		return false
	}
	b.rmu.Lock()
	defer b.rmu.Unlock()
	for _, e := range b.refColl {
		if e.seq == seq {
			return true
		}
	}
	return false
}

// heardColl handles a marker for collective seq from peer: the op of that
// number stops if it runs (halt), and frames of it held on any link are
// dropped.
func (b *Backend) heardColl(peer int, seq uint64, origin int, op comm.OpType, why string) {
	b.rmu.Lock()
	e := b.collEntryLocked(seq, origin, op, why)
	e.heard++
	// opColl is stored before begin looks at nRefColl, and nRefColl was
	// raised before this load: begin sees the entry, or this sees opColl.
	halt := !e.settled && b.opColl.Load() == seq && b.haltErr == nil
	if halt {
		b.haltErr = refusedErr(b.opType(), b.epoch, e.origin, e.op, e.reason)
		b.haltRef = *e
		b.halted.Store(true)
	}
	b.retireLocked(e)
	b.rmu.Unlock()
	if halt {
		b.pokeAll()
	}
	for _, l := range b.linkList() {
		if l != nil {
			l.poke() // a reader holding a frame of seq drops it
		}
	}
}

// refusedAtBegin fails collective seq, about to start, if it is known to
// be refused: the number is consumed and the peers are told, as when the
// op fails running.
func (b *Backend) refusedAtBegin(ctx context.Context, seq uint64) error {
	b.rmu.Lock()
	var e *collRefusal
	for _, x := range b.refColl {
		if x.seq == seq && !x.settled {
			e = x
		}
	}
	if e == nil {
		b.rmu.Unlock()
		return nil
	}
	e.settled = true
	b.haltErr = nil // a marker may have halted the op as it began
	b.halted.Store(false)
	b.opColl.Store(0)
	err := refusedErr(b.opType(), b.epoch, e.origin, e.op, e.reason)
	origin, op, why := e.origin, e.op, e.reason
	b.retireLocked(e)
	b.rmu.Unlock()
	b.collSeq = seq
	serr := b.sendRefusals(ctx, op, seq, origin, why)
	b.clearStrays()
	if serr != nil {
		return serr
	}
	return err
}

// haltError returns the refusal that stopped the op in progress, or nil.
func (b *Backend) haltError() error {
	b.rmu.Lock()
	defer b.rmu.Unlock()
	return b.haltErr
}

// stopped returns why the op in progress must stop: b broke, or its
// collective was refused. Cheap while neither is the case.
func (b *Backend) stopped() error {
	if b.isBroken() {
		return b.err()
	}
	if b.halted.Load() {
		if err := b.haltError(); err != nil {
			return err
		}
	}
	return nil
}

// noteRefusal records a refusal that concerns the op in progress (a send
// or receive of it); the op fails with the first once it is done.
func (b *Backend) noteRefusal(err error) {
	b.rmu.Lock()
	if b.opRefusal == nil {
		b.opRefusal = err
	}
	b.anyOpRefusal.Store(true)
	b.rmu.Unlock()
}

// settleOp ends the op in progress as to refusals (op goroutine, from
// end): it returns the refusal the op fails with, or nil, and clears
// what this op noted. halt, when not nil, is the refused collective that
// stopped the op.
func (b *Backend) settleOp() (err error, halt *collRefusal) {
	if !b.halted.Load() && b.nRefColl.Load() == 0 && !b.anyOpRefusal.Load() {
		// No refusal can concern this op (one of a collective that could
		// still arrive would mean the op could not have ended well).
		b.opColl.Store(0)
		return nil, nil
	}
	b.rmu.Lock()
	defer b.rmu.Unlock()
	if b.haltErr != nil {
		// The refusal is kept (unsettled: a later op's frame that meets a
		// receive of the refused op is held) until the op has taken its
		// receives back: settleColl.
		ref := b.haltRef
		err, halt = b.haltErr, &ref
	} else if b.opRefusal != nil {
		err = b.opRefusal
	}
	b.haltErr, b.opRefusal = nil, nil
	b.halted.Store(false)
	b.anyOpRefusal.Store(false)
	b.opColl.Store(0)
	return err, halt
}

// settleColl records that this rank's op of collective seq is over and its
// receives are taken back, so the refusal may be forgotten once every
// peer's marker is in.
func (b *Backend) settleColl(seq uint64) {
	b.rmu.Lock()
	defer b.rmu.Unlock()
	for _, e := range b.refColl {
		if e.seq == seq {
			e.settled = true
			b.retireLocked(e)
			return
		}
	}
}

// ---- point to point, at the peers ----

// markRxLocked applies a receive-side refusal to the entries posted on l
// (l.mu held): the one numbered ref.seq (exact), or every point-to-point
// one numbered ref.seq and up (stray); an exact refusal that finds no
// entry is kept for the receive to come.
func (l *link) markRxLocked(ref *p2pRefusal) {
	found := false
	for i := l.phead; i < len(l.posts); i++ {
		e := &l.posts[i]
		if e.d.op != comm.OpSend || e.ref != nil {
			continue
		}
		if e.seq == ref.seq || ref.stray && e.seq > ref.seq {
			e.ref = ref
			found = true
			if ref.stray {
				l.strayRx(ref)
			}
		}
	}
	if !found || ref.stray {
		l.rxRef = append(l.rxRef, ref)
		if ref.stray {
			l.nStray.Add(1)
			if b := l.owner; b != nil {
				b.strays.Add(1)
			}
		}
	}
}

// strayRx notes that stray refusal ref took receives of the op in
// progress: the op gives their numbers back when it ends, and ref is
// forgotten (l.mu held).
func (l *link) strayRx(ref *p2pRefusal) {
	if !l.strayTook.Load() || ref.seq < l.strayFrom {
		l.strayFrom = ref.seq
	}
	ref.taken = true
	l.strayTook.Store(true)
}

// refuseEntryLocked marks e, about to be posted, if a recorded refusal
// covers it (l.mu held).
func (l *link) refuseEntryLocked(e *entry) {
	if len(l.rxRef) == 0 || e.d.op != comm.OpSend {
		return
	}
	for i, ref := range l.rxRef {
		switch {
		case ref.stray && e.seq >= ref.seq:
			e.ref = ref
			l.strayRx(ref)
			return
		case !ref.stray && e.seq == ref.seq:
			e.ref = ref
			l.rxRef = slices.Delete(l.rxRef, i, i+1)
			return
		}
	}
	// Receives are posted in the order of their numbers: an exact refusal
	// of an earlier number found no receive (this rank refused it too).
	l.rxRef = slices.DeleteFunc(l.rxRef, func(r *p2pRefusal) bool { return !r.stray && r.seq < e.seq })
}

// completeRefusedLocked completes, in order, the refused entries at the
// head of the posts: they count as delivered (no data comes), and the op
// learns why (l.mu held). It reports whether any was completed.
func (l *link) completeRefusedLocked() bool {
	done := false
	for !l.active && l.phead < len(l.posts) && l.posts[l.phead].ref != nil {
		e := &l.posts[l.phead]
		ref, n := e.ref, len(e.dst)
		*e = entry{}
		l.phead++
		if l.phead == len(l.posts) {
			l.posts, l.phead = l.posts[:0], 0
		}
		l.rxBytes.Add(int64(n))
		l.rxDone.Add(1)
		if b := l.owner; b != nil {
			b.noteRefusal(refusedErr(b.opType(), b.epoch, ref.origin, ref.op, ref.reason))
		}
		done = true
	}
	return done
}

// txRefusal returns the refusal of this rank's message seq to the peer,
// or nil (op goroutine, before each frame of a send).
func (l *link) txRefusal(seq uint64) *p2pRefusal {
	if l.nTxRef.Load() == 0 {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, ref := range l.txRef {
		if ref.seq == seq {
			l.txRef = slices.Delete(l.txRef, i, i+1)
			l.nTxRef.Add(-1)
			return ref
		}
	}
	return nil
}

// pruneTx forgets send refusals of messages that were sent in full
// before the refusal arrived (op goroutine, between ops).
func (l *link) pruneTx() {
	if l.nTxRef.Load() == 0 {
		return
	}
	l.mu.Lock()
	before := len(l.txRef)
	l.txRef = slices.DeleteFunc(l.txRef, func(r *p2pRefusal) bool { return r.seq < l.p2pTx })
	l.nTxRef.Add(int32(len(l.txRef) - before))
	l.mu.Unlock()
}

// sendMessage sends t to p as message seq, stopping before any frame once
// the peer has refused it; the op then fails with the refusal once the
// rest of it is done.
func (b *Backend) sendMessage(ctx context.Context, p int, seq uint64, t comm.Tensor) error {
	l := b.links[p]
	h := opHeader(p2pDesc(t), seq, 0)
	data := t.Bytes()
	seg := b.segFor(h.d.dtype)
	for off := 0; ; off += seg {
		chunk := data[off:min(off+seg, len(data))]
		if l.shm != nil && !l.shmRoomFor(ctx, b, uint64(headerSize+pad8(len(chunk))), seq) {
			break
		}
		if l.nTxRef.Load() > 0 && l.txRefused(seq) {
			break
		}
		if err := b.sendFrame(ctx, p, &h, chunk); err != nil {
			return err
		}
		if off+seg >= len(data) {
			return nil
		}
	}
	ref := l.txRefusal(seq)
	b.noteRefusal(refusedErr(b.opType(), b.epoch, ref.origin, ref.op, ref.reason))
	return nil
}

// txRefused reports whether the peer refused this rank's message seq.
func (l *link) txRefused(seq uint64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.txRef, func(r *p2pRefusal) bool { return r.seq == seq })
}

// shmRoomFor waits until the tx ring has room for a whole frame of n
// bytes, so that a send is never left half a frame into a ring when its
// message turns out to be refused: a receiver that refused it consumes
// (and drops) it only when it next delivers, which may be long after.
// It returns false once the peer has refused message seq (read off the rx
// ring while waiting). A frame larger than the ring, or a wait that ends
// for another reason, goes on to the write (which fails as usual).
func (l *link) shmRoomFor(ctx context.Context, b *Backend, n, seq uint64) bool {
	l.smu.Lock()
	defer l.smu.Unlock()
	s := l.shm
	if !s.live || l.isClosed() || n > s.tx.size {
		return true
	}
	if f, err := s.txFree(); err != nil || f >= n {
		return true
	}
	l.txPublish()
	w := shmWait{tx: l, n: n}
	var sp spinner
	for {
		if f, err := s.txFree(); err != nil || f >= n {
			return true
		}
		if l.nTxRef.Load() > 0 && l.txRefused(seq) {
			return false
		}
		if l.isClosed() || b.isBroken() || ctx.Err() != nil {
			return true
		}
		if b.progressShm() {
			sp.reset()
			continue
		}
		if b.shmIdle(ctx, &w, &sp) != nil {
			return true
		}
	}
}

// clearStrays ends the stray refusals that took receives of the op that
// ends (op goroutine): those receives give their numbers back, and the
// refusals are forgotten. The others wait for an op that receives their
// message.
func (b *Backend) clearStrays() {
	if b.strays.Load() == 0 {
		return
	}
	for _, l := range b.links {
		if l == nil || !l.strayTook.Load() {
			continue
		}
		l.mu.Lock()
		l.p2pRx = min(l.p2pRx, l.strayFrom)
		l.strayTook.Store(false)
		n := len(l.rxRef)
		l.rxRef = slices.DeleteFunc(l.rxRef, func(r *p2pRefusal) bool { return r.taken })
		removed := int32(n - len(l.rxRef))
		l.nStray.Add(-removed)
		b.strays.Add(-removed)
		l.mu.Unlock()
	}
}

// ---- reading a marker ----

// onRefused applies a frameRefused from the peer (reader, or the op
// goroutine consuming a ring; l.mu not held).
func (l *link) onRefused(h *header, reason string) {
	l.mu.Lock()
	b, peer := l.owner, l.peer
	if b == nil || l.mode != rxNormal {
		l.mu.Unlock()
		return
	}
	origin := int(h.d.root)
	if origin >= b.size {
		origin = peer
	}
	switch h.tag {
	case refusedColl:
		l.mu.Unlock()
		b.heardColl(peer, h.seq, origin, h.d.op, reason)
		return
	case refusedSend:
		l.txRef = append(l.txRef, &p2pRefusal{seq: h.seq, origin: origin, op: h.d.op, reason: reason})
		l.nTxRef.Add(1)
		l.mu.Unlock()
		return
	}
	l.markRxLocked(&p2pRefusal{seq: h.seq, origin: origin, op: h.d.op, reason: reason, stray: h.tag == refusedStray})
	done := l.completeRefusedLocked()
	l.mu.Unlock()
	if done {
		b.poke()
	}
	l.poke() // a frame held for a refused entry is looked at again
}

// staleLocked reports whether op frame h is of a refused collective or of
// a message this rank refused to receive: it is dropped unread (l.mu held).
func (l *link) staleLocked(h *header) bool {
	if h.d.op == comm.OpSend {
		return h.seq < l.dropBelow.Load()
	}
	b := l.owner
	return b != nil && b.collRefused(h.seq)
}

// decodeReason reads a frameRefused's payload.
func decodeReason(p []byte) string {
	return strings.ToValidUTF8(string(p), "\uFFFD")
}
