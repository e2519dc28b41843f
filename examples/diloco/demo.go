package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/examples/diloco/charlm"
)

// proc is one replica process.
type proc struct {
	job     *jobState
	replica int
	restart int
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	started time.Time
	killed  bool
	exited  bool
	stopped bool // told to exit (stdin closed)
	// registered: its ft.Comm is registered with the coordinator; released:
	// it was told to start training.
	registered, released bool
	log                  *os.File
	spare                bool // started as a spare (ft.Config.Spare)
	tookPart             bool // committed a sync
}

// kill is one executed failure.
type kill struct {
	Failure
	KilledAt        time.Time
	KilledStep      int64
	KilledEpoch     uint64    // the newest epoch seen at the kill
	RestartAt       time.Time // when it is (was) started again; zero: not yet
	Restarted       bool
	SurvivorsCommit time.Duration // kill → the survivors' first commit without it
	RejoinedStep    int64
	Rejoined        time.Duration // restart → its first commit (after healing)
	Healed          bool
	HealedBytes     int64 // what it fetched from its peers (ft's EventHealed)
	HealTook        time.Duration
	// Spares: who was promoted in its place (EventPromoted), its first
	// committed sync, and kill → the first sync committed at full size
	// again (with or without a spare: capacity back).
	Promoted     string
	PromotedStep int64
	CapacityBack time.Duration
}

type point struct {
	Step int64
	Loss float64
}

// jobState is what the demo knows of one training job.
type jobState struct {
	name         string
	faulty       bool
	procs        []*proc
	pending      []Failure // failures still to inject
	kills        []*kill
	settingsSeen map[int64]bool  // syncs from which new job settings were taken (ftcoord job set)
	plansLogs    []string        // every replica process's plans log
	killedLogs   map[string]bool // the plans logs of the processes killed
	started      time.Time
	finished     time.Time

	step         int64
	epoch        uint64
	participants int
	lastEvent    string
	trainLoss    map[int64][]float64 // step → the replicas' mean training losses
	curve        []point             // validation loss of the global parameters
	done         map[int]event       // replica → its done event
	failedSyncs  map[int64]bool      // syncs that did not commit at some replica
	capacity     map[int64]int       // committed sync → its participants (the capacity timeline)
	epochs       map[uint64]bool
	peakPayload  int64
	wire         int64 // summed over the replicas' syncs
	syncEvents   int64
	blockedMs    float64
	trainMs      float64
	method       string
	finalLoss    float64
	finalHashes  map[string]int
	errors       []string
	bar          *mpb.Bar
	released     bool // its replicas were told to start
	shownEpoch   uint64

	mu     sync.Mutex // status is read by the progress bar's goroutine
	status string
}

func (j *jobState) setStatus() {
	loss := "–"
	if ls := j.trainLoss[j.step]; len(ls) > 0 {
		var s float64
		for _, l := range ls {
			s += l
		}
		loss = fmt.Sprintf("%.3f", s/float64(len(ls)))
	}
	j.mu.Lock()
	j.status = fmt.Sprintf("loss %s │ epoch %d │ %d replicas │ %s", loss, j.epoch, j.participants, j.lastEvent)
	j.mu.Unlock()
}

func (j *jobState) getStatus() string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.status
}

type evalReq struct {
	job   *jobState
	step  int64
	path  string
	final bool
	n     int
}

type evalRes struct {
	evalReq
	loss float64
	err  error
}

// demo runs the whole thing: coordinator, replica processes, failures,
// progress, evaluation, summary and plot.
type demo struct {
	cfg     Config
	run     runFile
	runPath string
	exe     string
	out     io.Writer // the terminal (through the progress container while bars are on)
	term    io.Writer // the terminal
	log     *zap.Logger
	events  chan event
	exits   chan *proc
	jobs    []*jobState
	evals   chan evalReq
	results chan evalRes
	val     []uint8
	samples int64 // the training set's samples (ft.SamplerConfig.Size)
	bars    *mpb.Progress
	wg      sync.WaitGroup // reader goroutines of the replicas' pipes
}

