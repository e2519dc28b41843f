package server

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

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
	s, err := New(testCtx(t, 30*time.Second), cfg)
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
	ctx := testCtx(t, 30*time.Second)
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
	q, err := m.NextQuorum(ctx, 0)
	if err != nil || q.PublishedBy != "inproc" || q.Signature == nil {
		t.Fatalf("quorum %+v, %v", q, err)
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
	m, err := membership.Join(testCtx(t, 30*time.Second), mc)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if q, err := m.NextQuorum(testCtx(t, 30*time.Second), 0); err != nil || q.Signature != nil {
		t.Fatalf("quorum %+v, %v", q, err)
	}
}

func TestServerCloseWithoutServe(t *testing.T) {
	cfg := DefaultConfig()
	cfg.DataDir, cfg.Listen, cfg.UnsafeNoFsync = t.TempDir(), "127.0.0.1:0", true
	s, err := New(testCtx(t, 30*time.Second), cfg)
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

// Issue 14 item 8: the HTTP server had no read or idle timeouts, so slow
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
