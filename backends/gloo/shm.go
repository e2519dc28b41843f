package gloo

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
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
// The segment holds, per lane, two single-producer single-consumer byte
// rings, one per direction (ring 0: listener → dialer). Lane 0 carries the
// frames of every op; lanes 1.. (when the listener offers them) carry the
// slices of a large all-reduce that helper goroutines move in parallel
// (see lanes.go). Each ring has a control block of two cache lines (head,
// tail) and a data area of a power-of-two size. Positions are free-running
// byte counts; frames are written as on TCP (the 40-byte header, then the
// payload) but without the trailer, with the payload padded to 8 bytes so
// that headers stay 8-byte aligned and no element of any dtype straddles
// the end of the data area.
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
// Nobody blocks on the segment: the goroutine that waits for data or space
// polls the rings itself (see shmlink.go), and when it gives up polling it
// sets its side's "asleep" word for its lane and parks on a Go channel; the
// other side, after publishing a position on that lane, sees the word and
// sends a wake frame over the TCP connection, whose reader unparks it.

const (
	shmMagic    = 0x324d48534f4c4746 // "FGLOSHM2", little-endian
	shmVersion  = 2
	shmCtlSize  = 8192 // header, asleep words and the rings' control blocks; the rings follow
	shmTokenLen = 16
	shmMinRing  = 64 << 10
	shmMaxRing  = 64 << 20
	shmAlign    = 8
	// shmMaxLanes bounds the lanes of a segment (lane 0 included).
	shmMaxLanes = 16
	offAsleep   = 64   // asleep word of (side, lane): offAsleep + (side*shmMaxLanes+lane)*64
	offRingCtl  = 4096 // control block of (lane, ring): offRingCtl + (lane*2+ring)*shmRingCtl
	shmRingCtl  = 128  // head on the first cache line, tail on the second
	// Segment header: magic u64, version u32, lane-0 ring size u32, token
	// [16], lanes u32, lane ring size u32.
	offSegToken = 16
	offSegLanes = 32
	offSegLane  = 36
)

var (
	errShmCorrupt     = fmt.Errorf("%w: shared-memory ring positions out of range", errMalformed)
	errShmInterrupted = fmt.Errorf("gloo: shared-memory write interrupted: %w", os.ErrDeadlineExceeded)
)

// shmSeg is one mapped segment: both rings of every lane of a link.
type shmSeg struct {
	mem      []byte
	ringSize int  // lane 0's rings
	lanes    int  // lanes, lane 0 included (1 ≤ lanes ≤ shmMaxLanes)
	laneRing int  // the rings of lanes 1.. (0 if lanes == 1)
	creator  bool // this side created it (produces on ring 0 of each lane)
}

func pad8(n int) int { return (n + shmAlign - 1) &^ (shmAlign - 1) }

func shmSegSize(ring, lanes, laneRing int) int {
	return shmCtlSize + 2*ring + 2*(lanes-1)*laneRing
}

func validRingSize(n int) bool {
	return n >= shmMinRing && n <= shmMaxRing && n&(n-1) == 0
}

func validLanes(lanes, laneRing int) bool {
	return lanes == 1 && laneRing == 0 || lanes > 1 && lanes <= shmMaxLanes && validRingSize(laneRing)
}

// createShm makes, seals and maps a segment with rings of ring bytes.
// It returns the segment and the fd, which the caller closes once the
// peer has opened it.
func createShm(ring, lanes, laneRing int) (*shmSeg, int, [shmTokenLen]byte, error) {
	var token [shmTokenLen]byte
	if !validRingSize(ring) || !validLanes(lanes, laneRing) {
		return nil, -1, token, fmt.Errorf("gloo: shared-memory ring size %d, %d lanes of %d", ring, lanes, laneRing)
	}
	if _, err := rand.Read(token[:]); err != nil {
		return nil, -1, token, err
	}
	fd, err := unix.MemfdCreate("ftcomm-gloo", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, -1, token, fmt.Errorf("gloo: memfd_create: %w", err)
	}
	size := shmSegSize(ring, lanes, laneRing)
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
	copy(mem[offSegToken:offSegToken+shmTokenLen], token[:])
	binary.LittleEndian.PutUint32(mem[offSegLanes:], uint32(lanes))
	binary.LittleEndian.PutUint32(mem[offSegLane:], uint32(laneRing))
	return &shmSeg{mem: mem, ringSize: ring, lanes: lanes, laneRing: laneRing, creator: true}, fd, token, nil
}

// openShm maps the segment the peer (process pid) created as its fd fd,
// after checking that it is sealed, of the announced size, and carries
// the token. Nothing read from it is trusted beyond that.
func openShm(pid int32, fd int, ring, lanes, laneRing int, token [shmTokenLen]byte) (*shmSeg, error) {
	if !validRingSize(ring) || !validLanes(lanes, laneRing) || fd < 0 {
		return nil, fmt.Errorf("gloo: shared memory: offered ring size %d, %d lanes of %d, fd %d", ring, lanes, laneRing, fd)
	}
	path := "/proc/" + strconv.Itoa(int(pid)) + "/fd/" + strconv.Itoa(fd)
	f, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("gloo: shared memory: open %s: %w", path, err)
	}
	defer unix.Close(f)
	size := shmSegSize(ring, lanes, laneRing)
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
		binary.LittleEndian.Uint32(mem[12:]) != uint32(ring) || string(mem[offSegToken:offSegToken+shmTokenLen]) != string(token[:]) ||
		binary.LittleEndian.Uint32(mem[offSegLanes:]) != uint32(lanes) || binary.LittleEndian.Uint32(mem[offSegLane:]) != uint32(laneRing) {
		unix.Munmap(mem)
		return nil, errors.New("gloo: shared memory: segment header or token does not match the offer")
	}
	return &shmSeg{mem: mem, ringSize: ring, lanes: lanes, laneRing: laneRing}, nil
}

func (s *shmSeg) unmap() {
	if s != nil && s.mem != nil {
		unix.Munmap(s.mem)
		s.mem = nil
	}
}

// ring returns lane's ring i (0: creator → opener).
func (s *shmSeg) ring(lane, i int) ring {
	ctl := s.mem[offRingCtl+(lane*2+i)*shmRingCtl:]
	size, off := s.ringSize, shmCtlSize+i*s.ringSize
	if lane > 0 {
		size, off = s.laneRing, shmCtlSize+2*s.ringSize+((lane-1)*2+i)*s.laneRing
	}
	return ring{
		head: (*atomic.Uint64)(unsafe.Pointer(&ctl[0])),
		tail: (*atomic.Uint64)(unsafe.Pointer(&ctl[64])),
		data: s.mem[off : off+size : off+size],
		size: uint64(size),
		mask: uint64(size - 1),
	}
}

// side is 0 for the creator, 1 for the opener.
func (s *shmSeg) side() int {
	if s.creator {
		return 0
	}
	return 1
}

// tx is this side's producing ring of lane, rx its consuming one.
func (s *shmSeg) tx(lane int) ring { return s.ring(lane, s.side()) }

func (s *shmSeg) rx(lane int) ring { return s.ring(lane, 1-s.side()) }

// asleep is the word of side's waiter on lane: non-zero while it is parked
// (or about to park) and wants a wake frame when the other side publishes.
func (s *shmSeg) asleep(side, lane int) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&s.mem[offAsleep+(side*shmMaxLanes+lane)*64]))
}

// ring is a view of one direction's positions and data in a mapping.
type ring struct {
	head, tail *atomic.Uint64
	data       []byte
	size, mask uint64
}