// Summary is what the demo measured; it is printed and written to
// summary.json.
type Summary struct {
	Date          string
	Settings      string
	Syncs         int64
	Jobs          []JobSummary
	LossDiffPct   float64 // (with failures − without) / without, %
	WithinTarget  bool    // |LossDiffPct| ≤ 2
	Plot          string
	DashboardHint string
}

// JobSummary is one job's part of the Summary.
type JobSummary struct {
	Name             string
	Faulty           bool
	Committed        int64
	Wall             time.Duration
	FinalValLoss     float64
	Kills            []*kill
	FailedSyncs      int // syncs that did not commit at some replica
	Epochs           int
	PeakPayloadBytes int64
	WirePerSync      float64
	BlockedPct       float64 // time the training loops waited on syncs, % of their training time
	Method           string
	StatesAgree      bool
	Spares           int
	Timeline         string   // participants per committed sync, as runs ("1-64: 4, 65: 3, 66-161: 4")
	Data             Coverage // what the committed syncs read, from the replicas' plans logs
}

func newDemo(cfg Config, stdout io.Writer, log *zap.Logger) (*demo, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return &demo{cfg: cfg, exe: exe, out: stdout, term: stdout, log: log, events: make(chan event, 1024), exits: make(chan *proc, 64),
		evals: make(chan evalReq, 1024), results: make(chan evalRes, 1024)}, nil
}

func goSourceDir() (string, error) {
	if out, err := exec.Command("go", "env", "GOROOT").Output(); err == nil {
		if root := strings.TrimSpace(string(out)); root != "" {
			return filepath.Join(root, "src"), nil
		}
	}
	if root := os.Getenv("GOROOT"); root != "" {
		return filepath.Join(root, "src"), nil
	}
	return "", errors.New("cannot find the Go distribution's source (go env GOROOT); pass -corpus")
}

// prepare loads the corpus, writes the token files and run.json.
func (d *demo) prepare(endpoints []string, credentials string) error {
	dir := d.cfg.Report
	for _, sub := range []string{"data", "snapshots", "logs", "plans"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			return err
		}
	}
	root := d.cfg.Corpus
	if root == "" {
		var err error
		if root, err = goSourceDir(); err != nil {
			return err
		}
	}
	corpus, err := charlm.LoadGoSource(root, d.cfg.TrainBytes, d.cfg.ValBytes)
	if err != nil {
		return err
	}
	d.val = corpus.Val
	d.samples = samplerConfig(d.cfg, corpus.Train).Size
	fmt.Fprintf(d.out, "corpus: %s — %d KB of training text (%d files), %d KB of validation text (%d other files)\n",
		root, len(corpus.Train)>>10, corpus.Files[0], len(corpus.Val)>>10, corpus.Files[1])
	train, val := filepath.Join(dir, "data", "train.tok"), filepath.Join(dir, "data", "val.tok")
	if err := os.WriteFile(train, corpus.Train, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(val, corpus.Val, 0o644); err != nil {
		return err
	}
	secret := make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		return err
	}
	d.run = runFile{Config: d.cfg, Endpoints: endpoints, Credentials: credentials, Secret: secret, Train: abs(train), Val: abs(val), Snapshots: abs(filepath.Join(dir, "snapshots")),
		Plans: abs(filepath.Join(dir, "plans"))}
	b, err := json.MarshalIndent(d.run, "", "  ")
	if err != nil {
		return err
	}
	d.runPath = abs(filepath.Join(dir, "run.json"))
	return os.WriteFile(d.runPath, b, 0o600)
}

func abs(p string) string {
	if a, err := filepath.Abs(p); err == nil {
		return a
	}
	return p
}

