package ft

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// An epoch's permutation is a bijection of 0..Size-1 for every size, and
// differs with the epoch and the seed.
func TestPermutationIsABijection(t *testing.T) {
	check := func(size int64, seed uint64, epoch int64) []int64 {
		t.Helper()
		p := newPermutation(size, seed, epoch, false)
		seen := make([]bool, size)
		out := make([]int64, size)
		for i := range size {
			x := p.at(i)
			if x < 0 || x >= size || seen[x] {
				t.Fatalf("size %d seed %d epoch %d: position %d maps to %d, out of range or seen before", size, seed, epoch, i, x)
			}
			seen[x], out[i] = true, x
		}
		return out
	}
	for size := int64(1); size <= 600; size++ {
		check(size, uint64(size)*31, size%3)
	}
	for _, size := range []int64{1 << 16, 1<<16 + 1, 999_983, 1 << 20} {
		a := check(size, 7, 0)
		b := check(size, 7, 1)
		c := check(size, 8, 0)
		if slices.Equal(a, b) || slices.Equal(a, c) {
			t.Fatalf("size %d: the epochs' or seeds' permutations are equal", size)
		}
		// Not the identity, nor close to it: few fixed points.
		fixed := 0
		for i, x := range a {
			if int64(i) == x {
				fixed++
			}
		}
		if fixed > 20 {
			t.Errorf("size %d: %d fixed points (a shuffle has about 1)", size, fixed)
		}
	}
	// A huge dataset costs no memory: spot-check a few positions.
	p := newPermutation(1e12, 1, 0, false)
	for i := int64(0); i < 1000; i++ {
		if x := p.at(i * 999_999_937); x < 0 || x >= 1e12 {
			t.Fatalf("1e12 samples: %d", x)
		}
	}
	if q := newPermutation(10, 1, 0, true); q.at(3) != 3 {
		t.Fatal("Sequential reads in order")
	}
}

