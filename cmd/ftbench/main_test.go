package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// mainArgsEnv makes the test binary run realMain with these arguments, so
// the process tests exercise the real launcher, which re-execs this same
// binary as its workers (workerEnv).
const mainArgsEnv = "FTBENCH_TEST_MAIN_ARGS"

func TestMain(m *testing.M) {
	if _, ok := os.LookupEnv(workerEnv); ok {
		os.Exit(realMain())
	}
	if args, ok := os.LookupEnv(mainArgsEnv); ok {
		os.Args = append([]string{"ftbench"}, strings.Fields(args)...)
		os.Exit(realMain())
	}
	os.Exit(m.Run())
}

// launched is a launcher process started by a test.
type launched struct {
	cmd    *exec.Cmd
	mu     sync.Mutex
	stderr bytes.Buffer
	stdout bytes.Buffer
	pids   map[int]int   // rank → worker pid, from the -v announcements
	pidsUp chan struct{} // closed when every rank's pid is known
	lines  chan string   // stdout lines
	done   chan struct{} // closed when the launcher has exited
	err    error         // its exit error, once done
}

var pidLine = regexp.MustCompile(`^ftbench: rank (\d+): pid (\d+)$`)

// startLauncher runs ftbench with args as its own process and follows its
// output. The test's cleanup kills it if it is still running.
func startLauncher(t *testing.T, np int, args ...string) *launched {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	l := &launched{pids: map[int]int{}, pidsUp: make(chan struct{}), lines: make(chan string, 1024), done: make(chan struct{})}
	l.cmd = exec.Command(exe)
	l.cmd.Env = append(os.Environ(), mainArgsEnv+"="+strings.Join(args, " "))
	stdout, err := l.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := l.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := l.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // ends at the launcher's exit (EOF)
		defer wg.Done()
		defer close(l.lines)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			l.mu.Lock()
			l.stdout.WriteString(sc.Text() + "\n")
			l.mu.Unlock()
			select {
			case l.lines <- sc.Text():
			default: // nobody follows the lines; they stay in l.stdout
			}
		}
	}()
	go func() { // ends at the launcher's exit (EOF)
		defer wg.Done()
		sc := bufio.NewScanner(stderr)
		// A worker that fails at its deadline logs its comm's flight
		// recorder as one line, over bufio's default 64 KiB: a scanner
		// stopped there lost the launcher's last words ("rank 0 failed").
		sc.Buffer(make([]byte, 1<<20), 64<<20)
		defer func() {
			if err := sc.Err(); err != nil {
				l.mu.Lock()
				l.stderr.WriteString("(test: stderr unread past here: " + err.Error() + ")\n")
				l.mu.Unlock()
				io.Copy(io.Discard, stderr) // the launcher must not block on a full pipe
			}
		}()
		for sc.Scan() {
			line := sc.Text()
			l.mu.Lock()
			l.stderr.WriteString(line + "\n")
			if m := pidLine.FindStringSubmatch(line); m != nil {
				r, _ := strconv.Atoi(m[1])
				p, _ := strconv.Atoi(m[2])
				l.pids[r] = p
				if len(l.pids) == np {
					close(l.pidsUp)
				}
			}
			l.mu.Unlock()
		}
	}()
	go func() {
		wg.Wait()
		l.err = l.cmd.Wait()
		close(l.done)
	}()
	t.Cleanup(func() {
		select {
		case <-l.done:
		default:
			l.cmd.Process.Kill()
			<-l.done
		}
	})
	return l
}

// wait waits for the launcher to exit, failing the test after d.
func (l *launched) wait(t *testing.T, d time.Duration) error {
	t.Helper()
	select {
	case <-l.done:
		return l.err
	case <-time.After(d):
		t.Fatalf("launcher still running after %s; stderr:\n%s", d, l.errText())
		return nil
	}
}

func (l *launched) errText() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.stderr.String()
}

func (l *launched) outText() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.stdout.String()
}

// workerPids waits until the launcher has announced every worker's pid.
func (l *launched) workerPids(t *testing.T, d time.Duration) map[int]int {
	t.Helper()
	select {
	case <-l.pidsUp:
	case <-l.done:
		t.Fatalf("launcher exited before starting its workers: %v\n%s", l.err, l.errText())
	case <-time.After(d):
		t.Fatalf("no worker pids after %s:\n%s", d, l.errText())
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[int]int{}
	for r, p := range l.pids {
		out[r] = p
	}
	return out
}

// waitLine waits for a stdout line matching match.
func (l *launched) waitLine(t *testing.T, d time.Duration, match func(string) bool) string {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case line, ok := <-l.lines:
			if !ok {
				t.Fatalf("launcher exited (%v) before the awaited line; stdout:\n%s\nstderr:\n%s", l.err, l.outText(), l.errText())
			}
			if match(line) {
				return line
			}
		case <-timer.C:
			t.Fatalf("awaited line not seen after %s; stdout:\n%s\nstderr:\n%s", d, l.outText(), l.errText())
		}
	}
}

// waitGone waits (on a pidfd, no polling) until process pid has exited.
// A pid that no longer exists counts as gone.
func waitGone(t *testing.T, pid int, d time.Duration) {
	t.Helper()
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return
	}
	if err != nil {
		t.Fatalf("pidfd_open(%d): %v", pid, err)
	}
	defer unix.Close(fd)
	deadline := time.Now().Add(d)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			t.Fatalf("worker pid %d still alive after %s", pid, d)
		}
		n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, int(left.Milliseconds())+1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			t.Fatalf("poll pidfd of %d: %v", pid, err)
		}
		if n > 0 {
			return
		}
	}
}

// exitCode is the launcher's exit status (-1 if it did not exit normally).
func exitCode(err error) int {
	if err == nil {
		return 0
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

func TestLauncherRejectsBadFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-np", "1"}, "-np 1"},
		{[]string{"-backend", "nosuch"}, `unknown backend "nosuch"`},
		{[]string{"-e", "12Q"}, `"12Q"`},
	} {
		l := startLauncher(t, 0, c.args...)
		err := l.wait(t, time.Minute)
		if code := exitCode(err); code != 2 {
			t.Errorf("%q: exit code %d (%v), want 2 for a usage error", c.args, code, err)
		}
		if !strings.Contains(l.errText(), c.want) {
			t.Errorf("%q: stderr does not explain the bad flag (%s):\n%s", c.args, c.want, l.errText())
		}
	}
}

// jsonLines parses the launcher's -json output.
func jsonLines(t *testing.T, out string) (Meta, []Row, Summary) {
	t.Helper()
	var (
		meta Meta
		rows []Row
		sum  Summary
	)
	for i, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var head struct{ Type string }
		if err := json.Unmarshal([]byte(line), &head); err != nil {
			t.Fatalf("line %d is not JSON: %q", i, line)
		}
		var err error
		switch head.Type {
		case "meta":
			err = json.Unmarshal([]byte(line), &meta)
		case "row":
			var r Row
			err = json.Unmarshal([]byte(line), &r)
			rows = append(rows, r)
		case "summary":
			err = json.Unmarshal([]byte(line), &sum)
		default:
			t.Fatalf("line %d has type %q", i, head.Type)
		}
		if err != nil {
			t.Fatalf("line %d: %v", i, err)
		}
	}
	return meta, rows, sum
}

var _ = context.Background
var _ = syscall.SIGTERM
