package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"os"
	"path/filepath"
	"time"

	"go.uber.org/zap"

	_ "github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/examples/diloco/charlm"
	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/ft/diloco"
	"github.com/ftcomm/ftcomm/membership"
)

// replicaEnv, when set (to a replicaSpec in JSON), makes the program run
// as one replica of a demo job instead of the demo.
const replicaEnv = "FTCOMM_DILOCO_REPLICA"

// replicaSpec is what the demo tells a replica process.
type replicaSpec struct {
	Run     string // run.json
	Job     string
	Replica int  // Config.Replicas and above: a spare
	Restart int  // how many times this replica was started before
	Spare   bool // ft.Config.Spare: wait in the first sync until promoted
}

// runFile is run.json: the demo's config plus what it set up.
type runFile struct {
	Config
	Endpoints []string
	// Credentials is the trainers' credentials file of the embedded ftcoord
	// (its etcd serves TLS with client certificates).
	Credentials string
	Secret      []byte
	Train       string // token files
	Val         string
	Snapshots   string // folder for the global parameters the demo evaluates
	Plans       string // folder for the replicas' plans logs (what committed syncs gave them to read)
}

// event is one JSON line a replica writes to its stdout for the demo.
type event struct {
	Kind         string  `json:"kind"` // start, sync, snapshot, done, error, ft (an ft.Event: Method is its kind, Path its text, Payload healed bytes)
	Job          string  `json:"job"`
	Replica      int     `json:"replica"`
	Pid          int     `json:"pid"`
	T            int64   `json:"t"` // unix ns
	Step         int64   `json:"step,omitempty"`
	Inner        int64   `json:"inner,omitempty"`
	Loss         float64 `json:"loss,omitempty"` // mean training loss since the last sync
	Epoch        uint64  `json:"epoch,omitempty"`
	Participants int     `json:"participants,omitempty"`
	Committed    bool    `json:"committed,omitempty"`
	Healed       bool    `json:"healed,omitempty"`
	Fragment     int     `json:"fragment,omitempty"`
	Contributors float32 `json:"contributors,omitempty"`
	Payload      int64   `json:"payload,omitempty"`
	Wire         int64   `json:"wire,omitempty"`
	Method       string  `json:"method,omitempty"`
	BlockedMs    float64 `json:"blocked_ms,omitempty"`
	ElapsedMs    float64 `json:"elapsed_ms,omitempty"`
	TrainMs      float64 `json:"train_ms,omitempty"` // inner steps' time since the last sync
	Path         string  `json:"path,omitempty"`
	Hash         string  `json:"hash,omitempty"`
	Err          string  `json:"err,omitempty"`
}

func readTokens(path string) ([]uint8, error) { return os.ReadFile(path) }

func hashFloats(s []float32) string {
	h := fnv.New64a()
	b := make([]byte, 4)
	for _, x := range s {
		binary.LittleEndian.PutUint32(b, math.Float32bits(x))
		h.Write(b)
	}
	return fmt.Sprintf("%016x", h.Sum64())
}

