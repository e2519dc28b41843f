package gloo

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"strconv"
	"syscall"
)

// identity says which kernel and which process one end of a connection is,
// as far as Linux tells. Both ends send theirs in the handshake (covered by
// its MACs). It lets a rank ask its own kernel about a silent peer on the
// same host (is that process stopped, gone, or merely not scheduled?), and
// decide whether a link can use shared memory. A zero identity (not Linux,
// no /proc) turns both off.
type identity struct {
	bootID [16]byte // /proc/sys/kernel/random/boot_id: one per kernel boot
	pidNS  uint64   // inode of /proc/self/ns/pid: which pid namespace pid is in
	start  uint64   // start time of the process, clock ticks after boot (guards against pid reuse)
	pid    int32
	flags  uint32 // capability bits (idFlag…)
}

const identityLen = 16 + 8 + 8 + 4 + 4

// Capability bits of identity.flags.
const (
	idFlagShm = 1 << iota // this end sets up shared memory with peers on its host
)

func (id *identity) encode(b []byte) {
	_ = b[identityLen-1]
	copy(b, id.bootID[:])
	binary.LittleEndian.PutUint64(b[16:], id.pidNS)
	binary.LittleEndian.PutUint64(b[24:], id.start)
	binary.LittleEndian.PutUint32(b[32:], uint32(id.pid))
	binary.LittleEndian.PutUint32(b[36:], id.flags)
}

func decodeIdentity(b []byte) identity {
	var id identity
	copy(id.bootID[:], b[:16])
	id.pidNS = binary.LittleEndian.Uint64(b[16:])
	id.start = binary.LittleEndian.Uint64(b[24:])
	id.pid = int32(binary.LittleEndian.Uint32(b[32:]))
	id.flags = binary.LittleEndian.Uint32(b[36:])
	return id
}

func (id *identity) known() bool { return id.bootID != [16]byte{} && id.pid > 0 && id.pidNS != 0 }

// sameProcessSpace reports whether a and b run on one kernel and in one pid
// namespace: then b's pid means the same process to a, and /proc/<pid> is it.
func (a *identity) sameProcessSpace(b *identity) bool {
	return a.known() && b.known() && a.bootID == b.bootID && a.pidNS == b.pidNS
}

// localIdentity reads this process's identity from /proc; a zero identity
// if any part is missing.
func localIdentity() identity {
	var id identity
	raw, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return identity{}
	}
	hx := bytes.ReplaceAll(bytes.TrimSpace(raw), []byte("-"), nil)
	if n, err := hex.Decode(id.bootID[:], hx); err != nil || n != 16 {
		return identity{}
	}
	fi, err := os.Stat("/proc/self/ns/pid")
	if err != nil {
		return identity{}
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return identity{}
	}
	id.pidNS = st.Ino
	id.pid = int32(os.Getpid())
	s, err := readProcStat(id.pid)
	if err != nil {
		return identity{}
	}
	id.start = s.start
	return id
}

type procStat struct {
	state byte   // R, S, D, T, t, Z, X, I, …
	start uint64 // field 22, clock ticks after boot
}

// parseProcStat parses /proc/<pid>/stat: "pid (comm) state ppid …"; comm
// may hold spaces and parentheses, so fields are counted after the last ')'.
func parseProcStat(b []byte) (procStat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return procStat{}, errors.New("gloo: malformed /proc stat")
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state); starttime is field 22.
	if len(f) < 20 || len(f[0]) != 1 {
		return procStat{}, errors.New("gloo: malformed /proc stat")
	}
	start, err := strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil {
		return procStat{}, errors.New("gloo: malformed /proc stat")
	}
	return procStat{state: f[0][0], start: start}, nil
}

func readProcStat(pid int32) (procStat, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/stat")
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(b)
}

// peerProc is what the kernel says about a peer's process.
type peerProc uint8

const (
	procUnknown  peerProc = iota // another host or pid namespace, or /proc unreadable
	procRunnable                 // a thread of it is running or waiting for a CPU: alive, maybe starved
	procBlocked                  // every thread sleeps or waits in the kernel (or a cgroup froze it)
	procStopped                  // stopped by a signal or a tracer: frozen
	procGone                     // exited (or a zombie), or its pid now names another process
)

func (p peerProc) String() string {
	switch p {
	case procRunnable:
		return "runnable"
	case procBlocked:
		return "blocked"
	case procStopped:
		return "stopped"
	case procGone:
		return "gone"
	}
	return "unknown"
}

// procOf asks this kernel about the process peer names, if it can: its
// threads' states (a starved process has runnable threads; a frozen one has
// none).
func procOf(self, peer *identity) peerProc {
	if !self.sameProcessSpace(peer) {
		return procUnknown
	}
	if peer.pid == self.pid && peer.start == self.start {
		return procRunnable // this process: it is running this code
	}
	s, err := readProcStat(peer.pid)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return procGone
	case err != nil:
		return procUnknown
	case s.start != peer.start:
		return procGone
	}
	if p := stateProc(s.state); p != procBlocked {
		return p
	}
	dir := "/proc/" + strconv.Itoa(int(peer.pid)) + "/task/"
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return procUnknown
	}
	for _, t := range tasks {
		b, err := os.ReadFile(dir + t.Name() + "/stat")
		if err != nil {
			continue // the thread exited
		}
		if ts, err := parseProcStat(b); err == nil {
			if p := stateProc(ts.state); p == procRunnable || p == procStopped {
				return p
			}
		}
	}
	return procBlocked
}

func stateProc(state byte) peerProc {
	switch state {
	case 'R':
		return procRunnable
	case 'T', 't':
		return procStopped
	case 'Z', 'X', 'x':
		return procGone
	}
	return procBlocked // S, D, I, W, P, K
}
