package membership

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

// MemberConfig configures a member: one replica group's leader of a job.
type MemberConfig struct {
	// Client is the etcd client the member uses (required); the caller
	// owns it and closes it after the member.
	Client *clientv3.Client
	// Root is the key prefix (default "/ftcomm").
	Root string
	// Job and ID name the member (ValidName); ID is unique within the job
	// while its holder lives.
	Job, ID string
	// Addr is where the member serves its peers (rendezvous, state
	// transfer); it appears in the quorum. Required.
	Addr string
	// Group is the replica group's name, and GroupSize, above 1, the
	// number of its ranks: the coordinator then admits the group's
	// members only together (MemberRecord.GroupSize).
	Group     string
	GroupSize int
	// Spare registers the member as a warm standby of its job
	// (MemberRecord.Spare): the coordinator admits it only when the job
	// runs below its target size. A spare replica group registers each
	// of its ranks with Spare and the group's GroupSize.
	Spare bool
	// Host is a placement hint (MemberRecord.Host): where the member runs.
	Host string
	// LeaseTTL: the member's registration expires this long after its
	// process stops renewing it (etcd's minimum is 2 s; default 5 s).
	// Without gossip this is how long a dead member goes unnoticed.
	LeaseTTL time.Duration
	// HeartbeatInterval: how often the member writes its step and health
	// to etcd when they changed (0: only when asked, by Heartbeat,
	// RequestQuorum or SetHealth). Each write is one etcd put and one
	// event at the coordinator; steps are for the dashboard and the
	// quorum's MaxStep. Default 10 s.
	HeartbeatInterval time.Duration
	// MinReplicas the job needs (0: the coordinator's default).
	MinReplicas int
	// Stragglers asks for a straggler policy for the member's job (the
	// zero value: the coordinator's, off by default); when members ask
	// for different ones, the most lenient holds. It needs step times:
	// call SetStepTime every step.
	Stragglers StragglerPolicy
	// WantQuorum asks to take part right away (as RequestQuorum would).
	WantQuorum bool
	// Step is the step the member starts at.
	Step int64
	// Run is the run of the job the member takes part in ("": the job's
	// current run, whichever it is, named by this member when the job has
	// none; see RunRecord). A Run that is not the job's current
	// run is started (StartRun, by this member) when StartRun is set and
	// the id was never used; otherwise Join fails with a *RunEndedError.
	// Starting a run waits for no one: while the job has live members,
	// Join fails with a *RunBusyError.
	Run      string
	StartRun bool
	// GroupLease binds the registration to its replica group's shared
	// lease instead of a lease of its own (Group required): the group's
	// first member to join creates and renews it (the group's leader:
	// heartbeats and gossip run there only) and the others link to that
	// member, which removes a member whose link ends; when the leader's
	// link ends, a member takes the lease over (see the package doc).
	// GroupLinkAddr is where this member listens for links if it leads
	// (default: Addr's host, a port from the OS); the links ping every
	// GroupLinkInterval (default 200 ms) and end after GroupLinkTimeout
	// of silence (default 1 s).
	// The leader also removes a registration on its lease that has had
	// no link to it for LeaseTTL + 4 GroupLinkTimeouts (a member that died
	// before it linked; see the package doc).
	GroupLease                          bool
	GroupLinkAddr                       string
	GroupLinkInterval, GroupLinkTimeout time.Duration
	// GroupEachWatches, with GroupLease, makes every member of the group
	// watch the job's epochs in etcd itself. Off (the default): only the
	// group's leader watches, and forwards what it learns on the group's
	// links (see the package doc, "Replica groups").
	GroupEachWatches bool
	// Quorums, when set, is shared by the members of this process that
	// decode each quorum record once and hold one copy of each quorum
	// (see QuorumCache). nil: the member keeps its own.
	Quorums *QuorumCache
	// Gossip enables failure detection by gossip with the coordinators
	// and other members (nil: off; lease expiry alone detects death).
	Gossip *GossipConfig
	// QuorumVerifier, when set, makes the member act only on quorums
	// signed by a trusted coordinator key: an unsigned or badly signed
	// quorum record is logged and ignored (Credentials.ApplyMember sets
	// it). nil: quorums are taken as read, as from an insecure
	// coordinator.
	QuorumVerifier *QuorumVerifier
	// WaitForDuplicate makes Join wait, while ctx lasts, for a previous
	// incarnation of the same id to go (its lease to expire or be
	// revoked) instead of failing with ErrDuplicateMember.
	WaitForDuplicate bool
	// Logger (nil: none).
	Logger *zap.Logger

	// linkHeld, when set, holds the member's group links back until it
	// is closed: a member registered on its group's lease that has not
	// linked yet (for the tests, export_test.go).
	linkHeld <-chan struct{}
	// linkMuted, when set and true, keeps the member's group links from
	// sending pings, as a starved process would (tests).
	linkMuted *atomic.Bool
	// takeoverHeld, when set, holds a takeover of the group's lease
	// between its claim and its lease grant until it is closed: a
	// takeover slowed by a loaded etcd, or a claimer that dies (tests).
	takeoverHeld <-chan struct{}
}

