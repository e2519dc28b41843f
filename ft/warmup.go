package ft

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// warmer is a spare's warm-up: a one-rank comm of the data backend, made
// and closed while the spare waits, so that it pays its library's
// one-time set-up then rather than in the grow that promotes it: NCCL
// loads its kernels into the process and sets up its device state with
// its first comm (0.26–0.56 s on H200, docs/measurements.md). A failed
// warm-up costs nothing but its log line: the promotion's formation does
// the same work.
type warmer struct {
	cancel context.CancelFunc
	done   chan struct{} // closed when it ended
	took   time.Duration // how long, once done (0: it failed)
	comm   *comm.Comm    // the comm it made, closed; its device release is awaited at shutdown

	mu    sync.Mutex
	gauge prometheus.Gauge // ftcomm_ft_spare_warm_up_seconds, once the Comm's metrics exist
}

// report sets g to how long the warm-up took, now or when it ends.
func (w *warmer) report(g prometheus.Gauge) {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.gauge = g
	if w.took > 0 {
		g.Set(w.took.Seconds())
	}
}

func startWarmUp(cfg Config, log *zap.Logger) *warmer {
	ctx, cancel := context.WithCancel(context.Background())
	w := &warmer{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		t0 := time.Now()
		x, err := comm.New(ctx, cfg.Backend, comm.Options{Name: "ft-warm-up", Rank: 0, Size: 1, Epoch: 1,
			JobID: cfg.Job, Secret: cfg.Secret, Store: memstore.New(), Prefix: "warm-up", Timeout: cfg.Timeout,
			Device: cfg.Device, Logger: log, BackendConfig: cfg.BackendConfig})
		if err != nil {
			log.Info("a spare's warm-up comm could not be made; its promotion will set the backend up", zap.Error(err))
			return
		}
		err = x.Close()
		w.mu.Lock()
		w.comm, w.took = x, time.Since(t0)
		if w.gauge != nil {
			w.gauge.Set(w.took.Seconds())
		}
		w.mu.Unlock()
		log.Info("warmed the data backend up while waiting as a spare", zap.String("backend", cfg.Backend),
			zap.Duration("took", w.took), zap.Error(err))
	}()
	return w
}

// stop ends the warm-up (nil: none) and waits for it.
func (w *warmer) stop() {
	if w == nil {
		return
	}
	w.cancel()
	<-w.done
}
