package membership_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// registers reports whether req is a transaction that registers member id
// (puts its key).
func registers(req any, job, id string) bool {
	tr, ok := req.(*pb.TxnRequest)
	if !ok {
		return false
	}
	key := etcdkeys.Layout{Root: etcdkeys.DefaultRoot}.Member(job, id)
	for _, op := range tr.Success {
		if p := op.GetRequestPut(); p != nil && string(p.Key) == key {
			return true
		}
	}
	return false
}

// loseOnce returns a client of e whose first registration of member id
// fails in transit with gRPC Unavailable, as when the connection's
// keepalive goes unanswered on a starved host: applied (etcd applies it,
// the answer is lost) or not (it never reaches etcd).
func loseOnce(t *testing.T, tj *clustertest.Job, id string, applied bool, lost *atomic.Int32) *clientv3.Client {
	t.Helper()
	icpt := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if method == "/etcdserverpb.KV/Txn" && registers(req, tj.Name, id) && lost.CompareAndSwap(0, 1) {
			if applied {
				if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
					return err
				}
			}
			return status.Error(codes.Unavailable, "test: the connection broke before the answer came")
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	return interceptedClient(t, tj.Etcd.Endpoints(), icpt)
}

// interceptedClient is a client of endpoints whose unary calls go through
// icpt, closed when the test ends.
func interceptedClient(t *testing.T, endpoints []string, icpt grpc.UnaryClientInterceptor) *clientv3.Client {
	t.Helper()
	cc := membership.ClientConfig(endpoints, nil)
	cc.DialOptions = append(cc.DialOptions, grpc.WithChainUnaryInterceptor(icpt))
	cli, err := clientv3.New(cc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// A registration lost in transit does not end the Join: made again, it
// finds its own registration when etcd had applied it (the same record
// under the same lease), or registers when etcd had not. Either way the
// member is registered once, its incarnation is its key's, and the job
// forms with it. Before, the first such loss ended the Join (10,000 ranks
// registering on a loaded 2-core VM: docs/capacity.md).
func TestJoinRegistrationLostInTransit(t *testing.T) {
	for _, tc := range []struct {
		name           string
		applied, group bool
	}{
		{"applied, own lease", true, false},
		{"not applied, own lease", false, false},
		{"applied, the group's leader", true, true},
		{"applied, a group member", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
			ids := []string{"m0", "m1"}
			victim := "m1"
			if tc.group {
				ids = []string{"g.0", "g.1"}
				victim = map[bool]string{true: "g.0", false: "g.1"}[strings.Contains(tc.name, "leader")]
			}
			var lost atomic.Int32
			var ms []*membership.Member
			for _, id := range ids {
				ms = append(ms, tj.Join(id, func(c *membership.MemberConfig) {
					if id == victim {
						c.Client = loseOnce(t, tj, id, tc.applied, &lost)
					}
					if tc.group {
						c.Group, c.GroupLease, c.GroupLinkAddr = "g", true, "127.0.0.1:0"
					}
				}))
			}
			if lost.Load() != 1 {
				t.Fatalf("the registration of %s was not lost in transit", victim)
			}
			ctx := clustertest.Ctx(t, 10*time.Second)
			resp, err := tj.Client.Get(ctx, etcdkeys.Layout{}.Members(tj.Name), clientv3.WithPrefix())
			if err != nil {
				t.Fatal(err)
			}
			if len(resp.Kvs) != len(ids) {
				t.Fatalf("%d member keys, want %d", len(resp.Kvs), len(ids))
			}
			for _, m := range ms {
				key := etcdkeys.Layout{}.Member(tj.Name, m.ID())
				var kv *struct{ inc, lease int64 }
				for _, x := range resp.Kvs {
					if string(x.Key) == key {
						kv = &struct{ inc, lease int64 }{x.CreateRevision, x.Lease}
					}
				}
				if kv == nil || kv.inc != m.Incarnation() || kv.lease != m.Record().Lease {
					t.Fatalf("%s: key %+v, want incarnation %d under lease %x", m.ID(), kv, m.Incarnation(), m.Record().Lease)
				}
			}
			clustertest.WaitQuorum(t, ms[0], 0, ids...)
		})
	}
}

// A lease that ends before the registration under it (its renewals went
// unanswered for a TTL on a starved host: the group's leader's, or the
// member's own) does not end the Join: the member binds to a lease again
// and registers. Before, "requested lease not found" ended it.
func TestJoinLeaseEndsBeforeRegistration(t *testing.T) {
	for _, group := range []bool{false, true} {
		t.Run(map[bool]string{false: "own lease", true: "the group's lease"}[group], func(t *testing.T) {
			tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
			first, victim := "m0", "m1"
			if group {
				first, victim = "g.0", "g.1"
			}
			var revoked atomic.Int64
			icpt := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				if method == "/etcdserverpb.KV/Txn" && registers(req, tj.Name, victim) && revoked.Load() == 0 {
					for _, op := range req.(*pb.TxnRequest).Success {
						if p := op.GetRequestPut(); p != nil && p.Lease != 0 {
							if _, err := tj.Client.Revoke(ctx, clientv3.LeaseID(p.Lease)); err != nil {
								return err
							}
							revoked.Store(p.Lease)
							break
						}
					}
				}
				return invoker(ctx, method, req, reply, cc, opts...)
			}
			cli := interceptedClient(t, tj.Etcd.Endpoints(), icpt)
			mut := func(c *membership.MemberConfig) {
				if group {
					c.Group, c.GroupLease, c.GroupLinkAddr = "g", true, "127.0.0.1:0"
				}
			}
			tj.Join(first, mut)
			m := tj.Join(victim, func(c *membership.MemberConfig) { mut(c); c.Client = cli })
			gone := revoked.Load()
			if gone == 0 {
				t.Fatal("no lease was revoked under the registration")
			}
			if m.Record().Lease == gone {
				t.Fatalf("%s registered under the revoked lease %x", victim, gone)
			}
			ctx := clustertest.Ctx(t, 10*time.Second)
			resp, err := tj.Client.Get(ctx, etcdkeys.Layout{}.Member(tj.Name, victim))
			if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].CreateRevision != m.Incarnation() || resp.Kvs[0].Lease != m.Record().Lease {
				t.Fatalf("%s's key: %v %v, want incarnation %d under lease %x", victim, resp, err, m.Incarnation(), m.Record().Lease)
			}
		})
	}
}