// maxHostLen bounds MemberConfig.Host: a DNS name's length.
const maxHostLen = 253

// DefaultMemberConfig returns the defaults of the optional fields; fill
// Client, Job, ID and Addr.
func DefaultMemberConfig() MemberConfig {
	return MemberConfig{Root: etcdkeys.DefaultRoot, LeaseTTL: 5 * time.Second, HeartbeatInterval: 10 * time.Second,
		GroupLinkInterval: 200 * time.Millisecond, GroupLinkTimeout: time.Second}
}

// Validate says what is wrong with the configuration, if anything.
func (c MemberConfig) Validate() error {
	if c.Client == nil {
		return fmt.Errorf("%w: membership: member needs an etcd Client", comm.ErrInvalidArgument)
	}
	if err := checkName("job", c.Job); err != nil {
		return err
	}
	if err := checkName("member id", c.ID); err != nil {
		return err
	}
	if c.Addr == "" {
		return fmt.Errorf("%w: membership: member %q needs an Addr", comm.ErrInvalidArgument, c.ID)
	}
	if c.LeaseTTL < 2*time.Second {
		return fmt.Errorf("%w: membership: LeaseTTL %v is below etcd's minimum of 2s", comm.ErrInvalidArgument, c.LeaseTTL)
	}
	if err := checkRunName(c.Run); err != nil {
		return err
	}
	if c.StartRun && c.Run == "" {
		return fmt.Errorf("%w: membership: StartRun needs a Run to start", comm.ErrInvalidArgument)
	}
	if len(c.Host) > maxHostLen {
		return fmt.Errorf("%w: membership: member %q: a Host of %d bytes (at most %d)", comm.ErrInvalidArgument, c.ID, len(c.Host), maxHostLen)
	}
	if c.GroupSize < 0 || c.GroupSize > 1 && c.Group == "" {
		return fmt.Errorf("%w: membership: member %q: group size %d (a size above 1 needs a Group)", comm.ErrInvalidArgument, c.ID, c.GroupSize)
	}
	if c.GroupLease && c.Group == "" {
		return fmt.Errorf("%w: membership: member %q: GroupLease needs a Group", comm.ErrInvalidArgument, c.ID)
	}
	if c.GroupLease && (c.GroupLinkInterval <= 0 || c.GroupLinkTimeout <= c.GroupLinkInterval) {
		return fmt.Errorf("%w: membership: group link interval %v must be positive and below its timeout %v", comm.ErrInvalidArgument, c.GroupLinkInterval, c.GroupLinkTimeout)
	}
	if c.HeartbeatInterval < 0 || c.MinReplicas < 0 {
		return fmt.Errorf("%w: membership: HeartbeatInterval %v and MinReplicas %d must not be negative", comm.ErrInvalidArgument, c.HeartbeatInterval, c.MinReplicas)
	}
	if err := c.Stragglers.Validate(); err != nil {
		return err
	}
	if c.Gossip != nil {
		return c.Gossip.Validate()
	}
	return nil
}

