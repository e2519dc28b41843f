package diloco

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
)

// Comm is what DiLoCo needs of its fault-tolerant communicator; *ft.Comm
// provides it.
type Comm interface {
	// Register names state a healing replica receives (before the first Step).
	Register(name string, t comm.Tensor) error
	// Step starts an ft step: quorum, reconfiguration, healing. An error
	// wrapping ft.ErrRolledBack means it healed over steps this replica
	// had committed and started the step as nil would.
	Step(ctx context.Context) error
	// AllReduce and AllGather issue collectives whose errors Commit collects.
	AllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) *comm.Work
	AllGather(ctx context.Context, out, in comm.Tensor) *comm.Work
	// Commit ends the step: true if every replica's collectives succeeded.
	Commit(ctx context.Context) (bool, error)
	// CommittedStep, Epoch, Participants and Rank describe the current step.
	CommittedStep() int64
	Epoch() uint64
	Participants() int
	Rank() int
}

// AllToAller is a Comm that also offers an all-to-all. With it, quantized
// outer gradients are averaged reduce-scatter style (all-to-all of
// quantized chunks, then an all-gather of the quantized chunk averages),
// sending 2(n−1)/n payloads per sync instead of the all-gather's n−1.
type AllToAller interface {
	AllToAll(ctx context.Context, out, in comm.Tensor) *comm.Work
}

// DiLoCo runs the outer loop of (Streaming) DiLoCo around a training loop's
// inner optimizer, over a fault-tolerant Comm. See the package doc.
type DiLoCo struct {
	c     Comm
	cfg   Config
	log   *zap.Logger
	outer Nesterov
	sched Schedule
	how   method

	local    []float32 // the caller's parameters, updated by its inner optimizer
	global   []float32 // registered: the job's parameters as of the committed step
	momentum []float32 // registered: the outer optimizer's momentum
	frags    []span
	ef1      [][]float32 // per fragment: this replica's quantization residual
	ef2      [][]float32 // per fragment: the residual of the chunk average this replica quantizes (all-to-all)
	ef2Of    []ownerKey  // per fragment: which chunk ef2 belongs to
	delta    []float32   // scratch: global − local of the fragment being sent

	done   int      // inner steps since New
	sync   *pending // the sync in flight, or nil
	base   int64    // committed step at the latest sync start
	baseAt int      // done at the latest sync start
	// The job's inner step at committed step baseOff: the period changed
	// there (Retune), so InnerStep counts from it.
	innerOff, baseOff int64
	x                 exchange
	stats             Stats
}

type ownerKey struct{ rank, size int }

// pending is a sync between its start and its finish.
type pending struct {
	frag       int
	startedAt  int // d.done at the start
	healed     bool
	rolledBack bool
	weight     float32
	t0         time.Time
	blocked    time.Duration
	epoch      uint64
	parts      int
}

// Outcome describes a sync that finished during a Tick.
type Outcome struct {
	Synced       bool  // false: no sync finished in this Tick (the rest is zero)
	Fragment     int   // which fragment was exchanged
	Committed    bool  // the step committed and the outer update was applied
	Healed       bool  // this replica healed at the sync's start: its parameters were reset to the global ones
	RolledBack   bool  // the heal replaced steps this replica had committed (ft.RollbackError): rewind what you keep outside (data position)
	Step         int64 // the committed step after the sync
	Epoch        uint64
	Participants int     // replicas in the exchange
	Contributors float32 // total weight: replicas that had progress to add
	// Payload is the bytes this replica handed to the collectives; Wire the
	// bytes it sent on the wire (see BytesSent in the package doc).
	Payload, Wire int64
	// Blocked is how long the training loop waited on this sync (Step,
	// the exchange's unfinished part, Commit); Elapsed is start to finish,
	// the overlapped inner steps included.
	Blocked, Elapsed time.Duration
	Method           string
}

// Stats accumulates over the syncs of a DiLoCo.
type Stats struct {
	Syncs, Committed, Failed, Heals int64
	Payload, Wire                   int64
	PeakPayload                     int64 // the largest payload of one sync
	Blocked                         time.Duration
}

