package main

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
)

// sim writes made-up histories for the checker: replica processes ("a#1")
// that commit, heal, roll back and fail, with real states computed by the
// workload's own functions.
type sim struct {
	t      *testing.T
	now    int64
	evs    []Event
	state  map[string][]float32
	step   map[string]int64
	faults []*Fault
	index  map[string]int
	// target and bound: checkInput's Target and SpareBound (0: the
	// capacity invariant unchecked).
	target int
	bound  time.Duration
	// data is the replicas' sampler (Size 0: none); pos their positions.
	data ft.SamplerConfig
	pos  map[string]int64
}

const simParams = 8

func newSim(t *testing.T) *sim {
	return &sim{t: t, now: time.Unix(1000, 0).UnixNano(), state: map[string][]float32{}, step: map[string]int64{},
		index: map[string]int{"a": 0, "b": 1, "c": 2, "d": 3, "e": 4},
		data:  ft.SamplerConfig{Size: 13, Seed: 7, Batch: 2}, pos: map[string]int64{}}
}

func (s *sim) tick() int64 { s.now += int64(10 * time.Millisecond); return s.now }

func split(who string) (string, int) {
	var r string
	var l int
	fmt.Sscanf(strings.Replace(who, "#", " ", 1), "%s %d", &r, &l)
	return r, l
}

func (s *sim) add(who string, e Event) {
	e.Replica, e.Launch = split(who)
	e.T = s.tick()
	s.evs = append(s.evs, e)
}

func (s *sim) start(who ...string) {
	for _, w := range who {
		st := make([]float32, simParams)
		initState(st)
		s.state[w], s.step[w], s.pos[w] = st, 0, 0
		s.add(w, Event{Kind: evStart, Hash: stateHash(st), Pos: s.position(w)})
	}
}

// commit has each of who commit its next step in epoch, the step's sum
// taken over the replicas in mask.
func (s *sim) commit(epoch uint64, mask uint32, who ...string) {
	for _, w := range who {
		st := s.state[w]
		prev := stateHash(st)
		step := s.step[w] + 1
		sum := make([]float32, simParams)
		grad := make([]float32, simParams)
		n := 0
		ranks := make([]int, maxReplicas)
		for k := range maxReplicas {
			ranks[k] = -1
			if mask&(1<<k) != 0 {
				ranks[k] = n
				n++
				gradient(grad, step, k)
				for i := range sum {
					sum[i] += grad[i]
				}
			}
		}
		apply(st, sum, n)
		s.step[w] = step
		e := Event{Kind: evCommit, Step: step, Epoch: epoch, Prev: prev, Hash: stateHash(st), Mask: mask, Ranks: ranks, N: n}
		if r, _ := split(w); s.data.Size > 0 {
			e.Data = s.read(step, s.pos[w], n, ranks[s.index[r]])
			s.pos[w] += int64(e.Data.Samples)
			e.Pos = s.position(w)
		}
		s.add(w, e)
	}
}

// read is what the sampler of the replica of rank rank among n reads in
// step from position pos.
func (s *sim) read(step, pos int64, n, rank int) *DataRead {
	p, err := ft.PlanFor(s.data, step, pos, n, n, 1, "", rank, 0)
	if err != nil {
		s.t.Fatalf("step %d rank %d of %d: %v", step, rank, n, err)
	}
	return readOf(p, rank)
}

// position is who's sampler's position, as events record it.
func (s *sim) position(who string) *int64 {
	if s.data.Size == 0 {
		return nil
	}
	p := s.pos[who]
	return &p
}

func (s *sim) heal(epoch uint64, to, from string) {
	copy(s.state[to], s.state[from])
	s.step[to], s.pos[to] = s.step[from], s.pos[from]
	s.add(to, Event{Kind: evHeal, Epoch: epoch, Step: s.step[to], Hash: stateHash(s.state[to]), Pos: s.position(to)})
}

func (s *sim) final(who ...string) {
	for _, w := range who {
		s.add(w, Event{Kind: evFinal, Step: s.step[w], Hash: stateHash(s.state[w]), Pos: s.position(w)})
	}
}

func (s *sim) check(durable, strict bool) *analysis {
	return check(checkInput{Events: s.evs, Faults: s.faults, Durable: durable, Timeout: 5 * time.Second,
		Margin: 2 * time.Second, Linger: 9 * time.Second, Params: simParams, Index: s.index, Final: true, StrictDeaths: strict,
		Target: s.target, SpareBound: s.bound, Data: s.data})
}

// expect asserts the violations' invariants, in order of time.
func expect(t *testing.T, a *analysis, invariants ...string) {
	t.Helper()
	var got []string
	for _, v := range a.Violations {
		got = append(got, v.Invariant)
	}
	if strings.Join(got, ",") != strings.Join(invariants, ",") {
		for _, v := range a.Violations {
			t.Logf("%s: %s", v.Invariant, v.Detail)
		}
		t.Fatalf("violations %v, want %v", got, invariants)
	}
}

func TestCheckCleanRun(t *testing.T) {
	s := newSim(t)
	s.start("a#1", "b#1")
	for range 5 {
		s.commit(1, 0b11, "a#1", "b#1")
	}
	s.final("a#1", "b#1")
	a := s.check(false, false)
	expect(t, a)
	if a.FinalStep != 5 || a.Commits != 10 || a.Lost != 0 {
		t.Fatalf("final step %d, %d commits, %d lost", a.FinalStep, a.Commits, a.Lost)
	}
}

