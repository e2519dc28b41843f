package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ftcomm/ftcomm/etcdhost"
)

// launcher runs one benchmark: an embedded etcd for rendezvous, one worker
// process per rank (this binary again, told by workerEnv), and the
// aggregation and printing of their rows.
//
// Every worker is killed (SIGKILL, by pid) as soon as any rank fails, hangs
// (no heartbeat for stall), or ctx ends (Ctrl-C, SIGTERM); run returns only
// after every worker has been waited for. A worker also dies on its own when
// the launcher does: its stdin (a pipe from the launcher) reaches EOF, and
// the kernel sends it SIGKILL (Pdeathsig).
type launcher struct {
	cfg   Config
	args  []string  // the command line, for the metadata
	exe   string    // the worker binary
	out   io.Writer // table or JSON
	diag  io.Writer // worker stderr (prefixed) and diagnostics
	stall time.Duration
}

// workerProc is one running worker, as the launcher sees it.
type workerProc struct {
	rank     int
	cmd      *exec.Cmd
	stdin    *os.File // our end of the worker's stdin; closing it tells the worker to stop
	tail     *tailWriter
	lastSeen time.Time
	exited   bool
	done     bool   // it reported "done"
	errMsg   string // the error it reported
	killed   bool   // we killed it
}

// event is something a worker did: wrote a line, or exited.
type event struct {
	rank int
	msg  *workerMsg
	line string // a stdout line that is not a message
	exit bool
	err  error
}

