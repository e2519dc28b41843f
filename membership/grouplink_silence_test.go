package membership_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// The links of these tests ping every 50 ms and time out after 250 ms: a
// peer this kernel sees runnable is taken for starved for up to
// silence.MaxStretch × 250 ms = 2.5 s.
const (
	silenceInterval = 50 * time.Millisecond
	silenceTimeout  = 250 * time.Millisecond
)

// joinMuted joins member id of group "g" on the group's lease with fast
// links, whose pings stop while muted is true (a process starved of CPU).
func joinMuted(tj *clustertest.Job, id string, muted *atomic.Bool) *membership.Member {
	return tj.Join(id, func(c *membership.MemberConfig) {
		c.Group, c.GroupLease, c.GroupLinkAddr = "g", true, "127.0.0.1:0"
		c.GroupLinkInterval, c.GroupLinkTimeout = silenceInterval, silenceTimeout
		membership.MuteLinks(c, muted)
	})
}

// starveBriefly mutes a member's links (muted) until judge, at the other
// end, has taken the silence for starvation 16 more times than before —
// with a look every link interval after the first at the timeout, a
// silence of 4 timeouts — then unmutes them and waits until judge hears
// the peer again.
func starveBriefly(t *testing.T, muted *atomic.Bool, judge *membership.Member) {
	t.Helper()
	ctx := clustertest.Ctx(t, 20*time.Second)
	from := membership.SilencesKept(judge)
	muted.Store(true)
	testutil.WaitFor(t, ctx, "silent link kept", func() bool { return membership.SilencesKept(judge) >= from+16 })
	muted.Store(false)
	testutil.WaitFor(t, ctx, "silent peer heard again", func() bool { return membership.SilencesEnded(judge) > 0 })
}

// A group member whose pings stop while its process runs (starved: here
// the same process as its leader) is not removed at the link timeout. The
// leader keeps it while the silence lasts up to the limit, and the link
// goes on when the pings resume. Past the limit, it is removed. Before the
// verdict (issue 42), a 10,000-member job on 2 cores lost 708 live members
// this way.
func TestGroupStarvedMemberKept(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	var leaderMuted, memberMuted atomic.Bool
	leader := joinMuted(tj, "g.0", &leaderMuted)
	member := joinMuted(tj, "g.1", &memberMuted)
	q := clustertest.WaitQuorum(t, leader, 0, "g.0", "g.1")

	starveBriefly(t, &memberMuted, leader)
	if now, _ := leader.Quorum(); now.Epoch != q.Epoch || member.Err() != nil {
		t.Fatalf("after 4 timeouts of silence from a runnable member: epoch %d (was %d), member err %v", now.Epoch, q.Epoch, member.Err())
	}

	// Past the limit a runnable member is dead all the same.
	memberMuted.Store(true)
	start := time.Now()
	clustertest.WaitQuorum(t, leader, q.Epoch, "g.0")
	if d := time.Since(start); d < 2*time.Second {
		// The limit is 2.5 s of silence; the quorum needs more than that.
		t.Errorf("silent member removed after %v, before the limit", d)
	}
	select {
	case <-member.Done():
	case <-clustertest.Ctx(t, 20*time.Second).Done():
		t.Fatal("the removed member did not learn it")
	}
}

// A group's leader whose pings stop while its process runs is not taken
// over at the link timeout by a member that sees its process runnable.
// Past the limit the member takes the lease over, and says goodbye as it
// leaves the old link, so that the old leader, merely slow, does not
// remove it for a death in turn: it leads the group, registered.
func TestGroupStarvedLeaderKept(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	var leaderMuted, memberMuted atomic.Bool
	leader := joinMuted(tj, "g.0", &leaderMuted)
	member := joinMuted(tj, "g.1", &memberMuted)
	q := clustertest.WaitQuorum(t, member, 0, "g.0", "g.1")

	starveBriefly(t, &leaderMuted, member)
	if now, _ := member.Quorum(); now.Epoch != q.Epoch || leader.Err() != nil || groupLeader(t, tj) != "g.0" {
		t.Fatalf("after 4 timeouts of silence from a runnable leader: epoch %d (was %d), leader err %v, group led by %s",
			now.Epoch, q.Epoch, leader.Err(), groupLeader(t, tj))
	}

	leaderMuted.Store(true)
	clustertest.WaitQuorum(t, member, q.Epoch, "g.1")
	if l := groupLeader(t, tj); l != "g.1" || member.Err() != nil {
		t.Fatalf("after the takeover: group led by %q, member err %v", l, member.Err())
	}
}

