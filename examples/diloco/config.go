package main

import (
	"errors"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/examples/diloco/charlm"
	"github.com/ftcomm/ftcomm/ft/diloco"
)

// Failure is one scheduled failure of the demo: replica Replica is
// SIGKILLed once the job has committed At of its syncs, and started again
// Down later (never, if Down < 0).
type Failure struct {
	Replica int
	At      float64 // fraction of the run's syncs
	Down    time.Duration
}

func (f Failure) String() string {
	s := fmt.Sprintf("%d@%g%%", f.Replica, f.At*100)
	if f.Down >= 0 {
		s += ":" + f.Down.String()
	}
	return s
}

// parseFailures reads "2@40%:3s,1@70%:2s": replica@percent[:downtime]; a
// missing downtime means the replica is not started again. "" or "none":
// no failures.
func parseFailures(s string, replicas int) ([]Failure, error) {
	if s == "" || s == "none" {
		return nil, nil
	}
	var out []Failure
	for _, part := range strings.Split(s, ",") {
		bad := func(why string) error {
			return fmt.Errorf("failure %q: %s (want replica@percent[:downtime], e.g. 2@40%%:3s)", part, why)
		}
		who, rest, ok := strings.Cut(strings.TrimSpace(part), "@")
		if !ok {
			return nil, bad("no @")
		}
		r, err := strconv.Atoi(strings.TrimPrefix(who, "r"))
		if err != nil || r < 0 || r >= replicas {
			return nil, bad(fmt.Sprintf("replica must be 0…%d", replicas-1))
		}
		at, down, hasDown := strings.Cut(rest, ":")
		p, err := strconv.ParseFloat(strings.TrimSuffix(at, "%"), 64)
		if err != nil || p <= 0 || p >= 100 {
			return nil, bad("percent must be in (0, 100)")
		}
		f := Failure{Replica: r, At: p / 100, Down: -1}
		if hasDown {
			if f.Down, err = time.ParseDuration(down); err != nil || f.Down < 0 {
				return nil, bad("bad downtime")
			}
		}
		out = append(out, f)
	}
	return out, nil
}

// Config is everything the demo and its replicas run with; the replicas
// read it from run.json in the report folder.
type Config struct {
	Replicas    int
	Spares      int // spare replicas started with the job with failures (ft.Config.Spare)
	MinReplicas int
	Backend     string
	Steps       int // inner steps each replica trains (the run ends after Steps/(H/F) syncs)
	Batch       int
	LR          float64 // AdamW's peak inner learning rate
	Seed        uint64
	Model       charlm.Config
	DiLoCo      diloco.Config `json:"-"`
	H, F, Tau   int
	Alpha       float64
	OuterLR     float64
	OuterMom    float64
	Quant       string
	Failures    []Failure
	Baseline    bool // also run the same job without failures, alongside
	Gossip      bool
	EvalEvery   int // evaluate the global parameters every EvalEvery syncs (0: every H/F·F = H inner steps)
	EvalN       int // validation positions per curve point
	FinalEvalN  int // validation positions of the final loss
	TrainBytes  int
	ValBytes    int
	Corpus      string // a directory of Go source; default: $(go env GOROOT)/src
	Report      string
	Timeout     time.Duration
	Progress    string // "bar", "lines" or "auto"
	Verbose     bool
}

func defaultConfig() Config {
	return Config{Replicas: 4, Spares: 1, MinReplicas: 2, Backend: "gloo", Steps: 4000, Batch: 64, LR: 3e-3, Seed: 1,
		Model: charlm.DefaultConfig(), H: 100, F: 4, Tau: 1, Alpha: 0.5, OuterLR: 0.7, OuterMom: 0.9, Quant: "float32",
		Failures: []Failure{{Replica: 2, At: 0.4, Down: 3 * time.Second}}, Baseline: true,
		EvalN: 4096, FinalEvalN: 32768, TrainBytes: 4 << 20, ValBytes: 256 << 10,
		Report: "diloco-report", Timeout: 10 * time.Minute, Progress: "auto"}
}

