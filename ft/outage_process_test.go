package ft

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// ftcoordBin is the ftcoord binary, built once for the tests that run it
// as a process.
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
		out, err := exec.Command("go", "build", "-o", path, "github.com/ftcomm/ftcomm/cmd/ftcoord").CombinedOutput()
		if err != nil {
			ftcoordBin.err = fmt.Errorf("go build ftcoord: %v\n%s", err, out)
			return
		}
		ftcoordBin.path = path
	})
	if ftcoordBin.err != nil {
		t.Fatal(ftcoordBin.err)
	}
	return ftcoordBin.path
}

// coordProcess is a running `ftcoord serve` with its embedded etcd, as an
// operator starts it: secured (TLS, signed quorums, a credentials file
// for the trainers), on a data directory.
type coordProcess struct {
	t       *testing.T
	cmd     *exec.Cmd
	started time.Time
	mu      sync.Mutex
	logs    bytes.Buffer
	more    chan struct{} // closed and replaced at every log line
	done    chan struct{}
}

// startCoordProcess starts `ftcoord serve` on dataDir; its log lines that
// match show (and every line, when the test fails) go to the test's log,
// timed from its start.
func startCoordProcess(t *testing.T, dataDir string, show func(string) bool, args ...string) *coordProcess {
	t.Helper()
	args = append([]string{"serve", "-name", "outage", "-listen", "127.0.0.1:0", "-data-dir", dataDir}, args...)
	p := &coordProcess{t: t, cmd: exec.Command(buildFtcoord(t), args...), more: make(chan struct{}), done: make(chan struct{})}
	stderr, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p.started = time.Now()
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if show(line) {
				t.Logf("ftcoord +%.3fs: %s", time.Since(p.started).Seconds(), line)
			}
			p.mu.Lock()
			p.logs.WriteString(line + "\n")
			close(p.more)
			p.more = make(chan struct{})
			p.mu.Unlock()
		}
		p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("logs of ftcoord started at %s:\n%s", p.started.Format(time.TimeOnly), p.output())
		}
	})
	return p
}

// kill SIGKILLs the process and returns once it is gone.
func (p *coordProcess) kill() {
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

func (p *coordProcess) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.logs.String()
}

// waitLog waits until the process has logged a line containing s.
func (p *coordProcess) waitLog(s string, d time.Duration) {
	p.t.Helper()
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
			p.t.Fatalf("ftcoord exited without logging %q", s)
		case <-deadline:
			p.t.Fatalf("ftcoord did not log %q within %v", s, d)
		}
	}
}

// The coordinator is down (SIGKILL, with its embedded etcd) for longer
// than the members' leases, and one replica dies while it is down; the
// coordinator is started again on its data directory. The survivors form
// an epoch without the dead replica and train on: no step is committed
// twice (every step's commits are of one epoch and one state, no
// rollback), the dead replica takes part in no later epoch, and the job
// runs to its end. The time from the restart to the survivors' first
// commit is a figure (FIGURE), not asserted.
//
// The outage lasts until every survivor's lease renewal lapsed, and at
// least FTCOMM_FT_OUTAGE (default 5s). An operator's outage of 20 s is the
// same fault, longer: the restarted coordinator meets the same state
// either way (etcd restores every lease of before the outage, each with a
// full TTL, so the registrations of the dead replica and of the survivors
// are all there). FTCOMM_FT_OUTAGE_RUNS repeats it.
func TestProcessCoordinatorOutageWithADeath(t *testing.T) {
	if testing.Short() {
		t.Skip("starts ftcoord and replica processes")
	}
	outage := 5 * time.Second
	if s := os.Getenv("FTCOMM_FT_OUTAGE"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatal(err)
		}
		outage = d
	}
	runs := 1
	if s := os.Getenv("FTCOMM_FT_OUTAGE_RUNS"); s != "" {
		fmt.Sscan(s, &runs)
	}
	var figures []time.Duration
	for i := range runs {
		t.Run(fmt.Sprint(i), func(t *testing.T) { figures = append(figures, coordinatorOutageWithADeath(t, outage)) })
	}
	if len(figures) > 1 {
		t.Logf("FIGURE coordinator restarted → the survivors' first commit: %s", testutil.Durations(figures))
	}
}

