package gloo

import (
	"fmt"
	"net"
	"os"
	"strings"
	"time"
)

// Algorithm selects the collective algorithms a Backend uses. All ranks of a
// comm must use the same setting: it is part of every collective's
// descriptor, so ranks that disagree fail with comm.ErrMismatch.
type Algorithm uint8

// The algorithm families.
const (
	// AlgorithmAuto picks by message size: latency-optimal algorithms at or
	// below Config.SmallThreshold bytes, bandwidth-optimal ones above.
	AlgorithmAuto Algorithm = iota
	// AlgorithmRing forces the bandwidth-optimal family: pipelined ring
	// all-reduce and reduce-scatter, pipelined chain broadcast and reduce.
	AlgorithmRing
	// AlgorithmRecursiveDoubling forces the latency-optimal family:
	// recursive-doubling all-reduce (and reduce-scatter through it),
	// binomial-tree broadcast and reduce.
	AlgorithmRecursiveDoubling
	numAlgorithms
)

// algoOneShot marks the one-shot all-reduce in a descriptor: chosen under
// AlgorithmAuto for small messages (Config.OneShotBytes), never set in a
// Config.
const algoOneShot = numAlgorithms

var algorithmNames = [numAlgorithms + 1]string{"auto", "ring", "recursive-doubling", "one-shot"}

func (a Algorithm) String() string {
	if a > algoOneShot {
		return fmt.Sprintf("algorithm(%d)", uint8(a))
	}
	return algorithmNames[a]
}

// ParseAlgorithm accepts "auto", "ring" and "recursive-doubling" (also "rd",
// "tree").
func ParseAlgorithm(s string) (Algorithm, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "auto":
		return AlgorithmAuto, nil
	case "ring", "chain":
		return AlgorithmRing, nil
	case "recursive-doubling", "rd", "tree", "recursivedoubling":
		return AlgorithmRecursiveDoubling, nil
	}
	return 0, fmt.Errorf("gloo: unknown algorithm %q (want auto, ring or recursive-doubling)", s)
}

