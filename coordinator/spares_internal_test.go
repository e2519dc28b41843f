package coordinator

import (
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
)

// The leader's report of a job carries its target and spares to the
// status (the API, ftcoord) and to the gauges ftcomm_coordinator_spares
// and ftcomm_coordinator_target_replicas; a job whose spares went reads
// 0, not the last count.
func TestReportSparesAndTarget(t *testing.T) {
	m, err := newCoordMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	c := &Coordinator{metrics: m, status: map[string]JobStatus{}}
	c.leader.Store(true)
	l := &leadership{c: c}
	l.report(status{job: "j", members: 6, at: time.Now(), target: 3, spares: []string{"s", "x.0", "x.1"}, ready: []string{"s", "x.0", "x.1"},
		unusable: []quorum.UnusableSpare{{Group: "x", Members: []string{"x.0", "x.1"}, Reason: "a replica group of 2 rank(s); the job's replica groups have 1"}}})
	st, ok := c.Status("j")
	if !ok || st.Target != 3 || !slices.Equal(st.Spares, []string{"s", "x.0", "x.1"}) || len(st.UnusableSpares) != 1 {
		t.Fatalf("status %+v", st)
	}
	value := func(g prometheus.Gauge) float64 {
		var pb dto.Metric
		if err := g.Write(&pb); err != nil {
			t.Fatal(err)
		}
		return pb.GetGauge().GetValue()
	}
	gauge := func(state string) float64 { return value(m.spares.WithLabelValues("j", state)) }
	if w, r, u, tg := gauge(spareWaiting), gauge(spareReady), gauge(spareUnusable), value(m.target.WithLabelValues("j")); w != 3 || r != 3 || u != 2 || tg != 3 {
		t.Fatalf("gauges: waiting %v ready %v unusable %v target %v", w, r, u, tg)
	}
	l.report(status{job: "j", members: 3, at: time.Now(), target: 3})
	if w, r, u := gauge(spareWaiting), gauge(spareReady), gauge(spareUnusable); w != 0 || r != 0 || u != 0 {
		t.Fatalf("gauges after the spares went: waiting %v ready %v unusable %v", w, r, u)
	}
}