// A minority (a, b) completed step 4's all-reduce of epoch 1 and
// committed it; c and d failed it and committed step 4 again in epoch 2
// without a and b. a and b then learn it (a rollback) when they heal.
func partialCommit(s *sim, tell bool) {
	s.start("a#1", "b#1", "c#1", "d#1")
	for range 3 {
		s.commit(1, 0b1111, "a#1", "b#1", "c#1", "d#1")
	}
	s.commit(1, 0b1111, "a#1", "b#1")
	s.commit(2, 0b1100, "c#1", "d#1")
	for _, w := range []string{"a#1", "b#1"} {
		s.heal(3, w, "c#1")
		if tell {
			s.add(w, Event{Kind: evRollback, Epoch: 3, From: 4, To: 4, Step: 4})
		}
	}
	s.commit(3, 0b1111, "a#1", "b#1", "c#1", "d#1")
	s.final("a#1", "b#1", "c#1", "d#1")
}

func TestCheckRedoneStepToldIsKept(t *testing.T) {
	s := newSim(t)
	partialCommit(s, true)
	a := s.check(false, false)
	expect(t, a)
	if a.Lost != 2 || a.Redone != 1 || a.Rollbacks != 2 || a.Forks != 1 || a.ForkDepth != 1 {
		t.Fatalf("lost %d, redone %d, rollbacks %d, forks %d (depth %d); want 2, 1, 2, 1 (1)", a.Lost, a.Redone, a.Rollbacks, a.Forks, a.ForkDepth)
	}
}

func TestCheckRedoneStepNotToldIsSplitBrain(t *testing.T) {
	s := newSim(t)
	partialCommit(s, false)
	expect(t, s.check(false, false), invSplitBrain, invSplitBrain)
}

// A rollback of steps the job kept: ft served a stale history to a healer
// (the soak found it), which then took steps that every replica had
// committed together in one epoch for another epoch's.
func TestCheckFalseRollback(t *testing.T) {
	s := newSim(t)
	s.start("a#1", "b#1")
	for range 3 {
		s.commit(1, 0b11, "a#1", "b#1")
	}
	s.commit(2, 0b10, "b#1") // a falls behind
	s.heal(3, "a#1", "b#1")
	s.add("a#1", Event{Kind: evRollback, Epoch: 3, From: 2, To: 3, Step: 4})
	s.commit(3, 0b11, "a#1", "b#1")
	s.final("a#1", "b#1")
	expect(t, s.check(false, false), invRollback)
}

// A step redone by another epoch with the same participants reaches the
// same state; ft, which tells epochs apart, rightly rolls it back.
func TestCheckRollbackOfSameStateKept(t *testing.T) {
	s := newSim(t)
	s.start("a#1", "b#1")
	s.commit(1, 0b11, "a#1", "b#1")
	s.commit(1, 0b11, "a#1") // b failed step 2 in epoch 1 …
	s.commit(2, 0b11, "b#1") // … and redid it with a in epoch 2: the same state
	s.heal(3, "a#1", "b#1")
	s.add("a#1", Event{Kind: evRollback, Epoch: 3, From: 2, To: 2, Step: 2})
	s.commit(3, 0b11, "a#1", "b#1")
	s.final("a#1", "b#1")
	expect(t, s.check(false, false))
}

func TestCheckDurableNeverRedoes(t *testing.T) {
	s := newSim(t)
	partialCommit(s, true)
	expect(t, s.check(true, false), invSplitBrain, invSplitBrain, invSplitBrain, invSplitBrain)
}

// A holder of a redone step that died holding it was never told, and
// needed not be.
func TestCheckRedoneByDeadHolder(t *testing.T) {
	s := newSim(t)
	s.start("a#1", "b#1", "c#1")
	s.commit(1, 0b111, "a#1", "b#1", "c#1")
	s.commit(1, 0b111, "a#1") // then a#1 is killed
	s.commit(2, 0b110, "b#1", "c#1")
	s.start("a#2")
	s.heal(3, "a#2", "b#1")
	s.commit(3, 0b111, "a#2", "b#1", "c#1")
	s.final("a#2", "b#1", "c#1")
	a := s.check(false, false)
	expect(t, a)
	if a.Lost != 1 {
		t.Fatalf("lost %d, want 1", a.Lost)
	}
}

func TestCheckEpochDisagreement(t *testing.T) {
	s := newSim(t)
	s.data = ft.SamplerConfig{} // b contributes to no slot: nothing a sampler could plan
	s.start("a#1", "b#1")
	s.commit(1, 0b11, "a#1")
	s.commit(1, 0b01, "b#1") // same step and epoch, other contributors
	expect(t, s.check(false, false), invAgreement, invLiveness)
}

func TestCheckUncommittedState(t *testing.T) {
	s := newSim(t)
	s.start("a#1", "b#1")
	s.commit(1, 0b11, "a#1", "b#1")
	s.state["b#1"][0] += 1 // a torn heal: state nobody committed
	s.add("b#1", Event{Kind: evHeal, Epoch: 2, Step: 1, Hash: stateHash(s.state["b#1"])})
	s.commit(2, 0b11, "a#1")
	s.commit(2, 0b11, "b#1")
	expect(t, s.check(false, false), invAgreement, invUncommit, invLiveness)

	s = newSim(t)
	s.start("a#1")
	s.commit(1, 0b1, "a#1")
	s.state["a#1"][3] = 7 // changed without a commit or heal
	s.commit(1, 0b1, "a#1")
	s.final("a#1")
	expect(t, s.check(false, false), invUncommit, invReplay)
}

