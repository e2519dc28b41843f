package coordinator

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// Config configures a Coordinator.
type Config struct {
	// Client is the etcd client (required; the caller closes it).
	Client *clientv3.Client
	// Root is the key prefix (default membership.DefaultRoot).
	Root string
	// Name tells coordinator instances apart (default host-pid).
	Name string
	// Quorum holds the rules for every job; members may raise
	// MinReplicas for theirs.
	Quorum quorum.Config
	// SessionTTL is the lease of the leader's election key: a killed
	// leader is replaced about this long after it stops (min 2 s,
	// default 3 s).
	SessionTTL time.Duration
	// Gossip makes the coordinator a gossip node, so it learns of a
	// member's death directly (nil: off; lease expiry then detects it).
	Gossip *membership.GossipConfig
	// HistoryLimit is how many past quorums (and revocations) each job
	// keeps in etcd (default 100).
	HistoryLimit int
	// EvictKeepOut is how long a member evicted through Evict may not
	// register again (default DefaultEvictKeepOut; negative: not at
	// all).
	EvictKeepOut time.Duration
	// QuorumSigner, when set, signs every quorum the coordinator
	// publishes (members with the matching membership.QuorumVerifier act
	// on no other), and lets the leader tell its own quorum records from
	// foreign ones when it loads them. Coordinators of one root must
	// share the key: each publishes its key id, and one whose id differs
	// from a running instance's fails with ErrKeyMismatch.
	QuorumSigner *QuorumSigner
	// Logger (nil: none).
	Logger *zap.Logger
	// Registerer receives the coordinator's metrics (nil: none).
	Registerer prometheus.Registerer
}

// DefaultConfig returns the defaults; fill Client.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		Root:         membership.DefaultRoot,
		Name:         fmt.Sprintf("%s-%d", host, os.Getpid()),
		Quorum:       quorum.DefaultConfig(),
		SessionTTL:   3 * time.Second,
		HistoryLimit: 100,
		EvictKeepOut: DefaultEvictKeepOut,
	}
}

// Validate says what is wrong with the configuration, if anything.
func (c Config) Validate() error {
	if c.Client == nil {
		return fmt.Errorf("%w: coordinator: coordinator needs an etcd Client", comm.ErrInvalidArgument)
	}
	if err := checkName("coordinator name", c.Name); err != nil {
		return err
	}
	if err := c.Quorum.Validate(); err != nil {
		return err
	}
	if c.SessionTTL < 2*time.Second {
		return fmt.Errorf("%w: coordinator: SessionTTL %v is below etcd's minimum of 2s", comm.ErrInvalidArgument, c.SessionTTL)
	}
	if c.HistoryLimit < 1 {
		return fmt.Errorf("%w: coordinator: HistoryLimit %d must be at least 1", comm.ErrInvalidArgument, c.HistoryLimit)
	}
	if c.Gossip != nil {
		return c.Gossip.Validate()
	}
	return nil
}

// Coordinator forms and publishes the quorums of every job under its
// root. Several may run; one leads (etcd election) and only its writes
// pass the fence. Create with New, then Run.
type Coordinator struct {
	cfg     Config
	cli     *clientv3.Client
	keys    membership.Keys
	lg      *zap.Logger
	metrics *coordMetrics
	gsp     *membership.Gossip

	leader atomic.Bool
	leadCh chan struct{} // closed while leading

	mu       sync.Mutex
	status   map[string]JobStatus // leader's view, for the API
	deadSeen map[string]time.Time // gossip deaths seen, by node name
	running  bool
}

// JobStatus is the leader's live view of a job.
type JobStatus struct {
	Job     string             `json:"job"`
	Members int                `json:"members"`
	Quorum  *membership.Quorum `json:"quorum,omitempty"`
	Waiting string             `json:"waiting,omitempty"` // why no quorum forms, if one is needed
	Updated time.Time          `json:"updated"`
}

// New checks the configuration and prepares a coordinator.
func New(cfg Config) (*Coordinator, error) {
	d := DefaultConfig()
	if cfg.Root == "" {
		cfg.Root = d.Root
	}
	if cfg.Name == "" {
		cfg.Name = d.Name
	}
	if cfg.Quorum == (quorum.Config{}) {
		cfg.Quorum = d.Quorum
	}
	if cfg.SessionTTL == 0 {
		cfg.SessionTTL = d.SessionTTL
	}
	if cfg.HistoryLimit == 0 {
		cfg.HistoryLimit = d.HistoryLimit
	}
	if cfg.EvictKeepOut == 0 {
		cfg.EvictKeepOut = d.EvictKeepOut
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := &Coordinator{
		cfg:      cfg,
		cli:      cfg.Client,
		keys:     membership.Keys{Root: cfg.Root},
		lg:       cfg.Logger,
		status:   map[string]JobStatus{},
		leadCh:   make(chan struct{}),
		deadSeen: map[string]time.Time{},
	}
	if c.lg == nil {
		c.lg = zap.NewNop()
	}
	c.lg = c.lg.With(zap.String("coordinator", cfg.Name))
	m, err := newCoordMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	c.metrics = m
	return c, nil
}

// Name returns the instance's name.
func (c *Coordinator) Name() string { return c.cfg.Name }

// IsLeader reports whether this instance leads now.
func (c *Coordinator) IsLeader() bool { return c.leader.Load() }

// GossipAddr returns the coordinator's gossip address once Run started it
// ("" without gossip).
func (c *Coordinator) GossipAddr() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gsp == nil {
		return ""
	}
	return c.gsp.Addr()
}

// GossipStats returns the counters of the coordinator's gossip node
// (zero without gossip, or before Run started it).
func (c *Coordinator) GossipStats() membership.GossipStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gsp == nil {
		return membership.GossipStats{}
	}
	return c.gsp.Stats()
}

// Status returns the leader's view of a job (ok false on a follower or
// for an unknown job).
func (c *Coordinator) Status(job string) (JobStatus, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s, ok := c.status[job]
	return s, ok && c.leader.Load()
}

// Evict removes a member of a job and keeps it out for EvictKeepOut
// (see Admin.EvictFor); it works on any instance: the leader sees the
// eviction through etcd.
func (c *Coordinator) Evict(ctx context.Context, job, id, by string) error {
	_, err := c.EvictFor(ctx, job, id, by, c.cfg.EvictKeepOut)
	return err
}

