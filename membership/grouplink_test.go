package membership_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
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

// debugLogger logs to the test and keeps what it logged, debug included.
func debugLogger(t *testing.T) (*zap.Logger, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.DebugLevel)
	return zap.New(zapcore.NewTee(zaptest.NewLogger(t).Core(), core)), logs
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
	key := etcdkeys.Layout{}.Member(tj.Name, "g.1")

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

// refusingLeader serves a group's link port as a live leader that does
// not hold the lease a hello names: it answers each hello with a refusal
// and closes. hellos receives each hello it read.
func refusingLeader(t *testing.T) (addr string, hellos <-chan string) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	ch := make(chan string, 100)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			line, err := bufio.NewReader(c).ReadString('\n')
			if err == nil {
				c.Write([]byte{'n'}) // the refusal (membership's linkRefuse)
				select {
				case ch <- strings.TrimSpace(line):
				default:
				}
			}
			c.Close()
		}
	}()
	return l.Addr().String(), ch
}

// A leader that answers a member's link but refuses its hello is alive:
// it does not hold the lease the hello names yet (it is taking the group
// over, and the member saw the record move before the leader's
// transaction returned) or any more. The member links again; it does not
// take the lease over from a live leader — which would delete that
// leader's registration, and a survivor would be counted among the dead.
func TestGroupLinkRefusedIsNoDeath(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	ctx := clustertest.Ctx(t, 30*time.Second)
	link, hellos := refusingLeader(t)
	// The group's record names a leader "g.0" that refuses every hello,
	// on a lease the test keeps alive.
	lr, err := tj.Client.Grant(ctx, 30)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tj.Client.KeepAlive(ctx, lr.ID); err != nil {
		t.Fatal(err)
	}
	rec, _ := json.Marshal(map[string]any{"lease": fmt.Sprint(int64(lr.ID)), "leader": "g.0", "link": link, "since": time.Now()})
	gkey := etcdkeys.Layout{}.GroupLease(tj.Name, "g")
	put, err := tj.Client.Put(ctx, gkey, string(rec), clientv3.WithLease(lr.ID))
	if err != nil {
		t.Fatal(err)
	}
	m := tj.Join("g.1", func(c *membership.MemberConfig) {
		groupMember(c)
		c.GroupLinkInterval, c.GroupLinkTimeout = 100*time.Millisecond, time.Second
	})
	for i := range 3 {
		select {
		case h := <-hellos:
			if !strings.Contains(h, `"g.1"`) {
				t.Fatalf("hello %q", h)
			}
		case <-ctx.Done():
			t.Fatalf("the member did not link again after %d refusals; it holds: %s", i, m.State())
		}
	}
	r, err := tj.Client.Get(ctx, gkey)
	if err != nil || len(r.Kvs) != 1 || r.Kvs[0].ModRevision != put.Header.Revision {
		t.Fatalf("the group's record after refusals: %v, %v; want it unchanged at revision %d (the member took the lease over from a live leader)",
			r, err, put.Header.Revision)
	}
	if s := m.State(); s.Leads || s.Lease != int64(lr.ID) || s.Err != nil {
		t.Fatalf("the member after refusals: %s; want it following g.0 on lease %x", s, int64(lr.ID))
	}
}

// A leader refuses a hello that names a lease it does not hold, and says
// so (the refusal above), rather than closing the link as a dead
// leader's would end.
func TestGroupLeaderSaysItRefuses(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	leader := tj.Join("g.0", groupMember)
	ctx := clustertest.Ctx(t, 20*time.Second)
	r, err := tj.Client.Get(ctx, etcdkeys.Layout{}.GroupLease(tj.Name, "g"))
	if err != nil || len(r.Kvs) != 1 {
		t.Fatalf("the group's record: %v, %v", r, err)
	}
	var g struct {
		Link string `json:"link"`
	}
	json.Unmarshal(r.Kvs[0].Value, &g)
	c, err := net.Dial("tcp", g.Link)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, `{"id":"g.1","inc":1,"lease":"%d"}`+"\n", leader.Record().Lease+1)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b := make([]byte, 1)
	if _, err := c.Read(b); err != nil || b[0] != 'n' {
		t.Fatalf("the leader's answer to a hello for another lease: %q, %v; want a refusal", b, err)
	}
}

