package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

// MemberConfig configures a member: one replica group's leader of a job.
type MemberConfig struct {
	// Client is the etcd client the member uses (required); the caller
	// owns it and closes it after the member.
	Client *clientv3.Client
	// Root is the key prefix (default DefaultRoot).
	Root string
	// Job and ID name the member (ValidName); ID is unique within the job
	// while its holder lives.
	Job, ID string
	// Addr is where the member serves its peers (rendezvous, state
	// transfer); it appears in the quorum. Required.
	Addr string
	// Group is the replica group's name (informational).
	Group string
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
	// link ends, a member takes the lease over (see Keys.GroupLease).
	// GroupLinkAddr is where this member listens for links if it leads
	// (default: Addr's host, a port from the OS); the links ping every
	// GroupLinkInterval (default 200 ms) and end after GroupLinkTimeout
	// of silence (default 1 s).
	GroupLease                          bool
	GroupLinkAddr                       string
	GroupLinkInterval, GroupLinkTimeout time.Duration
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
}

// DefaultMemberConfig returns the defaults of the optional fields; fill
// Client, Job, ID and Addr.
func DefaultMemberConfig() MemberConfig {
	return MemberConfig{Root: DefaultRoot, LeaseTTL: 5 * time.Second, HeartbeatInterval: 10 * time.Second,
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
	keys Keys
	key  string
	inc  int64
	// run is the run the member joined, runRev the revision of its
	// record (0: none, the default run): registration and commit records
	// are fenced on it.
	run    string
	runRev int64
	lg     *zap.Logger
	gsp    *Gossip // nil without gossip; set before the goroutines start, or under mu by takeOver
	ka     <-chan *clientv3.LeaseKeepAliveResponse
	// link listens for the group's liveness links (MemberConfig.GroupLease).
	link    net.Listener
	crashed atomic.Bool // Crash: links end without saying goodbye

	life   context.Context // ends at Leave, Close or loss
	stop   context.CancelFunc
	wg     sync.WaitGroup
	writeM sync.Mutex // orders record writes

	mu sync.Mutex
	// lease is the lease the registration is bound to; holds says
	// whether this member keeps it alive (always, without GroupLease; the
	// group's leader, with it). group and groupRev are the group lease
	// record the registration is bound under and its mod revision.
	lease       clientv3.LeaseID
	holds       bool
	group       GroupLease
	groupRev    int64
	links       map[net.Conn]bool // the group links this member serves (true: said goodbye)
	rec         MemberRecord
	dirty       bool
	stepTimes   time.Duration // the sum of the step times set since the last write
	stepTimesN  int64
	quorum      *Quorum
	revocations map[uint64]Revocation
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
		keys:        Keys{Root: cfg.Root},
		lg:          cfg.Logger,
		revocations: map[uint64]Revocation{},
		changed:     make(chan struct{}),
		revokedCh:   map[uint64]chan struct{}{},
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
		Job: cfg.Job, ID: cfg.ID, Addr: cfg.Addr, Group: cfg.Group, SharedLease: cfg.GroupLease,
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
	} else if err := m.ownLease(ctx); err != nil {
		return nil, err
	}
	for {
		run, rev, err := m.enterRun(ctx)
		if err != nil {
			return nil, err
		}
		m.run, m.runRev, m.rec.Run = run.ID, rev, run.ID
		if cfg.GroupLease {
			if err := m.enterGroup(ctx); err != nil {
				return nil, err
			}
		}
		err = m.register(ctx)
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
	// is current when Join returns.
	rev, err := m.loadEpochs(ctx)
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
		m.spawn(func() { m.renew(m.ka) })
	}
	m.spawn(func() { m.watchEpochs(rev) })
	m.spawn(m.watchSelf)
	if cfg.HeartbeatInterval > 0 && m.holdsLease() {
		m.spawn(m.heartbeats)
	}
	if m.gsp != nil {
		m.spawn(m.drainGossip)
	}
	if cfg.GroupLease {
		m.spawn(m.acceptGroupLinks)
		m.spawn(m.followGroup)
	}
	m.lg.Info("joined", zap.Int64("incarnation", m.inc), zap.String("addr", cfg.Addr))
	return m, nil
}

func (m *Member) spawn(f func()) {
	m.wg.Add(1)
	go func() { defer m.wg.Done(); f() }()
}

