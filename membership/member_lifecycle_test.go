package membership_test

import (
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"

	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

func joinLifecycle(t *testing.T, cli *clientv3.Client, id string) *membership.Member {
	t.Helper()
	cfg := membership.DefaultMemberConfig()
	cfg.Client = cli
	cfg.Job, cfg.ID, cfg.Addr = "job1", id, id+".example:1"
	cfg.LeaseTTL = 2 * time.Second
	cfg.HeartbeatInterval = 0
	cfg.Logger = zaptest.NewLogger(t).Named(id)
	m, err := membership.Join(clustertest.Ctx(t, 20*time.Second), cfg)
	if err != nil {
		t.Fatalf("join %s: %v", id, err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// Revoked waiters are woken when the membership ends, those that ask after
// the end included. Before, a channel asked for after the end (or while it
// ended) was never closed.
func TestRevokedAfterEnd(t *testing.T) {
	e := clustertest.StartEtcd(t)
	m := joinLifecycle(t, clustertest.NewClient(t, e), "m0")
	before := m.Revoked(7)
	m.Close()
	select {
	case <-before:
	default:
		t.Fatal("a Revoked channel taken before Close is not closed by Close")
	}
	select {
	case <-m.Revoked(7):
	default:
		t.Fatal("Revoked(7) taken after the membership ended is never closed (the same epoch's earlier channel was)")
	}
}

// A write (Heartbeat, SetHealth, RequestQuorum, ReportFormed, ...) in
// flight when Leave runs lands before Leave's "leaving" record, never
// after it. Before, it could land after: the key was then deleted with a
// record that did not say leaving, and the coordinator saw the member
// rejoin and then die of lease expiry. The interceptor holds the write
// until Leave's own put went through (the old order) or, when Leave waits
// for it (the fixed order), for 500 ms.
func TestLeaveAfterWriteInFlight(t *testing.T) {
	e := clustertest.StartEtcd(t)
	var armed atomic.Bool
	hbEntered, hbRelease, hbDone := make(chan struct{}), make(chan struct{}), make(chan struct{})
	putValue := func(req any) (string, bool) {
		tr, ok := req.(*pb.TxnRequest)
		if !ok {
			return "", false
		}
		for _, op := range tr.Success {
			if p := op.GetRequestPut(); p != nil && strings.Contains(string(p.Key), "/members/") {
				return string(p.Value), true
			}
		}
		return "", false
	}
	icpt := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		v, isPut := putValue(req)
		switch {
		case method == "/etcdserverpb.KV/Txn" && isPut && strings.Contains(v, `"leaving":true`):
			// Leave's own write: let it through, then the write held
			// below lands before Leave goes on to revoke the lease.
			err := invoker(ctx, method, req, reply, cc, opts...)
			close(hbRelease)
			<-hbDone
			return err
		case method == "/etcdserverpb.KV/Txn" && isPut && armed.CompareAndSwap(true, false):
			close(hbEntered)
			select {
			case <-hbRelease:
			case <-time.After(500 * time.Millisecond): // only if Leave waits for this write (a fixed Leave)
			}
			err := invoker(ctx, method, req, reply, cc, opts...)
			close(hbDone)
			return err
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	m := joinLifecycle(t, interceptedClient(t, e.Endpoints(), icpt), "m0")
	key := etcdkeys.Layout{Root: etcdkeys.DefaultRoot}.Member("job1", "m0")
	wctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wch := clustertest.NewClient(t, e).Watch(wctx, key, clientv3.WithRev(m.Incarnation()+1), clientv3.WithPrevKV(), clientv3.WithFilterPut())

	ctx := clustertest.Ctx(t, 20*time.Second)
	armed.Store(true)
	hb := make(chan error, 1)
	go func() { hb <- m.Heartbeat(ctx) }()
	<-hbEntered
	if err := m.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("heartbeat: %v", <-hb)
	for wr := range wch {
		for _, ev := range wr.Events {
			var r membership.MemberRecord
			json.Unmarshal(ev.PrevKv.Value, &r)
			if !r.Leaving {
				t.Fatalf("the member key was deleted with a record that does not say leaving (a heartbeat in flight overwrote Leave's): %s", ev.PrevKv.Value)
			}
			return
		}
	}
	t.Fatal("watch ended")
}
