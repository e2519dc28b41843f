package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// ftcoordBin is the ftcoord binary built once for the process tests.
var ftcoordBin struct {
	once sync.Once
	path string
	err  error
}

func buildFtcoord(t *testing.T) string {
	t.Helper()
	ftcoordBin.once.Do(func() {
		dir, err := os.MkdirTemp("", "ftcoord-bin-")
		if err != nil {
			ftcoordBin.err = err
			return
		}
		path := filepath.Join(dir, "ftcoord")
		out, err := exec.Command("go", "build", "-o", path, ".").CombinedOutput()
		if err != nil {
			ftcoordBin.err = fmt.Errorf("go build: %v\n%s", err, out)
			return
		}
		ftcoordBin.path = path
	})
	if ftcoordBin.err != nil {
		t.Fatal(ftcoordBin.err)
	}
	return ftcoordBin.path
}

func TestMain(m *testing.M) {
	code := m.Run()
	if ftcoordBin.path != "" {
		os.RemoveAll(filepath.Dir(ftcoordBin.path))
	}
	os.Exit(code)
}

// coordProc is a running `ftcoord serve` process.
type coordProc struct {
	name     string
	cmd      *exec.Cmd
	url      string
	addrFile string
	dataDir  string
	mu       sync.Mutex
	logs     bytes.Buffer
	more     chan struct{} // closed and replaced at every new log line
	done     chan struct{}
	err      error
}

// startFtcoord starts `ftcoord serve` with args and waits until it serves.
func startFtcoord(t *testing.T, name string, args ...string) *coordProc {
	t.Helper()
	p := startFtcoordNoWait(t, name, args...)
	p.waitLog(t, "\tserving\t", 60*time.Second)
	b, err := os.ReadFile(p.addrFile)
	if err != nil {
		t.Fatal(err)
	}
	p.url = strings.TrimSpace(string(b))
	return p
}

// startFtcoordNoWait starts `ftcoord serve` with args.
func startFtcoordNoWait(t *testing.T, name string, args ...string) *coordProc {
	t.Helper()
	bin := buildFtcoord(t)
	dir := t.TempDir()
	addrFile := filepath.Join(dir, "addr")
	args = append([]string{"serve", "-name", name, "-listen", "127.0.0.1:0", "-addr-file", addrFile, "-data-dir", filepath.Join(dir, "data")}, args...)
	p := &coordProc{name: name, cmd: exec.Command(bin, args...), done: make(chan struct{}), more: make(chan struct{}), addrFile: addrFile}
	for i, a := range args {
		if a == "-data-dir" && i+1 < len(args) {
			p.dataDir = args[i+1]
		}
	}
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.logs.WriteString(line + "\n")
			close(p.more)
			p.more = make(chan struct{})
			p.mu.Unlock()
		}
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			t.Logf("logs of %s:\n%s", name, p.output())
		}
	})
	return p
}

// waitLog waits until the process has logged a line containing s.
func (p *coordProc) waitLog(t *testing.T, s string, d time.Duration) {
	t.Helper()
	deadline := time.After(d)
	for {
		p.mu.Lock()
		found, more := strings.Contains(p.logs.String(), s), p.more
		p.mu.Unlock()
		if found {
			return
		}
		select {
		case <-more:
		case <-p.done:
			t.Fatalf("%s exited without logging %q", p.name, s)
		case <-deadline:
			t.Fatalf("%s did not log %q within %v", p.name, s, d)
		}
	}
}

func (p *coordProc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.logs.String()
}

// wait waits for the process to exit and returns its exit code.
func (p *coordProc) wait(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(d):
		t.Fatalf("%s did not exit within %v", p.name, d)
		return -1
	}
}

