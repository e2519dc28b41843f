package coordinator_test

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/internal/testutil"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

func TestCoordinatorFormsQuorumAndMembersLeave(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 2, JoinTimeout: 10 * time.Second}, false)
	a, b, c := tj.Join("a", nil), tj.Join("b", nil), tj.Join("c", nil)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b", "c")
	for _, m := range []*membership.Member{b, c} {
		if got := clustertest.WaitQuorum(t, m, 0, "a", "b", "c"); got.Epoch != q.Epoch {
			t.Fatalf("%s sees epoch %d, a sees %d", m.ID(), got.Epoch, q.Epoch)
		}
	}
	if !q.Includes("b", b.Incarnation()) || q.PublishedBy != "c0" {
		t.Fatalf("quorum %+v", q)
	}
	revoked := a.Revoked(q.Epoch)
	if err := b.Leave(clustertest.Ctx(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	q2 := clustertest.WaitQuorum(t, a, q.Epoch, "a", "c")
	if q2.Reason != "b left" || fmt.Sprint(q2.Removed) != "[b]" || fmt.Sprint(q2.Departed) != "[b]" {
		t.Fatalf("reason %q removed %v departed %v", q2.Reason, q2.Removed, q2.Departed)
	}
	select {
	case <-revoked:
	default:
		t.Fatal("epoch 1 not ended at a after epoch 2 was published")
	}
	// b left after its last step: its going revokes nothing (a step of a
	// and c in flight may end).
	if r, ok := a.Revocation(q.Epoch); ok {
		t.Fatalf("epoch %d revoked for a member that left: %+v", q.Epoch, r)
	}
	// Admin sees the same.
	v, err := coordinator.NewAdmin(tj.Client, "").Job(clustertest.Ctx(t, 5*time.Second), tj.Name)
	if err != nil || v.Quorum.Epoch != q2.Epoch || len(v.Members) != 2 {
		t.Fatalf("admin view %+v, %v", v, err)
	}
	h, err := coordinator.NewAdmin(tj.Client, "").History(clustertest.Ctx(t, 5*time.Second), tj.Name, 10)
	if err != nil || len(h) != int(q2.Epoch) || h[0].Epoch != q2.Epoch {
		t.Fatalf("history %+v, %v", h, err)
	}
	// A member that left refuses further work with a typed error.
	if err := b.Heartbeat(clustertest.Ctx(t, time.Second)); err == nil {
		t.Fatal("heartbeat after leave succeeded")
	}
}

func TestCommitFailureAndCriticalHealth(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 1, JoinTimeout: time.Second}, false)
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	ctx := clustertest.Ctx(t, 20*time.Second)
	if err := b.ReportCommitFailure(ctx, q.Epoch); err != nil {
		t.Fatal(err)
	}
	q2 := clustertest.WaitQuorum(t, a, q.Epoch, "a", "b")
	if q2.Epoch != q.Epoch+1 {
		t.Fatalf("epoch %d after a commit failure in %d", q2.Epoch, q.Epoch)
	}
	a.SetStep(42)
	if err := a.SetHealth(ctx, membership.Critical, "xid 79"); err != nil {
		t.Fatal(err)
	}
	q3 := clustertest.WaitQuorum(t, b, q2.Epoch, "b")
	if q3.Reason != "a critical: xid 79" {
		t.Fatalf("reason %q", q3.Reason)
	}
	if err := a.SetHealth(ctx, membership.Healthy, ""); err != nil {
		t.Fatal(err)
	}
	q4 := clustertest.WaitQuorum(t, b, q3.Epoch, "b", "a")
	if q4.MaxStep != 42 {
		t.Fatalf("max step %d", q4.MaxStep)
	}
}

