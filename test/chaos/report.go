package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ftcomm/ftcomm/ft"
)

// Report is what a run measured and whether it kept its invariants.
type Report struct {
	Settings Settings  `json:"settings"`
	Network  string    `json:"network"`
	Started  time.Time `json:"started"`
	// Seconds of the nemesis and of the whole run; the load average
	// (/proc/loadavg) when the nemesis began and ended.
	NemesisSeconds float64 `json:"nemesisSeconds"`
	TotalSeconds   float64 `json:"totalSeconds"`
	LoadStart      string  `json:"loadStart"`
	LoadEnd        string  `json:"loadEnd"`

	Faults       int               `json:"faults"`
	FaultsByKind map[FaultKind]int `json:"faultsByKind"`
	FaultErrors  int               `json:"faultErrors"` // faults the harness could not fully inject or undo

	// Step efficiency: commits that stayed in the job's history over
	// Commit calls, summed over the replicas.
	Attempts   int     `json:"attempts"`
	Commits    int     `json:"commits"`
	Lost       int     `json:"lost"`
	Efficiency float64 `json:"efficiency"`
	// The job's committed steps per second before the first fault and
	// while the nemesis ran.
	StepRateFaultFree float64 `json:"stepRateFaultFree"`
	StepRateNemesis   float64 `json:"stepRateNemesis"`
	FinalStep         int64   `json:"finalStep"`
	Epochs            int     `json:"epochs"`

	// Fault → the coordinator's first epoch without the faulted replica;
	// fault → the first commit of a newer epoch (failure to next commit);
	// undone → the faulted replica's first commit again.
	Detection Percentiles `json:"detection"`
	Recovery  Percentiles `json:"recovery"`
	Rejoin    Percentiles `json:"rejoin"`
	// The same over the faults no other fault overlapped.
	RecoveryAlone Percentiles            `json:"recoveryAlone"`
	RejoinAlone   Percentiles            `json:"rejoinAlone"`
	ByKind        map[FaultKind]KindStat `json:"byKind"`

	Heals       int   `json:"heals"`
	HealedBytes int64 `json:"healedBytes"`
	Rollbacks   int   `json:"rollbacks"`
	// RolledBackSteps: steps the rollbacks discarded, MaxRollback the
	// most one rollback discarded.
	RolledBackSteps int   `json:"rolledBackSteps"`
	MaxRollback     int64 `json:"maxRollback"`
	Redone          int   `json:"redoneSteps"` // steps committed by two epochs with different states
	// Forks: epochs that committed steps the job had already committed in
	// another epoch; ForkDepth: how far behind the job's newest step the
	// deepest started.
	Forks     int   `json:"forks"`
	ForkDepth int64 `json:"forkDepth"`
	// How the survivors' pending ops failed when a peer was SIGKILLed.
	KillErrors map[string]int `json:"killErrors"`
	// FalseDeaths: the coordinator removed a replica that no fault
	// touched (a stall taken for a death). Violations only with
	// Config.StrictDeaths.
	FalseDeaths []Violation `json:"falseDeaths"`
	// OutageRemovals: replicas removed during a coordinator or etcd
	// outage (their registrations lapsed with it), not counted as false
	// deaths.
	OutageRemovals int `json:"outageRemovals"`
	// Settings changes (`ftcoord job set`): how many, how many reached
	// every replica at one step in the epoch that carried them, and the
	// steps the job committed between the command's return and that step.
	SettingsChanges   int   `json:"settingsChanges,omitempty"`
	SettingsAllAtOnce int   `json:"settingsAllAtOnce,omitempty"`
	SettingsLagMax    int64 `json:"settingsLagMax,omitempty"`
	SettingsLagP50    int64 `json:"settingsLagP50,omitempty"`
	// Spares (Config.Spares): promotions; kills of a replica in the job,
	// and of them those with a spare ready; kill → the first commit at
	// full size again (capacity back) over those no other fault
	// overlapped.
	Promotions     int         `json:"promotions,omitempty"`
	KillsInJob     int         `json:"killsInJob,omitempty"`
	KillsWithSpare int         `json:"killsWithSpare,omitempty"`
	CapacityBack   Percentiles `json:"capacityBack"`
	// Data: what the job's committed history read (the data invariant).
	Data DataCoverage `json:"data"`

	Violations []Violation `json:"violations"`
}

