package main

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"syscall"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
)

// Python's tests (python_test.go) drive the ABI end to end; these check
// its Go parts alone.

// An error's status is its first kind in priority order, and the JSON
// lists every kind it matches and the ranks it names.
func TestClassify(t *testing.T) {
	peer := &comm.RankError{Rank: 2, Op: comm.OpAllReduce, Err: comm.ErrPeerFailed}
	for _, tc := range []struct {
		err    error
		status int32
		kinds  []string
		ranks  []int
	}{
		{fmt.Errorf("x: %w", comm.ErrInvalidArgument), errInvalidArgument, []string{"invalid_argument"}, nil},
		{fmt.Errorf("%w (%w)", comm.ErrTimeout, peer), errPeerFailed, []string{"peer_failed", "timeout"}, []int{2}},
		{fmt.Errorf("%w: %w", comm.ErrAborted, ErrInterrupted), errInterrupted, []string{"interrupted", "aborted"}, nil},
		{&ft.RollbackError{FromStep: 3, ToStep: 4, Step: 4, Epoch: 7}, errRolledBack, []string{"rolled_back"}, nil},
		{&ft.FinishedError{Final: 9, Step: 8}, errFinished, []string{"finished"}, nil},
		{context.DeadlineExceeded, errTimeout, []string{"timeout"}, nil},
		{ft.ErrClosed, errClosed, []string{"closed"}, nil},
		// A step the loop failed (ftcomm_ft_fail_step) stays too many failures.
		{fmt.Errorf("%w: 2 in a row, last: %w", ft.ErrTooManyCommitFailures, fmt.Errorf("%w: nan", ft.ErrStepFailed)),
			errTooManyFailures, []string{"too_many_commit_failures"}, nil},
		{errors.New("something else"), errOther, []string{"other"}, nil},
	} {
		info := classify(tc.err)
		if info.Status != tc.status || !slices.Equal(info.Kinds, tc.kinds) || !slices.Equal(info.Ranks, tc.ranks) {
			t.Errorf("%v: status %d kinds %v ranks %v; want %d %v %v", tc.err, info.Status, info.Kinds, info.Ranks, tc.status, tc.kinds, tc.ranks)
		}
	}
	if rb := classify(&ft.RollbackError{FromStep: 3, ToStep: 4, Step: 4, Epoch: 7}).Rollback; rb == nil || *rb != (rollback{3, 4, 4, 7, false}) {
		t.Errorf("rollback details: %+v", rb)
	}
	// A peer's refusal: its own kind (not invalid_argument: this rank's
	// arguments were fine), the rank, and why.
	ref := fmt.Errorf("comm t rank 0: broadcast #3: %w", &comm.RankError{Rank: 1, Op: comm.OpBroadcast,
		Err: fmt.Errorf("gloo: %w", &comm.Refusal{Rank: 1, Op: comm.OpBroadcast, Reason: "root 5 outside [0, 2)"})})
	info := classify(ref)
	if info.Status != errPeerRefused || !slices.Equal(info.Kinds, []string{"peer_refused"}) || !slices.Equal(info.Ranks, []int{1}) ||
		info.Refused == nil || *info.Refused != (refused{Rank: 1, Op: "broadcast", Reason: "root 5 outside [0, 2)"}) {
		t.Errorf("refusal: %+v (refused %+v)", info, info.Refused)
	}
}

// A handle is freed once: the second free, and any use after it, is
// ErrBadHandle; a handle of one kind is not another's.
func TestHandles(t *testing.T) {
	h := abi.put(&storeObj{addr: "x"})
	if _, err := lookup[*commObj](h); !errors.Is(err, ErrBadHandle) {
		t.Fatalf("lookup as the wrong kind: %v", err)
	}
	if _, err := take[*storeObj](h); err != nil {
		t.Fatal(err)
	}
	if _, err := take[*storeObj](h); !errors.Is(err, ErrBadHandle) {
		t.Fatalf("second free: %v", err)
	}
	if _, err := lookup[*storeObj](h); !errors.Is(err, ErrBadHandle) {
		t.Fatalf("use after free: %v", err)
	}
	if h2 := abi.put(&storeObj{}); h2 == h {
		t.Fatal("a handle was reused")
	} else {
		take[*storeObj](h2)
	}
}

// A panic inside a call becomes FTCOMM_ERR_INTERNAL with the stack in the
// thread's last error.
func TestGuardRecoversPanic(t *testing.T) {
	runtime.LockOSThread() // the last error is per OS thread
	defer runtime.UnlockOSThread()
	st := guard(func() error { panic("boom") })
	if int32(st) != errInternal {
		t.Fatalf("status %d, want %d", st, errInternal)
	}
	info := abi.lastError(syscall.Gettid())
	if info == nil || info.Kinds[0] != "internal" {
		t.Fatalf("last error: %+v", info)
	}
	abi.clearLastError(syscall.Gettid())
}

// ftcomm_interrupt cancels the ctx of calls in progress, with
// ErrInterrupted as the cause, and leaves later calls a fresh one.
func TestInterrupt(t *testing.T) {
	c := newCanceler()
	defer c.release()
	idle := c.ctx()
	if n := interruptAll(); n != 0 {
		t.Fatalf("interrupted %d objects with nothing blocked", n)
	}
	if idle.Err() != nil {
		t.Fatal("an idle object's ctx was cancelled")
	}
	ctx := c.enter()
	if n := interruptAll(); n != 1 {
		t.Fatalf("interrupted %d objects, want 1", n)
	}
	c.leave()
	if !errors.Is(context.Cause(ctx), ErrInterrupted) {
		t.Fatalf("cause %v", context.Cause(ctx))
	}
	if c.ctx().Err() != nil {
		t.Fatal("the next call's ctx is cancelled too")
	}
}