// Member is a registered member of a job. See the package documentation
// for its lifecycle. Its methods are safe for concurrent use.
type Member struct {
	// A Member is composed of parts, each of which owns its state and the
	// lock that guards it, and holds the parts it drives (given by
	// newMember):
	//
	//   - end (ending, member.go): why and how the membership ended;
	//   - rec (recordDraft, reports.go): the member's record as it will
	//     next be written, and its writes, in order;
	//   - lease (leaseBinding, lease.go): the lease the registration is
	//     bound to, whether this member keeps it alive, and its replica
	//     group's record and links;
	//   - roll (leaderRoll, grouproll.go): a group leader's roll of the
	//     registrations on its lease;
	//   - epochs (epochs, epochs.go and groupquorum.go): the job's quorums
	//     and revocations as the member learns them, and what a group's
	//     leader forwards of them;
	//   - reach (reachProbe, reach.go): the blamed peers the member dials;
	//   - live (liveness, liveness.go): the registration, its renewal,
	//     heartbeats, gossip and the watch of its own key;
	//   - links (linkServer, grouplink.go): the group's links, at the
	//     leader's end, and the link protocol;
	//   - follower (groupFollower, grouplease.go): a group member that
	//     does not lead: its link to the leader, its moves when the lease
	//     moves, and its takeover of the lease.
	//
	// memberEnv's fields are set by Join before any goroutine starts, and
	// read without a lock. The Member's own methods compose the parts:
	// Join wires them, Leave and Close end them in order.
	//
	// Lock order: the parts' locks do not nest, with two exceptions. The
	// record's write lock (recordDraft.writeM, held across each write of
	// the record to etcd) is taken before any other lock. Under the epochs
	// lock the member takes its QuorumCache's lock and each groupLink's,
	// which are leaves. Otherwise a part's method takes its own lock only,
	// and a caller holds no part's lock when it calls another part.
	*memberEnv
	closeOnce sync.Once // Leave's, Crash's

	end      ending
	rec      recordDraft
	lease    leaseBinding
	roll     leaderRoll
	epochs   *epochs
	reach    reachProbe
	live     liveness
	links    linkServer
	follower groupFollower
}

// memberEnv is what a member's parts share and none of them changes once
// Join has set it (before any goroutine starts): the configuration, the
// etcd client and key layout, the logger, the membership's lifetime and
// goroutines, and the registration's key, incarnation and run.
type memberEnv struct {
	cfg  MemberConfig
	cli  *clientv3.Client
	keys etcdkeys.Layout
	lg   *zap.Logger
	life context.Context    // ends at Leave, Close or loss
	stop context.CancelFunc // ends life (nil: a test's env)
	wg   sync.WaitGroup     // the goroutines spawn started
	key  string             // the member's key (etcdkeys.Layout.Member)
	inc  int64              // the registration's create revision (Incarnation)
	// run is the run the member joined, runRev the revision of its
	// record (0: none, the default run): registration and commit records
	// are fenced on it.
	run    string
	runRev int64
}

// spawn runs f on a goroutine of the membership's (Leave waits for them).
func (e *memberEnv) spawn(f func()) {
	e.wg.Add(1)
	go func() { defer e.wg.Done(); f() }()
}

// newMember makes a member of env's configuration, its parts empty and
// wired to each other.
func newMember(env *memberEnv) *Member {
	m := &Member{memberEnv: env, epochs: newEpochs(env)}
	m.end = ending{memberEnv: env, epochs: m.epochs, done: make(chan struct{})}
	m.rec.memberEnv, m.rec.end = env, &m.end
	m.lease.memberEnv, m.lease.rec = env, &m.rec
	m.roll.memberEnv, m.roll.lease = env, &m.lease
	m.reach.init(env)
	m.links = linkServer{memberEnv: env, end: &m.end, lease: &m.lease, roll: &m.roll, epochs: m.epochs}
	m.live = liveness{memberEnv: env, end: &m.end, rec: &m.rec, lease: &m.lease, links: &m.links}
	m.follower = groupFollower{memberEnv: env, rec: &m.rec, lease: &m.lease, roll: &m.roll,
		epochs: m.epochs, links: &m.links, live: &m.live}
	return m
}

// ending is how the membership ends: the first reason given, and whether
// it ended as a killed process's would.
type ending struct {
	*memberEnv
	epochs *epochs // ended with the membership

	crashed atomic.Bool // Crash: links end without saying goodbye

	mu   sync.Mutex    // guards err
	err  error         // why the membership ended (nil while it lasts)
	done chan struct{} // closed when err is set
}

// set records err as why the membership ended, unless it ended already;
// it reports whether this call ended it.
func (e *ending) set(err error) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.err != nil {
		return false
	}
	e.err = err
	close(e.done)
	return true
}

func (e *ending) cause() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// lost ends the membership because the registration is gone.
func (e *ending) lost(err error) {
	e.lg.Warn("membership lost", zap.Error(err))
	e.finish(err)
}

// finish records why the membership ended and stops the goroutines
// (without waiting for them: it may run on one of them).
func (e *ending) finish(err error) {
	if e.set(err) {
		e.epochs.end()
	}
	if e.stop != nil {
		e.stop()
	}
}