// errRunMoved: the job's run changed while the member registered.
var errRunMoved = errors.New("membership: the job's run changed")

// register creates the member key if no other incarnation holds it and
// the job's run is the one the member entered (errRunMoved: it changed).
func (m *Member) register(ctx context.Context) error {
	for {
		m.mu.Lock()
		m.rec.Lease = int64(m.lease)
		val, _ := json.Marshal(m.rec)
		lease := m.lease
		m.mu.Unlock()
		keepOut := m.keys.Evicted(m.cfg.Job, m.cfg.ID)
		runKey := m.keys.Run(m.cfg.Job)
		cmps := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(m.key), "=", 0), clientv3.Compare(clientv3.CreateRevision(keepOut), "=", 0),
			clientv3.Compare(clientv3.ModRevision(runKey), "=", m.runRev)}
		then := []clientv3.Op{clientv3.OpPut(m.key, string(val), clientv3.WithLease(lease))}
		els := []clientv3.Op{clientv3.OpGet(m.key), clientv3.OpGet(keepOut), clientv3.OpGet(runKey)}
		if m.cfg.GroupLease {
			c, op := m.groupBinding()
			cmps, els = append(cmps, c), append(els, clientv3.OpGet(m.groupKey()))
			if op != nil {
				then = append(then, *op)
			}
		}
		tr, err := m.cli.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
		if err != nil {
			return fmt.Errorf("membership: join %s/%s: %w", m.cfg.Job, m.cfg.ID, ctxErr(ctx, err))
		}
		if tr.Succeeded {
			m.inc = tr.Header.Revision
			m.rec.Incarnation = m.inc
			if m.cfg.GroupLease && m.holdsLease() {
				m.mu.Lock()
				m.groupRev = tr.Header.Revision
				m.mu.Unlock()
			}
			return nil
		}
		if m.checkRun(tr.Responses[2].GetResponseRange().Kvs) != nil {
			return errRunMoved
		}
		if m.cfg.GroupLease && m.groupMoved(tr.Responses[3].GetResponseRange().Kvs) {
			return errGroupMoved
		}
		if kos := tr.Responses[1].GetResponseRange().Kvs; len(kos) > 0 {
			var ko KeepOut
			_ = json.Unmarshal(kos[0].Value, &ko)
			return &KeptOutError{Job: m.cfg.Job, ID: m.cfg.ID, By: ko.By, Until: ko.Until}
		}
		kvs := tr.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 0 {
			continue // gone in between
		}
		var holder MemberRecord
		_ = json.Unmarshal(kvs[0].Value, &holder)
		dup := &DuplicateMemberError{Job: m.cfg.Job, ID: m.cfg.ID, Incarnation: kvs[0].CreateRevision, Addr: holder.Addr}
		if !m.cfg.WaitForDuplicate {
			return dup
		}
		m.lg.Info("waiting for the previous incarnation to go", zap.Int64("holder", dup.Incarnation))
		if err := m.waitDeleted(ctx, tr.Header.Revision+1); err != nil {
			return fmt.Errorf("%w (waited: %v)", dup, err)
		}
	}
}

// waitDeleted watches the member key from rev until it is deleted.
func (m *Member) waitDeleted(ctx context.Context, rev int64) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for wr := range m.cli.Watch(wctx, m.key, clientv3.WithRev(rev), clientv3.WithFilterPut()) {
		if err := wr.Err(); err != nil {
			return nil // compacted or similar: the caller reads again
		}
		if len(wr.Events) > 0 {
			return nil
		}
	}
	return context.Cause(ctx)
}

// joinGossip contacts the coordinators and a few members of the job.
func (m *Member) joinGossip(ctx context.Context) error {
	var seeds []string
	resp, err := m.cli.Get(ctx, m.keys.CoordinatorGossip(), clientv3.WithPrefix())
	if err != nil {
		return err
	}
	for _, kv := range resp.Kvs {
		seeds = append(seeds, string(kv.Value))
	}
	resp, err = m.cli.Get(ctx, m.keys.Members(m.cfg.Job), clientv3.WithPrefix(), clientv3.WithLimit(8))
	if err != nil {
		return err
	}
	for _, kv := range resp.Kvs {
		var r MemberRecord
		if json.Unmarshal(kv.Value, &r) == nil && r.Gossip != "" && r.ID != m.cfg.ID {
			seeds = append(seeds, r.Gossip)
		}
	}
	rand.Shuffle(len(seeds), func(i, j int) { seeds[i], seeds[j] = seeds[j], seeds[i] })
	_, err = m.gossip().Join(ctx, seeds)
	return err
}

