package comm_test

import (
	"context"
	"sync"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

func TestSmoke(t *testing.T) {
	cl := inproc.NewCluster()
	const n = 4
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := comm.New(context.Background(), "inproc", comm.Options{Rank: r, Size: n, Store: memstore.New(), BackendConfig: cl})
			if err != nil {
				t.Error(err)
				return
			}
			defer c.Close()
			x := []float32{float32(r), 1}
			if err := c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum); err != nil {
				t.Error(err)
			}
			if x[0] != 6 || x[1] != 4 {
				t.Errorf("rank %d got %v", r, x)
			}
			w := c.AllReduceAsync(context.Background(), comm.Float32s(x), comm.Avg)
			if err := w.Wait(context.Background()); err != nil || x[0] != 6 {
				t.Errorf("rank %d async: %v %v", r, err, x)
			}
		}()
	}
	wg.Wait()
}
