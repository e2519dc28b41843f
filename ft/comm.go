package ft

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/recovery"
)

// Comm is a training loop's fault-tolerant communicator: per-step quorum,
// reconfiguration, commit and live healing (see the package doc).
//
// Step, Commit, Register and the collectives are called by the training
// goroutine, one at a time; Epoch, Participants, Rank, CommittedStep, Group,
// ReportHealth and Close are safe from any goroutine. Comm runs one
// goroutine of its own, which follows the membership's quorums and
// revocations, and exits in Close (plus a GPU health watcher with device
// backends, also stopped by Close).
type Comm struct {
	cfg     Config
	log     *zap.Logger
	server  *recovery.Server
	metrics *metrics
	id      string

	mu      sync.Mutex
	m       Membership
	own     bool               // m was made from Config.Coordinator, so ft may re-register
	lost    error              // the membership ended for good
	revoked uint64             // newest epoch whose revocation record was acted on
	latest  *membership.Quorum // newest quorum seen
	changed chan struct{}      // closed and replaced when latest changes
	epoch   uint64             // the epoch of the current configuration
	// view is the configuration whose comms this rank holds: the quorum's
	// view once its comms formed, or one with no FT comm (ftRank -1) while
	// they form, after a formation failed, or while sitting out.
	view     view
	ft       comms // the fault-tolerant (replicate) dimension; zero while sitting out
	group    comms // the replica group (shard dimension); zero when GroupSize is 1
	cancelEp func(error)
	pendEp   uint64
	// applying is closed when the reconfiguration in flight (apply) ends;
	// nil when none is. Close cancels it and waits, so that no comm formed
	// after Close is left open.
	applying chan struct{}
	closed   bool
	stepNow  int64 // mirror of step for readers on other goroutines
	// midStep is true from a Step that returned until its Commit ended:
	// the training loop may have device ops in flight on the epoch's comms.
	midStep bool
	// stopping counts stopStale calls decided but not yet done; stopsDone
	// is closed when it drops to 0. A reconfiguration waits for them, so
	// a stop never lands on a comm that is being shrunk or grown.
	stopping  int
	stopsDone chan struct{}

	// Owned by the training goroutine.
	step          int64
	hist          history
	histBytes     []byte // hist encoded for healers; nil when it changed
	state         []registered
	blobs         []recovery.Blob // built at the first formation, when the data memory is known
	split         bool            // data and control run on different backends
	splitKnown    bool
	copier        comm.HostCopier
	staging       *stagingPool
	works         []*comm.Work
	errs          []error // this step's failures on the FT comms
	groupErrs     []error // and on the group's
	failedCommits int
	failedAt      time.Time // first failure since the last commit
	healed        recovery.Progress
	stepStarted   time.Time
	waitingFor    uint64 // durable mode: a committed step no participant holds (log once)
	fatal         error  // Step returns it from now on (the group's shards diverged)

	stopHealth context.CancelFunc
	stop       chan struct{}
	done       chan struct{}

	// releasing are the device comms formed so far whose release may
	// still be under way (c.mu): Close waits for them, so that no GPU op
	// of this Comm uses the caller's device memory after it returns.
	releasing []releaser
}

// releaser is a backend that frees its device resources in the background
// after Close (nccl's Backend: ncclCommAbort took 0.5 s after a peer's
// death on 2×H200). Released is closed once the comm's GPU work has
// stopped and its resources are freed; ReleaseErr then says whether that
// went wrong (its GPU work may still run).
type releaser interface {
	Released() <-chan struct{}
	ReleaseErr() error
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

// healthy reports whether neither comm has failed.
func (x comms) healthy() bool {
	return x.ok() && !slices.ContainsFunc(x.all(), func(c *comm.Comm) bool { return c.Err() != nil })
}

func (x comms) revoke(cause error) {
	for _, c := range x.all() {
		c.Revoke(cause)
	}
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
// starts its recovery server, and returns. The first Step joins a quorum.
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
	id := memberID(cfg.Group, cfg.GroupRank)
	met, err := newMetrics(cfg.Registerer, cfg.Job, id)
	if err != nil {
		server.Close()
		return nil, err
	}
	m, own := cfg.Membership, cfg.Membership == nil
	if own {
		m, err = joinCoordinator(ctx, cfg, id, server.Addr())
		if err != nil {
			met.unregister()
			server.Close()
			return nil, err
		}
	}
	if cfg.DurableCommit {
		if _, ok := m.(durableCommitter); !ok {
			met.unregister()
			server.Close()
			m.Close()
			return nil, fmt.Errorf("%w: ft: config: DurableCommit needs a Membership with RecordCommit and LastCommit", comm.ErrInvalidArgument)
		}
	}
	c := &Comm{
		cfg: cfg, m: m, own: own, server: server, metrics: met, id: id,
		log:     cfg.Logger.With(zap.String("job", cfg.Job), zap.String("member", id)),
		view:    view{ftRank: -1},
		changed: make(chan struct{}), stop: make(chan struct{}), done: make(chan struct{}),
	}
	go c.follow()
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
	case c.blobs != nil:
		return fmt.Errorf("%w: ft: register %q after the first Step", comm.ErrInvalidArgument, name)
	}
	c.state = append(c.state, registered{name, t})
	return nil
}