// Job returns the member's job.
func (m *Member) Job() string { return m.cfg.Job }

// ID returns the member's id.
func (m *Member) ID() string { return m.cfg.ID }

// Incarnation returns the etcd revision of this registration: a restarted
// member has a larger one.
func (m *Member) Incarnation() int64 { return m.inc }

// Lease returns the etcd lease the registration is bound to: with
// MemberConfig.GroupLease, its replica group's (it changes when another
// member of the group takes the lease over).
func (m *Member) Lease() clientv3.LeaseID {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.lease
}

// GossipAddr returns the member's gossip address ("" without gossip).
func (m *Member) GossipAddr() string {
	if g := m.gossip(); g != nil {
		return g.Addr()
	}
	return ""
}

func (m *Member) gossip() *Gossip {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.gsp
}

// Record returns the member's record as it will next be written.
func (m *Member) Record() MemberRecord {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rec
}

// Client returns the etcd client.
func (m *Member) Client() *clientv3.Client { return m.cli }

// Store returns the rendezvous store of an epoch of the member's job.
func (m *Member) Store(epoch uint64) *Store {
	return NewStore(m.cli, m.keys.RendezvousPrefix(m.cfg.Job, epoch))
}

// SetStep records the member's step locally (no I/O); it travels with the
// next heartbeat, RequestQuorum or SetHealth.
func (m *Member) SetStep(step int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.rec.Step != step {
		m.rec.Step = step
		m.dirty = true
	}
}

// SetStepTime records the member's own compute time of one step (no
// I/O): the mean of those set since the member's last write travels with
// its next heartbeat (MemberRecord.StepTime), for the straggler policy
// (MemberConfig.Stragglers). Measure what this replica alone spends on a
// step, not the collectives that wait for its peers: ft.Comm passes the
// time from Step's return to the loop's first collective (or to Commit).
func (m *Member) SetStepTime(d time.Duration) {
	if d <= 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.stepTimes += d
	m.stepTimesN++
	m.dirty = true
}

// SetHealth reports the member's health at once when it changed. A
// Critical member is excluded from the next quorum (the current epoch is
// revoked) until it reports Healthy or Degraded again.
func (m *Member) SetHealth(ctx context.Context, h Health, reason string) error {
	if h < Healthy || h > Critical {
		return fmt.Errorf("%w: membership: health %d", comm.ErrInvalidArgument, int(h))
	}
	m.mu.Lock()
	changed := m.rec.Health != h || m.rec.HealthReason != reason
	m.rec.Health, m.rec.HealthReason = h, reason
	m.mu.Unlock()
	if !changed {
		return nil
	}
	return m.write(ctx, "health")
}

// Finish records that this member's training loop ended the run at step:
// the member takes part in no further quorum, and the coordinator publishes
// the run's end (Quorum.Final). Leave after it.
func (m *Member) Finish(ctx context.Context, step int64) error {
	m.mu.Lock()
	m.rec.Step, m.rec.Finished, m.rec.WantQuorum = step, true, false
	m.mu.Unlock()
	return m.write(ctx, "finish")
}

// Heartbeat writes the member's step and health now.
func (m *Member) Heartbeat(ctx context.Context) error { return m.write(ctx, "heartbeat") }

// RequestQuorum asks to take part in the next quorum (a joiner, or a
// member dropped from the last one). It returns once the request is
// stored; wait for the quorum with NextQuorum or Changed. shrinkOnly
// (from a participant) keeps joiners out of quorums until it calls
// RequestQuorum(ctx, false).
func (m *Member) RequestQuorum(ctx context.Context, shrinkOnly bool) error {
	m.mu.Lock()
	m.rec.WantQuorum, m.rec.ShrinkOnly = true, shrinkOnly
	m.mu.Unlock()
	return m.write(ctx, "request")
}