// How a step is cut: the global batch per policy, every rank's share
// (contiguous, the group's ranks splitting their group's), the weights
// and the learning-rate scale.
func TestCutStep(t *testing.T) {
	for _, c := range []struct {
		name          string
		cfg           SamplerConfig
		shape         stepShape
		samples, k    int
		lrScale       float64
		firstRankSize int
	}{
		{"replica at target", SamplerConfig{Batch: 8, Accum: 2}, stepShape{4, 4, 1, KeepReplicaBatch}, 64, 2, 1, 16},
		{"replica below target", SamplerConfig{Batch: 8, Accum: 2}, stepShape{3, 4, 1, KeepReplicaBatch}, 48, 2, 0.75, 16},
		{"replica, groups of 2", SamplerConfig{Batch: 8, Accum: 1}, stepShape{2, 4, 2, KeepReplicaBatch}, 32, 1, 0.5, 8},
		{"global at target", SamplerConfig{Batch: 8, Accum: 1, MaxAccum: 4}, stepShape{4, 4, 1, KeepGlobalBatch}, 32, 1, 1, 8},
		{"global, 3 of 4", SamplerConfig{Batch: 8, Accum: 1, MaxAccum: 4}, stepShape{3, 4, 1, KeepGlobalBatch}, 30, 2, 0.9375, 10},
		{"global past the limit", SamplerConfig{Batch: 8, Accum: 1, MaxAccum: 2}, stepShape{1, 4, 1, KeepGlobalBatch}, 16, 2, 0.5, 16},
		{"global above target", SamplerConfig{Batch: 8, Accum: 1, MaxAccum: 4}, stepShape{6, 4, 1, KeepGlobalBatch}, 30, 1, 0.9375, 5},
		{"global, batch 1, 3 of 4", SamplerConfig{Batch: 1, Accum: 8, MaxAccum: 32}, stepShape{3, 4, 1, KeepGlobalBatch}, 30, 10, 0.9375, 10},
		{"global, more ranks than samples", SamplerConfig{Batch: 1, Accum: 1, MaxAccum: 4}, stepShape{5, 2, 1, KeepGlobalBatch}, 5, 1, 2.5, 1},
		{"global, groups of 2, 1 of 2", SamplerConfig{Batch: 4, Accum: 2, MaxAccum: 8}, stepShape{1, 2, 2, KeepGlobalBatch}, 32, 4, 1, 16},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := c.cfg
			cfg.Size = 1000
			cfg = cfg.withDefaults()
			pl := planner{cfg: cfg}
			x := cutStep(cfg, c.shape)
			if x.samples != c.samples || x.micro != c.k {
				t.Fatalf("cut %+v, want %d samples in %d micro-batches per rank", x, c.samples, c.k)
			}
			var all []int64
			var weights float64
			for r := range c.shape.participants {
				for g := range c.shape.groupSize {
					p := pl.plan(1, 0, c.shape, r, g)
					if r == 0 && g == 0 && len(p.Indices()) != c.firstRankSize {
						t.Errorf("rank 0 reads %d, want %d", len(p.Indices()), c.firstRankSize)
					}
					if len(p.Micro) != c.k || p.Samples != c.samples || p.LRScale != c.lrScale {
						t.Errorf("rank %d.%d: %d micro-batches, %d samples, scale %v", r, g, len(p.Micro), p.Samples, p.LRScale)
					}
					if p.First != int64(len(all)) {
						t.Errorf("rank %d.%d: First %d, after %d samples of the ranks before it", r, g, p.First, len(all))
					}
					for _, m := range p.Micro {
						if len(m.Indices) == 0 {
							t.Errorf("rank %d.%d: an empty micro-batch", r, g)
						}
						if c.shape.policy == KeepReplicaBatch && len(m.Indices) != cfg.Batch {
							t.Errorf("rank %d.%d: a micro-batch of %d, want %d", r, g, len(m.Indices), cfg.Batch)
						}
						if len(m.Indices) > cfg.Batch {
							t.Errorf("rank %d.%d: a micro-batch of %d, over Batch %d", r, g, len(m.Indices), cfg.Batch)
						}
						weights += m.Weight
					}
					all = append(all, p.Indices()...)
				}
			}
			// The ranks in slot order read the step's positions in order.
			for i, x := range all {
				if want := pl.index(int64(i)); x != want {
					t.Fatalf("sample %d of the step is %d, want %d (positions in rank order)", i, x, want)
				}
			}
			if ranks := float64(c.shape.participants * c.shape.groupSize); math.Abs(weights-ranks) > 1e-9 {
				t.Errorf("the weights sum to %v over %v ranks, want one per rank (the mean over the step's samples)", weights, ranks)
			}
		})
	}
}

// A replica whose sampler is configured otherwise than the job's learns
// it when it heals the job's position (its plans would read other
// samples): Plan fails with a *SamplerMismatchError, an invalid argument,
// and the replica reads nothing. Bad configurations are refused at
// NewSampler, registering nothing.
func TestSamplerMismatchIsRefused(t *testing.T) {
	j := newJob(t, quick(), 1)
	j.nParams = 64
	cfg := SamplerConfig{Size: 100, Seed: 5, Batch: 2}
	dl := &dataLedger{}
	a := j.open("a", 0, 1)
	s, err := NewSampler(a.c, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	go a.trainData(ctx, j.ledger, dl, s)
	a.waitStep(3)

	for _, bad := range []SamplerConfig{{Size: 0, Batch: 1}, {Size: 10}, {Size: 10, Batch: 1, Policy: "half"},
		{Size: 10, Batch: 1, Accum: 4, MaxAccum: 2}, {Size: 10, Batch: 1, Position: -1}} {
		b := j.open("x", 0, 1)
		if _, err := NewSampler(b.c, bad); !errors.Is(err, comm.ErrInvalidArgument) || len(b.c.state) != 1 {
			t.Errorf("%+v: %v, registered %d", bad, err, len(b.c.state))
		}
		b.c.Close()
	}

	other := cfg
	other.Seed++
	b := j.open("b", 0, 1)
	sb, err := NewSampler(b.c, other)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewSampler(b.c, other); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("a second sampler of one name: %v", err)
	}
	if err := b.c.Step(context.Background()); err != nil && !errors.Is(err, ErrRolledBack) {
		t.Fatal(err)
	}
	var mm *SamplerMismatchError
	if _, err := sb.Plan(); !errors.As(err, &mm) || !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("the healed replica's plan: %v, want a *SamplerMismatchError", err)
	}
	if _, err := b.c.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Plan(); !errors.Is(err, ErrNoStep) {
		t.Fatalf("after the commit: %v, want ErrNoStep", err)
	}
	if _, err := NewSampler(b.c, SamplerConfig{Name: "late", Size: 10, Batch: 1}); !errors.Is(err, comm.ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "after the first Step") {
		t.Errorf("a sampler made after the first Step: %v", err)
	}
	j.stopAll(a)
	b.c.Close()
}

