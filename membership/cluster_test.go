package membership

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
)

// testJob is a running embedded etcd with a coordinator, for tests.
type testJob struct {
	t     *testing.T
	etcd  *Embedded
	coord *Coordinator
	cli   *clientv3.Client
	job   string
	gsp   *GossipConfig

	sessionTTL time.Duration
}

func testGossipConfig() *GossipConfig {
	g := DefaultGossipConfig()
	return &g
}

// startTestJob starts etcd and a coordinator (with gossip when gossip is
// true) and stops both when the test ends.
func startTestJob(t *testing.T, qc QuorumConfig, gossip bool) *testJob {
	t.Helper()
	return startTestJobTTL(t, qc, gossip, 2*time.Second)
}

// startTestJobTTL is startTestJob with the coordinator's session TTL.
func startTestJobTTL(t *testing.T, qc QuorumConfig, gossip bool, sessionTTL time.Duration) *testJob {
	t.Helper()
	tj := &testJob{t: t, etcd: startEtcd(t), job: "job1", sessionTTL: sessionTTL}
	tj.cli = newClient(t, tj.etcd)
	if gossip {
		tj.gsp = testGossipConfig()
	}
	tj.coord = tj.startCoordinator("c0", qc)
	waitLeader(t, tj.coord)
	return tj
}

