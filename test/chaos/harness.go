package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftcomm/ftcomm/internal/netns"
	"github.com/ftcomm/ftcomm/membership"
)

const job = "chaos"

// harness runs one chaos job: the coordinators, the replicas, the
// nemesis, and the checks.
type harness struct {
	cfg   Config
	rec   *recorder
	net   network
	cl    *cluster
	self  string
	names []string // every process: the replicas, then the spares
	// replicas are the processes the job starts with; the rest of names
	// are spares.
	replicas []string
	index    map[string]int
	secret   []byte
	rng      *mrand.Rand
	start    time.Time
	work     int64 // spin rounds per step, with Compute "cpu"

	mu       sync.Mutex
	reps     map[string]*replica
	faults   []*Fault
	endAt    int64
	live     []Violation // found by the harness itself (stalls, the end)
	printed  map[string]bool
	quorums  map[uint64]bool
	hogProcs []*child
	// settingsSet counts the settings faults (each sets the next values).
	settingsSet int
}

type replica struct {
	name   string
	index  int
	spare  bool // started as a spare (ft.Config.Spare), every launch
	place  *placement
	launch int
	proc   *child
	expect bool // the harness ends this launch itself
	exited chan struct{}
}

func (h *harness) logf(format string, args ...any) {
	if h.cfg.Log != nil {
		fmt.Fprintf(h.cfg.Log, "%7.1fs  %s\n", time.Since(h.start).Seconds(), fmt.Sprintf(format, args...))
	}
}

