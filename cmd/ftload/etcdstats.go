package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// etcdSample is what one etcd member's /metrics says about load: whether
// it leads, how far apply trails commit (past 5,000 entries etcd refuses
// requests: "too many requests"), its watchers and how many of them are
// unsynced (they catch up by reading the log, under the lock that apply
// takes), the leases it granted, renewed and revoked, the applies that
// took over 100 ms, and its CPU.
type etcdSample struct {
	leader                      bool
	committed, applied          float64
	watchers, slowWatchers      float64
	granted, renewed, revoked   float64
	slowApplies, slowReadIndex  float64
	fsyncSum, fsyncCount, cpuS  float64
	pendingProposals, dbInUseMB float64
}

var etcdSampleMetrics = map[string]func(s *etcdSample, v float64){
	"etcd_server_is_leader":                      func(s *etcdSample, v float64) { s.leader = v == 1 },
	"etcd_server_proposals_committed_total":      func(s *etcdSample, v float64) { s.committed = v },
	"etcd_server_proposals_applied_total":        func(s *etcdSample, v float64) { s.applied = v },
	"etcd_server_proposals_pending":              func(s *etcdSample, v float64) { s.pendingProposals = v },
	"etcd_debugging_mvcc_watcher_total":          func(s *etcdSample, v float64) { s.watchers = v },
	"etcd_debugging_mvcc_slow_watcher_total":     func(s *etcdSample, v float64) { s.slowWatchers = v },
	"etcd_debugging_lease_granted_total":         func(s *etcdSample, v float64) { s.granted = v },
	"etcd_debugging_lease_renewed_total":         func(s *etcdSample, v float64) { s.renewed = v },
	"etcd_debugging_lease_revoked_total":         func(s *etcdSample, v float64) { s.revoked = v },
	"etcd_server_slow_apply_total":               func(s *etcdSample, v float64) { s.slowApplies = v },
	"etcd_server_slow_read_indexes_total":        func(s *etcdSample, v float64) { s.slowReadIndex = v },
	"etcd_mvcc_db_total_size_in_use_in_bytes":    func(s *etcdSample, v float64) { s.dbInUseMB = v / (1 << 20) },
	"process_cpu_seconds_total":                  func(s *etcdSample, v float64) { s.cpuS = v },
	"etcd_disk_wal_fsync_duration_seconds_sum":   func(s *etcdSample, v float64) { s.fsyncSum = v },
	"etcd_disk_wal_fsync_duration_seconds_count": func(s *etcdSample, v float64) { s.fsyncCount = v },
}

func (s *etcdSample) set(name string, f *dto.MetricFamily) {
	set, ok := etcdSampleMetrics[name]
	if !ok || len(f.GetMetric()) == 0 {
		return
	}
	m := f.GetMetric()[0]
	switch {
	case m.GetCounter() != nil:
		set(s, m.GetCounter().GetValue())
	case m.GetGauge() != nil:
		set(s, m.GetGauge().GetValue())
	case m.GetHistogram() != nil && strings.HasSuffix(name, "_sum"):
		set(s, m.GetHistogram().GetSampleSum())
	case m.GetHistogram() != nil && strings.HasSuffix(name, "_count"):
		set(s, float64(m.GetHistogram().GetSampleCount()))
	}
}

// sampleEtcd reads one member's /metrics (served on its client URL).
func sampleEtcd(ctx context.Context, addr string) (etcdSample, error) {
	var s etcdSample
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return s, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return s, fmt.Errorf("%s/metrics: %s", addr, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return s, err
	}
	for name, f := range fams {
		s.set(name, f)
		if f.GetType() == dto.MetricType_HISTOGRAM {
			s.set(name+"_sum", f)
			s.set(name+"_count", f)
		}
	}
	return s, nil
}

// logEtcdStats prints, every interval until ctx ends, one line per etcd
// member: what changed since the last sample (applies, renewals,
// revocations, slow applies, CPU) and where it stands (apply's lag behind
// commit, watchers, unsynced watchers). It is how a run that ends with
// etcd refusing requests says why.
func logEtcdStats(ctx context.Context, w io.Writer, names, addrs []string, every time.Duration) {
	prev := make([]etcdSample, len(addrs))
	t := time.NewTicker(every)
	defer t.Stop()
	start := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for i, addr := range addrs {
			sctx, cancel := context.WithTimeout(ctx, every)
			s, err := sampleEtcd(sctx, addr)
			cancel()
			if err != nil {
				fmt.Fprintf(w, "etcd-stats %6.1fs %s: %v\n", time.Since(start).Seconds(), names[i], err)
				continue
			}
			p := prev[i]
			prev[i] = s
			role := "follower"
			if s.leader {
				role = "leader"
			}
			fsync := 0.0
			if n := s.fsyncCount - p.fsyncCount; n > 0 {
				fsync = (s.fsyncSum - p.fsyncSum) / n * 1e3
			}
			fmt.Fprintf(w, "etcd-stats %6.1fs %s %-8s applied +%-6.0f lag %-5.0f pending %-4.0f watchers %-7.0f unsynced %-6.0f leases +%.0f renewed +%.0f revoked +%.0f slow-applies +%.0f slow-read-index +%.0f fsync %.1f ms cores %.2f db %.0f MiB\n",
				time.Since(start).Seconds(), names[i], role, s.applied-p.applied, s.committed-s.applied, s.pendingProposals,
				s.watchers, s.slowWatchers, s.granted-p.granted, s.renewed-p.renewed, s.revoked-p.revoked,
				s.slowApplies-p.slowApplies, s.slowReadIndex-p.slowReadIndex, fsync, (s.cpuS-p.cpuS)/every.Seconds(), s.dbInUseMB)
		}
	}
}
