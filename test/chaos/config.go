package main

import (
	"fmt"
	"io"
	"runtime"
	"time"

	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/membership"
)

// Config is one chaos run.
type Config struct {
	Replicas int // replica processes (one replica group each), 2–8
	// Spares is the pool of warm standby processes (ft.Config.Spare)
	// started beside the replicas, once they commit together: each waits
	// until the coordinator promotes it into a lost replica's place. The
	// faults target them too; Replicas+Spares is at most 8.
	Spares int
	// SpareBound is how soon after a loss that left the job below its
	// target, with a spare ready, the job must commit at full size again
	// (the capacity invariant); 0: 10 s.
	SpareBound time.Duration
	Duration   time.Duration // how long the nemesis injects faults
	MTBF       time.Duration // mean time between the starts of two faults
	// Random: exponentially distributed gaps between faults (mean MTBF)
	// instead of one every MTBF.
	Random bool
	Faults []FaultKind // the kinds the nemesis cycles through (in a random order each round)
	Seed   uint64
	// Topology: "embedded" (one ftcoord with its embedded etcd) or
	// "cluster" (an etcd server and three ftcoord instances on it).
	Topology string
	// Network: "auto" (netns when root, else the proxy), "netns", "proxy"
	// or "none" (no partitions or slow links).
	Network string
	Durable bool // ft.Config.DurableCommit

	Params   int           // float32s of state per replica
	StepTime time.Duration // simulated compute per step
	Timeout  time.Duration // ft.Config.Timeout: every collective's deadline
	LeaseTTL time.Duration // members' lease (etcd's minimum is 2 s)
	// Margin is the scheduling slack the deadline invariant allows on top
	// of Timeout.
	Margin time.Duration
	// Hog starts this many CPU-burning processes beside the run.
	Hog int
	// Gossip tunes failure detection by gossip (replicas and
	// coordinators alike); zero fields keep membership.DefaultGossipConfig.
	Gossip GossipTuning
	// StrictDeaths fails the run on a false death (the coordinator
	// removing a replica no fault touched); otherwise they are counted.
	StrictDeaths bool
	// Compute is how a replica spends a step's compute: "sleep" (StepTime
	// asleep) or "cpu" (StepTime of CPU time's worth of work, measured
	// when the run starts, so that a starved replica computes slower).
	Compute string
	// FaultLength fixes how long cut, stall and starve faults last (0:
	// each kind's random range).
	FaultLength time.Duration
	// Tail is how long the job runs on without faults after the nemesis
	// ends, before the replicas are stopped (the step rate after a fault).
	Tail time.Duration
	// StarveLoops is how many busy loops share a starved replica's CPU.
	StarveLoops int
	// StarveQuota, when above 0, starves a replica by a CPU quota
	// instead: this fraction of one CPU (the cgroup v1 cpu controller), so
	// that on a small machine the busy loops do not starve the others too.
	StarveQuota float64
	// Stragglers is the straggler policy the replicas ask for
	// (ft.Config.Member.Stragglers; the zero value: the coordinator's,
	// off).
	Stragglers membership.StragglerPolicy
	// Data is the dataset every replica reads through an ft.Sampler (the
	// data invariant: the job's committed steps read each sample of each
	// epoch exactly once); Seed 0: the run's Seed.
	Data ft.SamplerConfig

	Dir     string // logs, events, report and plot go here
	Ftcoord string // the ftcoord binary; empty: built with go build
	Log     io.Writer
}

// DefaultConfig is the CI mix's setting: 4 replicas, a fault every 15 s.
func DefaultConfig() Config {
	return Config{
		Replicas: 4, Duration: 2 * time.Minute, MTBF: 15 * time.Second, Faults: AllFaults, Seed: 1,
		Topology: "cluster", Network: "auto", Params: 1 << 16, StepTime: 50 * time.Millisecond,
		Timeout: 5 * time.Second, LeaseTTL: 2 * time.Second, Margin: 2 * time.Second,
		Compute: "sleep", StarveLoops: 4,
		// 16 samples a step at 4 replicas: an epoch every ~190 steps
		// (10 s), its ends falling inside steps.
		Data: ft.SamplerConfig{Size: 3000, Batch: 2, Accum: 2},
	}
}

// Validate says what is wrong.
func (c *Config) Validate() error {
	switch {
	case c.Replicas < 2 || c.Replicas > maxReplicas:
		return fmt.Errorf("chaos: %d replicas: want 2 to %d", c.Replicas, maxReplicas)
	case c.Spares < 0 || c.Replicas+c.Spares > maxReplicas || c.SpareBound < 0:
		return fmt.Errorf("chaos: %d spares beside %d replicas (bound %v): want at most %d processes in all", c.Spares, c.Replicas, c.SpareBound, maxReplicas)
	case c.Duration < 0 || c.MTBF <= 0:
		return fmt.Errorf("chaos: duration %v, mtbf %v", c.Duration, c.MTBF)
	case c.Topology != "embedded" && c.Topology != "cluster":
		return fmt.Errorf("chaos: topology %q: want embedded or cluster", c.Topology)
	case c.Network != "auto" && c.Network != "netns" && c.Network != "proxy" && c.Network != "none":
		return fmt.Errorf("chaos: network %q: want auto, netns, proxy or none", c.Network)
	case c.Params < 1:
		return fmt.Errorf("chaos: %d params", c.Params)
	case c.LeaseTTL < 2*time.Second:
		return fmt.Errorf("chaos: lease TTL %v is below etcd's minimum of 2s", c.LeaseTTL)
	case c.Timeout <= 0 || c.StepTime < 0 || c.Margin < 0 || c.Hog < 0:
		return fmt.Errorf("chaos: timeout %v, step time %v, margin %v, hog %d", c.Timeout, c.StepTime, c.Margin, c.Hog)
	case c.Gossip.Probe < 0 || (c.Gossip.Probe > 0 && (c.Gossip.ProbeTimeout <= 0 || c.Gossip.ProbeTimeout >= c.Gossip.Probe || c.Gossip.Suspicion < 1)):
		return fmt.Errorf("chaos: gossip probe %v, timeout %v, suspicion ×%d: want a timeout below the probe interval and ×1 or more",
			c.Gossip.Probe, c.Gossip.ProbeTimeout, c.Gossip.Suspicion)
	case c.Compute != "sleep" && c.Compute != "cpu":
		return fmt.Errorf("chaos: compute %q: want sleep or cpu", c.Compute)
	case c.FaultLength < 0 || c.StarveLoops < 0 || c.Tail < 0 || c.StarveQuota < 0 || c.StarveQuota > 1:
		return fmt.Errorf("chaos: fault length %v, starve loops %d, starve quota %g, tail %v", c.FaultLength, c.StarveLoops, c.StarveQuota, c.Tail)
	case c.Dir == "":
		return fmt.Errorf("chaos: no output directory")
	}
	if err := c.Data.Validate(); err != nil {
		return fmt.Errorf("chaos: data: %w", err)
	}
	return c.Stragglers.Validate()
}

// spareBound is SpareBound or its default.
func (c *Config) spareBound() time.Duration {
	if c.SpareBound > 0 {
		return c.SpareBound
	}
	return 10 * time.Second
}

// hogs is the default number of CPU hogs: one per core.
func hogs() int { return runtime.NumCPU() }

// GossipTuning overrides the gossip profile's probe interval, probe
// timeout and suspicion multiplier.
type GossipTuning struct {
	Probe, ProbeTimeout time.Duration
	Suspicion           int
}