func (tj *testJob) startCoordinator(name string, qc QuorumConfig) *Coordinator {
	t := tj.t
	t.Helper()
	cfg := DefaultCoordinatorConfig()
	cfg.Client = newClient(t, tj.etcd)
	cfg.Name = name
	cfg.Quorum = qc
	cfg.SessionTTL = tj.sessionTTL
	cfg.Gossip = tj.gsp
	cfg.Logger = zaptest.NewLogger(t).Named(name)
	cfg.Registerer = prometheus.NewRegistry()
	c, err := NewCoordinator(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return c
}

// waitLeader waits until c leads.
func waitLeader(t *testing.T, c *Coordinator) {
	t.Helper()
	select {
	case <-c.Leading():
	case <-testCtx(t, 20*time.Second).Done():
		t.Fatalf("%s did not become leader", c.Name())
	}
}

func (tj *testJob) join(id string, mut func(*MemberConfig)) *Member {
	tj.t.Helper()
	cfg := DefaultMemberConfig()
	cfg.Client = newClient(tj.t, tj.etcd)
	cfg.Job, cfg.ID, cfg.Addr = tj.job, id, id+".example:1"
	cfg.LeaseTTL = 2 * time.Second
	cfg.WantQuorum = true
	cfg.Gossip = tj.gsp
	cfg.Logger = zaptest.NewLogger(tj.t).Named(id)
	if mut != nil {
		mut(&cfg)
	}
	m, err := Join(testCtx(tj.t, 20*time.Second), cfg)
	if err != nil {
		tj.t.Fatalf("join %s: %v", id, err)
	}
	tj.t.Cleanup(func() { m.Close() })
	return m
}

// waitQuorum waits at m for a quorum after epoch `after` whose participants
// are exactly ids (in order), skipping intermediate ones.
func waitQuorum(t *testing.T, m *Member, after uint64, ids ...string) Quorum {
	t.Helper()
	ctx := testCtx(t, 30*time.Second)
	for {
		q, err := m.NextQuorum(ctx, after)
		if err != nil {
			t.Fatalf("%s waiting for quorum %v after epoch %d: %v", m.ID(), ids, after, err)
		}
		if fmt.Sprint(participantIDs(q)) == fmt.Sprint(ids) {
			return q
		}
		after = q.Epoch
	}
}

func participantIDs(q Quorum) []string {
	var out []string
	for _, p := range q.Participants {
		out = append(out, p.ID)
	}
	return out
}

func TestCoordinatorFormsQuorumAndMembersLeave(t *testing.T) {
	tj := startTestJob(t, QuorumConfig{MinReplicas: 2, JoinTimeout: 10 * time.Second}, false)
	a, b, c := tj.join("a", nil), tj.join("b", nil), tj.join("c", nil)
	q := waitQuorum(t, a, 0, "a", "b", "c")
	for _, m := range []*Member{b, c} {
		if got := waitQuorum(t, m, 0, "a", "b", "c"); got.Epoch != q.Epoch {
			t.Fatalf("%s sees epoch %d, a sees %d", m.ID(), got.Epoch, q.Epoch)
		}
	}
	if !q.Includes("b", b.Incarnation()) || q.PublishedBy != "c0" {
		t.Fatalf("quorum %+v", q)
	}
	revoked := a.Revoked(q.Epoch)
	if err := b.Leave(testCtx(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	q2 := waitQuorum(t, a, q.Epoch, "a", "c")
	if q2.Reason != "b left" || fmt.Sprint(q2.Removed) != "[b]" {
		t.Fatalf("reason %q removed %v", q2.Reason, q2.Removed)
	}
	select {
	case <-revoked:
	default:
		t.Fatal("epoch 1 not revoked at a after epoch 2 was published")
	}
	r, ok := a.Revocation(q.Epoch)
	if !ok || fmt.Sprint(r.Failed) != "[b]" {
		t.Fatalf("revocation %+v %v", r, ok)
	}
	// Admin sees the same.
	v, err := NewAdmin(tj.cli, "").Job(testCtx(t, 5*time.Second), tj.job)
	if err != nil || v.Quorum.Epoch != q2.Epoch || len(v.Members) != 2 {
		t.Fatalf("admin view %+v, %v", v, err)
	}
	h, err := NewAdmin(tj.cli, "").History(testCtx(t, 5*time.Second), tj.job, 10)
	if err != nil || len(h) != int(q2.Epoch) || h[0].Epoch != q2.Epoch {
		t.Fatalf("history %+v, %v", h, err)
	}
	// A member that left refuses further work with a typed error.
	if err := b.Heartbeat(testCtx(t, time.Second)); err == nil {
		t.Fatal("heartbeat after leave succeeded")
	}
}

func TestMemberDuplicateID(t *testing.T) {
	tj := startTestJob(t, DefaultQuorumConfig(), false)
	first := tj.join("a", nil)
	cfg := DefaultMemberConfig()
	cfg.Client, cfg.Job, cfg.ID, cfg.Addr = tj.cli, tj.job, "a", "other:1"
	_, err := Join(testCtx(t, 10*time.Second), cfg)
	var dup *DuplicateMemberError
	if !errors.Is(err, ErrDuplicateMember) || !errors.As(err, &dup) || dup.Incarnation != first.Incarnation() {
		t.Fatalf("second join = %v", err)
	}
	// Waiting for the holder: it goes, the new incarnation gets in — even
	// when the wait outlasts the waiter's own lease TTL.
	cfg.WaitForDuplicate = true
	cfg.LeaseTTL = 2 * time.Second
	waiting := make(chan struct{})
	var once sync.Once
	cfg.Logger = zap.New(zapcore.RegisterHooks(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(io.Discard), zap.InfoLevel), func(e zapcore.Entry) error {
		if e.Message == "waiting for the previous incarnation to go" {
			once.Do(func() { close(waiting) })
		}
		return nil
	}))
	joined := make(chan *Member, 1)
	go func() {
		m, err := Join(testCtx(t, 30*time.Second), cfg)
		if err != nil {
			t.Error(err)
		}
		joined <- m
	}()
	select {
	case <-waiting:
	case <-testCtx(t, 10*time.Second).Done():
		t.Fatal("the second join did not wait")
	}
	<-time.After(3 * time.Second) // longer than the waiter's lease TTL
	first.Leave(testCtx(t, 5*time.Second))
	m := <-joined
	if m == nil {
		return
	}
	defer m.Close()
	if m.Incarnation() <= first.Incarnation() {
		t.Fatalf("incarnation %d not above %d", m.Incarnation(), first.Incarnation())
	}
}

func TestCommitFailureAndCriticalHealth(t *testing.T) {
	tj := startTestJob(t, QuorumConfig{MinReplicas: 1, JoinTimeout: time.Second}, false)
	a, b := tj.join("a", nil), tj.join("b", nil)
	q := waitQuorum(t, a, 0, "a", "b")
	ctx := testCtx(t, 20*time.Second)
	if err := b.ReportCommitFailure(ctx, q.Epoch); err != nil {
		t.Fatal(err)
	}
	q2 := waitQuorum(t, a, q.Epoch, "a", "b")
	if q2.Epoch != q.Epoch+1 {
		t.Fatalf("epoch %d after a commit failure in %d", q2.Epoch, q.Epoch)
	}
	a.SetStep(42)
	if err := a.SetHealth(ctx, Critical, "xid 79"); err != nil {
		t.Fatal(err)
	}
	q3 := waitQuorum(t, b, q2.Epoch, "b")
	if q3.Reason != "a critical: xid 79" {
		t.Fatalf("reason %q", q3.Reason)
	}
	if err := a.SetHealth(ctx, Healthy, ""); err != nil {
		t.Fatal(err)
	}
	q4 := waitQuorum(t, b, q3.Epoch, "b", "a")
	if q4.MaxStep != 42 {
		t.Fatalf("max step %d", q4.MaxStep)
	}
}

func TestMemberRevokeEpoch(t *testing.T) {
	tj := startTestJob(t, DefaultQuorumConfig(), false)
	a, b := tj.join("a", nil), tj.join("b", nil)
	q := waitQuorum(t, b, 0, "a", "b")
	ch := b.Revoked(q.Epoch)
	if err := a.Revoke(testCtx(t, 5*time.Second), q.Epoch, "peer b timed out", "b"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ch:
	case <-testCtx(t, 10*time.Second).Done():
		t.Fatal("b did not see the revocation")
	}
	if r, ok := b.Revocation(q.Epoch); !ok || r.By != "a" || r.Reason != "peer b timed out" {
		t.Fatalf("revocation %+v", r)
	}
	if rs := b.Revocations(); len(rs) == 0 || rs[len(rs)-1].Epoch != q.Epoch || rs[len(rs)-1].By != "a" {
		t.Fatalf("revocations %+v", rs)
	}
	// The coordinator follows with the next epoch (same participants).
	q2 := waitQuorum(t, b, q.Epoch, "a", "b")
	if q2.Epoch != q.Epoch+1 {
		t.Fatalf("epoch %d", q2.Epoch)
	}
}

func TestEvict(t *testing.T) {
	tj := startTestJob(t, DefaultQuorumConfig(), false)
	a, b := tj.join("a", nil), tj.join("b", nil)
	q := waitQuorum(t, a, 0, "a", "b")
	ctx := testCtx(t, 20*time.Second)
	if err := tj.coord.Evict(ctx, tj.job, "b", "test"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-b.Done():
		if !errors.Is(b.Err(), ErrEvicted) {
			t.Fatalf("b ended with %v", b.Err())
		}
	case <-ctx.Done():
		t.Fatal("b did not learn of its eviction")
	}
	q2 := waitQuorum(t, a, q.Epoch, "a")
	if q2.Reason != "b evicted by test" {
		t.Fatalf("reason %q", q2.Reason)
	}
	if err := tj.coord.Evict(ctx, tj.job, "b", "test"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("second evict = %v", err)
	}
	if err := b.RequestQuorum(ctx, false); !errors.Is(err, ErrEvicted) {
		t.Fatalf("request after eviction = %v", err)
	}
}

func TestDeathByLeaseExpiry(t *testing.T) {
	tj := startTestJob(t, DefaultQuorumConfig(), false)
	a, b := tj.join("a", nil), tj.join("b", nil)
	q := waitQuorum(t, a, 0, "a", "b")
	start := time.Now()
	b.crash()
	q2 := waitQuorum(t, a, q.Epoch, "a")
	t.Logf("lease expiry (TTL 2s) noticed after %v: %s", time.Since(start), q2.Reason)
	if q2.Reason != "b lease expired" {
		t.Fatalf("reason %q", q2.Reason)
	}
}

func TestDeathByGossip(t *testing.T) {
	tj := startTestJob(t, DefaultQuorumConfig(), true)
	long := func(c *MemberConfig) { c.LeaseTTL = time.Minute } // gossip must find it
	a, b, c := tj.join("a", long), tj.join("b", long), tj.join("c", long)
	q := waitQuorum(t, a, 0, "a", "b", "c")
	_ = c
	start := time.Now()
	b.crash()
	q2 := waitQuorum(t, a, q.Epoch, "a", "c")
	t.Logf("gossip death noticed and published after %v: %s", time.Since(start), q2.Reason)
	if q2.Reason != "b died (gossip)" {
		t.Fatalf("reason %q", q2.Reason)
	}
	// The coordinator deleted the dead registration: b may come back at once.
	b2 := tj.join("b", long)
	waitQuorum(t, a, q2.Epoch, "a", "c", "b")
	if b2.Incarnation() <= b.Incarnation() {
		t.Fatal("no new incarnation")
	}
}

func TestCoordinatorFailover(t *testing.T) {
	tj := startTestJob(t, DefaultQuorumConfig(), false)
	standby := tj.startCoordinator("c1", DefaultQuorumConfig())
	a, b := tj.join("a", nil), tj.join("b", nil)
	q := waitQuorum(t, a, 0, "a", "b")
	if standby.IsLeader() {
		t.Fatal("two leaders")
	}
	// Stop the leader's session as a crash would: revoke its lease.
	resp, err := tj.cli.Get(testCtx(t, 5*time.Second), tj.coord.keys.Election()+"/", clientv3.WithFirstCreate()...)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatal(resp, err)
	}
	if _, err := tj.cli.Revoke(testCtx(t, 5*time.Second), clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
	waitLeader(t, standby)
	if err := b.Leave(testCtx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	q2 := waitQuorum(t, a, q.Epoch, "a")
	if q2.PublishedBy != "c1" {
		t.Fatalf("published by %q", q2.PublishedBy)
	}
}

// A deposed leader's write is refused by the fence.
func TestFencedPublish(t *testing.T) {
	tj := startTestJob(t, DefaultQuorumConfig(), false)
	l := &leadership{c: tj.coord, fenceKey: tj.coord.keys.Election() + "/stale", fenceRev: 1, jobs: map[string]*jobState{}}
	j := l.job(tj.job)
	d := Decision{Quorum: &Quorum{Job: tj.job, Epoch: 7}}
	err := l.publish(testCtx(t, 5*time.Second), tj.job, j, d)
	if !errors.Is(err, ErrNotLeader) {
		t.Fatalf("stale publish = %v", err)
	}
	if _, err := NewAdmin(tj.cli, "").Quorum(testCtx(t, 5*time.Second), tj.job); !errors.Is(err, ErrNoQuorum) {
		t.Fatalf("a quorum was written: %v", err)
	}
}

// One coordinator serves several jobs; their epochs are independent.
func TestCoordinatorManyJobs(t *testing.T) {
	tj := startTestJob(t, DefaultQuorumConfig(), false)
	inJob := func(job string) func(*MemberConfig) { return func(c *MemberConfig) { c.Job = job } }
	a1, b1 := tj.join("a", inJob("alpha")), tj.join("b", inJob("alpha"))
	a2, b2 := tj.join("a", inJob("beta")), tj.join("b", inJob("beta"))
	q1 := waitQuorum(t, a1, 0, "a", "b")
	q2 := waitQuorum(t, a2, 0, "a", "b")
	if q1.Job != "alpha" || q2.Job != "beta" {
		t.Fatalf("jobs %q %q", q1.Job, q2.Job)
	}
	// b2's view arrives by its own watch: wait for it before comparing.
	if qb := waitQuorum(t, b2, 0, "a", "b"); qb.Epoch != q2.Epoch {
		t.Fatalf("beta's members disagree: epoch %d and %d", q2.Epoch, qb.Epoch)
	}
	if err := b1.Leave(testCtx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	waitQuorum(t, a1, q1.Epoch, "a")
	// beta is untouched, in etcd and in its members' views.
	if q, err := NewAdmin(tj.cli, "").Quorum(testCtx(t, 5*time.Second), "beta"); err != nil || q.Epoch != q2.Epoch {
		t.Fatalf("beta's stored quorum: epoch %d (%v), want %d", q.Epoch, err, q2.Epoch)
	}
	if q, _ := b2.Quorum(); q.Epoch != q2.Epoch {
		t.Fatalf("beta moved to epoch %d", q.Epoch)
	}
	jobs, err := NewAdmin(tj.cli, "").Jobs(testCtx(t, 5*time.Second))
	if err != nil || len(jobs) != 2 || jobs[0].Job != "alpha" || jobs[0].Members != 1 || jobs[1].Members != 2 {
		t.Fatalf("jobs %+v, %v", jobs, err)
	}
	if st, ok := tj.coord.Status("beta"); !ok || st.Members != 2 || st.Quorum == nil {
		t.Fatalf("status %+v %v", st, ok)
	}
}

// A member a peer reports dead is removed at once when its address refuses
// connections (its process is gone), and kept when something still listens
// there (the peer's link broke, not the member).
func TestReportedDeathVerified(t *testing.T) {
	tj := startTestJob(t, DefaultQuorumConfig(), false) // no gossip, long enough leases: only the report can remove c
	alive, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer alive.Close()
	gone, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	goneAddr := gone.Addr().String()
	gone.Close() // nothing listens there any more: a SIGKILLed process's port
	lease := func(c *MemberConfig) { c.LeaseTTL = time.Minute }
	a := tj.join("a", lease)
	tj.join("b", func(c *MemberConfig) { lease(c); c.Addr = alive.Addr().String() })
	tj.join("c", func(c *MemberConfig) { lease(c); c.Addr = goneAddr })
	q := waitQuorum(t, a, 0, "a", "b", "c")
	if err := a.Revoke(testCtx(t, 5*time.Second), q.Epoch, "connection reset by peer", "b", "c"); err != nil {
		t.Fatal(err)
	}
	q2 := waitQuorum(t, a, q.Epoch, "a", "b")
	if !strings.Contains(q2.Reason, "reported by a peer") {
		t.Fatalf("reason %q", q2.Reason)
	}
}

// Members that report forming an epoch's comms get a next quorum whose Base
// is that epoch, through the real coordinator.
func TestQuorumBaseFromFormedReports(t *testing.T) {
	tj := startTestJob(t, QuorumConfig{MinReplicas: 1, JoinTimeout: time.Second}, false)
	a, b := tj.join("a", nil), tj.join("b", nil)
	q := waitQuorum(t, a, 0, "a", "b")
	ctx := testCtx(t, 20*time.Second)
	for _, m := range []*Member{a, b} {
		if err := m.ReportFormed(ctx, q.Epoch); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.ReportCommitFailure(ctx, q.Epoch); err != nil {
		t.Fatal(err)
	}
	q2 := waitQuorum(t, a, q.Epoch, "a", "b")
	if q2.Base != q.Epoch {
		t.Fatalf("epoch %d after both formed %d: base %d", q2.Epoch, q.Epoch, q2.Base)
	}
	// Only a forms epoch q2: the next one must start afresh.
	if err := a.ReportFormed(ctx, q2.Epoch); err != nil {
		t.Fatal(err)
	}
	if err := a.ReportCommitFailure(ctx, q2.Epoch); err != nil {
		t.Fatal(err)
	}
	if q3 := waitQuorum(t, b, q2.Epoch, "a", "b"); q3.Base != 0 {
		t.Fatalf("epoch %d: base %d though b never formed %d", q3.Epoch, q3.Base, q2.Epoch)
	}
}

// The first epoch to record a step owns it; others learn who did.
func TestRecordCommit(t *testing.T) {
	tj := startTestJob(t, QuorumConfig{MinReplicas: 1, JoinTimeout: time.Second}, false)
	a, b := tj.join("a", nil), tj.join("b", nil)
	ctx := testCtx(t, 20*time.Second)
	if _, ok, err := a.LastCommit(ctx); err != nil || ok {
		t.Fatalf("a fresh job has a commit record (%v, %v)", ok, err)
	}
	if _, ok, err := a.RecordCommit(ctx, 1, 3); err != nil || !ok {
		t.Fatalf("first record: ok=%v err=%v", ok, err)
	}
	if _, ok, err := b.RecordCommit(ctx, 1, 3); err != nil || !ok {
		t.Fatalf("same epoch again: ok=%v err=%v", ok, err)
	}
	rec, ok, err := b.RecordCommit(ctx, 1, 4)
	if err != nil || ok || rec.Epoch != 3 || rec.By != "a" {
		t.Fatalf("another epoch: rec=%+v ok=%v err=%v", rec, ok, err)
	}
	for s := int64(2); s <= 3; s++ {
		if _, ok, err := b.RecordCommit(ctx, s, 4); err != nil || !ok {
			t.Fatalf("step %d: ok=%v err=%v", s, ok, err)
		}
	}
	if last, ok, err := a.LastCommit(ctx); err != nil || !ok || last.Step != 3 || last.Epoch != 4 {
		t.Fatalf("last commit %+v ok=%v err=%v", last, ok, err)
	}
}
