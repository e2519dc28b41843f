package server

import (
	"context"
	"io"
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