// writeFloats writes s atomically (a temporary file renamed).
func writeFloats(path string, s []float32) error {
	b := make([]byte, 4*len(s))
	for i, x := range s {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func readFloats(path string) ([]float32, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	s := make([]float32, len(b)/4)
	for i := range s {
		s[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return s, nil
}

// runReplica is a replica process: it trains the model with Streaming
// DiLoCo on ft.Comm until the job has committed its syncs, reporting on
// stdout; it exits when its stdin closes (the demo is gone).
func runReplica(spec replicaSpec) int {
	out := json.NewEncoder(os.Stdout)
	emit := func(e event) {
		e.Job, e.Replica, e.Pid, e.T = spec.Job, spec.Replica, os.Getpid(), time.Now().UnixNano()
		out.Encode(e)
	}
	fail := func(err error) int {
		emit(event{Kind: "error", Err: err.Error()})
		fmt.Fprintln(os.Stderr, "replica:", err)
		return 1
	}
	b, err := os.ReadFile(spec.Run)
	if err != nil {
		return fail(err)
	}
	var run runFile
	if err := json.Unmarshal(b, &run); err != nil {
		return fail(err)
	}
	cfg := run.Config
	if err := cfg.validate(); err != nil {
		return fail(err)
	}
	train, err := readTokens(run.Train)
	if err != nil {
		return fail(err)
	}

	log, _ := zap.NewDevelopment()
	name := cfg.replicaName(spec.Replica)
	log = log.Named(spec.Job + "." + name)
	mc := membership.DefaultMemberConfig()
	mc.HeartbeatInterval = time.Second
	if cfg.Gossip {
		g := membership.DefaultGossipConfig()
		mc.Gossip = &g
	}
	ctx := context.Background()
	fcfg := ft.Config{Job: spec.Job, Group: name, Spare: spec.Spare, Coordinator: run.Endpoints, Credentials: run.Credentials,
		Member: mc, Backend: cfg.Backend, MinReplicas: cfg.MinReplicas, Secret: run.Secret,
		Timeout: 20 * time.Second, MaxCommitFailures: 50, Logger: log,
		OnEvent: func(e ft.Event) { // on this goroutine, inside Step and Commit
			emit(event{Kind: "ft", Step: e.Step, Epoch: e.Epoch, Participants: e.Participants, Method: e.Kind.String(),
				Path: e.String(), Payload: e.Bytes, ElapsedMs: e.Took.Seconds() * 1e3})
		}}
	// A replica restarted right after it was killed may find its previous
	// incarnation still registered: ft.New waits for its lease to end.
	c, err := ft.New(ctx, fcfg)
	if err != nil {
		return fail(err)
	}
	defer c.Close()

	model, err := charlm.New(cfg.Model, cfg.Seed) // the same initial parameters everywhere
	if err != nil {
		return fail(err)
	}
	tr := newInnerTrainer(model, cfg.Batch)
	opt := charlm.NewAdamW(len(model.Params))
	// The data: the job's position in the training set is registered with
	// the model (healed with it); DiLoCo drives the Comm through pc, which
	// keeps each sync's plan.
	sampler, err := ft.NewSampler(c, samplerConfig(cfg, train))
	if err != nil {
		return fail(err)
	}
	pc := &plannedComm{Comm: c, s: sampler}
	plans, err := os.OpenFile(plansLog(run.Plans, spec.Job, name, spec.Restart), os.O_CREATE|os.O_EXCL|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fail(err)
	}
	defer plans.Close()
	dcfg := cfg.DiLoCo
	dcfg.Logger = log
	d, err := diloco.New(pc, model.Params, dcfg)
	if err != nil {
		return fail(err)
	}
	lr := charlm.Schedule{Peak: float32(cfg.LR), Warmup: 100, Total: int64(cfg.Steps), Final: 0.1}
	target := cfg.Syncs()
	every := cfg.H / cfg.F // inner steps between two syncs
	// Registered: tell the demo, and wait for its go, so that a job's
	// first quorum has all its replicas (a restarted one gets it at once).
	emit(event{Kind: "start", Method: d.Method()})
	in := bufio.NewReader(os.Stdin)
	if _, err := in.ReadString('\n'); err != nil {
		return 0 // the demo is gone
	}
	go func() { // the demo holds our stdin: when it goes, so do we
		io.Copy(io.Discard, in)
		os.Exit(0)
	}()

	var lossSum float64
	var lossN int
	var trainTime time.Duration
	finished := false   // another replica ended the run (ft.ErrFinished)
	var settings uint64 // the job's settings version this replica follows
	tookPart := false   // committed a sync: a spare or a replaced replica's restart may never
	var win window      // what the inner steps read until the next commit
	for c.CommittedStep() < target {
		o, err := d.Tick(ctx) // a spare's first waits until it is promoted
		if errors.Is(err, ft.ErrFinished) {
			log.Info("the run ended at another replica", zap.Error(err))
			finished = true
			break
		}
		if err != nil {
			return fail(err)
		}
		if rb := pc.rollback; rb != nil {
			// The heal replaced syncs this replica had committed: so are
			// their plans, in its log.
			pc.rollback = nil
			if err := appendRecord(plans, planRecord{Kind: "rollback", From: rb.FromStep, To: rb.ToStep}); err != nil {
				return fail(err)
			}
		}
		if st := c.Settings(); st.Version != settings {
			// The job's settings changed (ftcoord job set): every replica
			// sees the new version from the same sync, right after its
			// Tick, and retunes there alike.
			settings = st.Version
			if h, ok := st.Int("sync_every"); followSettings(st, d, &lr, log) && ok && h > 0 {
				every = int(h) / cfg.F
			}
			emit(event{Kind: "settings", Step: st.FromStep, Epoch: st.Epoch, Method: st.Summary()})
		}
		if o.Synced {
			tookPart = tookPart || o.Committed
			if o.Healed {
				opt.Reset() // its moments belong to parameters that are gone
			}
			// Until the next commit the inner steps read this sync's plan
			// if it committed; after one that did not, nothing (its
			// samples go to the sync that takes its place).
			win = window{}
			if o.Committed {
				p, ok := pc.plan(o.Step)
				if !ok {
					return fail(fmt.Errorf("sync %d committed without a plan", o.Step))
				}
				// Recorded before anything says it committed: a SIGKILL
				// from here on leaves the plan unrecorded, never a
				// reported sync without its record.
				if err := appendRecord(plans, recordOf(p)); err != nil {
					return fail(err)
				}
				win = window{plan: p, steps: every}
			}
			e := event{Kind: "sync", Step: o.Step, Inner: d.InnerStep(), Epoch: o.Epoch, Participants: o.Participants,
				Committed: o.Committed, Healed: o.Healed, Fragment: o.Fragment, Contributors: o.Contributors,
				Payload: o.Payload, Wire: o.Wire, Method: o.Method,
				BlockedMs: o.Blocked.Seconds() * 1e3, ElapsedMs: o.Elapsed.Seconds() * 1e3, TrainMs: trainTime.Seconds() * 1e3}
			if lossN > 0 {
				e.Loss = lossSum / float64(lossN)
			}
			emit(e)
			lossSum, lossN, trainTime = 0, 0, 0
			if o.Committed && c.Rank() == 0 && ((o.Step-1)%int64(cfg.EvalEvery) == 0 || o.Step >= target) {
				p := filepath.Join(run.Snapshots, fmt.Sprintf("%s-%06d.f32", spec.Job, o.Step))
				if err := writeFloats(p, d.Global()); err != nil {
					return fail(err)
				}
				emit(event{Kind: "snapshot", Step: o.Step, Path: p})
			}
			if c.CommittedStep() >= target {
				break
			}
		}
		mbs := win.next()
		if len(mbs) == 0 {
			continue // nothing to read: the sync before did not commit here
		}
		t0 := time.Now()
		loss, grads, n := tr.grads(train, mbs)
		if n == 0 {
			continue // empty micro-batches (a job above its size, keeping the global batch)
		}
		lossSum += loss
		lossN++
		opt.Step(model.Params, grads, lr.At(d.InnerStep()))
		trainTime += time.Since(t0)
	}
	if !finished {
		if _, err := d.Flush(ctx); err != nil && !errors.Is(err, ft.ErrFinished) {
			return fail(err)
		}
		// The end of the run, agreed: a replica still ending its last
		// step finishes it, and one behind stops instead of waiting for
		// peers that will never step again.
		if err := c.Finish(ctx); err != nil {
			return fail(err)
		}
	}
	p := filepath.Join(run.Snapshots, fmt.Sprintf("%s-final-%s.f32", spec.Job, name))
	if err := writeFloats(p, d.Global()); err != nil {
		return fail(err)
	}
	s := d.Stats()
	emit(event{Kind: "done", Step: c.CommittedStep(), Committed: tookPart, Path: p, Hash: hashFloats(d.Global()) + hashFloats(d.Momentum()),
		Payload: s.PeakPayload, Wire: s.Wire, BlockedMs: s.Blocked.Seconds() * 1e3})
	return 0
}

// followSettings applies the job's settings the example reads: lr (the
// peak inner learning rate), outer_lr and sync_every (H, inner steps
// between two syncs of the same parameter), and reports whether it did.
// A value the run cannot take (an H the fragments do not divide) is
// refused the same way at every replica, and logged.
func followSettings(st ft.Settings, d *diloco.DiLoCo, lr *charlm.Schedule, log *zap.Logger) bool {
	if v, ok := st.Float("lr"); ok && v > 0 {
		lr.Peak = float32(v)
	}
	outer, _ := st.Float("outer_lr")
	h, _ := st.Int("sync_every")
	if err := d.Retune(outer, int(h)); err != nil {
		log.Warn("job settings not applied", zap.Uint64("version", st.Version), zap.Error(err))
		return false
	}
	log.Info("following the job's settings", zap.Uint64("version", st.Version), zap.Int64("from_step", st.FromStep),
		zap.String("settings", st.Summary()))
	return true
}
