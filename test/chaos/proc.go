package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// child is a process the harness started: its stdout goes line by line to
// onLine (or to its log), its stderr to its log file.
type child struct {
	name    string
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	started time.Time
	done    chan struct{} // closed when it exited and its output was read
	err     error         // how it exited (after done)

	mu    sync.Mutex
	lines []string      // the last lines of its log, for waitLine
	more  chan struct{} // closed and replaced at every log line
}

// startChild starts cmd, logging to logPath. onLine, if set, receives each
// stdout line (from one goroutine); else stdout goes to the log too.
func startChild(name string, cmd *exec.Cmd, logPath string, onLine func([]byte)) (*child, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	c := &child{name: name, cmd: cmd, done: make(chan struct{}), more: make(chan struct{})}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		logf.Close()
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		logf.Close()
		return nil, err
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		logf.Close()
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c.stdin, c.started = stdin, time.Now()
	var logMu sync.Mutex
	logLine := func(b []byte) {
		logMu.Lock()
		logf.Write(b)
		logf.Write([]byte{'\n'})
		logMu.Unlock()
		c.mu.Lock()
		c.lines = append(c.lines, string(b))
		if len(c.lines) > 200 {
			c.lines = c.lines[len(c.lines)-100:]
		}
		close(c.more)
		c.more = make(chan struct{})
		c.mu.Unlock()
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		for sc.Scan() {
			if onLine != nil {
				onLine(sc.Bytes())
			} else {
				logLine(sc.Bytes())
			}
		}
	}()
	go func() {
		defer wg.Done()
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		for sc.Scan() {
			logLine(sc.Bytes())
		}
	}()
	go func() { // exits when the process has and its output is read
		wg.Wait()
		c.err = cmd.Wait()
		logf.Close()
		c.mu.Lock()
		close(c.more)
		c.mu.Unlock()
		close(c.done)
	}()
	return c, nil
}

func (c *child) pid() int { return c.cmd.Process.Pid }

func (c *child) signal(sig syscall.Signal) error {
	select {
	case <-c.done:
		return fmt.Errorf("%s has exited", c.name)
	default:
	}
	return c.cmd.Process.Signal(sig)
}

// stop signals sig and waits up to grace for the exit, then SIGKILLs.
func (c *child) stop(sig syscall.Signal, grace time.Duration) error {
	if err := c.signal(sig); err != nil {
		<-c.done
		return nil
	}
	select {
	case <-c.done:
		return nil
	case <-time.After(grace):
	}
	c.cmd.Process.Signal(syscall.SIGCONT) // a stopped process cannot die
	c.cmd.Process.Kill()
	<-c.done
	return fmt.Errorf("%s did not exit within %v of %v", c.name, grace, sig)
}

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// waitLine waits until a log line contains s.
func (c *child) waitLine(s string, timeout time.Duration) error {
	deadline := time.After(timeout)
	seen := 0
	for {
		c.mu.Lock()
		lines, more := c.lines, c.more
		c.mu.Unlock()
		if seen > len(lines) {
			seen = 0
		}
		for _, l := range lines[seen:] {
			if strings.Contains(l, s) {
				return nil
			}
		}
		seen = len(lines)
		select {
		case <-more:
		case <-c.done:
			return fmt.Errorf("%s exited (%v) before logging %q", c.name, c.err, s)
		case <-deadline:
			return fmt.Errorf("%s did not log %q within %v", c.name, s, timeout)
		}
	}
}

// exitReason says how a process ended.
func exitReason(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return "signal " + ws.Signal().String()
		}
		return fmt.Sprintf("exit status %d", ee.ExitCode())
	}
	if err != nil {
		return err.Error()
	}
	return "exit status 0"
}