// prepareState turns the registered tensors into what recovery serves and
// fills, once the data comm shows which memory the job keeps.
func (c *Comm) prepareState(data *comm.Comm) error {
	if c.blobs != nil {
		return nil
	}
	device := data.Backend().Memory() == comm.DeviceMemory
	blobs := make([]recovery.Blob, 0, len(c.state))
	for _, r := range c.state {
		switch {
		case !r.t.IsDevice():
			blobs = append(blobs, recovery.Blob{Name: r.name, Data: r.t.Bytes()})
		case !device:
			return fmt.Errorf("%w: ft: %q is a device tensor, but backend %s keeps host memory", comm.ErrInvalidArgument, r.name, c.cfg.Backend)
		default:
			if c.copier == nil {
				hc, ok := data.Backend().(comm.HostCopier)
				if !ok {
					return fmt.Errorf("%w: ft: backend %s cannot copy device state to the host (comm.HostCopier), so %q cannot heal",
						comm.ErrBackendUnavailable, c.cfg.Backend, r.name)
				}
				c.copier = hc
				c.staging = newStagingPool(hc, c.cfg.fetchConfig().ChunkSize, stagingBuffers)
			}
			blobs = append(blobs, recovery.Blob{Name: r.name, Mem: &deviceState{copier: c.copier, t: r.t, pool: c.staging}})
		}
	}
	c.blobs = blobs
	return nil
}

// stagingBuffers bounds the pinned host memory a device job's healing uses:
// this many chunk-sized buffers, shared by serving and fetching.
const stagingBuffers = 16

// member returns the current registration (it changes on re-registration).
func (c *Comm) member() Membership {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m
}

// follow is the one goroutine of a Comm: it tracks the newest quorum and
// revokes the comms the moment a quorum or revocation record shows that a
// peer of the current epoch is gone. If the registration ends (evicted, or
// its lease lost in a long pause) it registers again as a new incarnation,
// which the coordinator admits like a restarted replica. It exits when the
// Comm closes.
func (c *Comm) follow() {
	defer close(c.done)
	for {
		m := c.member()
		changed, done := m.Changed(), m.Done() // before reading, so no change is missed
		if q, ok := m.Quorum(); ok {
			c.onQuorum(q)
		}
		c.checkRevocation(m)
		select {
		case <-c.stop:
			return
		case <-changed:
		case <-done:
			if !c.reregister(m) {
				return
			}
		}
	}
}

