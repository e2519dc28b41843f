package coordinator_test

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// An evicted member used to register again at once (ft
// re-registers within 50 ms). It is kept out for the time asked, told
// until when, and let back in after.
func TestEvictKeepsOut(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	ctx := clustertest.Ctx(t, 30*time.Second)
	start := time.Now()
	until, err := tj.Coord.EvictFor(ctx, tj.Name, "b", "test", 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if d := until.Sub(start); d < 2*time.Second || d > 3*time.Second {
		t.Fatalf("kept out until %v after eviction", d)
	}
	<-b.Done()
	clustertest.WaitQuorum(t, a, q.Epoch, "a")
	_, err = membership.Join(ctx, membership.MemberConfig{Client: tj.Client, Job: tj.Name, ID: "b", Addr: "b:1"})
	var kept *membership.KeptOutError
	if !errors.As(err, &kept) || !errors.Is(err, membership.ErrKeptOut) || !kept.Until.Equal(until) || kept.By != "test" {
		t.Fatalf("rejoin: %v", err)
	}
	// The record goes with its lease; then b may come back.
	k := etcdkeys.Layout{}.Evicted(tj.Name, "b")
	resp, err := tj.Client.Get(ctx, k)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("keep-out record: %v %v", resp, err)
	}
	var ko membership.KeepOut
	if json.Unmarshal(resp.Kvs[0].Value, &ko) != nil || !ko.Until.Equal(until) {
		t.Fatalf("keep-out record %s", resp.Kvs[0].Value)
	}
	for wr := range tj.Client.Watch(ctx, k, clientv3.WithRev(resp.Header.Revision+1)) {
		if len(wr.Events) > 0 && wr.Events[0].Type == mvccpb.DELETE {
			break
		}
	}
	if time.Now().Before(until.Add(-time.Second)) {
		t.Fatalf("the keep-out ended early")
	}
	b2 := tj.Join("b", nil)
	clustertest.WaitQuorum(t, b2, 0, "a", "b")

	// Without a keep-out, nothing is stored and b may come back at once.
	if until, err := tj.Coord.EvictFor(ctx, tj.Name, "b", "test", 0); err != nil || !until.IsZero() {
		t.Fatalf("evict without keep-out: %v %v", until, err)
	}
	<-b2.Done()
	tj.Join("b", nil)
}
