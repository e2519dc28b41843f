package coordinator_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

// A coordinator leads on an embedded etcd and publishes a job's first
// quorum; Admin reads the job from etcd, as the ftcoord API does.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	etcd, err := etcdhost.StartEmbedded(ctx, etcdhost.DefaultEmbeddedConfig())
	if err != nil {
		panic(err)
	}
	defer etcd.Close()
	cli, err := etcd.Client()
	if err != nil {
		panic(err)
	}

	cc := coordinator.DefaultConfig()
	cc.Client, cc.Name = cli, "c0"
	coord, err := coordinator.New(cc)
	if err != nil {
		panic(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- coord.Run(runCtx) }()
	defer func() { stop(); <-done }()
	<-coord.Leading()

	mc := membership.DefaultMemberConfig()
	mc.Client, mc.Job, mc.ID, mc.Addr, mc.WantQuorum = cli, "llama", "a", "a:7000", true
	m, err := membership.Join(ctx, mc)
	if err != nil {
		panic(err)
	}
	defer m.Close()
	q, err := m.NextQuorum(ctx, 0)
	if err != nil {
		panic(err)
	}

	jobs, err := coordinator.NewAdmin(cli, "").Jobs(ctx)
	if err != nil {
		panic(err)
	}
	for _, j := range jobs {
		fmt.Printf("%s: epoch %d, %d member(s), published by %s\n", j.Job, j.Epoch, j.Members, q.PublishedBy)
	}
	// Output:
	// llama: epoch 1, 1 member(s), published by c0
}
