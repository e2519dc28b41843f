package server

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// liveCoordinator is an in-process ftcoord: embedded etcd, a leading
// coordinator and the HTTP API on a free loopback port.
type liveCoordinator struct {
	etcd  *etcdhost.Embedded
	cli   *clientv3.Client
	coord *coordinator.Coordinator
	srv   *httptest.Server
	token string
}

func startLiveCoordinator(t *testing.T, token string, gossip bool) *liveCoordinator {
	t.Helper()
	ctx := testutil.Ctx(t, 30*time.Second)
	ec := etcdhost.DefaultEmbeddedConfig()
	ec.UnsafeNoFsync = true
	e, err := etcdhost.StartEmbedded(ctx, ec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	cli, err := e.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	reg := prometheus.NewRegistry()
	cc := coordinator.DefaultConfig()
	cc.Client, cc.Name, cc.Registerer = cli, "coord-a", reg
	cc.Logger = zaptest.NewLogger(t)
	if gossip {
		g := membership.DefaultGossipConfig()
		cc.Gossip = &g
	}
	coord, err := coordinator.New(cc)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- coord.Run(runCtx) }()
	t.Cleanup(func() { stop(); <-done })
	select {
	case <-coord.Leading():
	case <-ctx.Done():
		t.Fatal("coordinator did not lead")
	}
	a := &api{admin: coordinator.NewAdmin(cli, ""), coord: coord, cli: cli, token: token, gatherer: reg, lg: cc.Logger,
		keepOut: coordinator.DefaultEvictKeepOut, healthKey: etcdkeys.DefaultRoot + "/_health"}
	srv := httptest.NewServer(a.handler())
	t.Cleanup(srv.Close)
	return &liveCoordinator{etcd: e, cli: cli, coord: coord, srv: srv, token: token}
}

func (lc *liveCoordinator) join(t *testing.T, job, id string) *membership.Member {
	t.Helper()
	return lc.joinWith(t, job, id, nil)
}

// joinWith is join with mut (may be nil) changing the configuration.
func (lc *liveCoordinator) joinWith(t *testing.T, job, id string, mut func(*membership.MemberConfig)) *membership.Member {
	t.Helper()
	mc := membership.DefaultMemberConfig()
	mc.Client, mc.Job, mc.ID, mc.Addr, mc.Group = lc.cli, job, id, id+".host:7000", "g-"+id
	mc.WantQuorum = true
	mc.LeaseTTL = 2 * time.Second
	if mut != nil {
		mut(&mc)
	}
	m, err := membership.Join(testutil.Ctx(t, 10*time.Second), mc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// request sends an API request with the token (when withToken).
func (lc *liveCoordinator) request(t *testing.T, method, path, body string, withToken bool) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(testutil.Ctx(t, 10*time.Second), method, lc.srv.URL+path, stringsReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if withToken && lc.token != "" {
		req.Header.Set("Authorization", "Bearer "+lc.token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}