func TestEvict(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	ctx := clustertest.Ctx(t, 20*time.Second)
	if err := tj.Coord.Evict(ctx, tj.Name, "b", "test"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-b.Done():
		if !errors.Is(b.Err(), membership.ErrEvicted) {
			t.Fatalf("b ended with %v", b.Err())
		}
	case <-ctx.Done():
		t.Fatal("b did not learn of its eviction")
	}
	q2 := clustertest.WaitQuorum(t, a, q.Epoch, "a")
	if q2.Reason != "b evicted by test" {
		t.Fatalf("reason %q", q2.Reason)
	}
	if err := tj.Coord.Evict(ctx, tj.Name, "b", "test"); !errors.Is(err, coordinator.ErrNotFound) {
		t.Fatalf("second evict = %v", err)
	}
	if err := b.RequestQuorum(ctx, false); !errors.Is(err, membership.ErrEvicted) {
		t.Fatalf("request after eviction = %v", err)
	}
}

func TestCoordinatorFailover(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	standby := tj.StartCoordinator("c1", quorum.DefaultConfig())
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	if standby.IsLeader() {
		t.Fatal("two leaders")
	}
	// Stop the leader's session as a crash would: revoke its lease.
	resp, err := tj.Client.Get(clustertest.Ctx(t, 5*time.Second), etcdkeys.Layout{}.Election()+"/", clientv3.WithFirstCreate()...)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatal(resp, err)
	}
	if _, err := tj.Client.Revoke(clustertest.Ctx(t, 5*time.Second), clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
	clustertest.WaitLeader(t, standby)
	if err := b.Leave(clustertest.Ctx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	q2 := clustertest.WaitQuorum(t, a, q.Epoch, "a")
	if q2.PublishedBy != "c1" {
		t.Fatalf("published by %q", q2.PublishedBy)
	}
}

// A restarted instance leads at once: an election key that holds its name
// under another lease is its previous process's (names are unique), gone
// without resigning and its lease alive for a while (after a SIGKILL; an
// etcd restart gives every lease a fresh TTL), and it ends that session.
// Another instance's live key it leaves alone; and a second process under
// a name that leads deposes it once, not in turns.
func TestRestartedInstanceEndsItsPreviousSession(t *testing.T) {
	e := clustertest.StartEtcd(t)
	cli := clustertest.NewClient(t, e)
	ctx := clustertest.Ctx(t, 60*time.Second)
	election := etcdkeys.Layout{}.Election()
	// c1's previous process led, then vanished; its lease lives a minute.
	old, err := concurrency.NewSession(cli, concurrency.WithTTL(60))
	if err != nil {
		t.Fatal(err)
	}
	if err := concurrency.NewElection(old, election).Campaign(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	old.Orphan()
	tj := &clustertest.Job{T: t, Etcd: e, Client: cli, Name: "job1", SessionTTL: 2 * time.Second}
	c1 := tj.StartCoordinator("c1", quorum.DefaultConfig())
	clustertest.WaitLeader(t, c1)
	if ttl, err := cli.TimeToLive(ctx, old.Lease()); err != nil || ttl.TTL > 0 {
		t.Fatalf("the previous process's lease lives on: %+v, %v", ttl, err)
	}
	keysOf := func(name string) int {
		resp, err := cli.Get(ctx, election+"/", clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, kv := range resp.Kvs {
			if string(kv.Value) == name {
				n++
			}
		}
		return n
	}
	// A second process named c1 deposes the first, which campaigns
	// again behind it without deposing it in turn.
	c1b := tj.StartCoordinator("c1", quorum.DefaultConfig())
	clustertest.WaitLeader(t, c1b)
	testutil.WaitFor(t, ctx, "the first c1 campaigning again", func() bool { return keysOf("c1") == 2 })
	if !c1b.IsLeader() || c1.IsLeader() {
		t.Fatalf("leaders: first c1 %v, second c1 %v", c1.IsLeader(), c1b.IsLeader())
	}
	// Another instance campaigns behind the leader.
	c2 := tj.StartCoordinator("c2", quorum.DefaultConfig())
	testutil.WaitFor(t, ctx, "c2 campaigning", func() bool { return keysOf("c2") == 1 })
	if !c1b.IsLeader() || c2.IsLeader() {
		t.Fatalf("second c1 leads %v, c2 leads %v", c1b.IsLeader(), c2.IsLeader())
	}
}

// One coordinator serves several jobs; their epochs are independent.
func TestCoordinatorManyJobs(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	inJob := func(job string) func(*membership.MemberConfig) {
		return func(c *membership.MemberConfig) { c.Job = job }
	}
	a1, b1 := tj.Join("a", inJob("alpha")), tj.Join("b", inJob("alpha"))
	a2, b2 := tj.Join("a", inJob("beta")), tj.Join("b", inJob("beta"))
	q1 := clustertest.WaitQuorum(t, a1, 0, "a", "b")
	q2 := clustertest.WaitQuorum(t, a2, 0, "a", "b")
	if q1.Job != "alpha" || q2.Job != "beta" {
		t.Fatalf("jobs %q %q", q1.Job, q2.Job)
	}
	// b2's view arrives by its own watch: wait for it before comparing.
	if qb := clustertest.WaitQuorum(t, b2, 0, "a", "b"); qb.Epoch != q2.Epoch {
		t.Fatalf("beta's members disagree: epoch %d and %d", q2.Epoch, qb.Epoch)
	}
	if err := b1.Leave(clustertest.Ctx(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	clustertest.WaitQuorum(t, a1, q1.Epoch, "a")
	// beta is untouched, in etcd and in its members' views.
	if q, err := coordinator.NewAdmin(tj.Client, "").Quorum(clustertest.Ctx(t, 5*time.Second), "beta"); err != nil || q.Epoch != q2.Epoch {
		t.Fatalf("beta's stored quorum: epoch %d (%v), want %d", q.Epoch, err, q2.Epoch)
	}
	if q, _ := b2.Quorum(); q.Epoch != q2.Epoch {
		t.Fatalf("beta moved to epoch %d", q.Epoch)
	}
	jobs, err := coordinator.NewAdmin(tj.Client, "").Jobs(clustertest.Ctx(t, 5*time.Second))
	if err != nil || len(jobs) != 2 || jobs[0].Job != "alpha" || jobs[0].Members != 1 || jobs[1].Members != 2 {
		t.Fatalf("jobs %+v, %v", jobs, err)
	}
	if st, ok := tj.Coord.Status("beta"); !ok || st.Members != 2 || st.Quorum == nil {
		t.Fatalf("status %+v %v", st, ok)
	}
}

// A member a peer reports dead is removed at once when its address refuses
// connections (its process is gone), and kept when something still listens
// there (the peer's link broke, not the member).
func TestReportedDeathVerified(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false) // no gossip, long enough leases: only the report can remove c
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
	lease := func(c *membership.MemberConfig) { c.LeaseTTL = time.Minute }
	a := tj.Join("a", lease)
	tj.Join("b", func(c *membership.MemberConfig) { lease(c); c.Addr = alive.Addr().String() })
	tj.Join("c", func(c *membership.MemberConfig) { lease(c); c.Addr = goneAddr })
	q := clustertest.WaitQuorum(t, a, 0, "a", "b", "c")
	if err := a.Revoke(clustertest.Ctx(t, 5*time.Second), q.Epoch, "connection reset by peer", "b", "c"); err != nil {
		t.Fatal(err)
	}
	q2 := clustertest.WaitQuorum(t, a, q.Epoch, "a", "b")
	if !strings.Contains(q2.Reason, "reported by a peer") {
		t.Fatalf("reason %q", q2.Reason)
	}
}

// Members that report forming an epoch's comms get a next quorum whose Base
// is that epoch, through the real coordinator.
func TestQuorumBaseFromFormedReports(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 1, JoinTimeout: time.Second}, false)
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	ctx := clustertest.Ctx(t, 20*time.Second)
	for _, m := range []*membership.Member{a, b} {
		if err := m.ReportFormed(ctx, q.Epoch); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.ReportCommitFailure(ctx, q.Epoch); err != nil {
		t.Fatal(err)
	}
	q2 := clustertest.WaitQuorum(t, a, q.Epoch, "a", "b")
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
	if q3 := clustertest.WaitQuorum(t, b, q2.Epoch, "a", "b"); q3.Base != 0 {
		t.Fatalf("epoch %d: base %d though b never formed %d", q3.Epoch, q3.Base, q2.Epoch)
	}
}
