package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/membership"
)

// replicaEnv, when set to a replicaSpec in JSON, makes this program one
// replica of the chaos job instead of the harness.
const replicaEnv = "FTCOMM_CHAOS_REPLICA"

// replicaSpec is what the harness tells a replica process.
type replicaSpec struct {
	Job  string
	Name string // its replica group
	// Credentials is the trainer credentials file ftcoord wrote (TLS, the
	// quorum-verification and gossip keys); Endpoints override its etcd
	// endpoints (the proxy network's).
	Credentials string
	Index       int // its slot (0..maxReplicas-1)
	Endpoints   []string
	// Host is the address it binds (its network namespace's); GlooListen
	// and GlooAdvertise override gloo's listen address and advertised host
	// (the proxy network).
	Host          string
	GlooListen    string
	GlooAdvertise string
	Gossip        bool
	GossipTuning  GossipTuning
	Params        int
	StepTime      time.Duration
	Timeout       time.Duration
	LeaseTTL      time.Duration
	MinReplicas   int
	Durable       bool
	Secret        []byte
	// SlowOp: an all-reduce or Commit that takes longer is reported.
	SlowOp time.Duration
	// Work is the rounds of spin a step's compute does (0: StepTime
	// asleep).
	Work int64
	// Stragglers is the straggler policy the replica asks for.
	Stragglers membership.StragglerPolicy
	// Spare: a warm standby (ft.Config.Spare), its first Step waiting
	// for its promotion.
	Spare bool
	// Data is the dataset its sampler reads.
	Data ft.SamplerConfig
}

// errKind names the kind an op's error carries, the first that applies.
func errKind(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ft.ErrNotParticipating):
		return "not-participating"
	case errors.Is(err, comm.ErrPeerClosed):
		// A peer that closed its comm in order (it moved to a newer
		// epoch, or left): alive, so no failure to attribute.
		return "peer-closed"
	case errors.Is(err, comm.ErrPeerFailed):
		return "peer-failed"
	case errors.Is(err, comm.ErrTimeout):
		return "timeout"
	case errors.Is(err, comm.ErrRevoked):
		return "revoked"
	case errors.Is(err, comm.ErrAborted):
		return "aborted"
	case errors.Is(err, comm.ErrMismatch):
		return "mismatch"
	case errors.Is(err, comm.ErrClosed):
		return "closed"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "context"
	}
	return "unclassified"
}

