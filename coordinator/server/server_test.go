package server

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// startServer runs a Server on free loopback ports with its data in a
// temporary directory, until the test ends.
func startServer(t *testing.T, edit func(*Config)) *Server {
	t.Helper()
	cfg := DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.Name = t.TempDir(), "127.0.0.1:0", "inproc"
	cfg.UnsafeNoFsync = true
	if edit != nil {
		edit(&cfg)
	}
	s, err := New(testutil.Ctx(t, 30*time.Second), cfg)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(context.Background()) }()
	t.Cleanup(func() {
		s.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return s
}

// A program starts an embedded ftcoord in process: the dashboard answers,
// members join through its endpoints, and Close stops it all.
func TestServerInProcess(t *testing.T) {
	s := startServer(t, nil)
	if !strings.HasPrefix(s.DashboardURL(), "http://127.0.0.1:") {
		t.Fatalf("dashboard URL %q", s.DashboardURL())
	}
	resp, err := http.Get(s.DashboardURL())
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(page), "<title>ftcoord</title>") {
		t.Fatalf("dashboard: %d", resp.StatusCode)
	}
	// The readiness probe: etcd answers the coordinator's role (its
	// authentication is on), so /healthz says 200.
	resp, err = http.Get(strings.TrimSuffix(s.DashboardURL(), "/") + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	hz, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("healthz: %d %s", resp.StatusCode, hz)
	}
	ctx := testutil.Ctx(t, 30*time.Second)
	// Members connect with the credentials file it wrote (TLS, a client
	// certificate, the quorum-verification and gossip keys).
	creds, err := membership.LoadCredentials(s.CredentialsPath())
	if err != nil {
		t.Fatal(err)
	}
	if creds.CACert == "" || len(creds.QuorumKeys) == 0 || creds.Endpoints[0] != s.Endpoints()[0] {
		t.Fatalf("credentials %+v", creds)
	}
	cli, err := creds.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	mc := membership.DefaultMemberConfig()
	mc.Client, mc.Job, mc.ID, mc.Addr, mc.WantQuorum = cli, "demo", "a", "a:1", true
	creds.ApplyMember(&mc)
	m, err := membership.Join(ctx, mc)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	// The member verifies (credentials carry the key) and so acts only
	// on signed quorums.
	q, err := m.NextQuorum(ctx, 0)
	if err != nil || q.PublishedBy != "inproc" || mc.QuorumVerifier == nil {
		t.Fatalf("quorum %+v, %v (verifier %v)", q, err, mc.QuorumVerifier)
	}
}

