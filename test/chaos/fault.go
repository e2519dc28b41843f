package main

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// FaultKind names what the nemesis does.
type FaultKind string

// The faults the nemesis can inject.
const (
	// FaultKill SIGKILLs a replica and starts it again after a delay.
	FaultKill FaultKind = "kill"
	// FaultStop SIGSTOPs a replica for longer than its lease, then
	// SIGCONTs it: a zombie with an old epoch, which must be fenced out,
	// then heal and rejoin.
	FaultStop FaultKind = "stop"
	// FaultCoordKill SIGKILLs the leading ftcoord and starts it again on
	// its data directory after a delay; FaultCoordTerm does the same with
	// SIGTERM (a graceful shutdown).
	FaultCoordKill FaultKind = "coord-kill"
	FaultCoordTerm FaultKind = "coord-term"
	// FaultCoordAll stops every ftcoord (SIGKILL) for a while, then starts
	// them again on their data directories. With the embedded topology
	// etcd goes with them.
	FaultCoordAll FaultKind = "coord-all"
	// FaultEtcd SIGKILLs the etcd server of the cluster topology and
	// starts it again on its data directory.
	FaultEtcd FaultKind = "etcd-restart"
	// FaultPartition splits the replicas in two halves (2|2 of 4), the
	// coordinators with one of them, then heals.
	FaultPartition FaultKind = "partition"
	// FaultIsolate cuts one replica from every other and from the
	// coordinators, then heals.
	FaultIsolate FaultKind = "isolate"
	// FaultSlow adds delay, jitter and a rate cap to one replica's
	// uplink for a while.
	FaultSlow FaultKind = "slow"
	// FaultCut splits the replicas in two halves (2|2 of 4) that both
	// still reach the coordinators, then heals.
	FaultCut FaultKind = "cut"
	// FaultStall stops one replica's training loop from calling Step
	// (a stuck data loader) while its process lives on, then lets it go
	// on.
	FaultStall FaultKind = "stall"
	// FaultSettings changes the job's settings with `ftcoord job set`
	// while it trains: every replica of the epoch that carries the new
	// version must take it from the same step.
	FaultSettings FaultKind = "settings"
	// FaultStarve pins one replica's process to one CPU beside busy
	// loops pinned to the same CPU (Config.StarveLoops), then lets it
	// run anywhere again. It slows a replica that computes on the CPU
	// (Config.Compute "cpu").
	FaultStarve FaultKind = "starve"
)

// AllFaults is every kind "all" selects, in the order reports list them.
var AllFaults = []FaultKind{FaultKill, FaultStop, FaultCoordKill, FaultCoordTerm, FaultCoordAll, FaultEtcd,
	FaultPartition, FaultIsolate, FaultSlow}

// MoreFaults are the kinds only named ones select: "all" keeps the
// schedules of earlier seeds.
var MoreFaults = []FaultKind{FaultCut, FaultStall, FaultStarve, FaultSettings}

// needsNetwork: kinds that cut or shape links.
func (k FaultKind) needsNetwork() bool {
	return k == FaultPartition || k == FaultIsolate || k == FaultSlow || k == FaultCut
}

// replicaFault: kinds whose recovery is the first commit of a newer epoch
// (the others': the first commit at all).
func (k FaultKind) replicaFault() bool {
	switch k {
	case FaultKill, FaultStop, FaultPartition, FaultIsolate, FaultCut, FaultStall:
		return true
	}
	return false
}

// ParseFaults parses a comma-separated list of kinds ("all": every kind
// of AllFaults, "none": no fault at all).
func ParseFaults(s string) ([]FaultKind, error) {
	if s == "" || s == "all" {
		return append([]FaultKind(nil), AllFaults...), nil
	}
	if s == "none" {
		return nil, nil
	}
	var out []FaultKind
	for _, f := range strings.Split(s, ",") {
		k := FaultKind(strings.TrimSpace(f))
		if !slices.Contains(AllFaults, k) && !slices.Contains(MoreFaults, k) {
			return nil, fmt.Errorf("chaos: unknown fault %q (want some of %v %v, or all)", k, AllFaults, MoreFaults)
		}
		out = append(out, k)
	}
	return out, nil
}

// Fault is one injected fault.
type Fault struct {
	ID      int       `json:"id"`
	Kind    FaultKind `json:"kind"`
	Targets []string  `json:"targets"` // replicas or coordinator processes
	// Affects: the replicas whose process or links it touches (their
	// peers may rightly see them fail); Silent: those peers see silence
	// (a stopped process, a cut or slow link) rather than a reset.
	Affects []string  `json:"affects,omitempty"`
	Silent  bool      `json:"silent,omitempty"`
	Start   time.Time `json:"start"`
	End     time.Time `json:"end"` // when it was undone (restarted, continued, healed)
	Note    string    `json:"note,omitempty"`
	Epoch   uint64    `json:"epoch"` // the newest epoch at Start
	Err     string    `json:"err,omitempty"`

	// From the analysis (-1 when it does not apply or never happened).
	Detection time.Duration `json:"detectionNs"` // Start → the first epoch without a target
	Recovery  time.Duration `json:"recoveryNs"`  // Start → the first commit of a newer epoch (or any commit, for faults that need none)
	Rejoin    time.Duration `json:"rejoinNs"`    // End → the target's first commit again
	// Capacity: Start → the first commit of a newer epoch at the job's
	// full size (its quorum's target) again, for faults of replicas in
	// the job (0: none, or not measured).
	Capacity time.Duration `json:"capacityNs,omitempty"`
	// ReadySpares: spares waiting, ready, when it began, that it did not
	// touch; WaitingSpare: its target was one of them (not in the job).
	// InJob: a replica it touched was in the job (its newest quorum)
	// when it began.
	ReadySpares  int  `json:"readySpares,omitempty"`
	WaitingSpare bool `json:"waitingSpare,omitempty"`
	InJob        bool `json:"inJob,omitempty"`
	// Overlapped: another fault (settings changes aside) began between
	// Start and the end of its effects (the rejoin or, sooner, the job at
	// full size again), so Recovery and Rejoin measure both.
	Overlapped bool `json:"overlapped,omitempty"`
	// The job's committed steps per second while it lasted, and for as
	// long after it was undone (or to the end of the run).
	RateDuring float64 `json:"rateDuring"`
	RateAfter  float64 `json:"rateAfter"`

	// settings: the version `ftcoord job set` stored (0: none); the step
	// it was in force from at the replicas, and how many steps the job
	// committed after the command returned before that step (-1: none
	// took it); how many replicas took it in that epoch.
	Version     uint64 `json:"version,omitempty"`
	SettingsAt  int64  `json:"settingsAt,omitempty"`
	SettingsLag int64  `json:"settingsLag,omitempty"`
	SettingsN   int    `json:"settingsN,omitempty"`
}

// affects reports whether f touches replica r at time t (with linger after
// it was undone).
func (f *Fault) covers(r string, t int64, linger time.Duration) bool {
	if t < f.Start.UnixNano() || (!f.End.IsZero() && t > f.End.Add(linger).UnixNano()) {
		return false
	}
	for _, a := range f.Affects {
		if a == r {
			return true
		}
	}
	return false
}

// overlaps reports whether f (with linger) overlaps [from, to].
func (f *Fault) overlaps(from, to int64, linger time.Duration) bool {
	end := int64(1<<63 - 1)
	if !f.End.IsZero() {
		end = f.End.Add(linger).UnixNano()
	}
	return from <= end && to >= f.Start.UnixNano()
}
