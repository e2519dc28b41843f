package diloco_test

import (
	"context"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/ft/diloco"
)

// rewinding is a Comm of one replica whose Step, once, acts as ft.Comm
// does after a rollback: it heals the registered state to the job's (other
// values, the same step count) and returns a *ft.RollbackError.
type rewinding struct {
	alone
	state    map[string][]float32
	rollAt   int64 // the committed step at whose Step the rollback happens
	jobState float32
	rolled   bool
}

func (r *rewinding) Register(name string, t comm.Tensor) error {
	if r.state == nil {
		r.state = map[string][]float32{}
	}
	r.state[name] = t.AsFloat32s()
	return nil
}

func (r *rewinding) Step(context.Context) error {
	if r.rolled || r.step != r.rollAt {
		return nil
	}
	r.rolled = true
	for i := range r.state["diloco/global"] {
		r.state["diloco/global"][i] = r.jobState
	}
	clear(r.state["diloco/momentum"])
	return &ft.RollbackError{FromStep: r.step - 1, ToStep: r.step, Step: r.step, Epoch: 7}
}

// A rollback healed the global parameters to the job's: the sync counts
// as healed (local parameters reset to the job's global ones, this
// replica's stale progress not averaged in) and reports RolledBack, and
// training goes on.
func TestRollbackIsAHeal(t *testing.T) {
	ctx := context.Background()
	c := &rewinding{rollAt: 3, jobState: 42}
	params := []float32{0, 0, 0, 0}
	cfg := diloco.DefaultConfig()
	cfg.InnerSteps, cfg.Fragments, cfg.Overlap = 4, 1, 0
	d, err := diloco.New(c, params, cfg)
	if err != nil {
		t.Fatal(err)
	}
	var rolled []diloco.Outcome
	for c.CommittedStep() < 6 {
		out, err := d.Tick(ctx)
		if err != nil {
			t.Fatalf("Tick at step %d: %v", c.CommittedStep(), err)
		}
		if out.RolledBack {
			rolled = append(rolled, out)
			// The sync's outer update added nothing of this replica's
			// (weight 0, and the one-replica average is its own): the
			// global parameters are the job's, and so are the local ones.
			for i := range params {
				if d.Global()[i] != 42 || params[i] != 42 {
					t.Fatalf("after the rollback: global %v, local %v; want the job's 42 in both", d.Global(), params)
				}
			}
		}
		for i := range params {
			params[i] += 1 // inner progress
		}
	}
	if len(rolled) != 1 || !rolled[0].Healed || !rolled[0].Committed {
		t.Fatalf("outcomes with RolledBack: %+v; want one committed sync, marked healed", rolled)
	}
	if s := d.Stats(); s.Heals != 1 {
		t.Errorf("stats: %d heals, want 1", s.Heals)
	}
}
