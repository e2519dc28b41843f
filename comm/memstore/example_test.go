package memstore_test

import (
	"context"
	"fmt"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

func Example() {
	ctx := context.Background()
	s := memstore.New()
	defer s.Close()
	epoch := comm.WithPrefix(s, "job1/epoch/4")
	go epoch.Set(ctx, "addr/1", []byte("127.0.0.1:4001"))
	addr, _ := epoch.Get(ctx, "addr/1") // waits for the Set
	n, _ := epoch.Add(ctx, "arrived", 1)
	fmt.Println(string(addr), n)
	// Output: 127.0.0.1:4001 1
}