// ReportCommitFailure tells the coordinator that this member's commit of
// the given epoch failed: the next epoch follows (with the same
// participants when all are alive). blamed names the members whose
// connections failed in it (a reset: their process is likely gone); the
// coordinator checks them — a closed port is a death — before it forms the
// next epoch, so one death costs one epoch.
func (m *Member) ReportCommitFailure(ctx context.Context, epoch uint64, blamed ...string) error {
	m.mu.Lock()
	if epoch < m.rec.CommitFailed || epoch == m.rec.CommitFailed && len(blamed) == 0 {
		m.mu.Unlock()
		return nil
	}
	m.rec.CommitFailed, m.rec.Blamed = epoch, blamed
	m.mu.Unlock()
	return m.write(ctx, "commit failure")
}

// ReportFormed tells the coordinator at once that this member formed, and
// holds, the communicators of epoch: when every continuing participant
// has, the next quorum's Base lets them shrink or grow those instead of
// forming new ones.
func (m *Member) ReportFormed(ctx context.Context, epoch uint64) error {
	m.mu.Lock()
	if m.rec.Formed == epoch {
		m.mu.Unlock()
		return nil
	}
	m.rec.Formed = epoch
	m.mu.Unlock()
	return m.write(ctx, "formed")
}

// CommitRecord is a durable commit record: the epoch whose participants
// committed a step. One exists per step; the first writer wins.
type CommitRecord struct {
	Step  int64     `json:"step"`
	Epoch uint64    `json:"epoch"`
	By    string    `json:"by"`
	At    time.Time `json:"at"`
}

// keptCommitRecords is how many recent commit records a job keeps; each
// RecordCommit that creates one deletes the one this many steps older.
const keptCommitRecords = 1024

// RecordCommit makes this member's commit of step in epoch durable: it
// creates the step's commit record of the member's run, or finds one. ok
// is true when the record names epoch (this member's epoch owns the
// step); false when another epoch committed the step first (rec says
// which), and this member must not apply it. A *RunEndedError: the
// member's run is over (it records nothing).
func (m *Member) RecordCommit(ctx context.Context, step int64, epoch uint64) (rec CommitRecord, ok bool, err error) {
	k, runKey := m.keys.Commit(m.cfg.Job, step), m.keys.Run(m.cfg.Job)
	mine := CommitRecord{Step: step, Epoch: epoch, By: m.cfg.ID, At: time.Now()}
	val, _ := json.Marshal(mine)
	then := []clientv3.Op{clientv3.OpPut(k, string(val))}
	if step >= keptCommitRecords {
		then = append(then, clientv3.OpDelete(m.keys.Commit(m.cfg.Job, step-keptCommitRecords)))
	}
	tr, err := m.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0), clientv3.Compare(clientv3.ModRevision(runKey), "=", m.runRev)).
		Then(then...).Else(clientv3.OpGet(k), clientv3.OpGet(runKey)).Commit()
	if err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: record commit of step %d: %w", step, ctxErr(ctx, err))
	}
	if tr.Succeeded {
		return mine, true, nil
	}
	if err := m.checkRun(tr.Responses[1].GetResponseRange().Kvs); err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: record commit of step %d: %w", step, err)
	}
	kvs := tr.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 { // deleted in between: only records far behind are
		return CommitRecord{}, false, fmt.Errorf("membership: commit record of step %d vanished", step)
	}
	if err := json.Unmarshal(kvs[0].Value, &rec); err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: commit record of step %d: %w", step, err)
	}
	return rec, rec.Epoch == epoch, nil
}

// LastCommit returns the newest durable commit record of the member's
// run (ok false when there is none; a *RunEndedError when the run is
// over).
func (m *Member) LastCommit(ctx context.Context) (rec CommitRecord, ok bool, err error) {
	tr, err := m.cli.Txn(ctx).Then(
		clientv3.OpGet(m.keys.Commits(m.cfg.Job), clientv3.WithPrefix(),
			clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(1)),
		clientv3.OpGet(m.keys.Run(m.cfg.Job)),
	).Commit()
	if err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: read commit records: %w", ctxErr(ctx, err))
	}
	if err := m.checkRun(tr.Responses[1].GetResponseRange().Kvs); err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: read commit records: %w", err)
	}
	kvs := tr.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return CommitRecord{}, false, nil
	}
	if err := json.Unmarshal(kvs[0].Value, &rec); err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: commit record %s: %w", kvs[0].Key, err)
	}
	return rec, true, nil
}

