package inproc_test

import (
	"context"
	"fmt"
	"sync"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

func Example() {
	ctx := context.Background()
	cluster := inproc.NewCluster()
	out := make([][]int32, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := comm.New(ctx, "inproc", comm.Options{Rank: r, Size: 2, Store: memstore.New(), BackendConfig: cluster})
			if err != nil {
				panic(err)
			}
			defer c.Close()
			out[r] = make([]int32, 4)
			in := []int32{int32(10 * r), int32(10*r + 1)}
			if err := c.AllGather(ctx, comm.Int32s(out[r]), comm.Int32s(in)); err != nil {
				panic(err)
			}
		}()
	}
	wg.Wait()
	fmt.Println(out[0], out[1])
	// Output: [0 1 10 11] [0 1 10 11]
}
