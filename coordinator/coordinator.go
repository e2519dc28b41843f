package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership/gossip"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
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
	// Root is the key prefix (default etcdkeys.DefaultRoot).
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
		Root:         etcdkeys.DefaultRoot,
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
	keys    etcdkeys.Layout
	lg      *zap.Logger
	metrics *coordMetrics
	gsp     *gossip.Node

	leader atomic.Bool
	leadCh chan struct{} // closed while leading
	// previousEnded: the first campaign ended the sessions of this
	// instance's earlier processes (endPreviousSession); Run's goroutine
	// only.
	previousEnded bool

	mu       sync.Mutex
	status   map[string]JobStatus // leader's view, for the API
	deadSeen map[string]time.Time // gossip deaths seen, by node name
	running  bool
}

// GossipStats counts what the coordinator's gossip node saw since it
// started: suspicions of peers, refutations of suspicions of itself, and
// deaths.
type GossipStats = gossip.Stats

// JobStatus is the leader's live view of a job.
type JobStatus struct {
	Job     string             `json:"job"`
	Members int                `json:"members"`
	Quorum  *membership.Quorum `json:"quorum,omitempty"`
	Waiting string             `json:"waiting,omitempty"` // why no quorum forms, if one is needed
	Updated time.Time          `json:"updated"`
	// Target is the job's target size in replica groups, which spares
	// refill it to: its setting membership.SettingTargetReplicas, else
	// the most replica groups a quorum of the run had (0: no quorum yet).
	Target int `json:"target,omitempty"`
	// Spares are the members waiting as spares (MemberRecord.Spare, or a
	// restart of a replaced group), ReadySpares those of them asking to
	// take part; UnusableSpares the spare groups that can never be
	// promoted into the job, and why. Sorted; nil without spares.
	Spares         []string               `json:"spares,omitempty"`
	ReadySpares    []string               `json:"readySpares,omitempty"`
	UnusableSpares []quorum.UnusableSpare `json:"unusableSpares,omitempty"`
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
		keys:     etcdkeys.Layout{Root: cfg.Root},
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
func (c *Coordinator) GossipStats() GossipStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gsp == nil {
		return GossipStats{}
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
	gossipEvents := make(chan gossip.Event, 1024)
	if c.cfg.Gossip != nil {
		g, err := gossip.Start("_coordinator/"+c.cfg.Name, *c.cfg.Gossip)
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
func (c *Coordinator) pumpGossip(ctx context.Context, g *gossip.Node, out chan<- gossip.Event) {
	for {
		select {
		case ev := <-g.Events():
			c.metrics.gossipAlive.Set(float64(g.NumAlive()))
			if ev.Kind == gossip.Dead {
				c.mu.Lock()
				c.deadSeen[ev.Name] = ev.At
				for n, at := range c.deadSeen {
					if time.Since(at) > time.Minute {
						delete(c.deadSeen, n)
					}
				}
				c.mu.Unlock()
			}
			if ev.Kind != gossip.Dead {
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

func (c *Coordinator) campaignAndLead(ctx context.Context, gossipEvents <-chan gossip.Event) error {
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
	if !c.previousEnded {
		if err := c.endPreviousSession(ctx, sess); err != nil {
			return err
		}
		c.previousEnded = true
	}
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
	return newLeadership(c, sess, el.Key(), el.Rev()).run(ctx, gossipEvents)
}

// endPreviousSession ends the sessions of this instance's earlier
// processes: election keys that hold its name under another lease. Names
// are unique among a root's coordinators, so such a key is this
// instance's own from before a restart, held by a process that is gone
// (SIGKILL, a crash) — or, if an operator started a second process under
// the name, one that is deposed by it: the fence makes its writes fail
// from then on, and it campaigns again behind this one (only a
// process's first campaign ends another's session, so two such processes
// do not depose each other in turn). Without it a restarted instance
// waits for its own dead session to expire before it leads: SessionTTL,
// and after a restart of its embedded etcd, which gives every lease a
// fresh TTL and an election timeout more, longer still.
func (c *Coordinator) endPreviousSession(ctx context.Context, sess *concurrency.Session) error {
	resp, err := c.cli.Get(ctx, c.keys.Election()+"/", clientv3.WithPrefix())
	if err != nil {
		return fmt.Errorf("coordinator: read the election: %w", ctxErr(ctx, err))
	}
	for _, kv := range resp.Kvs {
		if string(kv.Value) != c.cfg.Name || kv.Lease == 0 || clientv3.LeaseID(kv.Lease) == sess.Lease() {
			continue
		}
		if _, err := c.cli.Revoke(ctx, clientv3.LeaseID(kv.Lease)); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return fmt.Errorf("coordinator: end the session of this instance's previous process: %w", ctxErr(ctx, err))
		}
		c.lg.Info("ended the session of this instance's previous process (a restart)", zap.String("key", string(kv.Key)),
			zap.Int64("rev", kv.CreateRevision))
	}
	return nil
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