// write stores the record if this incarnation still holds the key.
func (m *Member) write(ctx context.Context, why string) error {
	if err := m.Err(); err != nil {
		return err
	}
	m.writeM.Lock()
	defer m.writeM.Unlock()
	if err := m.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	m.rec.Updated = time.Now()
	if m.stepTimesN > 0 {
		m.rec.StepTime = m.stepTimes / time.Duration(m.stepTimesN)
		m.stepTimes, m.stepTimesN = 0, 0
	}
	val, _ := json.Marshal(m.rec)
	m.dirty = false
	lease := m.lease
	m.mu.Unlock()
	tr, err := m.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(m.key), "=", m.inc)).
		Then(clientv3.OpPut(m.key, string(val), clientv3.WithLease(lease))).Commit()
	if err != nil {
		m.mu.Lock()
		m.dirty = true
		m.mu.Unlock()
		return fmt.Errorf("membership: %s/%s %s: %w", m.cfg.Job, m.cfg.ID, why, ctxErr(ctx, err))
	}
	if !tr.Succeeded {
		m.lost(fmt.Errorf("%w: %s/%s: registration gone", ErrEvicted, m.cfg.Job, m.cfg.ID))
		return m.Err()
	}
	return nil
}

// Revoke records that an epoch must stop (e.g. a peer failed in a
// collective), so every member's Revoked(epoch) fires. The first record of
// an epoch wins; revoking again is a no-op. The coordinator then forms the
// next epoch.
func (m *Member) Revoke(ctx context.Context, epoch uint64, reason string, failed ...string) error {
	r := Revocation{Epoch: epoch, Reason: reason, Failed: failed, By: m.cfg.ID, At: time.Now()}
	val, _ := json.Marshal(r)
	k := m.keys.Revocation(m.cfg.Job, epoch)
	_, err := m.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
		Then(clientv3.OpPut(k, string(val))).Commit()
	if err != nil {
		return fmt.Errorf("membership: revoke epoch %d: %w", epoch, ctxErr(ctx, err))
	}
	return nil
}

// Quorum returns the latest published quorum of the job (no I/O), as a
// member sees it: its participants carry their ID, Group and Incarnation
// (not Addr or Step, which the full record holds: coordinator.Admin's
// Quorum reads it), and its Reason may be shortened.
func (m *Member) Quorum() (Quorum, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.quorum == nil {
		return Quorum{}, false
	}
	return *m.quorum, true
}

// Changed returns a channel closed at the next change of the published
// quorum or of the revocations; call again for the one after.
func (m *Member) Changed() <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.changed
}

// NextQuorum waits for a quorum with an epoch above after (after 0: any
// quorum) and returns it, or fails when ctx ends or the membership does.
func (m *Member) NextQuorum(ctx context.Context, after uint64) (Quorum, error) {
	for {
		m.mu.Lock()
		q, ch := m.quorum, m.changed
		m.mu.Unlock()
		if q != nil && q.Epoch > after {
			return *q, nil
		}
		select {
		case <-ch:
		case <-m.done:
			return Quorum{}, m.Err()
		case <-ctx.Done():
			return Quorum{}, fmt.Errorf("membership: waiting for a quorum after epoch %d: %w", after, context.Cause(ctx))
		}
	}
}

// Revoked returns a channel closed once the epoch is revoked (a
// revocation record exists or a later quorum was published) or the
// membership has ended.
func (m *Member) Revoked(epoch uint64) <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil || m.revokedLocked(epoch) {
		ch := make(chan struct{})
		close(ch)
		return ch
	}
	ch, ok := m.revokedCh[epoch]
	if !ok {
		ch = make(chan struct{})
		m.revokedCh[epoch] = ch
	}
	return ch
}

// Revocation returns the revocation record of an epoch, if one was seen.
func (m *Member) Revocation(epoch uint64) (Revocation, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.revocations[epoch]
	return r, ok
}

// Revocations returns the revocation records seen (the last 64 epochs'),
// oldest first.
func (m *Member) Revocations() []Revocation {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Revocation, 0, len(m.revocations))
	for _, r := range m.revocations {
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Epoch < out[j].Epoch })
	return out
}

func (m *Member) revokedLocked(epoch uint64) bool {
	if _, ok := m.revocations[epoch]; ok {
		return true
	}
	return m.quorum != nil && m.quorum.Epoch > epoch
}

