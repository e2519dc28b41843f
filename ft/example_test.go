package ft_test

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	_ "github.com/ftcomm/ftcomm/backends/gloo" // the data backend, by name
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/coordinator/memcoord"
	"github.com/ftcomm/ftcomm/ft"
)

// Two replicas of a data-parallel job average their gradients through
// ft.Comm for three steps. The coordinator runs in
// memory here (memcoord); a real job points Config.Coordinator (or
// FTCOMM_CREDENTIALS) at `ftcoord serve`.
func Example() {
	coord := memcoord.New("demo", quorum.DefaultConfig())
	defer coord.Close()
	var wg sync.WaitGroup
	out := make([]string, 2)
	for r, group := range []string{"g0", "g1"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			c, err := ft.New(ctx, ft.Config{Job: "demo", Group: group, Secret: []byte("job secret"),
				MinReplicas: 2, Timeout: 30 * time.Second, Membership: coord.Join(group+".0", group, 2)})
			if err != nil {
				panic(err)
			}
			defer c.Close()
			params := []float32{1, 1}
			if err := c.Register("params", comm.Float32s(params)); err != nil { // what a rejoining replica heals from
				panic(err)
			}
			for c.CommittedStep() < 3 {
				if err := c.Step(ctx); err != nil {
					panic(err)
				}
				grads := []float32{float32(r), float32(2 * r)} // this replica's gradients
				c.AllReduce(ctx, comm.Float32s(grads), comm.Avg)
				if ok, err := c.Commit(ctx); err != nil {
					panic(err)
				} else if ok { // the step is the job's: apply it
					for i := range params {
						params[i] -= 0.5 * grads[i]
					}
				}
			}
			out[r] = fmt.Sprintf("%s: step %d, %d participants, params %v", group, c.CommittedStep(), c.Participants(), params)
		}()
	}
	wg.Wait()
	for _, s := range out {
		fmt.Println(s)
	}
	// Output:
	// g0: step 3, 2 participants, params [0.25 -0.5]
	// g1: step 3, 2 participants, params [0.25 -0.5]
}
