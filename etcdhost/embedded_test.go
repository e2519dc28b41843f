package etcdhost

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

func TestEmbeddedRestartKeepsData(t *testing.T) {
	dir := t.TempDir()
	ctx := testutil.Ctx(t, 60*time.Second)
	cfg := DefaultEmbeddedConfig()
	cfg.Dir = dir
	cfg.UnsafeNoFsync = true
	e, err := StartEmbedded(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(e.Endpoints()) != 1 || e.Dir() != dir {
		t.Fatalf("endpoints %v dir %q", e.Endpoints(), e.Dir())
	}
	cli, err := e.Client()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, "/k", "v"); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	// Restarted on the same directory, the data is there.
	e2, err := StartEmbedded(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer e2.Close()
	cli2, err := e2.Client()
	if err != nil {
		t.Fatal(err)
	}
	resp, err := cli2.Get(ctx, "/k")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
		t.Fatalf("after restart: %v, %v", resp, err)
	}
}

// An etcd restarted on its data directory listens where it did before
// (trainers' credentials name its endpoint), secure or not; when another
// process took its client port, it says so and does not move; an explicit
// address moves it, and the next restart keeps that one.
func TestEmbeddedRestartKeepsEndpoints(t *testing.T) {
	for _, secure := range []bool{false, true} {
		t.Run(fmt.Sprintf("secure=%v", secure), func(t *testing.T) {
			ctx := testutil.Ctx(t, 60*time.Second)
			cfg := DefaultEmbeddedConfig()
			cfg.Dir, cfg.UnsafeNoFsync, cfg.Secure = t.TempDir(), true, secure
			start := func() *Embedded {
				t.Helper()
				e, err := StartEmbedded(ctx, cfg)
				if err != nil {
					t.Fatal(err)
				}
				return e
			}
			e := start()
			first, peer := e.Endpoints()[0], e.PeerURL()
			e.Close()
			e = start()
			if e.Endpoints()[0] != first || e.PeerURL() != peer {
				t.Fatalf("restarted on %v (peer %s), before on %s (peer %s)", e.Endpoints(), e.PeerURL(), first, peer)
			}
			cli, err := e.Client()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := cli.Get(ctx, etcdkeys.DefaultRoot+"/k"); err != nil {
				t.Fatal(err)
			}
			e.Close()

			l, err := net.Listen("tcp", first)
			if err != nil {
				t.Fatal(err)
			}
			_, err = StartEmbedded(ctx, cfg)
			l.Close()
			var taken *KeptAddrInUseError
			if !errors.As(err, &taken) || !errors.Is(err, syscall.EADDRINUSE) || taken.Addr != first || !strings.Contains(err.Error(), "-etcd-client-addr") {
				t.Fatalf("with its port taken: %v", err)
			}

			l, err = net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			other := l.Addr().String()
			l.Close()
			moved := cfg
			moved.ClientAddr = other
			e, err = StartEmbedded(ctx, moved)
			if err != nil {
				t.Fatal(err)
			}
			e.Close()
			e = start()
			defer e.Close()
			if e.Endpoints()[0] != other {
				t.Fatalf("after a move to %s, restarted on %v", other, e.Endpoints())
			}
		})
	}
}

func TestEmbeddedTwoInstancesApart(t *testing.T) {
	a, b := startEtcd(t), startEtcd(t)
	if a.Endpoints()[0] == b.Endpoints()[0] {
		t.Fatalf("both on %v", a.Endpoints())
	}
	ctx := testutil.Ctx(t, 20*time.Second)
	if _, err := newClient(t, a).Put(ctx, "/only-a", "1"); err != nil {
		t.Fatal(err)
	}
	resp, err := newClient(t, b).Get(ctx, "/only-a")
	if err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("b sees a's key: %v, %v", resp, err)
	}
}

func TestEmbeddedConfigValidate(t *testing.T) {
	for _, c := range []EmbeddedConfig{
		{ClientAddr: "nonsense"},
		{PeerAddr: "1.2.3.4"},
		{ClusterState: "sideways"},
		{TickMs: 100, ElectionMs: 200},
		{QuotaBackendBytes: -1},
	} {
		if err := c.Validate(); !errors.Is(err, comm.ErrInvalidArgument) {
			t.Errorf("Validate(%+v) = %v, want ErrInvalidArgument", c, err)
		}
		if _, err := StartEmbedded(context.Background(), c); !errors.Is(err, comm.ErrInvalidArgument) {
			t.Errorf("StartEmbedded(%+v) = %v, want ErrInvalidArgument", c, err)
		}
	}
	if err := DefaultEmbeddedConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	if _, err := StartEmbeddedCluster(context.Background(), DefaultEmbeddedConfig(), 0); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("cluster of 0 = %v", err)
	}
}

