package gloo

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/ftcomm/ftcomm/comm"
)

// Wire format of a frame (all integers little-endian):
//
//	0  magic   u8   0xF7
//	1  type    u8   frameOp, frameHeartbeat, frameNotice, frameResync, frameBye, frameWake, frameRefused
//	2  op      u8   comm.OpType of the collective (OpSend for point-to-point; a frameRefused's refused op)
//	3  dtype   u8   comm.DType (0 for ops without a tensor)
//	4  redop   u8   comm.ReduceOp (0 where none)
//	5  algo    u8   Algorithm
//	6  flags   u16  must be 0
//	8  length  u32  payload bytes
//	12 tag     u32  step of the algorithm (a frameRefused's kind: refusedColl, …)
//	16 seq     u64  collective sequence number, point-to-point message number, or epoch
//	24 count   u64  element count of the op's descriptor
//	32 root    i32  root of the op, or -1 (a frameRefused's refusing rank)
//	36 aux     u32  descriptor extra (hash of AllGatherV counts)
//	40 payload
//	   trailer u8   0xA5 complete, 0x5A abandoned (payload is filler)
const (
	headerSize     = 40
	frameMagic     = 0xF7
	trailerOK      = 0xA5
	trailerAbandon = 0x5A
	maxNoticeLen   = 4096
	maxFrameLen    = 1 << 27 // above any SegmentSize
	resyncFixed    = 32      // resync payload without the lane positions and the excluded ranks
	// maxResyncExcluded bounds the excluded ranks a resync frame lists
	// (a Shrink that excludes more lists the first ones).
	maxResyncExcluded = (maxNoticeLen - resyncFixed - 8*shmMaxLanes) / 4
)

type frameType uint8

const (
	frameOp        frameType = 1 // data of a collective or point-to-point op; header carries the descriptor
	frameHeartbeat frameType = 2 // keeps an idle connection observable
	frameNotice    frameType = 3 // the sender's comm failed; payload says why
	frameResync    frameType = 4 // marks the start of a new epoch on a reused connection
	frameBye       frameType = 5 // the sender closed its end
	frameWake      frameType = 6 // the sender published shared-memory positions, and the receiver's waiter on lane tag was parked
	frameRefused   frameType = 7 // an op was refused (refuse.go); on the data path, ordered with frameOp; payload the reason
)

func (t frameType) String() string {
	switch t {
	case frameOp:
		return "op"
	case frameHeartbeat:
		return "heartbeat"
	case frameNotice:
		return "notice"
	case frameResync:
		return "resync"
	case frameBye:
		return "bye"
	case frameWake:
		return "wake"
	case frameRefused:
		return "refused"
	}
	return fmt.Sprintf("frame(%d)", uint8(t))
}

// desc describes a collective; every rank must issue the same one.
type desc struct {
	op    comm.OpType
	dtype comm.DType
	redop comm.ReduceOp
	algo  Algorithm
	root  int32
	count uint64
	aux   uint32
}

func (d desc) String() string {
	s := fmt.Sprintf("%s %s[%d]", d.op, d.dtype, d.count)
	if d.redop != 0 {
		s += " " + d.redop.String()
	}
	if d.root >= 0 {
		s += fmt.Sprintf(" root %d", d.root)
	}
	if d.aux != 0 {
		s += fmt.Sprintf(" counts#%08x", d.aux)
	}
	if d.algo != AlgorithmAuto {
		s += " " + d.algo.String()
	}
	return s
}

type header struct {
	typ    frameType
	d      desc
	length uint32
	tag    uint32
	seq    uint64
}

var errMalformed = errors.New("gloo: malformed frame")

