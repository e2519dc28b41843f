package gloo_test

import (
	"context"
	"fmt"
	"sync"
	"time"

	_ "github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// Two ranks in one process, connected over loopback TCP, all-reduce a
// vector and broadcast another.
func Example() {
	store := memstore.New() // rendezvous; ranks in separate processes would share an etcd store
	defer store.Close()
	var wg sync.WaitGroup
	out := make([]string, 2)
	for rank := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c, err := comm.New(ctx, "gloo", comm.Options{
				Rank: rank, Size: 2, JobID: "example", Secret: []byte("shared secret"),
				Store: store, Prefix: "example/comm",
			})
			if err != nil {
				out[rank] = err.Error()
				return
			}
			defer c.Close()
			grads := []float32{float32(rank + 1), 10}
			if err := c.AllReduce(ctx, comm.Float32s(grads), comm.Avg); err != nil {
				out[rank] = err.Error()
				return
			}
			params := []int64{0, 0, 0}
			if rank == 0 {
				params = []int64{7, 8, 9}
			}
			if err := c.Broadcast(ctx, comm.Int64s(params), 0); err != nil {
				out[rank] = err.Error()
				return
			}
			out[rank] = fmt.Sprintf("rank %d: avg %v params %v", rank, grads, params)
		}()
	}
	wg.Wait()
	fmt.Println(out[0])
	fmt.Println(out[1])
	// Output:
	// rank 0: avg [1.5 10] params [7 8 9]
	// rank 1: avg [1.5 10] params [7 8 9]
}