// newJob is a job of cfg.Replicas replicas and spares spare processes.
func (d *demo) newJob(name string, faulty bool, spares int) *jobState {
	j := &jobState{name: name, faulty: faulty, procs: make([]*proc, d.cfg.Replicas+spares), trainLoss: map[int64][]float64{},
		done: map[int]event{}, failedSyncs: map[int64]bool{}, epochs: map[uint64]bool{}, finalHashes: map[string]int{},
		capacity: map[int64]int{}, killedLogs: map[string]bool{}, lastEvent: "starting"}
	if faulty {
		j.pending = slices.Clone(d.cfg.Failures)
		slices.SortFunc(j.pending, func(a, b Failure) int { return int((a.At - b.At) * 1e6) })
	}
	j.setStatus()
	return j
}

// spawn starts replica r of job j (a spare from cfg.Replicas on; a
// restart is always a plain replica: the coordinator makes it wait as a
// spare when a spare took its place).
func (d *demo) spawn(j *jobState, r, restart int) error {
	spare := r >= d.cfg.Replicas && restart == 0
	spec, _ := json.Marshal(replicaSpec{Run: d.runPath, Job: j.name, Replica: r, Restart: restart, Spare: spare})
	cmd := exec.Command(d.exe)
	cmd.Env = append(os.Environ(), replicaEnv+"="+string(spec))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	logf, err := os.Create(filepath.Join(d.cfg.Report, "logs", fmt.Sprintf("%s-%s-%d.log", j.name, d.cfg.replicaName(r), restart)))
	if err != nil {
		return err
	}
	if d.cfg.Verbose {
		cmd.Stderr = io.MultiWriter(logf, os.Stderr)
	} else {
		cmd.Stderr = logf
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return err
	}
	p := &proc{job: j, replica: r, restart: restart, cmd: cmd, stdin: stdin, started: time.Now(), log: logf, spare: spare}
	j.procs[r] = p
	j.plansLogs = append(j.plansLogs, plansLog(d.run.Plans, j.name, d.cfg.replicaName(r), restart))
	d.wg.Add(1)
	go func() { // reads the replica's events; exits at its EOF
		defer d.wg.Done()
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<16), 1<<20)
		for sc.Scan() {
			var e event
			if json.Unmarshal(sc.Bytes(), &e) == nil {
				d.events <- e
			}
		}
		cmd.Wait()
		logf.Close()
		d.exits <- p
	}()
	return nil
}

// stopAll ends every replica still running: stdin closed, then SIGKILL
// after a grace period.
func (d *demo) stopAll() {
	for _, j := range d.jobs {
		for _, p := range j.procs {
			if p != nil && !p.exited {
				p.stdin.Close()
			}
		}
	}
	deadline := time.After(5 * time.Second)
	for d.running() > 0 {
		select {
		case p := <-d.exits:
			p.exited = true
		case <-d.events:
		case <-deadline:
			for _, j := range d.jobs {
				for _, p := range j.procs {
					if p != nil && !p.exited {
						p.cmd.Process.Signal(syscall.SIGKILL)
					}
				}
			}
			deadline = time.After(time.Hour)
		}
	}
}

func (d *demo) running() int {
	n := 0
	for _, j := range d.jobs {
		for _, p := range j.procs {
			if p != nil && !p.exited {
				n++
			}
		}
	}
	return n
}

// evaluator computes validation losses of snapshots, one at a time; it
// exits when evals is closed.
func (d *demo) evaluator() {
	m, _ := charlm.New(d.cfg.Model, 0)
	tr := charlm.NewTrainer(m, 256)
	for r := range d.evals {
		params, err := readFloats(r.path)
		if err == nil && len(params) != len(m.Params) {
			err = fmt.Errorf("%s: %d parameters, want %d", r.path, len(params), len(m.Params))
		}
		res := evalRes{evalReq: r, err: err}
		if err == nil {
			copy(m.Params, params)
			res.loss = tr.Loss(d.val, r.n)
			if !r.final {
				os.Remove(r.path)
			}
		}
		d.results <- res
	}
	close(d.results)
}