// A member that ends its link to a live leader by its own choice (the
// group's record moved, or its watch of it broke) says goodbye: the
// leader removes only a member whose link ended without one. Here the
// record is rewritten unchanged, so both followers relink to the same
// leader; neither may lose its registration.
func TestGroupRelinkKeepsTheRegistration(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	lg, logs := debugLogger(t)
	leader := tj.Join("g.0", func(c *membership.MemberConfig) { groupMember(c); c.Logger = lg })
	ms := []*membership.Member{leader, tj.Join("g.1", groupMember), tj.Join("g.2", groupMember)}
	for _, m := range ms {
		clustertest.WaitQuorum(t, m, 0, "g.0", "g.1", "g.2")
	}
	ctx := clustertest.Ctx(t, 30*time.Second)
	gkey := etcdkeys.Layout{}.GroupLease(tj.Name, "g")
	moved, err := tj.Client.Put(ctx, gkey, "", clientv3.WithIgnoreValue(), clientv3.WithIgnoreLease())
	if err != nil {
		t.Fatal(err)
	}
	// Both links end at the leader, one way or the other.
	testutil.WaitFor(t, ctx, "both links' ends handled at the leader", func() bool {
		n := 0
		for _, e := range logs.All() {
			if e.Message == "group member's link ended without a goodbye: removed its registration" || e.Message == "a group member ended its link with a goodbye" {
				n++
			}
		}
		return n >= 2
	})
	if n := logs.FilterMessage("group member's link ended without a goodbye: removed its registration").Len(); n > 0 {
		t.Fatalf("the leader removed %d live members that relinked", n)
	}
	for _, m := range ms[1:] {
		testutil.WaitFor(t, ctx, m.ID()+" linked again under the moved record", func() bool {
			s := m.State()
			return s.Err != nil || s.Linked && s.GroupRev == moved.Header.Revision
		})
		if s := m.State(); s.Err != nil {
			t.Fatalf("%s: %s", m.ID(), s)
		}
	}
}

// lostAnswerKV passes every request to etcd, but answers the first
// transaction that writes key, once etcd applied it, with the error of a
// caller whose deadline passed first (a loaded etcd's late answer).
type lostAnswerKV struct {
	clientv3.KV
	key  string
	lost atomic.Bool
}

func (k *lostAnswerKV) Txn(ctx context.Context) clientv3.Txn {
	return &lostAnswerTxn{Txn: k.KV.Txn(ctx), kv: k}
}

type lostAnswerTxn struct {
	clientv3.Txn
	kv     *lostAnswerKV
	writes bool
}

func (t *lostAnswerTxn) If(cs ...clientv3.Cmp) clientv3.Txn { t.Txn = t.Txn.If(cs...); return t }

func (t *lostAnswerTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	for _, op := range ops {
		t.writes = t.writes || op.IsPut() && string(op.KeyBytes()) == t.kv.key
	}
	t.Txn = t.Txn.Then(ops...)
	return t
}

func (t *lostAnswerTxn) Else(ops ...clientv3.Op) clientv3.Txn { t.Txn = t.Txn.Else(ops...); return t }

func (t *lostAnswerTxn) Commit() (*clientv3.TxnResponse, error) {
	r, err := t.Txn.Commit()
	if err == nil && r.Succeeded && t.writes && t.kv.lost.CompareAndSwap(false, true) {
		return nil, context.DeadlineExceeded
	}
	return r, err
}

// A member that took its group's lease over leads it even when etcd's
// answer to the takeover never came: the transaction may have been
// applied, binding the group's record and the member's registration to
// the lease it granted, and dropping that lease would count a survivor
// among the dead.
func TestGroupTakeoverWithoutAnswerLeads(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	kv := &lostAnswerKV{key: etcdkeys.Layout{}.GroupLease(tj.Name, "g")}
	ms := []*membership.Member{
		tj.Join("g.0", groupMember),
		tj.Join("g.1", func(c *membership.MemberConfig) { // the first in line to take over
			groupMember(c)
			kv.KV, c.Client.KV = c.Client.KV, kv
		}),
		tj.Join("g.2", groupMember),
	}
	for _, m := range ms {
		clustertest.WaitQuorum(t, m, 0, "g.0", "g.1", "g.2")
	}
	ms[0].Crash()
	for _, m := range ms[1:] {
		clustertest.WaitQuorum(t, m, 0, "g.1", "g.2")
	}
	if !kv.lost.Load() {
		t.Fatal("no takeover's answer was lost: the test tested nothing")
	}
	if s := ms[1].State(); s.Err != nil || !s.Leads {
		t.Fatalf("g.1 after its takeover's answer was lost: %s; want it leading the group", s)
	}
	if s := ms[2].State(); s.Err != nil || s.Lease != ms[1].State().Lease {
		t.Fatalf("g.2: %s; want it on g.1's lease", s)
	}
}