// Run runs a chaos job as cfg says and returns its report; the report's
// Violations say whether it passed. An error means the run itself could
// not be carried out.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(cfg.Dir, "logs"), 0o755); err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	h := &harness{cfg: cfg, self: self, index: map[string]int{}, reps: map[string]*replica{},
		printed: map[string]bool{}, quorums: map[uint64]bool{}, start: time.Now(),
		rng: mrand.New(mrand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))}
	if h.cfg.Data.Seed == 0 {
		h.cfg.Data.Seed = cfg.Seed
	}
	h.secret = make([]byte, 32)
	rand.Read(h.secret)
	for i := range cfg.Replicas + cfg.Spares {
		n := string(rune('a' + i))
		h.names = append(h.names, n)
		h.index[n] = i
	}
	h.replicas = h.names[:cfg.Replicas]
	logf, err := os.Create(filepath.Join(cfg.Dir, "run.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	if cfg.Log != nil {
		h.cfg.Log = io.MultiWriter(cfg.Log, logf)
	} else {
		h.cfg.Log = logf
	}
	evf, err := os.Create(filepath.Join(cfg.Dir, "events.jsonl"))
	if err != nil {
		return nil, err
	}
	defer evf.Close()
	h.rec = newRecorder(evf)

	if cfg.Compute == "cpu" {
		h.work = int64(spinRate(500*time.Millisecond) * cfg.StepTime.Seconds())
		h.logf("a step's compute: %d rounds of spin (%v of CPU time)", h.work, cfg.StepTime)
	}
	if cfg.Ftcoord == "" {
		h.logf("building ftcoord")
		if cfg.Ftcoord, err = buildFtcoord(ctx, filepath.Join(cfg.Dir, "bin")); err != nil {
			return nil, err
		}
		h.cfg.Ftcoord = cfg.Ftcoord
	}
	if h.net, err = openNetwork(ctx, cfg.Network); err != nil {
		return nil, err
	}
	defer func() {
		if err := h.net.close(); err != nil {
			h.logf("removing the network: %v", err)
		}
	}()
	h.logf("network %s, topology %s, %d replicas, %d spares, faults %v every %v (random %v), durable %v, seed %d",
		h.net.kind(), cfg.Topology, cfg.Replicas, cfg.Spares, h.kinds(), cfg.MTBF, cfg.Random, cfg.Durable, cfg.Seed)
	if h.cl, err = newCluster(cfg.Topology, cfg.Ftcoord, self, cfg.Dir, h.net.serverHost(), h.rec); err != nil {
		return nil, err
	}
	h.cl.gossip = cfg.Gossip
	defer h.cl.close()
	if err := h.cl.start(ctx); err != nil {
		return nil, fmt.Errorf("chaos: starting the coordinators: %w", err)
	}
	defer h.stopReplicas()
	for _, n := range h.names {
		pl, err := h.net.place(ctx, n, h.cl.endpoints())
		if err != nil {
			return nil, err
		}
		h.reps[n] = &replica{name: n, index: h.index[n], place: pl, spare: !slices.Contains(h.replicas, n)}
	}
	for _, n := range h.replicas {
		if err := h.spawn(n); err != nil {
			return nil, err
		}
	}
	if !h.rec.wait(time.Now().Add(2*time.Minute), func(r *recorder) bool { return r.together(h.replicas, h.start) }) {
		return nil, fmt.Errorf("chaos: the %d replicas did not start committing together within 2 minutes (logs in %s)", cfg.Replicas, cfg.Dir)
	}
	h.logf("all %d replicas committing together at step %d", cfg.Replicas, h.rec.step())
	// The spares start once the job is at its size: the target (the most
	// replica groups a quorum had) is the replicas', and no spare waits
	// for a job still forming.
	spares := h.names[cfg.Replicas:]
	for _, n := range spares {
		if err := h.spawn(n); err != nil {
			return nil, err
		}
	}
	if len(spares) > 0 {
		since := time.Now()
		if !h.rec.wait(since.Add(time.Minute), func(r *recorder) bool { return r.startedSince(spares, since.Add(-time.Minute)) }) {
			return nil, fmt.Errorf("chaos: the %d spares did not start within a minute (logs in %s)", len(spares), cfg.Dir)
		}
		h.logf("%d spares waiting: %v", len(spares), spares)
	}
	h.startHogs()
	defer h.stopHogs()

	bg, stopBG := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); h.observe(bg) }()
	go func() { defer wg.Done(); h.watch(bg) }()

	nemesisStart, loadStart := time.Now(), loadavg()
	h.rec.harness(Event{Kind: evNemesis, Reason: "the nemesis begins"})
	h.nemesis(ctx)
	nemesisEnd, loadEnd := time.Now(), loadavg()
	h.rec.harness(Event{Kind: evNemesis, Reason: "the nemesis ends"})
	if cfg.Tail > 0 {
		h.logf("running on for %v without faults", cfg.Tail)
		select {
		case <-ctx.Done():
		case <-time.After(cfg.Tail):
		}
	}
	h.settle(ctx)
	stopBG()
	wg.Wait()
	h.pollQuorums(ctx) // the last epochs
	h.stopReplicas()

	evs := h.rec.snapshot()
	a := check(h.checkInput(evs, true))
	h.mu.Lock()
	live := append([]Violation(nil), h.live...)
	faults := append([]*Fault(nil), h.faults...)
	h.mu.Unlock()
	a.Violations = append(a.Violations, live...)
	sort.SliceStable(a.Violations, func(i, j int) bool { return a.Violations[i].T < a.Violations[j].T })
	for _, v := range a.Violations {
		h.printViolation(v, evs)
	}
	rep := buildReport(h.cfg, h.net.kind(), evs, faults, a, nemesisStart, nemesisEnd)
	rep.LoadStart, rep.LoadEnd = loadStart, loadEnd
	if err := rep.write(cfg.Dir, evs, faults); err != nil {
		return rep, err
	}
	return rep, nil
}

func (h *harness) checkInput(evs []Event, final bool) checkInput {
	h.mu.Lock()
	defer h.mu.Unlock()
	// Copies: the nemesis goes on filling in the newest fault (its end,
	// its errors) while the watcher checks.
	faults := make([]*Fault, len(h.faults))
	for i, f := range h.faults {
		c := *f
		faults[i] = &c
	}
	return checkInput{Events: evs, Faults: faults, Durable: h.cfg.Durable,
		Timeout: h.cfg.Timeout, Margin: h.cfg.Margin, Linger: h.linger(), Params: h.cfg.Params, Index: h.index,
		EndAt: h.endAt, Final: final, StrictDeaths: h.cfg.StrictDeaths, Target: h.cfg.Replicas, SpareBound: h.cfg.spareBound(),
		Data: h.cfg.Data}
}