// A 3-member cluster keeps serving, with a Store on it, when one member
// stops.
func TestEmbeddedClusterSurvivesOneMember(t *testing.T) {
	ctx := testutil.Ctx(t, 90*time.Second)
	cfg := DefaultEmbeddedConfig()
	cfg.UnsafeNoFsync = true
	c, err := StartEmbeddedCluster(ctx, cfg, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if n := len(c.Endpoints()); n != 3 {
		t.Fatalf("%d endpoints", n)
	}
	cli, err := c.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ml, err := cli.MemberList(ctx)
	if err != nil || len(ml.Members) != 3 {
		t.Fatalf("member list %v, %v", ml, err)
	}
	s := membership.NewStore(cli, "/ftcomm/j/rdzv/1")
	if _, err := s.Add(ctx, "n", 1); err != nil {
		t.Fatal(err)
	}
	// Stop the member that leads raft: the worst case.
	var leader *Embedded
	for _, m := range c.Members {
		if m.etcd.Server.Leader() == m.etcd.Server.MemberID() {
			leader = m
		}
	}
	if leader == nil {
		t.Fatal("no member leads")
	}
	leader.Close()
	if n, err := s.Add(ctx, "n", 1); err != nil || n != 2 {
		t.Fatalf("add after leader stop = %d, %v", n, err)
	}
	if v, err := s.Get(ctx, "n"); err != nil || string(v) != "2" {
		t.Fatalf("get = %q, %v", v, err)
	}
}

// A second server on a data directory in use fails at once with
// ErrDataDirInUse (etcd itself would wait forever for bbolt's lock); the
// directory is free again after Close. Close does not wait for a watch
// that stays attached.
func TestEmbeddedDataDirInUse(t *testing.T) {
	ctx := testutil.Ctx(t, 60*time.Second)
	cfg := DefaultEmbeddedConfig()
	cfg.Dir, cfg.UnsafeNoFsync = t.TempDir(), true
	e, err := StartEmbedded(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, err := StartEmbedded(ctx, cfg); !errors.Is(err, ErrDataDirInUse) {
		t.Fatalf("second server on %s: %v", cfg.Dir, err)
	}
	cli, err := e.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	wch := cli.Watch(ctx, "/", clientv3.WithPrefix())
	if _, err := cli.Put(ctx, "/x", "1"); err != nil {
		t.Fatal(err)
	}
	<-wch // the watch is attached
	closed := make(chan struct{})
	go func() { e.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(4 * time.Second): // etcd's own graceful stop waits 7 s
		t.Fatal("Close waited for the attached watch")
	}
	e2, err := StartEmbedded(ctx, cfg)
	if err != nil {
		t.Fatalf("after Close: %v", err)
	}
	e2.Close()
}

// The embedded etcd keeps etcd's default request limit
// (membership.MaxRequestBytes: one epoch of a 100,000-participant job
// fits, coordinator.TestEpochTxnFitsEtcdDefaults), refusing a larger
// request with a clear error, not a hang; MaxRequestBytes raises it.
func TestEmbeddedRequestLimit(t *testing.T) {
	ctx := testutil.Ctx(t, 60*time.Second)
	for _, limit := range []uint{0, 4 << 20} {
		cfg := DefaultEmbeddedConfig()
		cfg.UnsafeNoFsync, cfg.MaxRequestBytes = true, limit
		e, err := StartEmbedded(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		cli, err := membership.NewClient(e.Endpoints(), nil)
		if err != nil {
			t.Fatal(err)
		}
		under := strings.Repeat("x", membership.MaxRequestBytes-64<<10)
		if _, err := cli.Txn(ctx).Then(clientv3.OpPut("/q", under)).Commit(); err != nil {
			t.Fatalf("limit %d: a %d-byte transaction: %v", limit, len(under), err)
		}
		over := strings.Repeat("x", membership.MaxRequestBytes+64<<10)
		_, err = cli.Put(ctx, "/over", over)
		if limit == 0 && (err == nil || !strings.Contains(err.Error(), "too large")) {
			t.Fatalf("default limit: a %d-byte put: %v, want request too large", len(over), err)
		}
		if limit > 0 && err != nil {
			t.Fatalf("limit %d: a %d-byte put: %v", limit, len(over), err)
		}
		cli.Close()
		e.Close()
	}
}