func (d *demo) note(j *jobState, format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	j.lastEvent = msg
	j.setStatus()
	// Above the bars (d.out is the progress container then), or as lines.
	fmt.Fprintf(d.out, "%s  %-17s %s\n", time.Now().Format("15:04:05"), j.name, msg)
}

func (d *demo) job(name string) *jobState {
	for _, j := range d.jobs {
		if j.name == name {
			return j
		}
	}
	return nil
}

// release tells the registered replicas of j to start training once all
// of them are registered (so the first quorum has them all), and any
// restarted one at once.
func (d *demo) release(j *jobState) {
	if !j.released {
		for _, p := range j.procs {
			if p == nil || !p.registered {
				return
			}
		}
		j.released = true
	}
	for _, p := range j.procs {
		if p != nil && p.registered && !p.released && !p.exited {
			p.released = true
			io.WriteString(p.stdin, "go\n")
		}
	}
}

// handle folds one replica event into its job's state.
func (d *demo) handle(e event) {
	j := d.job(e.Job)
	if j == nil {
		return
	}
	t := time.Unix(0, e.T)
	switch e.Kind {
	case "start":
		j.method = e.Method
		if p := j.procs[e.Replica]; p != nil {
			p.registered = true
		}
		d.release(j)
	case "error":
		j.errors = append(j.errors, fmt.Sprintf("%s: %s", d.cfg.replicaName(e.Replica), e.Err))
		d.note(j, "%s: %s", d.cfg.replicaName(e.Replica), e.Err)
	case "sync":
		d.syncEvent(j, e, t)
	case "ft":
		d.ftEvent(j, e)
	case "settings":
		if !j.settingsSeen[e.Step] {
			if j.settingsSeen == nil {
				j.settingsSeen = map[int64]bool{}
			}
			j.settingsSeen[e.Step] = true
			d.note(j, "job settings from sync %d (epoch %d): %s", e.Step, e.Epoch, e.Method)
		}
	case "snapshot":
		d.evals <- evalReq{job: j, step: e.Step, path: e.Path, n: d.cfg.EvalN}
	case "done":
		j.done[e.Replica] = e
		if !e.Committed {
			return // a spare never promoted, or a restart that waited as one: not the job's state
		}
		j.finalHashes[e.Hash]++
		if len(j.finalHashes) == 1 && j.finalHashes[e.Hash] == 1 {
			d.evals <- evalReq{job: j, step: e.Step, path: e.Path, final: true, n: d.cfg.FinalEvalN}
		}
	}
}

