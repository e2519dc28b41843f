package ft

import (
	"context"
	"encoding/binary"
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
// goroutine, one at a time; Epoch, Participants, Step count and Close are
// safe from any goroutine. Comm runs one goroutine of its own, which
// follows the membership's quorums and revocations, and exits in Close.
type Comm struct {
	cfg     Config
	log     *zap.Logger
	m       Membership
	store   comm.Store
	server  *recovery.Server
	metrics *metrics
	id      string

	mu       sync.Mutex
	own      bool               // m was made from Config.Coordinator, so ft may re-register
	lost     error              // the membership ended for good
	revoked  uint64             // newest epoch whose revocation record was acted on
	latest   *membership.Quorum // newest quorum seen
	changed  chan struct{}      // closed and replaced when latest changes
	epoch    uint64             // the epoch of the current configuration
	view     view
	ft       *comm.Comm // the fault-tolerant comm; nil while sitting out
	group    *comm.Comm // the replica group's comm; nil when GroupSize is 1
	groupOf  []participant
	cancelEp func(error) // cancels the reconfiguration of pendingEp
	pendEp   uint64
	closed   bool
	stepNow  int64 // mirror of step for readers on other goroutines

	// Owned by the training goroutine.
	step          int64
	blobs         []recovery.Blob
	works         []*comm.Work
	errs          []error
	failedCommits int
	failedAt      time.Time // first failure since the last commit
	healed        recovery.Progress
	stepStarted   time.Time

	stop chan struct{}
	done chan struct{}
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
	id := memberID(cfg.Group, cfg.GroupRank)
	m, own := cfg.Membership, cfg.Membership == nil
	if own {
		m, err = joinCoordinator(ctx, cfg, id, server.Addr())
		if err != nil {
			server.Close()
			return nil, err
		}
	}
	met, err := newMetrics(cfg.Registerer, cfg.Job, id)
	if err != nil {
		server.Close()
		m.Close()
		return nil, err
	}
	c := &Comm{
		cfg: cfg, m: m, own: own, store: m.Store(), server: server, metrics: met, id: id,
		log:     cfg.Logger.With(zap.String("job", cfg.Job), zap.String("member", id)),
		changed: make(chan struct{}), stop: make(chan struct{}), done: make(chan struct{}),
	}
	go c.follow()
	return c, nil
}

// Register names host memory that makes up this replica's state: what a
// healing peer receives (and this replica receives when it heals). Register
// everything before the first Step, in the same order on every replica.
// Between Step and Commit the training loop must not write it; the
// optimizer writes it after a successful Commit.
func (c *Comm) Register(name string, t comm.Tensor) error {
	if t.IsZero() || t.IsDevice() {
		return fmt.Errorf("%w: ft: register %q: want a host tensor", comm.ErrInvalidArgument, name)
	}
	if slices.ContainsFunc(c.blobs, func(b recovery.Blob) bool { return b.Name == name }) {
		return fmt.Errorf("%w: ft: %q registered twice", comm.ErrInvalidArgument, name)
	}
	c.blobs = append(c.blobs, recovery.Blob{Name: name, Data: t.Bytes()})
	return nil
}

// member returns the current registration (it changes on re-registration).
func (c *Comm) member() Membership {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m
}

// follow is the one goroutine of a Comm: it tracks the newest quorum and
// revokes the FT comm the moment a quorum or revocation record shows that
// a peer of the current epoch is gone. If the registration ends (evicted,
// or its lease lost in a long pause) it registers again as a new
// incarnation, which the coordinator admits like a restarted replica. It
// exits when the Comm closes.
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
	if ft == nil || epoch <= c.revoked {
		c.mu.Unlock()
		return
	}
	r, ok := m.Revocation(epoch)
	if ok {
		c.revoked = epoch
	}
	c.mu.Unlock()
	if ok {
		ft.Revoke(fmt.Errorf("ft: epoch %d revoked by %s: %s", r.Epoch, r.By, r.Reason))
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
	var revoke []*comm.Comm
	gone := func(members []participant) bool {
		return slices.ContainsFunc(members, func(p participant) bool {
			r := q.Rank(p.ID)
			return r < 0 || q.Participants[r].Incarnation != p.Incarnation
		})
	}
	if c.ft != nil && q.Epoch > c.epoch && gone(c.view.ft) {
		revoke = append(revoke, c.ft)
	}
	if c.group != nil && q.Epoch > c.epoch && gone(c.groupOf) {
		revoke = append(revoke, c.group)
	}
	c.mu.Unlock()
	for _, x := range revoke {
		x.Revoke(fmt.Errorf("ft: epoch %d: %s", q.Epoch, q.Reason))
	}
	if len(revoke) > 0 {
		c.log.Info("revoked the comm: a peer left the quorum", zap.Uint64("epoch", q.Epoch), zap.String("reason", q.Reason))
	}
}

// Step starts a training step: it makes sure this replica takes part in the
// newest quorum with a working comm, reconfiguring (shrink, grow or a fresh
// comm) when the participants changed, and heals this replica from its
// peers if it is behind. While the epoch is unchanged and the comm healthy
// it returns at once, with no round trip to the coordinator.
func (c *Comm) Step(ctx context.Context) error {
	c.works, c.errs = c.works[:0], c.errs[:0]
	c.stepStarted = time.Now()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return ErrClosed
	}
	fast := c.ft != nil && c.latest != nil && c.latest.Epoch == c.epoch && c.ft.Err() == nil &&
		(c.group == nil || c.group.Err() == nil)
	c.mu.Unlock()
	if !fast {
		if err := c.reconfigure(ctx); err != nil {
			return err
		}
	}
	c.server.Offer(c.step, c.blobs)
	return nil
}

