package silence

import (
	"encoding/json"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

func TestLocalHealth(t *testing.T) {
	const iv = 100 * time.Millisecond
	var h Health
	for range 20 {
		h.Tick(300*time.Millisecond, iv) // every tick 300 ms late
	}
	if h.score != MaxHealthScore {
		t.Fatalf("after 20 late ticks: score %d, want %d", h.score, MaxHealthScore)
	}
	for range healthRecover - 1 {
		h.Tick(10*time.Millisecond, iv)
	}
	if h.score != MaxHealthScore {
		t.Fatalf("score dropped before %d timely ticks: %d", healthRecover, h.score)
	}
	h.Tick(0, iv)
	if h.score != MaxHealthScore-1 {
		t.Fatalf("after %d timely ticks: score %d, want %d", healthRecover, h.score, MaxHealthScore-1)
	}
	h.Tick(time.Second, iv)
	if h.score != MaxHealthScore || h.timely != 0 {
		t.Fatalf("a late tick: score %d timely %d", h.score, h.timely)
	}
	for range 200 {
		h.Tick(0, iv)
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
		proc        State
		blocked     time.Duration
		limit       time.Duration // RunnableLimit
		dead        bool
	}{
		{silent: 900 * ms, proc: Stopped, dead: true},
		{silent: 900 * ms, proc: Gone, dead: true},
		{silent: 900 * ms, health: 8, proc: Stopped, dead: true}, // certain: no stretching
		{silent: time.Hour, proc: Runnable, dead: false},         // starved, however long
		{silent: 9 * time.Second, proc: Runnable, limit: 10 * time.Second, dead: false},
		{silent: 11 * time.Second, proc: Runnable, limit: 10 * time.Second, dead: true}, // past the limit
		{silent: 2 * time.Second, proc: Stopped, limit: 10 * time.Second, dead: true},   // the limit is a runnable peer's
		{silent: 900 * ms, proc: Blocked, blocked: 0, dead: false},
		{silent: 2 * time.Second, proc: Blocked, blocked: 700 * ms, dead: false},
		{silent: 2 * time.Second, proc: Blocked, blocked: 800 * ms, dead: true},
		{silent: 900 * ms, proc: Unknown, dead: true},
		{silent: 900 * ms, gap: 400 * ms, proc: Unknown, dead: false},               // 3 × gap = 1.2 s
		{silent: 1300 * ms, gap: 400 * ms, proc: Unknown, dead: true},               // past it
		{silent: 1500 * ms, health: 1, proc: Unknown, dead: false},                  // 2 × base
		{silent: 1700 * ms, health: 1, proc: Unknown, dead: true},                   //
		{silent: 7 * time.Second, health: 8, gap: time.Second, proc: Unknown},       // capped at 8 s
		{silent: 8100 * ms, health: 8, gap: time.Second, proc: Unknown, dead: true}, //
	} {
		dead, why := Verdict(Silence{Silent: c.silent, Base: base, Gap: c.gap, Health: c.health, State: c.proc, Blocked: c.blocked, RunnableLimit: c.limit})
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
	s, err := ParseStat([]byte(line))
	if err != nil || s.State != 'S' || s.Start != 987654 {
		t.Fatalf("got %+v, %v; want state S start 987654", s, err)
	}
	for _, bad := range []string{"", "1 (x)", "1 (x) S 1 2", "1 (x) SS 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"} {
		if _, err := ParseStat([]byte(bad)); err == nil {
			t.Errorf("%q: parsed", bad)
		}
	}
}

// waitProc waits until the kernel reports want for the process id names.
func waitProc(t *testing.T, self, id Identity, want State) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for Look(self, id) != want {
		if time.Now().After(deadline) {
			t.Fatalf("pid %d: %v, want %v", id.Pid, Look(self, id), want)
		}
		time.Sleep(5 * time.Millisecond) // polls the kernel, which notifies nothing
	}
}

// TestProcOf asks the kernel about real processes: one sleeping, stopped,
// continued, busy and dead.
func TestLook(t *testing.T) {
	self := Self()
	if !self.Known() {
		t.Skip("no /proc identity on this system")
	}
	if got := Look(self, self); got != Runnable {
		t.Errorf("self: %v", got)
	}
	idOf := func(cmd *exec.Cmd) Identity {
		s, err := ReadStat(int32(cmd.Process.Pid))
		if err != nil {
			t.Fatal(err)
		}
		id := self
		id.Pid, id.Start = int32(cmd.Process.Pid), s.Start
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
	waitProc(t, self, id, Blocked)
	sleeper.Process.Signal(syscall.SIGSTOP)
	waitProc(t, self, id, Stopped)
	sleeper.Process.Signal(syscall.SIGCONT)
	waitProc(t, self, id, Blocked)
	reused := id
	reused.Start++
	if got := Look(self, reused); got != Gone {
		t.Errorf("pid with another start time: %v, want gone", got)
	}
	other := id
	other.PidNS++
	if got := Look(self, other); got != Unknown {
		t.Errorf("another pid namespace: %v, want unknown", got)
	}
	sleeper.Process.Kill()
	sleeper.Wait()
	if got := Look(self, id); got != Gone {
		t.Errorf("killed and reaped: %v, want gone", got)
	}
	busy := start("sh", "-c", "while :; do :; done")
	id = idOf(busy)
	waitProc(t, self, id, Runnable)
}

// A peer in another network namespace may be cut off while its process
// runs: it is judged as a remote peer, unless one end does not tell its
// namespace.
func TestSameProcessSpaceNetNS(t *testing.T) {
	a := Identity{Boot: BootID{1}, PidNS: 2, NetNS: 3, Start: 4, Pid: 5}
	b := a
	b.Pid = 6
	if !a.SameProcessSpace(b) {
		t.Fatal("same namespaces: not the same space")
	}
	b.NetNS = 7
	if a.SameProcessSpace(b) || Look(Self(), Identity{Boot: Self().Boot, PidNS: Self().PidNS, NetNS: Self().NetNS + 1, Pid: 1, Start: 1}) != Unknown {
		t.Fatal("another network namespace: the same space")
	}
	b.NetNS = 0
	if !a.SameProcessSpace(b) {
		t.Fatal("a namespace not told: not the same space")
	}
	if (Identity{}).SameProcessSpace(Identity{}) {
		t.Fatal("zero identities: the same space")
	}
}

func TestIdentityJSON(t *testing.T) {
	id := Identity{Boot: BootID{0xab, 0xcd, 15: 0xef}, PidNS: 4026531836, NetNS: 4026531840, Start: 12345, Pid: 77}
	b, err := json.Marshal(id)
	if err != nil {
		t.Fatal(err)
	}
	var back Identity
	if err := json.Unmarshal(b, &back); err != nil || back != id {
		t.Fatalf("%s → %+v, %v", b, back, err)
	}
	for _, bad := range []string{`{"boot":"xyz"}`, `{"boot":"abcd"}`, `{"boot":7}`} {
		if err := json.Unmarshal([]byte(bad), &back); err == nil {
			t.Errorf("%s: accepted", bad)
		}
	}
}

func TestArrivals(t *testing.T) {
	var a Arrivals
	a.Mark(0)
	a.Arrived(100)
	a.Arrived(400) // a gap of 300
	a.Arrived(450)
	if a.Gap() != 300 || a.Silent(500) != 50 {
		t.Fatalf("gap %v silent %v", a.Gap(), a.Silent(500))
	}
	a.Mark(1000) // silence counts from here; no gap
	if a.Gap() != 300 || a.Silent(1000) != 0 {
		t.Fatalf("after Mark: gap %v silent %v", a.Gap(), a.Silent(1000))
	}
	for range 1000 {
		a.Decay()
	}
	if a.Gap() != 0 {
		t.Fatalf("gap %v after 1,000 decays", a.Gap())
	}
}

func TestLimit(t *testing.T) {
	s := time.Second
	for _, c := range []struct {
		gap    time.Duration
		health int
		want   time.Duration
	}{{0, 0, s}, {s, 0, 3 * s}, {0, 1, 2 * s}, {s, 8, 10 * s}, {time.Hour, 0, 10 * s}} {
		if got := Limit(s, c.gap, c.health); got != c.want {
			t.Errorf("gap %v health %d: %v, want %v", c.gap, c.health, got, c.want)
		}
	}
}

// LookShared answers from one look per process while it is fresh, and
// looks again after.
func TestLookShared(t *testing.T) {
	self := Self()
	if !self.Known() {
		t.Skip("no /proc identity on this system")
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGCONT); cmd.Process.Kill(); cmd.Wait() })
	s, err := ReadStat(int32(cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	id := self
	id.Pid, id.Start = int32(cmd.Process.Pid), s.Start
	waitProc(t, self, id, Blocked)
	if got := LookShared(self, id, time.Hour); got != Blocked {
		t.Fatalf("first shared look: %v", got)
	}
	cmd.Process.Signal(syscall.SIGSTOP)
	waitProc(t, self, id, Stopped)
	if got := LookShared(self, id, time.Hour); got != Blocked {
		t.Fatalf("a fresh shared look: %v, want the cached blocked", got)
	}
	if got := LookShared(self, id, 0); got != Stopped {
		t.Fatalf("a look past its freshness: %v, want stopped", got)
	}
	other := id
	other.NetNS = self.NetNS + 1
	if self.NetNS != 0 && LookShared(self, other, time.Hour) != Unknown {
		t.Fatal("a process behind another network namespace: not unknown")
	}
}