// Insecure: plain etcd, unsigned quorums; the credentials file still
// names the endpoints.
func TestServerInsecure(t *testing.T) {
	s := startServer(t, func(c *Config) { c.Insecure = true })
	creds, err := membership.LoadCredentials(s.CredentialsPath())
	if err != nil {
		t.Fatal(err)
	}
	if creds.CACert != "" || len(creds.QuorumKeys) != 0 {
		t.Fatalf("insecure credentials %+v", creds)
	}
	cli, err := membership.NewClient(s.Endpoints(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	mc := membership.DefaultMemberConfig()
	mc.Client, mc.Job, mc.ID, mc.Addr, mc.WantQuorum = cli, "demo", "a", "a:1", true
	m, err := membership.Join(testutil.Ctx(t, 30*time.Second), mc)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if q, err := m.NextQuorum(testutil.Ctx(t, 30*time.Second), 0); err != nil || q.Signature != nil {
		t.Fatalf("quorum %+v, %v", q, err)
	}
}

func TestServerCloseWithoutServe(t *testing.T) {
	cfg := DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.UnsafeNoFsync = t.TempDir(), "127.0.0.1:0", true
	s, err := New(testutil.Ctx(t, 30*time.Second), cfg)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	s.Close()
	if err := s.Serve(context.Background()); err == nil {
		t.Fatal("Serve after Close succeeded")
	}
	if _, err := New(context.Background(), Config{}); err == nil || !strings.Contains(err.Error(), "invalid configuration") {
		t.Fatalf("zero config: %v", err)
	}
}

// The HTTP server had no read or idle timeouts, so slow
// or idle clients held a goroutine each for as long as they liked. A
// client that sends its headers or body too slowly, or idles between
// requests, is now cut off.
func TestServerCutsSlowAndIdleClients(t *testing.T) {
	s := startServer(t, func(c *Config) {
		c.Insecure = true
		c.ReadHeaderTimeout, c.ReadTimeout, c.IdleTimeout = 300*time.Millisecond, 600*time.Millisecond, 600*time.Millisecond
	})
	addr := strings.TrimPrefix(s.URL(), "http://")
	for _, c := range []struct{ what, send string }{
		{"slow headers", "GET /healthz HTTP/1.1\r\nHost: x\r\n"},
		{"slow body", "POST /api/v1/jobs/j/members/a/evict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"},
		{"idle after a request", "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"},
	} {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write([]byte(c.send)); err != nil {
			t.Fatal(err)
		}
		// The server must close the connection; the bound is far above
		// the timeouts (a loaded machine), far below "never".
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = io.Copy(io.Discard, conn)
		conn.Close()
		if err != nil {
			t.Errorf("%s: the server kept the connection: %v", c.what, err)
		}
	}
}

// What a platform team reads off a running instance: the advertised API
// address (not the bound one) and the build it runs, in the API and as
// the build-info metric.
func TestServerAdvertiseAndBuildInfo(t *testing.T) {
	s := startServer(t, func(c *Config) {
		c.Insecure, c.Gossip = true, nil
		c.Advertise, c.Version, c.Revision = "ftcoord-0.ftcoord.ftcomm.svc:0", "v9.9.9", "abc123"
	})
	bound := s.ln.Addr().(*net.TCPAddr)
	if want := "http://ftcoord-0.ftcoord.ftcomm.svc:" + strings.TrimPrefix(bound.String(), "127.0.0.1:"); s.URL() != want {
		t.Fatalf("URL %q, want %q", s.URL(), want)
	}
	get := func(path string) string {
		resp, err := http.Get("http://" + bound.String() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", path, resp.StatusCode, b)
		}
		return string(b)
	}
	var info CoordinatorInfo
	if err := json.Unmarshal([]byte(get("/api/v1/coordinator")), &info); err != nil || info.URL != s.URL() || info.Version != "v9.9.9" {
		t.Errorf("coordinator info %+v, %v", info, err)
	}
	metrics := get("/metrics")
	for _, want := range []string{`ftcomm_coordinator_build_info{goversion="go`, `revision="abc123",version="v9.9.9"} 1`, "go_build_info{"} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// The first connection to an external etcd: a wrong password fails New at
// once with etcd's answer (no retries can help), while an etcd that is not
// answering yet is waited for (retried, logged) until ctx ends.
func TestServerExternalEtcdConnect(t *testing.T) {
	ctx := testutil.Ctx(t, 60*time.Second)
	ec := etcdhost.DefaultEmbeddedConfig()
	ec.UnsafeNoFsync = true
	e, err := etcdhost.StartEmbedded(ctx, ec)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	cli, err := e.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.UserAdd(ctx, "root", "rootpw"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.UserGrantRole(ctx, "root", "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.AuthEnable(ctx); err != nil {
		t.Fatal(err)
	}
	external := func(endpoint, password string) Config {
		cfg := DefaultConfig()
		// The secrets and credentials files go to the data directory even
		// with an external etcd: never the working directory's default.
		cfg.DataDir = t.TempDir()
		cfg.Listen, cfg.Name, cfg.Insecure = "127.0.0.1:0", "ext", true
		cfg.Etcd, cfg.EtcdUser, cfg.EtcdPassword = []string{endpoint}, "root", password
		return cfg
	}
	// A wrong password: etcd's refusal, not a wait of etcdConnectFor.
	wctx, cancel := context.WithTimeout(ctx, etcdConnectFor)
	_, err = New(wctx, external(e.Endpoints()[0], "wrong"))
	waited := wctx.Err()
	cancel()
	if err == nil || waited != nil || !strings.Contains(err.Error(), "authentication failed") {
		t.Fatalf("wrong password: %v (ctx %v); want etcd's authentication failure at once", err, waited)
	}
	// Nothing listening: New retries until its ctx ends, and says so.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	silent := l.Addr().String()
	l.Close()
	sctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if _, err := New(sctx, external(silent, "rootpw")); err == nil || sctx.Err() == nil {
		t.Fatalf("no etcd: New returned %v before its ctx ended", err)
	}
}