func (h *header) encode(b []byte) {
	_ = b[headerSize-1]
	b[0] = frameMagic
	b[1] = byte(h.typ)
	b[2] = byte(h.d.op)
	b[3] = byte(h.d.dtype)
	b[4] = byte(h.d.redop)
	b[5] = byte(h.d.algo)
	b[6], b[7] = 0, 0
	binary.LittleEndian.PutUint32(b[8:], h.length)
	binary.LittleEndian.PutUint32(b[12:], h.tag)
	binary.LittleEndian.PutUint64(b[16:], h.seq)
	binary.LittleEndian.PutUint64(b[24:], h.d.count)
	binary.LittleEndian.PutUint32(b[32:], uint32(h.d.root))
	binary.LittleEndian.PutUint32(b[36:], h.d.aux)
}

// decodeHeader parses and checks a header. It never panics; a frame that
// fails the checks means the connection can no longer be trusted.
func decodeHeader(b []byte) (header, error) {
	var h header
	if len(b) < headerSize {
		return h, fmt.Errorf("%w: %d header bytes, want %d", errMalformed, len(b), headerSize)
	}
	if b[0] != frameMagic {
		return h, fmt.Errorf("%w: bad magic %#02x", errMalformed, b[0])
	}
	h.typ = frameType(b[1])
	h.d.op = comm.OpType(b[2])
	h.d.dtype = comm.DType(b[3])
	h.d.redop = comm.ReduceOp(b[4])
	h.d.algo = Algorithm(b[5])
	if b[6] != 0 || b[7] != 0 {
		return h, fmt.Errorf("%w: nonzero flags %#04x", errMalformed, binary.LittleEndian.Uint16(b[6:]))
	}
	h.length = binary.LittleEndian.Uint32(b[8:])
	h.tag = binary.LittleEndian.Uint32(b[12:])
	h.seq = binary.LittleEndian.Uint64(b[16:])
	h.d.count = binary.LittleEndian.Uint64(b[24:])
	h.d.root = int32(binary.LittleEndian.Uint32(b[32:]))
	h.d.aux = binary.LittleEndian.Uint32(b[36:])
	switch h.typ {
	case frameOp:
		if h.d.op == comm.OpNone || h.d.op >= comm.OpShrink && h.d.op != comm.OpSplit && h.d.op != comm.OpReduceScatterV {
			return h, fmt.Errorf("%w: op frame for %s", errMalformed, h.d.op)
		}
		if h.d.dtype != 0 && !h.d.dtype.Valid() {
			return h, fmt.Errorf("%w: dtype %d", errMalformed, uint8(h.d.dtype))
		}
		if h.d.redop != 0 && !h.d.redop.Valid() {
			return h, fmt.Errorf("%w: reduce op %d", errMalformed, uint8(h.d.redop))
		}
		if h.d.algo > algoOneShot {
			return h, fmt.Errorf("%w: algorithm %d", errMalformed, uint8(h.d.algo))
		}
		if h.length > maxFrameLen {
			return h, fmt.Errorf("%w: payload of %d bytes exceeds %d", errMalformed, h.length, maxFrameLen)
		}
		if h.length > 0 && (h.d.dtype == 0 || int(h.length)%h.d.dtype.Size() != 0) {
			return h, fmt.Errorf("%w: payload of %d bytes is not a whole number of %s elements", errMalformed, h.length, h.d.dtype)
		}
	case frameRefused:
		if h.length > maxNoticeLen || h.tag > refusedStray || !refusable(h.d.op) || h.d.root < 0 {
			return h, fmt.Errorf("%w: refusal of %s (kind %d, rank %d) with %d bytes", errMalformed, h.d.op, h.tag, h.d.root, h.length)
		}
	case frameHeartbeat, frameBye:
		if h.length != 0 {
			return h, fmt.Errorf("%w: %s frame with %d payload bytes", errMalformed, h.typ, h.length)
		}
	case frameWake:
		if h.length != 0 || h.tag >= shmMaxLanes {
			return h, fmt.Errorf("%w: wake frame with %d payload bytes for lane %d", errMalformed, h.length, h.tag)
		}
	case frameNotice:
		if h.length < noticeFixed || h.length > maxNoticeLen {
			return h, fmt.Errorf("%w: notice of %d bytes", errMalformed, h.length)
		}
	case frameResync:
		if h.length < resyncFixed || h.length > maxNoticeLen || (h.length-resyncFixed)%4 != 0 {
			return h, fmt.Errorf("%w: resync of %d bytes", errMalformed, h.length)
		}
	default:
		return h, fmt.Errorf("%w: unknown frame type %d", errMalformed, uint8(h.typ))
	}
	return h, nil
}