// Join registers a member bound to a fresh lease and starts its
// goroutines: lease renewal, the quorum watch, heartbeats and gossip.
// A live holder of the same id makes it fail with a *DuplicateMemberError
// (errors.Is ErrDuplicateMember) unless cfg.WaitForDuplicate.
func Join(ctx context.Context, cfg MemberConfig) (*Member, error) {
	d := DefaultMemberConfig()
	if cfg.Root == "" {
		cfg.Root = d.Root
	}
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = d.LeaseTTL
	}
	if cfg.GroupLinkInterval == 0 {
		cfg.GroupLinkInterval = d.GroupLinkInterval
	}
	if cfg.GroupLinkTimeout == 0 {
		cfg.GroupLinkTimeout = max(d.GroupLinkTimeout, 2*cfg.GroupLinkInterval)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	life, stop := context.WithCancel(context.Background())
	keys := etcdkeys.Layout{Root: cfg.Root}
	m := newMember(&memberEnv{cfg: cfg, cli: cfg.Client, keys: keys, lg: lg.With(zap.String("job", cfg.Job), zap.String("member", cfg.ID)),
		life: life, stop: stop, key: keys.Member(cfg.Job, cfg.ID)})
	ok := false
	defer func() {
		if !ok {
			m.release()
		}
	}()

	now := time.Now()
	rec := MemberRecord{
		Job: cfg.Job, ID: cfg.ID, Addr: cfg.Addr, Group: cfg.Group, GroupSize: cfg.GroupSize, Spare: cfg.Spare, Host: cfg.Host, SharedLease: cfg.GroupLease,
		Step: cfg.Step, WantQuorum: cfg.WantQuorum, MinReplicas: cfg.MinReplicas, Joined: now, Updated: now,
	}
	if cfg.Stragglers.Factor > 0 {
		p := cfg.Stragglers
		rec.Stragglers = &p
	}
	m.rec.update(func(r *MemberRecord) bool { *r = rec; return false })
	if cfg.GroupLease {
		m.roll.init(cfg.ID, cfg.unlinkedBound())
		if err := m.links.listen(); err != nil {
			return nil, err
		}
	} else if err := m.joinRetry(ctx, func() error { return m.lease.ownLease(ctx) }); err != nil {
		return nil, err
	}
	for {
		var run RunRecord
		var rev int64
		err := m.joinRetry(ctx, func() (err error) { run, rev, err = m.enterRun(ctx); return err })
		if err != nil {
			return nil, err
		}
		m.run, m.runRev = run.ID, rev
		m.rec.update(func(r *MemberRecord) bool { r.Run = run.ID; return false })
		if cfg.GroupLease {
			if err := m.joinRetry(ctx, func() error { return m.lease.enterGroup(ctx) }); err != nil {
				return nil, err
			}
		}
		err = m.joinRetry(ctx, func() (err error) { m.inc, err = m.live.register(ctx); return err })
		if errors.Is(err, errGroupMoved) || errors.Is(err, errLeaseGone) && cfg.GroupLease {
			m.lease.dropOwnLease()
			continue
		}
		if errors.Is(err, errLeaseGone) {
			m.lg.Warn("the member's lease ended before it registered (its renewals went unanswered); joining with a new one")
			m.lease.dropOwnLease()
			if err := m.joinRetry(ctx, func() error { return m.lease.ownLease(ctx) }); err != nil {
				return nil, err
			}
			continue
		}
		if !errors.Is(err, errRunMoved) {
			if err != nil {
				return nil, err
			}
			break
		}
	}

	// Read the epoch state before the member counts as joined, so Quorum()
	// is current when Join returns: the view (and the record if need be),
	// or for a group's leader the record, which it replays to the members
	// that link. A group's other member reads nothing: its leader sends it
	// what it holds as soon as it links (Quorum is empty until then).
	holds := m.lease.holdsLease()
	if holds {
		m.epochs.lead() // before the reads: what it applies, it replays to the members that link
	}
	var rev int64
	var err error
	switch {
	case !cfg.GroupLease || cfg.GroupEachWatches:
		err = m.joinRetry(ctx, func() (err error) { rev, err = m.epochs.loadEpochs(ctx); return err })
	case holds:
		err = m.joinRetry(ctx, func() (err error) { rev, err = m.epochs.seedForward(ctx); return err })
	}
	if err != nil {
		return nil, err
	}
	gsp := m.lease.gossip()
	if gsp != nil {
		if err := m.live.joinGossip(ctx); err != nil {
			m.lg.Warn("gossip join failed; lease expiry remains the failure detector", zap.Error(err))
		}
	}
	ok = true
	if holds {
		lease, ka := m.lease.keepAlive()
		m.spawn(func() { m.live.renew(lease, ka) })
	}
	if !cfg.GroupLease || cfg.GroupEachWatches || holds {
		m.spawn(func() { m.epochs.watchEpochs(rev) }) // a group's leader forwards what it learns
	}
	m.spawn(m.live.watchSelf)
	m.spawn(func() { m.reach.run(m.rec.tellReached) })
	if cfg.HeartbeatInterval > 0 && holds {
		m.spawn(m.live.heartbeats)
	}
	if gsp != nil {
		m.spawn(m.live.drainGossip)
	}
	if cfg.GroupLease {
		m.spawn(m.links.accept)
		m.spawn(m.follower.followGroup)
		if holds {
			_, created, _ := m.lease.groupRecord()
			m.spawn(func() { m.roll.rollGroup(created) })
		}
	}
	m.lg.Info("joined", zap.Int64("incarnation", m.inc), zap.String("addr", cfg.Addr))
	return m, nil
}

