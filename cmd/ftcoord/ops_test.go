package main

import (
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

var endpointsRE = regexp.MustCompile(`embedded etcd running\t\{[^}]*"endpoints": \["([^"]+)"`)

// etcdEndpoint returns the embedded etcd's client endpoint, from the log.
func (p *coordProc) etcdEndpoint(t *testing.T) string {
	t.Helper()
	p.waitLog(t, "embedded etcd running", 60*time.Second)
	m := endpointsRE.FindStringSubmatch(p.output())
	if m == nil {
		t.Fatalf("no etcd endpoint in the logs of %s", p.name)
	}
	return m[1]
}

// credentialsPath is where the process writes the trainers' credentials.
func (p *coordProc) credentialsPath() string {
	return filepath.Join(p.dataDir, "trainer-credentials.json")
}

// credentials reads the trainers' credentials the process wrote.
func (p *coordProc) credentials(t *testing.T) *membership.Credentials {
	t.Helper()
	p.waitLog(t, "trainer credentials written", 60*time.Second)
	c, err := membership.LoadCredentials(p.credentialsPath())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// etcdClient connects to the process's etcd as a trainer would: with
// the credentials file it wrote.
func (p *coordProc) etcdClient(t *testing.T) *clientv3.Client {
	t.Helper()
	cli, err := p.credentials(t).NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// joinMember registers a member of job through cli, with gossip and the
// trainers' credentials (nil: none), as ft.Comm does.
func joinMember(t *testing.T, cli *clientv3.Client, creds *membership.Credentials, job, id string, lg *zap.Logger) *membership.Member {
	t.Helper()
	mc := membership.DefaultMemberConfig()
	mc.Client, mc.Job, mc.ID, mc.Addr, mc.WantQuorum = cli, job, id, id+".host:1", true
	g := membership.DefaultGossipConfig()
	mc.Gossip, mc.Logger = &g, lg
	creds.ApplyMember(&mc)
	m, err := membership.Join(testutil.Ctx(t, 30*time.Second), mc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// waitParticipants waits for a quorum of m's job with n participants.
func waitParticipants(t *testing.T, m *membership.Member, n int) membership.Quorum {
	t.Helper()
	ctx := testutil.Ctx(t, 30*time.Second)
	q, err := m.NextQuorum(ctx, 0)
	for err == nil && len(q.Participants) != n {
		q, err = m.NextQuorum(ctx, q.Epoch)
	}
	if err != nil {
		t.Fatal(err)
	}
	return q
}

// A second ftcoord on a data directory in use used to
// block forever in bbolt's file lock, deaf to SIGTERM. It must say so and
// exit non-zero at once.
func TestServeProcessDataDirInUse(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	first := startFtcoord(t, "first", "-data-dir", dir)
	second := startFtcoordNoWait(t, "second", "-data-dir", dir)
	if code := second.wait(t, 10*time.Second); code != 1 {
		t.Fatalf("second ftcoord exited %d:\n%s", code, second.output())
	}
	if out := second.output(); !strings.Contains(out, "data directory in use") || !strings.Contains(out, dir) {
		t.Fatalf("the error does not say the directory is in use:\n%s", out)
	}
	first.waitLog(t, "\tleading\t", 30*time.Second) // the first one carries on
	first.cmd.Process.Signal(syscall.SIGTERM)
	if code := first.wait(t, 20*time.Second); code != 0 {
		t.Fatalf("first exited %d", code)
	}
}

// SIGTERM used to take 7–9 s while members or a watch
// were attached (etcd's graceful stop waited for their streams), so the
// members' leases could expire and a restart cost epochs. Now it stops
// within -shutdown-timeout, and a restart on the same data directory that
// is faster than the members' leases costs no epoch.
func TestServeProcessRestartKeepsEpoch(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	p := startFtcoord(t, "restart", "-data-dir", dir, "-shutdown-timeout", "1s")
	ep := p.etcdEndpoint(t)
	cli, creds := p.etcdClient(t), p.credentials(t)
	a, b := joinMember(t, cli, creds, "job", "a", nil), joinMember(t, cli, creds, "job", "b", nil)
	q := waitParticipants(t, a, 2)
	// An etcdctl-like watch on everything stays attached too.
	cli.Watch(testutil.Ctx(t, time.Minute), "/", clientv3.WithPrefix())

	stopped := time.Now()
	p.cmd.Process.Signal(syscall.SIGTERM)
	// The bound is the shutdown timeout plus slack for a loaded machine;
	// before the fix this took 7 s or more.
	if code := p.wait(t, 4*time.Second); code != 0 {
		t.Fatalf("exit code %d:\n%s", code, p.output())
	}
	t.Logf("SIGTERM → exit in %v with 2 members and a watch attached", time.Since(stopped).Round(time.Millisecond))

	p2 := startFtcoord(t, "restart", "-data-dir", dir, "-etcd-client-addr", ep)
	p2.waitLog(t, "\tleading\t", 30*time.Second)
	// A joiner after the restart gets the very next epoch: the restart
	// itself published none, and a and b are the same incarnations.
	c := joinMember(t, cli, creds, "job", "c", nil)
	q2 := waitParticipants(t, c, 3)
	if q2.Epoch != q.Epoch+1 || q2.Reason != "joined c" || len(q2.Removed) != 0 {
		t.Fatalf("after the restart: epoch %d (%q), before it %d", q2.Epoch, q2.Reason, q.Epoch)
	}
	for _, m := range []*membership.Member{a, b} {
		if !q2.Includes(m.ID(), m.Incarnation()) || m.Err() != nil {
			t.Fatalf("member %s lost across the restart: %v", m.ID(), m.Err())
		}
	}
}

// A member started before ftcoord used to wait in its
// lease grant without a word and join up to 15 s after etcd came up (gRPC
// reconnect backoff). Now it says what it waits for and joins within
// about membership.ReconnectMaxDelay of etcd being up.
func TestMemberStartedBeforeFtcoord(t *testing.T) {
	// A first run makes the trainers' credentials (as after any earlier
	// run of the service); the member starts while ftcoord is down.
	dir := filepath.Join(t.TempDir(), "data")
	first := startFtcoord(t, "late", "-data-dir", dir)
	creds := first.credentials(t)
	addr := first.etcdEndpoint(t)
	first.cmd.Process.Signal(syscall.SIGTERM)
	if code := first.wait(t, 20*time.Second); code != 0 {
		t.Fatalf("first run exited %d", code)
	}
	cli, err := creds.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	core, logs := observer.New(zap.InfoLevel)
	waiting := make(chan struct{})
	var once sync.Once
	lg := zap.New(core, zap.Hooks(func(e zapcore.Entry) error {
		if strings.Contains(e.Message, "waiting for the coordinator's etcd") {
			once.Do(func() { close(waiting) })
		}
		return nil
	}))
	joined := make(chan *membership.Member, 1)
	go func() {
		mc := membership.DefaultMemberConfig()
		mc.Client, mc.Job, mc.ID, mc.Addr, mc.WantQuorum, mc.Logger = cli, "job", "early", "early:1", true, lg
		creds.ApplyMember(&mc)
		m, err := membership.Join(testutil.Ctx(t, 60*time.Second), mc)
		if err != nil {
			t.Error(err)
		}
		joined <- m
	}()
	// It says what it waits for.
	select {
	case <-waiting:
	case <-testutil.Ctx(t, 30*time.Second).Done():
		t.Fatal("the member did not say what it waits for")
	}
	w := logs.FilterMessageSnippet("waiting for the coordinator's etcd").All()[0]
	if why := w.ContextMap()["why"]; !strings.Contains(strings.Join(toStrings(why), " "), "connection refused") {
		t.Fatalf("waiting notice %v", w.ContextMap())
	}

	p := startFtcoordNoWait(t, "late", "-data-dir", dir, "-etcd-client-addr", addr)
	p.waitLog(t, "embedded etcd running", 60*time.Second)
	up := time.Now()
	m := <-joined
	if m == nil {
		t.Fatal("no member")
	}
	defer m.Close()
	took := time.Since(up)
	t.Logf("joined %v after etcd was up", took.Round(time.Millisecond))
	if took > membership.ReconnectMaxDelay+2*time.Second {
		t.Fatalf("joined %v after etcd was up", took)
	}
}

func toStrings(v any) []string {
	switch v := v.(type) {
	case []string:
		return v
	case []any:
		var out []string
		for _, x := range v {
			out = append(out, strings.TrimSpace(strings.Trim(strings.TrimSpace(toString(x)), `"`)))
		}
		return out
	}
	return []string{toString(v)}
}

func toString(v any) string {
	if s, ok := v.(string); ok {
		return s
	}
	return ""
}
