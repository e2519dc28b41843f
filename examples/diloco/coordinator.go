package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/coordinator/server"
	"github.com/ftcomm/ftcomm/membership"
)

// coordinator is an embedded ftcoord in this process: a secured
// single-node etcd, the coordinator, and its API and dashboard, as
// `ftcoord serve` runs them.
type coordinator struct {
	srv  *server.Server
	dir  string
	stop context.CancelFunc
	done chan error
}

// Its data (etcd's, the certificates and the trainers' credentials) lives
// in a fresh temporary folder that close removes: every demo starts from
// an empty store.
func startCoordinator(ctx context.Context, gossip bool, log *zap.Logger) (*coordinator, error) {
	dir, err := os.MkdirTemp("", "diloco-ftcoord-")
	if err != nil {
		return nil, err
	}
	cfg := server.DefaultConfig()
	cfg.Listen, cfg.DataDir, cfg.UnsafeNoFsync = "127.0.0.1:0", dir, true
	cfg.Quorum.JoinTimeout, cfg.SessionTTL, cfg.ShutdownTimeout = 500*time.Millisecond, 2*time.Second, 5*time.Second
	cfg.Logger = log.Named("ftcoord")
	if gossip {
		g := membership.DefaultGossipConfig()
		cfg.Gossip = &g
	} else {
		cfg.Gossip = nil
	}
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	srv, err := server.New(sctx, cfg)
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("embedded ftcoord: %w", err)
	}
	rctx, stop := context.WithCancel(context.Background())
	c := &coordinator{srv: srv, dir: dir, stop: stop, done: make(chan error, 1)}
	go func() { c.done <- srv.Serve(rctx) }() // exits in close
	return c, nil
}

func (c *coordinator) endpoints() []string { return c.srv.Endpoints() }
func (c *coordinator) dashboard() string   { return c.srv.DashboardURL() }
func (c *coordinator) credentials() string { return c.srv.CredentialsPath() }

// close stops the coordinator, then removes its data. Safe to call twice.
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
	return errors.Join(err, c.srv.Close(), os.RemoveAll(c.dir))
}