// notifyLocked wakes Changed waiters and closes the Revoked channels of
// revoked epochs.
func (m *Member) notifyLocked() {
	close(m.changed)
	m.changed = make(chan struct{})
	for e, ch := range m.revokedCh {
		if m.revokedLocked(e) {
			close(ch)
			delete(m.revokedCh, e)
		}
	}
	// Keep the last 64 revocations.
	if m.quorum != nil {
		for e := range m.revocations {
			if e+64 < m.quorum.Epoch {
				delete(m.revocations, e)
			}
		}
	}
}

// applyLocked takes a quorum view, the full quorum record or a revocation
// record. needFull: a view the member could not apply (a change of an
// epoch it does not hold); read the full record (readFull). Called with
// mu held.
func (m *Member) applyLocked(kv *mvccpb.KeyValue) (changed, needFull bool) {
	k := string(kv.Key)
	switch k {
	case m.keys.QuorumView(m.cfg.Job), m.keys.QuorumViewFull(m.cfg.Job):
		h, added, err := decodeView(kv.Value, m.cfg.QuorumVerifier)
		if err == nil && h.Job != m.cfg.Job {
			err = fmt.Errorf("%w: the record is of job %q", ErrForgedQuorum, h.Job)
		}
		if err != nil {
			m.lg.Warn("ignored a quorum record", zap.Int64("revision", kv.ModRevision), zap.Error(err))
			return false, false
		}
		if m.quorum != nil && h.Epoch <= m.quorum.Epoch {
			return false, false
		}
		if r := h.Revocation; r != nil {
			if _, ok := m.revocations[r.Epoch]; !ok {
				m.revocations[r.Epoch] = *r
			}
		}
		q, ok := applyView(h, added, m.quorum)
		if !ok {
			return false, true
		}
		m.quorum = &q
		return true, false
	case m.keys.Quorum(m.cfg.Job):
		q, err := m.readQuorum(kv.Value)
		if err != nil {
			m.lg.Warn("ignored a quorum record", zap.Int64("revision", kv.ModRevision), zap.Error(err))
			return false, false
		}
		if m.quorum == nil || q.Epoch > m.quorum.Epoch {
			q = compact(q)
			m.quorum = &q
			return true, false
		}
		return false, false
	}
	var r Revocation
	if err := json.Unmarshal(kv.Value, &r); err != nil {
		m.lg.Warn("unreadable revocation record", zap.String("key", k), zap.Error(err))
		return false, false
	}
	if _, ok := m.revocations[r.Epoch]; ok {
		return false, false
	}
	m.revocations[r.Epoch] = r
	return true, false
}

// readFull reads the whole list of the quorum (Keys.QuorumViewFull) as of
// rev (0: the latest), for a view the member could not apply, and takes
// it in; the full record when that brings nothing new (a coordinator that
// writes no whole list).
func (m *Member) readFull(ctx context.Context, rev int64) error {
	var opts []clientv3.OpOption
	if rev > 0 {
		opts = append(opts, clientv3.WithRev(rev))
	}
	for _, key := range []string{m.keys.QuorumViewFull(m.cfg.Job), m.keys.Quorum(m.cfg.Job)} {
		resp, err := m.cli.Get(ctx, key, opts...)
		if err != nil {
			return fmt.Errorf("membership: read quorum of %s: %w", m.cfg.Job, ctxErr(ctx, err))
		}
		if m.applyAll(resp.Kvs) {
			return nil
		}
	}
	return nil
}

// readQuorum decodes a quorum record of the member's job, verifying its
// signature when the member has a verifier.
func (m *Member) readQuorum(raw []byte) (Quorum, error) {
	var q Quorum
	if v := m.cfg.QuorumVerifier; v != nil {
		var err error
		if q, err = v.Verify(raw); err != nil {
			return Quorum{}, err
		}
	} else if err := json.Unmarshal(raw, &q); err != nil {
		return Quorum{}, fmt.Errorf("membership: unreadable quorum record: %w", err)
	}
	if q.Job != m.cfg.Job {
		return Quorum{}, fmt.Errorf("%w: the record is of job %q", ErrForgedQuorum, q.Job)
	}
	return q, nil
}

