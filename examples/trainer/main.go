// Command trainer is the smallest training job that shows how a replica
// of an ft.Comm job is wired in a container: everything comes from the
// environment, as a Kubernetes Job sets it (deploy/kubernetes/training-job),
// and it answers the probes a platform expects.
//
// Each replica fits the same linear model y = w·x to data of its own
// (a data-parallel job): it computes a gradient, averages it with the
// other replicas through ft.Comm, and applies it when the step commits.
// A replica that joins late, or comes back after its pod was replaced,
// heals w from its peers before its first step.
//
// # Environment
//
//	FTCOMM_JOB             the job's name (required)
//	FTCOMM_GROUP           this replica's group id (default: g<JOB_COMPLETION_INDEX>, else the host name)
//	FTCOMM_RUN             the run of the job (ft.Config.Run; default: the job's current run). One
//	                       id per launch starts a new run from step 0 (or: `ftcoord job new-run`)
//	FTCOMM_CREDENTIALS     the trainers' credentials file (read by ft itself; `ftcoord credentials` prints it)
//	FTCOMM_SECRET_FILE     file holding the job's shared secret (peer authentication); or FTCOMM_SECRET
//	FTCOMM_ADVERTISE_HOST  the address peers reach this replica at (a pod: its IP); every
//	                       listener binds to it (default 127.0.0.1)
//	FTCOMM_RECOVERY_PORT   port of the state-transfer server (default 29600; 0: any)
//	FTCOMM_GOSSIP_PORT     port of the failure-detection gossip, TCP and UDP (default 7947; 0: any)
//	                       the gloo backend takes a free port per communicator
//	FTCOMM_MIN_REPLICAS    fewest replicas a step commits with (default 1)
//	FTCOMM_SPARE           1: a spare (ft.Config.Spare), promoted when the job runs below its target (docs/spares.md)
//	FTCOMM_NODE            where this replica runs, a placement hint for spares (a pod: spec.nodeName;
//	                       default: the host name)
//	FTCOMM_STEPS           committed steps to train, then end the run (ft.Comm.Finish) and exit 0 (default 1000)
//	FTCOMM_STEP_TIME       simulated compute per step (default 100ms)
//	FTCOMM_PROBE_ADDR      HTTP address of /healthz and /readyz (default :8081; off: none)
//	FTCOMM_STALL_TIMEOUT   /healthz fails when one call of the loop takes longer (default 10m)
//	FTCOMM_LOG_FORMAT      json (default) or console
//
// /healthz answers 200 while the loop is not stuck in one call past
// FTCOMM_STALL_TIMEOUT (a liveness probe: waiting for a quorum counts as
// stuck only that long); /readyz answers 200 while this replica takes
// part in the current epoch.
//
// SIGTERM or SIGINT ends the step in flight at once (its collectives are
// aborted, the step not committed), leaves the job gracefully (the
// others drop this replica without waiting for its lease to expire) and
// exits with status 0 within a few seconds: give the pod a termination
// grace period of 15 s or more.
package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/membership"
)

// dim is the model's size: a few KiB, enough to heal in one chunk.
const dim = 1024

type config struct {
	Job, Group, Run          string
	Secret                   []byte
	Host                     string
	RecoveryPort, GossipPort int
	MinReplicas              int
	Spare                    bool
	Node                     string
	Steps                    int64
	StepTime, Stall          time.Duration
	ProbeAddr, LogFormat     string
}

