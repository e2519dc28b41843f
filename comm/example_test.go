package comm_test

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// Three ranks (goroutines here; processes with a network backend) sum a
// vector, then the survivors of a failure shrink and carry on.
func Example() {
	ctx := context.Background()
	cluster, store := inproc.NewCluster(), memstore.New()
	const n = 3
	comms := make([]*comm.Comm, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := comm.New(ctx, "inproc", comm.Options{Rank: r, Size: n, Epoch: 1, Store: store, BackendConfig: cluster})
			if err != nil {
				panic(err)
			}
			comms[r] = c
			x := []float32{float32(r + 1), 10}
			if err := c.AllReduce(ctx, comm.Float32s(x), comm.Sum); err != nil {
				panic(err)
			}
			if r == 0 {
				fmt.Println("sum over 3 ranks:", x)
			}
		}()
	}
	wg.Wait()

	// Rank 2 dies. The survivors' next collective fails, naming it.
	comms[2].Backend().(*inproc.Backend).Fail()
	comms[2].Close()
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := comms[r].Barrier(ctx)
			if r == 0 {
				fmt.Println("peer failed:", errors.Is(err, comm.ErrPeerFailed), "ranks:", comm.FailedRanks(err))
			}
			// Both survivors shrink to epoch 2 and keep going.
			c, err := comms[r].Shrink(ctx, []int{2}, 2)
			if err != nil {
				panic(err)
			}
			defer c.Close()
			x := []float32{1}
			if err := c.AllReduce(ctx, comm.Float32s(x), comm.Sum); err != nil {
				panic(err)
			}
			if r == 0 {
				fmt.Println("after shrink: size", c.Size(), "epoch", c.Epoch(), "sum", x[0])
			}
		}()
	}
	wg.Wait()
	// Output:
	// sum over 3 ranks: [6 30]
	// peer failed: true ranks: [2]
	// after shrink: size 2 epoch 2 sum 2
}