// EvictFor is Evict with its own keep-out time (0 or less: none); it
// returns the end of the keep-out.
func (c *Coordinator) EvictFor(ctx context.Context, job, id, by string, keepOut time.Duration) (keptOutUntil time.Time, err error) {
	return NewAdmin(c.cli, c.cfg.Root).EvictFor(ctx, job, id, by, keepOut)
}

// Run campaigns for leadership and, while leading, forms and publishes
// quorums, until ctx ends. It starts the coordinator's gossip node first
// when configured. Run returns ctx's error, or an error wrapping
// ErrKeyMismatch when another instance signs quorums with another key;
// call it once.
func (c *Coordinator) Run(ctx context.Context) error {
	c.mu.Lock()
	if c.running {
		c.mu.Unlock()
		return fmt.Errorf("%w: coordinator: coordinator %s is already running", comm.ErrInvalidArgument, c.cfg.Name)
	}
	c.running = true
	c.mu.Unlock()

	var wg sync.WaitGroup
	defer wg.Wait()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	gossipEvents := make(chan membership.GossipEvent, 1024)
	if c.cfg.Gossip != nil {
		g, err := membership.StartGossip("_coordinator/"+c.cfg.Name, *c.cfg.Gossip)
		if err != nil {
			return err
		}
		c.mu.Lock()
		c.gsp = g
		c.mu.Unlock()
		defer g.Close()
		defer g.Leave(context.Background())
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.pumpGossip(ctx, g, gossipEvents)
		}()
	}
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 100*time.Millisecond, 3*time.Second, 0
	for ctx.Err() == nil {
		err := c.campaignAndLead(ctx, gossipEvents)
		c.setLeader(false)
		if ctx.Err() != nil {
			break
		}
		if errors.Is(err, ErrKeyMismatch) {
			c.lg.Error("not campaigning", zap.Error(err))
			return err
		}
		c.lg.Warn("leadership ended", zap.Error(err))
		select {
		case <-time.After(bo.NextBackOff()):
		case <-ctx.Done():
		}
	}
	return ctx.Err()
}

func (c *Coordinator) setLeader(on bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.leader.Load() == on {
		return
	}
	c.leader.Store(on)
	if on {
		close(c.leadCh)
		c.metrics.leader.Set(1)
	} else {
		c.leadCh = make(chan struct{})
		c.metrics.leader.Set(0)
	}
}

// Leading returns a channel that is closed while this instance leads (a
// new one after leadership is lost).
func (c *Coordinator) Leading() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.leadCh
}

// pumpGossip remembers deaths (for a leadership that starts later) and
// passes events on; it joins the coordinator's gossip node to the others
// and re-joins when it finds itself alone.
func (c *Coordinator) pumpGossip(ctx context.Context, g *membership.Gossip, out chan<- membership.GossipEvent) {
	for {
		select {
		case ev := <-g.Events():
			c.metrics.gossipAlive.Set(float64(g.NumAlive()))
			if ev.Kind == membership.GossipDead {
				c.mu.Lock()
				c.deadSeen[ev.Name] = ev.At
				for n, at := range c.deadSeen {
					if time.Since(at) > time.Minute {
						delete(c.deadSeen, n)
					}
				}
				c.mu.Unlock()
			}
			if ev.Kind != membership.GossipDead {
				continue
			}
			select {
			case out <- ev:
			default:
				// No leader loop is reading (a follower) and the buffer is
				// full: deadSeen keeps it for the next leadership's load.
			}
		case <-ctx.Done():
			return
		}
	}
}

// joinGossipPeers joins the other coordinators and a few members of
// every job (after a restart, members are the only ones left to ask).
func (c *Coordinator) joinGossipPeers(ctx context.Context) {
	c.mu.Lock()
	g := c.gsp
	c.mu.Unlock()
	if g == nil {
		return
	}
	var seeds []string
	resp, err := c.cli.Get(ctx, c.keys.CoordinatorGossip(), clientv3.WithPrefix())
	if err == nil {
		for _, kv := range resp.Kvs {
			if string(kv.Value) != g.Addr() {
				seeds = append(seeds, string(kv.Value))
			}
		}
	}
	if len(seeds) == 0 && g.NumAlive() <= 1 {
		resp, err := c.cli.Get(ctx, c.keys.Prefix(), clientv3.WithPrefix())
		if err == nil {
			for _, kv := range resp.Kvs {
				if _, kind, _, ok := c.keys.Parse(string(kv.Key)); ok && kind == "members" && len(seeds) < 16 {
					var r membership.MemberRecord
					if json.Unmarshal(kv.Value, &r) == nil && r.Gossip != "" {
						seeds = append(seeds, r.Gossip)
					}
				}
			}
		}
	}
	if _, err := g.Join(ctx, seeds); err != nil {
		c.lg.Info("gossip join", zap.Error(err))
	}
}

func (c *Coordinator) campaignAndLead(ctx context.Context, gossipEvents <-chan membership.GossipEvent) error {
	// The session outlives ctx by the few calls of a graceful exit, so
	// that it can resign and revoke its lease: a standby then takes over
	// at once instead of after SessionTTL.
	sessCtx, sessCancel := context.WithCancel(context.Background())
	defer sessCancel()
	var sess *concurrency.Session
	if err := withCtx(ctx, func() error {
		s, err := concurrency.NewSession(c.cli, concurrency.WithTTL(int((c.cfg.SessionTTL+time.Second-1)/time.Second)), concurrency.WithContext(sessCtx))
		sess = s
		return err
	}); err != nil {
		return fmt.Errorf("coordinator: coordinator session: %w", err)
	}
	defer func() {
		// Close revokes the lease, bounded by the client's own timeouts.
		done := make(chan struct{})
		go func() { sess.Close(); close(done) }()
		select {
		case <-done:
		case <-time.After(2 * time.Second):
		}
	}()
	if err := c.publishKeyID(ctx, sess); err != nil {
		return err
	}
	if addr := c.GossipAddr(); addr != "" {
		if _, err := c.cli.Put(ctx, c.keys.CoordinatorGossip()+c.cfg.Name, addr, clientv3.WithLease(sess.Lease())); err != nil {
			return fmt.Errorf("coordinator: publish gossip address: %w", err)
		}
		c.joinGossipPeers(ctx)
	}
	el := concurrency.NewElection(sess, c.keys.Election())
	if err := el.Campaign(ctx, c.cfg.Name); err != nil {
		return fmt.Errorf("coordinator: campaign: %w", err)
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.Background(), time.Second)
		el.Resign(rctx)
		cancel()
	}()
	c.lg.Info("leading", zap.String("key", el.Key()), zap.Int64("rev", el.Rev()))
	c.setLeader(true)
	l := &leadership{c: c, sess: sess, fenceKey: el.Key(), fenceRev: el.Rev(), jobs: map[string]*jobState{},
		verified: make(chan verdict, 64)}
	return l.run(ctx, gossipEvents)
}