// groupLeader reads which member the record of group "g" names.
func groupLeader(t *testing.T, tj *clustertest.Job) string {
	t.Helper()
	resp, err := tj.Client.Get(clustertest.Ctx(t, 10*time.Second), etcdkeys.Layout{}.GroupLease(tj.Name, "g"))
	if err != nil || len(resp.Kvs) == 0 {
		t.Fatalf("group record: %v (%d keys)", err, len(resp.Kvs))
	}
	var g struct {
		Leader string `json:"leader"`
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &g); err != nil {
		t.Fatal(err)
	}
	return g.Leader
}

// The verdict across processes, as on a host: the leader (this process)
// looks a silent member's process up in /proc. A member process whose
// links go silent while one of its threads spins (runnable: starved, not
// dead) is kept past the link timeout and goes on when it speaks again;
// the same process SIGSTOPped is removed at the timeout, the leader
// naming why, and learns it when continued.
func TestProcessGroupMemberStarvedThenStopped(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	core, logs := observer.New(zapcore.InfoLevel)
	leader := tj.Join("g.0", func(c *membership.MemberConfig) {
		c.Group, c.GroupLease, c.GroupLinkAddr = "g", true, "127.0.0.1:0"
		c.GroupLinkInterval, c.GroupLinkTimeout = 50*time.Millisecond, 300*time.Millisecond
		c.Logger = zap.New(core)
	})
	clustertest.WaitQuorum(t, leader, 0, "g.0")
	b := startMemberProc(t, tj.Etcd.Endpoints(), tj.Name, "g.1", 30*time.Second, false, "FTCOMM_TEST_GROUP=g", "FTCOMM_TEST_FASTLINK=1")
	q := clustertest.WaitQuorum(t, leader, 0, "g.0", "g.1")

	ctx := clustertest.Ctx(t, 20*time.Second)
	kept := membership.SilencesKept(leader)
	b.cmd.Process.Signal(syscall.SIGUSR2)
	n := b.waitOutput(t, 0, `"starved"`, func(l string) bool { return l == "starved" })
	testutil.WaitFor(t, ctx, "the starved member's silence kept", func() bool { return membership.SilencesKept(leader) >= kept+16 })
	b.cmd.Process.Signal(syscall.SIGUSR2)
	b.waitOutput(t, n, `"fed"`, func(l string) bool { return l == "fed" })
	testutil.WaitFor(t, ctx, "the starved member heard again", func() bool { return membership.SilencesEnded(leader) > 0 })
	if now, _ := leader.Quorum(); now.Epoch != q.Epoch {
		t.Fatalf("after a silence of over 3 timeouts from a runnable member process: epoch %d, was %d (%s)", now.Epoch, q.Epoch, now.Reason)
	}

	b.cmd.Process.Signal(syscall.SIGSTOP)
	clustertest.WaitQuorum(t, leader, q.Epoch, "g.0")
	// The leader logs the removal once its delete returned, which the
	// coordinator may have seen and published first.
	testutil.WaitFor(t, ctx, "the leader's removal logged", func() bool {
		return logs.FilterMessageSnippet("removed its registration").Len() > 0
	})
	removed := logs.FilterMessageSnippet("removed its registration").All()
	if len(removed) != 1 || !strings.Contains(fmt.Sprint(removed[0].ContextMap()["link"]), "process is stopped") {
		t.Fatalf("the leader's removals: %+v", removed)
	}
	b.cmd.Process.Signal(syscall.SIGCONT)
	b.waitEvicted(t)
}
