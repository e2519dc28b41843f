package ncclsim_test

import (
	"context"
	"fmt"
	"log"
	"sync"

	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/backends/nccl/ncclsim"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// Two ranks on simulated GPUs 0 and 1 all-reduce a device tensor, which
// runs anywhere: each rank (a simulated process) opens its own Library on
// the simulated machine, and the test reads the result straight from
// simulated device memory.
func Example() {
	ctx := context.Background()
	sim := ncclsim.New(2)
	store := memstore.New()
	out := make([][]byte, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() {
			lib, err := nccl.OpenSimulation(sim, nccl.LibraryConfig{})
			if err != nil {
				log.Fatal(err)
			}
			c, err := comm.New(ctx, "nccl", comm.Options{Rank: r, Size: 2, Device: r, Store: store,
				BackendConfig: &nccl.Config{Library: lib}})
			if err != nil {
				log.Fatal(err)
			}
			defer c.Close()
			buf, err := lib.Alloc(r, 4)
			if err != nil {
				log.Fatal(err)
			}
			defer buf.Free()
			if err := buf.CopyFromHost(ctx, []byte{byte(r + 1), 10, 20, 30}); err != nil {
				log.Fatal(err)
			}
			if err := c.AllReduce(ctx, buf.Tensor(comm.Uint8), comm.Sum); err != nil {
				log.Fatal(err)
			}
			if out[r], err = sim.ReadDevice(buf.Tensor(comm.Uint8)); err != nil {
				log.Fatal(err)
			}
		})
	}
	wg.Wait()
	fmt.Println(out[0], out[1], len(sim.Faults()))
	// Output: [3 20 40 60] [3 20 40 60] 0
}
