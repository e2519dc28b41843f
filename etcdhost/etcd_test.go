package etcdhost

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// startEtcd starts a single-member embedded etcd for one test and stops it
// when the test ends.
func startEtcd(t testing.TB) *Embedded {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := DefaultEmbeddedConfig()
	cfg.UnsafeNoFsync = true
	e, err := StartEmbedded(ctx, cfg)
	if err != nil {
		t.Fatalf("start etcd: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// newClient returns a fresh client of e closed when the test ends.
func newClient(t testing.TB, e *Embedded) *clientv3.Client {
	t.Helper()
	cli, err := e.NewClient(nil)
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}