// rollMember is a member of replica group "g" on the group's lease whose
// leader lets a registration go without a link for 6 s (LeaseTTL 2 s and
// four GroupLinkTimeouts of 1 s).
func rollMember(c *membership.MemberConfig) {
	c.Group, c.GroupLease, c.GroupLinkAddr = "g", true, "127.0.0.1:0"
	c.LeaseTTL, c.GroupLinkInterval, c.GroupLinkTimeout = 2*time.Second, 100*time.Millisecond, time.Second
}

// rollBound is the bound rollMember's leader holds registrations to.
func rollBound() time.Duration {
	c := membership.DefaultMemberConfig()
	rollMember(&c)
	return membership.UnlinkedBound(c)
}

// registration reads member id's registration (nil: none).
func registration(t *testing.T, ctx context.Context, cli *clientv3.Client, job, id string) *mvccpb.KeyValue {
	t.Helper()
	r, err := cli.Get(ctx, etcdkeys.Layout{}.Member(job, id))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Kvs) == 0 {
		return nil
	}
	return r.Kvs[0]
}

// Every registration on a group's lease is linked to the group's leader,
// or was within the bound: a member killed after it registered on the
// lease and before it linked is removed by the leader, no sooner than
// the bound after it registered — though no link of its ever ended and
// the lease it is bound to lives on.
func TestGroupUnlinkedDeathRemoved(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	leader := tj.Join("g.0", rollMember)
	bound := rollBound()
	start := time.Now()
	p := startMemberProc(t, tj.Etcd.Endpoints(), tj.Name, "g.1", 2*time.Second, false, "FTCOMM_TEST_GROUP=g", "FTCOMM_TEST_HOLDLINK=1")
	ctx := clustertest.Ctx(t, 3*bound+20*time.Second)
	if kv := registration(t, ctx, tj.Client, tj.Name, "g.1"); kv == nil || kv.CreateRevision != p.inc || kv.Lease != leader.Record().Lease {
		t.Fatalf("g.1's registration %v; want incarnation %d on the group's lease %x", kv, p.inc, leader.Record().Lease)
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
	testutil.WaitFor(t, ctx, "the unlinked dead member's registration removed", func() bool {
		return registration(t, ctx, tj.Client, tj.Name, "g.1") == nil
	})
	took := time.Since(start)
	t.Logf("FIGURE a member killed before it linked → its registration removed: %v (bound %v)", took.Round(time.Millisecond), bound)
	if took < bound {
		t.Fatalf("removed %v after it registered, within the bound %v", took, bound)
	}
	if s := leader.State(); s.Err != nil || !s.Leads {
		t.Fatalf("the leader: %s", s)
	}
}

// A member that links late, but within the bound, stays registered.
// Another member, registered after it and never linking, is the clock:
// once the leader has removed that one, the first one's bound has
// passed too.
func TestGroupLateLinkKept(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	leader := tj.Join("g.0", rollMember)
	bound := rollBound()
	release := make(chan struct{})
	late := tj.Join("g.1", func(c *membership.MemberConfig) { rollMember(c); membership.HoldLinks(c, release) })
	joined := time.Now()
	never := tj.Join("g.2", func(c *membership.MemberConfig) { rollMember(c); membership.HoldLinks(c, make(chan struct{})) })
	ctx := clustertest.Ctx(t, 3*bound+20*time.Second)
	// Late by half the bound: a member slowed down by its host.
	stall := time.AfterFunc(bound/2, func() { close(release) })
	t.Cleanup(func() { stall.Stop() })
	testutil.WaitFor(t, ctx, "g.1 linked", func() bool { return late.State().Linked })
	t.Logf("g.1 linked %v after it joined (bound %v)", time.Since(joined).Round(time.Millisecond), bound)
	select {
	case <-never.Done():
	case <-ctx.Done():
		t.Fatalf("g.2, which never linked, is still a member: %s", never.State())
	}
	if !errors.Is(never.Err(), membership.ErrEvicted) {
		t.Fatalf("g.2 ended with %v, want its registration deleted (ErrEvicted)", never.Err())
	}
	if s := late.State(); s.Err != nil || !s.Linked {
		t.Fatalf("g.1, linked late within the bound: %s", s)
	}
	if kv := registration(t, ctx, tj.Client, tj.Name, "g.1"); kv == nil || kv.CreateRevision != late.Incarnation() || kv.Lease != leader.Record().Lease {
		t.Fatalf("g.1's registration %v; want incarnation %d on the group's lease %x", kv, late.Incarnation(), leader.Record().Lease)
	}
}

// A member that takes the group's lease over holds the registrations on
// it to the same rule: one that moved to the new lease but never links to
// the new leader is removed (and, alive, sees its membership end); one
// that links to it stays.
func TestGroupTakeoverRemovesUnlinked(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	old := tj.Join("g.0", rollMember)
	linked := []*membership.Member{tj.Join("g.1", rollMember)}
	held := tj.Join("g.2", func(c *membership.MemberConfig) { rollMember(c); membership.HoldLinks(c, make(chan struct{})) })
	linked = append(linked, tj.Join("g.3", rollMember))
	ctx := clustertest.Ctx(t, 3*rollBound()+30*time.Second)
	testutil.WaitFor(t, ctx, "g.1 and g.3 linked to g.0", func() bool { return linked[0].State().Linked && linked[1].State().Linked })
	old.Crash()
	// g.1 or g.3 takes the lease over (whichever's turn comes first: the
	// turns follow the quorum each holds), and g.2 moves to the new lease.
	var heir, other *membership.Member
	testutil.WaitFor(t, ctx, "g.1 or g.3 leading on a new lease, g.2 moved to it", func() bool {
		s := held.State()
		for i, m := range linked {
			if h := m.State(); h.Leads && s.Lease == h.Lease {
				heir, other = m, linked[1-i]
				return true
			}
		}
		return s.Err != nil
	})
	if s := held.State(); s.Err != nil {
		t.Fatalf("g.2 ended before it moved to the new lease: %s", s)
	}
	moved := time.Now()
	select {
	case <-held.Done():
	case <-ctx.Done():
		t.Fatalf("g.2, which never linked to the new leader %s, is still a member: %s", heir.ID(), held.State())
	}
	t.Logf("g.2 removed %v after it moved to %s's lease (bound %v)", time.Since(moved).Round(time.Millisecond), heir.ID(), rollBound())
	if !errors.Is(held.Err(), membership.ErrEvicted) {
		t.Fatalf("g.2 ended with %v, want its registration deleted (ErrEvicted)", held.Err())
	}
	if registration(t, ctx, tj.Client, tj.Name, "g.2") != nil {
		t.Fatal("g.2 still registered")
	}
	if s := other.State(); s.Err != nil || !s.Linked || s.Lease != heir.State().Lease {
		t.Fatalf("%s, linked to the new leader: %s; want it linked on lease %x", other.ID(), s, heir.State().Lease)
	}
	clustertest.WaitQuorum(t, heir, 0, "g.1", "g.3")
}

// deafWatcher passes every watch to etcd but the first of key, which
// hears nothing and breaks when broken is closed (as a watch breaks when
// etcd loses its leader or compacts past it).
type deafWatcher struct {
	clientv3.Watcher
	key    string
	broken chan struct{}
	deaf   atomic.Bool
}

func (w *deafWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	if key != w.key || !w.deaf.CompareAndSwap(false, true) {
		return w.Watcher.Watch(ctx, key, opts...)
	}
	ch := make(chan clientv3.WatchResponse)
	go func() {
		defer close(ch)
		select {
		case <-w.broken:
		case <-ctx.Done():
		}
	}()
	return ch
}

// A leader whose watch of its group's registrations broke reads what is
// on its lease before it watches again: a registration whose joined
// record the broken watch never delivered is held to the bound all the
// same.
func TestGroupRollReadAfterBrokenWatch(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	w := &deafWatcher{key: etcdkeys.Layout{}.GroupJoined(tj.Name, "g"), broken: make(chan struct{})}
	tj.Join("g.0", func(c *membership.MemberConfig) {
		rollMember(c)
		w.Watcher, c.Client.Watcher = c.Client.Watcher, w
	})
	held := tj.Join("g.1", func(c *membership.MemberConfig) { rollMember(c); membership.HoldLinks(c, make(chan struct{})) })
	// The leader opens that watch on its own goroutine once it leads:
	// g.1's Join may return first.
	testutil.WaitFor(t, clustertest.Ctx(t, 20*time.Second), "the leader's watch of its group's joined record", w.deaf.Load)
	close(w.broken)
	ctx := clustertest.Ctx(t, 3*rollBound()+20*time.Second)
	select {
	case <-held.Done():
	case <-ctx.Done():
		t.Fatalf("g.1, which never linked, is still a member: %s", held.State())
	}
	if !errors.Is(held.Err(), membership.ErrEvicted) {
		t.Fatalf("g.1 ended with %v, want its registration deleted (ErrEvicted)", held.Err())
	}
}
