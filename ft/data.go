package ft

import (
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/bits"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// The data a job reads follows its quorum: the samples of an epoch are a
// permutation of the dataset (seed, epoch), read from one position that
// every replica holds alike — the samples that committed steps consumed —
// and each step's global batch is the next Samples of them, cut among the
// step's participants by their rank in the FT comm (and among a replica
// group's ranks by group rank). The position is registered state: it
// advances only when Commit returns true, a returning replica heals it
// with the model, and a step that does not commit gives its samples back
// to the next one. So across any sequence of commits, shrinks, grows and
// heals the committed steps read every sample of every epoch exactly once
// (docs/data.md).

// BatchPolicy says what a step's global batch does when the quorum holds
// another number of replica groups than the job's target.
type BatchPolicy string

const (
	// KeepReplicaBatch (the default): every rank takes Accum micro-batches
	// of Batch samples at every step, so the global batch follows the
	// participants; Plan.LRScale says by how much (a training loop scales
	// its learning rate by it: Python's OptimizerWrapper does).
	KeepReplicaBatch BatchPolicy = "replica"
	// KeepGlobalBatch: the step's global batch stays the target's
	// (rounded down to a multiple of the step's ranks, so that they all
	// read as many); the survivors take more micro-batches each
	// (gradient accumulation), at most MaxAccum, beyond which the batch
	// shrinks (LRScale says by how much).
	KeepGlobalBatch BatchPolicy = "global"
)

// ParseBatchPolicy parses "replica" or "global" ("" is the default,
// KeepReplicaBatch).
func ParseBatchPolicy(s string) (BatchPolicy, error) {
	switch BatchPolicy(s) {
	case "", KeepReplicaBatch:
		return KeepReplicaBatch, nil
	case KeepGlobalBatch:
		return KeepGlobalBatch, nil
	}
	return "", fmt.Errorf("%w: ft: batch policy %q: want %q or %q", comm.ErrInvalidArgument, s, KeepReplicaBatch, KeepGlobalBatch)
}

// SamplerConfig says what a Sampler reads. Every replica of the job (and
// every rank of its groups) uses the same values except Name's uniqueness
// within one Comm; a replica that heals from peers whose sampler differs
// gets a *SamplerMismatchError from Plan.
type SamplerConfig struct {
	// Name tells the samplers of one Comm apart (default "data"); the
	// position is registered as "ftcomm.sampler/<Name>".
	Name string
	// Size is the number of samples in the dataset (at least 1).
	Size int64
	// Seed and the epoch make the epoch's permutation.
	Seed uint64
	// Sequential reads every epoch in order 0..Size-1 instead of a
	// permutation.
	Sequential bool
	// Batch is the samples of one micro-batch of one rank (at least 1).
	Batch int
	// Accum is the micro-batches each rank takes per step at the target
	// size (default 1): gradient accumulation, or DiLoCo's inner steps
	// between two syncs.
	Accum int
	// Policy is the global batch's policy (default KeepReplicaBatch). The
	// job setting ftcomm.batch_policy ("replica" or "global", `ftcoord job
	// set`) overrides it from the step it is in force at.
	Policy BatchPolicy
	// MaxAccum bounds KeepGlobalBatch: the most micro-batches a rank takes
	// in one step (default 4 × Accum: a job down to a quarter of its
	// target keeps its global batch).
	MaxAccum int
	// Replicas is the job's size in replica groups that the global batch
	// is made for (default: the quorum's target, membership.Quorum.Target:
	// the most replica groups of the run, or the job setting
	// ftcomm.target_replicas).
	Replicas int
	// Position is where a run restored from a checkpoint resumes: the
	// samples its committed steps consumed (Sampler.Position at the
	// checkpoint). A replica that heals takes its peers' position instead.
	Position int64
}

// Validate checks the configuration.
func (c SamplerConfig) Validate() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("%w: ft: sampler: %s", comm.ErrInvalidArgument, fmt.Sprintf(f, a...))
	}
	if _, err := ParseBatchPolicy(string(c.Policy)); err != nil {
		return err
	}
	switch {
	case c.Size < 1:
		return bad("Size %d: want at least 1 sample", c.Size)
	case c.Batch < 1:
		return bad("Batch %d: want at least 1 sample", c.Batch)
	case c.Accum < 0, c.MaxAccum < 0, c.Replicas < 0:
		return bad("Accum %d, MaxAccum %d, Replicas %d: none may be negative", c.Accum, c.MaxAccum, c.Replicas)
	case c.MaxAccum > 0 && c.MaxAccum < max(c.Accum, 1):
		return bad("MaxAccum %d is below Accum %d", c.MaxAccum, max(c.Accum, 1))
	case c.Position < 0:
		return bad("Position %d is negative", c.Position)
	case len(c.Name) > 200:
		return bad("Name is longer than 200 bytes")
	case int64(c.Batch)*int64(max(c.Accum, c.MaxAccum, 1)) > 1<<31:
		return bad("Batch × Accum (or MaxAccum) is over 2^31 samples per rank")
	}
	return nil
}