// unsignedKeyID stands for "no signer" among the coordinators' key ids.
const unsignedKeyID = "unsigned"

// publishKeyID checks that every other live instance signs quorums with
// this instance's key (members trust only the keys in their credentials,
// and would ignore the quorums of an instance with another), then
// publishes this instance's key id under its session.
func (c *Coordinator) publishKeyID(ctx context.Context, sess *concurrency.Session) error {
	mine := unsignedKeyID
	if s := c.cfg.QuorumSigner; s != nil {
		mine = s.KeyID()
	}
	prefix := c.keys.CoordinatorKeys()
	resp, err := c.cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		return fmt.Errorf("coordinator: read coordinators' keys: %w", ctxErr(ctx, err))
	}
	for _, kv := range resp.Kvs {
		name := strings.TrimPrefix(string(kv.Key), prefix)
		if name != c.cfg.Name && string(kv.Value) != mine {
			return fmt.Errorf("%w: coordinator %s signs quorums with key %s, this one (%s) with %s: give every coordinator of root %s the same secrets",
				ErrKeyMismatch, name, kv.Value, c.cfg.Name, mine, strings.TrimSuffix(c.keys.Prefix(), "/"))
		}
	}
	if _, err := c.cli.Put(ctx, prefix+c.cfg.Name, mine, clientv3.WithLease(sess.Lease())); err != nil {
		return fmt.Errorf("coordinator: publish key id: %w", ctxErr(ctx, err))
	}
	return nil
}