func TestCheckMonotonic(t *testing.T) {
	s := newSim(t)
	s.start("a#1")
	s.commit(1, 0b1, "a#1")
	s.commit(1, 0b1, "a#1")
	s.step["a#1"] = 0 // commits step 1 again
	s.commit(1, 0b1, "a#1")
	expect(t, s.check(false, false), invMonotonic, invAgreement, invLiveness)
}

func TestCheckReplayDiffers(t *testing.T) {
	s := newSim(t)
	s.data = ft.SamplerConfig{} // the misreport would contradict the step's cut too (the data invariant's)
	s.start("a#1", "b#1")
	s.commit(1, 0b11, "a#1", "b#1")
	s.commit(1, 0b11, "a#1", "b#1")
	for i := range s.evs { // the commits misreport who took part in step 2
		if s.evs[i].Kind == evCommit && s.evs[i].Step == 2 {
			s.evs[i].Mask, s.evs[i].N = 0b01, 1
		}
	}
	s.final("a#1", "b#1")
	expect(t, s.check(false, false), invReplay)
}

func TestCheckReconfig(t *testing.T) {
	for _, tc := range []struct {
		name string
		hows []string // per rank
		want []string
	}{
		{"all shrink", []string{"shrink", "shrink"}, nil},
		{"all fresh", []string{"fresh", "fresh", "fresh"}, nil},
		{"grow with joiners last", []string{"grow", "grow", "fresh"}, nil},
		{"shrink and fresh", []string{"shrink", "fresh"}, []string{invReconfig}},
		{"joiner before a grower", []string{"grow", "fresh", "grow"}, []string{invReconfig}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSim(t)
			for rank, how := range tc.hows {
				s.add(fmt.Sprintf("%c#1", 'a'+rank), Event{Kind: evReconf, Epoch: 2, How: how, Rank: rank, N: len(tc.hows)})
			}
			a := s.check(false, false)
			var got []string
			for _, v := range a.Violations {
				if v.Invariant == invReconfig {
					got = append(got, v.Invariant)
				}
			}
			if strings.Join(got, ",") != strings.Join(tc.want, ",") {
				t.Fatalf("got %v, want %v (%v)", got, tc.want, a.Violations)
			}
		})
	}
}

func TestCheckErrorKinds(t *testing.T) {
	base := func() *sim {
		s := newSim(t)
		s.start("a#1", "b#1", "c#1")
		s.commit(1, 0b111, "a#1", "b#1", "c#1") // ranks: a 0, b 1, c 2
		return s
	}
	op := func(s *sim, who, kind string, failed []int, dur time.Duration) {
		s.add(who, Event{Kind: evOp, Epoch: 1, ErrKind: kind, Failed: failed, Dur: int64(dur), Err: kind})
	}
	onlyErrKinds := func(a *analysis) []string {
		var out []string
		for _, v := range a.Violations {
			if v.Invariant == invErrKind || v.Invariant == invDeadline {
				out = append(out, v.Invariant)
			}
		}
		return out
	}
	kill := func(s *sim, r string) {
		s.faults = append(s.faults, &Fault{Kind: FaultKill, Targets: []string{r}, Affects: []string{r},
			Start: time.Unix(0, s.now), End: time.Unix(0, s.now+int64(time.Second)), Epoch: 1})
	}
	stop := func(s *sim, r string) {
		s.faults = append(s.faults, &Fault{Kind: FaultStop, Targets: []string{r}, Affects: []string{r}, Silent: true,
			Start: time.Unix(0, s.now), End: time.Unix(0, s.now+int64(3*time.Second)), Epoch: 1})
	}
	const pending = 50 * time.Millisecond // an op that was pending at the kill
	for _, tc := range []struct {
		name string
		run  func(s *sim)
		want int
	}{
		{"the dead peer named", func(s *sim) { kill(s, "c"); op(s, "a#1", "peer-failed", []int{2}, pending) }, 0},
		{"a live peer named", func(s *sim) { kill(s, "c"); op(s, "a#1", "peer-failed", []int{1}, pending) }, 2},
		{"no peer named", func(s *sim) { kill(s, "c"); op(s, "a#1", "peer-failed", nil, pending) }, 2},
		{"a death seen as a revocation", func(s *sim) { kill(s, "c"); op(s, "a#1", "revoked", nil, pending) }, 1},
		{"a revocation after the death", func(s *sim) {
			kill(s, "c")
			s.now += int64(100 * time.Millisecond)
			op(s, "a#1", "revoked", nil, time.Millisecond)
		}, 0},
		{"a revocation", func(s *sim) { op(s, "a#1", "revoked", nil, time.Millisecond) }, 0},
		{"a live peer that closed its comm in order", func(s *sim) { op(s, "a#1", "peer-closed", []int{1}, time.Millisecond) }, 0},
		{"a death seen as an orderly close", func(s *sim) { kill(s, "c"); op(s, "a#1", "peer-closed", []int{2}, pending) }, 1},
		// The soak saw this one: a zombie (a) continued just as c was
		// killed; its op in its old epoch failed at once, blaming a's own
		// stall. That epoch had ended before the death.
		{"a zombie's op in an epoch that ended before the death", func(s *sim) {
			stop(s, "a")
			s.add("", Event{Kind: evQuorum, Epoch: 2, Members: []string{"b.0", "c.0"}, Removed: []string{"a.0"}})
			s.commit(2, 0b110, "b#1", "c#1")
			kill(s, "c")
			op(s, "a#1", "peer-failed", []int{0}, pending)
		}, 0},
		{"a death seen as a revocation, the next epoch just after", func(s *sim) {
			kill(s, "c")
			s.add("", Event{Kind: evQuorum, Epoch: 2, Members: []string{"a.0", "b.0"}, Removed: []string{"c.0"}})
			op(s, "a#1", "revoked", nil, pending)
		}, 1},
		{"a timeout with a stopped peer", func(s *sim) { stop(s, "c"); op(s, "a#1", "timeout", nil, 5*time.Second) }, 0},
		{"a timeout with nobody silent", func(s *sim) { op(s, "a#1", "timeout", nil, 5*time.Second) }, 1},
		{"an unknown kind", func(s *sim) { op(s, "a#1", "unclassified", nil, time.Millisecond) }, 1},
		{"a mismatch", func(s *sim) { op(s, "a#1", "mismatch", nil, time.Millisecond) }, 1},
		{"past the deadline", func(s *sim) { op(s, "a#1", "", nil, 8*time.Second) }, 1},
		{"past the deadline while stopped itself", func(s *sim) {
			s.now += int64(7 * time.Second)
			stop(s, "a")
			s.now += int64(time.Second)
			op(s, "a#1", "", nil, 8*time.Second)
		}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := base()
			tc.run(s)
			if got := onlyErrKinds(s.check(false, false)); len(got) != tc.want {
				t.Fatalf("%d violations %v, want %d", len(got), got, tc.want)
			}
		})
	}
}

