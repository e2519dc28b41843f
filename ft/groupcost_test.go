package ft

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
)

// TestGroupLeaseCost measures what a job of G replica groups of R ranks
// costs etcd in steady state with DurableCommit, with a lease per rank
// (RankLeases) and with a lease per group (the default): the leases held,
// the lease renewals per second and the etcd writes (raft proposals) per
// step. A measurement (its FIGURE lines), run on demand:
//
//	FTCOMM_FT_GROUP_COST=8x4 go test -run TestGroupLeaseCost -v ./ft
//
// The ranks run in one process over the inproc backend against one
// embedded etcd and a coordinator; lease TTL 6 s, heartbeats every 10 s.
// etcd's counters are process-wide (prometheus's default registry), so
// each mode reads them before and after a window of steady training.
func TestGroupLeaseCost(t *testing.T) {
	spec := os.Getenv("FTCOMM_FT_GROUP_COST")
	if spec == "" {
		t.Skip("a measurement: set FTCOMM_FT_GROUP_COST=GxR")
	}
	var groups, ranks int
	if _, err := fmt.Sscanf(spec, "%dx%d", &groups, &ranks); err != nil || groups < 1 || ranks < 2 {
		t.Fatalf("FTCOMM_FT_GROUP_COST=%q: want GxR with R ≥ 2", spec)
	}
	for _, rankLeases := range []bool{true, false} {
		name := "group-leases"
		if rankLeases {
			name = "rank-leases"
		}
		t.Run(name, func(t *testing.T) { measureGroupCost(t, groups, ranks, rankLeases) })
	}
}

func measureGroupCost(t *testing.T, groups, ranks int, rankLeases bool) {
	cluster := inproc.NewCluster()
	j := newEtcdJob(t, "inproc", cluster)
	j.cfg.Member.LeaseTTL = 6 * time.Second
	j.cfg.DurableCommit, j.cfg.RankLeases = true, rankLeases
	j.cfg.Timeout = 30 * time.Second
	cli, err := j.etcd.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx := context.Background()
	base, err := cli.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var rs []*replica
	for g := range groups {
		for r := range ranks {
			cfg := j.cfg
			cfg.Group, cfg.GroupRank, cfg.GroupSize = fmt.Sprintf("g%d", g), r, ranks
			cfg.Logger = zaptest.NewLogger(t).Named(memberID(cfg.Group, r))
			c, err := New(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			rp := &replica{t: t, id: memberID(cfg.Group, r), c: c, params: make([]float32, 256), done: make(chan struct{}), progress: make(chan struct{}, 1)}
			if err := c.Register("params", comm.Float32s(rp.params)); err != nil {
				t.Fatal(err)
			}
			tctx, cancel := context.WithCancel(ctx)
			rp.cancel = cancel
			go rp.train(tctx, j.ledger, 1<<40)
			rs = append(rs, rp)
		}
	}
	defer func() {
		for _, r := range rs {
			r.cancel()
			r.c.Close()
			<-r.done
		}
	}()
	// Steady: every rank committed a few steps in one epoch.
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for _, r := range rs {
		for r.c.CommittedStep() < 5 {
			select {
			case <-r.progress:
			case <-wctx.Done():
				t.Fatalf("%s did not reach step 5", r.id)
			}
		}
	}
	leases, err := cli.Leases(ctx)
	if err != nil {
		t.Fatal(err)
	}
	renewed0, proposals0, step0, epoch0 := etcdCounter(t, "etcd_debugging_lease_renewed_total"), etcdCounter(t, "etcd_server_proposals_committed_total"), rs[0].c.CommittedStep(), rs[0].c.Epoch()
	const window = 12 * time.Second // two heartbeat periods' worth of keepalives at TTL/3
	<-time.After(window)            // a measurement window, not a synchronisation
	renewed, proposals, steps := etcdCounter(t, "etcd_debugging_lease_renewed_total")-renewed0, etcdCounter(t, "etcd_server_proposals_committed_total")-proposals0, rs[0].c.CommittedStep()-step0
	if e := rs[0].c.Epoch(); e != epoch0 {
		t.Logf("the epoch moved (%d → %d) during the window: the figures include a reconfiguration", epoch0, e)
	}
	mode := "a lease per group"
	if rankLeases {
		mode = "a lease per rank"
	}
	t.Logf("FIGURE %d groups × %d ranks, DurableCommit, %s: %d leases; %.1f renewals/s; %d steps in %v, %.2f etcd writes (raft proposals) per step",
		groups, ranks, mode, len(leases.Leases)-len(base.Leases), renewed/window.Seconds(), steps, window, proposals/float64(max(steps, 1)))
}

// etcdCounter reads a counter or gauge of the embedded etcd from
// prometheus's default registry (summed over its labels).
func etcdCounter(t *testing.T, name string) float64 {
	t.Helper()
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		var sum float64
		for _, m := range mf.GetMetric() {
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				sum += m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				sum += m.GetGauge().GetValue()
			}
		}
		return sum
	}
	t.Fatalf("etcd metric %s not registered", name)
	return 0
}
