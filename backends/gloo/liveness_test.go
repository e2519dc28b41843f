package gloo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

func TestLocalHealth(t *testing.T) {
	const iv = 100 * time.Millisecond
	var h localHealth
	for range 20 {
		h.tick(300*time.Millisecond, iv) // every tick 300 ms late
	}
	if h.score != maxHealthScore {
		t.Fatalf("after 20 late ticks: score %d, want %d", h.score, maxHealthScore)
	}
	for range healthRecover - 1 {
		h.tick(10*time.Millisecond, iv)
	}
	if h.score != maxHealthScore {
		t.Fatalf("score dropped before %d timely ticks: %d", healthRecover, h.score)
	}
	h.tick(0, iv)
	if h.score != maxHealthScore-1 {
		t.Fatalf("after %d timely ticks: score %d, want %d", healthRecover, h.score, maxHealthScore-1)
	}
	h.tick(time.Second, iv)
	if h.score != maxHealthScore || h.timely != 0 {
		t.Fatalf("a late tick: score %d timely %d", h.score, h.timely)
	}
	for range 200 {
		h.tick(0, iv)
	}
	if h.score != 0 {
		t.Fatalf("after 200 timely ticks: score %d, want 0", h.score)
	}
}

func TestSilenceVerdict(t *testing.T) {
	const base = 800 * time.Millisecond
	ms := time.Millisecond
	for _, c := range []struct {
		silent, gap time.Duration
		health      int
		proc        peerProc
		blocked     time.Duration
		dead        bool
	}{
		{silent: 900 * ms, proc: procStopped, dead: true},
		{silent: 900 * ms, proc: procGone, dead: true},
		{silent: 900 * ms, health: 8, proc: procStopped, dead: true}, // certain: no stretching
		{silent: time.Hour, proc: procRunnable, dead: false},         // starved, however long
		{silent: 900 * ms, proc: procBlocked, blocked: 0, dead: false},
		{silent: 2 * time.Second, proc: procBlocked, blocked: 700 * ms, dead: false},
		{silent: 2 * time.Second, proc: procBlocked, blocked: 800 * ms, dead: true},
		{silent: 900 * ms, proc: procUnknown, dead: true},
		{silent: 900 * ms, gap: 400 * ms, proc: procUnknown, dead: false},               // 3 × gap = 1.2 s
		{silent: 1300 * ms, gap: 400 * ms, proc: procUnknown, dead: true},               // past it
		{silent: 1500 * ms, health: 1, proc: procUnknown, dead: false},                  // 2 × base
		{silent: 1700 * ms, health: 1, proc: procUnknown, dead: true},                   //
		{silent: 7 * time.Second, health: 8, gap: time.Second, proc: procUnknown},       // capped at 8 s
		{silent: 8100 * ms, health: 8, gap: time.Second, proc: procUnknown, dead: true}, //
	} {
		dead, why := silenceVerdict(c.silent, base, c.gap, c.health, c.proc, c.blocked)
		if dead != c.dead {
			t.Errorf("silent %v gap %v health %d proc %v blocked %v: dead %v (%s), want %v", c.silent, c.gap, c.health, c.proc, c.blocked, dead, why, c.dead)
		}
		if dead && why == "" {
			t.Errorf("silent %v proc %v: declared dead without a reason", c.silent, c.proc)
		}
	}
}

func TestParseProcStat(t *testing.T) {
	line := "4242 (a) b (c) d) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 7 0 987654 1000000 300 18446744073709551615\n"
	s, err := parseProcStat([]byte(line))
	if err != nil || s.state != 'S' || s.start != 987654 {
		t.Fatalf("got %+v, %v; want state S start 987654", s, err)
	}
	for _, bad := range []string{"", "1 (x)", "1 (x) S 1 2", "1 (x) SS 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"} {
		if _, err := parseProcStat([]byte(bad)); err == nil {
			t.Errorf("%q: parsed", bad)
		}
	}
}

// waitProc waits until the kernel reports want for the process id names.
func waitProc(t *testing.T, self, id *identity, want peerProc) {
	t.Helper()
	waitFor(t, fmt.Sprintf("pid %d %v", id.pid, want), func() bool { return procOf(self, id) == want })
}