func coordinatorOutageWithADeath(t *testing.T, outage time.Duration) time.Duration {
	dataDir := filepath.Join(t.TempDir(), "data")
	show := func(line string) bool {
		for _, s := range []string{"\tleading", "\tserving", "quorum published", "epoch revoked", "member removed",
			"quorum waits", "probing", "did not refuse"} {
			if strings.Contains(line, s) {
				return true
			}
		}
		return false
	}
	coord := startCoordProcess(t, dataDir, show)
	coord.waitLog("\tleading\t", 60*time.Second)
	credsPath := filepath.Join(dataDir, "trainer-credentials.json")
	creds, err := membership.LoadCredentials(credsPath)
	if err != nil {
		t.Fatal(err)
	}
	j := &procJob{t: t, endpoints: creds.Endpoints, events: make(chan childEvent, 10000),
		procs: map[string]*exec.Cmd{}, stdins: map[string]io.WriteCloser{}}
	t.Cleanup(j.printLogsIfFailed) // after stopAll: the logs are complete
	t.Cleanup(j.stopAll)
	ids := []string{"a.0", "b.0", "c.0", "d.0"}
	for _, g := range []string{"a", "b", "c", "d"} {
		j.spawnCmd(childCmd(), g, 0, 1, 1<<12, membership.CredentialsEnv+"="+credsPath)
	}
	seen := map[string]bool{}
	j.await("all four replicas committing together, from step 20", func(ev childEvent) bool {
		if ev.Kind == "" && ev.Participants == 4 && ev.Step >= 20 {
			seen[ev.ID] = true
		}
		return len(seen) == 4
	})

	// The outage: the coordinator and its etcd go; one replica dies
	// inside it.
	down := time.Now()
	coord.kill()
	t.Logf("test: ftcoord SIGKILLed")
	died := j.kill("d.0")
	survivors := ids[:3]
	lapsed := map[string]bool{}
	j.await("every survivor's lease renewal lapsed", func(ev childEvent) bool {
		if ev.Kind == "lapsed" && !lapsed[ev.ID] {
			lapsed[ev.ID] = true
			t.Logf("test: %s's lease renewal lapsed %.2fs into the outage", ev.ID, time.Unix(0, ev.UnixNano).Sub(down).Seconds())
		}
		return len(lapsed) == len(survivors)
	})
	if rest := outage - time.Since(down); rest > 0 {
		<-time.After(rest) // the outage's length, not a synchronisation
	}
	lastStep := map[string]int64{}
	for _, ev := range j.all {
		if ev.Kind == "" {
			lastStep[ev.ID] = max(lastStep[ev.ID], ev.Step)
		}
	}

	// The coordinator comes back on its data directory.
	coord = startCoordProcess(t, dataDir, show)
	back := coord.started
	t.Logf("test: ftcoord restarted after an outage of %.2fs; steps before it %v", back.Sub(down).Seconds(), lastStep)
	first := map[string]time.Duration{}
	j.await("the survivors' first commits after the restart", func(ev childEvent) bool {
		at := time.Unix(0, ev.UnixNano)
		switch {
		case ev.Kind == "error":
			t.Fatalf("%s failed: %s", ev.ID, ev.Err)
		case ev.Kind == "registered":
			t.Logf("test: %s registered again %.2fs after the restart", ev.ID, at.Sub(back).Seconds())
		case ev.Kind == "" && at.After(back):
			if _, ok := first[ev.ID]; !ok {
				first[ev.ID] = at.Sub(back)
				t.Logf("test: %s's first commit after the restart: step %d, epoch %d, %d participants, %.2fs after it",
					ev.ID, ev.Step, ev.Epoch, ev.Participants, at.Sub(back).Seconds())
			}
		}
		return len(first) == len(survivors)
	})
	var took time.Duration
	for _, d := range first {
		took = max(took, d)
	}
	t.Logf("FIGURE coordinator restarted (outage %.1fs, one of 4 replicas SIGKILLed in it) → every survivor's first commit: %v (%v)",
		back.Sub(down).Seconds(), took.Round(time.Millisecond), first)

	// The survivors train on, then end the run.
	from, at := map[string]int64{}, map[string]int64{}
	j.await("ten more commits of the three survivors at each", func(ev childEvent) bool {
		if ev.Kind == "" && ev.Participants == len(survivors) {
			if _, ok := from[ev.ID]; !ok {
				from[ev.ID] = ev.Step
			}
			at[ev.ID] = ev.Step
		}
		n := 0
		for _, id := range survivors {
			if s, ok := from[id]; ok && at[id] >= s+10 {
				n++
			}
		}
		return n == len(survivors)
	})
	for _, id := range survivors {
		j.send(id, "finish")
	}
	ended := map[string]int64{}
	j.await("every survivor finishing the run", func(ev childEvent) bool {
		if ev.Kind == "error" {
			t.Fatalf("%s failed: %s", ev.ID, ev.Err)
		}
		if ev.Kind == "finished" {
			ended[ev.ID] = ev.Step
		}
		return len(ended) == len(survivors)
	})
	j.mu.Lock()
	procs := j.procs
	j.procs, j.stdins = map[string]*exec.Cmd{}, map[string]io.WriteCloser{}
	j.mu.Unlock()
	for id, cmd := range procs {
		if err := cmd.Wait(); err != nil {
			t.Errorf("%s exited: %v", id, err)
		}
	}
	steps := slices.Collect(maps.Values(ended))
	if slices.Min(steps) != slices.Max(steps) {
		t.Errorf("the survivors ended the run at different steps: %v", ended)
	}

	// No step committed twice.
	j.check()
	epochOf := map[int64]uint64{}
	for _, ev := range j.all {
		switch {
		case ev.Kind == "rollback":
			t.Errorf("%s rolled back steps %d–%d: they had been committed in another epoch", ev.ID, ev.From, ev.To)
		case ev.Kind != "":
		case ev.ID == "d.0" && time.Unix(0, ev.UnixNano).After(died):
			t.Errorf("the dead replica committed step %d after its death", ev.Step)
		default:
			if e, ok := epochOf[ev.Step]; ok && e != ev.Epoch {
				t.Errorf("step %d committed in epochs %d and %d", ev.Step, e, ev.Epoch)
			}
			epochOf[ev.Step] = ev.Epoch
			if time.Unix(0, ev.UnixNano).After(back) && ev.Participants > len(survivors) {
				t.Errorf("%s committed step %d after the restart with %d participants: more than the %d survivors", ev.ID, ev.Step, ev.Participants, len(survivors))
			}
		}
	}
	return took
}