// linger is how long after a fault was undone its effects may still show:
// a collective's timeout, a lease, and slack.
func (h *harness) linger() time.Duration { return h.cfg.Timeout + h.cfg.LeaseTTL + 2*time.Second }

func buildFtcoord(ctx context.Context, dir string) (string, error) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	path := filepath.Join(dir, "ftcoord")
	out, err := exec.CommandContext(ctx, goTool, "build", "-o", path, "github.com/ftcomm/ftcomm/cmd/ftcoord").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("chaos: go build ftcoord: %v\n%s", err, out)
	}
	return path, nil
}

func openNetwork(ctx context.Context, kind string) (network, error) {
	if kind == "auto" {
		if netns.Available() == nil {
			kind = "netns"
		} else {
			kind = "proxy"
		}
	}
	switch kind {
	case "netns":
		if err := netns.Available(); err != nil {
			return nil, err
		}
		return newNSNetwork(ctx)
	case "proxy":
		return newProxyNetwork(), nil
	}
	return noNetwork{}, nil
}

// kinds are the configured faults this run can inject.
func (h *harness) kinds() []FaultKind {
	var out []FaultKind
	for _, k := range h.cfg.Faults {
		switch {
		case k.needsNetwork() && (h.net == nil || h.net.kind() == "none"):
		case k == FaultEtcd && h.cfg.Topology != "cluster":
		case k == FaultPartition && h.cfg.Replicas < 2:
		default:
			out = append(out, k)
		}
	}
	return out
}

// spawn starts a new launch of replica name.
func (h *harness) spawn(name string) error {
	h.mu.Lock()
	r := h.reps[name]
	r.launch++
	launch := r.launch
	h.mu.Unlock()
	spec := replicaSpec{Job: job, Name: name, Index: r.index, Credentials: h.cl.credentialsFile(0), Endpoints: r.place.endpoints, Host: r.place.host,
		GlooListen: r.place.glooListen, GlooAdvertise: r.place.glooAdvertise, Gossip: r.place.gossip, GossipTuning: h.cfg.Gossip,
		Params: h.cfg.Params, StepTime: h.cfg.StepTime, Timeout: h.cfg.Timeout, LeaseTTL: h.cfg.LeaseTTL,
		MinReplicas: 1, Durable: h.cfg.Durable, Secret: h.secret, SlowOp: h.cfg.Timeout / 2, Work: h.work, Stragglers: h.cfg.Stragglers,
		Spare: r.spare, Data: h.cfg.Data}
	b, _ := json.Marshal(spec)
	cmd := r.place.command(h.self)
	cmd.Env = append(append(os.Environ(), replicaEnv+"="+string(b)), r.place.env...)
	who := fmt.Sprintf("%s#%d", name, launch)
	p, err := startChild(who, cmd, filepath.Join(h.cfg.Dir, "logs", fmt.Sprintf("%s-%d.log", name, launch)), func(line []byte) {
		var e Event
		if err := json.Unmarshal(line, &e); err != nil {
			return
		}
		e.Replica, e.Launch = name, launch
		h.rec.add(e)
	})
	if err != nil {
		return err
	}
	exited := make(chan struct{})
	h.mu.Lock()
	r.proc, r.expect, r.exited = p, false, exited
	h.mu.Unlock()
	if pa, ok := h.net.(interface{ started(string, int) }); ok {
		pa.started(name, p.pid())
	}
	var role string
	if r.spare {
		role = "spare"
	}
	h.rec.harness(Event{Kind: evSpawn, Replica: name, Launch: launch, Pid: p.pid(), Reason: role})
	go func() { // exits with the process
		<-p.done
		h.mu.Lock()
		expected := r.proc != p || r.expect
		h.mu.Unlock()
		why := exitReason(p.err)
		if expected {
			why = "expected: " + why
		}
		h.rec.harness(Event{Kind: evExit, Replica: name, Launch: launch, Pid: p.pid(), Reason: why})
		close(exited)
	}()
	return nil
}