// Job returns the member's job.
func (m *Member) Job() string { return m.cfg.Job }

// ID returns the member's id.
func (m *Member) ID() string { return m.cfg.ID }

// Incarnation returns the etcd revision of this registration: a restarted
// member has a larger one.
func (m *Member) Incarnation() int64 { return m.inc }

// Record returns the member's record as it will next be written.
func (m *Member) Record() MemberRecord { return m.rec.get() }

// Store returns the rendezvous store of an epoch of the member's job.
func (m *Member) Store(epoch uint64) comm.Store {
	return NewStore(m.cli, m.keys.RendezvousPrefix(m.cfg.Job, epoch))
}

// Done is closed when the membership ends: Leave, Close, or loss of the
// registration (Err then wraps ErrEvicted).
func (m *Member) Done() <-chan struct{} { return m.end.done }

// Err says why the membership ended (nil while it lasts).
func (m *Member) Err() error { return m.end.cause() }

// release frees what Join acquired, for a Join that failed.
func (m *Member) release() {
	m.lease.dropOwnLease()
	m.links.close()
	m.stop()
}

// Leave deregisters the member gracefully: its key and lease go at once,
// gossip peers see a leave (not a death), the coordinator forms the next
// quorum without it. It then releases everything, as Close.
func (m *Member) Leave(ctx context.Context) error {
	var err error
	m.closeOnce.Do(func() {
		alive := m.Err() == nil
		shared := m.lease.shared()
		m.end.finish(fmt.Errorf("%w: member left", comm.ErrClosed))
		if alive {
			// Say "leaving" first so the coordinator tells a leave from
			// a lease expiry, then drop the lease (and with it the key).
			// After any write in flight: it must not land after this one.
			unlock := m.rec.lockWrites()
			m.rec.update(func(r *MemberRecord) bool { r.Leaving = true; return false })
			val, lease := m.rec.encode()
			holds := m.lease.holdsLease()
			_, e1 := m.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(m.key), "=", m.inc)).
				Then(clientv3.OpPut(m.key, string(val), clientv3.WithLease(lease))).Commit()
			var e2 error
			if holds && !shared {
				_, e2 = m.cli.Revoke(ctx, lease)
			} else {
				// The group's other members keep the lease (one of them
				// takes it over when this leader's links end).
				_, e2 = m.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(m.key), "=", m.inc)).
					Then(clientv3.OpDelete(m.key)).Commit()
			}
			unlock()
			if e1 != nil || e2 != nil {
				err = fmt.Errorf("membership: leave %s/%s: %w", m.cfg.Job, m.cfg.ID, ctxErr(ctx, errors.Join(e1, e2)))
			}
			if g := m.lease.gossip(); g != nil {
				if e := g.Leave(ctx); e != nil {
					m.lg.Info("gossip leave", zap.Error(e))
				}
			}
		}
		if g := m.lease.gossip(); g != nil {
			g.Close()
		}
		m.links.close()
		m.wg.Wait()
	})
	return err
}

// Close leaves (bounded to 2 s) if the member has not yet, and waits for
// its goroutines. Safe to call twice.
func (m *Member) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	m.Leave(ctx)
	return nil
}
