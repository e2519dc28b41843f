package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/membership"
)

// coordinator is an embedded ftcoord: a single-node etcd and a
// membership.Coordinator in this process.
type coordinator struct {
	etcd *membership.Embedded
	cli  *clientv3.Client
	stop context.CancelFunc
	done chan error
}

// Its etcd keeps its data in a fresh temporary folder that close removes:
// every demo starts from an empty store.
func startCoordinator(ctx context.Context, gossip bool, log *zap.Logger) (*coordinator, error) {
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	ec := membership.DefaultEmbeddedConfig()
	ec.Logger = log.Named("etcd")
	e, err := membership.StartEmbedded(sctx, ec)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd: %w", err)
	}
	cli, err := e.NewClient(nil)
	if err != nil {
		e.Close()
		return nil, err
	}
	cc := membership.DefaultCoordinatorConfig()
	cc.Client, cc.Logger = cli, log.Named("coordinator")
	cc.Quorum.JoinTimeout, cc.SessionTTL = 500*time.Millisecond, 2*time.Second
	if gossip {
		g := membership.DefaultGossipConfig()
		cc.Gossip = &g
	}
	coord, err := membership.NewCoordinator(cc)
	if err != nil {
		cli.Close()
		e.Close()
		return nil, err
	}
	rctx, stop := context.WithCancel(context.Background())
	c := &coordinator{etcd: e, cli: cli, stop: stop, done: make(chan error, 1)}
	go func() { c.done <- coord.Run(rctx) }() // exits in close
	return c, nil
}

func (c *coordinator) endpoints() []string { return c.etcd.Endpoints() }

// close stops the coordinator, then etcd. Safe to call twice.
func (c *coordinator) close() error {
	if c.stop == nil {
		return nil
	}
	c.stop()
	c.stop = nil
	err := <-c.done
	if errors.Is(err, context.Canceled) {
		err = nil
	}
	return errors.Join(err, c.cli.Close(), c.etcd.Close())
}