// withCtx runs f (which cannot take ctx) and returns early when ctx ends.
func withCtx(ctx context.Context, f func() error) error {
	ch := make(chan error, 1)
	go func() { ch <- f() }()
	select {
	case err := <-ch:
		return err
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// leadership is one term of leading.
type leadership struct {
	c        *Coordinator
	sess     *concurrency.Session
	fenceKey string
	fenceRev int64
	jobs     map[string]*jobState
	byNode   map[string]memberRef // gossip node name → member
	doomed   []doomedMember       // registrations to delete after publishing
	// verified receives the verdicts on members reported failed by a peer
	// (see verifyReported).
	verified chan verdict
	ctx      context.Context // the leadership's, for the verifying dials
}

type doomedMember struct {
	job string
	rec membership.MemberRecord
}

type memberRef struct {
	job, id string
	inc     int64
}

// verdict is the outcome of checking a reported death: dead when the
// member's address refused a connection (its process is gone).
type verdict struct {
	memberRef
	dead bool
	err  error // the dial's (nil: it connected)
}

type jobState struct {
	m         *quorum.Machine
	quorumRev int64  // mod revision of the quorum key we last wrote or read (0: no key)
	ownRev    int64  // revision of our last write of the key, a deletion included
	lastValue []byte // the record we last wrote (or loaded and trusted)
	// inflight is a record whose write failed without an answer: seeing
	// it in the watch means it was stored after all.
	inflight  []byte
	inflightQ membership.Quorum
	// foreign is a write of the quorum key by someone else, to repair.
	foreign *foreignWrite
	dirty   bool
	wakeAt  time.Time
	waiting string
	// stalled are the members that wait for a holder of a committed step
	// (MemberRecord.WaitingFor), by id.
	stalled map[string]bool
}

// foreignWrite is a write of a job's quorum key that no leader made.
type foreignWrite struct {
	rev     int64  // its mod revision (0: the key was deleted); of the record when view
	epoch   uint64 // the epoch it claims, if readable
	deleted bool
	view    bool // a write of the view, not the record
}

func (l *leadership) job(name string) *jobState {
	j, ok := l.jobs[name]
	if !ok {
		j = &jobState{m: quorum.NewMachine(name, l.c.cfg.Quorum, nil)}
		l.jobs[name] = j
	}
	return j
}

// load reads every job's state and returns the revision read at.
func (l *leadership) load(ctx context.Context) (int64, error) {
	resp, err := l.c.cli.Get(ctx, l.c.keys.Prefix(), clientv3.WithPrefix())
	if err != nil {
		return 0, fmt.Errorf("coordinator: load state: %w", err)
	}
	l.jobs = map[string]*jobState{}
	l.byNode = map[string]memberRef{}
	type pending struct {
		job string
		rec membership.MemberRecord
	}
	var recs []pending
	var revs []membership.Revocation
	var revJobs []string
	quorums := map[string]*mvccpb.KeyValue{}
	history := map[string][]*mvccpb.KeyValue{}
	for _, kv := range resp.Kvs {
		job, kind, rest, ok := l.c.keys.Parse(string(kv.Key))
		if !ok {
			continue
		}
		switch {
		case kind == "members":
			var r membership.MemberRecord
			if json.Unmarshal(kv.Value, &r) != nil {
				continue
			}
			r.Incarnation = kv.CreateRevision
			recs = append(recs, pending{job, r})
		case kind == "_quorum":
			quorums[job] = kv
		case kind == "_history":
			history[job] = append(history[job], kv)
		case kind == "epoch" && strings.HasPrefix(rest, "revoked/"):
			var r membership.Revocation
			if json.Unmarshal(kv.Value, &r) == nil {
				revs = append(revs, r)
				revJobs = append(revJobs, job)
			}
		}
	}
	for job, kv := range quorums {
		l.jobs[job] = l.loadQuorum(job, kv, history[job])
	}
	for job, h := range history {
		if _, ok := quorums[job]; !ok {
			l.jobs[job] = l.loadQuorum(job, nil, h) // the key was deleted
		}
	}
	now := time.Now()
	for _, p := range recs {
		l.upsert(now, p.job, p.rec)
	}
	for i, r := range revs {
		l.job(revJobs[i]).m.Revoke(now, r)
	}
	for _, j := range l.jobs {
		j.dirty = true
	}
	// Deaths gossip reported before this term.
	l.c.mu.Lock()
	dead := make(map[string]time.Time, len(l.c.deadSeen))
	for n, at := range l.c.deadSeen {
		dead[n] = at
	}
	l.c.mu.Unlock()
	for n := range dead {
		l.gossipDeath(ctx, now, n)
	}
	return resp.Header.Revision, nil
}

// loadQuorum makes a job's state from its quorum record (nil: none) and
// its history (sorted by epoch). A record the leader cannot trust — not
// signed by its key, or (without a signer) not the newest history entry —
// is foreign: the job starts from the newest trusted history entry, and
// the record is repaired at the first decision.
func (l *leadership) loadQuorum(job string, kv *mvccpb.KeyValue, history []*mvccpb.KeyValue) *jobState {
	trust := func(raw []byte) (membership.Quorum, bool) {
		var q membership.Quorum
		if s := l.c.cfg.QuorumSigner; s != nil {
			var err error
			q, err = s.Verifier().Verify(raw)
			return q, err == nil && q.Job == job
		}
		return q, json.Unmarshal(raw, &q) == nil && q.Job == job
	}
	// The newest trusted history entry, and the highest epoch seen at all.
	var real *mvccpb.KeyValue
	var realQ membership.Quorum
	var floor uint64
	for i := len(history) - 1; i >= 0; i-- {
		var q membership.Quorum
		if json.Unmarshal(history[i].Value, &q) == nil {
			floor = max(floor, q.Epoch)
		}
		if real == nil {
			if q, ok := trust(history[i].Value); ok {
				real, realQ = history[i], q
			}
		}
	}
	if kv != nil {
		q, ok := trust(kv.Value)
		if ok && l.c.cfg.QuorumSigner == nil && real != nil {
			// Unsigned: only the record the history agrees with is ours.
			ok = bytes.Equal(kv.Value, real.Value)
		}
		if ok {
			return &jobState{m: quorum.NewMachine(job, l.c.cfg.Quorum, &q), quorumRev: kv.ModRevision, lastValue: kv.Value}
		}
		f := &foreignWrite{rev: kv.ModRevision}
		var fq membership.Quorum
		if json.Unmarshal(kv.Value, &fq) == nil {
			f.epoch = fq.Epoch
			floor = max(floor, fq.Epoch)
		}
		l.c.lg.Warn("quorum record not written by a coordinator; restoring the last trusted one",
			zap.String("job", job), zap.Int64("revision", kv.ModRevision), zap.Uint64("claimed epoch", f.epoch))
		j := &jobState{quorumRev: kv.ModRevision, foreign: f}
		switch {
		case real != nil:
			j.m, j.lastValue = quorum.NewMachine(job, l.c.cfg.Quorum, &realQ), real.Value
		case floor > 0:
			// Nothing trusted to restore; never go back below an epoch
			// members may have seen.
			j.m = quorum.NewMachine(job, l.c.cfg.Quorum, &membership.Quorum{Job: job, Epoch: floor})
		default:
			j.m = quorum.NewMachine(job, l.c.cfg.Quorum, nil)
		}
		return j
	}
	if real == nil {
		return &jobState{m: quorum.NewMachine(job, l.c.cfg.Quorum, nil)}
	}
	l.c.lg.Warn("quorum record deleted by someone else; restoring it", zap.String("job", job), zap.Uint64("epoch", realQ.Epoch))
	return &jobState{m: quorum.NewMachine(job, l.c.cfg.Quorum, &realQ), lastValue: real.Value, foreign: &foreignWrite{deleted: true, epoch: realQ.Epoch}}
}

// upsert applies a member record (or its eviction or leave).
func (l *leadership) upsert(now time.Time, job string, r membership.MemberRecord) {
	j := l.job(job)
	l.noteStalled(job, j, r)
	switch {
	case r.Evicted != "":
		l.remove(now, job, r.ID, r.Incarnation, quorum.Removal{Cause: quorum.Evicted, By: r.Evicted})
		return
	case r.Leaving && r.Finished:
		// Where the run ended outlives the member (a coordinator that
		// loads only the leaving record learns it here).
		if old, ok := j.m.Member(r.ID); ok && old.Incarnation == r.Incarnation {
			j.m.Upsert(now, r)
		}
		l.remove(now, job, r.ID, r.Incarnation, quorum.Removal{Cause: quorum.Finished, Step: r.Step})
		return
	case r.Leaving:
		l.remove(now, job, r.ID, r.Incarnation, quorum.Removal{Cause: quorum.Left})
		return
	}
	old, ok := j.m.Member(r.ID)
	if !ok || old.Incarnation != r.Incarnation {
		if ok {
			delete(l.byNode, membership.GossipNodeName(job, old.ID, old.Lease))
		}
		l.c.metrics.joins.WithLabelValues(job).Inc()
	}
	if r.Gossip != "" {
		l.byNode[membership.GossipNodeName(job, r.ID, r.Lease)] = memberRef{job, r.ID, r.Incarnation}
	}
	if j.m.Upsert(now, r) {
		j.dirty = true
	}
	if len(r.Blamed) > 0 && (!ok || old.Incarnation != r.Incarnation || old.CommitFailed != r.CommitFailed || !slices.Equal(old.Blamed, r.Blamed)) {
		l.verifyReported(job, membership.Revocation{Epoch: r.CommitFailed, Failed: r.Blamed})
	}
}

// remove applies a member's end; what follows is its cause's (see
// quorum.Cause).
func (l *leadership) remove(now time.Time, job, id string, inc int64, r quorum.Removal) {
	j := l.job(job)
	old, ok := j.m.Member(id)
	if !ok || inc != 0 && old.Incarnation != inc {
		return
	}
	delete(l.byNode, membership.GossipNodeName(job, id, old.Lease))
	l.noteStalled(job, j, membership.MemberRecord{ID: id})
	j.m.Remove(now, id, old.Incarnation, r)
	j.dirty = true
	l.c.metrics.removals.WithLabelValues(job, removalLabel(r.Cause)).Inc()
	l.c.lg.Info("member removed", zap.String("job", job), zap.String("member", id), zap.String("why", r.String()))
}

// gossipDeath removes the member behind a dead gossip node and deletes
// its registration (fenced), so a restarted process may register again.
func (l *leadership) gossipDeath(ctx context.Context, now time.Time, node string) {
	ref, ok := l.byNode[node]
	if !ok {
		return
	}
	j := l.job(ref.job)
	rec, ok := j.m.Member(ref.id)
	if !ok || rec.Incarnation != ref.inc {
		return
	}
	l.remove(now, ref.job, ref.id, ref.inc, quorum.Removal{Cause: quorum.GossipDeath})
	// Deleted after the next publication, off the critical path.
	l.doomed = append(l.doomed, doomedMember{ref.job, rec})
}

// verifyReported checks the members a revocation blames (a peer saw its
// connection to them reset): a member whose advertised address refuses a
// TCP connection has no process listening there any more, so it is removed
// at once instead of after gossip's suspicion timeout. A member that
// answers, or cannot be reached at all (a partition), is left to gossip and
// its lease. Each check is one dial of at most verifyTimeout.
func (l *leadership) verifyReported(job string, r membership.Revocation) {
	j := l.job(job)
	now := time.Now()
	for _, id := range r.Failed {
		rec, ok := j.m.Member(id)
		if !ok || rec.Addr == "" {
			continue
		}
		ref := memberRef{job: job, id: id, inc: rec.Incarnation}
		// The next quorum waits for the verdict (at most the dial's time).
		j.m.Suspect(now, id, rec.Incarnation, now.Add(verifyTimeout+100*time.Millisecond))
		addr, ctx := rec.Addr, l.ctx
		go func() {
			dead, err := probeDead(ctx, addr)
			select {
			case l.verified <- verdict{ref, dead, err}:
			case <-ctx.Done():
			}
		}()
	}
}

// verifyTimeout bounds the dials that confirm a reported death.
const verifyTimeout = 500 * time.Millisecond

// probeDead dials addr until it refuses a connection (dead: no process
// listens there), for up to verifyTimeout. A process killed a moment ago
// may still accept: the kernel closes its listener only when the exit has
// torn down its memory, which takes a big process a few hundred
// milliseconds after its peers saw their connections to it end. A dial
// that times out or fails otherwise (unreachable) decides at once: not
// dead. err is the last dial's (nil: it connected).
func probeDead(ctx context.Context, addr string) (dead bool, err error) {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 50*time.Millisecond, 150*time.Millisecond, verifyTimeout
	deadline := time.Now().Add(verifyTimeout)
	_ = backoff.Retry(func() error {
		d := net.Dialer{Deadline: deadline}
		var c net.Conn
		c, err = d.DialContext(ctx, "tcp", addr)
		switch {
		case err == nil:
			c.Close()
			return errors.New("it accepted") // perhaps still exiting: again
		case errors.Is(err, syscall.ECONNRESET):
			return err // its listener closing under the dial: again
		case errors.Is(err, syscall.ECONNREFUSED):
			dead = true
			return nil
		}
		return backoff.Permanent(err)
	}, backoff.WithContext(b, ctx))
	return dead, err
}

// verifiedDeath removes a member whose reported death the coordinator
// confirmed, like a gossip death.
func (l *leadership) verifiedDeath(now time.Time, v verdict) {
	ref := v.memberRef
	j := l.job(ref.job)
	rec, ok := j.m.Member(ref.id)
	if !ok || rec.Incarnation != ref.inc {
		return
	}
	if !v.dead { // answering, or unreachable: left to gossip and the lease
		l.c.lg.Info("a member reported dead did not refuse a connection; left to gossip and its lease",
			zap.String("job", ref.job), zap.String("member", ref.id), zap.String("addr", rec.Addr), zap.NamedError("dial", v.err))
		j.m.Unsuspect(ref.id, ref.inc)
		j.dirty = true
		return
	}
	l.remove(now, ref.job, ref.id, ref.inc, quorum.Removal{Cause: quorum.PortClosed})
	l.doomed = append(l.doomed, doomedMember{ref.job, rec})
}

// deleteDoomed deletes the registrations of members gossip declared dead.
func (l *leadership) deleteDoomed(ctx context.Context) {
	for _, d := range l.doomed {
		l.deleteMember(ctx, d.job, d.rec)
	}
	l.doomed = l.doomed[:0]
}

// deleteMember deletes a member's key if this leader still leads and the
// incarnation still holds it, then revokes its lease unless the lease is
// its replica group's.
func (l *leadership) deleteMember(ctx context.Context, job string, rec membership.MemberRecord) {
	key := l.c.keys.Member(job, rec.ID)
	tr, err := l.c.cli.Txn(ctx).If(
		clientv3.Compare(clientv3.CreateRevision(l.fenceKey), "=", l.fenceRev),
		clientv3.Compare(clientv3.CreateRevision(key), "=", rec.Incarnation),
	).Then(clientv3.OpDelete(key)).Commit()
	if err != nil || !tr.Succeeded {
		return
	}
	if rec.Lease != 0 && !rec.SharedLease { // a group's lease stays with the group's other members
		l.c.cli.Revoke(ctx, clientv3.LeaseID(rec.Lease))
	}
}

func (l *leadership) run(ctx context.Context, gossipEvents <-chan membership.GossipEvent) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	l.ctx = ctx
	defer func() {
		l.c.mu.Lock()
		clear(l.c.status)
		l.c.mu.Unlock()
	}()
	rev, err := l.load(ctx)
	if err != nil {
		return err
	}
	if err := l.decide(ctx); err != nil {
		return err
	}
	l.deleteDoomed(ctx)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		if err := l.follow(ctx, rev, timer, gossipEvents); err != nil {
			return err
		}
		// The watch broke (compaction, lost etcd leader): rebuild from a
		// fresh read.
		if rev, err = l.load(ctx); err != nil {
			return err
		}
		if err := l.decide(ctx); err != nil {
			return err
		}
		l.deleteDoomed(ctx)
	}
}

