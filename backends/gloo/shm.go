package gloo

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Shared-memory data path of a link between two processes on one host.
//
// The listener of a connection creates an anonymous memory file
// (memfd_create: it has no name, so nothing can be left behind in /dev/shm
// even by a SIGKILL), seals it against shrinking and growing (so neither
// side can truncate it under the other's mapping, which would turn every
// access into SIGBUS), maps it and sends its fd number and a random token
// over the authenticated TCP connection; the dialer opens it through
// /proc/<listener pid>/fd/<n> (same pid namespace, checked in the
// handshake), checks the seals, the size and the token, maps it and says
// so; then both close their fds. The pages live as long as either mapping.
//
// The segment holds two single-producer single-consumer byte rings, one
// per direction (ring 0: listener → dialer). Each ring has a control block
// of four cache lines (head, tail, the consumer's futex word, the
// producer's futex word) and a data area of a power-of-two size. Positions
// are free-running byte counts; frames are written as on TCP (the 40-byte
// header, then the payload) but without the trailer, with the payload
// padded to 8 bytes so that headers stay 8-byte aligned and no element of
// any dtype straddles the end of the data area.
//
// Each side keeps its own positions (the producer its head, the consumer
// its tail) in process memory and only ever publishes them; it reads the
// other side's position from the segment and checks it against its own
// (0 ≤ head − tail ≤ size) before using it, so a buggy or hostile peer can
// make this side fail the link, but not read or write out of bounds.
//
// Both ends map with MAP_POPULATE, so the rings' pages are in place before
// the first op instead of faulting in during the first few hundred small
// ones (a 4 KiB op touches a new page of a 2 MiB ring each time).
//
// Waiting: a side that finds nothing to do spins briefly, then sets its
// "waiting" word, re-checks, and sleeps in FUTEX_WAIT (on a shared mapping,
// so without FUTEX_PRIVATE_FLAG) with a timeout; the other side wakes it
// after publishing a position if the word is set. Events of this process
// (a receive posted, a cancel, Abort, the link closing) bump the same
// futex word and wake it too.

const (
	shmMagic     = 0x314d48534f4c4746 // "FGLOSHM1", little-endian
	shmVersion   = 1
	shmCtlSize   = 4096 // header and the two control blocks; the rings follow
	shmRingCtl   = 256  // bytes of one ring's control block
	shmTokenLen  = 16
	shmMinRing   = 64 << 10
	shmMaxRing   = 64 << 20
	shmAlign     = 8
	shmWaitSlice = 250 * time.Millisecond // longest futex sleep before conditions are looked at again
)

// Offsets in a ring's control block (each on its own cache line).
const (
	offHead     = 0   // u64, written by the producer
	offTail     = 64  // u64, written by the consumer
	offConsWait = 128 // u32: the consumer is (about to be) asleep on offDataSeq
	offDataSeq  = 132 // u32 futex word: bumped when there is something for the consumer
	offProdWait = 192 // u32: the producer is (about to be) asleep on offSpaceSeq
	offSpaceSeq = 196 // u32 futex word: bumped when the producer may go on
)

var (
	errShmCorrupt     = fmt.Errorf("%w: shared-memory ring positions out of range", errMalformed)
	errShmInterrupted = fmt.Errorf("gloo: shared-memory write interrupted: %w", os.ErrDeadlineExceeded)
)

// shmSeg is one mapped segment: both rings of a link.
type shmSeg struct {
	mem      []byte
	ringSize int
	creator  bool // this side created it (produces on ring 0)
}

func pad8(n int) int { return (n + shmAlign - 1) &^ (shmAlign - 1) }

func shmSegSize(ring int) int { return shmCtlSize + 2*ring }

func validRingSize(n int) bool {
	return n >= shmMinRing && n <= shmMaxRing && n&(n-1) == 0
}

