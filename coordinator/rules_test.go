package coordinator_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// waitStatus waits, up to d, until the leader's view of the job satisfies
// ok, and returns it.
func waitStatus(t *testing.T, c *coordinator.Coordinator, job string, d time.Duration, ok func(coordinator.JobStatus) bool) coordinator.JobStatus {
	t.Helper()
	ctx := clustertest.Ctx(t, d)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		st, _ := c.Status(job)
		if ok(st) {
			return st
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			t.Fatalf("job %s: status %+v after %v", job, st, d)
		}
	}
}

// When the leases of every holder of the job's step lapse (as in an etcd
// outage) while a replica at step 0 asks in, no quorum of that replica
// alone is published: the quorum waits for a holder to come back.
func TestLapsedHoldersAreAwaited(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 1, JoinTimeout: time.Second}, false)
	at500 := func(c *membership.MemberConfig) { c.Step = 500 }
	b, c := tj.Join("b", at500), tj.Join("c", at500)
	q := clustertest.WaitQuorum(t, b, 0, "b", "c")
	ctx := clustertest.Ctx(t, 30*time.Second)
	for _, m := range []*membership.Member{b, c} {
		if _, err := tj.Client.Revoke(ctx, clientv3.LeaseID(m.Record().Lease)); err != nil { // the lease lapses
			t.Fatal(err)
		}
	}
	a := tj.Join("a", nil)
	waitStatus(t, tj.Coord, tj.Name, 20*time.Second, func(st coordinator.JobStatus) bool {
		return strings.Contains(st.Waiting, "to come back")
	})
	// b registers again, with its step: the quorum forms with it.
	tj.Join("b", at500)
	clustertest.WaitQuorum(t, a, q.Epoch, "a", "b")
	h, err := coordinator.NewAdmin(tj.Client, "").History(ctx, tj.Name, 100)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range h {
		if slices.Equal(clustertest.ParticipantIDs(e), []string{"a"}) {
			t.Errorf("epoch %d %v published before a holder of step 500 came back", e.Epoch, clustertest.ParticipantIDs(e))
		}
	}
}

// Four live members split 2|2, each side blaming the other: the
// coordinator publishes one side (the first ids on a tie), and the other
// joins again once the blame's hold ends.
func TestCutKeepsOneSide(t *testing.T) {
	qc := quorum.DefaultConfig()
	qc.BlameHold = time.Second
	tj := clustertest.StartJob(t, qc, false)
	long := func(c *membership.MemberConfig) { c.LeaseTTL = time.Minute }
	ms := map[string]*membership.Member{}
	for _, id := range []string{"a", "b", "c", "d"} {
		ms[id] = tj.Join(id, long)
	}
	q := clustertest.WaitQuorum(t, ms["a"], 0, "a", "b", "c", "d")
	ctx := clustertest.Ctx(t, 30*time.Second)
	blame := map[string][]string{"a": {"c", "d"}, "b": {"c", "d"}, "c": {"a", "b"}, "d": {"a", "b"}}
	for id, ids := range blame {
		if err := ms[id].ReportCommitFailure(ctx, q.Epoch, ids...); err != nil {
			t.Fatal(err)
		}
	}
	q2 := clustertest.WaitQuorum(t, ms["a"], q.Epoch, "a", "b")
	if !strings.Contains(q2.Reason, "c cut off from a,b") || !slices.Equal(q2.Removed, []string{"c", "d"}) {
		t.Fatalf("epoch %d: reason %q, removed %v", q2.Epoch, q2.Reason, q2.Removed)
	}
	// The blame of each pair ends when its last report is a hold old: c
	// and d may come back one at a time, in either order.
	for after := q2.Epoch; ; {
		q, err := ms["c"].NextQuorum(ctx, after)
		if err != nil {
			t.Fatalf("c and d never came back: %v", err)
		}
		if len(q.Participants) == 4 {
			break
		}
		after = q.Epoch
	}
}

// A member that finishes the run leaves the next quorum at once, and
// every later quorum says where the run ended, also one published by
// another coordinator.
func TestFinishedRunOutlivesTheLeader(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 2, JoinTimeout: time.Second}, false)
	standby := tj.StartCoordinator("c1", quorum.Config{MinReplicas: 2, JoinTimeout: time.Second})
	a, b, c := tj.Join("a", nil), tj.Join("b", nil), tj.Join("c", nil)
	q := clustertest.WaitQuorum(t, b, 0, "a", "b", "c")
	ctx := clustertest.Ctx(t, 30*time.Second)
	if err := a.Finish(ctx, 42); err != nil {
		t.Fatal(err)
	}
	if err := a.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	q2 := clustertest.WaitQuorum(t, b, q.Epoch, "b", "c")
	if q2.Final != 42 {
		t.Fatalf("epoch %d: final %d", q2.Epoch, q2.Final)
	}
	resp, err := tj.Client.Get(ctx, etcdkeys.Layout{}.Election()+"/", clientv3.WithFirstCreate()...)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatal(resp, err)
	}
	if _, err := tj.Client.Revoke(ctx, clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
	clustertest.WaitLeader(t, standby)
	// Below min replicas: the end of the run still goes out.
	if err := c.Finish(ctx, 42); err != nil {
		t.Fatal(err)
	}
	q3 := clustertest.WaitQuorum(t, b, q2.Epoch, "b")
	if q3.Final != 42 || q3.PublishedBy != "c1" {
		t.Fatalf("epoch %d by %s: final %d", q3.Epoch, q3.PublishedBy, q3.Final)
	}
}

// A replica whose step time stays above the policy's factor of its peers'
// is taken out, and back as soon as it reports keeping up.
func TestStragglerOutAndBack(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 1, JoinTimeout: time.Second}, false)
	policy := func(c *membership.MemberConfig) {
		c.Stragglers = membership.StragglerPolicy{Factor: 2, Window: 500 * time.Millisecond, Probation: time.Hour}
		c.HeartbeatInterval = 0 // the test writes
	}
	ms := map[string]*membership.Member{}
	for _, id := range []string{"a", "b", "c"} {
		ms[id] = tj.Join(id, policy)
	}
	q := clustertest.WaitQuorum(t, ms["a"], 0, "a", "b", "c")
	ctx := clustertest.Ctx(t, 30*time.Second)
	report := func(id string, d ...time.Duration) {
		t.Helper()
		for _, d := range d {
			ms[id].SetStepTime(d)
		}
		if err := ms[id].Heartbeat(ctx); err != nil {
			t.Fatal(err)
		}
		if r := ms[id].Record(); r.StepTime == 0 {
			t.Fatalf("%s's record carries no step time", id)
		}
	}
	report("a", 10*time.Millisecond)
	report("b", 12*time.Millisecond)
	report("c", 50*time.Millisecond, 70*time.Millisecond) // a mean of 60 ms: 5× the others'
	q2 := clustertest.WaitQuorum(t, ms["a"], q.Epoch, "a", "b")
	if !strings.Contains(q2.Reason, "c straggling (step time 60ms") {
		t.Fatalf("reason %q", q2.Reason)
	}
	report("c", 11*time.Millisecond)
	clustertest.WaitQuorum(t, ms["a"], q2.Epoch, "a", "b", "c")
}
