package coordinator

import (
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/testutil"
)

// The tests of this package that need its internals cannot use
// test/clustertest (it imports this package): these are theirs.

// startEtcd starts a single-member embedded etcd for one test and stops it
// when the test ends.
func startEtcd(t testing.TB) *etcdhost.Embedded {
	t.Helper()
	cfg := etcdhost.DefaultEmbeddedConfig()
	cfg.UnsafeNoFsync = true
	e, err := etcdhost.StartEmbedded(testutil.Ctx(t, 30*time.Second), cfg)
	if err != nil {
		t.Fatalf("start etcd: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	return e
}

// newClient returns a fresh client of e closed when the test ends.
func newClient(t testing.TB, e *etcdhost.Embedded) *clientv3.Client {
	t.Helper()
	cli, err := e.NewClient(nil)
	if err != nil {
		t.Fatalf("etcd client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}