// reconfigure waits for a quorum this replica can take part in and moves to
// it, retrying with the next epoch when one fails part-way.
func (c *Comm) reconfigure(ctx context.Context) error {
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
		if err == nil {
			c.metrics.reconfigSeconds.Observe(time.Since(t0).Seconds())
			return nil
		}
		if ctx.Err() != nil || errors.Is(err, comm.ErrBackendUnavailable) || errors.Is(err, comm.ErrInvalidArgument) {
			return fmt.Errorf("ft: step: %w", err)
		}
		c.noteFailure()
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
		if q != nil && (q.Epoch > c.epoch || (c.ft == nil && q.Epoch == c.epoch && c.epoch == 0)) {
			v, verr = deriveView(q.Epoch, participantsOf(*q), c.cfg.Group, c.cfg.GroupRank, c.cfg.GroupSize)
			usable = verr == nil && v.complete && v.includes(c.id, m.Incarnation())
		}
		var leave []*comm.Comm
		if q != nil && q.Epoch > c.epoch && !usable {
			// Left out of this epoch: stop holding comms the others are leaving.
			leave = append(leave, c.ft, c.group)
			c.ft, c.group, c.view, c.groupOf = nil, nil, view{}, nil
			c.epoch = q.Epoch
		}
		c.mu.Unlock()
		closeAll(leave...)
		if verr != nil {
			c.log.Error("malformed quorum", zap.Error(verr))
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

func closeAll(cs ...*comm.Comm) {
	for _, x := range cs {
		if x != nil {
			x.Close()
		}
	}
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

// apply moves to quorum q: the group comm, then the FT comm, then the step
// agreement and, if behind, healing.
func (c *Comm) apply(ctx context.Context, q membership.Quorum, v view) error {
	ectx, done := c.epochContext(ctx, q.Epoch)
	defer done()
	// Forming comms is bounded by the op timeout: a rank that chose
	// differently must not hold the others forever.
	tctx, cancel := context.WithTimeout(ectx, c.cfg.Timeout)
	defer cancel()
	c.mu.Lock()
	oldFT, oldMembers, oldGroup := c.ft, c.view.ft, c.group
	c.ft, c.group = nil, nil // held here until the new ones are in place
	c.epoch, c.view = q.Epoch, v
	c.mu.Unlock()

	opts := func(prefix string, rank, size int) comm.Options {
		return comm.Options{Name: prefix, Rank: rank, Size: size, Epoch: q.Epoch, JobID: c.cfg.Job, Secret: c.cfg.Secret,
			Store: c.store, Prefix: prefix, Timeout: c.cfg.Timeout, Logger: c.log, BackendConfig: c.cfg.BackendConfig}
	}

	// The replica group's own comm is made anew at every epoch, like the
	// FT comm's fresh case: the decision must not depend on local state.
	closeAll(oldGroup)
	var group *comm.Comm
	if c.cfg.GroupSize > 1 {
		var err error
		group, err = comm.New(tctx, c.cfg.Backend, opts("group-"+c.cfg.Group, c.cfg.GroupRank, c.cfg.GroupSize))
		if err != nil {
			closeAll(oldFT)
			return fmt.Errorf("ft: group comm for epoch %d: %w", q.Epoch, err)
		}
	}

	how, exclude := plan(oldMembersOrNil(oldFT, oldMembers), v.ft)
	var ft *comm.Comm
	var err error
	switch how {
	case shrinkTo:
		ft, err = oldFT.Shrink(tctx, exclude, q.Epoch)
	case growTo:
		ft, err = oldFT.Grow(tctx, len(v.ft), q.Epoch)
	case freshComm:
		closeAll(oldFT)
		ft, err = comm.New(tctx, c.cfg.Backend, opts("ft-"+strconv.Itoa(c.cfg.GroupRank), v.ftRank, len(v.ft)))
	}
	if err != nil {
		closeAll(group)
		if how != freshComm {
			closeAll(oldFT) // left as it was by the failed Shrink or Grow
		}
		return fmt.Errorf("ft: %s the FT comm to epoch %d: %w", how, q.Epoch, err)
	}
	if ft.Backend().Memory() != comm.HostMemory {
		closeAll(ft, group)
		return fmt.Errorf("%w: ft: backend %s keeps tensors in %s memory; ft's FT and group comms need a host-memory backend (e.g. gloo) for their step agreement and votes",
			comm.ErrBackendUnavailable, c.cfg.Backend, ft.Backend().Memory())
	}
	c.mu.Lock()
	c.ft, c.group, c.groupOf = ft, group, v.group
	c.mu.Unlock()
	c.metrics.reconfigs.WithLabelValues(how.String()).Inc()
	c.forgetRendezvous(ctx, oldFT, v.ftRank == 0, "ft-"+strconv.Itoa(c.cfg.GroupRank))
	c.forgetRendezvous(ctx, oldGroup, c.cfg.GroupRank == 0, "group-"+c.cfg.Group)
	c.log.Info("reconfigured", zap.Uint64("epoch", q.Epoch), zap.Stringer("how", how), zap.Ints("exclude", exclude),
		zap.Int("rank", v.ftRank), zap.Int("size", len(v.ft)), zap.Int("groups", v.groups))

	return c.agreeAndHeal(ectx, q.Epoch)
}

// forgetRendezvous deletes the rendezvous keys of a replaced comm's epoch
// (backends keep them under <prefix>/epoch/<epoch>/); one rank does it.
func (c *Comm) forgetRendezvous(ctx context.Context, old *comm.Comm, mine bool, prefix string) {
	if old == nil || !mine {
		return
	}
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := c.store.DeletePrefix(dctx, fmt.Sprintf("%s/epoch/%d/", prefix, old.Epoch())); err != nil {
		c.log.Warn("deleting old rendezvous keys", zap.Error(err))
	}
}

func oldMembersOrNil(ft *comm.Comm, members []participant) []participant {
	if ft == nil {
		return nil
	}
	return members
}

// stepRecord is what each rank tells the others after a reconfiguration:
// its committed step and where it serves its state.
const stepRecordSize = 8 + 120

// agreeAndHeal exchanges steps over the new FT comm and, if this replica
// is behind the most advanced one, fetches that state from every replica at
// that step. Both end with the epoch (ctx): once a newer one exists the
// sources may stop serving. A heal cut short keeps its progress, and the
// next epoch's heal of the same step fetches only the rest.
func (c *Comm) agreeAndHeal(ctx context.Context, epoch uint64) error {
	c.mu.Lock()
	ft := c.ft
	c.mu.Unlock()
	mine := make([]byte, stepRecordSize)
	binary.LittleEndian.PutUint64(mine, uint64(c.step))
	addr := c.server.Addr()
	if len(addr) > stepRecordSize-8 {
		return fmt.Errorf("%w: ft: recovery address %q is too long", comm.ErrInvalidArgument, addr)
	}
	copy(mine[8:], addr)
	all := make([]byte, stepRecordSize*ft.Size())
	if err := ft.AllGather(ctx, comm.Uint8s(all), comm.Uint8s(mine)); err != nil {
		return fmt.Errorf("ft: step agreement in epoch %d: %w", epoch, err)
	}
	var maxStep int64
	steps := make([]int64, ft.Size())
	addrs := make([]string, ft.Size())
	for r := range steps {
		rec := all[r*stepRecordSize : (r+1)*stepRecordSize]
		steps[r] = int64(binary.LittleEndian.Uint64(rec))
		addrs[r] = string(rec[8 : 8+clen(rec[8:])])
		maxStep = max(maxStep, steps[r])
	}
	if c.step >= maxStep {
		return nil
	}
	var sources []string
	for r, s := range steps {
		if s == maxStep {
			sources = append(sources, addrs[r])
		}
	}
	c.log.Info("healing", zap.Int64("from_step", c.step), zap.Int64("to_step", maxStep), zap.Strings("sources", sources))
	fc := c.cfg.fetchConfig()
	fc.Progress = &c.healed
	st, err := recovery.Fetch(ctx, fc, maxStep, sources, c.blobs)
	c.metrics.healedBytes.Add(float64(st.Bytes))
	if err != nil {
		return fmt.Errorf("ft: heal to step %d: %w", maxStep, err)
	}
	c.metrics.healSeconds.Observe(st.Duration.Seconds())
	c.metrics.healThroughput.Set(st.Throughput())
	c.log.Info("healed", zap.Int64("step", maxStep), zap.Int64("bytes", st.Bytes), zap.Duration("took", st.Duration),
		zap.Float64("bytes_per_s", st.Throughput()), zap.Int("retries", st.Retries))
	c.setStep(maxStep)
	// Tell the coordinator now rather than at the next heartbeat, so its
	// dashboard stops showing this replica as healing.
	if hb, ok := c.member().(interface{ Heartbeat(context.Context) error }); ok {
		if err := hb.Heartbeat(ctx); err != nil {
			c.log.Warn("reporting the healed step", zap.Error(err))
		}
	}
	return nil
}

func clen(b []byte) int {
	for i, x := range b {
		if x == 0 {
			return i
		}
	}
	return len(b)
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
// replica groups took part, and (with GroupSize > 1) every rank of the
// group voted yes. On true the caller applies its optimizer step; on
// false it must not (the step is rolled back), and the next Step moves to a
// new epoch. After MaxCommitFailures failures in a row Commit returns
// ErrTooManyCommitFailures.
func (c *Comm) Commit(ctx context.Context) (bool, error) {
	for _, w := range c.works {
		if err := w.Wait(ctx); err != nil {
			c.record(err)
		}
	}
	c.mu.Lock()
	ft, group, groups := c.ft, c.group, c.view.groups
	c.mu.Unlock()
	vote := len(c.errs) == 0 && ft != nil && groups >= c.cfg.MinReplicas
	if group != nil {
		v := []int32{0}
		if vote {
			v[0] = 1
		}
		if err := group.AllReduce(ctx, comm.Int32s(v), comm.Min); err != nil {
			c.record(err)
			v[0] = 0
		}
		vote = v[0] == 1
	}
	// The optimizer writes the state next: stop serving it first.
	if err := c.server.Withdraw(ctx); err != nil {
		c.record(err)
		vote = false
	}
	if vote {
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
	reason := "no comm"
	if ft == nil {
		reason = "not participating"
	} else if len(c.errs) > 0 {
		reason = c.errs[0].Error()
		ft.Revoke(fmt.Errorf("ft: commit failed: %w", c.errs[0]))
	} else if groups < c.cfg.MinReplicas {
		reason = fmt.Sprintf("%d replica groups, %d needed", groups, c.cfg.MinReplicas)
	} else {
		reason = "a rank of the replica group voted no"
	}
	c.mu.Lock()
	epoch := c.epoch
	c.mu.Unlock()
	c.log.Warn("commit failed", zap.Int64("step", c.step), zap.Uint64("epoch", epoch), zap.String("reason", reason),
		zap.Int("in_a_row", c.failedCommits))
	if ft != nil {
		// Blame the peers our collectives saw fail (a reset connection:
		// their process is likely gone); the coordinator checks and removes
		// them without waiting for gossip.
		if failed := c.failedMembers(); len(failed) > 0 {
			if err := c.member().Revoke(ctx, epoch, reason, failed...); err != nil {
				c.log.Warn("reporting failed peers", zap.Error(err))
			}
		}
		if err := c.member().ReportCommitFailure(ctx, epoch); err != nil {
			c.log.Warn("reporting the commit failure", zap.Error(err))
		}
	}
	if c.failedCommits >= c.cfg.MaxCommitFailures {
		return false, fmt.Errorf("%w: %d in a row, last: %s", ErrTooManyCommitFailures, c.failedCommits, reason)
	}
	return false, nil
}

// failedMembers maps the ranks named by this step's peer failures to their
// member ids.
func (c *Comm) failedMembers() []string {
	c.mu.Lock()
	members := c.view.ft
	c.mu.Unlock()
	var ids []string
	for _, err := range c.errs {
		if !errors.Is(err, comm.ErrPeerFailed) {
			continue
		}
		for _, r := range comm.FailedRanks(err) {
			if r >= 0 && r < len(members) && !slices.Contains(ids, members[r].ID) {
				ids = append(ids, members[r].ID)
			}
		}
	}
	return ids
}

// forward issues an op on the FT comm and remembers its Work so Commit can
// collect its error.
func (c *Comm) forward(issue func(*comm.Comm) *comm.Work) *comm.Work {
	c.mu.Lock()
	ft := c.ft
	c.mu.Unlock()
	var w *comm.Work
	if ft == nil {
		w = comm.FailedWork(ErrNotParticipating)
	} else {
		w = issue(ft)
	}
	c.works = append(c.works, w)
	return w
}

// AllReduce reduces t across the participating replicas (Avg divides by
// this step's participants). Its error is recorded for Commit, not raised:
// the training loop may ignore the Work.
func (c *Comm) AllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) *comm.Work {
	return c.forward(func(x *comm.Comm) *comm.Work { return x.AllReduceAsync(ctx, t, op) })
}

// ReduceScatter, AllGather and Broadcast forward likewise.
func (c *Comm) ReduceScatter(ctx context.Context, out, in comm.Tensor, op comm.ReduceOp) *comm.Work {
	return c.forward(func(x *comm.Comm) *comm.Work { return x.ReduceScatterAsync(ctx, out, in, op) })
}

func (c *Comm) AllGather(ctx context.Context, out, in comm.Tensor) *comm.Work {
	return c.forward(func(x *comm.Comm) *comm.Work { return x.AllGatherAsync(ctx, out, in) })
}

func (c *Comm) Broadcast(ctx context.Context, t comm.Tensor, root int) *comm.Work {
	return c.forward(func(x *comm.Comm) *comm.Work { return x.BroadcastAsync(ctx, t, root) })
}

// ReportHealth tells the coordinator this replica's health. A device monitor
// calls it with membership.Critical on a fatal fault (a GPU XID, say) so the
// replica leaves the quorum before it hangs its peers' collectives; the
// replica sits out until it reports Healthy again. Safe from any goroutine.
func (c *Comm) ReportHealth(ctx context.Context, h membership.Health, reason string) error {
	if err := c.member().SetHealth(ctx, h, reason); err != nil {
		return fmt.Errorf("ft: report health: %w", err)
	}
	c.log.Info("reported health", zap.Stringer("health", h), zap.String("reason", reason))
	return nil
}

// Group returns the replica group's comm (the shard dimension of HSDP), or
// nil when GroupSize is 1 or the group is not formed. Ops on it are not
// recorded for Commit; check their errors.
func (c *Comm) Group() *comm.Comm {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.group
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
	if c.ft == nil {
		return 0
	}
	return len(c.view.ft)
}

// Rank is this replica's rank in the FT comm, -1 while sitting out.
func (c *Comm) Rank() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ft == nil {
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

// Close leaves the job, closes the comms and the recovery server, and stops
// the Comm's goroutine. Safe to call twice.
func (c *Comm) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	ft, group := c.ft, c.group
	c.ft, c.group = nil, nil
	close(c.changed)
	c.changed = make(chan struct{})
	c.mu.Unlock()
	close(c.stop)
	<-c.done
	closeAll(ft, group)
	m := c.member()
	lctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := errors.Join(m.Leave(lctx), m.Close(), c.server.Close())
	c.metrics.unregister()
	return err
}
