package diloco_test

import (
	"context"
	"fmt"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/ft/diloco"
)

// alone is a Comm of one replica: every collective is the identity and
// every step commits. Real jobs pass an *ft.Comm.
type alone struct{ step int64 }

func (a *alone) Register(string, comm.Tensor) error { return nil }
func (a *alone) Step(context.Context) error         { return nil }
func (a *alone) AllReduce(context.Context, comm.Tensor, comm.ReduceOp) *comm.Work {
	return comm.FailedWork(nil)
}
func (a *alone) AllGather(_ context.Context, out, in comm.Tensor) *comm.Work {
	copy(out.Bytes(), in.Bytes())
	return comm.FailedWork(nil)
}
func (a *alone) Commit(context.Context) (bool, error) { a.step++; return true, nil }
func (a *alone) CommittedStep() int64                 { return a.step }
func (a *alone) Epoch() uint64                        { return 1 }
func (a *alone) Participants() int                    { return 1 }
func (a *alone) Rank() int                            { return 0 }

// One replica minimising (θ − 3)² with plain SGD as its inner optimizer:
// the outer loop follows it to 3.
func Example() {
	ctx := context.Background()
	c := &alone{}
	params := []float32{0}
	cfg := diloco.DefaultConfig()
	cfg.InnerSteps = 10
	d, err := diloco.New(c, params, cfg)
	if err != nil {
		panic(err)
	}
	for c.CommittedStep() < 20 {
		if _, err := d.Tick(ctx); err != nil {
			panic(err)
		}
		params[0] -= 0.1 * 2 * (params[0] - 3) // inner SGD step
	}
	fmt.Printf("global %.2f after %d syncs\n", d.Global()[0], c.CommittedStep())
	// Output: global 3.00 after 20 syncs
}