// Config holds the gloo-specific settings, passed as
// comm.Options.BackendConfig (nil means DefaultConfig()).
type Config struct {
	// ListenAddr is where this rank accepts peer connections. Default
	// "127.0.0.1:0" (loopback, a port chosen by the OS).
	ListenAddr string
	// AdvertiseHost, if set, replaces the listener's host in the address
	// published through the Store (for listeners on 0.0.0.0).
	AdvertiseHost string
	// SocketBuffer sets SO_SNDBUF and SO_RCVBUF of every connection in
	// bytes. 0 (the default) leaves them to the kernel's autotuning, which
	// on Linux grows them up to net.ipv4.tcp_rmem/tcp_wmem's maximum: a
	// fixed size disables autotuning, and on a loaded 2-core machine fixed
	// 4 MiB buffers made receivers that reduce as they read fall behind,
	// close the window and trigger spurious retransmissions (stalls of
	// seconds in a 64 MiB all-reduce; median 4 ranks × 64 MiB op 170–270 ms
	// against 137 ms autotuned).
	SocketBuffer int
	// ConnectTimeout bounds forming the mesh (rendezvous, dials with
	// retries, handshakes, resynchronisation), tightened by the caller's ctx.
	ConnectTimeout time.Duration
	// HandshakeTimeout bounds one handshake; a peer that stalls longer is
	// dropped.
	HandshakeTimeout time.Duration
	// HeartbeatInterval: a connection that has sent nothing for this long
	// sends a heartbeat frame.
	HeartbeatInterval time.Duration
	// PeerTimeout: while an op is pending, a peer from which nothing (data or
	// heartbeat) has arrived for this long is suspected: declared failed if
	// it is on this host and stopped or gone (or without a runnable thread
	// for another PeerTimeout), never if it is on this host and runnable
	// (starved), and if it is elsewhere, once the silence outlasts this
	// timeout stretched by load (up to 10×). See the package documentation.
	// Must be at least 3 × HeartbeatInterval.
	PeerTimeout time.Duration
	// Algorithm forces an algorithm family (tests, benchmarks).
	Algorithm Algorithm
	// SmallThreshold: with AlgorithmAuto, messages of at most this many
	// bytes use the latency-optimal algorithms.
	SmallThreshold int
	// OneShotBytes: with AlgorithmAuto, an all-reduce of at most
	// SmallThreshold bytes whose size times (ranks − 1) is at most this
	// many bytes goes one-shot: every rank sends its whole vector to every
	// other and reduces all of them locally, in rank order — one step
	// instead of recursive doubling's ⌈log₂ n⌉, which is what the small
	// control all-reduces of every training step (the commit vote) pay.
	// 0 turns it off. Like SmallThreshold it matters only through the
	// choice it makes, which must be the same at every rank.
	OneShotBytes int
	// SegmentSize is the pipelining unit of the ring and chain algorithms
	// and the largest frame this rank sends, in bytes (SharedMemorySegment
	// replaces it for a ring all-reduce entirely on shared memory). Default 1 MiB: at
	// 64 MiB, 512 KiB segments cost ~10–15% more CPU per op (more handoffs
	// between the connection's reader and the op), 2 MiB was no better.
	SegmentSize int
	// SharedMemorySegment is SegmentSize for a ring all-reduce that runs
	// on one lane (SharedMemoryLanes) and whose every rank has
	// shared-memory links to both its ring neighbours (agreed on with the
	// lanes, so that every rank cuts alike); 0 uses SegmentSize. Default
	// 4 MiB: one host's ranks hand blocks over through memory, and finer
	// pipelining only adds handoffs. Measured with cmd/ftbench -segment,
	// 2026-11-24, 3 interleaved rounds, 2 ranks on a 2-core VM (one lane
	// each): 16 MiB 9.9–13.9 GB/s busbw against 3.8–5.7 with 1 MiB, 64 MiB
	// 7.5–9.4 against 3.5–5.8. Where lanes run the parts side by side (the
	// 16-core host) 4 MiB made no difference beyond the noise, and lanes
	// keep SegmentSize.
	SharedMemorySegment int
	// MaxPendingHandshakes bounds concurrent inbound handshakes; excess
	// connections are refused at once.
	MaxPendingHandshakes int
	// SharedMemory lets a link to a peer on the same host (same kernel and
	// pid namespace, as the handshake tells) carry its op data through a
	// shared-memory segment instead of the socket; the TCP connection still
	// carries the handshake, heartbeats, notices, resync and bye, and still
	// tells of a peer's death. Used only where both ends enable it, and
	// turned off for the whole process by the environment variable
	// FTCOMM_GLOO_SHM=0 (or "off", "false"). A link whose segment cannot be
	// set up (e.g. /proc/<pid>/fd not accessible) uses TCP, logged at info.
	SharedMemory bool
	// SharedMemoryRing is the size in bytes of each direction's ring of a
	// shared-memory link (a power of two, 64 KiB – 64 MiB); a link maps
	// twice this plus 8 KiB, and its extra lanes (SharedMemoryLanes). The
	// listener's setting is used.
	SharedMemoryRing int
	// SharedMemoryLanes bounds how many cores one rank spreads a large
	// all-reduce over when both of its ring neighbours are shared-memory
	// links: the op's goroutine and up to SharedMemoryLanes−1 helpers, each
	// moving one part through its own ring pair of each link (512 KiB each
	// way, mapped when the link is set up). 0, the default, picks the
	// host's CPUs divided by the ranks of the comm on this host, at most 8
	// and at most GOMAXPROCS (1 on a 2-core host with 2 ranks); 1 turns
	// lanes off. An op uses the fewest lanes
	// any rank can (agreed on per op, one per MiB of message at most).
	SharedMemoryLanes int
	// LockedCallers says that ops are called on goroutines locked to their
	// OS threads, as every call through the C ABI is (a cgo callback runs
	// locked to the caller's thread): a waiter on shared memory then never
	// yields with runtime.Gosched, which on a locked thread hands the
	// thread's P to another thread and back. Measured through the Python
	// package (2 ranks, 4 KiB all-reduce, 2-core VM, 2026-11-26): +7.9 µs
	// per op over the Go API with the yields, +3.9 µs without.
	LockedCallers bool
	// KeepPointToPointAfterLeave: a peer that closes its comm in an orderly
	// way (a goodbye) while no op of this rank needs it no longer breaks
	// the comm at once; the next collective fails (every collective needs
	// every member), as does a send to or receive from that peer, while
	// sends and receives between the others go on. This is torchcomms'
	// semantics (a rank done with its part may finalize while two others
	// still exchange), what the C ABI's comms use. Off (the default), the
	// comm breaks at the goodbye, so its owner learns of the departure
	// before its next op (ft reconfigures between steps instead of failing
	// one).
	KeepPointToPointAfterLeave bool
}