// Settings are the run's configuration, as the report shows it.
type Settings struct {
	Replicas int         `json:"replicas"`
	Spares   int         `json:"spares,omitempty"`
	Duration string      `json:"duration"`
	MTBF     string      `json:"mtbf"`
	Random   bool        `json:"random"`
	Faults   []FaultKind `json:"faults"`
	Seed     uint64      `json:"seed"`
	Topology string      `json:"topology"`
	Durable  bool        `json:"durable"`
	Params   int         `json:"params"`
	StepTime string      `json:"stepTime"`
	Timeout  string      `json:"timeout"`
	LeaseTTL string      `json:"leaseTTL"`
	Margin   string      `json:"margin"`
	Hog      int         `json:"hog"`
	Gossip   string      `json:"gossip"`
	CPUs     int         `json:"cpus"`
	Data     string      `json:"data,omitempty"`
}

// Percentiles summarise durations (seconds).
type Percentiles struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50"`
	P99 float64 `json:"p99"`
	Max float64 `json:"max"`
}

// KindStat is one fault kind's figures.
type KindStat struct {
	N         int         `json:"n"`
	Detection Percentiles `json:"detection"`
	Recovery  Percentiles `json:"recovery"`
	Rejoin    Percentiles `json:"rejoin"`
	// RecoveryAlone and RejoinAlone: the same for the faults no other
	// fault overlapped (Fault.Overlapped). With faults every 15 s, some
	// lasting 20–40 s, the tails of Recovery and Rejoin are mostly a
	// second fault's cost (a stalled replica cannot rejoin from a cut).
	RecoveryAlone Percentiles `json:"recoveryAlone"`
	RejoinAlone   Percentiles `json:"rejoinAlone"`
}