func (d *demo) syncEvent(j *jobState, e event, t time.Time) {
	j.syncEvents++
	j.wire += e.Wire
	j.peakPayload = max(j.peakPayload, e.Payload)
	j.blockedMs += e.BlockedMs
	j.trainMs += e.TrainMs
	j.epochs[e.Epoch] = true
	if !e.Committed {
		if !j.failedSyncs[e.Step+1] {
			j.failedSyncs[e.Step+1] = true
			d.note(j, "sync %d did not commit at %s (epoch %d): discarded there, training goes on", e.Step+1, d.cfg.replicaName(e.Replica), e.Epoch)
		}
		return
	}
	if e.Loss > 0 {
		j.trainLoss[e.Step] = append(j.trainLoss[e.Step], e.Loss)
	}
	if p := j.procs[e.Replica]; p != nil {
		p.tookPart = true
	}
	if _, ok := j.capacity[e.Step]; !ok {
		j.capacity[e.Step] = e.Participants
	}
	if e.Epoch != j.epoch || e.Participants != j.participants {
		if j.epoch != 0 {
			d.note(j, "epoch %d: %d replicas", e.Epoch, e.Participants)
		}
		j.epoch, j.participants = max(j.epoch, e.Epoch), e.Participants
	}
	name := d.cfg.replicaName(e.Replica)
	for _, k := range j.kills {
		if k.Replica != e.Replica && k.SurvivorsCommit == 0 && t.After(k.KilledAt) && e.Participants < d.cfg.Replicas {
			k.SurvivorsCommit = t.Sub(k.KilledAt)
			d.note(j, "r%d killed → survivors committed sync %d with %d replicas after %v", k.Replica, e.Step, e.Participants, k.SurvivorsCommit.Round(time.Millisecond))
		}
		// Full size again: a sync of an epoch formed after the kill (the
		// others' commits of the epoch the victim was in can reach the
		// demo after the kill).
		if k.CapacityBack == 0 && t.After(k.KilledAt) && e.Epoch > k.KilledEpoch && e.Participants >= d.cfg.Replicas {
			k.CapacityBack = t.Sub(k.KilledAt)
			d.note(j, "r%d killed → capacity back: sync %d committed by %d replicas %v after the kill", k.Replica, e.Step, e.Participants, k.CapacityBack.Round(time.Millisecond))
		}
		if k.Promoted == name && k.PromotedStep == 0 {
			k.PromotedStep, k.Healed = e.Step, k.Healed || e.Healed
		}
		if k.Replica == e.Replica && k.Restarted && k.Rejoined == 0 && t.After(k.RestartAt) {
			k.Rejoined, k.RejoinedStep, k.Healed = t.Sub(k.RestartAt), e.Step, e.Healed
			how := "joined"
			if e.Healed {
				how = "healed from its peers and rejoined"
			}
			d.note(j, "r%d %s at sync %d, %v after its restart", e.Replica, how, e.Step, k.Rejoined.Round(time.Millisecond))
		}
	}
	if e.Step > j.step {
		j.step = e.Step
	}
	j.setStatus()
	d.maybeKill(j)
}

// ftEvent shows what ft.Comm reported (Config.OnEvent): heals, rollbacks,
// failed commits, and each new epoch once.
func (d *demo) ftEvent(j *jobState, e event) {
	switch e.Method {
	case "reconfigured":
		if e.Epoch <= j.shownEpoch {
			return
		}
		j.shownEpoch = e.Epoch
	case "promoted":
		for _, k := range j.kills {
			if k.Promoted == "" {
				k.Promoted = d.cfg.replicaName(e.Replica)
				break
			}
		}
	case "healed":
		for _, k := range j.kills {
			if (k.Replica == e.Replica && k.Restarted || k.Promoted == d.cfg.replicaName(e.Replica)) && k.HealedBytes == 0 {
				k.HealedBytes, k.HealTook = e.Payload, time.Duration(e.ElapsedMs*1e6)
			}
		}
	case "commit failed":
		return // the sync events say it, once per step
	}
	d.note(j, "%s: %s", d.cfg.replicaName(e.Replica), e.Path)
}

// maybeKill injects the next failure once the job is far enough.
func (d *demo) maybeKill(j *jobState) {
	if len(j.pending) == 0 {
		return
	}
	f := j.pending[0]
	if float64(j.step) < f.At*float64(d.cfg.Syncs()) {
		return
	}
	p := j.procs[f.Replica]
	if p == nil || p.exited || p.killed {
		return
	}
	j.pending = j.pending[1:]
	p.killed = true
	p.cmd.Process.Signal(syscall.SIGKILL)
	j.killedLogs[plansLog(d.run.Plans, j.name, d.cfg.replicaName(f.Replica), p.restart)] = true
	k := &kill{Failure: f, KilledAt: time.Now(), KilledStep: j.step, KilledEpoch: j.epoch}
	if f.Down >= 0 {
		k.RestartAt = k.KilledAt.Add(f.Down)
	}
	j.kills = append(j.kills, k)
	d.note(j, "SIGKILL r%d (pid %d) at sync %d", f.Replica, p.cmd.Process.Pid, j.step)
}

