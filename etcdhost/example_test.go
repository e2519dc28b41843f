package etcdhost_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/etcdhost"
)

// An etcd server inside this process, on a free loopback port with a
// temporary data directory, and a client of it.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	etcd, err := etcdhost.StartEmbedded(ctx, etcdhost.DefaultEmbeddedConfig())
	if err != nil {
		panic(err)
	}
	defer etcd.Close() // stops it and removes the temporary directory
	cli, err := etcd.Client()
	if err != nil {
		panic(err)
	}
	if _, err := cli.Put(ctx, "/ftcomm/greeting", "hello"); err != nil {
		panic(err)
	}
	resp, err := cli.Get(ctx, "/ftcomm/greeting")
	if err != nil {
		panic(err)
	}
	fmt.Printf("%d endpoint(s); %s\n", len(etcd.Endpoints()), resp.Kvs[0].Value)
	// Output:
	// 1 endpoint(s); hello
}