func percentiles(ds []time.Duration) Percentiles {
	if len(ds) == 0 {
		return Percentiles{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	rank := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return s[max(i, 0)].Seconds()
	}
	return Percentiles{N: len(s), P50: rank(0.5), P99: rank(0.99), Max: s[len(s)-1].Seconds()}
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// stepAt is the job's newest committed step at t.
func stepAt(evs []Event, t time.Time) int64 {
	var s int64
	for _, e := range evs {
		if e.T > t.UnixNano() {
			break
		}
		if e.Kind == evCommit {
			s = max(s, e.Step)
		}
	}
	return s
}

// stepRate is the job's committed steps per second from from to to.
func stepRate(evs []Event, from, to time.Time) float64 {
	if d := to.Sub(from); d > 0 {
		return float64(stepAt(evs, to)-stepAt(evs, from)) / d.Seconds()
	}
	return 0
}

// measure fills in each fault's detection, recovery and rejoin times and
// the step rates while it lasted and after.
func measure(evs []Event, faults []*Fault) {
	var last time.Time
	if len(evs) > 0 {
		last = time.Unix(0, evs[len(evs)-1].T)
	}
	pool := spareLaunches(evs)
	touched := func(r string, t int64) bool {
		return slices.ContainsFunc(faults, func(f *Fault) bool { return f.covers(r, t, 0) })
	}
	for _, f := range faults {
		if !f.End.IsZero() {
			f.RateDuring = stepRate(evs, f.Start, f.End)
			to := f.End.Add(f.End.Sub(f.Start))
			if to.After(last) {
				to = last
			}
			f.RateAfter = stepRate(evs, f.End, to)
		}
		if f.Kind == FaultSettings {
			measureSettings(evs, f)
			continue
		}
		start := f.Start.UnixNano()
		f.Capacity, f.InJob, f.WaitingSpare, f.ReadySpares = 0, false, false, 0
		affects := map[string]bool{}
		for _, a := range f.Affects {
			affects[a] = true
		}
		replicaFault := f.Kind.replicaFault()
		detected := replicaFault || f.Kind == FaultStarve // a straggler policy may take it out
		// The job's size and members when it began: its newest quorum's.
		var before Event
		for _, e := range evs {
			if e.T >= start {
				break
			}
			if e.Kind == evQuorum {
				before = e
			}
		}
		full := before.Target
		if full == 0 {
			full = len(before.Members)
		}
		inJob := slices.ContainsFunc(f.Affects, func(r string) bool {
			return slices.ContainsFunc(before.Members, func(m string) bool { return replicaOfMember(m) == r })
		})
		f.InJob = replicaFault && inJob
		if len(pool) > 0 && replicaFault {
			f.WaitingSpare = !inJob && len(f.Affects) == 1 && slices.ContainsFunc(pool, func(l *spareLaunch) bool {
				return l.name == f.Affects[0] && l.waiting(start)
			})
			f.ReadySpares = 0
			for _, n := range readySpares(pool, start, "", touched) {
				if !slices.Contains(f.Affects, n) {
					f.ReadySpares++
				}
			}
		}
		if f.WaitingSpare {
			continue // the job lost nothing: no detection, recovery or rejoin
		}
		for _, e := range evs {
			if e.T < start {
				continue
			}
			switch e.Kind {
			case evQuorum:
				// Detected while it lasts (or soon after): a replica
				// that took no part in the epoch is not removed at all.
				if f.Detection < 0 && detected && (f.End.IsZero() || e.T <= f.End.Add(10*time.Second).UnixNano()) {
					for _, m := range e.Removed {
						if affects[replicaOfMember(m)] {
							f.Detection = time.Duration(e.T - start)
						}
					}
				}
			case evCommit:
				if f.Recovery < 0 && (!replicaFault || e.Epoch > f.Epoch) {
					f.Recovery = time.Duration(e.T - start)
				}
				if f.Capacity <= 0 && replicaFault && inJob && full > 0 && e.Epoch > f.Epoch && e.N >= full {
					f.Capacity = time.Duration(e.T - start)
				}
				if f.Rejoin < 0 && detected && !f.End.IsZero() && e.T > f.End.UnixNano() && affects[e.Replica] &&
					(f.Kind != FaultPartition && f.Kind != FaultCut || e.N == 0 || len(f.Affects) == e.N) {
					f.Rejoin = time.Duration(e.T - f.End.UnixNano())
				}
			}
		}
	}
	markOverlaps(faults)
}

// markOverlaps sets Overlapped on each fault that another one (settings
// changes aside: they touch no replica) began after, before the fault was
// over: rejoined, or else recovered, or else undone.
func markOverlaps(faults []*Fault) {
	for _, f := range faults {
		over := f.End
		switch {
		case f.WaitingSpare:
			// A spare's restart waits again: nothing more to be over.
		case f.Capacity > 0 && (f.Rejoin < 0 || f.Start.Add(f.Capacity).Before(f.End.Add(f.Rejoin))):
			// The job at full size again (a spare in the target's place,
			// whose restart waits as a spare: its rejoin may be the next
			// fault's).
			if c := f.Start.Add(f.Capacity); c.After(over) {
				over = c
			}
		case f.Rejoin >= 0 && !f.End.IsZero():
			over = f.End.Add(f.Rejoin)
		case f.Recovery >= 0 && f.Start.Add(f.Recovery).After(over):
			over = f.Start.Add(f.Recovery)
		}
		for _, g := range faults {
			if g != f && g.Kind != FaultSettings && !g.Start.Before(f.Start) && !g.Start.After(over) {
				f.Overlapped = true
				break
			}
		}
	}
}

// measureSettings finds where a settings fault's version took effect:
// the first epoch that carried it, the step from which its replicas took
// it, how many did, and how many steps the job committed between
// `ftcoord job set` returning and that step.
func measureSettings(evs []Event, f *Fault) {
	f.SettingsLag, f.SettingsAt, f.SettingsN = -1, 0, 0
	if f.Version == 0 || f.End.IsZero() {
		return
	}
	var epoch uint64
	for _, e := range evs {
		if e.Kind == evSettings && e.Version == f.Version && (epoch == 0 || e.Epoch < epoch) {
			epoch = e.Epoch
		}
	}
	if epoch == 0 {
		return
	}
	for _, e := range evs {
		if e.Kind == evSettings && e.Version == f.Version && e.Epoch == epoch {
			f.SettingsAt = e.From
			f.SettingsN++
		}
	}
	f.SettingsLag = max(f.SettingsAt-1-stepAt(evs, f.End), 0)
}

func buildReport(cfg Config, network string, evs []Event, faults []*Fault, a *analysis, nemesisStart, nemesisEnd time.Time) *Report {
	measure(evs, faults)
	r := &Report{
		Settings: Settings{Replicas: cfg.Replicas, Spares: cfg.Spares, Duration: cfg.Duration.String(), MTBF: cfg.MTBF.String(), Random: cfg.Random,
			Faults: cfg.Faults, Seed: cfg.Seed, Topology: cfg.Topology, Durable: cfg.Durable, Params: cfg.Params,
			StepTime: cfg.StepTime.String(), Timeout: cfg.Timeout.String(), LeaseTTL: cfg.LeaseTTL.String(),
			Margin: cfg.Margin.String(), Hog: cfg.Hog, CPUs: hogs(), Gossip: gossipString(cfg.Gossip), Data: dataString(cfg)},
		Network: network, FaultsByKind: map[FaultKind]int{}, ByKind: map[FaultKind]KindStat{},
		Attempts: a.Attempts, Commits: a.Commits, Lost: a.Lost, FinalStep: a.FinalStep, Rollbacks: a.Rollbacks,
		RolledBackSteps: a.RolledBack, MaxRollback: a.MaxRollback,
		Redone: a.Redone, Forks: a.Forks, ForkDepth: a.ForkDepth, KillErrors: a.KillErrors, Violations: a.Violations, FalseDeaths: a.FalseDeaths,
		OutageRemovals: a.OutageRemovals, Data: a.Data,
		NemesisSeconds: nemesisEnd.Sub(nemesisStart).Seconds(),
	}
	if r.Violations == nil {
		r.Violations = []Violation{}
	}
	if r.FalseDeaths == nil {
		r.FalseDeaths = []Violation{}
	}
	if len(evs) > 0 {
		r.Started = time.Unix(0, evs[0].T)
		r.TotalSeconds = time.Unix(0, evs[len(evs)-1].T).Sub(r.Started).Seconds()
	}
	if a.Attempts > 0 {
		r.Efficiency = float64(a.Commits-a.Lost) / float64(a.Attempts)
	}
	// The fault-free rate: from the nemesis's start to its first fault.
	firstFault := nemesisEnd
	if len(faults) > 0 {
		firstFault = faults[0].Start
	}
	if firstFault.Sub(nemesisStart) > time.Second {
		r.StepRateFaultFree = stepRate(evs, nemesisStart, firstFault)
	}
	r.StepRateNemesis = stepRate(evs, nemesisStart, nemesisEnd)
	epochs := map[uint64]bool{}
	for _, e := range evs {
		switch e.Kind {
		case evHeal:
			r.Heals++
			r.HealedBytes += e.Bytes
		case evQuorum:
			epochs[e.Epoch] = true
		case evPromoted:
			r.Promotions++
		}
	}
	r.Epochs = len(epochs)
	r.faultFigures(faults, cfg.Replicas)
	return r
}

// faultFigures fills in the report's per-fault figures from the measured
// faults (measure).
func (r *Report) faultFigures(faults []*Fault, replicas int) {
	r.Faults, r.FaultErrors, r.SettingsChanges, r.SettingsAllAtOnce = 0, 0, 0, 0
	r.FaultsByKind, r.ByKind = map[FaultKind]int{}, map[FaultKind]KindStat{}
	var det, rec, rej []time.Duration
	var recAlone, rejAlone []time.Duration
	byKind := map[FaultKind][5][]time.Duration{}
	for _, f := range faults {
		r.Faults++
		r.FaultsByKind[f.Kind]++
		if f.Err != "" {
			r.FaultErrors++
		}
		k := byKind[f.Kind]
		if f.Detection >= 0 {
			det = append(det, f.Detection)
			k[0] = append(k[0], f.Detection)
		}
		if f.Recovery >= 0 {
			if f.Kind.replicaFault() {
				rec = append(rec, f.Recovery)
				if !f.Overlapped {
					recAlone = append(recAlone, f.Recovery)
				}
			}
			k[1] = append(k[1], f.Recovery)
			if !f.Overlapped {
				k[3] = append(k[3], f.Recovery)
			}
		}
		if f.Rejoin >= 0 {
			rej = append(rej, f.Rejoin)
			k[2] = append(k[2], f.Rejoin)
			if !f.Overlapped {
				rejAlone = append(rejAlone, f.Rejoin)
				k[4] = append(k[4], f.Rejoin)
			}
		}
		byKind[f.Kind] = k
	}
	r.Detection, r.Recovery, r.Rejoin = percentiles(det), percentiles(rec), percentiles(rej)
	r.KillsInJob, r.KillsWithSpare = 0, 0
	var capBack []time.Duration
	for _, f := range faults {
		if f.Kind != FaultKill || !f.InJob {
			continue // a spare's
		}
		r.KillsInJob++
		if f.ReadySpares > 0 {
			r.KillsWithSpare++
		}
		if f.Capacity > 0 && !f.Overlapped {
			capBack = append(capBack, f.Capacity)
		}
	}
	r.CapacityBack = percentiles(capBack)
	r.RecoveryAlone, r.RejoinAlone = percentiles(recAlone), percentiles(rejAlone)
	var lags []int64
	for _, f := range faults {
		if f.Kind != FaultSettings {
			continue
		}
		r.SettingsChanges++
		if f.SettingsN == replicas {
			r.SettingsAllAtOnce++
		}
		if f.SettingsLag >= 0 {
			lags = append(lags, f.SettingsLag)
		}
	}
	if len(lags) > 0 {
		sort.Slice(lags, func(i, j int) bool { return lags[i] < lags[j] })
		r.SettingsLagP50, r.SettingsLagMax = lags[len(lags)/2], lags[len(lags)-1]
	}
	for kind, k := range byKind {
		r.ByKind[kind] = KindStat{N: r.FaultsByKind[kind], Detection: percentiles(k[0]), Recovery: percentiles(k[1]),
			Rejoin: percentiles(k[2]), RecoveryAlone: percentiles(k[3]), RejoinAlone: percentiles(k[4])}
	}
}

// Passed reports whether the run kept every invariant.
func (r *Report) Passed() bool { return len(r.Violations) == 0 }

// Table is the report for people.
func (r *Report) Table() string {
	var b strings.Builder
	s := r.Settings
	fmt.Fprintf(&b, "chaos run: %d replicas (+%d spares), %s topology, %s network, durable %v, faults every %s (random %v) for %s, seed %d\n",
		s.Replicas, s.Spares, s.Topology, r.Network, s.Durable, s.MTBF, s.Random, s.Duration, s.Seed)
	fmt.Fprintf(&b, "  state %d float32s, step compute %s, op timeout %s, lease %s, gossip %s, %d CPUs, %d CPU hogs, load %s → %s\n",
		s.Params, s.StepTime, s.Timeout, s.LeaseTTL, s.Gossip, s.CPUs, s.Hog, r.LoadStart, r.LoadEnd)
	fmt.Fprintf(&b, "  %d faults in %.0f s (%d not fully injected or undone); %d epochs; final step %d\n",
		r.Faults, r.NemesisSeconds, r.FaultErrors, r.Epochs, r.FinalStep)
	fmt.Fprintf(&b, "  step efficiency %.1f%% (%d commits kept of %d attempts, %d lost); steps/s %.1f fault-free, %.1f under faults\n",
		100*r.Efficiency, r.Commits-r.Lost, r.Attempts, r.Lost, r.StepRateFaultFree, r.StepRateNemesis)
	fmt.Fprintf(&b, "  healed %d times, %.1f MiB; %d rollbacks discarding %d steps (at most %d at once); %d steps redone by a newer epoch\n",
		r.Heals, float64(r.HealedBytes)/(1<<20), r.Rollbacks, r.RolledBackSteps, r.MaxRollback, r.Redone)
	fmt.Fprintf(&b, "  %d epochs committed steps the job had already committed (the deepest %d steps behind its newest)\n", r.Forks, r.ForkDepth)
	fmt.Fprintf(&b, "  false deaths (a replica no fault touched removed by the coordinator): %d; removals during coordinator outages: %d\n",
		len(r.FalseDeaths), r.OutageRemovals)
	for _, v := range r.FalseDeaths {
		fmt.Fprintf(&b, "    %.3fs %s\n", time.Unix(0, v.T).Sub(r.Started).Seconds(), v.Detail)
	}
	if len(r.KillErrors) > 0 {
		var ks []string
		for k, n := range r.KillErrors {
			ks = append(ks, fmt.Sprintf("%s %d", k, n))
		}
		sort.Strings(ks)
		fmt.Fprintf(&b, "  a SIGKILLed peer reached the survivors' ops pending at its death as: %s\n", strings.Join(ks, ", "))
	}
	if s.Spares > 0 {
		c := r.CapacityBack
		fmt.Fprintf(&b, "  spares: %d; %d promotions; %d kills of a replica in the job, %d of them with a spare ready; capacity back (kill → first commit at full size), kills no other fault overlapped: n %d, p50 %.2fs, p99 %.2fs, max %.2fs\n",
			s.Spares, r.Promotions, r.KillsInJob, r.KillsWithSpare, c.N, c.P50, c.P99, c.Max)
	}
	if s.Data != "" {
		d := r.Data
		if d.Checked {
			fmt.Fprintf(&b, "  data (%s): the job's %d steps read %d samples: every sample of %d epochs exactly once, %d of the next with none twice; %d data violations\n",
				s.Data, d.Steps, d.Samples, d.Epochs, d.InProgress, r.violations(invData))
		} else {
			fmt.Fprintf(&b, "  data (%s): the job's history could not be followed (%d data violations)\n", s.Data, r.violations(invData))
		}
	}
	if r.SettingsChanges > 0 {
		fmt.Fprintf(&b, "  settings changes (ftcoord job set): %d; in force at every replica from one step: %d; steps committed after the command returned, before that step: p50 %d, max %d\n",
			r.SettingsChanges, r.SettingsAllAtOnce, r.SettingsLagP50, r.SettingsLagMax)
	}
	b.WriteString("\n")
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "fault\tn\tdetect p50\tp99\tto commit p50\tp99\tmax\trejoin p50\tp99\talone: n\tto commit p99\trejoin p99\t")
	row := func(name string, n int, d, rc, rj, rca, rja Percentiles) {
		cell := func(p Percentiles, v float64) string {
			if p.N == 0 {
				return "–"
			}
			return fmt.Sprintf("%.2fs", v)
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t\n", name, n, cell(d, d.P50), cell(d, d.P99),
			cell(rc, rc.P50), cell(rc, rc.P99), cell(rc, rc.Max), cell(rj, rj.P50), cell(rj, rj.P99),
			max(rca.N, rja.N), cell(rca, rca.P99), cell(rja, rja.P99))
	}
	for _, k := range append(AllFaults[:len(AllFaults):len(AllFaults)], MoreFaults...) {
		if st, ok := r.ByKind[k]; ok {
			row(string(k), st.N, st.Detection, st.Recovery, st.Rejoin, st.RecoveryAlone, st.RejoinAlone)
		}
	}
	row("replica faults", r.Detection.N, r.Detection, r.Recovery, r.Rejoin, r.RecoveryAlone, r.RejoinAlone)
	tw.Flush()
	b.WriteString("  (detect: fault → the coordinator's epoch without the replica; to commit: fault → the first commit of a newer epoch,\n")
	b.WriteString("   for coordinator and slow-link faults the first commit at all; rejoin: fault undone → the replica's first commit;\n")
	b.WriteString("   alone: the faults no other fault began during, until they were over)\n\n")
	var by []string
	for _, inv := range invariants {
		if s.Spares > 0 || (inv != invSpare && inv != invCapacity && inv != invTarget) {
			by = append(by, fmt.Sprintf("%s %d", inv, r.violations(inv)))
		}
	}
	if len(r.Violations) == 0 {
		b.WriteString("invariants: all kept (0 violations)\n")
	} else {
		fmt.Fprintf(&b, "invariants: %d VIOLATIONS\n", len(r.Violations))
		for _, v := range r.Violations {
			fmt.Fprintf(&b, "  %.3fs %s: %s\n", time.Unix(0, v.T).Sub(r.Started).Seconds(), v.Invariant, v.Detail)
		}
	}
	fmt.Fprintf(&b, "  by invariant: %s\n", strings.Join(by, ", "))
	return b.String()
}

// violations counts the violations of invariant inv.
func (r *Report) violations(inv string) int {
	n := 0
	for _, v := range r.Violations {
		if v.Invariant == inv {
			n++
		}
	}
	return n
}

// dataString describes the replicas' dataset.
func dataString(cfg Config) string {
	d := cfg.Data
	if d.Size == 0 {
		return ""
	}
	pol := d.Policy
	if pol == "" {
		pol = ft.KeepReplicaBatch
	}
	return fmt.Sprintf("%d samples, seed %d, batch %d × %d per replica, policy %s", d.Size, d.Seed, d.Batch, max(d.Accum, 1), pol)
}

// write saves report.json, report.txt, faults.json and timeline.png in dir.
func (r *Report) write(dir string, evs []Event, faults []*Fault) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.json"), b, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "report.txt"), []byte(r.Table()), 0o644); err != nil {
		return err
	}
	fb, _ := json.MarshalIndent(faults, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "faults.json"), fb, 0o644); err != nil {
		return err
	}
	return plotTimeline(filepath.Join(dir, "timeline.png"), r, evs, faults)
}

// loadRun reads a run's events.jsonl and faults.json.
func loadRun(dir string) ([]Event, []*Fault, error) {
	b, err := os.ReadFile(filepath.Join(dir, "events.jsonl"))
	if err != nil {
		return nil, nil, err
	}
	var evs []Event
	for _, line := range strings.Split(string(b), "\n") {
		var e Event
		if json.Unmarshal([]byte(line), &e) == nil && e.T != 0 {
			evs = append(evs, e)
		}
	}
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].T < evs[j].T })
	var faults []*Fault
	if b, err := os.ReadFile(filepath.Join(dir, "faults.json")); err == nil {
		if err := json.Unmarshal(b, &faults); err != nil {
			return nil, nil, err
		}
	}
	return evs, faults, nil
}

func gossipString(g GossipTuning) string {
	if g.Probe == 0 {
		return "default (probe 200ms, timeout 100ms, suspicion ×2)"
	}
	return fmt.Sprintf("probe %v, timeout %v, suspicion ×%d", g.Probe, g.ProbeTimeout, g.Suspicion)
}