// New starts DiLoCo on params, the caller's model parameters (which its
// inner optimizer updates in place). Every replica must pass the same
// initial values. New copies them as the first global parameters and
// registers the global parameters and the outer momentum with c as
// cfg.Name+"/global" and cfg.Name+"/momentum", so call it before c's
// first Step.
func New(c Comm, params []float32, cfg Config) (*DiLoCo, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if len(params) < cfg.Fragments {
		return nil, fmt.Errorf("%w: diloco: %d parameters cannot make %d fragments", comm.ErrInvalidArgument, len(params), cfg.Fragments)
	}
	d := &DiLoCo{
		c: c, cfg: cfg, log: cfg.Logger,
		outer:    Nesterov{LR: float32(cfg.OuterLR), Momentum: float32(cfg.OuterMomentum)},
		sched:    Schedule{Every: cfg.Every(), Overlap: cfg.Overlap},
		local:    params,
		global:   append([]float32(nil), params...),
		momentum: make([]float32, len(params)),
		frags:    split(len(params), cfg.Fragments, cfg.QuantBlock),
		ef1:      make([][]float32, cfg.Fragments),
		ef2:      make([][]float32, cfg.Fragments),
		ef2Of:    make([]ownerKey, cfg.Fragments),
	}
	d.x.q, d.x.block = cfg.Quantization, cfg.QuantBlock
	switch _, a2a := c.(AllToAller); {
	case cfg.Quantization == Float32:
		d.how = viaAllReduce
	case a2a:
		d.how = viaAllToAll
	default:
		d.how = viaAllGather
	}
	if err := c.Register(cfg.Name+"/global", comm.Float32s(d.global)); err != nil {
		return nil, err
	}
	if err := c.Register(cfg.Name+"/momentum", comm.Float32s(d.momentum)); err != nil {
		return nil, err
	}
	return d, nil
}

// Tick is called by the training loop before each inner step. When a
// sync is due it starts one (ft Step, healing included, then the
// fragment's exchange) or finishes the one in flight (wait, Commit, outer
// update, mixing); otherwise it only moves a two-phase exchange along. It
// returns what a finished sync did. Errors are those of Step and Commit
// that end training (ctx, ft.ErrTooManyCommitFailures, a closed comm);
// a failed sync is an Outcome with Committed false, and training goes on.
func (d *DiLoCo) Tick(ctx context.Context) (Outcome, error) {
	var out Outcome
	var err error
	if d.sync != nil && d.sched.FinishesAt(d.sync.startedAt, d.done) {
		if out, err = d.finish(ctx); err != nil {
			return out, err
		}
	}
	if d.sync == nil && d.sched.StartsAt(d.done) {
		if err = d.start(ctx); err != nil {
			return out, err
		}
		if d.sched.Overlap == 0 {
			if out, err = d.finish(ctx); err != nil {
				return out, err
			}
		}
	} else if d.sync != nil {
		d.x.poll(ctx, d.c)
	}
	d.done++
	return out, nil
}

// Flush finishes the sync in flight, if any, without further inner steps.
func (d *DiLoCo) Flush(ctx context.Context) (Outcome, error) {
	if d.sync == nil {
		return Outcome{}, nil
	}
	return d.finish(ctx)
}

func (d *DiLoCo) start(ctx context.Context) error {
	t0 := time.Now()
	before := d.c.CommittedStep()
	err := d.c.Step(ctx)
	// A rollback (this replica's last commits are not the job's history)
	// has healed the registered state and started the step like nil does.
	rolledBack := errors.Is(err, ft.ErrRolledBack)
	if err != nil && !rolledBack {
		return fmt.Errorf("diloco: %w", err)
	}
	step := d.c.CommittedStep()
	p := &pending{startedAt: d.done, t0: t0, weight: 1, epoch: d.c.Epoch(), parts: d.c.Participants(), rolledBack: rolledBack}
	if step != before || rolledBack {
		// Healed: the registered global parameters and momentum are the
		// job's as of step; local progress and residuals belong to a
		// history that did not commit.
		p.healed = true
		copy(d.local, d.global)
		for f := range d.ef1 {
			d.ef1[f], d.ef2[f] = nil, nil
		}
		d.stats.Heals++
		d.log.Info("healed: local parameters reset to the committed global ones", zap.Int64("from_step", before), zap.Int64("to_step", step))
	}
	if p.healed || d.done == 0 {
		p.weight = 0 // nothing to add: the others' average must not be diluted
	}
	p.frag = Fragment(step, len(d.frags))
	d.base, d.baseAt = step, d.done
	s := d.frags[p.frag]
	var ef2 []float32
	if d.how == viaAllToAll && d.ef2Of[p.frag] == (ownerKey{d.c.Rank(), d.c.Participants()}) {
		ef2 = d.ef2[p.frag]
	}
	d.x.begin(ctx, d.c, d.how, d.global[s.lo:s.hi], d.local[s.lo:s.hi], p.weight, d.ef1[p.frag], ef2)
	p.blocked = time.Since(t0)
	d.sync = p
	return nil
}