// createShm makes, seals and maps a segment with rings of ring bytes.
// It returns the segment and the fd, which the caller closes once the
// peer has opened it.
func createShm(ring int) (*shmSeg, int, [shmTokenLen]byte, error) {
	var token [shmTokenLen]byte
	if !validRingSize(ring) {
		return nil, -1, token, fmt.Errorf("gloo: shared-memory ring size %d", ring)
	}
	if _, err := rand.Read(token[:]); err != nil {
		return nil, -1, token, err
	}
	fd, err := unix.MemfdCreate("ftcomm-gloo", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, token, fmt.Errorf("gloo: memfd_create: %w", err)
	}
	size := shmSegSize(ring)
	fail := func(what string, err error) (*shmSeg, int, [shmTokenLen]byte, error) {
		unix.Close(fd)
		return nil, -1, token, fmt.Errorf("gloo: shared memory: %s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return fail("ftruncate", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL); err != nil {
		return fail("seal", err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fail("mmap", err)
	}
	binary.LittleEndian.PutUint64(mem[0:], shmMagic)
	binary.LittleEndian.PutUint32(mem[8:], shmVersion)
	binary.LittleEndian.PutUint32(mem[12:], uint32(ring))
	copy(mem[16:16+shmTokenLen], token[:])
	return &shmSeg{mem: mem, ringSize: ring, creator: true}, fd, token, nil
}

// openShm maps the segment the peer (process pid) created as its fd fd,
// after checking that it is sealed, of the announced size, and carries
// the token. Nothing read from it is trusted beyond that.
func openShm(pid int32, fd int, ring int, token [shmTokenLen]byte) (*shmSeg, error) {
	if !validRingSize(ring) || fd < 0 {
		return nil, fmt.Errorf("gloo: shared memory: offered ring size %d, fd %d", ring, fd)
	}
	path := "/proc/" + strconv.Itoa(int(pid)) + "/fd/" + strconv.Itoa(fd)
	f, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("gloo: shared memory: open %s: %w", path, err)
	}
	defer unix.Close(f)
	size := shmSegSize(ring)
	var st unix.Stat_t
	if err := unix.Fstat(f, &st); err != nil {
		return nil, fmt.Errorf("gloo: shared memory: fstat: %w", err)
	}
	if st.Size != int64(size) {
		return nil, fmt.Errorf("gloo: shared memory: segment of %d bytes, want %d", st.Size, size)
	}
	seals, err := unix.FcntlInt(uintptr(f), unix.F_GET_SEALS, 0)
	if err != nil || seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL) != unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL {
		return nil, fmt.Errorf("gloo: shared memory: segment not sealed against shrinking (seals %#x, %v)", seals, err)
	}
	mem, err := unix.Mmap(f, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("gloo: shared memory: mmap: %w", err)
	}
	if binary.LittleEndian.Uint64(mem[0:]) != shmMagic || binary.LittleEndian.Uint32(mem[8:]) != shmVersion ||
		binary.LittleEndian.Uint32(mem[12:]) != uint32(ring) || string(mem[16:16+shmTokenLen]) != string(token[:]) {
		unix.Munmap(mem)
		return nil, errors.New("gloo: shared memory: segment header or token does not match the offer")
	}
	return &shmSeg{mem: mem, ringSize: ring}, nil
}

func (s *shmSeg) unmap() {
	if s != nil && s.mem != nil {
		unix.Munmap(s.mem)
		s.mem = nil
	}
}

// ring returns ring i's view (0: creator → opener).
func (s *shmSeg) ring(i int) ring {
	ctl := s.mem[64+i*shmRingCtl : 64+(i+1)*shmRingCtl]
	data := s.mem[shmCtlSize+i*s.ringSize : shmCtlSize+(i+1)*s.ringSize]
	return ring{
		head:     (*atomic.Uint64)(unsafe.Pointer(&ctl[offHead])),
		tail:     (*atomic.Uint64)(unsafe.Pointer(&ctl[offTail])),
		consWait: (*atomic.Uint32)(unsafe.Pointer(&ctl[offConsWait])),
		dataSeq:  (*atomic.Uint32)(unsafe.Pointer(&ctl[offDataSeq])),
		prodWait: (*atomic.Uint32)(unsafe.Pointer(&ctl[offProdWait])),
		spaceSeq: (*atomic.Uint32)(unsafe.Pointer(&ctl[offSpaceSeq])),
		data:     data,
		size:     uint64(s.ringSize),
		mask:     uint64(s.ringSize - 1),
	}
}

// tx is this side's producing ring, rx its consuming one.
func (s *shmSeg) tx() ring {
	if s.creator {
		return s.ring(0)
	}
	return s.ring(1)
}

func (s *shmSeg) rx() ring {
	if s.creator {
		return s.ring(1)
	}
	return s.ring(0)
}

// ring is a view of one direction's control words and data in a mapping.
type ring struct {
	head, tail         *atomic.Uint64
	consWait, dataSeq  *atomic.Uint32
	prodWait, spaceSeq *atomic.Uint32
	data               []byte
	size, mask         uint64
}

// wakeConsumer bumps the consumer's futex word and wakes it.
func (r *ring) wakeConsumer() {
	r.dataSeq.Add(1)
	futexWake(r.dataSeq)
}

// wakeProducer bumps the producer's futex word and wakes it.
func (r *ring) wakeProducer() {
	r.spaceSeq.Add(1)
	futexWake(r.spaceSeq)
}

// Futex operations, without FUTEX_PRIVATE_FLAG: the words are in a
// mapping shared between processes.
const (
	futexWaitOp = 0
	futexWakeOp = 1
)

// futexWait sleeps while *addr == val, at most *ts. Spurious returns are
// fine: callers look at their conditions again. (syscall.Syscall6 tells
// the scheduler this thread may block; the goroutine's P goes elsewhere.)
func futexWait(addr *atomic.Uint32, val uint32, ts *syscall.Timespec) {
	syscall.Syscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWaitOp, uintptr(val), uintptr(unsafe.Pointer(ts)), 0, 0)
}

func futexWake(addr *atomic.Uint32) {
	syscall.Syscall6(syscall.SYS_FUTEX, uintptr(unsafe.Pointer(addr)), futexWakeOp, 1, 0, 0, 0)
}
