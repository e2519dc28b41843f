package main

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	_ "github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/internal/testutil"
)

// trainer is an ft.Comm replica training in a goroutine of the test
// process, connected to ftcoord through a credentials file alone.
type trainer struct {
	group string
	c     *ft.Comm
	stop  context.CancelFunc
	done  chan struct{}

	mu      sync.Mutex
	commits []trainerCommit
	err     error
	more    chan struct{} // closed and replaced at every commit
}

type trainerCommit struct {
	at           time.Time
	participants int
}

func startTrainer(t *testing.T, group, credentials string) *trainer {
	t.Helper()
	cfg := ft.Config{Job: "keep", Group: group, Credentials: credentials, Backend: "gloo", Secret: []byte("k"),
		MinReplicas: 1, Timeout: 10 * time.Second, MaxCommitFailures: 1000,
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Named(group)}
	c, err := ft.New(testutil.Ctx(t, 60*time.Second), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Register("x", comm.Float32s(make([]float32, 16))); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	tr := &trainer{group: group, c: c, stop: cancel, done: make(chan struct{}), more: make(chan struct{})}
	go tr.train(ctx)
	t.Cleanup(tr.close)
	return tr
}

func (tr *trainer) train(ctx context.Context) {
	defer close(tr.done)
	grads := make([]float32, 16)
	for ctx.Err() == nil {
		if err := tr.c.Step(ctx); err != nil && !errors.Is(err, ft.ErrRolledBack) {
			tr.fail(ctx, err)
			return
		}
		tr.c.AllReduce(ctx, comm.Float32s(grads), comm.Avg)
		ok, err := tr.c.Commit(ctx)
		if err != nil {
			tr.fail(ctx, err)
			return
		}
		if ok {
			tr.mu.Lock()
			tr.commits = append(tr.commits, trainerCommit{time.Now(), tr.c.Participants()})
			close(tr.more)
			tr.more = make(chan struct{})
			tr.mu.Unlock()
		}
		select { // the step's compute
		case <-time.After(20 * time.Millisecond):
		case <-ctx.Done():
		}
	}
}

func (tr *trainer) fail(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return
	}
	tr.mu.Lock()
	tr.err = err
	close(tr.more)
	tr.more = make(chan struct{})
	tr.mu.Unlock()
}

// close stops the training loop and leaves the job. Safe to call twice.
func (tr *trainer) close() {
	tr.stop()
	<-tr.done
	tr.c.Close()
}

// waitCommit waits until the trainer commits a step with n participants
// after `after`.
func (tr *trainer) waitCommit(t *testing.T, n int, after time.Time, what string) {
	t.Helper()
	deadline := time.After(60 * time.Second)
	for {
		tr.mu.Lock()
		more, err := tr.more, tr.err
		found := false
		for _, c := range tr.commits {
			found = found || c.at.After(after) && c.participants == n
		}
		tr.mu.Unlock()
		switch {
		case found:
			return
		case err != nil:
			t.Fatalf("%s: trainer %s failed: %v", what, tr.group, err)
		}
		select {
		case <-more:
		case <-deadline:
			t.Fatalf("%s: trainer %s committed no step with %d participants within 60s", what, tr.group, n)
		}
	}
}

// Trainers started on ftcoord's credentials file go on across restarts of
// ftcoord on its data directory: a restart keeps the embedded etcd's
// endpoint (before, it moved to a new random port and the trainers tried
// the old one forever); a restart that cannot keep it (another process
// took the port) says so and exits; and when the operator moves etcd
// (-etcd-client-addr), the trainers, whose endpoints all fail, follow the
// rewritten credentials file.
func TestServeRestartKeepsTrainers(t *testing.T) {
	dir := t.TempDir() + "/data"
	p := startFtcoord(t, "keep", "-data-dir", dir, "-join-timeout", "500ms")
	p.waitLog(t, "\tleading\t", 30*time.Second)
	ep := p.etcdEndpoint(t)
	creds := p.credentialsPath()
	a, b := startTrainer(t, "a", creds), startTrainer(t, "b", creds)
	start := time.Now()
	a.waitCommit(t, 2, start, "before the restart")
	b.waitCommit(t, 2, start, "before the restart")

	// A plain restart: same endpoint; a new replica's epoch reaches a and b.
	stop := func() {
		t.Helper()
		p.cmd.Process.Signal(syscall.SIGTERM)
		if code := p.wait(t, 20*time.Second); code != 0 {
			t.Fatalf("ftcoord exited %d after SIGTERM:\n%s", code, p.output())
		}
	}
	stop()
	p = startFtcoordNoWait(t, "keep", "-data-dir", dir, "-join-timeout", "500ms")
	p.waitLog(t, "\tleading\t", 30*time.Second)
	if got := p.etcdEndpoint(t); got != ep {
		t.Fatalf("restarted on %s, before on %s", got, ep)
	}
	joined := time.Now()
	c := startTrainer(t, "c", creds)
	for _, tr := range []*trainer{a, b, c} {
		tr.waitCommit(t, 3, joined, "after a plain restart")
	}

	// Its port taken by another process: it says so, and exits.
	stop()
	squatter, err := net.Listen("tcp", ep)
	if err != nil {
		t.Fatal(err)
	}
	defer squatter.Close()
	p = startFtcoordNoWait(t, "keep", "-data-dir", dir)
	if code := p.wait(t, 30*time.Second); code != 1 || !strings.Contains(p.output(), ep) || !strings.Contains(p.output(), "-etcd-client-addr") {
		t.Fatalf("with its etcd port taken, ftcoord exited %d:\n%s", code, p.output())
	}

	// The operator moves etcd: the trainers follow the credentials file.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	moved := l.Addr().String()
	l.Close()
	p = startFtcoordNoWait(t, "keep", "-data-dir", dir, "-join-timeout", "500ms", "-etcd-client-addr", moved)
	p.waitLog(t, "\tleading\t", 30*time.Second)
	left := time.Now()
	c.close()
	for _, tr := range []*trainer{a, b} {
		tr.waitCommit(t, 2, left, "after etcd moved and c left")
	}
}