func (d *DiLoCo) finish(ctx context.Context) (Outcome, error) {
	p := d.sync
	d.sync = nil
	t0 := time.Now()
	exchanged := d.x.finish(ctx, d.c)
	ok, err := d.c.Commit(ctx)
	now := time.Now()
	p.blocked += now.Sub(t0)
	out := Outcome{Synced: true, Fragment: p.frag, Committed: ok && exchanged, Healed: p.healed, RolledBack: p.rolledBack,
		Step: d.c.CommittedStep(), Epoch: p.epoch, Participants: d.x.size, Contributors: d.x.wsum,
		Payload: d.x.payload, Wire: d.x.wire, Blocked: p.blocked, Elapsed: now.Sub(p.t0), Method: d.how.String()}
	d.stats.Syncs++
	d.stats.Payload += out.Payload
	d.stats.Wire += out.Wire
	d.stats.PeakPayload = max(d.stats.PeakPayload, out.Payload)
	d.stats.Blocked += p.blocked
	if ok && !exchanged {
		// Cannot happen with ft.Comm (a failed collective fails the
		// commit); never apply an average that did not arrive.
		d.log.Error("commit succeeded without the exchange's result; outer update skipped", zap.Int("fragment", p.frag))
	}
	if !out.Committed {
		d.stats.Failed++
		if err != nil {
			return out, fmt.Errorf("diloco: %w", err)
		}
		d.log.Info("sync did not commit; its outer update is discarded", zap.Int("fragment", p.frag), zap.Int64("step", out.Step))
		return out, nil
	}
	d.stats.Committed++
	s := d.frags[p.frag]
	if d.x.wsum > 0 {
		d.outer.outerStep(d.global[s.lo:s.hi], d.momentum[s.lo:s.hi], d.local[s.lo:s.hi], d.x.avg, d.x.scale, float32(d.cfg.Alpha))
		if d.how != viaAllReduce {
			d.ef1[p.frag] = append(d.ef1[p.frag][:0], d.x.res1...)
		}
		if d.how == viaAllToAll {
			d.ef2[p.frag] = append(d.ef2[p.frag][:0], d.x.res2...)
			d.ef2Of[p.frag] = ownerKey{d.x.rank, d.x.size}
		}
	} else {
		Mix(d.local[s.lo:s.hi], d.global[s.lo:s.hi], float32(d.cfg.Alpha))
	}
	return out, err
}

// InnerStep is the job's inner step as this replica counts it: H/F per
// committed step at the latest sync's start, plus the inner steps since.
// A replica that healed jumps to the job's count, so a learning-rate
// schedule driven by it stays in line with the others.
func (d *DiLoCo) InnerStep() int64 {
	return d.innerOff + (d.base-d.baseOff)*int64(d.sched.Every) + int64(d.done-d.baseAt)
}

// Retune changes the outer learning rate and the sync period H (inner
// steps between two syncs of the same parameter) while training: the
// outer learning rate from the next outer update, H from the sync that
// started last (the next one starts H/F inner steps after it). 0 keeps a
// value. Replicas that retune at the same sync keep syncing together: a
// training loop that follows the job's settings (ft.Comm.Settings, which
// every replica of an epoch takes from the same step) retunes right after
// the Tick whose sync brought a new version. A replica that joins after a
// change counts InnerStep from its own first sync with the new H.
func (d *DiLoCo) Retune(outerLR float64, innerSteps int) error {
	cfg := d.cfg
	if outerLR > 0 {
		cfg.OuterLR = outerLR
	}
	if innerSteps > 0 {
		cfg.InnerSteps = innerSteps
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	if every := cfg.Every(); every != d.sched.Every {
		d.innerOff += (d.base - d.baseOff) * int64(d.sched.Every)
		d.baseOff = d.base
		d.sched.Every, d.sched.From = every, d.baseAt
	}
	d.cfg = cfg
	d.outer.LR = float32(cfg.OuterLR)
	return nil
}

// Global is the job's parameters as of the last committed sync (every
// replica holds the same). Read it between Ticks; do not write it.
func (d *DiLoCo) Global() []float32 { return d.global }

// Momentum is the outer optimizer's momentum, like Global.
func (d *DiLoCo) Momentum() []float32 { return d.momentum }

// Stats returns the totals so far.
func (d *DiLoCo) Stats() Stats { return d.stats }

// Method names how outer gradients are averaged: "all-reduce" (float32),
// "all-gather" or "all-to-all+all-gather" (quantized).
func (d *DiLoCo) Method() string { return d.how.String() }

// Fragments returns the fragments' bounds: fragment f is params[b[f]:b[f+1]].
func (d *DiLoCo) Fragments() []int {
	b := make([]int, 0, len(d.frags)+1)
	for _, s := range d.frags {
		b = append(b, s.lo)
	}
	return append(b, len(d.local))
}
