package ft

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// failPlan says which replica fails which step (FailStep), and records
// the step and epoch it failed in.
type failPlan struct {
	at     atomic.Int64  // fail the first step at or after it (0: not yet)
	failed chan struct{} // closed once the step failed
	step   int64         // the failed step, and its epoch: read after failed
	epoch  uint64
}

// trainOrFail is replica.train with a loop that fails one step (when r is
// the failer): its gradient has a NaN, which the loop finds before the
// gradient's all-reduce, so it calls FailStep, issues the all-reduce
// anyway and commits.
func (r *replica) trainOrFail(ctx context.Context, l *ledger, p *failPlan, failer bool) {
	defer close(r.done)
	grads := make([]float32, len(r.params))
	for {
		if err := r.c.Step(ctx); err != nil && !errors.Is(err, ErrRolledBack) {
			r.setErr(err)
			return
		}
		step := r.c.CommittedStep()
		for i := range grads {
			grads[i] = float32((int(step)*7+i)%13) / 8
		}
		if at := p.at.Load(); failer && at > 0 && step+1 >= at && p.step == 0 {
			grads[0] = float32(math.NaN())
			p.step, p.epoch = step+1, r.c.Epoch()
			if err := r.c.FailStep("loss is NaN"); err != nil {
				r.setErr(fmt.Errorf("FailStep: %w", err))
				return
			}
			// Revoked already: the NaN goes nowhere.
			if err := r.c.AllReduce(ctx, comm.Float32s(grads), comm.Avg).Wait(ctx); !errors.Is(err, comm.ErrRevoked) {
				r.setErr(fmt.Errorf("the all-reduce after FailStep: %v, want comm.ErrRevoked", err))
				return
			}
			close(p.failed)
		} else {
			r.c.AllReduce(ctx, comm.Float32s(grads), comm.Avg)
		}
		ok, err := r.c.Commit(ctx)
		if err != nil {
			r.setErr(err)
			return
		}
		if !ok {
			continue
		}
		r.applyCommit(l, grads)
	}
}

// FailStep at one rank of one replica fails that step at every replica:
// no replica commits it in the epoch it failed in (the NaN the loop found
// reaches no replica's state), and the job goes on committing, the failed
// step redone in the next epoch. With replica groups the failing rank's
// group learns it from its vote, the other groups from their rank of the
// failing rank's FT comm, whose op of the step fails.
func TestFailStepFailsTheStepEverywhere(t *testing.T) {
	for _, tc := range []struct {
		name   string
		groups []string
		size   int
		failer string
	}{
		{"replicas", []string{"a", "b", "c"}, 1, "b.0"},
		{"groups", []string{"a", "b"}, 2, "a.1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := newJob(t, quick(), 2)
			p := &failPlan{failed: make(chan struct{})}
			var rs []*replica
			for _, g := range tc.groups {
				for rank := range tc.size {
					r := j.open(g, rank, tc.size)
					ctx, cancel := context.WithCancel(context.Background())
					r.cancel = cancel
					go r.trainOrFail(ctx, j.ledger, p, r.id == tc.failer)
					rs = append(rs, r)
				}
			}
			for _, r := range rs {
				r.waitParticipants(len(tc.groups))
			}
			p.at.Store(rs[0].c.CommittedStep() + 2)
			select {
			case <-p.failed:
			case <-time.After(60 * time.Second):
				t.Fatal("the failer never failed its step")
			}
			for _, r := range rs {
				r.waitStep(p.step + 3)
			}
			j.stopAll(rs...)
			for _, r := range rs {
				redone := false
				for _, c := range r.records() {
					if c.step == p.step && c.epoch == p.epoch {
						t.Errorf("%s committed step %d in epoch %d, where %s failed it", r.id, c.step, c.epoch, tc.failer)
					}
					redone = redone || c.step == p.step && c.epoch > p.epoch
				}
				if !redone {
					t.Errorf("%s did not commit step %d in a later epoch: %+v", r.id, p.step, r.records())
				}
				for i, v := range r.params {
					if math.IsNaN(float64(v)) {
						t.Fatalf("%s: params[%d] is NaN: the failed step's gradient reached its state", r.id, i)
					}
				}
			}
		})
	}
}

// FailStep outside a started step is refused (comm.ErrInvalidArgument
// before Step and after Commit, ErrClosed after Close) and changes
// nothing; in a step it fails the commit, and the loop's reason is typed
// in the ErrTooManyCommitFailures error.
func TestFailStepMisuse(t *testing.T) {
	j := newJob(t, quick(), 1)
	j.cfg.MaxCommitFailures = 2
	r := j.open("a", 0, 1)
	defer r.c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	step := func(fail string) (bool, error) {
		t.Helper()
		if err := r.c.Step(ctx); err != nil {
			t.Fatal(err)
		}
		if fail != "" {
			if err := r.c.FailStep(fail); err != nil {
				t.Fatalf("FailStep in a step: %v", err)
			}
		}
		return r.c.Commit(ctx)
	}
	if err := r.c.FailStep("before Step"); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("FailStep before Step: %v, want comm.ErrInvalidArgument", err)
	}
	if ok, err := step(""); !ok || err != nil {
		t.Fatalf("the step after a refused FailStep: %v, %v; want it committed", ok, err)
	}
	if err := r.c.FailStep("after Commit"); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("FailStep after Commit: %v, want comm.ErrInvalidArgument", err)
	}
	if ok, err := step("first"); ok || err != nil {
		t.Fatalf("a failed step's Commit: %v, %v; want false, nil", ok, err)
	}
	ok, err := step("second")
	if ok || !errors.Is(err, ErrTooManyCommitFailures) || !errors.Is(err, ErrStepFailed) || !strings.Contains(err.Error(), "second") {
		t.Fatalf("the second failed step in a row: %v, %v; want ErrTooManyCommitFailures wrapping ErrStepFailed", ok, err)
	}
	for i := 0; ; i++ {
		ok, err := step("")
		if err != nil && !errors.Is(err, ErrTooManyCommitFailures) {
			t.Fatal(err)
		}
		if ok {
			break
		}
		if i == 5 {
			t.Fatal("no step committed after the failed ones")
		}
	}
	if err := r.c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.c.FailStep("after Close"); !errors.Is(err, ErrClosed) {
		t.Fatalf("FailStep after Close: %v, want ErrClosed", err)
	}
}