// The default ftcoord: embedded etcd on free ports, API, status CLI,
// graceful SIGTERM.
func TestServeProcessEmbeddedEtcd(t *testing.T) {
	p := startFtcoord(t, "solo", "-token", "tok")
	p.waitLog(t, "\tleading\t", 30*time.Second)
	var out, errb bytes.Buffer
	env := func(k string) string {
		if k == "FTCOORD_TOKEN" {
			return "tok"
		}
		return ""
	}
	if code := run([]string{"status", "-addr", p.url}, env, &out, &errb); code != 0 {
		t.Fatalf("status: %d %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "coordinator solo, leader solo") || !strings.Contains(out.String(), "JOB") {
		t.Fatalf("status output:\n%s", out.String())
	}
	out.Reset()
	if code := run([]string{"status", "-addr", p.url}, func(string) string { return "" }, &out, &errb); code != 1 || !strings.Contains(errb.String(), "401") {
		t.Fatalf("status without token: %d %q", code, errb.String())
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	if code := p.wait(t, 20*time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM:\n%s", code, p.output())
	}
	if !strings.Contains(p.output(), "\tstopped\t") {
		t.Fatalf("no graceful stop in logs:\n%s", p.output())
	}
}

func TestServeProcessBadConfig(t *testing.T) {
	bin := buildFtcoord(t)
	cmd := exec.Command(bin, "serve", "-etcd", "not-an-endpoint", "-session-ttl", "500ms")
	cmd.Env = append(os.Environ(), "FTCOORD_HISTORY=0")
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 2 {
		t.Fatalf("exit %v, output:\n%s", err, out)
	}
	for _, want := range []string{`-etcd "not-an-endpoint"`, "-session-ttl 500ms", "-history 0"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// sessionTTL is the -session-ttl of TestLeaderKillAmongThree: the
// failover time it logs is about this long (the README's figures name it).
var sessionTTL = flag.Duration("ftcoord.session-ttl", 2*time.Second, "-session-ttl of the leader-kill test")

// Three ftcoord processes on a 3-node etcd cluster; the leader is
// SIGKILLed while a commit failure waits for the next epoch: another
// instance must publish it.
func TestLeaderKillAmongThree(t *testing.T) {
	ctx := testutil.Ctx(t, 120*time.Second)
	ec := etcdhost.DefaultEmbeddedConfig()
	ec.UnsafeNoFsync = true
	cluster, err := etcdhost.StartEmbeddedCluster(ctx, ec, 3)
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	eps := strings.Join(cluster.Endpoints(), ",")
	procs := map[string]*coordProc{}
	secrets := filepath.Join(t.TempDir(), "secrets.json") // one key for all three
	for i := 0; i < 3; i++ {
		name := fmt.Sprintf("coord-%d", i)
		procs[name] = startFtcoord(t, name, "-etcd", eps, "-session-ttl", sessionTTL.String(), "-join-timeout", "2s", "-secrets-file", secrets)
	}
	creds := procs["coord-0"].credentials(t)
	cli, err := cluster.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	var members []*membership.Member
	for _, id := range []string{"a", "b", "c"} {
		mc := membership.DefaultMemberConfig()
		mc.Client, mc.Job, mc.ID, mc.Addr, mc.WantQuorum = cli, "job", id, id+":1", true
		// No member dies here: the test is the coordinators' failover. A
		// suspicion is declared a death only after 8 s (0.4 s by default),
		// so that a loaded machine holding this process up does not evict
		// a live member (member a "evicted: registration deleted" in a CI
		// run beside other load).
		g := membership.DefaultGossipConfig()
		g.ProbeInterval, g.ProbeTimeout = time.Second, 500*time.Millisecond
		g.SuspicionMult, g.SuspicionMaxTimeoutMult = 8, 1
		mc.Gossip = &g
		creds.ApplyMember(&mc) // quorum verification, gossip key
		m, err := membership.Join(ctx, mc)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		members = append(members, m)
	}
	a := members[0]
	q, err := a.NextQuorum(ctx, 0)
	for err == nil && len(q.Participants) < 3 {
		q, err = a.NextQuorum(ctx, q.Epoch)
	}
	if err != nil {
		t.Fatal(err)
	}
	admin := coordinator.NewAdmin(cli, "")
	leader, err := admin.Leader(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if q.PublishedBy != leader {
		t.Fatalf("published by %s, leader %s", q.PublishedBy, leader)
	}

	killed := time.Now()
	procs[leader].cmd.Process.Signal(syscall.SIGKILL)
	if err := members[1].ReportCommitFailure(ctx, q.Epoch); err != nil {
		t.Fatal(err)
	}
	q2, err := a.NextQuorum(ctx, q.Epoch)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(killed)
	if q2.PublishedBy == leader || q2.PublishedBy == "" || len(q2.Participants) != 3 {
		t.Fatalf("after the leader's death: %+v", q2)
	}
	t.Logf("leader %s SIGKILLed: %s published epoch %d after %v (-session-ttl %v)", leader, q2.PublishedBy, q2.Epoch, took, *sessionTTL)

	// The new leader stops gracefully (SIGTERM): it resigns, and the third
	// instance takes over without waiting out the session TTL.
	second := procs[q2.PublishedBy]
	stopped := time.Now()
	second.cmd.Process.Signal(syscall.SIGTERM)
	if err := members[2].ReportCommitFailure(ctx, q2.Epoch); err != nil {
		t.Fatal(err)
	}
	q3, err := a.NextQuorum(ctx, q2.Epoch)
	if err != nil {
		t.Fatal(err)
	}
	if q3.PublishedBy == leader || q3.PublishedBy == second.name {
		t.Fatalf("epoch %d published by %s", q3.Epoch, q3.PublishedBy)
	}
	t.Logf("leader %s SIGTERMed: %s published epoch %d after %v", second.name, q3.PublishedBy, q3.Epoch, time.Since(stopped))
	if code := second.wait(t, 20*time.Second); code != 0 {
		t.Fatalf("SIGTERMed leader exited %d", code)
	}
}