func (c SamplerConfig) withDefaults() SamplerConfig {
	if c.Name == "" {
		c.Name = "data"
	}
	if c.Accum == 0 {
		c.Accum = 1
	}
	if c.MaxAccum == 0 {
		c.MaxAccum = 4 * c.Accum
	}
	if c.Policy == "" {
		c.Policy = KeepReplicaBatch
	}
	return c
}

// fingerprint identifies what makes the plans: two samplers with the
// same fingerprint cut every step alike.
func (c SamplerConfig) fingerprint() int64 {
	h := fnv.New64a()
	fmt.Fprintf(h, "ftcomm-sampler-v1 %d %d %t %d %d %s %d %d", c.Size, c.Seed, c.Sequential, c.Batch, c.Accum,
		c.Policy, c.MaxAccum, c.Replicas)
	return int64(h.Sum64() &^ (1 << 63))
}

// SamplerMismatchError: this replica's sampler is not the job's (its
// configuration differs from the peers' it healed from), so its plans
// would read other samples than theirs. errors.Is comm.ErrInvalidArgument.
type SamplerMismatchError struct {
	Name string
}

func (e *SamplerMismatchError) Error() string {
	return fmt.Sprintf("ft: sampler %q: the state healed from the job's replicas was made by a sampler of another "+
		"configuration (Size, Seed, Sequential, Batch, Accum, Policy, MaxAccum, Replicas differ): configure every "+
		"replica alike", e.Name)
}

func (e *SamplerMismatchError) Unwrap() error { return comm.ErrInvalidArgument }

// MicroBatch is one forward and backward pass of a rank.
type MicroBatch struct {
	// Indices are the dataset's samples, in order.
	Indices []int64
	// Weight scales the micro-batch's mean loss so that the step's
	// gradient, averaged over the participants (comm.Avg) and the
	// group's ranks, is the mean over the step's Samples: len(Indices)
	// × participants × group size / Samples (1/Accum when every rank
	// takes Accum full micro-batches).
	Weight float64
}

// Plan is what one rank reads in one step.
type Plan struct {
	// Step is the step it is for: it commits as CommittedStep Step.
	Step int64
	// Position is the job's position at the step's start (the samples
	// committed before it); the step reads positions Position to
	// Position+Samples-1, of epoch position / Size.
	Position int64
	// Epoch is the dataset epoch of the step's first sample.
	Epoch int64
	// Samples is the step's global batch: every rank's micro-batches.
	Samples int
	// First is the position of this rank's first sample: its samples are
	// positions First to First+len(Indices())-1 of the step's (the ranks
	// read the step's positions in rank order), so a reader that records
	// them can check what a step covered without the other ranks'.
	First int64
	// Participants and Target are the step's replica groups and the size
	// the global batch is made for; Policy is the one in force.
	Participants, Target int
	Policy               BatchPolicy
	// LRScale is Samples over the global batch at the target size: a
	// training loop that keeps the learning rate per sample (the linear
	// scaling rule) multiplies its learning rate by it.
	LRScale float64
	// Micro are this rank's micro-batches, in order: every rank of the
	// step takes as many, none empty, of at most Batch samples.
	Micro []MicroBatch
}

// Indices are all of the plan's samples of this rank, in order.
func (p Plan) Indices() []int64 {
	var out []int64
	for _, m := range p.Micro {
		out = append(out, m.Indices...)
	}
	return out
}

// stepShape is what every rank of a step knows alike.
type stepShape struct {
	participants, target, groupSize int
	policy                          BatchPolicy
}

// cut is a step's division: the global batch, how many micro-batches each
// rank takes, and how many samples: every rank slot reads the same count
// (a slot's samples start at slot × perRank), so no rank's micro-batch is
// empty and the ranks' work is even.
type cut struct {
	samples, micro int
	perRank        int
	fullBatch      int // the global batch at the target size
}

// cutStep divides a step (pure: every rank computes the same). Under
// KeepGlobalBatch the global batch is the target's rounded down to a
// multiple of the step's ranks (so that it divides evenly: 3 of 4
// replicas read 30 of 32 samples, LRScale 0.9375), at least one sample
// per rank, at most MaxAccum micro-batches of Batch per rank; each rank
// then takes as few micro-batches as hold its share.
func cutStep(c SamplerConfig, s stepShape) cut {
	ranks := int64(s.participants) * int64(s.groupSize)
	t := int64(max(s.target, 1))
	b := int64(c.Batch)
	full := t * int64(s.groupSize) * int64(c.Accum) * b
	var per int64
	switch s.policy {
	case KeepGlobalBatch:
		per = min(max(full/ranks, 1), int64(c.MaxAccum)*b)
	default:
		per = int64(c.Accum) * b
	}
	return cut{samples: int(per * ranks), micro: int((per + b - 1) / b), perRank: int(per), fullBatch: int(full)}
}

