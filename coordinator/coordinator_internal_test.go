package coordinator

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// startLeader starts etcd and a coordinator, waits until it leads, and
// returns it with a client of the etcd.
func startLeader(t *testing.T) (*Coordinator, *clientv3.Client) {
	t.Helper()
	e := startEtcd(t)
	cfg := DefaultConfig()
	cfg.Client, cfg.Name, cfg.SessionTTL = newClient(t, e), "c0", 2*time.Second
	cfg.Logger = zaptest.NewLogger(t).Named("c0")
	cfg.Registerer = prometheus.NewRegistry()
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	select {
	case <-c.Leading():
	case <-testutil.Ctx(t, 20*time.Second).Done():
		t.Fatal("c0 did not become leader")
	}
	return c, cfg.Client
}

// A deposed leader's write is refused by the fence, and its leadership
// ends there.
func TestFencedPublish(t *testing.T) {
	coord, cli := startLeader(t)
	const job = "job1"
	l := newLeadership(coord, nil, coord.keys.Election()+"/stale", 1)
	ctx := testutil.Ctx(t, 5*time.Second)
	now := time.Now()
	if err := l.feed(ctx, now, recordPut{job, membership.MemberRecord{Job: job, ID: "a", Addr: "a:1", Incarnation: 7, WantQuorum: true}}); err != nil {
		t.Fatal(err)
	}
	// Once joins are quiet, the quorum of a is due; its write is refused.
	if err := l.feed(ctx, now.Add(time.Second), tick{}); !errors.Is(err, ErrNotLeader) {
		t.Fatalf("stale publish = %v", err)
	}
	if _, err := NewAdmin(cli, "").Quorum(ctx, job); !errors.Is(err, ErrNoQuorum) {
		t.Fatalf("a quorum was written: %v", err)
	}
}

// The leader's own quorum writes seen late in its watch (after a newer
// one) are its own, not a foreign write: no false alarm, no repair.
func TestOwnLateQuorumEventIsNotForeign(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	c := &Coordinator{keys: etcdkeys.Layout{}, lg: zap.New(core), cfg: DefaultConfig()}
	m, err := newCoordMetrics(nil)
	if err != nil {
		t.Fatal(err)
	}
	c.metrics = m
	l := newLeadership(c, nil, "", 0)
	ctx := testutil.Ctx(t, 5*time.Second)
	j := l.m.job("j")
	j.quorumRev = 20 // the leader's newest write
	key := []byte(etcdkeys.Layout{}.Quorum("j"))
	feed := func(ev *clientv3.Event) {
		if err := l.feed(ctx, time.Now(), l.event(ev)); err != nil {
			t.Fatal(err)
		}
	}
	feed(&clientv3.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: key, Value: []byte(`{}`), ModRevision: 17}})
	if j.foreign != nil || logs.Len() != 0 {
		t.Fatalf("own write at 17 taken as foreign: %+v %v", j.foreign, logs.All())
	}
	feed(&clientv3.Event{Type: mvccpb.PUT, Kv: &mvccpb.KeyValue{Key: key, Value: []byte(`{"epoch":3}`), ModRevision: 21}})
	if j.foreign == nil || j.foreign.epoch != 3 || logs.Len() != 1 {
		t.Fatalf("foreign write at 21 missed: %+v %v", j.foreign, logs.All())
	}
}

// A reported death is confirmed by a refused connection, also when the
// killed process still accepts for a moment while it exits; a process
// that keeps answering is not dead.
func TestProbeDead(t *testing.T) {
	ctx := context.Background()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if dead, err := probeDead(ctx, addr); dead || err != nil {
		t.Fatalf("a listening process: dead %v, %v", dead, err)
	}
	// Exiting: it accepts the first dial, then its listener goes.
	accepted := make(chan struct{})
	go func() {
		c, err := ln.Accept()
		if err == nil {
			c.Close()
		}
		ln.Close()
		close(accepted)
	}()
	if dead, err := probeDead(ctx, addr); !dead {
		t.Fatalf("a process whose listener closed after one accept: dead %v, %v", dead, err)
	}
	<-accepted
	if dead, _ := probeDead(ctx, addr); !dead {
		t.Fatal("a closed port: not dead")
	}
}
