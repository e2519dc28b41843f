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