// permutation maps an epoch's positions to the dataset's samples: a
// Feistel network over the smallest even number of bits that holds Size,
// walked until it lands inside (a bijection of 0..Size-1 needing no
// memory: a dataset of 10^10 samples costs nothing to shuffle).
type permutation struct {
	size       int64
	sequential bool
	half       uint
	mask       uint64
	keys       [feistelRounds]uint64
}

const feistelRounds = 6

func newPermutation(size int64, seed uint64, epoch int64, sequential bool) permutation {
	p := permutation{size: size, sequential: sequential}
	b := uint(bits.Len64(uint64(size - 1)))
	b = max(b+b%2, 2)
	p.half = b / 2
	p.mask = 1<<p.half - 1
	k := mix64(seed ^ mix64(uint64(epoch)+0x9e3779b97f4a7c15))
	for i := range p.keys {
		k = mix64(k + uint64(i) + 1)
		p.keys[i] = k
	}
	return p
}

// at returns the sample at position i (0 <= i < size) of the epoch.
func (p *permutation) at(i int64) int64 {
	if p.sequential {
		return i
	}
	x := uint64(i)
	for {
		l, r := x>>p.half, x&p.mask
		for _, k := range p.keys {
			l, r = r, l^(mix64(r^k)&p.mask)
		}
		x = l<<p.half | r
		if x < uint64(p.size) {
			return int64(x)
		}
	}
}

// mix64 is splitmix64's finalizer.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// planner computes plans, caching the permutation of the last epoch read.
type planner struct {
	cfg  SamplerConfig
	perm permutation
	have bool
	at   int64 // perm's epoch
}

func (pl *planner) index(pos int64) int64 {
	e := pos / pl.cfg.Size
	if !pl.have || pl.at != e {
		pl.perm, pl.have, pl.at = newPermutation(pl.cfg.Size, pl.cfg.Seed, e, pl.cfg.Sequential), true, e
	}
	return pl.perm.at(pos % pl.cfg.Size)
}

// plan is the step's plan for rank slot (replica rank × group size +
// group rank), starting at position pos.
func (pl *planner) plan(step, pos int64, s stepShape, replicaRank, groupRank int) Plan {
	x := cutStep(pl.cfg, s)
	n := x.perRank
	off := (replicaRank*s.groupSize + groupRank) * n
	p := Plan{Step: step, Position: pos, Epoch: pos / pl.cfg.Size, Samples: x.samples, First: pos + int64(off),
		Participants: s.participants,
		Target:       max(s.target, 1), Policy: s.policy, LRScale: float64(x.samples) / float64(x.fullBatch)}
	ranks := float64(s.participants * s.groupSize)
	all := make([]int64, n)
	for i := range all {
		all[i] = pl.index(pos + int64(off+i))
	}
	p.Micro = make([]MicroBatch, x.micro)
	for m := range p.Micro {
		// Even cuts of the rank's n samples into k (of Batch each when
		// n is k × Batch).
		lo, hi := m*n/x.micro, (m+1)*n/x.micro
		p.Micro[m] = MicroBatch{Indices: all[lo:hi:hi], Weight: float64(hi-lo) * ranks / float64(x.samples)}
	}
	return p
}

// PlanFor recomputes one rank's plan of a step from what every rank of
// the step knows alike — what its Plan records (Step, Position,
// Participants, Target, Policy) and the group size — for the rank at
// replicaRank among the participants (its FT comm rank) and groupRank in
// its group: the Plan that rank's Sampler returned, configured as cfg. A
// tool that checks a job's data after the fact uses it for the ranks that
// recorded nothing. policy "" is cfg's.
func PlanFor(cfg SamplerConfig, step, position int64, participants, target, groupSize int, policy BatchPolicy,
	replicaRank, groupRank int) (Plan, error) {
	if err := cfg.Validate(); err != nil {
		return Plan{}, err
	}
	cfg = cfg.withDefaults()
	if policy == "" {
		policy = cfg.Policy
	}
	if _, err := ParseBatchPolicy(string(policy)); err != nil {
		return Plan{}, err
	}
	if participants < 1 || target < 1 || groupSize < 1 || position < 0 || replicaRank < 0 || replicaRank >= participants ||
		groupRank < 0 || groupRank >= groupSize {
		return Plan{}, fmt.Errorf("%w: ft: plan of rank %d.%d at position %d: %d participants, target %d, groups of %d",
			comm.ErrInvalidArgument, replicaRank, groupRank, position, participants, target, groupSize)
	}
	pl := planner{cfg: cfg}
	shape := stepShape{participants: participants, target: target, groupSize: groupSize, policy: policy}
	return pl.plan(step, position, shape, replicaRank, groupRank), nil
}