func TestCheckFalseDeaths(t *testing.T) {
	s := newSim(t)
	s.start("a#1", "b#1")
	s.commit(1, 0b11, "a#1", "b#1")
	s.add("", Event{Kind: evQuorum, Epoch: 2, Members: []string{"a.0"}, Removed: []string{"b.0"}, Reason: "b.0 died (gossip)"})
	s.commit(2, 0b01, "a#1")
	s.heal(3, "b#1", "a#1")
	s.commit(3, 0b11, "a#1", "b#1")
	s.final("a#1", "b#1")
	if a := s.check(false, false); len(a.FalseDeaths) != 1 || len(a.Violations) != 0 {
		t.Fatalf("false deaths %v, violations %v: want one, none", a.FalseDeaths, a.Violations)
	}
	expect(t, s.check(false, true), invFalseDeath)
	// During an etcd outage it is the outage's doing.
	s.faults = append(s.faults, &Fault{Kind: FaultEtcd, Start: time.Unix(0, s.evs[0].T), End: time.Unix(0, s.evs[4].T)})
	if a := s.check(false, true); len(a.FalseDeaths) != 0 || a.OutageRemovals != 1 || len(a.Violations) != 0 {
		t.Fatalf("false deaths %v, outage removals %d, violations %v", a.FalseDeaths, a.OutageRemovals, a.Violations)
	}
}

