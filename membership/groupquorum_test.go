package membership_test

import (
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// waitWatching waits until m watches etcd's epochs (want) or not.
func waitWatching(t *testing.T, m *membership.Member, want bool) {
	t.Helper()
	ctx := clustertest.Ctx(t, 10*time.Second)
	for m.WatchesEpochs() != want {
		if ctx.Err() != nil {
			t.Fatalf("%s watches etcd: %v, want %v", m.ID(), m.WatchesEpochs(), want)
		}
		waitChange(ctx, m)
	}
}

// Only a replica group's leader watches the job's epochs in etcd; the
// group's other members take every quorum from it. When the leader dies
// while a new epoch is being published, the member that takes the lease
// over watches from then on and serves the group: every survivor ends on
// the final quorum, and follows the epochs after it.
func TestGroupQuorumFromLeader(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	ms := joinGroup(tj, "g.0", "g.1", "g.2")
	h := tj.Join("h.0", nil)
	q := clustertest.WaitQuorum(t, h, 0, "g.0", "g.1", "g.2", "h.0")
	for _, m := range ms {
		clustertest.WaitQuorum(t, m, 0, "g.0", "g.1", "g.2", "h.0")
	}
	waitWatching(t, ms[0], true)
	for _, m := range ms[1:] {
		if m.WatchesEpochs() {
			t.Fatalf("%s, not the group's leader, watches etcd", m.ID())
		}
	}

	// A joiner's epoch and the leader's death at once.
	y := tj.Join("y", nil)
	ms[0].Crash()
	final := clustertest.WaitQuorum(t, y, q.Epoch, "g.1", "g.2", "h.0", "y")
	for _, m := range ms[1:] {
		if got := clustertest.WaitQuorum(t, m, q.Epoch, "g.1", "g.2", "h.0", "y"); got.Epoch < final.Epoch {
			t.Fatalf("%s on epoch %d, want %d or later", m.ID(), got.Epoch, final.Epoch)
		}
	}
	var leader, follower *membership.Member
	ctx := clustertest.Ctx(t, 10*time.Second)
	for leader == nil && ctx.Err() == nil {
		for i, m := range ms[1:] {
			if m.WatchesEpochs() {
				leader, follower = m, ms[2-i]
			}
		}
		waitChange(ctx, ms[1])
	}
	if leader == nil {
		t.Fatal("no survivor of the group watches etcd after the leader's death")
	}
	if follower.WatchesEpochs() {
		t.Fatalf("both survivors watch etcd")
	}
	// The new leader serves the group: the next epoch reaches its follower.
	if err := h.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	next := clustertest.WaitQuorum(t, follower, final.Epoch, "g.1", "g.2", "y")
	if got := clustertest.WaitQuorum(t, leader, final.Epoch, "g.1", "g.2", "y"); got.Epoch != next.Epoch {
		t.Fatalf("leader on epoch %d, its follower on %d", got.Epoch, next.Epoch)
	}
}

// With GroupEachWatches every member of the group watches etcd itself.
func TestGroupEachWatches(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	var ms []*membership.Member
	for _, id := range []string{"g.0", "g.1"} {
		ms = append(ms, tj.Join(id, func(c *membership.MemberConfig) {
			c.Group, c.GroupLease, c.GroupLinkAddr, c.GroupEachWatches = "g", true, "127.0.0.1:0", true
		}))
	}
	for _, m := range ms {
		clustertest.WaitQuorum(t, m, 0, "g.0", "g.1")
		waitWatching(t, m, true)
	}
}