func main() {
	cfg, err := configFromEnv(os.Getenv)
	if err != nil {
		fmt.Fprintln(os.Stderr, "trainer:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := train(ctx, cfg, newLogger(cfg.LogFormat)); err != nil {
		fmt.Fprintln(os.Stderr, "trainer:", err)
		os.Exit(1)
	}
}

func configFromEnv(getenv func(string) string) (config, error) {
	c := config{Job: getenv("FTCOMM_JOB"), Group: getenv("FTCOMM_GROUP"), Run: getenv("FTCOMM_RUN"), Host: getenv("FTCOMM_ADVERTISE_HOST"),
		ProbeAddr: ":8081", LogFormat: "json", RecoveryPort: 29600, GossipPort: 7947, MinReplicas: 1, Steps: 1000,
		StepTime: 100 * time.Millisecond, Stall: 10 * time.Minute}
	var errs []error
	if c.Group == "" {
		if i := getenv("JOB_COMPLETION_INDEX"); i != "" {
			c.Group = "g" + i
		} else if h, err := os.Hostname(); err == nil {
			c.Group = h
		}
	}
	if c.Host == "" {
		c.Host = "127.0.0.1"
	}
	switch v := getenv("FTCOMM_PROBE_ADDR"); v {
	case "":
	case "off":
		c.ProbeAddr = ""
	default:
		c.ProbeAddr = v
	}
	if v := getenv("FTCOMM_LOG_FORMAT"); v != "" {
		c.LogFormat = v
	}
	if f := getenv("FTCOMM_SECRET_FILE"); f != "" {
		b, err := os.ReadFile(f)
		if err != nil {
			errs = append(errs, fmt.Errorf("FTCOMM_SECRET_FILE: %w", err))
		}
		c.Secret = b
	} else {
		c.Secret = []byte(getenv("FTCOMM_SECRET"))
	}
	num := func(name string, to *int) {
		if v := getenv(name); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				errs = append(errs, fmt.Errorf("%s=%q: want a number ≥ 0", name, v))
			}
			*to = n
		}
	}
	dur := func(name string, to *time.Duration) {
		if v := getenv(name); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				errs = append(errs, fmt.Errorf("%s=%q: want a duration ≥ 0", name, v))
			}
			*to = d
		}
	}
	switch v := getenv("FTCOMM_SPARE"); v {
	case "", "0", "false":
	case "1", "true":
		c.Spare = true
	default:
		errs = append(errs, fmt.Errorf("FTCOMM_SPARE=%q: want 1 or 0", v))
	}
	c.Node = getenv("FTCOMM_NODE")
	steps := int(c.Steps)
	num("FTCOMM_RECOVERY_PORT", &c.RecoveryPort)
	num("FTCOMM_GOSSIP_PORT", &c.GossipPort)
	num("FTCOMM_MIN_REPLICAS", &c.MinReplicas)
	num("FTCOMM_STEPS", &steps)
	c.Steps = int64(steps)
	dur("FTCOMM_STEP_TIME", &c.StepTime)
	dur("FTCOMM_STALL_TIMEOUT", &c.Stall)
	switch {
	case !membership.ValidName(c.Job):
		errs = append(errs, fmt.Errorf("FTCOMM_JOB=%q: want 1–128 of [A-Za-z0-9._-]", c.Job))
	case !membership.ValidName(c.Group):
		errs = append(errs, fmt.Errorf("FTCOMM_GROUP=%q: want 1–128 of [A-Za-z0-9._-]", c.Group))
	case len(c.Secret) == 0:
		errs = append(errs, errors.New("no job secret: set FTCOMM_SECRET_FILE or FTCOMM_SECRET"))
	case getenv(membership.CredentialsEnv) == "":
		errs = append(errs, fmt.Errorf("%s is not set: give the trainers' credentials file", membership.CredentialsEnv))
	case c.LogFormat != "json" && c.LogFormat != "console":
		errs = append(errs, fmt.Errorf("FTCOMM_LOG_FORMAT=%q: want json or console", c.LogFormat))
	}
	return c, errors.Join(errs...)
}

func newLogger(format string) *zap.Logger {
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	encoder := zapcore.NewJSONEncoder(enc)
	if format == "console" {
		encoder = zapcore.NewConsoleEncoder(enc)
	}
	return zap.New(zapcore.NewCore(encoder, zapcore.AddSync(os.Stderr), zapcore.InfoLevel))
}

// probes is what /healthz and /readyz read.
type probes struct {
	callStart atomic.Int64            // unix ns when the loop entered its current call; 0 between calls
	comm      atomic.Pointer[ft.Comm] // set once made: a replica waiting as a spare is in Step, not hung
	ready     atomic.Bool
	stall     time.Duration
}

func (p *probes) enter() { p.callStart.Store(time.Now().UnixNano()) }
func (p *probes) leave() { p.callStart.Store(0) }

func (p *probes) waitsAsSpare() bool {
	c := p.comm.Load()
	return c != nil && c.Spare()
}