// signal sends sig to replica name's current process; kill makes its exit
// expected.
func (h *harness) signal(name string, sig syscall.Signal) (*child, error) {
	h.mu.Lock()
	r := h.reps[name]
	p := r.proc
	if sig == syscall.SIGKILL || sig == syscall.SIGTERM {
		r.expect = true
	}
	h.mu.Unlock()
	if p == nil {
		return nil, fmt.Errorf("chaos: %s has no process", name)
	}
	return p, p.signal(sig)
}

// tell writes a line to replica name's current process (pause, resume,
// stop N).
func (h *harness) tell(name, line string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	p := h.reps[name].proc
	if p == nil || p.exited() {
		return fmt.Errorf("chaos: %s has no process", name)
	}
	_, err := fmt.Fprintln(p.stdin, line)
	return err
}

// starve pins replica name's process to the last CPU and starts loops busy
// loops pinned there too; undo stops the loops and lets the process run on
// every CPU again.
func (h *harness) starve(name string, loops int) (undo func() error, err error) {
	h.mu.Lock()
	p := h.reps[name].proc
	h.mu.Unlock()
	if p == nil || p.exited() {
		return nil, fmt.Errorf("chaos: %s has no process", name)
	}
	var one, all unix.CPUSet
	one.Set(runtime.NumCPU() - 1)
	if err := unix.SchedGetaffinity(0, &all); err != nil {
		return nil, err
	}
	if err := setAffinity(p.pid(), &one); err != nil {
		return nil, err
	}
	var busy []*child
	undo = func() error {
		for _, b := range busy {
			b.stop(syscall.SIGKILL, 5*time.Second)
		}
		return setAffinity(p.pid(), &all)
	}
	for i := range loops {
		b, err := startChild(fmt.Sprintf("busy%d", i), exec.Command("sh", "-c", "while :; do :; done"),
			filepath.Join(h.cfg.Dir, "logs", "busy.log"), nil)
		if err == nil {
			busy = append(busy, b)
			err = unix.SchedSetaffinity(b.pid(), &one)
		}
		if err != nil {
			return nil, errors.Join(err, undo())
		}
	}
	return undo, nil
}

// cpuCgroup is where the cgroup v1 cpu controller is mounted.
const cpuCgroup = "/sys/fs/cgroup/cpu"

// quota limits replica name's process to frac of one CPU (a cgroup of the
// v1 cpu controller); undo moves it back and removes the cgroup.
func (h *harness) quota(name string, frac float64) (undo func() error, err error) {
	h.mu.Lock()
	p := h.reps[name].proc
	h.mu.Unlock()
	if p == nil || p.exited() {
		return nil, fmt.Errorf("chaos: %s has no process", name)
	}
	b := make([]byte, 4)
	rand.Read(b)
	dir := filepath.Join(cpuCgroup, fmt.Sprintf("ftcomm-chaos-%x", b))
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("chaos: a CPU quota needs the cgroup v1 cpu controller at %s: %w", cpuCgroup, err)
	}
	const period = 100_000 // µs
	write := func(file, v string) error { return os.WriteFile(filepath.Join(dir, file), []byte(v), 0o644) }
	undo = func() error {
		var errs []error
		if !p.exited() {
			errs = append(errs, os.WriteFile(filepath.Join(cpuCgroup, "cgroup.procs"), []byte(strconv.Itoa(p.pid())), 0o644))
		}
		return errors.Join(append(errs, os.Remove(dir))...)
	}
	if err := errors.Join(write("cpu.cfs_period_us", strconv.Itoa(period)),
		write("cpu.cfs_quota_us", strconv.Itoa(int(frac*period))),
		write("cgroup.procs", strconv.Itoa(p.pid()))); err != nil {
		return nil, errors.Join(err, undo())
	}
	return undo, nil
}

