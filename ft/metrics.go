package ft

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ftcomm/ftcomm/comm"
)

// metrics are one Comm's Prometheus collectors, labelled by job and member
// (ftcomm_job, not job: Prometheus keeps "job" for the scrape target).
type metrics struct {
	collectors      []prometheus.Collector
	registered      []registration
	epochSeen       prometheus.Gauge
	step            prometheus.Gauge
	commits         *prometheus.CounterVec
	reconfigs       *prometheus.CounterVec
	reconfigSeconds prometheus.Observer
	recoverySeconds prometheus.Observer
	stepSeconds     prometheus.Observer
	detectSeconds   prometheus.Observer
	healSeconds     prometheus.Observer
	healedBytes     prometheus.Counter
	healThroughput  prometheus.Gauge
	rollbacks       prometheus.Counter
	rolledBackSteps prometheus.Counter
	spare           prometheus.Gauge
	warmUp          prometheus.Gauge
	// Peer snapshots (Config.SnapshotEvery).
	snapshotBytes   *prometheus.GaugeVec
	snapshotStep    prometheus.Gauge
	snapshotSeconds prometheus.Observer
	snapshotPulled  prometheus.Counter
	snapshotSkipped prometheus.Counter
	restores        prometheus.Counter
	restoreSeconds  prometheus.Observer
	// comm receives the op metrics of this Comm's communicators
	// (ftcomm_comm_*); nil without a registerer.
	comm comm.Metrics
}

func newMetrics(reg prometheus.Registerer, job, member string) (*metrics, error) {
	labels := prometheus.Labels{"ftcomm_job": job, "member": member}
	secs := prometheus.ExponentialBuckets(0.001, 2, 18) // 1 ms … 131 s
	m := &metrics{}
	gauge := func(name, help string) prometheus.Gauge {
		g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels})
		m.collectors = append(m.collectors, g)
		return g
	}
	hist := func(name, help string) prometheus.Observer {
		h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: labels, Buckets: secs})
		m.collectors = append(m.collectors, h)
		return h
	}
	m.epochSeen = gauge("ftcomm_ft_epoch", "Newest quorum epoch seen.")
	m.step = gauge("ftcomm_ft_committed_step", "Steps committed (or healed to).")
	m.spare = gauge("ftcomm_ft_spare", "1 while this process waits as a spare (Config.Spare), 0 once promoted or for a replica.")
	m.warmUp = gauge("ftcomm_ft_spare_warm_up_seconds", "How long a spare's one-rank comm of the data backend took to make and close while it waited (its library's one-time set-up: NCCL's kernels); 0 before.")
	m.healThroughput = gauge("ftcomm_ft_heal_bytes_per_second", "Throughput of the last heal.")
	m.commits = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_ft_commits_total",
		Help: "Commit votes, by result (ok, failed).", ConstLabels: labels}, []string{"result"})
	m.reconfigs = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ftcomm_ft_reconfigurations_total",
		Help: "Moves to a new epoch, by kind (shrink, grow, fresh, prepared: a grow formed in the background).", ConstLabels: labels}, []string{"how"})
	m.healedBytes = prometheus.NewCounter(prometheus.CounterOpts{Name: "ftcomm_ft_healed_bytes_total",
		Help: "State bytes received from peers while healing.", ConstLabels: labels})
	m.rollbacks = prometheus.NewCounter(prometheus.CounterOpts{Name: "ftcomm_ft_rollbacks_total",
		Help: "Times this replica found committed steps of its own outside the job's history and rolled them back.", ConstLabels: labels})
	m.rolledBackSteps = prometheus.NewCounter(prometheus.CounterOpts{Name: "ftcomm_ft_rolled_back_steps_total",
		Help: "Committed steps rolled back.", ConstLabels: labels})
	m.snapshotBytes = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "ftcomm_ft_snapshot_bytes",
		Help:        "Host memory held by peer snapshots (Config.SnapshotEvery), by copy: own (this rank's state) or held (its source rank's).",
		ConstLabels: labels}, []string{"copy"})
	m.snapshotStep = gauge("ftcomm_ft_snapshot_step", "Newest peer snapshot step known complete (-1: none).")
	m.snapshotStep.Set(-1)
	m.snapshotPulled = prometheus.NewCounter(prometheus.CounterOpts{Name: "ftcomm_ft_snapshot_pulled_bytes_total",
		Help: "Bytes of the source rank's snapshots copied into this rank's memory.", ConstLabels: labels})
	m.snapshotSkipped = prometheus.NewCounter(prometheus.CounterOpts{Name: "ftcomm_ft_snapshot_skipped_total",
		Help: "Snapshot steps skipped because the previous snapshot's copies were still in transit.", ConstLabels: labels})
	m.restores = prometheus.NewCounter(prometheus.CounterOpts{Name: "ftcomm_ft_snapshot_restores_total",
		Help: "Peer snapshot restores this rank took part in.", ConstLabels: labels})
	m.collectors = append(m.collectors, m.commits, m.reconfigs, m.healedBytes, m.rollbacks, m.rolledBackSteps,
		m.snapshotBytes, m.snapshotPulled, m.snapshotSkipped, m.restores)
	m.reconfigSeconds = hist("ftcomm_ft_reconfiguration_seconds", "Time to move to a new epoch once its quorum is known, healing included.")
	m.recoverySeconds = hist("ftcomm_ft_failure_to_commit_seconds", "From the first failure seen (op error, failed commit or reconfiguration) to the next committed step.")
	m.detectSeconds = hist("ftcomm_ft_detection_seconds", "From the first failure this rank saw to its learning of the epoch that resolves it.")
	m.stepSeconds = hist("ftcomm_ft_step_seconds", "From Step to a successful Commit.")
	m.healSeconds = hist("ftcomm_ft_heal_seconds", "Duration of each heal.")
	m.snapshotSeconds = hist("ftcomm_ft_snapshot_copy_seconds", "Copying the registered state into this rank's own snapshot (in the background of a step).")
	m.restoreSeconds = hist("ftcomm_ft_snapshot_restore_seconds", "A peer snapshot restore at this rank, from the decision to the group's barrier.")
	if reg == nil {
		return m, nil
	}
	for _, c := range m.collectors {
		if err := reg.Register(c); err != nil {
			m.unregister()
			return nil, err
		}
		m.registered = append(m.registered, registration{reg, c})
	}
	// The comms' op metrics carry this Comm's labels through the registerer.
	wrapped := prometheus.WrapRegistererWith(labels, reg)
	cm, err := comm.NewPrometheusMetrics(wrapped)
	if err != nil {
		m.unregister()
		return nil, err
	}
	for _, c := range cm.Collectors() {
		m.registered = append(m.registered, registration{wrapped, c})
	}
	m.comm = cm
	return m, nil
}

type registration struct {
	reg prometheus.Registerer
	c   prometheus.Collector
}

func (m *metrics) unregister() {
	for _, r := range m.registered {
		r.reg.Unregister(r.c)
	}
	m.registered = nil
}
