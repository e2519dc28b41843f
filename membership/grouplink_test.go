package membership_test

import (
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/internal/clustertest"
	"github.com/ftcomm/ftcomm/internal/keys"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// What a group's links promise, whatever the load: a member is removed
// only for its death, and its death is always removed.

// groupMember is the configuration of a member of replica group "g" on
// the group's shared lease, with a lease long enough to outlast the
// faults the tests below inject.
func groupMember(c *membership.MemberConfig) {
	c.Group, c.GroupLease, c.GroupLinkAddr = "g", true, "127.0.0.1:0"
	c.LeaseTTL = 30 * time.Second
}

// A group member's death is removed even when etcd did not take the
// leader's first delete of its registration (etcd shedding load, or out
// of reach for longer than one try): the registration is bound to the
// group's lease, which the leader keeps renewing, so nothing else would
// ever remove it — and the job would wait for the dead member forever.
func TestGroupDeathRemovedAfterAFailedDelete(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	proxy := newCutProxy(t, tj.Etcd.Endpoints()[0])
	lg, logs := observedLogger(t)
	leader := tj.Join("g.0", func(c *membership.MemberConfig) {
		groupMember(c)
		cli, err := membership.NewClient([]string{proxy.addr()}, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cli.Close() })
		c.Client, c.Logger = cli, lg
	})
	ms := []*membership.Member{leader, tj.Join("g.1", groupMember), tj.Join("g.2", groupMember)}
	for _, m := range ms {
		clustertest.WaitQuorum(t, m, 0, "g.0", "g.1", "g.2")
	}
	key := keys.Layout{}.Member(tj.Name, "g.1")

	proxy.setCut(true) // the leader's deletes fail until healed
	ms[1].Crash()
	waitLogged(t, logs, "could not remove a group member whose link ended")
	proxy.setCut(false)
	ctx := clustertest.Ctx(t, 20*time.Second)
	testutil.WaitFor(t, ctx, "the dead member's registration removed", func() bool {
		r, err := tj.Client.Get(ctx, key)
		return err == nil && len(r.Kvs) == 0
	})
	clustertest.WaitQuorum(t, ms[2], 0, "g.0", "g.2")
}