// EnvSharedMemory, set to 0, off or false, disables Config.SharedMemory
// in every comm the process creates afterwards.
const EnvSharedMemory = "FTCOMM_GLOO_SHM"

// SharedMemoryAllowed reports whether comms this process creates may use
// shared memory (Config.SharedMemory), i.e. whether EnvSharedMemory leaves
// it on.
func SharedMemoryAllowed() bool { return !sharedMemoryDisabledByEnv() }

func sharedMemoryDisabledByEnv() bool {
	switch strings.ToLower(strings.TrimSpace(os.Getenv(EnvSharedMemory))) {
	case "0", "off", "false", "no":
		return true
	}
	return false
}

// DefaultConfig returns the default settings.
func DefaultConfig() *Config {
	return &Config{
		ListenAddr:           "127.0.0.1:0",
		SocketBuffer:         0,
		ConnectTimeout:       60 * time.Second,
		HandshakeTimeout:     5 * time.Second,
		HeartbeatInterval:    100 * time.Millisecond,
		PeerTimeout:          800 * time.Millisecond,
		Algorithm:            AlgorithmAuto,
		SmallThreshold:       64 << 10,
		OneShotBytes:         256 << 10,
		SegmentSize:          1 << 20,
		SharedMemorySegment:  4 << 20,
		MaxPendingHandshakes: 64,
		SharedMemory:         true,
		SharedMemoryRing:     2 << 20,
	}
}

// Validate reports what is wrong with c, or nil.
func (c *Config) Validate() error {
	if c == nil {
		return fmt.Errorf("gloo: nil Config")
	}
	if _, _, err := net.SplitHostPort(c.ListenAddr); err != nil {
		return fmt.Errorf("gloo: config: ListenAddr %q: %v", c.ListenAddr, err)
	}
	switch {
	case c.SocketBuffer < 0 || c.SocketBuffer > 1<<30:
		return fmt.Errorf("gloo: config: SocketBuffer %d outside [0, 1 GiB]", c.SocketBuffer)
	case c.ConnectTimeout <= 0:
		return fmt.Errorf("gloo: config: ConnectTimeout %v must be positive", c.ConnectTimeout)
	case c.HandshakeTimeout <= 0:
		return fmt.Errorf("gloo: config: HandshakeTimeout %v must be positive", c.HandshakeTimeout)
	case c.HeartbeatInterval <= 0:
		return fmt.Errorf("gloo: config: HeartbeatInterval %v must be positive", c.HeartbeatInterval)
	case c.PeerTimeout < 3*c.HeartbeatInterval:
		return fmt.Errorf("gloo: config: PeerTimeout %v must be at least 3 × HeartbeatInterval (%v)", c.PeerTimeout, 3*c.HeartbeatInterval)
	case c.Algorithm >= numAlgorithms:
		return fmt.Errorf("gloo: config: unknown Algorithm %d", c.Algorithm)
	case c.SmallThreshold < 0:
		return fmt.Errorf("gloo: config: SmallThreshold %d is negative", c.SmallThreshold)
	case c.OneShotBytes < 0:
		return fmt.Errorf("gloo: config: OneShotBytes %d is negative", c.OneShotBytes)
	case c.SegmentSize < 4<<10 || c.SegmentSize > 64<<20:
		return fmt.Errorf("gloo: config: SegmentSize %d outside [4 KiB, 64 MiB]", c.SegmentSize)
	case c.SharedMemorySegment != 0 && (c.SharedMemorySegment < 4<<10 || c.SharedMemorySegment > 64<<20):
		return fmt.Errorf("gloo: config: SharedMemorySegment %d outside [4 KiB, 64 MiB]", c.SharedMemorySegment)
	case c.MaxPendingHandshakes < 1:
		return fmt.Errorf("gloo: config: MaxPendingHandshakes %d must be at least 1", c.MaxPendingHandshakes)
	case c.SharedMemoryLanes < 0 || c.SharedMemoryLanes > shmMaxLanes:
		return fmt.Errorf("gloo: config: SharedMemoryLanes %d outside [0, %d]", c.SharedMemoryLanes, shmMaxLanes)
	case c.SharedMemory && !validRingSize(c.SharedMemoryRing):
		return fmt.Errorf("gloo: config: SharedMemoryRing %d is not a power of two in [64 KiB, 64 MiB]", c.SharedMemoryRing)
	}
	return nil
}
