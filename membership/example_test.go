package membership_test

import (
	"context"
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

// A coordinator and two members of one job over an embedded etcd: the
// members learn their quorum by watch, and a leave forms the next epoch.
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
	cc.Client = cli
	coord, err := coordinator.New(cc)
	if err != nil {
		panic(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- coord.Run(runCtx) }()
	defer func() { stop(); <-done }()

	var members []*membership.Member
	for _, id := range []string{"a", "b"} {
		mc := membership.DefaultMemberConfig()
		mc.Client, mc.Job, mc.ID, mc.Addr = cli, "llama", id, id+":7000"
		m, err := membership.Join(ctx, mc)
		if err != nil {
			panic(err)
		}
		defer m.Close()
		members = append(members, m)
	}
	a, b := members[0], members[1]
	// Both registered, then both ask: one alone is not a majority of the
	// two live members, so the first quorum holds both.
	for _, m := range members {
		if err := m.RequestQuorum(ctx, false); err != nil {
			panic(err)
		}
	}

	q, err := a.NextQuorum(ctx, 0)
	if err != nil {
		panic(err)
	}
	fmt.Printf("epoch %d: %s rank %d, %s rank %d\n", q.Epoch, a.ID(), q.Rank("a"), b.ID(), q.Rank("b"))

	if err := b.Leave(ctx); err != nil {
		panic(err)
	}
	<-a.Revoked(q.Epoch) // a's communicator of epoch 1 must stop
	q, err = a.NextQuorum(ctx, q.Epoch)
	if err != nil {
		panic(err)
	}
	fmt.Printf("epoch %d: %d participant(s), because %s\n", q.Epoch, len(q.Participants), q.Reason)
	// Output:
	// epoch 1: a rank 0, b rank 1
	// epoch 2: 1 participant(s), because b left
}
