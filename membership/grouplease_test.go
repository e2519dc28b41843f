package membership_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// joinGroup joins members ids of replica group "g" on the group's shared
// lease, in order (the first leads).
func joinGroup(tj *clustertest.Job, ids ...string) []*membership.Member {
	var ms []*membership.Member
	for _, id := range ids {
		ms = append(ms, tj.Join(id, func(c *membership.MemberConfig) {
			c.Group, c.GroupLease, c.GroupLinkAddr = "g", true, "127.0.0.1:0"
		}))
	}
	return ms
}

// memberLeases counts the leases bound to the job's member keys.
func memberLeases(t *testing.T, cli *clientv3.Client, job string) map[int64]int {
	t.Helper()
	resp, err := cli.Get(clustertest.Ctx(t, 10*time.Second), etcdkeys.Layout{}.Members(job), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64]int{}
	for _, kv := range resp.Kvs {
		out[kv.Lease]++
	}
	return out
}

// A replica group holds one lease whatever its size: its members'
// registrations are all bound to the lease of the member that leads it.
func TestGroupLeaseOnePerGroup(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	ms := joinGroup(tj, "g.0", "g.1", "g.2", "g.3")
	clustertest.WaitQuorum(t, ms[0], 0, "g.0", "g.1", "g.2", "g.3")
	leases := memberLeases(t, tj.Client, tj.Name)
	if len(leases) != 1 || leases[ms[0].Record().Lease] != 4 {
		t.Fatalf("member keys by lease %v, want all 4 on the leader's lease %x", leases, ms[0].Record().Lease)
	}
	for _, m := range ms {
		if r := m.Record(); !r.SharedLease || clientv3.LeaseID(m.Record().Lease) != clientv3.LeaseID(ms[0].Record().Lease) {
			t.Fatalf("%s: shared %v lease %x, want the group's %x", m.ID(), r.SharedLease, m.Record().Lease, ms[0].Record().Lease)
		}
	}
}

// A member of the group that dies is removed by the group's leader (its
// link ends without a goodbye): one member gone, the others registered
// as before, on the same lease.
func TestGroupLeaseMemberDeath(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	ms := joinGroup(tj, "g.0", "g.1", "g.2")
	q := clustertest.WaitQuorum(t, ms[0], 0, "g.0", "g.1", "g.2")
	lease := clientv3.LeaseID(ms[0].Record().Lease)
	killed := time.Now()
	ms[2].Crash()
	clustertest.WaitQuorum(t, ms[0], q.Epoch, "g.0", "g.1")
	t.Logf("FIGURE a group member's death (links closed) → new quorum at the leader: %v", time.Since(killed).Round(time.Millisecond))
	for _, m := range ms[:2] {
		if m.Err() != nil || clientv3.LeaseID(m.Record().Lease) != lease {
			t.Fatalf("%s: err %v lease %x, want alive on %x", m.ID(), m.Err(), m.Record().Lease, int64(lease))
		}
	}
}

// When the leader dies, one of the others takes the lease over: the
// survivors keep their incarnations, move to the new lease, and the
// coordinator sees one member gone — one new epoch.
func TestGroupLeaseLeaderDeath(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	ms := joinGroup(tj, "g.0", "g.1", "g.2")
	q := clustertest.WaitQuorum(t, ms[1], 0, "g.0", "g.1", "g.2")
	old := clientv3.LeaseID(ms[0].Record().Lease)
	incs := []int64{ms[1].Incarnation(), ms[2].Incarnation()}
	killed := time.Now()
	ms[0].Crash()
	next := clustertest.WaitQuorum(t, ms[1], q.Epoch, "g.1", "g.2")
	t.Logf("FIGURE the group leader's death (links closed) → new quorum at a member: %v", time.Since(killed).Round(time.Millisecond))
	if next.Epoch != q.Epoch+1 {
		t.Errorf("epoch %d after %d: the leader's death cost more than one epoch", next.Epoch, q.Epoch)
	}
	ctx := clustertest.Ctx(t, 20*time.Second)
	for ctx.Err() == nil {
		l := memberLeases(t, tj.Client, tj.Name)
		if len(l) == 1 && l[int64(old)] == 0 && l[ms[1].Record().Lease] == 2 && clientv3.LeaseID(ms[1].Record().Lease) == clientv3.LeaseID(ms[2].Record().Lease) {
			break
		}
		waitChange(ctx, ms[1])
	}
	if ctx.Err() != nil {
		t.Fatalf("member keys by lease %v; g.1 on %x, g.2 on %x", memberLeases(t, tj.Client, tj.Name), ms[1].Record().Lease, ms[2].Record().Lease)
	}
	for i, m := range ms[1:] {
		if m.Err() != nil || m.Incarnation() != incs[i] {
			t.Fatalf("%s: err %v incarnation %d, want alive as %d", m.ID(), m.Err(), m.Incarnation(), incs[i])
		}
	}
	// The new leader keeps the group alive past the old lease's expiry,
	// and a restarted g.0 joins it.
	for ctx.Err() == nil {
		ttl, err := tj.Client.TimeToLive(ctx, old)
		if err == nil && ttl.TTL == -1 {
			break
		}
		waitChange(ctx, ms[1])
	}
	r := joinGroup(tj, "g.0")[0]
	clustertest.WaitQuorum(t, ms[1], next.Epoch, "g.1", "g.2", "g.0")
	if clientv3.LeaseID(r.Record().Lease) != clientv3.LeaseID(ms[1].Record().Lease) || ms[1].Err() != nil || ms[2].Err() != nil {
		t.Fatalf("restarted g.0 on %x, group on %x; errs %v %v", r.Record().Lease, ms[1].Record().Lease, ms[1].Err(), ms[2].Err())
	}
}