// setAffinity sets the CPU affinity of every thread of process pid.
func setAffinity(pid int, set *unix.CPUSet) error {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return err
	}
	var errs []error
	for _, t := range tasks {
		if tid, err := strconv.Atoi(t.Name()); err == nil {
			if err := unix.SchedSetaffinity(tid, set); err != nil && !errors.Is(err, unix.ESRCH) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// running reports whether replica name's current process is alive.
func (h *harness) running(name string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	p := h.reps[name].proc
	return p != nil && !p.exited()
}

// stopReplicas ends every replica process (closing stdin: they exit at once).
func (h *harness) stopReplicas() {
	h.mu.Lock()
	var ps []*child
	for _, r := range h.reps {
		if r.proc != nil && !r.proc.exited() {
			r.expect = true
			ps = append(ps, r.proc)
		}
	}
	h.mu.Unlock()
	for _, p := range ps {
		p.cmd.Process.Signal(syscall.SIGCONT)
		p.stdin.Close()
	}
	for _, p := range ps {
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			p.cmd.Process.Kill()
			<-p.done
		}
	}
}

// settle ends the chaos: every link healed, every process running; once
// the job commits at its full size (Config.Replicas processes together),
// the others (spares waiting) are stopped, and each of the job's is told
// to stop at a step a little ahead, and reports its final state.
func (h *harness) settle(ctx context.Context) {
	h.net.heal(ctx)
	for _, n := range h.names {
		h.net.shape(ctx, n, netns.Shape{})
		if !h.running(n) {
			h.spawn(n)
		}
	}
	for _, i := range h.cl.coordsDown() {
		h.cl.startCoord(i)
	}
	since := time.Now()
	h.logf("settling: waiting for %d replicas (or more) to commit together", h.cfg.Replicas)
	var job []string
	if !h.rec.wait(time.Now().Add(2*time.Minute), func(r *recorder) bool {
		job = r.fullSize(h.cfg.Replicas, since)
		return job != nil
	}) {
		h.violation(time.Now().UnixNano(), invLiveness, fmt.Sprintf("%d replicas did not commit together within 2 minutes of the last fault", h.cfg.Replicas))
		return
	}
	target := h.rec.step() + 20
	h.mu.Lock()
	h.endAt = time.Now().UnixNano()
	var exits, waiting []chan struct{}
	for _, r := range h.reps {
		r.expect = true
		if slices.Contains(job, r.name) {
			fmt.Fprintf(r.proc.stdin, "stop %d\n", target)
			exits = append(exits, r.exited)
		} else { // a spare waiting: it exits at once
			r.proc.stdin.Close()
			waiting = append(waiting, r.exited)
		}
	}
	h.mu.Unlock()
	if len(waiting) > 0 {
		h.logf("settled: %v commit at full size; %d spares stopped", job, len(waiting))
	}
	h.logf("settled: stopping every replica at step %d", target)
	deadline := time.After(2 * time.Minute)
	for _, ch := range append(exits, waiting...) {
		select {
		case <-ch:
		case <-deadline:
			h.violation(time.Now().UnixNano(), invLiveness, fmt.Sprintf("the replicas did not reach step %d within 2 minutes", target))
			return
		}
	}
}

// violation records one the harness found itself.
func (h *harness) violation(t int64, inv, detail string) {
	v := Violation{T: t, Invariant: inv, Detail: detail}
	h.mu.Lock()
	h.live = append(h.live, v)
	h.mu.Unlock()
	h.logf("VIOLATION %s: %s", inv, detail)
}

// observe records the coordinator's epochs (its history) every 2 s.
func (h *harness) observe(ctx context.Context) {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			h.pollQuorums(ctx)
		}
	}
}

func (h *harness) pollQuorums(ctx context.Context) {
	qctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	qs, err := h.cl.history(qctx, job)
	if err != nil {
		return // down for now; the history keeps them
	}
	sort.Slice(qs, func(i, j int) bool { return qs[i].Epoch < qs[j].Epoch })
	for _, q := range qs {
		h.mu.Lock()
		seen := h.quorums[q.Epoch]
		h.quorums[q.Epoch] = true
		h.mu.Unlock()
		if seen {
			continue
		}
		h.rec.add(quorumEvent(q))
	}
}

func quorumEvent(q membership.Quorum) Event {
	e := Event{T: q.Created.UnixNano(), Kind: evQuorum, Epoch: q.Epoch, Removed: q.Removed, Reason: q.Reason,
		Promoted: q.Promoted, Replaced: q.Replaced, Target: q.Target}
	for _, p := range q.Participants {
		e.Members = append(e.Members, p.ID)
	}
	return e
}

