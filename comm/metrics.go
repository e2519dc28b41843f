package comm

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics receives one call per finished op. Implementations must be safe
// for concurrent use and cheap: the call is on the op's path.
type Metrics interface {
	ObserveOp(comm string, op OpType, bytes int, d time.Duration, err error)
}

// PrometheusMetrics exports op counts, bytes and latency through
// client_golang:
//
//	ftcomm_comm_ops_total{comm,op,result}      result = ok | error
//	ftcomm_comm_bytes_total{comm,op}           bytes of the local buffer
//	ftcomm_comm_op_duration_seconds{comm,op}   histogram, 10 µs … 100 s
type PrometheusMetrics struct {
	ops   *prometheus.CounterVec
	bytes *prometheus.CounterVec
	dur   *prometheus.HistogramVec
}

var _ Metrics = (*PrometheusMetrics)(nil)

// NewPrometheusMetrics creates the collectors and registers them with reg
// (prometheus.DefaultRegisterer if nil).
func NewPrometheusMetrics(reg prometheus.Registerer) (*PrometheusMetrics, error) {
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	m := &PrometheusMetrics{
		ops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ftcomm_comm_ops_total", Help: "Communicator ops finished, by result.",
		}, []string{"comm", "op", "result"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ftcomm_comm_bytes_total", Help: "Bytes of the local buffers of finished ops.",
		}, []string{"comm", "op"}),
		dur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "ftcomm_comm_op_duration_seconds", Help: "Op latency from start of execution to completion.",
			Buckets: prometheus.ExponentialBuckets(10e-6, 4, 12),
		}, []string{"comm", "op"}),
	}
	for _, c := range []prometheus.Collector{m.ops, m.bytes, m.dur} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Collectors returns the collectors NewPrometheusMetrics registered, for
// callers that unregister them when their comms go.
func (m *PrometheusMetrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.ops, m.bytes, m.dur}
}

// ObserveOp implements Metrics.
func (m *PrometheusMetrics) ObserveOp(comm string, op OpType, bytes int, d time.Duration, err error) {
	result := "ok"
	if err != nil {
		result = "error"
	}
	name := op.String()
	m.ops.WithLabelValues(comm, name, result).Inc()
	m.bytes.WithLabelValues(comm, name).Add(float64(bytes))
	m.dur.WithLabelValues(comm, name).Observe(d.Seconds())
}