// reregister replaces a registration that ended. It reports false when
// there is nothing more to follow.
func (c *Comm) reregister(old Membership) bool {
	cause := old.Err()
	em, ok := old.(*etcdMember)
	if !c.own || !ok {
		c.mu.Lock()
		c.lost = fmt.Errorf("%w: %v", ErrMembershipLost, cause)
		close(c.changed)
		c.changed = make(chan struct{})
		c.mu.Unlock()
		c.log.Error("membership ended", zap.Error(cause))
		return false
	}
	c.log.Warn("registration lost; registering again", zap.Error(cause))
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 100*time.Millisecond, 5*time.Second, 0
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { // ends the retries when the Comm closes; exits with this function
		select {
		case <-c.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	var nm *etcdMember
	err := backoff.Retry(func() error {
		var err error
		nm, err = register(ctx, c.cfg, em.cli, c.id, c.server.Addr())
		if err != nil {
			c.log.Warn("registering again", zap.Error(err))
		}
		return err
	}, backoff.WithContext(b, ctx))
	if err != nil {
		return false // closing
	}
	nm.cli, em.cli = em.cli, nil // the client moves to the new registration
	em.Close()
	c.mu.Lock()
	c.m = nm
	c.mu.Unlock()
	c.log.Info("registered again", zap.Int64("incarnation", nm.Incarnation()))
	return true
}

func (c *Comm) checkRevocation(m Membership) {
	c.mu.Lock()
	epoch, ft := c.epoch, c.ft
	if !ft.ok() || epoch <= c.revoked {
		c.mu.Unlock()
		return
	}
	r, ok := m.Revocation(epoch)
	if ok {
		c.revoked = epoch
	}
	c.mu.Unlock()
	if ok {
		ft.revoke(fmt.Errorf("ft: epoch %d revoked by %s: %s", r.Epoch, r.By, r.Reason))
		c.log.Info("revoked the comm by record", zap.Uint64("epoch", r.Epoch), zap.String("reason", r.Reason))
	}
}

func (c *Comm) onQuorum(q membership.Quorum) {
	c.mu.Lock()
	if c.latest != nil && q.Epoch <= c.latest.Epoch {
		c.mu.Unlock()
		return
	}
	c.latest = &q
	close(c.changed)
	c.changed = make(chan struct{})
	c.metrics.epochSeen.Set(float64(q.Epoch))
	if c.cancelEp != nil && q.Epoch > c.pendEp {
		c.cancelEp(fmt.Errorf("ft: epoch %d superseded by %d", c.pendEp, q.Epoch))
	}
	// Revoke at once if a member of the current FT or group comm is gone,
	// so no survivor waits out a collective timeout for it.
	var revoke []comms
	gone := func(members []participant) bool {
		return slices.ContainsFunc(members, func(p participant) bool {
			return p.ID != "" && !q.Includes(p.ID, p.Incarnation)
		})
	}
	if c.ft.ok() && q.Epoch > c.epoch && gone(c.view.ft) {
		revoke = append(revoke, c.ft)
	}
	if c.group.ok() && q.Epoch > c.epoch && gone(c.view.group) {
		revoke = append(revoke, c.group)
	}
	stale := c.staleDataLocked(q.Epoch, revoke)
	c.mu.Unlock()
	for _, x := range revoke {
		x.revoke(fmt.Errorf("ft: epoch %d: %s", q.Epoch, q.Reason))
	}
	if len(revoke) > 0 {
		c.log.Info("revoked the comm: a peer left the quorum", zap.Uint64("epoch", q.Epoch), zap.String("reason", q.Reason))
	}
	c.stopStale(stale, q.Epoch)
}

// staleDataLocked returns the device data comms to stop because a quorum
// newer than the current epoch appeared in the middle of a step. A peer
// that had not started the step moves to the new epoch (it shrinks, grows
// or leaves the comm) and never posts its part of the step's ops on the
// old one; gloo sees that as a mismatch, but NCCL waits for it until the
// op's Timeout. The step's ops fail instead, the step does not commit, and
// the next Step moves on. Only the data comms stop: the control comms
// keep the replica group's vote whole (a vote cut at one rank but not the
// other would split the group's commit). Comms in skip are revoked whole
// anyway. c.mu is held.
func (c *Comm) staleDataLocked(epoch uint64, skip []comms) []*comm.Comm {
	if !c.midStep || epoch <= c.epoch {
		return nil
	}
	var stale []*comm.Comm
	for _, x := range []comms{c.ft, c.group} {
		if x.ok() && x.data != x.ctl && !slices.Contains(skip, x) {
			stale = append(stale, x.data)
		}
	}
	if len(stale) > 0 {
		if c.stopping == 0 {
			c.stopsDone = make(chan struct{})
		}
		c.stopping++
	}
	return stale
}

// stopStale revokes what staleDataLocked returned, outside c.mu.
func (c *Comm) stopStale(stale []*comm.Comm, epoch uint64) {
	if len(stale) == 0 {
		return
	}
	for _, d := range stale {
		d.Revoke(fmt.Errorf("ft: epoch %d began mid-step: the old epoch's device ops may wait for peers that moved on", epoch))
	}
	c.log.Info("stopped the step's device ops: a new epoch began mid-step", zap.Uint64("epoch", epoch))
	c.mu.Lock()
	if c.stopping--; c.stopping == 0 {
		close(c.stopsDone)
	}
	c.mu.Unlock()
}

// settle ends the step for the purpose of mid-step stops (none starts
// from now on) and waits for those already decided: a revoke that lands
// after a shrink or grow began would fail it at this rank alone, and
// NCCL's shrink and grow are collective.
func (c *Comm) settle(ctx context.Context) error {
	c.mu.Lock()
	c.midStep = false
	n, done := c.stopping, c.stopsDone
	c.mu.Unlock()
	if n == 0 {
		return nil
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("ft: step: %w (waiting for a revoke of the last step's device ops)", context.Cause(ctx))
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
	c.works, c.errs, c.groupErrs = c.works[:0], c.errs[:0], c.groupErrs[:0]
	c.stepStarted = time.Now()
	if c.fatal != nil {
		return c.fatal
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return ErrClosed
	}
	fast := c.ft.ok() && c.latest != nil && c.latest.Epoch == c.epoch && c.ft.healthy() &&
		(c.cfg.GroupSize == 1 || c.group.healthy())
	c.mu.Unlock()
	var rollback error
	if !fast {
		if err := c.reconfigure(ctx); err != nil {
			if !errors.Is(err, ErrRolledBack) {
				return err
			}
			rollback = err
		}
	}
	if c.histBytes == nil {
		c.histBytes = c.hist.encode()
	}
	c.server.OfferWithMeta(c.step, c.histBytes, c.blobs)
	c.mu.Lock()
	c.midStep = true
	var stale []*comm.Comm
	var newest uint64
	if c.latest != nil {
		// A quorum that came while this Step reconfigured finds the step
		// already started.
		newest = c.latest.Epoch
		stale = c.staleDataLocked(newest, nil)
	}
	c.mu.Unlock()
	c.stopStale(stale, newest)
	return rollback
}

// reconfigure waits for a quorum this replica can take part in and moves to
// it, retrying with the next epoch when one fails part-way.
func (c *Comm) reconfigure(ctx context.Context) error {
	if err := c.settle(ctx); err != nil {
		return err
	}
	for {
		q, v, err := c.awaitQuorum(ctx)
		if err != nil {
			return err
		}
		t0 := time.Now()
		if !c.failedAt.IsZero() {
			c.metrics.detectSeconds.Observe(t0.Sub(c.failedAt).Seconds())
		}
		err = c.apply(ctx, q, v)
		if err == nil || errors.Is(err, ErrRolledBack) {
			c.metrics.reconfigSeconds.Observe(time.Since(t0).Seconds())
			return err
		}
		if c.isClosed() {
			return ErrClosed // Close cancelled the reconfiguration; nothing failed
		}
		if ctx.Err() != nil {
			// The caller's ctx ended: say so (errors.Is ctx.Err()), even
			// when what failed first was a formation's own deadline.
			return fmt.Errorf("ft: step: %w (reconfiguring: %v)", context.Cause(ctx), err)
		}
		if errors.Is(err, comm.ErrBackendUnavailable) || errors.Is(err, comm.ErrInvalidArgument) || errors.Is(err, ErrGroupDiverged) {
			return fmt.Errorf("ft: step: %w", err)
		}
		c.noteFailure()
		if errors.Is(err, errHolderAbsent) {
			continue // wait for a quorum with a replica that holds the job's step; nothing failed
		}
		c.log.Warn("reconfiguration failed; waiting for the next epoch", zap.Uint64("epoch", q.Epoch), zap.Error(err))
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if rerr := c.member().ReportCommitFailure(rctx, q.Epoch); rerr != nil {
			c.log.Warn("reporting the failed epoch", zap.Error(rerr))
		}
		cancel()
	}
}

// awaitQuorum returns the newest quorum after the current epoch in which
// this replica's group is complete and this rank takes part. Quorums that
// leave it out make it sit out: its comms are closed, as the others
// reconfigure without it.
func (c *Comm) awaitQuorum(ctx context.Context) (membership.Quorum, view, error) {
	for {
		c.mu.Lock()
		q, changed, m := c.latest, c.changed, c.m
		if c.closed {
			c.mu.Unlock()
			return membership.Quorum{}, view{}, ErrClosed
		}
		if c.lost != nil {
			c.mu.Unlock()
			return membership.Quorum{}, view{}, c.lost
		}
		var usable bool
		var v view
		var verr error
		if q != nil && (q.Epoch > c.epoch || (!c.ft.ok() && q.Epoch == c.epoch && c.epoch == 0)) {
			v, verr = deriveView(q.Epoch, participantsOf(*q), c.cfg.Group, c.cfg.GroupRank, c.cfg.GroupSize)
			usable = verr == nil && v.complete && v.includes(c.id, m.Incarnation())
		}
		var leave []comms
		satOut := q != nil && q.Epoch > c.epoch && !usable
		if satOut {
			// Left out of this epoch: stop holding comms the others are
			// leaving, and hold what the epoch asks of this rank: nothing.
			leave = append(leave, c.ft, c.group)
			c.ft, c.group = comms{}, comms{}
			c.epoch, c.view = q.Epoch, view{epoch: q.Epoch, ftRank: -1}
		}
		c.mu.Unlock()
		for _, x := range leave {
			x.close()
		}
		if verr != nil {
			c.log.Error("malformed quorum", zap.Error(verr))
		}
		if satOut {
			c.reportFormed(ctx, q.Epoch)
			c.emit(Event{Kind: EventSatOut, Epoch: q.Epoch, Reason: q.Reason})
		}
		if usable {
			return *q, v, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return membership.Quorum{}, view{}, fmt.Errorf("ft: step: waiting for a quorum that includes %s: %w", c.id, context.Cause(ctx))
		}
	}
}

func participantsOf(q membership.Quorum) []participant {
	ps := make([]participant, len(q.Participants))
	for i, p := range q.Participants {
		ps[i] = participant{ID: p.ID, Group: p.Group, Incarnation: p.Incarnation}
	}
	return ps
}

// epochContext returns a ctx that ends when ctx does or when a quorum newer
// than epoch is seen: a reconfiguration for a superseded epoch would wait
// for peers that have moved on.
func (c *Comm) epochContext(ctx context.Context, epoch uint64) (context.Context, func()) {
	ectx, cancel := context.WithCancelCause(ctx)
	c.mu.Lock()
	c.cancelEp, c.pendEp = cancel, epoch
	if c.latest != nil && c.latest.Epoch > epoch {
		cancel(fmt.Errorf("ft: epoch %d already superseded", epoch))
	}
	c.mu.Unlock()
	return ectx, func() {
		c.mu.Lock()
		c.cancelEp = nil
		c.mu.Unlock()
		cancel(nil)
	}
}

// apply moves to quorum q: the group's comms, then the FT comms (shrunk,
// grown or made anew as planFor decides from the quorum), then the step
// agreement and, if behind, healing.
func (c *Comm) apply(ctx context.Context, q membership.Quorum, v view) error {
	t0 := time.Now()
	ectx, done := c.epochContext(ctx, q.Epoch)
	defer done()
	// Forming comms is bounded by the op timeout: a rank that chose
	// differently must not hold the others forever.
	tctx, cancel := context.WithTimeout(ectx, c.cfg.Timeout)
	defer cancel()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return ErrClosed
	}
	applying := make(chan struct{})
	c.applying = applying
	defer func() {
		c.mu.Lock()
		c.applying = nil
		c.mu.Unlock()
		close(applying)
	}()
	held, oldFT, oldGroup := c.view, c.ft, c.group
	c.ft, c.group = comms{}, comms{} // held here until the new ones are in place
	c.epoch, c.view = q.Epoch, view{epoch: q.Epoch, ftRank: -1}
	inc := c.m.Incarnation()
	c.mu.Unlock()

	// The replica group's comms are made anew at every epoch.
	oldGroup.close()
	var group comms
	if c.cfg.GroupSize > 1 {
		var err error
		group, err = c.form(tctx, freshComm, nil, comms{}, "group-"+c.cfg.Group, c.cfg.GroupRank, c.cfg.GroupSize, q.Epoch)
		if err != nil {
			oldFT.close()
			return fmt.Errorf("ft: group comm for epoch %d: %w", q.Epoch, err)
		}
	}
	how, exclude := planFor(q.Base, held, v, c.id, inc)
	if how == freshComm {
		oldFT.close()
	}
	ft, err := c.form(tctx, how, exclude, oldFT, "ft-"+strconv.Itoa(c.cfg.GroupRank), v.ftRank, len(v.ft), q.Epoch)
	if err != nil {
		group.close()
		oldFT.close() // left as it was by a failed Shrink or Grow
		return fmt.Errorf("ft: %s the FT comm to epoch %d: %w", how, q.Epoch, err)
	}
	if err := c.prepareState(ft.data); err != nil {
		ft.close()
		group.close()
		return err
	}
	c.mu.Lock()
	if c.closed {
		// Close ran while they formed and took no comms: these are ours
		// to close (before Close, which waits for this, ends).
		c.mu.Unlock()
		ft.close()
		group.close()
		return ErrClosed
	}
	c.ft, c.group, c.view = ft, group, v
	c.mu.Unlock()
	c.reportFormed(ctx, q.Epoch)
	c.watchHealth(ft.data)
	c.metrics.reconfigs.WithLabelValues(how.String()).Inc()
	c.forgetRendezvous(ctx, oldFT, v.ftRank == 0, "ft-"+strconv.Itoa(c.cfg.GroupRank))
	c.forgetRendezvous(ctx, oldGroup, c.cfg.GroupRank == 0, "group-"+c.cfg.Group)
	c.log.Info("reconfigured", zap.Uint64("epoch", q.Epoch), zap.Uint64("base", q.Base), zap.Stringer("how", how), zap.Ints("exclude", exclude),
		zap.Int("rank", v.ftRank), zap.Int("size", len(v.ft)), zap.Int("groups", v.groups))
	c.emit(Event{Kind: EventReconfigured, Epoch: q.Epoch, Participants: v.groups, How: how.String(), Took: time.Since(t0), Reason: q.Reason})

	err = c.agreeAndHeal(ectx, q.Epoch)
	if err != nil && !errors.Is(err, ErrRolledBack) {
		return err
	}
	if group.ok() {
		if gerr := c.checkGroupSteps(ectx, group, q.Epoch); gerr != nil {
			return gerr
		}
	}
	return err
}

// checkGroupSteps makes sure the replica group's ranks continue from one
// step. They heal independently (rank i from FT comm i), so they differ
// only when the group's vote completed at one rank and failed at the
// other and no other group holds the lagging shard's step: that shard's
// state is lost, and training on would mix steps silently.
func (c *Comm) checkGroupSteps(ctx context.Context, group comms, epoch uint64) error {
	v := []int64{c.step, -c.step}
	if err := group.ctl.AllReduce(ctx, comm.Int64s(v), comm.Max); err != nil {
		return fmt.Errorf("ft: the group's step check in epoch %d: %w", epoch, err)
	}
	if hi, lo := v[0], -v[1]; hi != lo {
		c.log.Error("the replica group's ranks stand at different steps; no replica holds the lagging shard's step",
			zap.Int64("step", c.step), zap.Int64("group_min", lo), zap.Int64("group_max", hi))
		c.fatal = &GroupDivergedError{Group: c.cfg.Group, Step: c.step, Min: lo, Max: hi}
		return c.fatal
	}
	return nil
}

// form makes one dimension's comms for epoch: shrinks or grows old, or
// creates new ones under prefix. With a device data backend the control
// comm runs on the control backend beside it, formed the same way.
func (c *Comm) form(ctx context.Context, how reconfig, exclude []int, old comms, prefix string, rank, size int, epoch uint64) (comms, error) {
	opts := func(prefix, backend string, bcfg any) comm.Options {
		return comm.Options{Name: prefix, Rank: rank, Size: size, Epoch: epoch, JobID: c.cfg.Job, Secret: c.cfg.Secret,
			Store: c.member().Store(), Prefix: prefix, Timeout: c.cfg.Timeout, Device: c.cfg.Device, Logger: c.log,
			Metrics: c.metrics.comm, BackendConfig: bcfg}
	}
	move := func(x *comm.Comm, prefix, backend string, bcfg any) (*comm.Comm, error) {
		switch how {
		case shrinkTo:
			return x.Shrink(ctx, exclude, epoch)
		case growTo:
			return x.Grow(ctx, size, epoch)
		}
		return comm.New(ctx, backend, opts(prefix, backend, bcfg))
	}
	data, err := move(old.data, prefix, c.cfg.Backend, c.cfg.BackendConfig)
	if err != nil {
		return comms{}, err
	}
	c.track(data)
	if !c.splitKnown {
		// The first formation shows whether the data backend keeps host
		// memory (one comm serves both) or device memory (control needs a
		// host comm beside it). Every rank learns the same.
		c.split = data.Backend().Memory() == comm.DeviceMemory ||
			(c.cfg.ControlBackend != "" && c.cfg.ControlBackend != c.cfg.Backend)
		c.splitKnown = true
	}
	if !c.split {
		return comms{ctl: data, data: data}, nil
	}
	ctl, err := move(old.ctl, prefix+"-ctl", c.controlBackend(), c.cfg.ControlBackendConfig)
	if err != nil {
		data.Close()
		return comms{}, fmt.Errorf("control comm: %w", err)
	}
	c.track(ctl)
	if ctl.Backend().Memory() != comm.HostMemory {
		data.Close()
		ctl.Close()
		return comms{}, fmt.Errorf("%w: ft: control backend %s keeps %s memory; control messages need a host-memory backend (gloo)",
			comm.ErrBackendUnavailable, c.controlBackend(), ctl.Backend().Memory())
	}
	return comms{ctl: ctl, data: data}, nil
}

// track remembers a newly formed comm whose backend releases its device
// resources after Close, for Close to wait for. Every comm ft forms passes
// here, so the comms it closes along the way (left when sitting out,
// replaced by new ones, shrunk or grown into the next epoch's, or a
// formation's half) are waited for too; those already released are
// forgotten.
func (c *Comm) track(x *comm.Comm) {
	r, ok := x.Backend().(releaser)
	if !ok {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.releasing = slices.DeleteFunc(c.releasing, func(r releaser) bool {
		select {
		case <-r.Released():
			return true
		default:
			return false
		}
	})
	c.releasing = append(c.releasing, r)
}

// awaitReleased waits, until deadline at most, until every device comm
// this Comm formed has released its resources, so that no GPU op of it
// still uses the caller's device memory.
func (c *Comm) awaitReleased(deadline time.Time) error {
	c.mu.Lock()
	rs := c.releasing
	c.releasing = nil
	c.mu.Unlock()
	timeout := time.NewTimer(time.Until(deadline))
	defer timeout.Stop()
	var errs []error
	for i, r := range rs {
		select {
		case <-r.Released():
			if err := r.ReleaseErr(); err != nil {
				errs = append(errs, fmt.Errorf("ft: releasing a device comm: %w (its GPU work may still use device memory)", err))
			}
		case <-timeout.C:
			return errors.Join(append(errs, fmt.Errorf("ft: %d device comms not released within %v of Close: their GPU work may still use device memory",
				len(rs)-i, c.cfg.Timeout))...)
		}
	}
	return errors.Join(errs...)
}

func (c *Comm) controlBackend() string {
	if c.cfg.ControlBackend != "" {
		return c.cfg.ControlBackend
	}
	return DefaultControlBackend
}

// reportFormed tells the coordinator that this rank holds what epoch asks
// of it, so that the next quorum may let it shrink or grow its comms.
// Without the report the next epoch forms new comms: slower, never wrong.
func (c *Comm) reportFormed(ctx context.Context, epoch uint64) {
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := c.member().ReportFormed(rctx, epoch); err != nil {
		c.log.Warn("reporting the formed epoch", zap.Uint64("epoch", epoch), zap.Error(err))
	}
}

// watchHealth starts watching the GPU of a device data backend, once: a
// critical fault takes the replica out of the next quorum.
func (c *Comm) watchHealth(data *comm.Comm) {
	if c.stopHealth != nil || c.cfg.DisableHealthWatch || data.Backend().Memory() != comm.DeviceMemory {
		return
	}
	hw, ok := data.Backend().(comm.HealthWatcher)
	if !ok {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	c.stopHealth = cancel
	err := hw.WatchHealth(ctx, func(e comm.HealthEvent) {
		if !e.Critical {
			// A fault that leaves the device usable (an application's Xid)
			// is no news of its health, and must not report a GPU that
			// had a critical fault healthy again.
			c.log.Info("device event", zap.Int("device", e.Device), zap.String("reason", e.Reason))
			return
		}
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := c.ReportHealth(rctx, membership.Critical, e.Reason); err != nil {
			c.log.Error("reporting device health", zap.Int("device", e.Device), zap.String("reason", e.Reason), zap.Error(err))
		}
	})
	if err != nil {
		c.log.Warn("cannot watch the GPU's health; set Config.DisableHealthWatch to silence this", zap.Error(err))
	}
}

// forgetRendezvous deletes the rendezvous keys of a replaced comm's epoch
// (backends keep them under <prefix>/epoch/<epoch>/); one rank does it.
func (c *Comm) forgetRendezvous(ctx context.Context, old comms, mine bool, prefix string) {
	if !old.ok() || !mine {
		return
	}
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for _, p := range []string{prefix, prefix + "-ctl"} {
		if err := c.member().Store().DeletePrefix(dctx, fmt.Sprintf("%s/epoch/%d/", p, old.ctl.Epoch())); err != nil {
			c.log.Warn("deleting old rendezvous keys", zap.Error(err))
		}
	}
}

// errHolderAbsent: with DurableCommit, the job's newest committed step is
// held by no participant of this epoch; the rank waits for a quorum that
// brings one back.
var errHolderAbsent = errors.New("ft: the job's committed step is held by no participant")

// agreeAndHeal exchanges step records over the control comm, agrees on the
// state to continue from (agree), and, if this replica holds another,
// fetches it from every replica that holds it. Both end with the epoch
// (ctx): once a newer one exists the sources may stop serving. A heal cut
// short keeps its progress, and the next epoch's heal of the same step
// fetches only the rest.
func (c *Comm) agreeAndHeal(ctx context.Context, epoch uint64) error {
	c.mu.Lock()
	ctl := c.ft.ctl
	c.mu.Unlock()
	mine := make([]byte, stepRecordSize)
	if err := (stepRecord{Step: c.step, Epoch: c.hist.last(), Addr: c.server.Addr()}).encode(mine); err != nil {
		return err
	}
	all := make([]byte, stepRecordSize*ctl.Size())
	if err := ctl.AllGather(ctx, comm.Uint8s(all), comm.Uint8s(mine)); err != nil {
		return fmt.Errorf("ft: step agreement in epoch %d: %w", epoch, err)
	}
	recs := make([]stepRecord, ctl.Size())
	for r := range recs {
		var err error
		if recs[r], err = decodeStepRecord(all[r*stepRecordSize:]); err != nil {
			return fmt.Errorf("ft: step agreement in epoch %d: rank %d: %w", epoch, r, err)
		}
	}
	a := agree(recs)
	if c.cfg.DurableCommit {
		last, ok, err := c.member().(durableCommitter).LastCommit(ctx)
		if err != nil {
			return fmt.Errorf("ft: step agreement in epoch %d: %w", epoch, err)
		}
		if ok && last.Step > a.Step {
			if c.waitingFor != uint64(last.Step) {
				c.waitingFor = uint64(last.Step)
				c.log.Warn("the job committed a step no participant holds; waiting for a quorum with one of its replicas",
					zap.Int64("step", last.Step), zap.Uint64("committed_in_epoch", last.Epoch), zap.Int64("participants_hold", a.Step))
				c.emit(Event{Kind: EventWaiting, Epoch: epoch,
					Reason: fmt.Sprintf("step %d was committed by epoch %d; no participant holds it", last.Step, last.Epoch)})
			}
			return errHolderAbsent
		}
	}
	if !a.heals(c.step, c.hist.last()) {
		return nil
	}
	from := c.step
	c.log.Info("healing", zap.Int64("from_step", c.step), zap.Uint64("from_epoch", c.hist.last()),
		zap.Int64("to_step", a.Step), zap.Uint64("to_epoch", a.Epoch), zap.Strings("sources", a.Sources))
	fc := c.cfg.fetchConfig()
	fc.Progress = &c.healed
	st, err := recovery.Fetch(ctx, fc, a.Step, a.Sources, c.blobs)
	c.metrics.healedBytes.Add(float64(st.Bytes))
	if err != nil {
		return fmt.Errorf("ft: heal to step %d: %w", a.Step, err)
	}
	theirs, err := decodeHistory(st.Meta)
	if err != nil {
		return fmt.Errorf("ft: heal to step %d: the sources' history: %w", a.Step, err)
	}
	c.metrics.healSeconds.Observe(st.Duration.Seconds())
	c.metrics.healThroughput.Set(st.Throughput())
	c.log.Info("healed", zap.Int64("step", a.Step), zap.Int64("bytes", st.Bytes), zap.Duration("took", st.Duration),
		zap.Float64("bytes_per_s", st.Throughput()), zap.Int("retries", st.Retries))
	lostFrom, lostTo, rolledBack := diverged(c.hist, c.step, theirs)
	c.hist, c.histBytes = theirs, nil
	c.setStep(a.Step)
	c.emit(Event{Kind: EventHealed, Epoch: epoch, FromStep: from, Bytes: st.Bytes, Took: st.Duration})
	// Tell the coordinator now rather than at the next heartbeat, so its
	// dashboard stops showing this replica as healing.
	if hb, ok := c.member().(interface{ Heartbeat(context.Context) error }); ok {
		if err := hb.Heartbeat(ctx); err != nil {
			c.log.Warn("reporting the healed step", zap.Error(err))
		}
	}
	if !rolledBack {
		return nil
	}
	c.metrics.rollbacks.Inc()
	c.metrics.rolledBackSteps.Add(float64(lostTo - lostFrom + 1))
	c.log.Error("rolled back committed steps: the job's history has them from another epoch",
		zap.Int64("from_step", lostFrom), zap.Int64("to_step", lostTo), zap.Int64("now_at", a.Step), zap.Uint64("their_epoch", a.Epoch))
	c.emit(Event{Kind: EventRolledBack, Epoch: epoch, FromStep: lostFrom, ToStep: lostTo})
	return &RollbackError{FromStep: lostFrom, ToStep: lostTo, Step: a.Step, Epoch: a.Epoch}
}

// emit tells the training loop's event hook, from the training goroutine.
func (c *Comm) emit(e Event) {
	if c.cfg.OnEvent == nil {
		return
	}
	e.Time = time.Now()
	if e.Step == 0 {
		e.Step = c.step
	}
	if e.Participants == 0 {
		e.Participants = c.Participants()
	}
	c.cfg.OnEvent(e)
}

func (c *Comm) setStep(s int64) {
	c.step = s
	c.mu.Lock()
	c.stepNow = s
	c.mu.Unlock()
	c.member().SetStep(s)
	c.metrics.step.Set(float64(s))
}

// noteFailure marks the start of an outage (for failure-to-commit latency).
func (c *Comm) noteFailure() {
	if c.failedAt.IsZero() {
		c.failedAt = time.Now()
	}
}

func (c *Comm) record(err error) {
	c.errs = append(c.errs, err)
	c.noteFailure()
}

// Commit ends the step: it waits for the step's collectives and votes.
// The step commits only if none of them failed, at least MinReplicas
// replica groups took part, (with GroupSize > 1) every rank of the group
// voted yes, and (with DurableCommit) no other epoch recorded the step
// first. On true the caller applies its optimizer step; on false it must
// not (the step is rolled back), and the next Step moves to a new epoch.
// After MaxCommitFailures failures in a row Commit returns
// ErrTooManyCommitFailures.
func (c *Comm) Commit(ctx context.Context) (bool, error) {
	for _, w := range c.works {
		if err := w.Wait(ctx); err != nil {
			c.record(err)
		}
	}
	c.mu.Lock()
	ft, group, groups, epoch := c.ft, c.group, c.view.groups, c.epoch
	c.midStep = false
	c.mu.Unlock()
	if ft.ok() && ft.ctl != ft.data && ft.ctl.Err() != nil {
		// The control comm failed (its host link, say): the step fails
		// with it, as with a failed data op.
		c.record(fmt.Errorf("ft: control comm: %w", ft.ctl.Err()))
	}
	if group.ok() && group.ctl != group.data && group.data.Err() != nil {
		// The group's device ops are the loop's own (Group()); a failed
		// one must not be voted for.
		c.groupErrs = append(c.groupErrs, fmt.Errorf("ft: group data comm: %w", group.data.Err()))
	}
	vote := len(c.errs) == 0 && len(c.groupErrs) == 0 && ft.ok() && groups >= c.cfg.MinReplicas
	if group.ok() {
		v := []int32{0}
		if vote {
			v[0] = 1
		}
		if err := group.ctl.AllReduce(ctx, comm.Int32s(v), comm.Min); err != nil {
			c.groupErrs = append(c.groupErrs, err)
			c.noteFailure()
			v[0] = 0
		}
		vote = v[0] == 1
	}
	var reason string
	if vote && c.cfg.DurableCommit {
		vote, reason = c.recordCommit(ctx, epoch)
	}
	// The optimizer writes the state next: stop serving it first.
	if err := c.server.Withdraw(ctx); err != nil {
		c.record(err)
		vote = false
	}
	if vote {
		if h := c.hist.commit(c.step+1, epoch); len(h) != len(c.hist) || h.last() != c.hist.last() {
			c.hist, c.histBytes = h, nil
		}
		c.setStep(c.step + 1)
		c.failedCommits = 0
		c.metrics.commits.WithLabelValues("ok").Inc()
		if !c.failedAt.IsZero() {
			c.metrics.recoverySeconds.Observe(time.Since(c.failedAt).Seconds())
			c.log.Info("committed after a failure", zap.Int64("step", c.step), zap.Duration("failure_to_commit", time.Since(c.failedAt)))
			c.failedAt = time.Time{}
		}
		c.metrics.stepSeconds.Observe(time.Since(c.stepStarted).Seconds())
		return true, nil
	}
	c.failedCommits++
	c.metrics.commits.WithLabelValues("failed").Inc()
	c.noteFailure()
	switch {
	case reason != "":
	case !ft.ok():
		reason = "not participating"
	case len(c.errs) > 0:
		reason = c.errs[0].Error()
	case len(c.groupErrs) > 0:
		reason = "the replica group's vote failed: " + c.groupErrs[0].Error()
	case groups < c.cfg.MinReplicas:
		reason = fmt.Sprintf("%d replica groups, %d needed", groups, c.cfg.MinReplicas)
	default:
		reason = "a rank of the replica group voted no"
	}
	if ft.ok() {
		ft.revoke(fmt.Errorf("ft: commit failed: %s", reason))
	}
	c.log.Warn("commit failed", zap.Int64("step", c.step), zap.Uint64("epoch", epoch), zap.String("reason", reason),
		zap.Int("in_a_row", c.failedCommits))
	c.emit(Event{Kind: EventCommitFailed, Epoch: epoch, Reason: reason})
	if ft.ok() {
		// Reporting is best effort, bounded by the op timeout: a replica
		// cut off from etcd must not block in Commit (the coordinator
		// learns of the failure from leases and gossip meanwhile).
		rctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
		// Blame the peers our collectives saw fail (a reset connection:
		// their process is likely gone); the coordinator checks and removes
		// them without waiting for gossip.
		failed := c.failedMembers()
		if len(failed) > 0 {
			// The record revokes the epoch everywhere at once; the report
			// carries the blame to the coordinator even when the epoch's
			// record was written first by someone else.
			if err := c.member().Revoke(rctx, epoch, reason, failed...); err != nil {
				c.log.Warn("reporting failed peers", zap.Error(err))
			}
		}
		if err := c.member().ReportCommitFailure(rctx, epoch, failed...); err != nil {
			c.log.Warn("reporting the commit failure", zap.Error(err))
		}
		cancel()
	}
	if c.failedCommits >= c.cfg.MaxCommitFailures {
		return false, fmt.Errorf("%w: %d in a row, last: %s", ErrTooManyCommitFailures, c.failedCommits, reason)
	}
	return false, nil
}

// recordCommit makes the commit of the next step durable (DurableCommit):
// it votes yes only if this epoch owns the step's record. A transient etcd
// error is retried within the op timeout; only "another epoch owns it" is
// final.
func (c *Comm) recordCommit(ctx context.Context, epoch uint64) (bool, string) {
	dc := c.member().(durableCommitter)
	rctx, cancel := context.WithTimeout(ctx, c.cfg.Timeout)
	defer cancel()
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval = 10*time.Millisecond, time.Second
	var rec membership.CommitRecord
	var ok bool
	err := backoff.Retry(func() error {
		var err error
		rec, ok, err = dc.RecordCommit(rctx, c.step+1, epoch)
		return err
	}, backoff.WithContext(b, rctx))
	switch {
	case err != nil:
		return false, fmt.Sprintf("recording the commit of step %d: %v", c.step+1, err)
	case !ok:
		return false, fmt.Sprintf("step %d was committed first by epoch %d (%s)", c.step+1, rec.Epoch, rec.By)
	}
	return true, ""
}

// failedMembers maps the ranks named by this step's peer failures to their
// member ids.
func (c *Comm) failedMembers() []string {
	c.mu.Lock()
	ftMembers, groupMembers := c.view.ft, c.view.group
	c.mu.Unlock()
	var ids []string
	blame := func(errs []error, members []participant) {
		for _, err := range errs {
			if !errors.Is(err, comm.ErrPeerFailed) {
				continue
			}
			for _, r := range comm.FailedRanks(err) {
				if r >= 0 && r < len(members) && members[r].ID != "" && !slices.Contains(ids, members[r].ID) {
					ids = append(ids, members[r].ID)
				}
			}
		}
	}
	blame(c.errs, ftMembers)
	blame(c.groupErrs, groupMembers)
	return ids
}

// forward issues an op on the FT data comm and remembers its Work so
// Commit can collect its error.
func (c *Comm) forward(issue func(*comm.Comm) *comm.Work) *comm.Work {
	c.mu.Lock()
	data := c.ft.data
	c.mu.Unlock()
	var w *comm.Work
	if data == nil {
		w = comm.FailedWork(ErrNotParticipating)
	} else {
		w = issue(data)
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

// ReportHealth tells the coordinator this replica's health. A device monitor
// calls it with membership.Critical on a fatal fault (a GPU XID, say) so the
// replica leaves the quorum before it hangs its peers' collectives; the
// replica sits out until it reports Healthy again. With a GPU data backend
// ft does this itself (Config.DisableHealthWatch). Safe from any goroutine.
func (c *Comm) ReportHealth(ctx context.Context, h membership.Health, reason string) error {
	if err := c.member().SetHealth(ctx, h, reason); err != nil {
		return fmt.Errorf("ft: report health: %w", err)
	}
	c.log.Info("reported health", zap.Stringer("health", h), zap.String("reason", reason))
	return nil
}

// Group returns the replica group's data comm (the shard dimension of
// HSDP), or nil when GroupSize is 1 or the group is not formed. Ops on it
// are not recorded for Commit; check their errors.
func (c *Comm) Group() *comm.Comm {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.group.data
}

// Epoch is the epoch of the current configuration.
func (c *Comm) Epoch() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.epoch
}

// Participants is the number of replica groups in the current FT comm
// (0 while sitting out).
func (c *Comm) Participants() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.ft.ok() {
		return 0
	}
	return len(c.view.ft)
}

// Rank is this replica's rank in the FT comm, -1 while sitting out.
func (c *Comm) Rank() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.ft.ok() {
		return -1
	}
	return c.view.ftRank
}

// CommittedStep is the number of steps this replica has committed (or
// healed to).
func (c *Comm) CommittedStep() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stepNow
}

func (c *Comm) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

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
// Step that is reconfiguring is cancelled (it returns ErrClosed), and
// Close returns after it ended, having closed what it formed. Safe to
// call twice.
func (c *Comm) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	ft, group := c.ft, c.group
	c.ft, c.group = comms{}, comms{}
	close(c.changed)
	c.changed = make(chan struct{})
	if c.cancelEp != nil {
		c.cancelEp(ErrClosed)
	}
	applying := c.applying
	c.mu.Unlock()
	if applying != nil {
		// A reconfiguration in flight on the training goroutine: it ends
		// soon (cancelled), closing what it formed.
		<-applying
	}
	close(c.stop)
	<-c.done
	if c.stopHealth != nil {
		c.stopHealth()
	}
	ft.close()
	group.close()
	m := c.member()
	lctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := errors.Join(m.Leave(lctx), m.Close(), c.server.Close())
	// Device work gets Config.Timeout in all to stop.
	deadline := time.Now().Add(c.cfg.Timeout)
	if c.staging != nil {
		// After the server: no chunk is staged any more.
		err = errors.Join(err, c.staging.close(deadline))
	}
	err = errors.Join(err, c.awaitReleased(deadline))
	c.metrics.unregister()
	return err
}