// noticeKind says why a comm failed, in a notice frame.
type noticeKind uint8

const (
	noticeAbort      noticeKind = 1 // aborted locally (Abort, timeout, ctx)
	noticeRevoke     noticeKind = 2 // revoked
	noticePeerFailed noticeKind = 3 // subject rank died or its connection broke
	noticeMismatch   noticeKind = 4 // subject rank issued a different op
)

// Notice flags.
const (
	// noticeTimedOut: the origin's op passed its deadline (an abort for a
	// timeout), so the peers' errors match comm.ErrTimeout as the origin's does.
	noticeTimedOut uint8 = 1 << 0
	// noticePeerClosed: the subject of a peer failure closed its comm in
	// an orderly way (alive), so the peers' errors match comm.ErrPeerClosed.
	noticePeerClosed uint8 = 1 << 1
	noticeFlags            = noticeTimedOut | noticePeerClosed // every flag defined
)

// notice is the payload of a frameNotice (epoch in the header's seq):
//
//	0 kind u8, 1 op u8, 2 flags u8, 3 reserved u8, 4 origin i32, 8 subject i32, 12 cause (UTF-8, rest)
type notice struct {
	kind    noticeKind
	op      comm.OpType
	flags   uint8
	origin  int32 // the rank whose comm failed first
	subject int32 // the rank the failure concerns, or -1
	cause   string
}

const noticeFixed = 12

// abortNotice is the notice of an abort at rank origin for cause; a cause
// that is a timeout (the Comm's deadline, or a ctx deadline) is flagged so.
func abortNotice(op comm.OpType, origin int, cause error) notice {
	nt := notice{kind: noticeAbort, op: op, origin: int32(origin), subject: int32(origin), cause: cause.Error()}
	if errors.Is(cause, comm.ErrTimeout) || errors.Is(cause, context.DeadlineExceeded) {
		nt.flags |= noticeTimedOut
	}
	return nt
}

func (n *notice) encode(b []byte) int {
	b[0] = byte(n.kind)
	b[1] = byte(n.op)
	b[2], b[3] = n.flags, 0
	binary.LittleEndian.PutUint32(b[4:], uint32(n.origin))
	binary.LittleEndian.PutUint32(b[8:], uint32(n.subject))
	c := n.cause
	if len(c) > maxNoticeLen-noticeFixed {
		c = c[:maxNoticeLen-noticeFixed]
	}
	return noticeFixed + copy(b[noticeFixed:], c)
}

func decodeNotice(b []byte) (notice, error) {
	var n notice
	if len(b) < noticeFixed || len(b) > maxNoticeLen {
		return n, fmt.Errorf("%w: notice of %d bytes", errMalformed, len(b))
	}
	n.kind = noticeKind(b[0])
	n.op = comm.OpType(b[1])
	if n.kind < noticeAbort || n.kind > noticeMismatch {
		return n, fmt.Errorf("%w: notice kind %d", errMalformed, b[0])
	}
	n.flags = b[2]
	if n.flags&^noticeFlags != 0 || b[3] != 0 {
		return n, fmt.Errorf("%w: notice flags %#02x %#02x", errMalformed, b[2], b[3])
	}
	n.origin = int32(binary.LittleEndian.Uint32(b[4:]))
	n.subject = int32(binary.LittleEndian.Uint32(b[8:]))
	n.cause = string(b[noticeFixed:])
	return n, nil
}