// A member that does not lead watches the group's record from its own
// registration, which found the record unchanged, not from the record's
// revision: etcd serves a watch that starts in the past from its log, a
// scan of every revision since (under the lock its applies take), and the
// group's record may be as old as the job. Here 300 writes come between
// the group's creation and a member's join; the member's watch starts
// after all of them, and still sees the lease move when the leader dies.
func TestGroupFollowerWatchesFromItsRegistration(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	lead := joinGroup(tj, "g.0")[0]
	ctx := clustertest.Ctx(t, 30*time.Second)
	created := int64(0)
	if r, err := tj.Client.Get(ctx, etcdkeys.Layout{}.GroupLease(tj.Name, "g")); err != nil || len(r.Kvs) != 1 {
		t.Fatalf("the group's record: %v, %v", r, err)
	} else {
		created = r.Kvs[0].ModRevision
	}
	var last int64
	for i := range 300 {
		r, err := tj.Client.Put(ctx, fmt.Sprintf("/unrelated/%d", i), "x")
		if err != nil {
			t.Fatal(err)
		}
		last = r.Header.Revision
	}
	ms := joinGroup(tj, "g.1", "g.2")
	for _, m := range ms {
		if from := m.GroupWatchFrom(); from < last || from < m.Incarnation() {
			t.Fatalf("%s watches the group's record after revision %d: the record's %d, the writes up to %d, its registration %d",
				m.ID(), from, created, last, m.Incarnation())
		}
	}
	q := clustertest.WaitQuorum(t, ms[0], 0, "g.0", "g.1", "g.2")
	lead.Crash()
	clustertest.WaitQuorum(t, ms[0], q.Epoch, "g.1", "g.2")
	for ctx.Err() == nil {
		l := memberLeases(t, tj.Client, tj.Name)
		if len(l) == 1 && l[ms[0].Record().Lease] == 2 && ms[0].Record().Lease != lead.Record().Lease {
			return
		}
		waitChange(ctx, ms[0])
	}
	t.Fatalf("after the leader's death: member keys by lease %v", memberLeases(t, tj.Client, tj.Name))
}

// waitChange waits a little for a quorum change (or not): the lease moves
// produce none, so this only paces the polling of etcd.
func waitChange(ctx context.Context, m *membership.Member) {
	t := time.NewTimer(50 * time.Millisecond)
	defer t.Stop()
	select {
	case <-m.Changed():
	case <-t.C:
	case <-ctx.Done():
	}
}