// policySettings are settings with ftcomm.batch_policy set to p ("": unset).
func policySettings(p BatchPolicy) Settings {
	if p == "" {
		return Settings{}
	}
	return Settings{JobSettings: membership.JobSettings{Values: map[string]membership.Setting{
		SettingBatchPolicy: {Type: membership.SettingString, Value: string(p)}}}}
}

// modelRank is one rank of the property test's job: a real Sampler on a
// Comm that only holds its configuration, and the steps it committed.
type modelRank struct {
	g    *modelGroup
	s    *Sampler
	step int64
	ver  int // the round that committed its newest step (the epoch: ties go to the newest)
	hist []committedSlice
}

// modelGroup is a replica group's ranks.
type modelGroup struct{ ranks []*modelRank }

// committedSlice is what one rank read in a committed step.
type committedSlice struct {
	step     int64
	position int64
	samples  int
	shape    stepShape
	slot     int
	indices  []int64
}

func newModelRank(t *testing.T, cfg SamplerConfig, groupRank, groupSize int) *modelRank {
	t.Helper()
	c := &Comm{cfg: Config{GroupRank: groupRank, GroupSize: groupSize}}
	s, err := NewSampler(c, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.state) != 1 || c.state[0].name != "ftcomm.sampler/data" {
		t.Fatalf("registered %+v", c.state)
	}
	return &modelRank{s: s}
}

// healFrom copies src's registered state and history, as ft's heal does.
func (r *modelRank) healFrom(src *modelRank) {
	copy(r.s.state, src.s.state)
	r.step, r.ver, r.hist = src.step, src.ver, slices.Clone(src.hist)
}

