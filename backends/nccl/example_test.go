package nccl_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync"

	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// On a machine without NCCL, the backend says so with a typed error.
func Example() {
	_, err := nccl.Open(nccl.LibraryConfig{NCCLPath: "/nonexistent/libnccl.so.2"})
	fmt.Println(errors.Is(err, comm.ErrBackendUnavailable))
	// Output: true
}

// Two ranks on GPUs 0 and 1 of one machine all-reduce a device tensor.
// (Not run by go test: it needs two GPUs.)
func ExampleNew() {
	ctx := context.Background()
	lib, err := nccl.Open(nccl.LibraryConfig{})
	if err != nil {
		log.Fatal(err)
	}
	store := memstore.New()
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() {
			c, err := comm.New(ctx, "nccl", comm.Options{Rank: r, Size: 2, Device: r, Store: store,
				BackendConfig: &nccl.Config{Library: lib}})
			if err != nil {
				log.Fatal(err)
			}
			defer c.Close()
			buf, err := lib.Alloc(r, 4*1024)
			if err != nil {
				log.Fatal(err)
			}
			defer buf.Free()
			if err := buf.Fill(ctx, 0); err != nil {
				log.Fatal(err)
			}
			if err := c.AllReduce(ctx, buf.Tensor(comm.Float32), comm.Sum); err != nil {
				log.Fatal(err)
			}
		})
	}
	wg.Wait()
}

// The same job on a Simulation, which runs anywhere: each rank (a
// simulated process) has its own Library on the simulated machine, and the
// test reads the result straight from simulated device memory.
func ExampleNewSimulation() {
	ctx := context.Background()
	sim := nccl.NewSimulation(2)
	store := memstore.New()
	out := make([][]byte, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() {
			lib := sim.Library()
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