// resyncInfo is what both ends of a reused connection must agree on to
// enter a new epoch (epoch in the header's seq); resyncNote is what else
// the sender's resync says.
//
//	0 size u32, 4 sender rank u32, 8 members hash u64, 16 previous epoch u64,
//	24 lanes u32, 28 excluded count u32,
//	32 shm tx position of each lane u64 × lanes (0 lanes for a TCP link),
//	then excluded ranks u32 × min(count, maxResyncExcluded)
type resyncInfo struct {
	epoch   uint64
	size    uint32
	rank    uint32 // the sender's rank in the new epoch
	members uint64 // hash of the new comm's membership
}

// resyncNote is the part of a resync frame that is not agreed on.
type resyncNote struct {
	lanes    int                 // shared-memory lanes of the link (0: TCP)
	txPos    [shmMaxLanes]uint64 // where the sender's new-epoch data starts in each lane's ring
	from     uint64              // the epoch the sender left
	excluded []int               // the ranks of epoch from that a Shrink left out, ascending
	nexcl    int                 // how many it left out (excluded may list fewer)
}

func resyncLen(nt *resyncNote) int {
	return resyncFixed + 8*nt.lanes + 4*min(len(nt.excluded), maxResyncExcluded)
}

func encodeResync(b []byte, r *resyncInfo, nt *resyncNote) {
	le := binary.LittleEndian
	le.PutUint32(b[0:], r.size)
	le.PutUint32(b[4:], r.rank)
	le.PutUint64(b[8:], r.members)
	le.PutUint64(b[16:], nt.from)
	le.PutUint32(b[24:], uint32(nt.lanes))
	le.PutUint32(b[28:], uint32(len(nt.excluded)))
	off := resyncFixed
	for i := range nt.lanes {
		le.PutUint64(b[off:], nt.txPos[i])
		off += 8
	}
	for _, x := range nt.excluded[:min(len(nt.excluded), maxResyncExcluded)] {
		le.PutUint32(b[off:], uint32(x))
		off += 4
	}
}

// decodeResync parses a resync payload (its length was checked with the
// header). The excluded ranks are only decoded when withExcluded is set
// (they allocate).
func decodeResync(epoch uint64, b []byte, withExcluded bool) (resyncInfo, resyncNote, error) {
	le := binary.LittleEndian
	if len(b) < resyncFixed || (len(b)-resyncFixed)%4 != 0 {
		return resyncInfo{}, resyncNote{}, fmt.Errorf("%w: resync of %d bytes", errMalformed, len(b))
	}
	info := resyncInfo{epoch: epoch, size: le.Uint32(b[0:]), rank: le.Uint32(b[4:]), members: le.Uint64(b[8:])}
	nt := resyncNote{from: le.Uint64(b[16:]), lanes: int(le.Uint32(b[24:])), nexcl: int(le.Uint32(b[28:]))}
	rest := len(b) - resyncFixed - 8*nt.lanes
	if nt.lanes > shmMaxLanes || rest < 0 || rest/4 > nt.nexcl {
		return resyncInfo{}, resyncNote{}, fmt.Errorf("%w: resync of %d bytes for %d lanes and %d excluded ranks", errMalformed, len(b), nt.lanes, nt.nexcl)
	}
	off := resyncFixed
	for i := range nt.lanes {
		nt.txPos[i] = le.Uint64(b[off:])
		off += 8
	}
	if withExcluded && rest > 0 {
		nt.excluded = make([]int, rest/4)
		for i := range nt.excluded {
			nt.excluded[i] = int(le.Uint32(b[off:]))
			off += 4
		}
	}
	return info, nt, nil
}

// hashInts hashes ints (membership lists, counts vectors), FNV-1a over
// their little-endian bytes, without allocating.
func hashInts(vals []int) uint64 {
	h := uint64(14695981039346656037)
	for _, v := range vals {
		u := uint64(v)
		for i := 0; i < 8; i++ {
			h ^= u & 0xff
			h *= 1099511628211
			u >>= 8
		}
	}
	return h
}