// Property: over random histories of commits, failed steps, commits that
// reach only some ranks, shrinks, grows, deaths, restarts (fresh state)
// and heals (the agreement's rule: the most advanced step, the newest
// epoch on a tie), under both policies switched at run time and a moving
// target, the job's history — what the most advanced replica holds —
// reads the epochs' permutations from position 0 on with no gap: every
// sample of every finished epoch exactly once, and of the epoch in
// progress none twice.
func TestSamplerExactlyOnceProperty(t *testing.T) {
	for seed := uint64(1); seed <= 60; seed++ {
		rng := rand.New(rand.NewPCG(seed, 99))
		groupSize := 1 + rng.IntN(3)
		cfg := SamplerConfig{Size: int64(50 + rng.IntN(400)), Seed: seed, Batch: 1 + rng.IntN(7), Accum: 1 + rng.IntN(3)}
		cfg.MaxAccum = cfg.Accum * (1 + rng.IntN(4))
		newGroup := func() *modelGroup {
			g := &modelGroup{}
			for r := range groupSize {
				m := newModelRank(t, cfg, r, groupSize)
				m.g = g
				g.ranks = append(g.ranks, m)
			}
			return g
		}
		live := []*modelGroup{newGroup(), newGroup(), newGroup(), newGroup()}
		target := 4
		for round := 1; round <= 300; round++ {
			switch x := rng.IntN(20); {
			case x == 0 && len(live) > 1: // a death
				i := rng.IntN(len(live))
				live = slices.Delete(live, i, i+1)
			case x == 1 && len(live) < 6: // a restart or a spare: fresh state
				live = append(live, newGroup())
			case x == 2:
				target = 1 + rng.IntN(6)
			}
			// The quorum: a random subset of the live groups, in a random order.
			parts := slices.Clone(live)
			rng.Shuffle(len(parts), func(i, j int) { parts[i], parts[j] = parts[j], parts[i] })
			parts = parts[:1+rng.IntN(len(parts))]
			// The agreement: everyone heals to the most advanced rank's
			// state (a group's ranks hold one step).
			best := parts[0].ranks[0]
			for _, g := range parts {
				for _, r := range g.ranks {
					if r.step > best.step || (r.step == best.step && r.ver > best.ver) {
						best = r
					}
				}
			}
			for _, g := range parts {
				for gr, r := range g.ranks {
					// Rank gr heals from rank gr of the most advanced group.
					if src := best.g.ranks[gr]; r != src {
						r.healFrom(src)
					}
				}
			}
			policy := [...]BatchPolicy{"", KeepReplicaBatch, KeepGlobalBatch}[rng.IntN(3)]
			settings := policySettings(policy)
			var step int64 = best.step + 1
			var plans [][]Plan
			for rank, g := range parts {
				var ps []Plan
				for _, r := range g.ranks {
					r.s.begin(step, rank, len(parts), target, settings)
					p, err := r.s.Plan()
					if err != nil {
						t.Fatalf("seed %d round %d: %v", seed, round, err)
					}
					ps = append(ps, p)
				}
				plans = append(plans, ps)
			}
			// Every rank of the step read the step's positions, in slot order.
			pos, n := plans[0][0].Position, plans[0][0].Samples
			var all []int64
			for _, ps := range plans {
				for _, p := range ps {
					if p.Position != pos || p.Samples != n {
						t.Fatalf("seed %d round %d: ranks disagree on the step: %d+%d and %d+%d", seed, round, pos, n, p.Position, p.Samples)
					}
					all = append(all, p.Indices()...)
				}
			}
			if len(all) != n {
				t.Fatalf("seed %d round %d: the ranks read %d samples of a step of %d", seed, round, len(all), n)
			}
			// Who commits: everyone, no one, or some (the vote completed
			// at some ranks only; a group's ranks commit alike).
			commits := make([]bool, len(parts))
			switch x := rng.IntN(10); {
			case x < 6:
				for i := range commits {
					commits[i] = true
				}
			case x < 8:
			default:
				for i := range commits {
					commits[i] = rng.IntN(2) == 0
				}
			}
			for i, g := range parts {
				for gr, r := range g.ranks {
					if commits[i] {
						p := plans[i][gr]
						r.hist = append(r.hist, committedSlice{step: step, position: p.Position, samples: p.Samples,
							shape: stepShape{p.Participants, p.Target, groupSize, p.Policy}, slot: i*groupSize + gr,
							indices: p.Indices()})
						r.step, r.ver = step, round
					}
					r.s.end(commits[i])
					if _, err := r.s.Plan(); !errors.Is(err, ErrNoStep) {
						t.Fatalf("after the commit: %v", err)
					}
				}
			}
		}
		// The job's history: the most advanced live group's (each rank's
		// history is its slices; the group's ranks together read the
		// step's share of their group, and the other groups' shares come
		// from their own ranks, which healed alike: recompute them).
		var best *modelRank
		for _, g := range live {
			for _, r := range g.ranks {
				if best == nil || r.step > best.step || (r.step == best.step && r.ver > best.ver) {
					best = r
				}
			}
		}
		checkCoverage(t, fmt.Sprintf("seed %d (groups of %d, %d samples, batch %d×%d)", seed, groupSize, cfg.Size, cfg.Batch, cfg.Accum),
			cfg, best.hist, best.s.Position())
	}
}