// loadEpochs reads the quorum (its view; the full record when the view is
// a change of an epoch the member does not hold) and revocations and
// returns the revision read at.
func (m *Member) loadEpochs(ctx context.Context) (int64, error) {
	resp, err := m.cli.Txn(ctx).Then(
		clientv3.OpGet(m.keys.QuorumView(m.cfg.Job)),
		clientv3.OpGet(m.keys.Revocations(m.cfg.Job), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return 0, fmt.Errorf("membership: read quorum of %s: %w", m.cfg.Job, ctxErr(ctx, err))
	}
	rev := resp.Header.Revision
	m.mu.Lock()
	changed, needFull := false, false
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			c, f := m.applyLocked(kv)
			changed, needFull = changed || c, needFull || f
		}
	}
	if changed {
		m.notifyLocked()
	}
	m.mu.Unlock()
	if needFull {
		// The whole list of the same revision: views and record are
		// written together.
		if err := m.readFull(ctx, rev); err != nil {
			return 0, err
		}
	}
	return rev, nil
}

// watchEpochs follows the quorum view and the revocations (two watches:
// only coordinators write the one, members the others) from rev+1 until
// the membership ends, re-reading both after a compaction or a broken
// watch. It does not watch the full quorum record, nor any member's
// record: per epoch a member receives the view, a few bytes per
// participant that changed.
func (m *Member) watchEpochs(rev int64) {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, 2*time.Second, 0
	for m.life.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(m.life))
		quorum := m.cli.Watch(wctx, m.keys.QuorumView(m.cfg.Job), clientv3.WithRev(rev+1))
		revoked := m.cli.Watch(wctx, m.keys.Revocations(m.cfg.Job), clientv3.WithPrefix(), clientv3.WithRev(rev+1))
		for {
			var wr clientv3.WatchResponse
			var ok, isQuorum bool
			select {
			case wr, ok = <-quorum:
				isQuorum = true
			case wr, ok = <-revoked:
			}
			if !ok || wr.Err() != nil {
				if m.life.Err() == nil {
					m.lg.Info("quorum watch broke; reading again", zap.Error(wr.Err()))
				}
				break
			}
			bo.Reset()
			if isQuorum && m.needsCatchUp(wr.Events) {
				// The two watches are not ordered with each other: read
				// the revocations a new quorum may have overtaken, so
				// that Revoked never fires before Revocation has its
				// record.
				m.catchUpRevocations(wctx, wr.Header.Revision)
			}
			m.mu.Lock()
			changed, needFull := false, false
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.PUT {
					c, f := m.applyLocked(ev.Kv)
					changed, needFull = changed || c, needFull || f
				}
			}
			if changed {
				m.notifyLocked()
			}
			m.mu.Unlock()
			if needFull {
				if err := m.readFull(wctx, 0); err != nil && m.life.Err() == nil {
					m.lg.Info("reading the quorum record failed; reading again", zap.Error(err))
					break
				}
			}
		}
		cancel()
		if m.life.Err() != nil {
			return
		}
		for m.life.Err() == nil {
			r, err := m.loadEpochs(m.life)
			if err == nil {
				rev = r
				break
			}
			select {
			case <-time.After(bo.NextBackOff()):
			case <-m.life.Done():
			}
		}
	}
}

// needsCatchUp reports whether a new view may have overtaken a
// revocation record: not when the member had no quorum (nothing of its
// to revoke) nor when the view carries the revocation of the epoch it
// ends. Reading them costs etcd a range request per member per epoch.
func (m *Member) needsCatchUp(evs []*clientv3.Event) bool {
	m.mu.Lock()
	none := m.quorum == nil
	m.mu.Unlock()
	if none {
		return false
	}
	for _, ev := range evs {
		if h, ok := viewHeader(ev.Kv.Value); !ok || h.Revocation == nil {
			return true
		}
	}
	return false
}

// catchUpRevocations reads the revocation records of the current epoch
// and later ones, as of revision rev, and takes them in.
func (m *Member) catchUpRevocations(ctx context.Context, rev int64) {
	m.mu.Lock()
	var from uint64
	if m.quorum != nil {
		from = m.quorum.Epoch
	}
	m.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := m.cli.Get(ctx, m.keys.Revocation(m.cfg.Job, from),
		clientv3.WithRange(clientv3.GetPrefixRangeEnd(m.keys.Revocations(m.cfg.Job))), clientv3.WithRev(rev))
	if err != nil {
		return // the watch delivers them anyway, later
	}
	m.applyAll(resp.Kvs)
}