// The leader's link port takes no orders from strangers: a hello that is
// not JSON, or names the group's lease but a member of another group,
// closed without a goodbye, removes no registration.
func TestGroupLeaseLinkStrangers(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	ms := joinGroup(tj, "g.0", "g.1")
	other := tj.Join("h.0", func(c *membership.MemberConfig) { c.Group = "h" })
	q := clustertest.WaitQuorum(t, ms[0], 0, "g.0", "g.1", "h.0")
	ctx := clustertest.Ctx(t, 20*time.Second)
	resp, err := tj.Client.Get(ctx, etcdkeys.Layout{}.GroupLease(tj.Name, "g"))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("the group's lease record: %v (%d keys)", err, len(resp.Kvs))
	}
	var g struct { // the group's lease record, as any reader of the job's keys sees it
		Lease int64  `json:"lease,string"`
		Link  string `json:"link"`
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &g); err != nil {
		t.Fatal(err)
	}
	for _, hello := range []string{
		"GET / HTTP/1.1\r\n\r\n",
		fmt.Sprintf(`{"id":"h.0","inc":%d,"lease":"%d"}`+"\n", other.Incarnation(), g.Lease),
		fmt.Sprintf(`{"id":"nobody","inc":1,"lease":"%d"}`+"\n", g.Lease),
	} {
		c, err := net.Dial("tcp", g.Link)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Write([]byte(hello)); err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
	// A real member's departure after the strangers' shows the leader has
	// handled them: the next quorum must be exactly g.0 and h.0.
	ms[1].Crash()
	next := clustertest.WaitQuorum(t, ms[0], q.Epoch, "g.0", "h.0")
	if next.Epoch != q.Epoch+1 || other.Err() != nil {
		t.Fatalf("epoch %d after %d, h.0 err %v: a stranger's hello removed a member", next.Epoch, q.Epoch, other.Err())
	}
}

