package clustertest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// Ctx returns a context that ends after d or when the test ends.
func Ctx(t testing.TB, d time.Duration) context.Context { return testutil.Ctx(t, d) }

// StartEtcd starts a single-member embedded etcd (no fsync) for one test
// and stops it when the test ends.
func StartEtcd(t testing.TB) *etcdhost.Embedded {
	t.Helper()
	cfg := etcdhost.DefaultEmbeddedConfig()
	cfg.UnsafeNoFsync = true
	e, err := etcdhost.StartEmbedded(Ctx(t, 30*time.Second), cfg)
	if err != nil {
		t.Fatalf("start etcd: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// NewClient returns a fresh client of e, closed when the test ends.
func NewClient(t testing.TB, e *etcdhost.Embedded) *clientv3.Client {
	t.Helper()
	cli, err := e.NewClient(nil)
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// Job is a running embedded etcd with a leading coordinator, and the
// members of one job that Join adds.
type Job struct {
	T      *testing.T
	Etcd   *etcdhost.Embedded
	Coord  *coordinator.Coordinator
	Client *clientv3.Client // a client of Etcd for the test's own reads and writes
	Name   string           // the job ("job1")
	Gossip *membership.GossipConfig

	SessionTTL time.Duration
}

// StartJob starts etcd and a leading coordinator "c0" (with gossip when
// gossip is true), with a 2 s session TTL.
func StartJob(t *testing.T, qc quorum.Config, gossip bool) *Job {
	t.Helper()
	return StartJobTTL(t, qc, gossip, 2*time.Second)
}

// StartJobTTL is StartJob with the coordinators' session TTL.
func StartJobTTL(t *testing.T, qc quorum.Config, gossip bool, sessionTTL time.Duration) *Job {
	t.Helper()
	var g *membership.GossipConfig
	if gossip {
		d := membership.DefaultGossipConfig()
		g = &d
	}
	return startJob(t, qc, g, sessionTTL)
}

// StartJobGossip is StartJob with gossip configured by g (for the
// coordinator and every member Join adds).
func StartJobGossip(t *testing.T, qc quorum.Config, g membership.GossipConfig) *Job {
	t.Helper()
	return startJob(t, qc, &g, 2*time.Second)
}

// SteadyGossip is a gossip profile for tests that say which member dies:
// a member is declared dead 8 s after it is first suspected (the default
// profile: 0.4 s). A gossip death ends the member's registration, and the
// members, the coordinator and their gossip nodes of such a test all run
// in one process, whose goroutines a loaded machine (2 cores, -race, other
// packages beside it) can hold up for seconds: with the default profile a
// healthy member is then declared dead because nobody ran to refute.
// A stopped member is still found in about 10 s.
func SteadyGossip() membership.GossipConfig {
	g := membership.DefaultGossipConfig()
	g.ProbeInterval, g.ProbeTimeout = time.Second, 500*time.Millisecond
	g.SuspicionMult, g.SuspicionMaxTimeoutMult = 8, 1
	return g
}

func startJob(t *testing.T, qc quorum.Config, g *membership.GossipConfig, sessionTTL time.Duration) *Job {
	t.Helper()
	j := &Job{T: t, Etcd: StartEtcd(t), Name: "job1", SessionTTL: sessionTTL, Gossip: g}
	j.Client = NewClient(t, j.Etcd)
	j.Coord = j.StartCoordinator("c0", qc)
	WaitLeader(t, j.Coord)
	return j
}

// StartCoordinator runs another coordinator on the job's etcd until the
// test ends; it may not lead.
func (j *Job) StartCoordinator(name string, qc quorum.Config) *coordinator.Coordinator {
	t := j.T
	t.Helper()
	cfg := coordinator.DefaultConfig()
	cfg.Client = NewClient(t, j.Etcd)
	cfg.Name = name
	cfg.Quorum = qc
	cfg.SessionTTL = j.SessionTTL
	cfg.Gossip = j.Gossip
	cfg.Logger = zaptest.NewLogger(t).Named(name)
	cfg.Registerer = prometheus.NewRegistry()
	c, err := coordinator.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	Run(t, c)
	return c
}

// Run runs c until the test ends.
func Run(t testing.TB, c *coordinator.Coordinator) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

// WaitLeader waits until c leads.
func WaitLeader(t testing.TB, c *coordinator.Coordinator) {
	t.Helper()
	select {
	case <-c.Leading():
	case <-Ctx(t, 20*time.Second).Done():
		t.Fatalf("%s did not become leader", c.Name())
	}
}

// Join adds member id to the job with its own client, a 2 s lease,
// WantQuorum and the job's gossip; mut (may be nil) changes the
// configuration before Join.
func (j *Job) Join(id string, mut func(*membership.MemberConfig)) *membership.Member {
	t := j.T
	t.Helper()
	cfg := membership.DefaultMemberConfig()
	cfg.Client = NewClient(t, j.Etcd)
	cfg.Job, cfg.ID, cfg.Addr = j.Name, id, id+".example:1"
	cfg.LeaseTTL = 2 * time.Second
	cfg.WantQuorum = true
	cfg.Gossip = j.Gossip
	cfg.Logger = zaptest.NewLogger(t).Named(id)
	if mut != nil {
		mut(&cfg)
	}
	m, err := membership.Join(Ctx(t, 20*time.Second), cfg)
	if err != nil {
		t.Fatalf("join %s: %v", id, err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// WaitQuorum waits at m for a quorum after epoch `after` whose
// participants are exactly ids (in order), skipping intermediate ones.
func WaitQuorum(t testing.TB, m *membership.Member, after uint64, ids ...string) membership.Quorum {
	t.Helper()
	ctx := Ctx(t, 30*time.Second)
	for {
		q, err := m.NextQuorum(ctx, after)
		if err != nil {
			t.Fatalf("%s waiting for quorum %v after epoch %d: %v; it holds: %s", m.ID(), ids, after, err, m.State())
		}
		if fmt.Sprint(ParticipantIDs(q)) == fmt.Sprint(ids) {
			return q
		}
		after = q.Epoch
	}
}

// ParticipantIDs returns the ids of q's participants in rank order.
func ParticipantIDs(q membership.Quorum) []string {
	var out []string
	for _, p := range q.Participants {
		out = append(out, p.ID)
	}
	return out
}