// applyAll applies records read from etcd and wakes the waiters if any
// changed what the member knows; it reports whether one did.
func (m *Member) applyAll(kvs []*mvccpb.KeyValue) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	changed := false
	for _, kv := range kvs {
		c, _ := m.applyLocked(kv)
		changed = changed || c
	}
	if changed {
		m.notifyLocked()
	}
	return changed
}

// watchSelf ends the membership when the member key is deleted (eviction,
// lease expiry, a coordinator's verdict of death).
func (m *Member) watchSelf() {
	rev := m.inc + 1
	for m.life.Err() == nil {
		for wr := range m.cli.Watch(m.life, m.key, clientv3.WithRev(rev), clientv3.WithFilterPut()) {
			if wr.Err() != nil {
				break
			}
			if len(wr.Events) > 0 {
				m.lost(fmt.Errorf("%w: %s/%s: registration deleted", ErrEvicted, m.cfg.Job, m.cfg.ID))
				return
			}
			rev = wr.Header.Revision + 1
		}
		if m.life.Err() != nil {
			return
		}
		// Compacted past our revision: look at the key itself.
		resp, err := m.cli.Get(m.life, m.key)
		if err != nil {
			continue
		}
		if len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != m.inc {
			m.lost(fmt.Errorf("%w: %s/%s: registration gone", ErrEvicted, m.cfg.Job, m.cfg.ID))
			return
		}
		rev = resp.Header.Revision + 1
	}
}

// renew drains lease keepalive responses; the channel closes when the
// lease is gone (expired, revoked) or the membership ends.
func (m *Member) renew(ka <-chan *clientv3.LeaseKeepAliveResponse) {
	for range ka {
	}
	if m.life.Err() == nil {
		m.lost(fmt.Errorf("%w: %s/%s: lease %x expired or revoked", ErrEvicted, m.cfg.Job, m.cfg.ID, int64(m.Lease())))
	}
}

func (m *Member) heartbeats() {
	t := time.NewTicker(m.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			m.mu.Lock()
			dirty := m.dirty
			m.mu.Unlock()
			if dirty {
				ctx, cancel := context.WithTimeout(m.life, m.cfg.HeartbeatInterval)
				if err := m.write(ctx, "heartbeat"); err != nil && !errors.Is(err, ErrEvicted) && m.life.Err() == nil {
					m.lg.Warn("heartbeat failed", zap.Error(err))
				}
				cancel()
			}
		case <-m.life.Done():
			return
		}
	}
}

func (m *Member) drainGossip() {
	g := m.gossip()
	for {
		select {
		case ev := <-g.Events():
			if ev.Kind != GossipJoin {
				m.lg.Debug("gossip", zap.Stringer("event", ev.Kind), zap.String("node", ev.Name))
			}
		case <-m.life.Done():
			return
		}
	}
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

// waitNoticeAfter is how long an etcd call may wait before waitNotice
// says what it waits for; waitNoticeEvery how often it says it again.
const (
	waitNoticeAfter = time.Second
	waitNoticeEvery = 5 * time.Second
)

// waitNotice logs, while the call it was started for has not returned,
// that it waits for etcd, where, and what is in the way (the port refuses
// connections, or answers but the client cannot connect: TLS or
// credentials). The returned func stops it and waits for its goroutine.
func waitNotice(cli *clientv3.Client, lg *zap.Logger, what string) (stop func()) {
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTimer(waitNoticeAfter)
		defer t.Stop()
		start := time.Now()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			eps := cli.Endpoints()
			fields := []zap.Field{zap.Strings("endpoints", eps), zap.Duration("waited", time.Since(start).Round(time.Millisecond))}
			if cc := cli.ActiveConnection(); cc != nil {
				fields = append(fields, zap.Stringer("connection", cc.GetState()))
			}
			var probs []string
			for _, ep := range eps {
				host := ep
				if u, err := url.Parse(ep); err == nil && u.Host != "" {
					host = u.Host
				}
				c, err := net.DialTimeout("tcp", host, 500*time.Millisecond)
				if err != nil {
					probs = append(probs, err.Error())
					continue
				}
				c.Close()
				probs = append(probs, host+" accepts connections but the client is not connected (TLS or credentials?)")
			}
			fields = append(fields, zap.Strings("why", probs))
			lg.Warn("waiting for the coordinator's etcd to "+what+" (is ftcoord running and reachable?)", fields...)
			t.Reset(waitNoticeEvery)
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-exited }) }
}