// rankFailure is why a rank failed, in the order the launcher noticed.
type rankFailure struct {
	rank   int
	reason string
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// run executes the benchmark and prints it. The returned Summary says
// whether every row was right; the error says why the run failed, if it did.
func (l *launcher) run(ctx context.Context) (Summary, error) {
	p := &printer{w: l.out, json: l.cfg.JSON}
	fail := func(err error) (Summary, error) {
		s, perr := p.summary(err)
		return s, errors.Join(err, perr)
	}
	if err := p.meta(newMeta(l.cfg, l.args)); err != nil {
		return Summary{}, err
	}

	ecfg := etcdhost.DefaultEmbeddedConfig()
	ecfg.UnsafeNoFsync = true // a throwaway store for one run
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	etcd, err := etcdhost.StartEmbedded(startCtx, ecfg)
	cancel()
	if err != nil {
		return fail(fmt.Errorf("ftbench: start embedded etcd: %w", err))
	}
	defer etcd.Close()

	runID := randomHex(8)
	secret := make([]byte, 32)
	rand.Read(secret)
	events := make(chan event, 64)
	var diagMu sync.Mutex
	procs := make([]*workerProc, l.cfg.NP)
	var wg sync.WaitGroup
	defer wg.Wait() // every waiter goroutine has returned before run does
	killAll := func() {
		for _, w := range procs {
			if w != nil && !w.exited && !w.killed {
				w.killed = true
				w.cmd.Process.Kill()
			}
		}
	}
	started := 0
	var startErr error
	for r := range procs {
		spec, _ := json.Marshal(workerSpec{Config: l.cfg, Rank: r, Endpoints: etcd.Endpoints(), RunID: runID, Secret: secret})
		w, err := l.start(r, spec, events, &diagMu)
		if err != nil {
			startErr = fmt.Errorf("ftbench: start rank %d: %w", r, err)
			break
		}
		procs[r] = w
		started++
		if l.cfg.Verbose {
			diagMu.Lock()
			fmt.Fprintf(l.diag, "ftbench: rank %d: pid %d\n", r, w.cmd.Process.Pid)
			diagMu.Unlock()
		}
		wg.Add(1)
		go func() { // exits when the worker has exited and its output is drained
			defer wg.Done()
			err := w.cmd.Wait()
			events <- event{rank: w.rank, exit: true, err: err}
		}()
	}
	defer func() {
		for _, w := range procs {
			if w != nil {
				w.stdin.Close()
			}
		}
	}()

	var failures []rankFailure
	var runErr error // a failure that is not one rank's (interrupt, bad rows, start)
	if startErr != nil {
		runErr = startErr
		killAll()
	}
	rows := map[int][]rankRow{}
	got := map[int]int{}
	next := 0
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	interrupted := ctx.Done()
	for exited := 0; exited < started; {
		select {
		case ev := <-events:
			w := procs[ev.rank]
			w.lastSeen = time.Now()
			switch {
			case ev.exit:
				w.exited = true
				exited++
				if !w.killed && (ev.err != nil || !w.done) {
					failures = append(failures, rankFailure{ev.rank, l.exitReason(w, ev.err)})
					killAll()
				}
			case ev.msg == nil:
				diagMu.Lock()
				fmt.Fprintf(l.diag, "[rank %d stdout] %s\n", ev.rank, ev.line)
				diagMu.Unlock()
			case ev.msg.Kind == "row" && ev.msg.Row != nil:
				rr := *ev.msg.Row
				if rows[rr.Index] == nil {
					rows[rr.Index] = make([]rankRow, l.cfg.NP)
				}
				rows[rr.Index][ev.rank] = rr
				got[rr.Index]++
				for got[next] == l.cfg.NP && runErr == nil {
					row, err := combine(rows[next], l.cfg.Average)
					if err == nil {
						err = p.row(row)
					}
					if err != nil {
						runErr = err
						killAll()
						break
					}
					delete(rows, next)
					delete(got, next)
					next++
				}
			case ev.msg.Kind == "error":
				w.errMsg = ev.msg.Err
			case ev.msg.Kind == "done":
				w.done = true
				if allDone(procs) { // release the workers: they close and exit
					for _, w := range procs {
						w.stdin.Close()
					}
				}
			}
		case <-tick.C:
			for _, w := range procs {
				if w != nil && !w.exited && !w.killed && time.Since(w.lastSeen) > l.stall {
					failures = append(failures, rankFailure{w.rank, fmt.Sprintf("made no progress for %s (hung); killed", l.stall)})
					killAll()
				}
			}
		case <-interrupted:
			interrupted = nil
			runErr = fmt.Errorf("ftbench: interrupted (%v); workers killed", context.Cause(ctx))
			killAll()
		}
	}
	if len(failures) == 0 && runErr == nil && len(got) > 0 {
		missing := make([]int, 0, len(got))
		for i := range got {
			missing = append(missing, i)
		}
		sort.Ints(missing)
		runErr = fmt.Errorf("ftbench: rows %v were not reported by every rank", missing)
	}
	var errs []error
	if runErr != nil {
		errs = append(errs, runErr)
	}
	for i, f := range failures {
		note := ""
		if i > 0 {
			note = " (after rank " + fmt.Sprint(failures[0].rank) + " failed)"
		}
		errs = append(errs, fmt.Errorf("ftbench: rank %d failed%s: %s", f.rank, note, f.reason))
	}
	if err := errors.Join(errs...); err != nil {
		return fail(err)
	}
	return p.summary(nil)
}

func allDone(procs []*workerProc) bool {
	for _, w := range procs {
		if w == nil || !w.done {
			return false
		}
	}
	return true
}

// exitReason explains a worker's unexpected exit: its own error message if
// it sent one, else its exit status and the end of its stderr.
func (l *launcher) exitReason(w *workerProc, err error) string {
	status := "exited without finishing"
	if err != nil {
		status = err.Error()
	}
	if w.errMsg != "" {
		return w.errMsg + " (" + status + ")"
	}
	if t := strings.TrimSpace(w.tail.String()); t != "" {
		return status + "; last output:\n" + t
	}
	return status
}

// start launches rank r's worker.
func (l *launcher) start(r int, spec []byte, events chan<- event, diagMu *sync.Mutex) (*workerProc, error) {
	stdinR, stdinW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(l.exe)
	cmd.Env = append(os.Environ(), workerEnv+"=1")
	cmd.Stdin = stdinR
	w := &workerProc{rank: r, cmd: cmd, stdin: stdinW, tail: &tailWriter{max: 20}, lastSeen: time.Now()}
	cmd.Stdout = &lineWriter{fn: func(line string) {
		var m workerMsg
		if err := json.Unmarshal([]byte(line), &m); err != nil || m.Kind == "" {
			events <- event{rank: r, line: line}
			return
		}
		events <- event{rank: r, msg: &m}
	}}
	cmd.Stderr = &lineWriter{fn: func(line string) {
		w.tail.add(line)
		diagMu.Lock()
		fmt.Fprintf(l.diag, "[rank %d] %s\n", r, line)
		diagMu.Unlock()
	}}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 5 * time.Second
	err = cmd.Start()
	stdinR.Close()
	if err == nil {
		_, err = stdinW.Write(append(spec, '\n')) // far below the pipe's buffer: never blocks
		if err != nil {
			cmd.Process.Kill()
			cmd.Wait()
		}
	}
	if err != nil {
		stdinW.Close()
		return nil, err
	}
	return w, nil
}

// lineWriter calls fn with each complete line written to it (a last line
// without a newline is dropped). exec calls Write from one goroutine per
// stream.
type lineWriter struct {
	buf bytes.Buffer
	fn  func(string)
}

func (lw *lineWriter) Write(b []byte) (int, error) {
	lw.buf.Write(b)
	for {
		i := bytes.IndexByte(lw.buf.Bytes(), '\n')
		if i < 0 {
			break
		}
		line := string(lw.buf.Next(i + 1))
		lw.fn(strings.TrimRight(line, "\r\n"))
	}
	return len(b), nil
}

// tailWriter keeps the last max lines given to add.
type tailWriter struct {
	mu    sync.Mutex
	max   int
	lines []string
}

func (t *tailWriter) add(line string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lines = append(t.lines, line)
	if len(t.lines) > t.max {
		t.lines = t.lines[len(t.lines)-t.max:]
	}
}

func (t *tailWriter) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(t.lines, "\n")
}