// runReplica is one replica: the toy job on ft.Comm, reporting every step's
// outcome as JSON lines on stdout, until the harness tells it (on stdin)
// to stop at a step, or closes stdin (the harness is gone: exit at once).
func runReplica(specJSON string) int {
	var spec replicaSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "replica: spec:", err)
		return 2
	}
	var mu sync.Mutex
	out := json.NewEncoder(os.Stdout)
	emit := func(e Event) {
		e.T, e.Pid = time.Now().UnixNano(), os.Getpid()
		mu.Lock()
		out.Encode(e)
		mu.Unlock()
	}
	fatal := func(err error) int {
		emit(Event{Kind: evFatal, Err: err.Error()})
		fmt.Fprintln(os.Stderr, "replica:", err)
		return 1
	}

	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	log := zap.New(zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.Lock(os.Stderr), zap.InfoLevel)).Named(spec.Name)
	defer log.Sync()

	var target atomic.Int64 // stop once this step is committed (0: not yet told)
	var stalled sync.Mutex  // held while the harness stalls the loop
	go func() {             // the harness holds our stdin
		sc := bufio.NewScanner(os.Stdin)
		paused := false
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			switch {
			case len(f) == 2 && f[0] == "stop":
				if n, err := strconv.ParseInt(f[1], 10, 64); err == nil {
					target.Store(n)
				}
			case len(f) == 1 && f[0] == "pause" && !paused:
				stalled.Lock() // the loop stops before its next Step
				paused = true
			case len(f) == 1 && f[0] == "resume" && paused:
				stalled.Unlock()
				paused = false
			}
		}
		os.Exit(0)
	}()

	mc := membership.DefaultMemberConfig()
	mc.LeaseTTL, mc.HeartbeatInterval = spec.LeaseTTL, time.Second
	mc.Stragglers = spec.Stragglers
	if spec.Gossip {
		g := membership.DefaultGossipConfig()
		g.BindAddr = net.JoinHostPort(spec.Host, "0")
		if t := spec.GossipTuning; t.Probe > 0 {
			g.ProbeInterval, g.ProbeTimeout, g.SuspicionMult = t.Probe, t.ProbeTimeout, t.Suspicion
		}
		mc.Gossip = &g
	}
	gcfg := gloo.DefaultConfig()
	gcfg.ListenAddr = net.JoinHostPort(spec.Host, "0")
	if spec.GlooListen != "" {
		gcfg.ListenAddr = spec.GlooListen
	}
	gcfg.AdvertiseHost = spec.GlooAdvertise
	params := make([]float32, spec.Params)
	initState(params)
	var c *ft.Comm
	var sampler *ft.Sampler
	position := func() *int64 {
		p := sampler.Position()
		return &p
	}
	var failReason string         // the last failed commit's, from ft's event
	onEvent := func(e ft.Event) { // on the training goroutine, inside Step and Commit
		ev := Event{Epoch: e.Epoch, Step: e.Step, N: e.Participants, Reason: e.Reason}
		switch e.Kind {
		case ft.EventReconfigured:
			ev.Kind, ev.How, ev.Rank, ev.Dur = evReconf, e.How, e.Rank, int64(e.Took)
		case ft.EventHealed: // the sampler's position came with the state
			ev.Kind, ev.Hash, ev.From, ev.Bytes, ev.Dur, ev.Pos = evHeal, stateHash(params), e.FromStep, e.Bytes, int64(e.Took), position()
		case ft.EventRolledBack:
			ev.Kind, ev.From, ev.To = evRollback, e.FromStep, e.ToStep
		case ft.EventSatOut:
			ev.Kind = evSatOut
		case ft.EventWaiting:
			ev.Kind = evWaiting
		case ft.EventSettings:
			ev.Kind, ev.Version, ev.From = evSettings, e.Version, e.FromStep
		case ft.EventPromoted:
			ev.Kind = evPromoted
		case ft.EventCommitFailed:
			failReason = e.Reason // reported by the loop
			return
		default:
			return
		}
		emit(ev)
	}
	ctx := context.Background()
	c, err := ft.New(ctx, ft.Config{Job: spec.Job, Group: spec.Name, Coordinator: spec.Endpoints, Credentials: spec.Credentials, Member: mc,
		Backend: "gloo", BackendConfig: gcfg, Secret: spec.Secret, RecoveryAddr: net.JoinHostPort(spec.Host, "0"),
		MinReplicas: spec.MinReplicas, Timeout: spec.Timeout, MaxCommitFailures: 1 << 20, DurableCommit: spec.Durable,
		OnEvent: onEvent, Logger: log, Spare: spec.Spare})
	if err != nil {
		return fatal(fmt.Errorf("new: %w", err))
	}
	defer c.Close()
	if err := c.Register("params", comm.Float32s(params)); err != nil {
		return fatal(err)
	}
	if sampler, err = ft.NewSampler(c, spec.Data); err != nil {
		return fatal(err)
	}
	emit(Event{Kind: evStart, Hash: stateHash(params), Pos: position()})

	buf := make([]float32, spec.Params+maxReplicas) // gradient, then one slot per replica
	for {
		if t := target.Load(); t > 0 && c.CommittedStep() >= t {
			emit(Event{Kind: evFinal, Step: c.CommittedStep(), Epoch: c.Epoch(), Hash: stateHash(params), Pos: position()})
			if err := c.Close(); err != nil {
				log.Warn("close", zap.Error(err))
			}
			return 0
		}
		stalled.Lock() // a stuck data loader, when the harness says so
		stalled.Unlock()
		var rb *ft.RollbackError
		if err := c.Step(ctx); err != nil && !errors.As(err, &rb) {
			return fatal(fmt.Errorf("step: %w", err))
		}
		// What this replica reads in the step: ErrNotParticipating while
		// it sits the epoch out (its ops fail, the step does not commit).
		plan, planErr := sampler.Plan()
		var mismatch *ft.SamplerMismatchError
		if errors.As(planErr, &mismatch) {
			return fatal(planErr)
		}
		prev := stateHash(params)
		step := c.CommittedStep() + 1
		if spec.Work > 0 { // forward and backward
			sink += spin(spec.Work)
		} else {
			time.Sleep(spec.StepTime)
		}
		gradient(buf[:spec.Params], step, spec.Index)
		clear(buf[spec.Params:])
		rank := c.Rank()
		buf[spec.Params+spec.Index] = float32(rank + 1)
		epoch := c.Epoch()
		t0 := time.Now()
		err := c.AllReduce(ctx, comm.Float32s(buf), comm.Sum).Wait(ctx)
		if d := time.Since(t0); err != nil || d > spec.SlowOp {
			emit(Event{Kind: evOp, Epoch: epoch, Step: step - 1, Dur: int64(d), ErrKind: errKind(err), Failed: comm.FailedRanks(err),
				Err: errString(err), Rank: rank})
		}
		t1 := time.Now()
		ok, err := c.Commit(ctx)
		if d := time.Since(t1); d > spec.SlowOp {
			emit(Event{Kind: evCommitD, Epoch: epoch, Step: step - 1, Dur: int64(d)})
		}
		switch {
		case errors.Is(err, ft.ErrTooManyCommitFailures):
			emit(Event{Kind: evTooMany, Epoch: epoch, Step: step - 1, Err: err.Error()})
		case err != nil:
			return fatal(fmt.Errorf("commit: %w", err))
		}
		if !ok {
			emit(Event{Kind: evFail, Epoch: epoch, Step: step - 1, Reason: failReason, Pos: position()})
			failReason = ""
			continue
		}
		var mask uint32
		n := 0
		ranks := make([]int, maxReplicas)
		for k := range maxReplicas {
			ranks[k] = int(buf[spec.Params+k]) - 1
			if ranks[k] >= 0 {
				mask |= 1 << k
				n++
			}
		}
		apply(params, buf[:spec.Params], n)
		// The step's reads go out with its commit, in one write.
		ev := Event{Kind: evCommit, Step: c.CommittedStep(), Epoch: epoch, Prev: prev, Hash: stateHash(params),
			Mask: mask, Ranks: ranks, N: c.Participants(), Rank: rank, Pos: position()}
		if planErr == nil {
			ev.Data = readOf(plan, rank)
		} else {
			ev.Err = "plan: " + planErr.Error()
		}
		emit(ev)
	}
}

// sink keeps the replica's spin work from being optimised away.
var sink uint64

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