// maxBatch bounds how long the coordinator applies watch responses that
// are ready before it decides (see follow).
const maxBatch = 50 * time.Millisecond

// follow applies watch events from rev+1, gossip deaths and timers until
// the watch breaks (nil) or leadership ends (an error).
func (l *leadership) follow(ctx context.Context, rev int64, timer *time.Timer, gossipEvents <-chan membership.GossipEvent) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	wch := l.c.cli.Watch(clientv3.WithRequireLeader(wctx), l.c.keys.Prefix(), clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithPrevKV())
	// applyWatch applies one watch response; false when the watch broke.
	applyWatch := func(wr clientv3.WatchResponse, ok bool) bool {
		if !ok || wr.Err() != nil {
			if ctx.Err() == nil {
				l.c.lg.Info("watch broke; reloading", zap.Error(wr.Err()))
			}
			return false
		}
		now := time.Now()
		for _, ev := range wr.Events {
			l.apply(now, ev)
		}
		return true
	}
	for {
		l.armTimer(timer)
		select {
		case wr, ok := <-wch:
			if !applyWatch(wr, ok) {
				return ctx.Err()
			}
			// Apply what else the watch has ready before deciding: a
			// decision looks at every member of the job, so deciding
			// after each response made a 10,000-member job's joins and
			// formed reports cost 10,000 decisions of 10,000 members
			// each, and the coordinator fell tens of seconds behind.
			// Bounded, so that a flood cannot hold a decision back long.
			for deadline := time.Now().Add(maxBatch); time.Now().Before(deadline); {
				select {
				case wr, ok := <-wch:
					if !applyWatch(wr, ok) {
						return ctx.Err()
					}
					continue
				default:
				}
				break
			}
		case ev := <-gossipEvents:
			if ev.Kind == membership.GossipDead {
				l.gossipDeath(ctx, time.Now(), ev.Name)
			}
		case ref := <-l.verified:
			l.verifiedDeath(time.Now(), ref)
		case <-timer.C:
		case <-l.sess.Done():
			return fmt.Errorf("%w: session expired", ErrNotLeader)
		case <-ctx.Done():
			return ctx.Err()
		}
		if err := l.decide(ctx); err != nil {
			return err
		}
		l.deleteDoomed(ctx)
	}
}