// SettingBatchPolicy is the job setting that overrides
// SamplerConfig.Policy at run time (membership.SettingBatchPolicy).
const SettingBatchPolicy = membership.SettingBatchPolicy

// Sampler is a Comm's quorum-aware reader of a dataset: between Step and
// Commit, Plan says which samples this rank reads in the step. See
// NewSampler.
type Sampler struct {
	c     *Comm
	cfg   SamplerConfig
	fp    int64
	state []int64 // registered: magic, fingerprint, position
	pl    planner

	cur    Plan
	curErr error // why there is no plan (nil: cur is it)
}

const samplerMagic = 0x66746461 // "ftda"

// ErrNoStep: Plan was called with no step started (before Step, after
// Commit, or after a Step that failed).
var ErrNoStep = errors.New("ft: sampler: no step in progress (Plan is valid between Step and Commit)")

// NewSampler makes c's sampler of a dataset and registers its position
// with c, as state a healing replica receives: call it before the first
// Step, on every replica in the same order as the other registrations.
// After each Step, Plan says what this rank reads; the position advances
// when Commit returns true, and a step that does not commit gives its
// samples back. Use it from the training goroutine.
func NewSampler(c *Comm, cfg SamplerConfig) (*Sampler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if c.started.Load() {
		return nil, fmt.Errorf("%w: ft: sampler %q made after the first Step: its position is state a healing replica "+
			"receives, registered before the first Step on every replica", comm.ErrInvalidArgument, cfg.Name)
	}
	cfg = cfg.withDefaults()
	s := &Sampler{c: c, cfg: cfg, fp: cfg.fingerprint(), pl: planner{cfg: cfg}, curErr: ErrNoStep}
	s.state = []int64{samplerMagic, s.fp, cfg.Position}
	if err := c.Register("ftcomm.sampler/"+cfg.Name, comm.Int64s(s.state)); err != nil {
		return nil, err
	}
	c.samplers = append(c.samplers, s)
	return s, nil
}

// Config returns the sampler's configuration, defaults filled in.
func (s *Sampler) Config() SamplerConfig { return s.cfg }

// Position is the job's position as this replica holds it: the samples
// its committed steps consumed since the run began (healed with the
// model).
func (s *Sampler) Position() int64 { return s.state[2] }

// Epoch is the dataset epoch of the next sample.
func (s *Sampler) Epoch() int64 { return s.state[2] / s.cfg.Size }

// Plan returns this rank's samples for the step in progress. It fails with
// ErrNotParticipating while this replica sits the epoch out, ErrNoStep
// outside a step, and a *SamplerMismatchError when the state healed from
// the job's replicas came from a sampler configured otherwise.
func (s *Sampler) Plan() (Plan, error) {
	if s.curErr != nil {
		return Plan{}, s.curErr
	}
	return s.cur, nil
}

// begin computes the plan of a step that started (Comm.Step): rank of
// participants replica groups, with the step's settings and target.
func (s *Sampler) begin(step int64, rank, participants, target int, settings Settings) {
	s.cur, s.curErr = Plan{}, nil
	if s.state[0] != samplerMagic || s.state[1] != s.fp {
		s.curErr = &SamplerMismatchError{Name: s.cfg.Name}
		return
	}
	if rank < 0 || participants < 1 {
		s.curErr = ErrNotParticipating
		return
	}
	policy := s.cfg.Policy
	if v, ok := settings.String(SettingBatchPolicy); ok {
		if p, err := ParseBatchPolicy(v); err == nil {
			policy = p
		}
	}
	if s.cfg.Replicas > 0 {
		target = s.cfg.Replicas
	}
	if target < 1 {
		target = participants
	}
	shape := stepShape{participants: participants, target: target, groupSize: max(s.c.cfg.GroupSize, 1), policy: policy}
	s.cur = s.pl.plan(step, s.state[2], shape, rank, s.c.cfg.GroupRank)
}

// end closes the step: the position moves past its samples if it
// committed.
func (s *Sampler) end(committed bool) {
	if committed && s.curErr == nil && s.cur.Step != 0 && s.state[2] == s.cur.Position {
		if s.state[2] > math.MaxInt64-int64(s.cur.Samples) {
			s.state[2] = math.MaxInt64 // unreachable in practice: 9.2e18 samples
		} else {
			s.state[2] += int64(s.cur.Samples)
		}
	}
	s.cur, s.curErr = Plan{}, ErrNoStep
}