// restarts starts again the killed replicas whose downtime is over.
func (d *demo) restarts(now time.Time) error {
	for _, j := range d.jobs {
		for _, k := range j.kills {
			if k.Restarted || k.RestartAt.IsZero() || now.Before(k.RestartAt) || !j.finished.IsZero() {
				continue
			}
			p := j.procs[k.Replica]
			if !p.exited {
				continue // wait until the killed process is reaped
			}
			k.Restarted, k.RestartAt = true, now
			if err := d.spawn(j, k.Replica, p.restart+1); err != nil {
				return err
			}
			if j.spares() > 0 {
				d.note(j, "restarted r%d as a plain replica: a spare took its place, so it waits as the next spare", k.Replica)
			} else {
				d.note(j, "restarted r%d: it registers, heals and rejoins", k.Replica)
			}
		}
	}
	return nil
}

// finished reports whether j's run is over: every replica that trained
// from the start and was not killed has committed the last sync. A
// restarted replica that has not finished by then cannot any more (its
// peers are gone); it is stopped after a grace period.
func (d *demo) finished(j *jobState) bool {
	if len(j.done) == 0 {
		return false
	}
	for r, p := range j.procs {
		if _, ok := j.done[r]; !ok && p.restart == 0 && !p.killed && (!p.spare || p.tookPart) {
			return false
		}
	}
	return true
}

// spares is how many spares j started with.
func (j *jobState) spares() int {
	n := 0
	for _, p := range j.procs {
		if p != nil && p.spare {
			n++
		}
	}
	return n
}

// stopStragglers ends the restarted replicas of a finished job that are
// still running 5 s after its end.
func (d *demo) stopStragglers(j *jobState, now time.Time) {
	if j.finished.IsZero() || now.Sub(j.finished) < 5*time.Second {
		return
	}
	for r, p := range j.procs {
		if _, ok := j.done[r]; !ok && !p.exited && !p.stopped {
			p.stopped = true
			p.stdin.Close()
			d.note(j, "%s did not finish with the others: stopped", d.cfg.replicaName(r))
		}
	}
}

// Run runs the demo and returns its summary.
func (d *demo) Run(ctx context.Context) (*Summary, error) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.Timeout)
	defer cancel()
	if err := os.MkdirAll(d.cfg.Report, 0o755); err != nil {
		return nil, err
	}
	coord, err := startCoordinator(ctx, d.cfg.Gossip, d.log)
	if err != nil {
		return nil, err
	}
	defer coord.close()
	eps := coord.endpoints()
	fmt.Fprintf(d.out, "coordinator: embedded ftcoord, etcd at %s (TLS, client certificates); dashboard while it runs: %s\n",
		strings.Join(eps, ","), coord.dashboard())
	if err := d.prepare(eps, coord.credentials()); err != nil {
		return nil, err
	}
	fmt.Fprintf(d.out, "job: %d replicas × %d inner steps of AdamW on a %d-parameter character MLP; Streaming DiLoCo H=%d F=%d τ=%d α=%g, outer Nesterov lr %g momentum %g, %s outer gradients; %d syncs\n",
		d.cfg.Replicas, d.cfg.Steps, d.cfg.Model.NumParams(), d.cfg.H, d.cfg.F, d.cfg.Tau, d.cfg.Alpha, d.cfg.OuterLR, d.cfg.OuterMom, d.cfg.Quant, d.cfg.Syncs())
	if len(d.cfg.Failures) > 0 {
		fmt.Fprintf(d.out, "failures: %v (replica@point of the run:downtime before restart)\n", d.cfg.Failures)
	}

	// The spares only in the job with failures: in the other they would
	// wait, idle, to the end.
	d.jobs = append(d.jobs, d.newJob("with-failures", len(d.cfg.Failures) > 0, d.cfg.Spares))
	if d.cfg.Baseline && len(d.cfg.Failures) > 0 {
		d.jobs = append(d.jobs, d.newJob("without-failures", false, 0))
	}
	if d.cfg.Spares > 0 {
		fmt.Fprintf(d.out, "spares: %d in %s, waiting in their first sync until the coordinator promotes one in a dead replica's place\n", d.cfg.Spares, d.jobs[0].name)
	}
	d.setupProgress(ctx)
	go d.evaluator()
	defer d.stopAll()
	for _, j := range d.jobs {
		j.started = time.Now()
		for r := range j.procs {
			if err := d.spawn(j, r, 0); err != nil {
				return nil, err
			}
		}
	}

	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var runErr error
