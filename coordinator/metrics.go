package coordinator

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
)

// removalLabel is the cause label of ftcomm_coordinator_removals_total: a
// member that finished the run counts as one that left.
func removalLabel(c quorum.Cause) string {
	if c == quorum.Finished {
		return quorum.Left.String()
	}
	return c.String()
}

// jobLabel is the label naming a job in the coordinator's metrics. Not
// "job": Prometheus sets that one to the scrape job's name and renames a
// target's own to "exported_job".
const jobLabel = "ftcomm_job"

// coordMetrics are the coordinator's Prometheus metrics.
type coordMetrics struct {
	leader, jobs, gossipAlive    prometheus.Gauge
	members, epoch, participants *prometheus.GaugeVec
	quorums, joins, removals     *prometheus.CounterVec
	foreign                      *prometheus.CounterVec
	stalled                      *prometheus.GaugeVec
	target, spares               *prometheus.GaugeVec
	publishSeconds               prometheus.Histogram
	tooLarge                     *prometheus.CounterVec
}

// The state label of ftcomm_coordinator_spares: waiting counts every
// waiting spare, ready and unusable are of them.
const (
	spareWaiting  = "waiting"
	spareReady    = "ready"
	spareUnusable = "unusable"
)

func newCoordMetrics(reg prometheus.Registerer) (*coordMetrics, error) {
	m := &coordMetrics{
		leader:       prometheus.NewGauge(prometheus.GaugeOpts{Name: "ftcomm_coordinator_leader", Help: "1 while this instance leads."}),
		jobs:         prometheus.NewGauge(prometheus.GaugeOpts{Name: "ftcomm_coordinator_jobs", Help: "Jobs the leader serves."}),
		gossipAlive:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "ftcomm_coordinator_gossip_alive", Help: "Gossip nodes this instance believes alive."}),
		members:      prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_members", Help: "Live members per job."}, []string{jobLabel}),
		epoch:        prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_epoch", Help: "Current epoch per job."}, []string{jobLabel}),
		participants: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_participants", Help: "Participants of the current quorum per job."}, []string{jobLabel}),
		quorums:      prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_coordinator_quorums_total", Help: "Quorums published per job."}, []string{jobLabel}),
		joins:        prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_coordinator_joins_total", Help: "Member incarnations seen per job."}, []string{jobLabel}),
		removals:     prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_coordinator_removals_total", Help: "Members removed per job and cause (left, evicted, gossip, reported, lease)."}, []string{jobLabel, "cause"}),
		foreign:      prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_coordinator_foreign_quorum_writes_total", Help: "Writes of a job's quorum record by someone other than a coordinator (repaired at once)."}, []string{jobLabel}),
		stalled: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_waiting_members",
			Help: "Members per job that wait for a holder of a step the job committed (ft's DurableCommit), and cannot step meanwhile."}, []string{jobLabel}),
		target: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_target_replicas",
			Help: "Target size per job in replica groups, which spares refill it to (the setting ftcomm.target_replicas, else the most replica groups a quorum of the run had)."}, []string{jobLabel}),
		spares: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_coordinator_spares",
			Help: "Spare members per job: waiting (all), ready (of them, asking to take part), unusable (of them, in a spare group that can never be promoted into the job)."}, []string{jobLabel, "state"}),
		publishSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ftcomm_coordinator_publish_seconds", Help: "Latency of fenced quorum writes.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14)}),
		tooLarge: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_coordinator_publish_too_large_total",
			Help: "Quorum publications per job that etcd (or the client's send limit) refused for their size: never written as they are."}, []string{jobLabel}),
	}
	if reg == nil {
		return m, nil
	}
	for _, col := range []prometheus.Collector{m.leader, m.jobs, m.gossipAlive, m.members, m.epoch, m.participants, m.quorums, m.joins, m.removals, m.foreign, m.stalled, m.target, m.spares, m.publishSeconds, m.tooLarge} {
		if err := reg.Register(col); err != nil {
			return nil, fmt.Errorf("coordinator: register metrics: %w", err)
		}
	}
	return m, nil
}
