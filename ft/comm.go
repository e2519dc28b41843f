package ft

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/recovery"
)

// Comm is a training loop's fault-tolerant communicator: per-step quorum,
// reconfiguration, commit and live healing (see the package doc).
//
// Step, Commit, FailStep, Register and the collectives are called by the
// training goroutine, one at a time; Epoch, Participants, Rank,
// CommittedStep, Group, ReportHealth and Close are safe from any goroutine.
//
// A Comm runs one goroutine of its own, the driver, which owns every comm
// it forms and the step protocol's state (the step machine, machine.go):
// it follows the membership's quorums and revocations, watches each comm
// for failure, carries out the machine's actions and answers Step, Commit
// and Close. The training goroutine uses the comms of a step it was
// handed between Step and Commit, and touches nothing else.
type Comm struct {
	*link // to and from the driver
	cfg   Config
	log   *zap.Logger
	id    string
	// d is the driver: only its goroutine touches it (tests look at it
	// once it has ended).
	d       *driver
	busy    atomic.Bool
	started atomic.Bool // the first Step was called: Register is over
	close   sync.Once

	// Owned by the training goroutine.
	state    []registered
	samplers []*Sampler // NewSampler's: told of each step's start and end
	cur      stepComms  // the comms of the step in progress
	works    []*comm.Work
	stepAt   time.Time // when Step returned, until the step's time is reported
}

// snapshot is what readers on other goroutines see (with step).
type snapshot struct {
	epoch        uint64
	rank         int
	participants int
	group        *comm.Comm
	spare        bool
}

// stepComms are the comms a started step uses.
type stepComms struct{ ft, group comms }

// reply answers Step or Commit.
type reply struct {
	err   error
	ok    bool
	comms stepComms
	// target is the step's quorum's target size (membership.Quorum.Target;
	// 0: unknown), for the samplers.
	target int
}

// comms are one dimension's communicators at one epoch: data carries the
// training loop's collectives, ctl ft's own control messages (the step
// agreement, the group's vote). They are one comm when the data backend
// keeps host memory.
type comms struct {
	ctl, data *comm.Comm
}

func (x comms) ok() bool { return x.ctl != nil }

func (x comms) all() []*comm.Comm {
	switch {
	case x.ctl == nil:
		return nil
	case x.data == x.ctl:
		return []*comm.Comm{x.ctl}
	}
	return []*comm.Comm{x.ctl, x.data}
}

// part returns the comm of part p; with one comm for both, the data part
// is it and the control part nil (it was asked for already).
func (x comms) part(p part) *comm.Comm {
	if p == partData {
		return x.data
	}
	if x.ctl == x.data {
		return nil
	}
	return x.ctl
}

func (x comms) close() {
	for _, c := range x.all() {
		c.Close()
	}
}

type registered struct {
	name string
	t    comm.Tensor
}

