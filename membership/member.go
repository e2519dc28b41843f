package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership/gossip"
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
	cfg  MemberConfig
	cli  *clientv3.Client
	keys etcdkeys.Layout
	key  string
	inc  int64
	// run is the run the member joined, runRev the revision of its
	// record (0: none, the default run): registration and commit records
	// are fenced on it.
	run    string
	runRev int64
	lg     *zap.Logger
	gsp    *gossip.Node // nil without gossip; set before the goroutines start, or under mu by takeOver
	ka     <-chan *clientv3.LeaseKeepAliveResponse
	// link listens for the group's liveness links (MemberConfig.GroupLease).
	link    net.Listener
	crashed atomic.Bool // Crash: links end without saying goodbye
	// readingFull: a read of the whole list for a forwarded view is under
	// way; readAgain: a view came that it may predate.
	readingFull atomic.Bool
	readAgain   atomic.Bool
	watching    atomic.Int32 // watchEpochs runs (a group's follower does not watch)

	life   context.Context // ends at Leave, Close or loss
	stop   context.CancelFunc
	wg     sync.WaitGroup
	writeM sync.Mutex // orders record writes

	mu sync.Mutex
	// lease is the lease the registration is bound to; holds says
	// whether this member keeps it alive (always, without GroupLease; the
	// group's leader, with it). group and groupRev are the group lease
	// record the registration is bound under and its mod revision;
	// groupSeen is a revision at which that record was known to be still
	// at groupRev (a fenced write's), where a follower's watch of it
	// starts: a watch from groupRev+1, which may be the group's first
	// revision, is one etcd must catch up from its log, under the lock
	// its applies take (at 100,000 ranks, tens of thousands of revisions
	// for each of 87,500 followers).
	lease       clientv3.LeaseID
	holds       bool
	group       groupLease
	groupRev    int64
	groupSeen   int64
	links       map[net.Conn]*groupLink // the group links this member serves
	roll        groupRoll               // the registrations on the lease this member leads (grouproll.go)
	rollWake    chan struct{}           // the roll changed: rollGroup looks again
	linked      bool                    // a member that does not lead: its link to the leader is up
	delivered   [vias]uint64            // the newest epoch of a quorum record received by each way (State)
	fwdLog      [][]byte                // what a group's leader replays to a member that links (groupquorum.go)
	rec         MemberRecord
	dirty       bool
	stepTimes   time.Duration // the sum of the step times set since the last write
	stepTimesN  int64
	quorum      *Quorum
	revocations map[uint64]Revocation
	settings    map[uint64]JobSettings // by version: the documents views carried
	reach       map[string]reachTarget // blamed peers to dial (reach.go)
	reachWake   chan struct{}
	changed     chan struct{}
	revokedCh   map[uint64]chan struct{}
	err         error // why the membership ended
	done        chan struct{}
	closeOnce   sync.Once
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
	m := &Member{
		cfg:         cfg,
		cli:         cfg.Client,
		keys:        etcdkeys.Layout{Root: cfg.Root},
		lg:          cfg.Logger,
		revocations: map[uint64]Revocation{},
		changed:     make(chan struct{}),
		revokedCh:   map[uint64]chan struct{}{},
		reachWake:   make(chan struct{}, 1),
		done:        make(chan struct{}),
	}
	if m.lg == nil {
		m.lg = zap.NewNop()
	}
	m.lg = m.lg.With(zap.String("job", cfg.Job), zap.String("member", cfg.ID))
	m.key = m.keys.Member(cfg.Job, cfg.ID)
	ok := false
	defer func() {
		if !ok {
			m.release()
		}
	}()

	m.life, m.stop = context.WithCancel(context.Background())
	now := time.Now()
	m.rec = MemberRecord{
		Job: cfg.Job, ID: cfg.ID, Addr: cfg.Addr, Group: cfg.Group, GroupSize: cfg.GroupSize, Spare: cfg.Spare, Host: cfg.Host, SharedLease: cfg.GroupLease,
		Step: cfg.Step, WantQuorum: cfg.WantQuorum, MinReplicas: cfg.MinReplicas, Joined: now, Updated: now,
	}
	if cfg.Stragglers.Factor > 0 {
		p := cfg.Stragglers
		m.rec.Stragglers = &p
	}
	if cfg.GroupLease {
		if err := m.listenGroupLink(); err != nil {
			return nil, err
		}
	} else if err := m.shedRetry(ctx, func() error { return m.ownLease(ctx) }); err != nil {
		return nil, err
	}
	for {
		var run RunRecord
		var rev int64
		err := m.shedRetry(ctx, func() (err error) { run, rev, err = m.enterRun(ctx); return err })
		if err != nil {
			return nil, err
		}
		m.run, m.runRev, m.rec.Run = run.ID, rev, run.ID
		if cfg.GroupLease {
			if err := m.shedRetry(ctx, func() error { return m.enterGroup(ctx) }); err != nil {
				return nil, err
			}
		}
		err = m.shedRetry(ctx, func() error { return m.register(ctx) })
		if errors.Is(err, errGroupMoved) {
			m.dropOwnLease()
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
	var rev int64
	var err error
	switch {
	case !cfg.GroupLease || cfg.GroupEachWatches:
		err = m.shedRetry(ctx, func() (err error) { rev, err = m.loadEpochs(ctx); return err })
	case m.holdsLease():
		err = m.shedRetry(ctx, func() (err error) { rev, err = m.seedForward(ctx); return err })
	}
	if err != nil {
		return nil, err
	}
	if m.gsp != nil {
		if err := m.joinGossip(ctx); err != nil {
			m.lg.Warn("gossip join failed; lease expiry remains the failure detector", zap.Error(err))
		}
	}
	ok = true
	if m.holdsLease() {
		m.mu.Lock()
		lease, ka := m.lease, m.ka
		m.mu.Unlock()
		m.spawn(func() { m.renew(lease, ka) })
	}
	if !cfg.GroupLease || cfg.GroupEachWatches || m.holdsLease() {
		m.spawn(func() { m.watchEpochs(rev) }) // a group's leader forwards what it learns
	}
	m.spawn(m.watchSelf)
	m.spawn(m.reachPeers)
	if cfg.HeartbeatInterval > 0 && m.holdsLease() {
		m.spawn(m.heartbeats)
	}
	if m.gsp != nil {
		m.spawn(m.drainGossip)
	}
	if cfg.GroupLease {
		m.spawn(m.acceptGroupLinks)
		m.spawn(m.followGroup)
		if m.holdsLease() {
			m.mu.Lock()
			created := m.groupRev
			m.mu.Unlock()
			m.spawn(func() { m.rollGroup(created) })
		}
	}
	m.lg.Info("joined", zap.Int64("incarnation", m.inc), zap.String("addr", cfg.Addr))
	return m, nil
}

func (m *Member) spawn(f func()) {
	m.wg.Add(1)
	go func() { defer m.wg.Done(); f() }()
}

// Job returns the member's job.
func (m *Member) Job() string { return m.cfg.Job }

// ID returns the member's id.
func (m *Member) ID() string { return m.cfg.ID }

// Incarnation returns the etcd revision of this registration: a restarted
// member has a larger one.
func (m *Member) Incarnation() int64 { return m.inc }

// Record returns the member's record as it will next be written.
func (m *Member) Record() MemberRecord {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rec
}

// Store returns the rendezvous store of an epoch of the member's job.
func (m *Member) Store(epoch uint64) comm.Store {
	return NewStore(m.cli, m.keys.RendezvousPrefix(m.cfg.Job, epoch))
}

// Done is closed when the membership ends: Leave, Close, or loss of the
// registration (Err then wraps ErrEvicted).
func (m *Member) Done() <-chan struct{} { return m.done }

// Err says why the membership ended (nil while it lasts).
func (m *Member) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.err
}