loop:
	for {
		all := true
		for _, j := range d.jobs {
			if j.finished.IsZero() && d.finished(j) {
				j.finished = time.Now()
				d.note(j, "done: %d syncs committed", j.step)
			}
			all = all && !j.finished.IsZero()
		}
		if all && d.running() == 0 {
			break
		}
		select {
		case e := <-d.events:
			d.handle(e)
		case p := <-d.exits:
			p.exited = true
			if _, ok := p.job.done[p.replica]; !ok && !p.killed && !p.stopped {
				name := d.cfg.replicaName(p.replica)
				p.job.errors = append(p.job.errors, fmt.Sprintf("%s exited unexpectedly (%v); see %s", name, p.cmd.ProcessState, p.log.Name()))
				d.note(p.job, "%s exited unexpectedly", name)
				runErr = fmt.Errorf("%s: replica %s exited unexpectedly (%v); its log: %s", p.job.name, name, p.cmd.ProcessState, p.log.Name())
				break loop
			}
		case r := <-d.results:
			d.evalResult(r)
		case now := <-tick.C:
			if err := d.restarts(now); err != nil {
				runErr = err
				break loop
			}
			for _, j := range d.jobs {
				d.stopStragglers(j, now)
			}
			d.refresh()
		case <-ctx.Done():
			runErr = fmt.Errorf("demo: %w", context.Cause(ctx))
			break loop
		}
	}
	d.stopAll()
	d.wg.Wait()
	close(d.evals)
	for r := range d.results {
		d.evalResult(r)
	}
	d.finishProgress()
	if runErr != nil {
		return nil, runErr
	}
	return d.summarize()
}

func (d *demo) evalResult(r evalRes) {
	if r.err != nil {
		r.job.errors = append(r.job.errors, r.err.Error())
		return
	}
	if r.final {
		r.job.finalLoss = r.loss
		return
	}
	r.job.curve = append(r.job.curve, point{r.step, r.loss})
	slices.SortFunc(r.job.curve, func(a, b point) int { return int(a.Step - b.Step) })
}

func (d *demo) setupProgress(ctx context.Context) {
	mode := d.cfg.Progress
	if mode == "auto" {
		mode = "lines"
		if f, ok := d.out.(*os.File); ok {
			if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
				mode = "bar"
			}
		}
	}
	if mode != "bar" {
		return // notes go out as lines
	}
	d.bars = mpb.NewWithContext(ctx, mpb.WithOutput(d.out), mpb.WithWidth(24), mpb.WithRefreshRate(150*time.Millisecond))
	total := d.cfg.Syncs()
	for _, j := range d.jobs {
		j.bar = d.bars.New(total, mpb.BarStyle().Lbound("▕").Filler("█").Tip("▌").Padding("░").Rbound("▏"),
			mpb.PrependDecorators(decor.Name(fmt.Sprintf("%-17s", j.name)), decor.CountersNoUnit("sync %3d/%d ")),
			mpb.AppendDecorators(decor.Elapsed(decor.ET_STYLE_GO, decor.WC{W: 5}), decor.Any(func(decor.Statistics) string { return " │ " + j.getStatus() })))
	}
	d.out = d.bars // lines printed above the bars
}

func (d *demo) refresh() {
	for _, j := range d.jobs {
		if j.bar != nil {
			j.bar.SetCurrent(j.step)
		}
	}
}

func (d *demo) finishProgress() {
	if d.bars == nil {
		return
	}
	for _, j := range d.jobs {
		j.bar.SetCurrent(j.step)
		if j.step >= d.cfg.Syncs() {
			j.bar.SetTotal(-1, true)
		} else {
			j.bar.Abort(false)
		}
	}
	d.bars.Wait()
	d.out = d.term
}
