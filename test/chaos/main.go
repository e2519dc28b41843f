package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/ftcomm/ftcomm/ft"
)

func main() {
	if s := os.Getenv(replicaEnv); s != "" {
		os.Exit(runReplica(s))
	}
	if s := os.Getenv(etcdEnv); s != "" {
		os.Exit(runEtcd(s))
	}
	if len(os.Args) > 1 && os.Args[1] == "show" {
		os.Exit(show(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == "remeasure" {
		os.Exit(remeasure(os.Args[2:]))
	}
	os.Exit(soak(os.Args[1:]))
}

// remeasure prints a recorded run's report with its fault figures
// measured again from its events (what this build measures: the "alone"
// columns for runs recorded before them). The invariants' verdict is the
// recorded one.
func remeasure(args []string) int {
	fs := flag.NewFlagSet("chaos remeasure", flag.ContinueOnError)
	dir := fs.String("dir", ".", "the run's output directory")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	evs, faults, err := loadRun(*dir)
	if err == nil && len(faults) == 0 {
		err = errors.New("no faults.json")
	}
	var r Report
	if err == nil {
		var b []byte
		if b, err = os.ReadFile(filepath.Join(*dir, "report.json")); err == nil {
			err = json.Unmarshal(b, &r)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos remeasure:", err)
		return 1
	}
	for _, f := range faults {
		f.Detection, f.Recovery, f.Rejoin, f.Overlapped = -1, -1, -1, false
	}
	measure(evs, faults)
	r.faultFigures(faults, r.Settings.Replicas)
	fmt.Print(r.Table())
	return 0
}

// show prints part of a recorded run's timeline: around a fault, or a
// time (seconds since the run's first event).
func show(args []string) int {
	fs := flag.NewFlagSet("chaos show", flag.ContinueOnError)
	dir := fs.String("dir", ".", "the run's output directory")
	fault := fs.Int("fault", 0, "show the timeline around this fault")
	at := fs.Float64("at", -1, "show the timeline around this time (seconds since the first event)")
	before := fs.Duration("before", 2*time.Second, "how much before")
	after := fs.Duration("after", 8*time.Second, "how much after")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	evs, faults, err := loadRun(*dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos show:", err)
		return 1
	}
	if len(evs) == 0 {
		fmt.Fprintln(os.Stderr, "chaos show: no events")
		return 1
	}
	origin := time.Unix(0, evs[0].T)
	t := origin.Add(time.Duration(*at * float64(time.Second))).UnixNano()
	for _, f := range faults {
		if f.ID == *fault {
			t = f.Start.UnixNano()
			fmt.Printf("fault #%d %s %v %s (detection %v, to commit %v, rejoin %v; steps/s %.1f during, %.1f after)\n", f.ID, f.Kind, f.Targets, f.Note,
				f.Detection, f.Recovery, f.Rejoin, f.RateDuring, f.RateAfter)
		}
	}
	fmt.Print(timeline(evs, t, *before, *after, origin))
	return 0
}

// soak is the command: a chaos run as the flags say, its report printed
// and written to -dir.
func soak(args []string) int {
	cfg := DefaultConfig()
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	fs.IntVar(&cfg.Replicas, "replicas", cfg.Replicas, "replica processes (2–8)")
	fs.IntVar(&cfg.Spares, "spares", 0, "spare processes (ft.Config.Spare) beside the replicas, promoted into lost replicas' places")
	fs.DurationVar(&cfg.SpareBound, "spare-bound", 0, "a loss with a spare ready → the job at full size again, at most (0: 10s)")
	fs.DurationVar(&cfg.Duration, "duration", 30*time.Minute, "how long to inject faults")
	fs.DurationVar(&cfg.MTBF, "mtbf", cfg.MTBF, "mean time between faults")
	fs.BoolVar(&cfg.Random, "random", true, "exponentially distributed gaps between faults (else one every -mtbf)")
	faults := fs.String("faults", "all", "fault kinds, comma-separated, none, or all (kill,stop,coord-kill,coord-term,coord-all,etcd-restart,partition,isolate,slow); cut, stall and starve only by name")
	fs.Uint64Var(&cfg.Seed, "seed", uint64(time.Now().UnixNano()), "random seed (the report gives it, to run the same schedule again)")
	fs.StringVar(&cfg.Topology, "topology", cfg.Topology, "embedded (one ftcoord with its etcd) or cluster (etcd and three ftcoords)")
	fs.StringVar(&cfg.Network, "network", cfg.Network, "auto, netns (root), proxy or none")
	fs.BoolVar(&cfg.Durable, "durable", false, "ft.Config.DurableCommit")
	fs.IntVar(&cfg.Params, "params", cfg.Params, "float32s of state per replica")
	fs.DurationVar(&cfg.StepTime, "step-time", cfg.StepTime, "simulated compute per step")
	fs.DurationVar(&cfg.Timeout, "timeout", cfg.Timeout, "ft.Config.Timeout (each collective's deadline)")
	fs.DurationVar(&cfg.LeaseTTL, "lease", cfg.LeaseTTL, "members' lease TTL (≥ 2s)")
	fs.DurationVar(&cfg.Margin, "margin", cfg.Margin, "scheduling margin over the timeout before a blocked op is a violation")
	fs.IntVar(&cfg.Hog, "hog", 0, "CPU-burning processes beside the run (-1: one per CPU)")
	fs.DurationVar(&cfg.Gossip.Probe, "gossip-probe", 0, "gossip probe interval of replicas and coordinators (0: membership's default profile)")
	fs.DurationVar(&cfg.Gossip.ProbeTimeout, "gossip-probe-timeout", 0, "gossip probe timeout (with -gossip-probe)")
	fs.IntVar(&cfg.Gossip.Suspicion, "gossip-suspicion", 0, "gossip suspicion multiplier (with -gossip-probe)")
	fs.BoolVar(&cfg.StrictDeaths, "strict-deaths", false, "fail on a false death (a replica no fault touched removed by the coordinator)")
	fs.StringVar(&cfg.Compute, "compute", cfg.Compute, "a step's compute: sleep, or cpu (the step time's worth of work on the CPU, which -faults starve slows)")
	fs.DurationVar(&cfg.FaultLength, "fault-length", 0, "how long cut, stall and starve faults last (0: each kind's random range)")
	fs.DurationVar(&cfg.Tail, "tail", 0, "how long the job runs on without faults after the last one, before the replicas stop")
	fs.Float64Var(&cfg.StarveQuota, "starve-quota", 0, "starve a replica by a CPU quota of this fraction of one CPU (cgroup v1 cpu) instead of busy loops")
	fs.IntVar(&cfg.StarveLoops, "starve-loops", cfg.StarveLoops, "busy loops beside a starved replica on its CPU")
	fs.Float64Var(&cfg.Stragglers.Factor, "straggler-factor", 0, "the replicas' straggler policy: out while their step time stays above this many times the others' median (0: off)")
	fs.DurationVar(&cfg.Stragglers.Window, "straggler-window", 0, "the straggler policy's window (0: membership's default)")
	fs.DurationVar(&cfg.Stragglers.Probation, "straggler-probation", 0, "the straggler policy's probation (0: membership's default)")
	fs.Int64Var(&cfg.Data.Size, "data-size", cfg.Data.Size, "samples in the dataset the replicas read through an ft.Sampler (the data invariant)")
	fs.IntVar(&cfg.Data.Batch, "data-batch", cfg.Data.Batch, "samples of a replica's micro-batch")
	fs.IntVar(&cfg.Data.Accum, "data-accum", cfg.Data.Accum, "micro-batches per replica and step")
	policy := fs.String("data-policy", "replica", "the sampler's batch policy: replica (the global batch follows the participants) or global")
	fs.Uint64Var(&cfg.Data.Seed, "data-seed", 0, "the dataset's shuffle seed (0: -seed)")
	fs.StringVar(&cfg.Dir, "dir", "", "output directory (default: a new one under the system's temporary directory)")
	fs.StringVar(&cfg.Ftcoord, "ftcoord", "", "ftcoord binary (default: built with go build)")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	var err error
	if cfg.Faults, err = ParseFaults(*faults); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if cfg.Data.Policy, err = ft.ParseBatchPolicy(*policy); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if cfg.Hog < 0 {
		cfg.Hog = hogs()
	}
	if cfg.Dir == "" {
		if cfg.Dir, err = os.MkdirTemp("", "ftcomm-chaos-"); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	cfg.Log = os.Stdout
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	rep, err := Run(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 1
	}
	fmt.Printf("\n%s\nreport, events, logs and timeline.png in %s\n", rep.Table(), cfg.Dir)
	if !rep.Passed() {
		return 1
	}
	return 0
}