// checkCoverage checks a history of committed steps (slices of ranks, in
// step order; one or more per step): steps 1, 2, … with no gap, each starting where the one before ended,
// from 0 to end; each slice is its slot's share of the step; and the
// slots of every step together — recomputed from the step's shape — read
// its positions, so the history covers each finished epoch exactly once
// and the one in progress with no sample twice.
func checkCoverage(t *testing.T, what string, cfg SamplerConfig, hist []committedSlice, end int64) {
	t.Helper()
	cfg = cfg.withDefaults()
	pl := planner{cfg: cfg}
	var pos, last int64
	seen := map[int64]int{}
	for _, h := range hist {
		g := h.shape.groupSize
		if own := pl.plan(h.step, h.position, h.shape, h.slot/g, h.slot%g).Indices(); !slices.Equal(own, h.indices) {
			t.Fatalf("%s: step %d slot %d read %v, its share is %v", what, h.step, h.slot, h.indices, own)
		}
		if h.step == last {
			continue // another rank's slice of the step: its slot's share, checked
		}
		if h.step != last+1 || h.position != pos {
			t.Fatalf("%s: step %d (position %d) follows step %d ending at %d", what, h.step, h.position, last, pos)
		}
		last = h.step
		for slot := range h.shape.participants * g {
			for _, x := range pl.plan(h.step, h.position, h.shape, slot/g, slot%g).Indices() {
				e := pos / cfg.Size
				if want := pl.index(pos); x != want {
					t.Fatalf("%s: step %d slot %d reads %d at position %d, the permutation has %d", what, h.step, slot, x, pos, want)
				}
				seen[e*cfg.Size+x]++
				pos++
			}
		}
		if pos != h.position+int64(h.samples) {
			t.Fatalf("%s: step %d's slots read %d samples, not %d", what, h.step, pos-h.position, h.samples)
		}
	}
	if pos != end {
		t.Fatalf("%s: the history ends at position %d, the sampler holds %d", what, pos, end)
	}
	for k, n := range seen {
		if n != 1 {
			t.Fatalf("%s: sample %d of epoch %d read %d times", what, k%cfg.Size, k/cfg.Size, n)
		}
	}
	if int64(len(seen)) != end {
		t.Fatalf("%s: %d distinct samples in %d positions", what, len(seen), end)
	}
}

// incarnation is what one replica process (or in-process replica) of a
// job committed, in commit order: its slice of each step, less the steps a
// rollback replaced.
type incarnation struct {
	who    string
	killed bool // it died: its last commit may be its own alone
	slices []committedSlice
}

// rollback takes out the steps from..to that the job's history replaced
// (a *RollbackError).
func (in *incarnation) rollback(from, to int64) {
	in.slices = slices.DeleteFunc(in.slices, func(s committedSlice) bool { return from <= s.step && s.step <= to })
}

// jobHistory merges incarnations into the job's history, in step order,
// for checkCoverage. Every incarnation that committed a step agrees on
// it (position, samples, shape), but for a killed one's last step: a
// commit that completed there alone, the others failing the step and
// taking it again without the dead, is not the job's and is left out.
func jobHistory(t *testing.T, what string, incs []*incarnation) []committedSlice {
	t.Helper()
	type version struct {
		position int64
		samples  int
		shape    stepShape
	}
	of := func(s committedSlice) version { return version{s.position, s.samples, s.shape} }
	lastOfDead := func(in *incarnation, i int) bool { return in.killed && i == len(in.slices)-1 }
	job := map[int64]version{}
	for _, in := range incs {
		for i, s := range in.slices {
			if lastOfDead(in, i) {
				continue
			}
			if v, ok := job[s.step]; ok && v != of(s) {
				t.Fatalf("%s: step %d committed as %+v and as %+v (%s)", what, s.step, v, of(s), in.who)
			}
			job[s.step] = of(s)
		}
	}
	var hist []committedSlice
	for _, in := range incs {
		for i, s := range in.slices {
			if v, ok := job[s.step]; ok && v != of(s) && lastOfDead(in, i) {
				t.Logf("%s: %s's last commit, step %d as %+v, completed there alone: the job took the step as %+v",
					what, in.who, s.step, of(s), v)
				continue
			}
			hist = append(hist, s)
		}
	}
	slices.SortStableFunc(hist, func(a, b committedSlice) int { return cmp.Compare(a.step, b.step) })
	return hist
}