// New registers this rank with the coordinator (or uses cfg.Membership),
// starts its recovery server and the driver, and returns. The
// registration does not ask to take part: the first Step does, and joins
// a quorum.
func New(ctx context.Context, cfg Config) (*Comm, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	server, err := recovery.NewServer(recovery.ServerConfig{Job: cfg.Job, Secret: cfg.Secret, ListenAddr: cfg.RecoveryAddr, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	if len(server.Addr()) > maxAddrLen {
		server.Close()
		return nil, fmt.Errorf("%w: ft: recovery address %q is longer than %d bytes", comm.ErrInvalidArgument, server.Addr(), maxAddrLen)
	}
	m, own := cfg.Membership, cfg.Membership == nil
	var warm *warmer
	if cfg.Spare {
		warm = startWarmUp(cfg, cfg.Logger)
	}
	var slotted *etcdMember
	if cfg.GroupRank == AnyRank {
		// A slot spare: it waits here for a place, then is that rank.
		var rank int
		if slotted, rank, err = claimSlot(ctx, cfg, server.Addr()); err != nil {
			warm.stop()
			server.Close()
			return nil, err
		}
		cfg.GroupRank, cfg.Spare, m = rank, false, slotted
	}
	id := memberID(cfg.Group, cfg.GroupRank)
	met, err := newMetrics(cfg.Registerer, cfg.Job, id)
	if err != nil {
		if slotted != nil {
			slotted.Leave(context.Background())
			slotted.Close()
		}
		warm.stop()
		server.Close()
		return nil, err
	}
	if cfg.Spare {
		met.spare.Set(1)
	}
	if own && slotted == nil {
		m, err = joinCoordinator(ctx, cfg, id, server.Addr())
		if err != nil {
			met.unregister()
			warm.stop()
			server.Close()
			return nil, err
		}
	}
	bound := bindMember(m)
	if cfg.DurableCommit && !bound.keepsRecords {
		met.unregister()
		warm.stop()
		server.Close()
		m.Close()
		return nil, fmt.Errorf("%w: ft: config: DurableCommit needs a Membership with RecordCommit and LastCommit", comm.ErrInvalidArgument)
	}
	c := &Comm{link: newLink(bound), cfg: cfg, id: id, log: cfg.Logger.With(zap.String("job", cfg.Job), zap.String("member", id))}
	if cfg.Spare {
		c.link.snap.Store(&snapshot{rank: -1, spare: true})
	}
	c.d = newDriver(cfg, c.log, id, c.link, server, met, bound, own)
	c.d.warm = warm
	warm.report(met.warmUp)
	if cfg.SnapshotEvery > 0 {
		if c.d.snaps, err = newSnapshots(cfg, c.log, met); err != nil {
			met.unregister()
			server.Close()
			m.Close()
			return nil, err
		}
	}
	go c.d.run()
	return c, nil
}

// Register names memory that makes up this replica's state: what a healing
// peer receives (and this replica receives when it heals). Host tensors
// always; device tensors when the data backend keeps device memory and can
// copy it to the host (comm.HostCopier; backends/nccl can). Register
// everything before the first Step, in the same order on every replica.
// Between Step and Commit the training loop must not write it; the
// optimizer writes it after a successful Commit.
func (c *Comm) Register(name string, t comm.Tensor) error {
	switch {
	case t.IsZero():
		return fmt.Errorf("%w: ft: register %q: empty tensor", comm.ErrInvalidArgument, name)
	case name == "":
		return fmt.Errorf("%w: ft: register: empty name", comm.ErrInvalidArgument)
	case slices.ContainsFunc(c.state, func(r registered) bool { return r.name == name }):
		return fmt.Errorf("%w: ft: %q registered twice", comm.ErrInvalidArgument, name)
	case c.started.Load():
		return fmt.Errorf("%w: ft: register %q after the first Step", comm.ErrInvalidArgument, name)
	}
	c.state = append(c.state, registered{name, t})
	return nil
}

// ask sends the training loop's input to the driver and returns its reply,
// handing the driver's events to Config.OnEvent while it waits. If ctx
// ends first, the driver is told (cancel) and the reply still awaited:
// the driver answers promptly, once the task it cancelled ended.
func (c *Comm) ask(ctx context.Context, in input, cancel func(error) input) (reply, error) {
	if !c.busy.CompareAndSwap(false, true) {
		return reply{}, fmt.Errorf("%w: ft: Step, Commit, FailStep or Finish called while another is in progress (call them from one goroutine)", comm.ErrInvalidArgument)
	}
	defer c.busy.Store(false)
	defer c.deliver()
	c.deliver()
	for sent := false; !sent; {
		select {
		case c.in <- in:
			sent = true
		case <-ctx.Done():
			return reply{}, fmt.Errorf("ft: %w", context.Cause(ctx))
		case <-c.evWake:
			c.deliver()
		case <-c.done:
			return reply{}, ErrClosed
		}
	}
	var tell chan<- input // the driver, once ctx ended: it cancels the call
	var msg input
	dl := ctx.Done()
	for {
		select {
		case r := <-c.replies:
			return r, nil
		case <-dl:
			dl, tell, msg = nil, c.in, cancel(context.Cause(ctx))
		case tell <- msg:
			tell = nil
		case <-c.evWake:
			c.deliver()
		case <-c.done:
			select {
			case r := <-c.replies:
				return r, nil
			default:
				return reply{}, ErrClosed
			}
		}
	}
}

// deliver hands the events the driver queued to Config.OnEvent, on the
// training goroutine.
func (c *Comm) deliver() {
	if c.cfg.OnEvent == nil {
		return
	}
	for _, e := range c.takeEvents() {
		c.cfg.OnEvent(e)
	}
}

// Step starts a training step: it makes sure this replica takes part in the
// newest quorum with working comms, reconfiguring (shrink, grow or new
// comms) when the participants changed, and heals this replica from its
// peers if it is behind. While the epoch is unchanged and the comms
// healthy it returns at once, with no round trip to the coordinator.
//
// A *RollbackError (errors.Is ErrRolledBack) means the step has started
// as after nil, but this replica's last committed steps were replaced by
// the job's history; see RollbackError.
func (c *Comm) Step(ctx context.Context) error {
	if !c.started.Swap(true) {
		c.askToTakePart(ctx)
	}
	c.works = c.works[:0]
	c.cur = stepComms{}
	c.stepAt = time.Time{}
	for _, s := range c.samplers {
		s.end(false) // a step begun and not committed gives its samples back
	}
	r, err := c.ask(ctx, stepCalled{state: c.state}, func(err error) input { return stepCancelled{err} })
	if err != nil {
		return err
	}
	if r.err == nil || errors.Is(r.err, ErrRolledBack) {
		c.cur = r.comms
		if c.cur.ft.data != nil {
			c.stepAt = time.Now()
		}
		c.beginSamplers(r.target)
	}
	return r.err
}

// beginSamplers gives each sampler the step that started: its rank among
// the step's participants (the FT comm's: what every participant knows
// alike), the quorum's target and the settings in force.
func (c *Comm) beginSamplers(target int) {
	if len(c.samplers) == 0 {
		return
	}
	rank, n := -1, 0
	if d := c.cur.ft.data; d != nil {
		rank, n = d.Rank(), d.Size()
	}
	step, settings := c.CommittedStep()+1, c.Settings()
	for _, s := range c.samplers {
		s.begin(step, rank, n, target, settings)
	}
}

// askToTakePart asks the coordinator to admit this replica, at its first
// Step: until then the job does not count on it, so a replica that builds
// its model after New holds nobody up (a quorum that included it would
// wait for its first Step in the reconfiguration). A request that fails
// to reach etcd is carried by the next heartbeat.
func (c *Comm) askToTakePart(ctx context.Context) {
	if err := c.member().asker.RequestQuorum(ctx, false); err != nil {
		c.log.Warn("asking to take part; the next heartbeat carries the request", zap.Error(err))
	}
}

// stepTime reports this replica's own time on the step, from Step's
// return to its first collective (or Commit): the loop's compute, without
// the waits for its peers. The straggler policy compares it across the
// job (membership.StragglerPolicy).
func (c *Comm) stepTime() {
	if c.stepAt.IsZero() {
		return
	}
	c.member().timer.SetStepTime(time.Since(c.stepAt))
	c.stepAt = time.Time{}
}

// Commit ends the step: it waits for the step's collectives and votes.
// The step commits only if none of them failed, the loop did not fail it
// (FailStep), at least MinReplicas replica groups took part, (with
// GroupSize > 1) every rank of the group voted yes, and (with
// DurableCommit) no other epoch recorded the step first. On true the
// caller applies its optimizer step; on false it must not (the step is
// rolled back), and the next Step moves to a new epoch.
// After MaxCommitFailures failures in a row Commit returns
// ErrTooManyCommitFailures.
func (c *Comm) Commit(ctx context.Context) (bool, error) {
	c.stepTime()
	var errs []error
	for _, w := range c.works {
		if err := w.Wait(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	c.works = c.works[:0]
	r, err := c.ask(ctx, commitCalled{errs: errs}, func(err error) input { return commitCancelled{err} })
	c.cur = stepComms{}
	for _, s := range c.samplers {
		s.end(err == nil && r.ok)
	}
	if err != nil {
		return false, err
	}
	return r.ok, r.err
}

// forward issues an op on the step's FT data comm and remembers its Work
// so Commit can collect its error.
func (c *Comm) forward(issue func(*comm.Comm) *comm.Work) *comm.Work {
	c.stepTime()
	var w *comm.Work
	if d := c.cur.ft.data; d == nil {
		w = comm.FailedWork(ErrNotParticipating)
	} else {
		w = issue(d)
	}
	c.works = append(c.works, w)
	return w
}

// AllReduce reduces t across the participating replicas (Avg divides by
// this step's participants). Its error is recorded for Commit, not raised:
// the training loop may ignore the Work. t is a device tensor on a device
// data backend (a host tensor there fails with comm.ErrInvalidArgument).
func (c *Comm) AllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) *comm.Work {
	return c.forward(func(x *comm.Comm) *comm.Work { return x.AllReduceAsync(ctx, t, op) })
}

// ReduceScatter, AllGather, Broadcast and AllToAll forward likewise.
func (c *Comm) ReduceScatter(ctx context.Context, out, in comm.Tensor, op comm.ReduceOp) *comm.Work {
	return c.forward(func(x *comm.Comm) *comm.Work { return x.ReduceScatterAsync(ctx, out, in, op) })
}

func (c *Comm) AllGather(ctx context.Context, out, in comm.Tensor) *comm.Work {
	return c.forward(func(x *comm.Comm) *comm.Work { return x.AllGatherAsync(ctx, out, in) })
}

func (c *Comm) Broadcast(ctx context.Context, t comm.Tensor, root int) *comm.Work {
	return c.forward(func(x *comm.Comm) *comm.Work { return x.BroadcastAsync(ctx, t, root) })
}

// AllToAll sends block r of in to participant r and receives participant
// r's block into block r of out (ft/diloco averages quantized outer
// gradients with it).
func (c *Comm) AllToAll(ctx context.Context, out, in comm.Tensor) *comm.Work {
	return c.forward(func(x *comm.Comm) *comm.Work { return x.AllToAllAsync(ctx, out, in) })
}

// Refuse fails an op of the step that this replica's caller refused
// before issuing it (checks of its own found an argument invalid: the
// Python API's), as an op whose arguments the FT comm refuses is failed:
// in the op's place on the FT data comm (comm.Comm.Refuse), so that on
// gloo the other replicas' matching op fails at once with
// comm.ErrPeerRefused instead of waiting for its deadline. The failure is
// recorded for Commit, like any op's; Refuse returns it.
func (c *Comm) Refuse(ctx context.Context, op comm.Op, reason error) error {
	return c.forward(func(x *comm.Comm) *comm.Work { return comm.FailedWork(x.Refuse(ctx, op, reason)) }).Err()
}

// FailStep fails the step in progress for a reason the training loop
// found outside ft: a NaN in its loss, an op that failed on a comm of its
// own (an FSDP shard comm), a data loader's error. Call it between Step
// and Commit, on the training goroutine, then Commit as usual: Commit
// returns false, and reason — an error wrapping ErrStepFailed — is the
// step's first error, in the log and the EventCommitFailed (and in the
// ErrTooManyCommitFailures error when it was the last of them).
//
// So that no other replica commits the step either, FailStep tells the
// peers as a failed collective of the step does, with no collective of
// its own: it revokes this replica's FT comms at once (the next Step moves
// to a new epoch; the coordinator forces one when Commit reports the
// failure). A peer's FT op of the step that needs this replica's part
// fails when the revocation reaches it (on gloo within a round trip), and
// so does the peer's commit; with GroupSize > 1 the group's vote carries
// the no to the rest of each group whose rank saw it. This replica's own
// later ops of the step fail at once (comm.ErrRevoked); issuing them is
// harmless. The replica group's comms are not revoked (the group's vote
// says no over them).
//
// What a peer has completed cannot be taken back: a peer whose FT ops of
// the step all completed before the revocation reached it commits the
// step, and this replica heals to it at the next epoch. A peer can only be
// told through a collective, or through the coordinator once Commit has
// reported the failure. An all-reduce, reduce-scatter, all-gather or
// all-to-all needs every participant's part, so call FailStep before
// issuing the one that would carry what is wrong (check the loss before
// the gradient all-reduce): then no replica commits the step.
//
// Outside a started step (before Step or a Step that failed, after
// Commit) FailStep returns an error wrapping comm.ErrInvalidArgument and
// changes nothing; after Close, ErrClosed. Calling it twice in one step
// is harmless.
func (c *Comm) FailStep(reason string) error {
	err := ErrStepFailed
	if reason != "" {
		err = fmt.Errorf("%w: %s", ErrStepFailed, reason)
	}
	// The driver answers at once (no task runs for it): nothing to cancel.
	r, aerr := c.ask(context.Background(), stepFailed{err: err}, func(error) input { return nil })
	if aerr != nil {
		return aerr
	}
	return r.err
}

// Finish ends the run at this replica's committed step: the coordinator
// publishes it as the run's end (membership.Quorum.Final), so that every
// other replica's Step returns a *FinishedError (ErrFinished) rather than
// go on without it or redo a step it will never take again; a replica
// behind the final step first heals to it from the replicas that
// finished. Call it when the training loop is done (every replica of a
// job normally stops at the same step), between Commit and Step, then
// Close. From Finish on, the registered state is served as the run's
// final state: do not write it until Close returns. Close then waits
// (Config.Timeout at most) until no replica is left behind the final
// step to heal from this one.
func (c *Comm) Finish(ctx context.Context) error {
	r, err := c.ask(ctx, finishCalled{}, func(err error) input { return nil })
	if err == nil {
		err = r.err
	}
	if err != nil {
		return fmt.Errorf("ft: finish: %w", err)
	}
	if err := c.member().Finish(ctx, c.CommittedStep()); err != nil {
		return fmt.Errorf("ft: finish: %w", err)
	}
	c.log.Info("finished the run", zap.Int64("step", c.CommittedStep()))
	return nil
}

// Settings are the job's settings in force at a replica: a document the
// operator changes while the job runs (`ftcoord job set`, the
// coordinator's API), in force from step FromStep, the first step of
// Epoch, at every replica of that epoch alike.
type Settings struct {
	membership.JobSettings
	Epoch    uint64
	FromStep int64
}

// Settings returns the job's settings in force for this replica's current
// step (Version 0 and no values before any were set). They change only
// inside Step, at the start of an epoch whose first step every
// participant agreed on, and Config.OnEvent then gets an EventSettings:
// a loop that reads them after Step (its learning rate, its sync period)
// uses the same version at the same step as every other replica. Safe
// from any goroutine.
func (c *Comm) Settings() Settings {
	if s := c.settings.Load(); s != nil {
		return *s
	}
	return Settings{}
}

// ReportHealth tells the coordinator this replica's health. A device monitor
// calls it with membership.Critical on a fatal fault (a GPU XID, say) so the
// replica leaves the quorum before it hangs its peers' collectives; the
// replica sits out until it reports Healthy again. With a GPU data backend
// ft does this itself (Config.DisableHealthWatch). Safe from any goroutine.
func (c *Comm) ReportHealth(ctx context.Context, h membership.Health, reason string) error {
	return reportHealth(ctx, c.member(), c.log, h, reason)
}

// reportHealth tells the coordinator m's health (ReportHealth, and the
// driver's GPU health watch).
func reportHealth(ctx context.Context, m Membership, log *zap.Logger, h membership.Health, reason string) error {
	if err := m.SetHealth(ctx, h, reason); err != nil {
		return fmt.Errorf("ft: report health: %w", err)
	}
	log.Info("reported health", zap.Stringer("health", h), zap.String("reason", reason))
	return nil
}

// Group returns the replica group's data comm (the shard dimension of
// HSDP) of the current epoch, or nil when GroupSize is 1 or the group is
// not formed. Use it between Step and Commit. Ops on it are not recorded
// for Commit; check their errors (a failed one fails the group's vote
// all the same: ft watches the comm).
func (c *Comm) Group() *comm.Comm { return c.snap.Load().group }

// Epoch is the epoch of the current configuration.
func (c *Comm) Epoch() uint64 { return c.snap.Load().epoch }

// Participants is the number of replica groups in the current FT comm
// (0 while sitting out).
func (c *Comm) Participants() int { return c.snap.Load().participants }

// Rank is this replica's rank in the FT comm, -1 while sitting out.
func (c *Comm) Rank() int { return c.snap.Load().rank }

// Spare reports whether this process waits as a spare: it registered as
// one (Config.Spare) and was not promoted yet, or the job replaced its
// group with a promoted spare and it waits for the next vacancy. A spare
// waits in Step for as long as the job needs no one: a liveness check
// must not count that wait as a hang.
func (c *Comm) Spare() bool { return c.snap.Load().spare }

// CommittedStep is the number of steps this replica has committed (or
// healed to).
func (c *Comm) CommittedStep() int64 { return c.step.Load() }

// GroupRank is this process's rank in its replica group: Config.GroupRank,
// or, for a slot spare (AnyRank), the rank whose place it took.
func (c *Comm) GroupRank() int { return c.cfg.GroupRank }

// Close leaves the job, closes the comms and the recovery server, and stops
// the Comm's goroutines. With a device data backend it then waits until
// every comm the Comm formed has stopped its GPU work and released it
// (nccl: ncclCommAbort, in the background since the comm was closed),
// including the comms of earlier epochs it closed on the way, and until
// no state-transfer copy abandoned by a cancelled heal runs on the GPU —
// Config.Timeout at most in all: once Close returns no op of the Comm
// uses device memory, and the caller may free its tensors. An error says
// when that is not so.
// Close may be called from another goroutine than the training loop's: a
// Step or Commit in progress is cancelled and returns ErrClosed, and Close
// returns after the driver closed every comm, those formed while it ran
// included. Safe to call twice (the second call returns nil).
func (c *Comm) Close() error {
	var err error
	first := false
	c.close.Do(func() {
		first = true
		select {
		case c.in <- closeCalled{}:
		case <-c.done:
		}
		<-c.released
		err = c.closeErr
	})
	if !first {
		<-c.released
	}
	return err
}

// leaveTimeout bounds the graceful leave in Close.
const leaveTimeout = 5 * time.Second