// TestProcOf asks the kernel about real processes: one sleeping, stopped,
// continued, busy and dead.
func TestProcOf(t *testing.T) {
	self := localIdentity()
	if !self.known() {
		t.Skip("no /proc identity on this system")
	}
	if got := procOf(&self, &self); got != procRunnable {
		t.Errorf("self: %v", got)
	}
	idOf := func(cmd *exec.Cmd) identity {
		s, err := readProcStat(int32(cmd.Process.Pid))
		if err != nil {
			t.Fatal(err)
		}
		id := self
		id.pid, id.start = int32(cmd.Process.Pid), s.start
		return id
	}
	start := func(name string, args ...string) *exec.Cmd {
		cmd := exec.Command(name, args...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Signal(syscall.SIGCONT); cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	sleeper := start("sleep", "60")
	id := idOf(sleeper)
	waitProc(t, &self, &id, procBlocked)
	sleeper.Process.Signal(syscall.SIGSTOP)
	waitProc(t, &self, &id, procStopped)
	sleeper.Process.Signal(syscall.SIGCONT)
	waitProc(t, &self, &id, procBlocked)
	reused := id
	reused.start++
	if got := procOf(&self, &reused); got != procGone {
		t.Errorf("pid with another start time: %v, want gone", got)
	}
	other := id
	other.pidNS++
	if got := procOf(&self, &other); got != procUnknown {
		t.Errorf("another pid namespace: %v, want unknown", got)
	}
	sleeper.Process.Kill()
	sleeper.Wait()
	if got := procOf(&self, &id); got != procGone {
		t.Errorf("killed and reaped: %v, want gone", got)
	}
	busy := start("sh", "-c", "while :; do :; done")
	id = idOf(busy)
	waitProc(t, &self, &id, procRunnable)
}

// cgroupDir makes a cgroup (v1 controller ctl, or the v2 hierarchy) for a
// test, or skips the test when this machine does not let it. The cgroup
// is removed at cleanup (after the processes in it are gone).
func cgroupDir(t *testing.T, ctl string) (dir string, v2 bool) {
	t.Helper()
	name := fmt.Sprintf("gloo-test-%d-%d", os.Getpid(), time.Now().UnixNano())
	for _, c := range []struct {
		root string
		v2   bool
	}{{"/sys/fs/cgroup/" + ctl, false}, {"/sys/fs/cgroup", true}} {
		if c.v2 {
			// cgroup2 mounted at /sys/fs/cgroup; the freezer is built in,
			// other controllers must be enabled for children.
			b, err := os.ReadFile("/sys/fs/cgroup/cgroup.subtree_control")
			if err != nil || ctl != "freezer" && !strings.Contains(" "+strings.TrimSpace(string(b))+" ", " "+ctl+" ") {
				continue
			}
		} else if _, err := os.Stat(c.root + "/cgroup.procs"); err != nil {
			continue
		}
		d := filepath.Join(c.root, name)
		if err := os.Mkdir(d, 0o755); err != nil {
			continue
		}
		t.Cleanup(func() { os.Remove(d) })
		return d, c.v2
	}
	t.Skipf("cannot make a %s cgroup here (needs root and cgroup v1 %s or v2)", ctl, ctl)
	return "", false
}

func writeFile(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
}

// TestStarvedPeerNotDeclaredFailed starves a rank running in another
// process (a CPU quota of 2 ms per second) far past PeerTimeout: its
// silence is not a failure, because its process is runnable, and the
// all-reduces complete.
func TestStarvedPeerNotDeclaredFailed(t *testing.T) {
	dir, v2 := cgroupDir(t, "cpu")
	const n, victim, count = 2, 1, 64
	ch, comms, _ := processJob(t, n, victim, count, 300*time.Millisecond)
	// The child all-reduces in a loop; its ops and this rank's pair up.
	c := comms[0]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	buf := make([]float32, count)
	if err := c.AllReduce(ctx, comm.Float32s(buf), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if v2 {
		writeFile(t, dir+"/cpu.max", "2000 1000000")
	} else {
		writeFile(t, dir+"/cpu.cfs_period_us", "1000000")
		writeFile(t, dir+"/cpu.cfs_quota_us", "2000")
	}
	writeFile(t, dir+"/cgroup.procs", strconv.Itoa(ch.cmd.Process.Pid))
	t.Cleanup(func() { ch.cmd.Process.Kill(); <-ch.done })
	b := backendOf(c)
	start := time.Now()
	for i := 0; time.Since(start) < 3*time.Second || i < 2; i++ {
		if err := c.AllReduce(ctx, comm.Float32s(buf), comm.Sum); err != nil {
			t.Fatalf("all-reduce %d with a starved peer: %v", i, err)
		}
	}
	// The starvation was real: the peer went silent for longer than
	// PeerTimeout (the gap decays, so this is a lower bound).
	if g := time.Duration(b.links[victim].maxGap.Load()); g <= b.cfg.PeerTimeout {
		t.Errorf("longest recent gap between arrivals from the starved peer: %v, not above PeerTimeout %v", g, b.cfg.PeerTimeout)
	}
}

// TestFrozenCgroupPeerDetected freezes a rank in another process with the
// cgroup freezer (as `docker pause` does): its threads sleep in the kernel,
// not stopped, so the survivors declare it failed when it has been silent
// and never runnable for PeerTimeout.
func TestFrozenCgroupPeerDetected(t *testing.T) {
	dir, v2 := cgroupDir(t, "freezer")
	const n, victim, count = 3, 2, 1 << 12
	ch, comms, _ := processJob(t, n, victim, count, 500*time.Millisecond)
	writeFile(t, dir+"/cgroup.procs", strconv.Itoa(ch.cmd.Process.Pid))
	thaw := func() {
		if v2 {
			os.WriteFile(dir+"/cgroup.freeze", []byte("0"), 0o644)
		} else {
			os.WriteFile(dir+"/freezer.state", []byte("THAWED"), 0o644)
		}
	}
	t.Cleanup(func() { thaw(); ch.cmd.Process.Kill(); <-ch.done })
	started := make(chan struct{})
	go func() {
		<-started
		if v2 {
			writeFile(t, dir+"/cgroup.freeze", "1")
		} else {
			writeFile(t, dir+"/freezer.state", "FROZEN")
		}
	}()
	errs := loopUntilError(comms, count, started)
	for r, err := range errs {
		if r == victim {
			continue
		}
		if !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != victim || errors.Is(err, comm.ErrTimeout) {
			t.Errorf("rank %d: got %v, want ErrPeerFailed naming rank %d", r, err, victim)
		}
	}
}
