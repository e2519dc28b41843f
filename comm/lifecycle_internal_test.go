package comm

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the results in comm/testdata/lifecycle scripts")

// TestLifecycleScripts drives lifecycles through the scripts in
// testdata/lifecycle, event by event on one goroutine. A script is
// paragraphs, one scenario each on a fresh lifecycle: "#" lines say what
// holds, then lines "event -> what it did". Ops are named by a word and
// made at their first issue: a barrier, or an allreduce (which the test's
// Enqueuer can start), refused (invalid here, told to the peers), a shrink.
//
//	issue sync|async OP [allreduce] [refused] [shrink]  -> here | queued | Closed, +spawn
//	release | ran | done-acting                      -> ok, +spawn
//	next                                             -> run OP | start OP | wait | stopped
//	begin OP | start OP                              -> ok | refused ERRS
//	end OP nil|peer-failed|revoked|invalid|peer-refused|ctx|expired  -> ERRS [; abort ERRS]
//	start-failed OP                                  -> ERRS (the Enqueuer would not start it: a peer failed)
//	cancel OP                                        -> ok (ends OP's ctx)
//	overdue early|late                               -> none | rearm OP | abort OP ERRS
//	ctx-ended OP                                     -> none | abort OP ERRS
//	abort | revoke | close | replace                 -> what each returned
//	shutdown                                         -> ok (only on an idle comm: it waits)
//	state                                            -> OWNER HEALTH q=N p=N acting=N broken=open|closed
//
// ERRS are the sentinels an error matches, joined by +. Each op begins at
// t0 with a deadline a second later; overdue looks at it half a second
// (early) or two seconds (late) after t0.
func TestLifecycleScripts(t *testing.T) {
	dir := filepath.Join("testdata", "lifecycle")
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if name, ok := strings.CutSuffix(e.Name(), ".txt"); ok {
			t.Run(name, func(t *testing.T) { runLifecycleScript(t, filepath.Join(dir, e.Name())) })
		}
	}
}