func (l *leadership) armTimer(t *time.Timer) {
	var next time.Time
	for _, j := range l.jobs {
		if !j.wakeAt.IsZero() && (next.IsZero() || j.wakeAt.Before(next)) {
			next = j.wakeAt
		}
	}
	d := time.Hour
	if !next.IsZero() {
		d = max(time.Until(next), 0)
	}
	t.Reset(d)
}

func (l *leadership) apply(now time.Time, ev *clientv3.Event) {
	job, kind, rest, ok := l.c.keys.Parse(string(ev.Kv.Key))
	if !ok {
		return
	}
	switch {
	case kind == "members" && ev.Type == mvccpb.PUT:
		var r membership.MemberRecord
		if json.Unmarshal(ev.Kv.Value, &r) != nil {
			return
		}
		r.Incarnation = ev.Kv.CreateRevision
		l.upsert(now, job, r)
	case kind == "members" && ev.Type == mvccpb.DELETE:
		var inc int64
		if ev.PrevKv != nil {
			inc = ev.PrevKv.CreateRevision
		}
		l.remove(now, job, rest, inc, quorum.Removal{Cause: quorum.LeaseExpired})
	case kind == "epoch" && strings.HasPrefix(rest, "revoked/") && ev.Type == mvccpb.PUT:
		var r membership.Revocation
		if json.Unmarshal(ev.Kv.Value, &r) == nil {
			j := l.job(job)
			j.m.Revoke(now, r)
			j.dirty = true
			l.verifyReported(job, r)
		}
	case kind == "_quorum":
		l.applyQuorumEvent(job, ev)
	case kind == "_view":
		l.applyViewEvent(job, ev)
	}
}

// applyQuorumEvent tells the leader's own quorum writes, seen in the
// watch (late, possibly after a newer one), from anyone else's, which it
// repairs at once. Only a leader passes the fence, so another writer is
// not a coordinator: an operator, or an intruder.
func (l *leadership) applyQuorumEvent(job string, ev *clientv3.Event) {
	j := l.job(job)
	if ev.Kv.ModRevision <= max(j.quorumRev, j.ownRev) {
		return // ours, or older than ours
	}
	if ev.Type == mvccpb.PUT && j.inflight != nil && bytes.Equal(ev.Kv.Value, j.inflight) {
		// Ours after all: a write whose answer was lost.
		j.quorumRev, j.ownRev, j.lastValue, j.inflight = ev.Kv.ModRevision, ev.Kv.ModRevision, j.inflight, nil
		j.m.Published(j.inflightQ)
		return
	}
	f := &foreignWrite{rev: ev.Kv.ModRevision, deleted: ev.Type == mvccpb.DELETE}
	if f.deleted {
		f.rev = 0
	} else {
		var q membership.Quorum
		if json.Unmarshal(ev.Kv.Value, &q) == nil {
			f.epoch = q.Epoch
		}
	}
	l.c.lg.Warn("quorum record written by someone else; restoring the leader's", zap.String("job", job),
		zap.Int64("revision", ev.Kv.ModRevision), zap.Bool("deleted", f.deleted), zap.Uint64("claimed epoch", f.epoch))
	j.foreign, j.dirty = f, true
	l.c.metrics.foreign.WithLabelValues(job).Inc()
}

// applyViewEvent tells a foreign write of a job's quorum view (what
// members act on) from the leader's own, which it writes in the same
// transaction as the record and so with the record's revision.
func (l *leadership) applyViewEvent(job string, ev *clientv3.Event) {
	j := l.job(job)
	if ev.Kv.ModRevision <= max(j.quorumRev, j.ownRev) {
		return
	}
	f := &foreignWrite{rev: j.quorumRev, view: true, deleted: ev.Type == mvccpb.DELETE}
	if !f.deleted {
		var h struct {
			Epoch uint64 `json:"epoch"`
		}
		if i := bytes.IndexByte(ev.Kv.Value, '\n'); i > 0 && json.Unmarshal(ev.Kv.Value[:i], &h) == nil {
			f.epoch = h.Epoch
		}
	}
	l.c.lg.Warn("quorum view written by someone else; republishing the leader's", zap.String("job", job),
		zap.Int64("revision", ev.Kv.ModRevision), zap.Bool("deleted", f.deleted), zap.Uint64("claimed epoch", f.epoch))
	j.foreign, j.dirty = f, true
	l.c.metrics.foreign.WithLabelValues(job).Inc()
}