// watch checks the invariants every 5 s (printing new violations at once)
// and that the job does not stall.
func (h *harness) watch(ctx context.Context) {
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	stalled := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		evs := h.rec.snapshot()
		a := check(h.checkInput(evs, false))
		for _, v := range a.Violations {
			h.printViolation(v, evs)
		}
		var last int64
		for i := len(evs) - 1; i >= 0; i-- {
			if evs[i].Kind == evCommit {
				last = evs[i].T
				break
			}
		}
		if d := time.Since(time.Unix(0, last)); d > 30*time.Second && !stalled {
			stalled = true
			h.violation(time.Now().UnixNano(), invLiveness, fmt.Sprintf("no replica committed for %v", d.Round(time.Second)))
		} else if d < 30*time.Second {
			stalled = false
		}
	}
}

// printViolation prints a violation, once, with the timeline around it.
func (h *harness) printViolation(v Violation, evs []Event) {
	h.mu.Lock()
	seen := h.printed[v.key()]
	h.printed[v.key()] = true
	h.mu.Unlock()
	if seen || h.cfg.Log == nil {
		return
	}
	fmt.Fprintf(h.cfg.Log, "\nVIOLATION %s at %s: %s\ntimeline:\n%s\n", v.Invariant, h.stamp(v.T), v.Detail,
		timeline(evs, v.T, 4*time.Second, time.Second, h.start))
}

func (h *harness) stamp(t int64) string {
	return fmt.Sprintf("%.3fs", time.Unix(0, t).Sub(h.start).Seconds())
}

// timeline renders the events from before to after t, one line each, with
// runs of commits of one epoch folded into one line.
func timeline(evs []Event, t int64, before, after time.Duration, origin time.Time) string {
	var b strings.Builder
	from, to := t-int64(before), t+int64(after)
	type run struct {
		first, last Event
		n           int
		who         map[string]bool
	}
	var open *run
	at := func(e Event) float64 { return time.Unix(0, e.T).Sub(origin).Seconds() }
	flush := func() {
		if open == nil {
			return
		}
		if open.n == 1 {
			fmt.Fprintf(&b, "  %9.3fs %s\n", at(open.first), open.first)
		} else {
			var who []string
			for w := range open.who {
				who = append(who, w)
			}
			sort.Strings(who)
			fmt.Fprintf(&b, "  %9.3fs %-8s commit    ×%d steps %d..%d epoch %d by %v (n %d), to %.3fs\n", at(open.first),
				"", open.n, open.first.Step, open.last.Step, open.first.Epoch, who, open.last.N, at(open.last))
		}
		open = nil
	}
	for _, e := range evs {
		if e.T < from || e.T > to {
			continue
		}
		if e.Kind == evCommit && open != nil && open.first.Epoch == e.Epoch {
			open.last = e
			open.n++
			open.who[e.who()] = true
			continue
		}
		flush()
		if e.Kind == evCommit {
			open = &run{first: e, last: e, n: 1, who: map[string]bool{e.who(): true}}
			continue
		}
		mark := " "
		if e.T >= t && e.T < t+int64(time.Millisecond) {
			mark = ">"
		}
		fmt.Fprintf(&b, " %s%9.3fs %s\n", mark, at(e), e)
	}
	flush()
	return b.String()
}

// startHogs starts Config.Hog CPU-burning processes.
func (h *harness) startHogs() {
	for i := range h.cfg.Hog {
		p, err := startChild(fmt.Sprintf("hog%d", i), exec.Command("sh", "-c", "while :; do :; done"),
			filepath.Join(h.cfg.Dir, "logs", "hog.log"), nil)
		if err != nil {
			h.logf("hog: %v", err)
			continue
		}
		h.hogProcs = append(h.hogProcs, p)
	}
	if len(h.hogProcs) > 0 {
		h.logf("%d CPU hogs running", len(h.hogProcs))
	}
}

func (h *harness) stopHogs() {
	for _, p := range h.hogProcs {
		p.stop(syscall.SIGKILL, 5*time.Second)
	}
	h.hogProcs = nil
}