// lost ends the membership because the registration is gone.
func (m *Member) lost(err error) {
	m.lg.Warn("membership lost", zap.Error(err))
	m.finish(err)
}

// finish records why the membership ended and stops the goroutines
// (without waiting for them: it may run on one of them).
func (m *Member) finish(err error) {
	m.mu.Lock()
	if m.err == nil {
		m.err = err
		close(m.done)
		for e, ch := range m.revokedCh {
			close(ch)
			delete(m.revokedCh, e)
		}
	}
	m.mu.Unlock()
	if m.stop != nil {
		m.stop()
	}
}

// release frees what Join acquired, for a Join that failed.
func (m *Member) release() {
	m.dropOwnLease()
	if m.link != nil {
		m.link.Close()
	}
	if m.stop != nil {
		m.stop()
	}
}

// Leave deregisters the member gracefully: its key and lease go at once,
// gossip peers see a leave (not a death), the coordinator forms the next
// quorum without it. It then releases everything, as Close.
func (m *Member) Leave(ctx context.Context) error {
	var err error
	m.closeOnce.Do(func() {
		alive := m.Err() == nil
		shared := m.leaseShared()
		m.finish(fmt.Errorf("%w: member left", comm.ErrClosed))
		if alive {
			// Say "leaving" first so the coordinator tells a leave from
			// a lease expiry, then drop the lease (and with it the key).
			// After any write in flight: it must not land after this one.
			m.writeM.Lock()
			m.mu.Lock()
			m.rec.Leaving = true
			val, _ := json.Marshal(m.rec)
			lease, holds := m.lease, m.holds
			m.mu.Unlock()
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
			m.writeM.Unlock()
			if e1 != nil || e2 != nil {
				err = fmt.Errorf("membership: leave %s/%s: %w", m.cfg.Job, m.cfg.ID, ctxErr(ctx, errors.Join(e1, e2)))
			}
			if g := m.gossip(); g != nil {
				if e := g.Leave(ctx); e != nil {
					m.lg.Info("gossip leave", zap.Error(e))
				}
			}
		}
		if g := m.gossip(); g != nil {
			g.Close()
		}
		if m.link != nil {
			m.link.Close()
		}
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