// repair undoes a foreign write of a job's quorum key: it restores the
// leader's record; without one, it deletes the foreign record. Without a
// signer, members cannot tell a foreign record from the leader's and may
// have obeyed it, so a foreign epoch at or above the leader's is answered
// with the leader's participants republished above it.
func (l *leadership) repair(ctx context.Context, job string, j *jobState) error {
	f := j.foreign
	j.foreign = nil
	qk := l.c.keys.Quorum(job)
	cur, have := j.m.Current()
	if f.view {
		// Members may have taken it (unsigned) or ignored it (signed): a
		// new epoch above it, with the leader's participants, is right
		// either way.
		if !have {
			_, err := l.c.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(l.fenceKey), "=", l.fenceRev)).
				Then(clientv3.OpDelete(l.c.keys.QuorumView(job))).Commit()
			if err != nil {
				j.foreign, j.dirty = f, true
			}
			return ctx.Err()
		}
		q := cur
		q.Epoch, q.Created, q.Base, q.Removed, q.Added = cur.Epoch+1, time.Now(), 0, nil, nil
		if f.epoch >= cur.Epoch && f.epoch < math.MaxUint64-1 {
			q.Epoch = f.epoch + 1
		}
		q.Reason = "the quorum view was overwritten by someone else; republished"
		return l.publish(ctx, job, j, quorum.Decision{Quorum: &q})
	}
	if l.c.cfg.QuorumSigner == nil && have && !f.deleted && f.epoch >= cur.Epoch && f.epoch < math.MaxUint64-1 {
		q := cur
		q.Epoch, q.Created, q.Base, q.Removed, q.Added = f.epoch+1, time.Now(), 0, nil, nil
		q.Reason = "the quorum record was overwritten by someone else; republished"
		j.quorumRev = f.rev
		return l.publish(ctx, job, j, quorum.Decision{Quorum: &q})
	}
	op, what := clientv3.OpDelete(qk), "deleted the foreign quorum record"
	if j.lastValue != nil {
		op, what = clientv3.OpPut(qk, string(j.lastValue)), "restored the quorum record"
	}
	tr, err := l.c.cli.Txn(ctx).If(
		clientv3.Compare(clientv3.CreateRevision(l.fenceKey), "=", l.fenceRev),
		clientv3.Compare(clientv3.ModRevision(qk), "=", f.rev),
	).Then(op).Commit()
	if err != nil {
		j.foreign, j.dirty = f, true // try again at the next event
		l.c.lg.Warn("quorum repair failed", zap.String("job", job), zap.Error(err))
		return ctx.Err()
	}
	if !tr.Succeeded {
		return fmt.Errorf("%w: fenced repair of job %s refused", ErrNotLeader, job)
	}
	j.quorumRev, j.ownRev = tr.Header.Revision, tr.Header.Revision
	if j.lastValue == nil {
		j.quorumRev = 0 // deleted: the next publication creates the key
	}
	l.c.lg.Info(what, zap.String("job", job), zap.Uint64("epoch", cur.Epoch))
	return nil
}

// decide runs Advance for the jobs that need it and publishes.
func (l *leadership) decide(ctx context.Context) error {
	now := time.Now()
	names := make([]string, 0, len(l.jobs))
	for name := range l.jobs {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		j := l.jobs[name]
		if !j.dirty && (j.wakeAt.IsZero() || now.Before(j.wakeAt)) {
			continue
		}
		j.dirty = false
		if j.foreign != nil {
			if err := l.repair(ctx, name, j); err != nil {
				return err
			}
		}
		d := j.m.Advance(now)
		j.wakeAt, j.waiting = d.WakeAt, d.Waiting
		if d.Quorum != nil || d.Revocation != nil {
			if err := l.publish(ctx, name, j, d); err != nil {
				return err
			}
		}
		l.report(name, j)
	}
	return nil
}

func (l *leadership) report(name string, j *jobState) {
	st := JobStatus{Job: name, Members: j.m.Len(), Waiting: j.waiting, Updated: time.Now()}
	if q, ok := j.m.Current(); ok {
		st.Quorum = &q
		l.c.metrics.epoch.WithLabelValues(name).Set(float64(q.Epoch))
		l.c.metrics.participants.WithLabelValues(name).Set(float64(len(q.Participants)))
	}
	l.c.metrics.members.WithLabelValues(name).Set(float64(j.m.Len()))
	l.c.metrics.stalled.WithLabelValues(name).Set(float64(len(j.stalled)))
	l.c.mu.Lock()
	l.c.status[name] = st
	l.c.metrics.jobs.Set(float64(len(l.c.status)))
	l.c.mu.Unlock()
}