// dataLedger keeps what every incarnation of an in-process job read in
// the steps it committed.
type dataLedger struct {
	mu   sync.Mutex
	incs map[string]*incarnation
}

func (l *dataLedger) inc(who string) *incarnation {
	if l.incs == nil {
		l.incs = map[string]*incarnation{}
	}
	if l.incs[who] == nil {
		l.incs[who] = &incarnation{who: who}
	}
	return l.incs[who]
}

func (l *dataLedger) add(who string, s committedSlice) {
	l.mu.Lock()
	defer l.mu.Unlock()
	in := l.inc(who)
	in.slices = append(in.slices, s)
}

func (l *dataLedger) rollback(who string, from, to int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.inc(who).rollback(from, to)
}

func (l *dataLedger) kill(who string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.inc(who).killed = true
}

// history is the job's history (jobHistory).
func (l *dataLedger) history(t *testing.T) []committedSlice {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	return jobHistory(t, "the job", slices.Collect(maps.Values(l.incs)))
}

// trainData is replica.train with a sampler: each step's gradient depends
// on the samples its ranks read, so the ledger's state check also says
// that every replica that committed a step applied the same data.
func (r *replica) trainData(ctx context.Context, l *ledger, dl *dataLedger, s *Sampler) {
	defer close(r.done)
	who := r.incarnation()
	grads := make([]float32, len(r.params))
	for {
		var rb *RollbackError
		if err := r.c.Step(ctx); errors.As(err, &rb) {
			dl.rollback(who, rb.FromStep, rb.ToStep)
		} else if err != nil {
			r.setErr(err)
			return
		}
		p, err := s.Plan()
		if err != nil && !errors.Is(err, ErrNotParticipating) {
			r.setErr(err)
			return
		}
		var sum float32
		for _, x := range p.Indices() {
			sum += float32(x % 97)
		}
		for i := range grads {
			grads[i] = sum * float32(i%5) / 64
		}
		r.c.AllReduce(ctx, comm.Float32s(grads), comm.Sum)
		ok, err := r.c.Commit(ctx)
		if err != nil {
			r.setErr(err)
			return
		}
		if ok {
			for i := range r.params {
				r.params[i] -= 0.001 * grads[i]
			}
			l.commit(r.id, r.c.CommittedStep(), r.params)
			dl.add(who, committedSlice{step: p.Step, position: p.Position, samples: p.Samples,
				shape: stepShape{p.Participants, p.Target, max(r.c.cfg.GroupSize, 1), p.Policy},
				slot:  r.c.Rank()*max(r.c.cfg.GroupSize, 1) + r.c.cfg.GroupRank, indices: p.Indices()})
			r.noteCommit()
		}
	}
}

// incarnation names r apart from a replica of the same id started again.
func (r *replica) incarnation() string { return fmt.Sprintf("%s@%p", r.id, r) }

