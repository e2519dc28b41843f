package silence

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// Identity says which kernel and which process one end of a connection is,
// as far as Linux tells. Each end sends its own to the other (the gloo
// handshake, membership's link hello and group record), so that a silent
// peer on this host can be looked up in /proc (Look). A zero Identity (not
// Linux, no /proc) turns the look off.
type Identity struct {
	Boot  BootID `json:"boot"`            // /proc/sys/kernel/random/boot_id: one per kernel boot
	PidNS uint64 `json:"pidns"`           // inode of /proc/self/ns/pid: which pid namespace Pid is in
	NetNS uint64 `json:"netns,omitempty"` // inode of /proc/self/ns/net (0: not told)
	Start uint64 `json:"start"`           // start time of the process, clock ticks after boot (guards against pid reuse)
	Pid   int32  `json:"pid"`
}

// BootID is a kernel's boot id; it reads and writes as 32 hex digits.
type BootID [16]byte

func (b BootID) MarshalText() ([]byte, error) { return []byte(hex.EncodeToString(b[:])), nil }

func (b *BootID) UnmarshalText(t []byte) error {
	if n, err := hex.Decode(b[:], t); err != nil || n != len(b) {
		return fmt.Errorf("silence: boot id %q: not 32 hex digits", t)
	}
	return nil
}

// Known reports whether id names a process (a zero or partial identity
// names none).
func (id Identity) Known() bool { return id.Boot != BootID{} && id.Pid > 0 && id.PidNS != 0 }

// SameProcessSpace reports whether a and b run on one kernel and in one pid
// namespace (then b's pid means the same process to a, and /proc/<pid> is
// it), and, where both tell their network namespace, in the same one: a
// peer behind another network namespace can be cut off from this one
// (a partition) while its process runs, so its silence is judged as a
// remote peer's.
func (a Identity) SameProcessSpace(b Identity) bool {
	return a.Known() && b.Known() && a.Boot == b.Boot && a.PidNS == b.PidNS &&
		(a.NetNS == 0 || b.NetNS == 0 || a.NetNS == b.NetNS)
}

// Self is this process's identity, read from /proc once; a zero Identity
// if any part is missing.
var Self = sync.OnceValue(readSelf)

func readSelf() Identity {
	var id Identity
	raw, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return Identity{}
	}
	if id.Boot.UnmarshalText(bytes.ReplaceAll(bytes.TrimSpace(raw), []byte("-"), nil)) != nil {
		return Identity{}
	}
	if id.PidNS = nsInode("pid"); id.PidNS == 0 {
		return Identity{}
	}
	id.NetNS = nsInode("net")
	id.Pid = int32(os.Getpid())
	s, err := ReadStat(id.Pid)
	if err != nil {
		return Identity{}
	}
	id.Start = s.Start
	return id
}

// nsInode is the inode of this process's namespace of a kind, 0 if unknown.
func nsInode(kind string) uint64 {
	fi, err := os.Stat("/proc/self/ns/" + kind)
	if err != nil {
		return 0
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0
	}
	return st.Ino
}

// Stat is what this package reads of /proc/<pid>/stat.
type Stat struct {
	State byte   // R, S, D, T, t, Z, X, I, …
	Start uint64 // field 22, clock ticks after boot
}

var errStat = errors.New("silence: malformed /proc stat")

// ParseStat parses /proc/<pid>/stat: "pid (comm) state ppid …"; comm may
// hold spaces and parentheses, so fields are counted after the last ')'.
func ParseStat(b []byte) (Stat, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return Stat{}, errStat
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state); starttime is field 22.
	if len(f) < 20 || len(f[0]) != 1 {
		return Stat{}, errStat
	}
	start, err := strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil {
		return Stat{}, errStat
	}
	return Stat{State: f[0][0], Start: start}, nil
}

// ReadStat reads and parses /proc/<pid>/stat.
func ReadStat(pid int32) (Stat, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/stat")
	if err != nil {
		return Stat{}, err
	}
	return ParseStat(b)
}

// State is what the kernel says about a peer's process.
type State uint8

const (
	Unknown  State = iota // another host or namespace, or /proc unreadable
	Runnable              // a thread of it is running or waiting for a CPU: alive, maybe starved
	Blocked               // every thread sleeps or waits in the kernel (or a cgroup froze it)
	Stopped               // stopped by a signal or a tracer: frozen
	Gone                  // exited (or a zombie), or its pid now names another process
)

func (s State) String() string {
	switch s {
	case Runnable:
		return "runnable"
	case Blocked:
		return "blocked"
	case Stopped:
		return "stopped"
	case Gone:
		return "gone"
	}
	return "unknown"
}

// Look asks this kernel about the process peer names, if it can: its
// threads' states (a starved process has runnable threads; a frozen one has
// none).
func Look(self, peer Identity) State {
	if !self.SameProcessSpace(peer) {
		return Unknown
	}
	if peer.Pid == self.Pid && peer.Start == self.Start {
		return Runnable // this process: it is running this code
	}
	s, err := ReadStat(peer.Pid)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return Gone
	case err != nil:
		return Unknown
	case s.Start != peer.Start:
		return Gone
	}
	if p := stateOf(s.State); p != Blocked {
		return p
	}
	dir := "/proc/" + strconv.Itoa(int(peer.Pid)) + "/task/"
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return Unknown
	}
	for _, t := range tasks {
		b, err := os.ReadFile(dir + t.Name() + "/stat")
		if err != nil {
			continue // the thread exited
		}
		if ts, err := ParseStat(b); err == nil {
			if p := stateOf(ts.State); p == Runnable || p == Stopped {
				return p
			}
		}
	}
	return Blocked
}

func stateOf(state byte) State {
	switch state {
	case 'R':
		return Runnable
	case 'T', 't':
		return Stopped
	case 'Z', 'X', 'x':
		return Gone
	}
	return Blocked // S, D, I, W, P, K
}

// looks is the shared cache of LookShared.
var looks = struct {
	sync.Mutex
	m map[Identity]look
}{m: map[Identity]look{}}

type look struct {
	state State
	at    time.Time
}

// LookShared is Look with one answer per peer process shared by every
// caller for up to fresh: a process holding thousands of links to a few
// peer processes (membership's group links at 10,000 members per host)
// would otherwise read /proc for each link's every look, and on a starved
// host that work starves it further.
func LookShared(self, peer Identity, fresh time.Duration) State {
	if !self.SameProcessSpace(peer) {
		return Unknown
	}
	now := time.Now()
	looks.Lock()
	l, ok := looks.m[peer]
	looks.Unlock()
	if ok && now.Sub(l.at) < fresh {
		return l.state
	}
	st := Look(self, peer)
	looks.Lock()
	defer looks.Unlock()
	if len(looks.m) >= 4096 {
		for id, l := range looks.m {
			if now.Sub(l.at) >= fresh {
				delete(looks.m, id)
			}
		}
	}
	looks.m[peer] = look{st, now}
	return st
}