func TestCheckZombieFenced(t *testing.T) {
	for _, tc := range []struct {
		name  string
		after int // commits in the old epoch after SIGCONT
		want  []string
	}{{"finishes its step", 1, nil}, {"keeps going", 2, []string{invFencing}}} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSim(t)
			s.start("a#1", "b#1")
			s.commit(1, 0b11, "a#1", "b#1")
			f := &Fault{Kind: FaultStop, Targets: []string{"b"}, Affects: []string{"b"}, Silent: true, Start: time.Unix(0, s.tick())}
			s.faults = append(s.faults, f)
			f.End = time.Unix(0, s.tick())
			for range tc.after {
				s.commit(1, 0b11, "b#1")
			}
			var got []string
			for _, v := range s.check(false, false).Violations {
				if v.Invariant == invFencing {
					got = append(got, v.Invariant)
				}
			}
			if strings.Join(got, ",") != strings.Join(tc.want, ",") {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}

// The replicas of an epoch take its settings version from one step; a
// replica that joins later takes it from its own epoch's first step.
func TestCheckSettings(t *testing.T) {
	s := newSim(t)
	s.start("a#1", "b#1", "c#1")
	s.commit(1, 0b111, "a#1", "b#1", "c#1")
	s.add("a#1", Event{Kind: evSettings, Epoch: 2, Version: 1, From: 2})
	s.add("b#1", Event{Kind: evSettings, Epoch: 2, Version: 1, From: 2})
	s.add("c#1", Event{Kind: evSettings, Epoch: 3, Version: 1, From: 5}) // joined later
	s.commit(2, 0b111, "a#1", "b#1", "c#1")
	s.final("a#1", "b#1", "c#1")
	expect(t, s.check(false, false))
	s.add("b#1", Event{Kind: evSettings, Epoch: 4, Version: 2, From: 9})
	s.add("a#1", Event{Kind: evSettings, Epoch: 4, Version: 2, From: 10})
	expect(t, s.check(false, false), invSettings)
}

// A fault another one began during (before it was over: rejoined, or
// recovered) is marked overlapped; one that ended before the next began,
// and a settings change during a fault, are not.
func TestMarkOverlaps(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	cut := &Fault{Kind: FaultCut, Start: at(0), End: at(20), Recovery: 1500 * time.Millisecond, Rejoin: 900 * time.Millisecond}
	settings := &Fault{Kind: FaultSettings, Start: at(10), End: at(10), Recovery: -1, Rejoin: -1}
	stall := &Fault{Kind: FaultStall, Start: at(20.5), End: at(40), Recovery: time.Second, Rejoin: 100 * time.Millisecond}
	coord := &Fault{Kind: FaultCoordAll, Start: at(40.05), End: at(45), Recovery: 50 * time.Millisecond, Rejoin: -1}
	kill := &Fault{Kind: FaultKill, Start: at(60), End: at(61), Recovery: 100 * time.Millisecond, Rejoin: 300 * time.Millisecond}
	markOverlaps([]*Fault{cut, settings, stall, coord, kill})
	for _, c := range []struct {
		name string
		f    *Fault
		want bool
	}{{"cut (a stall began before it rejoined)", cut, true}, {"settings", settings, false},
		{"stall (every replica down before it rejoined)", stall, true}, {"coord-all", coord, false}, {"kill", kill, false}} {
		if c.f.Overlapped != c.want {
			t.Errorf("%s: overlapped %v", c.name, c.f.Overlapped)
		}
	}
}

// An orderly close (a peer that moved to a newer epoch, or left) is its
// own kind: alive, so the checker attributes no failure to it; a crash is
// ErrPeerFailed alone.
func TestErrKindPeerClosed(t *testing.T) {
	closed := &comm.RankError{Rank: 1, Err: fmt.Errorf("gloo: %w: %w", comm.ErrPeerFailed, comm.ErrPeerClosed)}
	crashed := &comm.RankError{Rank: 1, Err: fmt.Errorf("gloo: %w: connection reset", comm.ErrPeerFailed)}
	if k := errKind(fmt.Errorf("comm: %w: %w", comm.ErrAborted, closed)); k != "peer-closed" {
		t.Errorf("an orderly close: %q", k)
	}
	if k := errKind(crashed); k != "peer-failed" {
		t.Errorf("a crash: %q", k)
	}
}

// spawnSpare starts who as a spare (the harness's spawn, then its start).
func (s *sim) spawnSpare(who string) {
	s.add(who, Event{Kind: evSpawn, Reason: "spare"})
	s.start(who)
}

// quorum publishes an epoch of replicas members ("a" → member "a.0").
func (s *sim) quorum(epoch uint64, members, removed, promoted, replaced []string) {
	ids := func(rs []string) []string {
		var out []string
		for _, r := range rs {
			out = append(out, r+".0")
		}
		return out
	}
	s.add("", Event{Kind: evQuorum, Epoch: epoch, Members: ids(members), Removed: ids(removed), Promoted: ids(promoted),
		Replaced: replaced, Target: s.target})
}

// spareTakesPlace: replicas a, b, c and a spare e; c is killed, the
// survivors commit in epoch 2, e is promoted into epoch 3, heals, and the
// job commits at full size again; late shifts the promotion that many
// seconds after the loss.
func spareTakesPlace(s *sim, late time.Duration) {
	s.target = 3
	s.quorum(1, []string{"a", "b", "c"}, nil, nil, nil)
	s.start("a#1", "b#1", "c#1")
	s.commit(1, 0b111, "a#1", "b#1", "c#1")
	s.spawnSpare("e#1")
	s.commit(1, 0b111, "a#1", "b#1", "c#1")
	s.faults = append(s.faults, &Fault{Kind: FaultKill, Targets: []string{"c"}, Affects: []string{"c"},
		Start: time.Unix(0, s.tick()), End: time.Unix(0, s.now+int64(time.Second)), Epoch: 1})
	s.quorum(2, []string{"a", "b"}, []string{"c"}, nil, nil)
	s.commit(2, 0b011, "a#1", "b#1")
	s.now += int64(late)
	s.quorum(3, []string{"a", "b", "e"}, nil, []string{"e"}, []string{"c"})
	s.add("e#1", Event{Kind: evPromoted, Epoch: 3})
	s.heal(3, "e#1", "a#1")
	s.commit(3, 0b10011, "a#1", "b#1", "e#1")
	s.now += int64(2 * time.Second)
	s.commit(3, 0b10011, "a#1", "b#1", "e#1")
	s.final("a#1", "b#1", "e#1")
}

// A spare promoted into a lost replica's place contributes from its
// promotion's epoch on; the job is at full size again within the bound.
func TestCheckSparePromoted(t *testing.T) {
	s := newSim(t)
	s.bound = time.Second
	spareTakesPlace(s, 0)
	expect(t, s.check(false, false))
}

// A spare contributes to no step before its promotion: neither its own
// commit nor its peers' counting it in an epoch formed while it waited.
func TestCheckSpareContributesBeforePromotion(t *testing.T) {
	s := newSim(t)
	s.quorum(1, []string{"a", "b", "c"}, nil, nil, nil)
	s.start("a#1", "b#1", "c#1")
	s.commit(1, 0b111, "a#1", "b#1", "c#1")
	s.spawnSpare("e#1")
	s.quorum(2, []string{"a", "b", "c", "e"}, nil, nil, nil) // the job grew past its target with the spare
	s.heal(2, "e#1", "a#1")
	s.commit(2, 0b10111, "a#1", "b#1", "c#1", "e#1")
	s.final("a#1", "b#1", "c#1", "e#1")
	a := s.check(false, false)
	expect(t, a, invSpare, invSpare)
	if !strings.Contains(a.Violations[0].Detail, "a#1 committed step 2 of epoch 2 counting spare e#1") ||
		!strings.Contains(a.Violations[1].Detail, "spare e#1 committed step 2 in epoch 2 before its promotion (never promoted)") {
		t.Fatalf("details: %q, %q", a.Violations[0].Detail, a.Violations[1].Detail)
	}

	// Promoted, but it committed in an epoch before its promotion's.
	s = newSim(t)
	spareTakesPlace(s, 0)
	for i, e := range s.evs {
		if e.Kind == evPromoted {
			s.evs[i].Epoch = 4
		}
	}
	expect(t, s.check(false, false), invSpare, invSpare)
}

// A spare promoted into an epoch it never formed (cut off) is promoted
// all the same: removed and back, it joins as the replica it now is, with
// no EventPromoted (the soak of 2026-11-29 saw it), and contributes from
// then on.
func TestCheckSparePromotedWhileCutOff(t *testing.T) {
	s := newSim(t)
	s.target = 3
	s.quorum(1, []string{"a", "b", "c"}, nil, nil, nil)
	s.start("a#1", "b#1", "c#1")
	s.commit(1, 0b111, "a#1", "b#1", "c#1")
	s.spawnSpare("e#1")
	s.quorum(2, []string{"a", "b"}, []string{"c"}, nil, nil)
	s.commit(2, 0b011, "a#1", "b#1")
	s.quorum(3, []string{"a", "b", "e"}, nil, []string{"e"}, []string{"c"}) // e cut off: it never forms epoch 3
	s.quorum(4, []string{"a", "b"}, []string{"e"}, nil, []string{"c"})
	s.commit(4, 0b011, "a#1", "b#1")
	s.quorum(5, []string{"a", "b", "e"}, nil, nil, []string{"c"}) // joined e
	s.heal(5, "e#1", "a#1")
	s.commit(5, 0b10011, "a#1", "b#1", "e#1")
	s.final("a#1", "b#1", "e#1")
	expect(t, s.check(false, false))

	// Its commit before the promotion it missed is still one too early.
	s.evs = slices.DeleteFunc(s.evs, func(e Event) bool { return e.Kind == evQuorum && e.Epoch == 3 })
	s.quorum(6, []string{"a", "b", "e"}, nil, []string{"e"}, []string{"c"})
	expect(t, s.check(false, false), invSpare, invSpare)
}

// With a spare ready, the job at full size again within the bound after a
// loss; late, the capacity invariant reports the loss with the times,
// unless another fault overlaps it or the spare was not ready (a fault
// touched it).
func TestCheckCapacity(t *testing.T) {
	s := newSim(t)
	s.bound = time.Second
	spareTakesPlace(s, 3*time.Second)
	a := s.check(false, false)
	expect(t, a, invCapacity)
	if d := a.Violations[0].Detail; !strings.Contains(d, "epoch 2 removed [c.0], leaving 2 of the target 3 replica groups, while spares [e] were ready") ||
		!strings.Contains(d, "committed with 2 participants at most (want 3; reached: 3.0") {
		t.Fatalf("detail: %s", d)
	}

	s = newSim(t)
	s.bound = time.Second
	spareTakesPlace(s, 3*time.Second)
	s.faults = append(s.faults, &Fault{Kind: FaultCoordAll, Targets: []string{"coord1"}, Start: time.Unix(0, s.evs[0].T), End: time.Unix(0, s.evs[1].T)})
	expect(t, s.check(false, false)) // every coordinator down just before: another fault

	s = newSim(t)
	s.bound = time.Second
	spareTakesPlace(s, 3*time.Second)
	s.faults = append(s.faults, &Fault{Kind: FaultStop, Targets: []string{"e"}, Affects: []string{"e"}, Silent: true,
		Start: s.faults[0].Start.Add(-time.Second), End: s.faults[0].Start})
	s.faults[0], s.faults[1] = s.faults[1], s.faults[0]
	expect(t, s.check(false, false)) // the spare was stopped: not ready (and another fault)

	// Two false deaths (no fault): the second within the first's bound
	// disturbs the job anew; the check starts from it.
	s = newSim(t)
	s.bound = 5 * time.Second
	spareTakesPlace(s, 6*time.Second)
	s.faults = nil
	late := slices.IndexFunc(s.evs, func(e Event) bool { return e.Kind == evQuorum && e.Epoch == 3 })
	second := s.evs[late-1].T + 1
	s.evs = slices.Insert(s.evs, late, Event{T: second, Kind: evQuorum, Epoch: 3, Members: []string{"a.0", "b.0"}, Removed: []string{"b.0"}, Target: 3})
	for i := late + 1; i < len(s.evs); i++ {
		if s.evs[i].Epoch >= 3 {
			s.evs[i].Epoch++
		}
	}
	a = s.check(false, false)
	expect(t, a, invCapacity)
	if d := a.Violations[0].Detail; !strings.Contains(d, "epoch 3 removed [b.0]") {
		t.Fatalf("detail: %s", d)
	}

	// Without a spare the job waits for the dead replica's restart.
	s = newSim(t)
	s.bound = time.Second
	spareTakesPlace(s, 3*time.Second)
	s.evs = slices.DeleteFunc(s.evs, func(e Event) bool { return e.Kind == evSpawn })
	s.evs = slices.DeleteFunc(s.evs, func(e Event) bool { return e.Replica == "e" && e.Kind == evStart })
	if a := s.check(false, false); slices.ContainsFunc(a.Violations, func(v Violation) bool { return v.Invariant == invCapacity }) {
		t.Fatalf("a capacity violation with no spare: %v", a.Violations)
	}
}

// The report's capacity figures: a kill of a replica in the job with a
// spare ready, kill → the first commit at full size again; a kill of a
// waiting spare (the dead replica's restart, waiting in its group's
// place) is none.
func TestMeasureCapacityBack(t *testing.T) {
	s := newSim(t)
	spareTakesPlace(s, 0)
	s.add("c#2", Event{Kind: evSpawn}) // c, replaced, waits as a spare …
	s.start("c#2")
	s.now += int64(time.Second)
	spareKill := &Fault{Kind: FaultKill, Targets: []string{"c"}, Affects: []string{"c"}, Start: time.Unix(0, s.tick()),
		End: time.Unix(0, s.now+int64(time.Second)), Epoch: 3}
	s.faults = append(s.faults, spareKill) // … and is killed: the job loses nothing
	for _, f := range s.faults {
		f.Detection, f.Recovery, f.Rejoin = -1, -1, -1
	}
	measure(s.evs, s.faults)
	kill := s.faults[0]
	if !kill.InJob || kill.ReadySpares != 1 || kill.Capacity <= 0 || kill.Overlapped {
		t.Fatalf("the kill of c: in job %v, ready spares %d, capacity back %v, overlapped %v", kill.InJob, kill.ReadySpares, kill.Capacity, kill.Overlapped)
	}
	if spareKill.InJob || !spareKill.WaitingSpare {
		t.Fatalf("the kill of a waiting spare: in job %v, waiting spare %v", spareKill.InJob, spareKill.WaitingSpare)
	}
	var r Report
	r.faultFigures(s.faults, 3)
	if r.KillsInJob != 1 || r.KillsWithSpare != 1 || r.CapacityBack.N != 1 || r.CapacityBack.Max != kill.Capacity.Seconds() {
		t.Fatalf("kills in the job %d, with a spare %d, capacity back %+v (the kill's %v)", r.KillsInJob, r.KillsWithSpare, r.CapacityBack, kill.Capacity)
	}
}

// Spares refill the job, never grow it: a quorum with more replica
// groups than the target (a spare promoted while a lost replica came back
// as a joiner, say) is a violation.
func TestCheckSparesGrowTheJob(t *testing.T) {
	s := newSim(t)
	spareTakesPlace(s, 0)
	expect(t, s.check(false, false))
	s.quorum(4, []string{"a", "b", "e", "c"}, nil, nil, nil)
	a := s.check(false, false)
	expect(t, a, invTarget)
	if d := a.Violations[0].Detail; !strings.Contains(d, "epoch 4 has 4 replica groups [a.0 b.0 e.0 c.0], above the job's target 3") {
		t.Fatalf("detail: %s", d)
	}
}

// The data invariant: the job's history — through a shrink, a restart
// that heals its position with the state, a grow, steps across epochs'
// ends, and a minority's step that another epoch redid — reads every
// sample of every finished epoch once; the coverage counts the history's
// samples, not the redone step's.
func TestCheckDataCoverage(t *testing.T) {
	s := newSim(t)
	s.start("a#1", "b#1", "c#1")
	for range 5 {
		s.commit(1, 0b111, "a#1", "b#1", "c#1") // 6 samples a step
	}
	for range 4 {
		s.commit(2, 0b011, "a#1", "b#1") // c killed: 4 a step
	}
	s.start("c#2")
	s.heal(3, "c#2", "a#1")
	for range 6 {
		s.commit(3, 0b111, "a#1", "b#1", "c#2")
	}
	s.final("a#1", "b#1", "c#2")
	a := s.check(false, false)
	expect(t, a)
	if want := (DataCoverage{Checked: true, Steps: 15, Samples: 82, Epochs: 6, InProgress: 4}); a.Data != want {
		t.Fatalf("coverage %+v, want %+v", a.Data, want)
	}

	s = newSim(t)
	partialCommit(s, true) // a and b's step 4 is not the job's: c and d's is
	a = s.check(false, false)
	expect(t, a)
	if want := (DataCoverage{Checked: true, Steps: 5, Samples: 3*8 + 4 + 8, Epochs: 2, InProgress: 10}); a.Data != want {
		t.Fatalf("coverage %+v, want %+v", a.Data, want)
	}
	// Not told: the split-brain invariant's violation, not the data's too.
	s = newSim(t)
	partialCommit(s, false)
	expect(t, s.check(false, false), invSplitBrain, invSplitBrain)
}

// invariants lists the violations' invariants.
func dataViolations(a *analysis) []string {
	var out []string
	for _, v := range a.Violations {
		if v.Invariant == invData {
			out = append(out, v.Detail)
		}
	}
	return out
}

// What breaks the data invariant, each seen where it happens: a restart
// whose position did not come with the state (read twice), a position
// that moved without a commit (skipped), a failed step that moved it, a
// replica reading another slot's share or the same slot as another, a
// state loaded at another position than it was committed at.
func TestCheckDataViolations(t *testing.T) {
	// f breaks the run after step 3 of a and b and returns who goes on;
	// they commit steps 4 and 5 in epoch 4.
	run := func(name string, want []string, f func(s *sim) []string) {
		t.Run(name, func(t *testing.T) {
			s := newSim(t)
			s.start("a#1", "b#1")
			for range 3 {
				s.commit(1, 0b11, "a#1", "b#1")
			}
			who := f(s)
			for range 2 {
				s.commit(4, 0b11, who...)
			}
			s.final(who...)
			got := dataViolations(s.check(false, false))
			ok := len(got) == len(want)
			for i := range got {
				ok = ok && strings.Contains(got[i], want[i])
			}
			if !ok {
				t.Fatalf("data violations:\n%s\nwant (containing):\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
			}
		})
	}
	at := func(p int64) *int64 { return &p }
	run("the position not healed", []string{
		"a#2 healed to step 3 (state",
		"epoch 4 committed step 4 as step 4 positions 0..3 (0 of 2 participants, target 2, replica) at a#2 and as step 4 positions 12..15",
		"a#2 ended at position 8; the job's history at 20",
	}, func(s *sim) []string {
		s.start("a#2") // a#1 killed
		s.heal(3, "a#2", "b#1")
		s.pos["a#2"] = 0 // its sampler's position did not come with the state
		s.evs[len(s.evs)-1].Pos = at(0)
		return []string{"a#2", "b#1"}
	})
	run("a position moved without a commit", []string{
		"a#1 committed step 4 reading from position 14, but its sampler held 12",
		"the job's step 4 read step 4 positions 14..17 (0 of 2 participants, target 2, replica); its steps before ended at position 12",
		"b#1 committed step 4 reading from position 14, but its sampler held 12",
	}, func(s *sim) []string {
		s.pos["a#1"] += 2
		s.pos["b#1"] += 2
		return []string{"a#1", "b#1"}
	})
	run("a failed step moved the position", []string{
		"a#1: its sampler holds position 16 after a step that did not commit (4), but 12 before it",
	}, func(s *sim) []string {
		s.add("a#1", Event{Kind: evFail, Epoch: 1, Step: 3, Pos: at(16)})
		s.add("a#1", Event{Kind: evHeal, Epoch: 4, Step: 3, Hash: stateHash(s.state["a#1"]), Pos: at(12)})
		return []string{"a#1", "b#1"}
	})
	run("a state loaded at another position", []string{
		"a#1 healed to step 3 (state",
		"b#1 healed to step 3 (state",
		"the job's step 4 read step 4 positions 4..7",
	}, func(s *sim) []string {
		for _, w := range []string{"a#1", "b#1"} { // both load step 3 with position 4
			s.pos[w] = 4
			s.add(w, Event{Kind: evHeal, Epoch: 4, Step: 3, Hash: stateHash(s.state[w]), Pos: at(4)})
		}
		return []string{"a#1", "b#1"}
	})
	run("another slot's share", []string{
		"the job read sample 9 of epoch 1 twice: at positions 13 and 15 (step 4, slot 1)",
		"b#1 committed step 4 positions 12..15 (1 of 2 participants, target 2, replica) reading [4 9]; the slot's share is [6 0]",
		"the job read sample 4 of epoch 1 twice: at positions 14 and 18 (step 5, slot 1)",
	}, func(s *sim) []string {
		s.commit(4, 0b11, "a#1", "b#1")
		s.evs[len(s.evs)-1].Data.Indices = slices.Clone(s.evs[len(s.evs)-2].Data.Indices)
		return []string{"a#1", "b#1"}
	})
	run("two replicas read one slot", []string{
		"a#1 and b#1 both read slot 0 of step 4 in epoch 4",
	}, func(s *sim) []string {
		s.commit(4, 0b11, "a#1", "b#1")
		s.evs[len(s.evs)-1].Data = s.read(4, 12, 2, 0)
		return []string{"a#1", "b#1"}
	})
}

// A finished epoch that missed a sample says which.
func TestCheckDataEpochSkipped(t *testing.T) {
	s := newSim(t)
	s.start("a#1")
	for range 8 { // 2 samples a step: epoch 0 is positions 0..12
		s.commit(1, 0b1, "a#1")
		if e := &s.evs[len(s.evs)-1]; e.Step == 3 {
			e.Data.Indices[1] = e.Data.Indices[0] // position 5 reads position 4's sample again
		}
	}
	s.final("a#1")
	got := dataViolations(s.check(false, false))
	if len(got) != 3 || !strings.Contains(got[2], "the job's epoch 0 ended with 1 samples never read") {
		t.Fatalf("data violations:\n%s\nwant the slot's, the sample read twice, the sample never read", strings.Join(got, "\n"))
	}
}

// A sampler gone wrong at every step says so in the first violations and
// one more that counts the rest.
func TestCheckDataViolationsCapped(t *testing.T) {
	s := newSim(t)
	s.start("a#1", "b#1")
	for range 30 {
		s.commit(1, 0b11, "a#1", "b#1")
		s.evs[len(s.evs)-1].Data.Indices[0]++
	}
	s.final("a#1", "b#1")
	got := dataViolations(s.check(false, false))
	if len(got) != maxDataViolations+1 || !strings.HasPrefix(got[len(got)-1], "… and ") {
		t.Fatalf("%d data violations, the last %q; want %d, the last counting the rest", len(got), got[len(got)-1], maxDataViolations+1)
	}
}
