package membership_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// observedLogger logs to the test and keeps what it logged.
func observedLogger(t *testing.T) (*zap.Logger, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.InfoLevel)
	return zap.New(zapcore.NewTee(zaptest.NewLogger(t).Core(), core)), logs
}

func waitLogged(t *testing.T, logs *observer.ObservedLogs, msg string) {
	t.Helper()
	testutil.WaitFor(t, clustertest.Ctx(t, 30*time.Second), "log "+msg, func() bool {
		for _, e := range logs.All() {
			if strings.Contains(e.Message, msg) {
				return true
			}
		}
		return false
	})
}

// A registration outlives an etcd outage longer than its lease: etcd
// restores every lease when it starts again, each with a fresh TTL, so the
// member renews the same lease once etcd answers and stays the same
// incarnation, instead of taking the lapse of its renewals for the end of
// its registration (a coordinator's embedded etcd goes down with it; the
// members of a job then re-registered, and every epoch of the job broke).
func TestRegistrationOutlivesEtcdRestart(t *testing.T) {
	ctx := clustertest.Ctx(t, 90*time.Second)
	ecfg := etcdhost.DefaultEmbeddedConfig()
	ecfg.Dir, ecfg.UnsafeNoFsync = t.TempDir(), true
	e, err := etcdhost.StartEmbedded(ctx, ecfg)
	if err != nil {
		t.Fatal(err)
	}
	cli, err := membership.NewClient(e.Endpoints(), nil)
	if err != nil {
		t.Fatal(err)
	}
	lg, logs := observedLogger(t)
	cfg := membership.DefaultMemberConfig()
	cfg.Client, cfg.Job, cfg.ID, cfg.Addr, cfg.Logger = cli, "j", "a", "a:1", lg
	cfg.LeaseTTL, cfg.HeartbeatInterval = 2*time.Second, 0
	m, err := membership.Join(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(); cli.Close() })

	e.Close()
	waitLogged(t, logs, "lease renewal lapsed")
	e, err = etcdhost.StartEmbedded(ctx, ecfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	waitLogged(t, logs, "lease renewed again")
	if err := m.Err(); err != nil {
		t.Fatalf("membership ended: %v", err)
	}
	admin := clustertest.NewClient(t, e)
	key := etcdkeys.Layout{}.Member("j", "a")
	resp, err := admin.Get(ctx, key)
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].CreateRevision != m.Incarnation() {
		t.Fatalf("the registration after the restart: %+v, %v (incarnation %d)", resp, err, m.Incarnation())
	}
	// It is renewed: it outlives the TTL etcd restored its lease with
	// (and the election timeout etcd adds), twice over.
	watch := admin.Watch(ctx, key, clientv3.WithRev(resp.Header.Revision+1), clientv3.WithFilterPut())
	select {
	case wr := <-watch:
		t.Fatalf("the registration went: %+v, %v", wr.Events, wr.Err())
	case <-m.Done():
		t.Fatalf("membership ended: %v", m.Err())
	case <-time.After(2 * (cfg.LeaseTTL + time.Second)):
	}
}

// A member whose lease etcd let expire while the member could not reach
// it (a partition longer than the TTL, etcd running on) has lost its
// registration: it learns so when it reaches etcd again.
func TestLapsedLeaseThatExpiredIsLost(t *testing.T) {
	ctx := clustertest.Ctx(t, 60*time.Second)
	e := clustertest.StartEtcd(t)
	admin := clustertest.NewClient(t, e)
	proxy := newCutProxy(t, e.Endpoints()[0])
	cli, err := membership.NewClient([]string{proxy.addr()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	lg, logs := observedLogger(t)
	cfg := membership.DefaultMemberConfig()
	cfg.Client, cfg.Job, cfg.ID, cfg.Addr, cfg.Logger = cli, "j", "a", "a:1", lg
	cfg.LeaseTTL, cfg.HeartbeatInterval = 2*time.Second, 0
	m, err := membership.Join(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close(); cli.Close() })
	lease := clientv3.LeaseID(m.Record().Lease)

	proxy.setCut(true)
	waitLogged(t, logs, "lease renewal lapsed")
	testutil.WaitFor(t, ctx, "the lease expired in etcd", func() bool {
		ttl, err := admin.TimeToLive(ctx, lease)
		return err == nil && ttl.TTL < 0
	})
	if err := m.Err(); err != nil {
		t.Fatalf("membership ended while etcd could not be asked: %v", err)
	}
	proxy.setCut(false)
	select {
	case <-m.Done():
	case <-ctx.Done():
		t.Fatal("the member did not learn that its registration is gone")
	}
	if !errors.Is(m.Err(), membership.ErrEvicted) {
		t.Fatalf("membership ended with %v", m.Err())
	}
}

// A member whose etcd client is closed before it (the caller's mistake:
// it owns the client and closes it after the member) ends at once: it can
// neither renew its lease nor ask etcd about it.
func TestMemberEndsWhenItsClientCloses(t *testing.T) {
	ctx := clustertest.Ctx(t, 30*time.Second)
	e := clustertest.StartEtcd(t)
	cli, err := membership.NewClient(e.Endpoints(), nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := membership.DefaultMemberConfig()
	cfg.Client, cfg.Job, cfg.ID, cfg.Addr, cfg.Logger = cli, "j", "a", "a:1", zaptest.NewLogger(t)
	cfg.LeaseTTL, cfg.HeartbeatInterval = 2*time.Second, 0
	m, err := membership.Join(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	cli.Close()
	select {
	case <-m.Done():
	case <-ctx.Done():
		t.Fatal("the member lives on without its client")
	}
	if !errors.Is(m.Err(), membership.ErrEvicted) {
		t.Fatalf("membership ended with %v", m.Err())
	}
}