// leasesGranted reads etcd's count of granted leases (the embedded
// server's metrics, in this process's default registry).
func leasesGranted(t *testing.T) float64 {
	t.Helper()
	fams, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == "etcd_debugging_lease_granted_total" && len(f.GetMetric()) > 0 {
			return f.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatal("no etcd_debugging_lease_granted_total among the metrics")
	return 0
}

// When a group's leader dies, its members take the lease over in turns
// (by id, a link interval apart), each watching the group's record while
// it waits: the first one's takeover moves the others, and the group
// costs etcd one new lease, not one per member.
func TestGroupTakeoverInTurns(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	var ms []*membership.Member
	for _, id := range []string{"g.0", "g.1", "g.2", "g.3", "g.4"} {
		ms = append(ms, tj.Join(id, func(c *membership.MemberConfig) {
			c.Group, c.GroupLease, c.GroupLinkAddr = "g", true, "127.0.0.1:0"
			c.GroupLinkInterval, c.GroupLinkTimeout = time.Second, 3*time.Second // turns 1 s apart: the first takeover fits in one
		}))
	}
	q := clustertest.WaitQuorum(t, ms[0], 0, "g.0", "g.1", "g.2", "g.3", "g.4")
	for _, m := range ms[1:] {
		clustertest.WaitQuorum(t, m, q.Epoch-1, "g.0", "g.1", "g.2", "g.3", "g.4")
	}
	granted := leasesGranted(t)
	ms[0].Crash()
	next := clustertest.WaitQuorum(t, ms[1], q.Epoch, "g.1", "g.2", "g.3", "g.4")
	ctx := clustertest.Ctx(t, 20*time.Second)
	for ctx.Err() == nil {
		l := memberLeases(t, tj.Client, tj.Name)
		if len(l) == 1 && l[ms[1].Record().Lease] == 4 {
			break
		}
		waitChange(ctx, ms[1])
	}
	if ctx.Err() != nil {
		t.Fatalf("member keys by lease %v, want the 4 survivors on g.1's lease %x", memberLeases(t, tj.Client, tj.Name), ms[1].Record().Lease)
	}
	// One, unless the first takeover took longer than a turn (a loaded
	// machine): then the second in line grants one too. All four would
	// grant one each without turns.
	if n := leasesGranted(t) - granted; n > 2 {
		t.Errorf("%v leases granted for the takeover (epoch %d), want 1: g.1 first, the others moved by its record", n, next.Epoch)
	} else {
		t.Logf("%v lease(s) granted for the takeover", n)
	}
}

// A takeover is claimed in the group's record before its lease is
// granted: the claim alone removes the dead leader (the coordinator
// publishes the quorum without it while the claimer's grant is held up,
// as by a loaded etcd), and the group's other members, whose turns pass
// meanwhile, wait for the claimer instead of granting leases of their
// own: one lease for the whole takeover, however long it takes.
func TestGroupTakeoverClaimedBeforeItsGrant(t *testing.T) {
	release := make(chan struct{})
	// A claim waited for 10 s.
	tj, ms, solo, q := claimJob(t, 5, 10*time.Second, release)
	all := []string{"g.0", "g.1", "g.2", "g.3", "g.4", "h.0"}
	granted := leasesGranted(t)
	ms[0].Crash()
	clustertest.WaitQuorum(t, solo, q.Epoch, all[1:]...)
	ctx := clustertest.Ctx(t, 20*time.Second)
	for _, m := range ms[2:] {
		for ctx.Err() == nil && m.State().Claim != "g.1" {
			waitChange(ctx, m)
		}
		if ctx.Err() != nil {
			t.Fatalf("%s: %s; want it waiting for g.1's claim", m.ID(), m.State())
		}
	}
	if n := leasesGranted(t) - granted; n != 0 {
		t.Fatalf("%v leases granted while g.1's takeover was held after its claim, want 0", n)
	}
	close(release)
	for ctx.Err() == nil {
		l := memberLeases(t, tj.Client, tj.Name)
		if l[ms[1].Record().Lease] == 4 && ms[1].State().Leads {
			break
		}
		waitChange(ctx, ms[1])
	}
	if ctx.Err() != nil {
		t.Fatalf("member keys by lease %v; g.1: %s", memberLeases(t, tj.Client, tj.Name), ms[1].State())
	}
	if n := leasesGranted(t) - granted; n != 1 {
		t.Errorf("%v leases granted for the takeover, want 1 (g.1's)", n)
	}
	for _, m := range ms[1:] {
		if s := m.State(); s.Err != nil || s.Claim != "" {
			t.Errorf("%s after the takeover: %s", m.ID(), s)
		}
	}
}

// A claimer that dies between its claim and its takeover (a second
// failure during recovery) is passed over: the group's other members wait
// a GroupLinkTimeout for it, then the next in line takes the lease over
// from the claimed record, and the quorum loses the claimer too.
func TestGroupTakeoverClaimerDies(t *testing.T) {
	tj, ms, solo, q := claimJob(t, 4, time.Second, make(chan struct{})) // g.1 held until it dies
	ms[0].Crash()
	ctx := clustertest.Ctx(t, 20*time.Second)
	for ctx.Err() == nil && ms[2].State().Claim != "g.1" {
		waitChange(ctx, ms[2])
	}
	if ctx.Err() != nil {
		t.Fatalf("g.2: %s; want it waiting for g.1's claim", ms[2].State())
	}
	ms[1].Crash()
	clustertest.WaitQuorum(t, solo, q.Epoch, "g.2", "g.3", "h.0")
	for ctx.Err() == nil {
		l := memberLeases(t, tj.Client, tj.Name)
		if l[ms[2].Record().Lease] == 2 && ms[2].State().Leads {
			break
		}
		waitChange(ctx, ms[2])
	}
	if ctx.Err() != nil {
		t.Fatalf("member keys by lease %v; g.2: %s; g.3: %s", memberLeases(t, tj.Client, tj.Name), ms[2].State(), ms[3].State())
	}
	for _, m := range ms[2:] {
		if s := m.State(); s.Err != nil {
			t.Errorf("%s: %s", m.ID(), s)
		}
	}
}

// claimJob starts group "g" of n members g.0 (its leader) to g.<n-1>,
// their turns to take the lease over 100 ms apart and a claim waited for
// claimWait (GroupLinkTimeout), g.1's takeover held after its claim until
// release is closed, and h.0 beside them, which watches the epochs itself
// (the group's followers take them from a leader); it returns once every
// member holds the first quorum.
func claimJob(t *testing.T, n int, claimWait time.Duration, release chan struct{}) (*clustertest.Job, []*membership.Member, *membership.Member, membership.Quorum) {
	t.Helper()
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	var ms []*membership.Member
	var all []string
	for i := range n {
		id := fmt.Sprintf("g.%d", i)
		all = append(all, id)
		ms = append(ms, tj.Join(id, func(c *membership.MemberConfig) {
			c.Group, c.GroupLease, c.GroupLinkAddr = "g", true, "127.0.0.1:0"
			c.GroupLinkInterval, c.GroupLinkTimeout = 100*time.Millisecond, claimWait
			if id == "g.1" { // the first in line once g.0 dies
				membership.HoldTakeover(c, release)
			}
		}))
	}
	solo := tj.Join("h.0", nil)
	all = append(all, "h.0")
	q := clustertest.WaitQuorum(t, solo, 0, all...)
	for _, m := range ms {
		clustertest.WaitQuorum(t, m, 0, all...)
	}
	return tj, ms, solo, q
}