// A job of real Comms (memcoord, inproc transport) reads its data exactly
// once through a death, a restart that heals the position, a late joiner
// and, under KeepGlobalBatch, steps of fewer replicas with more
// micro-batches each.
func TestSamplerFollowsTheQuorum(t *testing.T) {
	for _, policy := range []BatchPolicy{KeepReplicaBatch, KeepGlobalBatch} {
		t.Run(string(policy), func(t *testing.T) {
			j := newJob(t, quick(), 1)
			j.nParams = 64
			cfg := SamplerConfig{Size: 1000, Seed: 5, Batch: 3, Accum: 2, Policy: policy, Replicas: 3}
			dl := &dataLedger{}
			var samplers = map[*replica]*Sampler{}
			// A killed replica keeps a ledger of its own: its last commit
			// may be its alone, with other data than the job's step (the
			// data ledger's history leaves it out).
			start := func(g string, l *ledger) *replica {
				r := j.open(g, 0, 1)
				s, err := NewSampler(r.c, cfg)
				if err != nil {
					t.Fatal(err)
				}
				samplers[r] = s
				ctx, cancel := context.WithCancel(context.Background())
				r.cancel = cancel
				go r.trainData(ctx, l, dl, s)
				return r
			}
			a, b, c := start("a", j.ledger), start("b", j.ledger), start("c", &ledger{hashes: map[int64]uint64{}})
			a.waitParticipants(3)
			a.waitStep(a.c.CommittedStep() + 10)
			j.kill(c)
			dl.kill(c.incarnation())
			// Its driver lives on in this process: close it before the
			// subtest ends, or its stall warnings outlive the test's log.
			defer c.c.Close()
			a.waitParticipants(2)
			a.waitStep(a.c.CommittedStep() + 10)
			c2 := start("c", j.ledger)
			c2.waitParticipants(3)
			d := start("d", j.ledger) // a fourth: the job above its target
			d.waitParticipants(4)
			a.waitStep(a.c.CommittedStep() + 10)
			j.stopAll(a, b, c2, d)
			if t.Failed() {
				return
			}
			// The ledger holds every step some replica committed: the
			// history ends where the most advanced replica stands (the
			// cancelled loops may stop a step apart).
			best := a
			for _, r := range []*replica{b, c2, d} {
				if r.c.CommittedStep() > best.c.CommittedStep() {
					best = r
				}
			}
			end := samplers[best].Position()
			for _, r := range []*replica{a, b, c2, d} {
				if p := samplers[r].Position(); r.c.CommittedStep() == best.c.CommittedStep() && p != end {
					t.Errorf("%s holds position %d at step %d, %s %d", r.id, p, r.c.CommittedStep(), best.id, end)
				}
			}
			if first := c2.records()[0].step; first <= 1 {
				t.Fatalf("the restarted replica did not heal: first commit %d", first)
			}
			// The steps with 2 participants read 2/3 of a full step's
			// samples under KeepReplicaBatch, all of it under KeepGlobalBatch.
			hist := dl.history(t)
			var two int
			for _, x := range hist {
				if x.shape.participants == 2 {
					two++
					want := 12
					if policy == KeepGlobalBatch {
						want = 18
					}
					if x.samples != want {
						t.Fatalf("a step of 2 of 3 replicas read %d samples, want %d", x.samples, want)
					}
				}
			}
			if two == 0 {
				t.Fatal("no step committed with 2 participants")
			}
			checkCoverage(t, "the job", cfg, hist, end)
			t.Logf("%s: %d steps, position %d (epoch %d)", policy, best.c.CommittedStep(), end, samplers[best].Epoch())
		})
	}
}

// BenchmarkSamplerPlan is what a rank's plan costs at each Step: 4
// replicas × 4 micro-batches × 256 samples, this rank's quarter (1024
// samples) per op, the position moving on by the step's 4096 samples
// (across epochs of 10^7 samples). ns/sample is the figure to hold under
// 1 µs.
func BenchmarkSamplerPlan(b *testing.B) {
	for _, sequential := range []bool{false, true} {
		name := "shuffled"
		if sequential {
			name = "sequential"
		}
		b.Run(name, func(b *testing.B) {
			const ranks = 4
			c := &Comm{cfg: Config{GroupSize: 1}}
			s, err := NewSampler(c, SamplerConfig{Size: 10_000_000, Seed: 1, Sequential: sequential, Batch: 256, Accum: 4})
			if err != nil {
				b.Fatal(err)
			}
			var perRank int
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				s.begin(int64(i+1), i%ranks, ranks, ranks, Settings{})
				p, err := s.Plan()
				if err != nil {
					b.Fatal(err)
				}
				perRank = len(p.Micro) * len(p.Micro[0].Indices)
				s.end(true)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(perRank), "ns/sample")
		})
	}
}