func (p *probes) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		if s := p.callStart.Load(); s != 0 && time.Since(time.Unix(0, s)) > p.stall && !p.waitsAsSpare() {
			http.Error(w, fmt.Sprintf("stuck in one call for %v", time.Since(time.Unix(0, s)).Round(time.Second)), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if !p.ready.Load() {
			http.Error(w, "not in the current epoch", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

func train(ctx context.Context, cfg config, lg *zap.Logger) error {
	lg = lg.With(zap.String("job", cfg.Job), zap.String("group", cfg.Group))
	p := &probes{stall: cfg.Stall}
	if cfg.ProbeAddr != "" {
		ln, err := net.Listen("tcp", cfg.ProbeAddr)
		if err != nil {
			return err
		}
		srv := &http.Server{Handler: p.handler(), ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(ln) // ends at Close below
		defer srv.Close()
		lg.Info("probes", zap.String("url", "http://"+ln.Addr().String()))
	}

	hostPort := func(port int) string { return net.JoinHostPort(cfg.Host, strconv.Itoa(port)) }
	mc := membership.DefaultMemberConfig()
	g := membership.DefaultGossipConfig()
	g.BindAddr = hostPort(cfg.GossipPort)
	mc.Gossip = &g
	gc := gloo.DefaultConfig()
	gc.ListenAddr = hostPort(0) // one listener per communicator
	c, err := ft.New(ctx, ft.Config{
		Job: cfg.Job, Group: cfg.Group, Run: cfg.Run, Secret: cfg.Secret, MinReplicas: cfg.MinReplicas, Spare: cfg.Spare, Host: cfg.Node,
		Backend: "gloo", BackendConfig: gc, Member: mc,
		RecoveryAddr: hostPort(cfg.RecoveryPort), // ft reads FTCOMM_CREDENTIALS for etcd and the keys
		Logger:       lg,
		OnEvent:      func(e ft.Event) { lg.Info("ft event", zap.Stringer("event", e)) },
	})
	if err != nil {
		return err
	}
	p.comm.Store(c)
	defer func() {
		t0 := time.Now()
		err := c.Close() // leaves the job: the others go on without waiting for a lease
		lg.Info("left the job", zap.Duration("took", time.Since(t0)), zap.Error(err))
	}()

	// The model every replica starts from, and data of its own.
	w := make([]float32, dim)
	if err := c.Register("w", comm.Float32s(w)); err != nil {
		return err
	}
	truth := make([]float32, dim)
	rt := rand.New(rand.NewPCG(1, 2))
	for i := range truth {
		truth[i] = float32(rt.NormFloat64())
	}
	rng := rand.New(rand.NewPCG(uint64(len(cfg.Group)), hash(cfg.Group)))
	x, grad := make([]float32, dim), make([]float32, dim)
	lg.Info("registered; training", zap.Int64("steps", cfg.Steps), zap.String("advertise", cfg.Host))

	for c.CommittedStep() < cfg.Steps {
		p.enter()
		err := c.Step(ctx)
		p.leave()
		var rb *ft.RollbackError
		switch {
		case ctx.Err() != nil:
			lg.Info("stopping", zap.Int64("committed", c.CommittedStep()))
			return nil
		case errors.Is(err, ft.ErrFinished):
			lg.Info("another replica ended the run", zap.Error(err))
			return nil
		case errors.As(err, &rb):
			lg.Warn("rolled back", zap.Error(err))
		case err != nil:
			return err
		}
		p.ready.Store(c.Rank() >= 0)

		// A stochastic gradient of ½(w·x − y)² on one example.
		var pred, y float32
		for i := range x {
			x[i] = float32(rng.NormFloat64())
			pred += w[i] * x[i]
			y += truth[i] * x[i]
		}
		for i := range grad {
			grad[i] = (pred - y) * x[i]
		}
		time.Sleep(cfg.StepTime) // the forward and backward pass of a real model

		p.enter()
		aerr := c.AllReduce(ctx, comm.Float32s(grad), comm.Avg).Wait(ctx)
		ok, err := c.Commit(ctx)
		p.leave()
		if ctx.Err() != nil {
			lg.Info("stopping", zap.Int64("committed", c.CommittedStep()))
			return nil
		}
		if err != nil {
			return err
		}
		if !ok {
			lg.Info("step not committed", zap.Int64("step", c.CommittedStep()), zap.NamedError("allreduce", aerr))
			continue
		}
		for i := range w {
			w[i] -= 0.5 / dim * grad[i]
		}
		if s := c.CommittedStep(); s%50 == 0 || s == cfg.Steps {
			var d float64
			for i := range w {
				d += float64((w[i] - truth[i]) * (w[i] - truth[i]))
			}
			lg.Info("committed", zap.Int64("step", s), zap.Uint64("epoch", c.Epoch()), zap.Int("participants", c.Participants()),
				zap.Float64("distance", math.Sqrt(d)))
		}
	}
	// The end of the run, agreed: a peer still in its last step ends it,
	// and one behind stops (ft.ErrFinished) instead of waiting for us.
	if err := c.Finish(ctx); err != nil {
		return err
	}
	lg.Info("done", zap.Int64("steps", c.CommittedStep()))
	return nil
}

func hash(s string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h = (h ^ uint64(s[i])) * 1099511628211
	}
	return h
}