func runLifecycleScript(t *testing.T, file string) {
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var s *scriptedLifecycle
	var out strings.Builder
	for n, line := range strings.Split(strings.TrimSuffix(string(data), "\n"), "\n") {
		ev, want, isEvent := strings.Cut(line, "->")
		switch {
		case line == "":
			s = nil // the next paragraph starts afresh
		case isEvent:
			if s == nil {
				s = newScriptedLifecycle()
			}
			got := s.step(t, strings.TrimSpace(ev))
			if !*rewrite && got != strings.TrimSpace(want) {
				t.Errorf("%s:%d: %s-> %s, want %s", file, n+1, ev, got, strings.TrimSpace(want))
			}
			line = ev + "-> " + got
		}
		out.WriteString(line + "\n")
	}
	if *rewrite {
		if err := os.WriteFile(file, []byte(out.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

type scriptedLifecycle struct {
	l       *lifecycle
	spawns  int
	ops     map[string]*Work
	cancels map[string]context.CancelFunc
	t0      time.Time
}

func newScriptedLifecycle() *scriptedLifecycle {
	s := &scriptedLifecycle{ops: map[string]*Work{}, cancels: map[string]context.CancelFunc{}, t0: time.Unix(1e9, 0)}
	startable := func(w *Work) bool { return w.d.refused == nil && w.d.kind == OpAllReduce }
	s.l = newLifecycle(zap.NewNop(), newFlightRecorder(16), func() { s.spawns++ }, startable)
	return s
}

func (s *scriptedLifecycle) step(t *testing.T, ev string) string {
	t.Helper()
	f := strings.Fields(ev)
	op := func() *Work {
		w := s.ops[f[1]]
		if w == nil {
			t.Fatalf("%s: no op %s", ev, f[1])
		}
		return w
	}
	l, spawns := s.l, s.spawns
	withSpawn := func(out string) string {
		if s.spawns > spawns {
			return out + " +spawn"
		}
		return out
	}
	switch f[0] {
	case "issue":
		ctx, cancel := context.WithCancel(context.Background())
		w := &Work{d: opDesc{kind: OpBarrier}, ctx: ctx}
		for _, m := range f[3:] {
			switch m {
			case "allreduce":
				w.d.kind = OpAllReduce
			case "refused":
				w.d.refused = fmt.Errorf("%w: root 9 of 2 ranks", ErrInvalidArgument)
			case "shrink":
				w.d.kind, w.d.reconfig = OpShrink, true
			default:
				t.Fatalf("%s: unknown op %s", ev, m)
			}
		}
		s.ops[f[2]], s.cancels[f[2]] = w, cancel
		here, err := l.issue(w, f[1] == "sync")
		switch {
		case err != nil:
			return sentinels(err)
		case here:
			return withSpawn("here")
		}
		return withSpawn("queued")
	case "release":
		l.release()
		return withSpawn("ok")
	case "ran":
		l.ran()
		return "ok"
	case "done-acting":
		l.doneActing()
		return "ok"
	case "next":
		l.mu.Lock()
		w, start, wait := l.nextLocked()
		l.mu.Unlock()
		switch {
		case wait:
			return "wait"
		case w == nil:
			return "stopped"
		case start:
			return "start " + s.name(w)
		}
		return "run " + s.name(w)
	case "begin", "start":
		if err := l.begin(op(), s.t0, s.t0.Add(time.Second), f[0] == "start"); err != nil {
			return "refused " + sentinels(err)
		}
		return "ok"
	case "end":
		w, expired := op(), false
		var err error
		switch f[2] {
		case "peer-failed":
			err = &RankError{Rank: 1, Op: w.d.kind, Err: ErrPeerFailed}
		case "revoked":
			err = fmt.Errorf("%w by rank 1", ErrRevoked)
		case "invalid":
			err = fmt.Errorf("%w: dtype mismatch", ErrInvalidArgument)
		case "peer-refused":
			err = &RankError{Rank: 1, Op: w.d.kind, Err: ErrPeerRefused}
		case "ctx":
			err = w.ctx.Err()
		case "expired":
			err, expired = context.Canceled, true
		}
		opErr, abort := l.end(w, err, expired)
		if abort != nil {
			return sentinels(opErr) + "; abort " + sentinels(abort)
		}
		return sentinels(opErr)
	case "start-failed":
		return sentinels(l.startFailed(op(), &RankError{Rank: 1, Op: OpAllReduce, Err: ErrPeerFailed}))
	case "shutdown":
		l.shutdown()
		return "ok"
	case "cancel":
		op()
		s.cancels[f[1]]()
		return "ok"
	case "overdue":
		now := s.t0.Add(500 * time.Millisecond)
		if f[1] == "late" {
			now = s.t0.Add(2 * time.Second)
		}
		cause, seq, kind, due := l.overdue(now)
		return s.action(cause, seq, kind, due)
	case "ctx-ended":
		return s.action(l.ctxEnded(op().seq), op().seq, op().d.kind, time.Time{})
	case "abort":
		return fmt.Sprintf("closed=%t", l.abort(fmt.Errorf("%w: by the test", ErrAborted)))
	case "revoke":
		return fmt.Sprint(l.revoke(fmt.Errorf("%w: by the test", ErrRevoked)))
	case "replace":
		return fmt.Sprint(l.replace(fmt.Errorf("%w: replaced by shrink", ErrClosed)))
	case "close":
		switch first, abort := l.close(); {
		case !first:
			return "again"
		case abort:
			return "first abort"
		}
		return "first"
	case "state":
		l.mu.Lock()
		defer l.mu.Unlock()
		broken := "open"
		select {
		case <-l.h.broken:
			broken = "closed"
		default:
		}
		return fmt.Sprintf("%s %s q=%d p=%d acting=%d broken=%s", l.owner, l.h.state, len(l.queue), l.pending, l.acting, broken)
	}
	t.Fatalf("unknown event %q", ev)
	return ""
}

// action says what a callback check returned: nothing to do, the deadline
// to re-arm for, or the op to abort the backend for.
func (s *scriptedLifecycle) action(cause error, seq uint64, kind OpType, due time.Time) string {
	switch {
	case cause != nil:
		for name, w := range s.ops {
			if w.seq == seq && w.d.kind == kind {
				return "abort " + name + " " + sentinels(cause)
			}
		}
		return "abort unknown op " + sentinels(cause)
	case !due.IsZero():
		for name, w := range s.ops {
			if w.deadline.Equal(due) && w == s.l.cur {
				return "rearm " + name
			}
		}
		return "rearm unknown op"
	}
	return "none"
}

func (s *scriptedLifecycle) name(w *Work) string {
	for name, o := range s.ops {
		if o == w {
			return name
		}
	}
	return "unknown op"
}

// sentinels names the errors err matches, joined by +; nil for none.
func sentinels(err error) string {
	if err == nil {
		return "nil"
	}
	var names []string
	for _, s := range []struct {
		name string
		err  error
	}{
		{"Closed", ErrClosed}, {"Revoked", ErrRevoked}, {"Aborted", ErrAborted}, {"Timeout", ErrTimeout},
		{"InvalidArgument", ErrInvalidArgument}, {"PeerRefused", ErrPeerRefused}, {"PeerFailed", ErrPeerFailed},
		{"Canceled", context.Canceled},
	} {
		if errors.Is(err, s.err) {
			names = append(names, s.name)
		}
	}
	if len(names) == 0 {
		return "other: " + err.Error()
	}
	return strings.Join(names, "+")
}

// The worker's next waits for work and returns nil once shutdown stops it;
// shutdown waits for the owner to go idle and for every callback's action.
func TestLifecycleWorkerRunsQueuedOpsAndStops(t *testing.T) {
	got, exited := make(chan *Work), make(chan struct{})
	var l *lifecycle
	spawn := func() {
		go func() {
			defer close(exited)
			for {
				w, _ := l.next()
				if w == nil {
					return
				}
				got <- w
				l.ran()
				close(w.done)
			}
		}()
	}
	l = newLifecycle(zap.NewNop(), newFlightRecorder(4), spawn, nil)
	for i := range 3 {
		w := &Work{d: opDesc{kind: OpBarrier}, ctx: context.Background()}
		if here, err := l.issue(w, false); here || err != nil {
			t.Fatalf("async issue: here %t, %v", here, err)
		}
		if r := <-got; r != w || r.seq != uint64(i+1) {
			t.Fatalf("worker took op #%d, want #%d", r.seq, i+1)
		}
		<-w.done
	}
	// A caller owns the executor and its op's ctx callback acts: shutdown
	// waits for both.
	ctx, cancel := context.WithCancel(context.Background())
	caller := &Work{d: opDesc{kind: OpBarrier}, ctx: ctx}
	if here, _ := l.issue(caller, true); !here {
		t.Fatal("a sync op on an idle comm did not run on its caller")
	}
	if err := l.begin(caller, time.Now(), time.Time{}, false); err != nil {
		t.Fatal(err)
	}
	cancel()
	if l.ctxEnded(caller.seq) == nil {
		t.Fatal("the ctx of the running op ended and nothing was to be aborted")
	}
	if first, abort := l.close(); !first || !abort {
		t.Fatalf("close: first %t abort %t; want both (an op runs)", first, abort)
	}
	stopped := make(chan struct{})
	go func() { l.shutdown(); close(stopped) }()
	l.end(caller, context.Canceled, false)
	l.release()
	select {
	case <-stopped:
		t.Fatal("shutdown returned while a callback acted")
	default:
	}
	l.doneActing()
	<-stopped
	<-exited
}

// backendBroke leaves a failure to the op that runs (it classifies what the
// backend saw), and acts only on one no op found.
func TestLifecycleBackendBrokeDefersToTheRunningOp(t *testing.T) {
	l := newLifecycle(zap.NewNop(), newFlightRecorder(4), func() {}, nil)
	w := &Work{d: opDesc{kind: OpBarrier}, ctx: context.Background()}
	if here, _ := l.issue(w, true); !here {
		t.Fatal("a sync op on an idle comm did not run on its caller")
	}
	if err := l.begin(w, time.Now(), time.Time{}, false); err != nil {
		t.Fatal(err)
	}
	watched := make(chan struct{})
	go func() {
		l.backendBroke(fmt.Errorf("%w: rank 1 is gone", ErrRevoked))
		close(watched)
	}()
	l.end(w, &RankError{Rank: 1, Op: OpBarrier, Err: ErrPeerFailed}, false)
	l.release()
	<-watched
	if err := l.err(); !errors.Is(err, ErrPeerFailed) || errors.Is(err, ErrRevoked) {
		t.Fatalf("refusal %v; want the op's failure, not the backend's", err)
	}

	for _, tc := range []struct {
		seen       error
		want       commState
		wantErrors []error
	}{
		{fmt.Errorf("%w: rank 1 is gone", ErrPeerFailed), stateFailed, []error{ErrAborted, ErrPeerFailed}},
		{fmt.Errorf("%w by rank 1", ErrRevoked), stateRevoked, []error{ErrRevoked}},
	} {
		l := newLifecycle(zap.NewNop(), newFlightRecorder(4), func() {}, nil)
		l.backendBroke(tc.seen) // idle: acts at once
		if l.state() != tc.want {
			t.Fatalf("backend broke with %v: %s, want %s", tc.seen, l.state(), tc.want)
		}
		for _, e := range tc.wantErrors {
			if !errors.Is(l.err(), e) {
				t.Fatalf("backend broke with %v: refusal %v does not match %v", tc.seen, l.err(), e)
			}
		}
		<-l.broken()
	}
}

// Health moves one way: active to failed or revoked, failed to revoked,
// anything to closed; Broken closes on the first move out of active.
func TestHealthMovesOneWay(t *testing.T) {
	to := func(h *health, s commState) {
		if s == stateClosed {
			h.close(ErrClosed)
		} else {
			h.breakTo(s, fmt.Errorf("to %s", s))
		}
	}
	states := []commState{stateActive, stateFailed, stateRevoked, stateClosed}
	for _, from := range states {
		for _, next := range states[1:] {
			h := health{log: zap.NewNop(), broken: make(chan struct{})}
			if from != stateActive {
				to(&h, from)
			}
			to(&h, next)
			want := next
			if from == stateClosed || (from == stateRevoked && next == stateFailed) {
				want = from
			}
			if h.state != want {
				t.Errorf("%s then %s: %s, want %s", from, next, h.state, want)
			}
			select {
			case <-h.broken:
			default:
				t.Errorf("%s then %s: broken still open", from, next)
			}
		}
	}
}
