package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"runtime/trace"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// workerEnv makes the binary a worker ("1"). Its workerSpec arrives as the
// first line of its stdin (not in the environment: it holds the job
// secret); the rest of stdin is its lifeline to the launcher.
const workerEnv = "FTBENCH_WORKER"

// workerSpec is everything a worker needs, from the launcher.
type workerSpec struct {
	Config    Config   `json:"config"`
	Rank      int      `json:"rank"`
	Endpoints []string `json:"endpoints"` // etcd client endpoints
	RunID     string   `json:"run_id"`    // job id and store prefix of this run
	Secret    []byte   `json:"secret"`    // authenticates the ranks to each other
}

// workerMsg is one JSON line a worker writes to its stdout for the launcher.
type workerMsg struct {
	Kind string   `json:"kind"` // "alive", "row", "error" or "done"
	Row  *rankRow `json:"row,omitempty"`
	Err  string   `json:"err,omitempty"`
}

// aliveEvery is how often a busy worker tells the launcher it advances.
const aliveEvery = 500 * time.Millisecond

// emitter writes workerMsgs; safe for concurrent use.
type emitter struct {
	mu        sync.Mutex
	w         io.Writer
	lastAlive time.Time
}

func (e *emitter) send(m workerMsg) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	_, err = e.w.Write(append(b, '\n'))
	return err
}

// alive sends a heartbeat unless one went out less than aliveEvery ago.
func (e *emitter) alive() {
	e.mu.Lock()
	now := time.Now()
	due := now.Sub(e.lastAlive) >= aliveEvery
	if due {
		e.lastAlive = now
	}
	e.mu.Unlock()
	if due {
		e.send(workerMsg{Kind: "alive"}) // a broken stdout shows up at the next row
	}
}

func newWorkerLogger(w io.Writer, rank int, verbose bool) *zap.Logger {
	level := zapcore.WarnLevel
	if verbose {
		level = zapcore.DebugLevel
	}
	enc := zap.NewDevelopmentEncoderConfig()
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.Lock(zapcore.AddSync(w)), level)
	return zap.New(core).With(zap.Int("rank", rank))
}

// workerMain is a worker process: it runs spec's rank until done, writing
// workerMsgs to stdout and logs to stderr, and returns the exit code. It
// stops when ctx ends (the launcher went away or sent a signal); after
// reporting done, the end of ctx is the launcher's release.
func workerMain(ctx context.Context, spec workerSpec, stdout, stderr io.Writer) int {
	em := &emitter{w: stdout}
	log := newWorkerLogger(stderr, spec.Rank, spec.Config.Verbose)
	defer log.Sync()
	err := runWorker(ctx, spec, em, log)
	if err != nil {
		em.send(workerMsg{Kind: "error", Err: err.Error()})
		return 1
	}
	return 0
}

func runWorker(ctx context.Context, spec workerSpec, em *emitter, log *zap.Logger) (err error) {
	cfg := spec.Config
	if err := cfg.Validate(); err != nil {
		return err
	}
	if spec.Rank < 0 || spec.Rank >= cfg.NP {
		return fmt.Errorf("ftbench: worker rank %d outside [0, %d)", spec.Rank, cfg.NP)
	}
	em.send(workerMsg{Kind: "alive"})
	for _, p := range []struct {
		name, path string
		start      func(io.Writer) error
		stop       func()
	}{
		{"cpu profile", cfg.CPUProf, pprof.StartCPUProfile, pprof.StopCPUProfile},
		{"trace", cfg.Trace, trace.Start, trace.Stop},
	} {
		if p.path == "" {
			continue
		}
		stop, err := record(p.path+".rank"+strconv.Itoa(spec.Rank), p.start, p.stop)
		if err != nil {
			return fmt.Errorf("ftbench: rank %d: %s: %w", spec.Rank, p.name, err)
		}
		defer func() {
			if serr := stop(); serr != nil && err == nil {
				err = fmt.Errorf("ftbench: rank %d: %s: %w", spec.Rank, p.name, serr)
			}
		}()
	}

	cli, err := membership.NewClient(spec.Endpoints, nil)
	if err != nil {
		return fmt.Errorf("ftbench: rank %d: etcd client: %w", spec.Rank, err)
	}
	defer cli.Close()
	store := membership.NewStore(cli, "ftbench/"+spec.RunID)

	timeout := time.Duration(cfg.Timeout)
	setupCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	c, err := comm.New(setupCtx, cfg.Backend, comm.Options{
		Name: "ftbench", Rank: spec.Rank, Size: cfg.NP, Epoch: 1, JobID: spec.RunID, Secret: spec.Secret,
		Store: store, Prefix: "comm", Timeout: timeout, Device: spec.Rank, Logger: log, BackendConfig: backendConfig(&cfg),
	})
	if err != nil {
		return fmt.Errorf("ftbench: rank %d: create %s communicator: %w", spec.Rank, cfg.Backend, err)
	}
	defer c.Close()
	b := &bench{cfg: cfg, c: c, alive: em.alive, emit: func(r rankRow) error {
		return em.send(workerMsg{Kind: "row", Row: &r})
	}}
	if c.Backend().Memory() == comm.DeviceMemory {
		if b.dev, err = deviceMemoryFor(c.Backend(), spec.Rank); err != nil {
			return err
		}
	}
	if cfg.Raw {
		raw, err := newRawRing(setupCtx, store, spec.Rank, cfg.NP, spec.Secret, cfg.RawBuf, timeout)
		if err != nil {
			return fmt.Errorf("ftbench: rank %d: %w", spec.Rank, err)
		}
		defer raw.Close()
		b.raw = raw
	}
	cancel()
	log.Debug("connected", zap.String("backend", cfg.Backend), zap.Int("np", cfg.NP))
	if err := b.run(ctx); err != nil {
		return err
	}
	// Done here, but a peer may still be finishing its last op, and a
	// communicator closed under it would fail that op. The launcher
	// releases the workers (EOF on stdin, which ends ctx) once every rank
	// has reported done.
	if err := em.send(workerMsg{Kind: "done"}); err != nil {
		return err
	}
	select {
	case <-ctx.Done():
	case <-time.After(timeout):
		log.Warn("not released by the launcher; closing anyway", zap.Duration("after", timeout))
	}
	return c.Close()
}

// record starts a profile or trace written to path; the returned function
// stops it and closes the file.
func record(path string, start func(io.Writer) error, stop func()) (func() error, error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := start(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() error {
		stop()
		return f.Close()
	}, nil
}