// publish writes a decision in one Txn fenced by the leader key and the
// quorum key's revision.
func (l *leadership) publish(ctx context.Context, job string, j *jobState, d quorum.Decision) error {
	k := l.c.keys
	qk := k.Quorum(job)
	var ops []clientv3.Op
	if r := d.Revocation; r != nil {
		r.By = "coordinator " + l.c.cfg.Name
		val, _ := json.Marshal(r)
		rk := k.Revocation(job, r.Epoch)
		ops = append(ops, clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(rk), "=", 0)},
			[]clientv3.Op{clientv3.OpPut(rk, string(val))}, nil))
	}
	var val []byte
	if q := d.Quorum; q != nil {
		q.PublishedBy = l.c.cfg.Name
		var err error
		if s := l.c.cfg.QuorumSigner; s != nil {
			val, err = s.Marshal(*q)
		} else {
			val, err = json.Marshal(q)
		}
		if err != nil {
			return fmt.Errorf("coordinator: encode quorum: %w", err)
		}
		// Members watch the view, not the record: a change of the
		// previous epoch, a few bytes per participant that changed.
		var sign func([]byte) *membership.QuorumSignature
		if s := l.c.cfg.QuorumSigner; s != nil {
			sign = s.Sign
		}
		var prev *membership.Quorum
		if cur, ok := j.m.Current(); ok {
			prev = &cur
		}
		rev := d.Revocation
		if r, ok := j.m.Revocation(); ok && rev == nil {
			rev = &r
		}
		view, err := membership.EncodeQuorumView(prev, *q, rev, sign)
		if err != nil {
			return fmt.Errorf("coordinator: encode quorum view: %w", err)
		}
		whole := view
		if prev != nil {
			if whole, err = membership.EncodeQuorumView(nil, *q, rev, sign); err != nil {
				return fmt.Errorf("coordinator: encode quorum view: %w", err)
			}
		}
		j.inflight, j.inflightQ = val, *q
		// The view after the record: the watch delivers the record's
		// event first (see applyQuorumEvent).
		ops = append(ops, clientv3.OpPut(qk, string(val)), clientv3.OpPut(k.QuorumView(job), string(view)),
			clientv3.OpPut(k.QuorumViewFull(job), string(whole)), clientv3.OpPut(k.HistoryEntry(job, q.Epoch), string(val)))
		if lim := uint64(l.c.cfg.HistoryLimit); q.Epoch > lim {
			ops = append(ops,
				clientv3.OpDelete(k.HistoryEntry(job, 0), clientv3.WithRange(k.HistoryEntry(job, q.Epoch-lim))),
				clientv3.OpDelete(k.Revocation(job, 0), clientv3.WithRange(k.Revocation(job, q.Epoch-lim))))
		}
		if q.Epoch > 2 {
			// Rendezvous keys of epochs before the previous one are done.
			ops = append(ops, clientv3.OpDelete(k.RendezvousPrefix(job, 0), clientv3.WithRange(k.RendezvousPrefix(job, q.Epoch-1))))
		}
	}
	start := time.Now()
	tr, err := l.c.cli.Txn(ctx).If(
		clientv3.Compare(clientv3.CreateRevision(l.fenceKey), "=", l.fenceRev),
		clientv3.Compare(clientv3.ModRevision(qk), "=", j.quorumRev),
	).Then(ops...).Commit()
	if err != nil {
		j.dirty = true // try again at the next event
		l.c.lg.Warn("publish failed", zap.String("job", job), zap.Error(err))
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return nil
	}
	l.c.metrics.publishSeconds.Observe(time.Since(start).Seconds())
	if !tr.Succeeded {
		j.inflight = nil
		return fmt.Errorf("%w: fenced write of job %s refused", ErrNotLeader, job)
	}
	if d.Quorum != nil {
		j.quorumRev, j.ownRev, j.lastValue, j.inflight = tr.Header.Revision, tr.Header.Revision, val, nil
		j.m.Published(*d.Quorum)
		l.c.metrics.quorums.WithLabelValues(job).Inc()
		l.c.lg.Info("quorum published", zap.String("job", job), zap.Uint64("epoch", d.Quorum.Epoch),
			zap.Int("participants", len(d.Quorum.Participants)), zap.String("reason", d.Quorum.Reason))
	} else {
		j.m.Revoke(time.Now(), *d.Revocation)
		l.c.lg.Info("epoch revoked", zap.String("job", job), zap.Uint64("epoch", d.Revocation.Epoch), zap.String("reason", d.Revocation.Reason))
	}
	return nil
}

// removalLabel is the cause label of ftcomm_coordinator_removals_total: a
// member that finished the run counts as one that left.
func removalLabel(c quorum.Cause) string {
	if c == quorum.Finished {
		return quorum.Left.String()
	}
	return c.String()
}

// jobLabel is the label naming a job in the coordinator's metrics. Not
// "job": Prometheus sets that one to the scrape job's name and renames a
// target's own to "exported_job".
const jobLabel = "ftcomm_job"

// coordMetrics are the coordinator's Prometheus metrics.
type coordMetrics struct {
	leader, jobs, gossipAlive    prometheus.Gauge
	members, epoch, participants *prometheus.GaugeVec
	quorums, joins, removals     *prometheus.CounterVec
	foreign                      *prometheus.CounterVec
	stalled                      *prometheus.GaugeVec
	publishSeconds               prometheus.Histogram
}

func newCoordMetrics(reg prometheus.Registerer) (*coordMetrics, error) {
	m := &coordMetrics{
		leader:       prometheus.NewGauge(prometheus.GaugeOpts{Name: "ftcomm_coordinator_leader", Help: "1 while this instance leads."}),
		jobs:         prometheus.NewGauge(prometheus.GaugeOpts{Name: "ftcomm_coordinator_jobs", Help: "Jobs the leader serves."}),
		gossipAlive:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "ftcomm_coordinator_gossip_alive", Help: "Gossip nodes this instance believes alive."}),
		members:      prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_members", Help: "Live members per job."}, []string{jobLabel}),
		epoch:        prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_epoch", Help: "Current epoch per job."}, []string{jobLabel}),
		participants: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_participants", Help: "Participants of the current quorum per job."}, []string{jobLabel}),
		quorums:      prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_coordinator_quorums_total", Help: "Quorums published per job."}, []string{jobLabel}),
		joins:        prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_coordinator_joins_total", Help: "Member incarnations seen per job."}, []string{jobLabel}),
		removals:     prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_coordinator_removals_total", Help: "Members removed per job and cause (left, evicted, gossip, reported, lease)."}, []string{jobLabel, "cause"}),
		foreign:      prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_coordinator_foreign_quorum_writes_total", Help: "Writes of a job's quorum record by someone other than a coordinator (repaired at once)."}, []string{jobLabel}),
		stalled: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_waiting_members",
			Help: "Members per job that wait for a holder of a step the job committed (ft's DurableCommit), and cannot step meanwhile."}, []string{jobLabel}),
		publishSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ftcomm_coordinator_publish_seconds", Help: "Latency of fenced quorum writes.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}),
	}
	if reg == nil {
		return m, nil
	}
	for _, col := range []prometheus.Collector{m.leader, m.jobs, m.gossipAlive, m.members, m.epoch, m.participants, m.quorums, m.joins, m.removals, m.foreign, m.stalled, m.publishSeconds} {
		if err := reg.Register(col); err != nil {
			return nil, fmt.Errorf("coordinator: register metrics: %w", err)
		}
	}
	return m, nil
}

// checkName says what is wrong with a job, member or coordinator name.
func checkName(kind, s string) error {
	if !membership.ValidName(s) {
		return fmt.Errorf("%w: coordinator: %s %q: want 1–128 of [A-Za-z0-9._-], starting with a letter or digit", comm.ErrInvalidArgument, kind, s)
	}
	return nil
}

// ctxErr prefers the cause of ctx's end over the client's rendering of it
// (a gRPC status), so callers can errors.Is(err, context.DeadlineExceeded).
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}