// flags binds the command line to c.
func (c *Config) flags(fs *flag.FlagSet, failures *string) {
	fs.IntVar(&c.Replicas, "replicas", c.Replicas, "replica processes")
	fs.IntVar(&c.Spares, "spares", c.Spares, "spare replica processes started with the job with failures: one is promoted in a dead replica's place (0: none; the restarted replica rejoins)")
	fs.IntVar(&c.MinReplicas, "min-replicas", c.MinReplicas, "fewest replicas a sync may commit with")
	fs.StringVar(&c.Backend, "backend", c.Backend, "comm backend of the fault-tolerant dimension: gloo (the demo's model lives in host memory, so a device backend such as nccl is refused)")
	fs.IntVar(&c.Steps, "steps", c.Steps, "inner steps per replica")
	fs.IntVar(&c.Batch, "batch", c.Batch, "examples per inner step")
	fs.Float64Var(&c.LR, "lr", c.LR, "peak inner learning rate (AdamW, warm-up and cosine decay)")
	fs.Uint64Var(&c.Seed, "seed", c.Seed, "seed of the model and the data order")
	fs.IntVar(&c.H, "H", c.H, "inner steps between two syncs of a parameter")
	fs.IntVar(&c.F, "F", c.F, "fragments (Streaming DiLoCo); 1 = DiLoCo")
	fs.IntVar(&c.Tau, "tau", c.Tau, "inner steps each fragment's exchange overlaps (τ < H/F)")
	fs.Float64Var(&c.Alpha, "alpha", c.Alpha, "mixing factor α of a synced fragment into the local parameters")
	fs.Float64Var(&c.OuterLR, "outer-lr", c.OuterLR, "outer learning rate (Nesterov)")
	fs.Float64Var(&c.OuterMom, "outer-momentum", c.OuterMom, "outer momentum (Nesterov)")
	fs.StringVar(&c.Quant, "quant", c.Quant, "outer gradients on the wire: float32, int8 or int4")
	fs.StringVar(failures, "fail", *failures, "failure schedule: replica@percent-of-syncs[:downtime before restart], comma separated; none for none")
	fs.BoolVar(&c.Baseline, "baseline", c.Baseline, "also train the same job without failures, alongside, for comparison")
	fs.BoolVar(&c.Gossip, "gossip", c.Gossip, "members gossip (memberlist) to detect hung replicas too")
	fs.IntVar(&c.Model.Context, "context", c.Model.Context, "model: characters of context")
	fs.IntVar(&c.Model.Embed, "embed", c.Model.Embed, "model: embedding width")
	fs.IntVar(&c.Model.Hidden, "hidden", c.Model.Hidden, "model: hidden units")
	fs.IntVar(&c.EvalN, "eval", c.EvalN, "validation positions per point of the loss curve")
	fs.IntVar(&c.FinalEvalN, "final-eval", c.FinalEvalN, "validation positions of the final loss")
	fs.StringVar(&c.Corpus, "corpus", c.Corpus, "directory of Go source to train on (default: the Go distribution's src)")
	fs.StringVar(&c.Report, "report", c.Report, "report folder (summary, plot, logs)")
	fs.DurationVar(&c.Timeout, "timeout", c.Timeout, "give up after this long")
	fs.StringVar(&c.Progress, "progress", c.Progress, "progress display: bar, lines or auto")
	fs.BoolVar(&c.Verbose, "v", c.Verbose, "copy the replicas' logs to stderr")
}

// validate fills in the DiLoCo config and says what is wrong.
func (c *Config) validate() error {
	q, err := diloco.ParseQuantization(c.Quant)
	if err != nil {
		return err
	}
	d := diloco.DefaultConfig()
	d.InnerSteps, d.Fragments, d.Overlap, d.Alpha, d.OuterLR, d.OuterMomentum, d.Quantization = c.H, c.F, c.Tau, c.Alpha, c.OuterLR, c.OuterMom, q
	if err := d.Validate(); err != nil {
		return err
	}
	c.DiLoCo = d
	switch {
	case c.Replicas < 1:
		return errors.New("need at least one replica")
	case c.Spares < 0:
		return errors.New("spares must be 0 or more")
	case c.MinReplicas < 1 || c.MinReplicas > c.Replicas:
		return fmt.Errorf("min replicas %d: want 1…%d", c.MinReplicas, c.Replicas)
	case c.Steps < c.H/c.F:
		return fmt.Errorf("%d steps do not reach the first sync (every %d)", c.Steps, c.H/c.F)
	case c.Batch < 1 || c.LR <= 0:
		return errors.New("batch and lr must be positive")
	case c.EvalN < 1 || c.FinalEvalN < 1:
		return errors.New("eval sizes must be positive")
	case c.Backend != "gloo":
		// The model trains with gonum on the CPU: its parameters are host
		// tensors, which a device backend refuses at the first sync.
		return fmt.Errorf("backend %q: the demo's model lives in host memory; only gloo carries it", c.Backend)
	}
	if err := c.Model.Validate(); err != nil {
		return err
	}
	for _, f := range c.Failures {
		if f.Replica >= c.Replicas {
			return fmt.Errorf("failure %v: no replica %d", f, f.Replica)
		}
	}
	if c.EvalEvery == 0 {
		c.EvalEvery = c.F
	}
	return nil
}

// replicaName is process r's group: r0… for the replicas, s0… for the
// spares (numbered after them).
func (c *Config) replicaName(r int) string {
	if r >= c.Replicas {
		return fmt.Sprintf("s%d", r-c.Replicas)
	}
	return fmt.Sprintf("r%d", r)
}

// Syncs is the number of committed syncs a run makes: one join sync, then
// one every H/F inner steps.
func (c *Config) Syncs() int64 { return int64(c.Steps/(c.H/c.F)) + 1 }
