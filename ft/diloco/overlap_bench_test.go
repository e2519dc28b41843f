package diloco_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/ft/diloco"
)

// BenchmarkOverlap measures whether a fragment's sync is hidden behind
// inner steps: replicas on ft.Comm (real etcd, coordinator, gloo on
// loopback; 2 of them, one per core here, or 4) hold 2 Mi parameters (8 MiB; H = 16, F = 4: a 2 MiB fragment
// every 4 inner steps), and each inner step is 10 ms of device time — a
// sleep, as a GPU computes while the host CPU runs the exchange. Three
// variants run interleaved, round after round: no sync at all, Streaming
// DiLoCo with τ = 0 (the training loop waits for each exchange) and with
// τ = 1 (the exchange overlaps the next inner step). Metrics: ms/step of
// each, and their ratios to no sync (the target: τ = 1 ≤ 1.1).
func BenchmarkOverlap(b *testing.B) {
	for _, ranks := range []int{2, 4} {
		b.Run(fmt.Sprintf("replicas=%d", ranks), func(b *testing.B) { benchmarkOverlap(b, ranks) })
	}
}

func benchmarkOverlap(b *testing.B, ranks int) {
	const params, perRound = 1 << 21, 32
	const device = 10 * time.Millisecond
	j := newJob(b, diloco.DefaultConfig())
	j.n = params
	type replica struct {
		c  *ft.Comm
		ds []*diloco.DiLoCo // τ = 0, τ = 1
		p  [][]float32
	}
	rs := make([]*replica, ranks)
	for i := range rs {
		cfg := j.cfg
		cfg.Group, cfg.Logger = fmt.Sprintf("r%d", i), zap.NewNop()
		c, err := ft.New(context.Background(), cfg)
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		r := &replica{c: c}
		for tau := range 2 {
			dc := diloco.DefaultStreamingConfig()
			dc.InnerSteps, dc.Fragments, dc.Overlap, dc.Name = 16, 4, tau, fmt.Sprintf("tau%d", tau)
			p := make([]float32, params)
			d, err := diloco.New(c, p, dc)
			if err != nil {
				b.Fatal(err)
			}
			r.ds, r.p = append(r.ds, d), append(r.p, p)
		}
		rs[i] = r
	}
	ctx := context.Background()
	// run does n inner steps of variant v (0: no sync; 1, 2: τ = 0, 1) and
	// returns their wall time.
	run := func(r *replica, v, n int) (time.Duration, error) {
		t0 := time.Now()
		for range n {
			if v > 0 {
				if _, err := r.ds[v-1].Tick(ctx); err != nil {
					return 0, err
				}
			}
			time.Sleep(device)
			if v > 0 {
				p := r.p[v-1]
				p[0]++ // some local progress
			}
		}
		return time.Since(t0), nil
	}
	var total [3]time.Duration
	rounds := 0
	all := func(v, n int, measure bool) {
		var wg sync.WaitGroup
		var mu sync.Mutex
		for _, r := range rs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d, err := run(r, v, n)
				if err != nil {
					b.Error(err)
				}
				if measure {
					mu.Lock()
					total[v] += d
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
	}
	all(1, perRound, false) // join, warm up
	all(2, perRound, false)
	b.ResetTimer()
	for range b.N {
		for v := range 3 {
			all(v, perRound, true)
		}
		rounds++
	}
	b.StopTimer()
	per := func(v int) float64 { return total[v].Seconds() * 1e3 / float64(rounds*perRound*ranks) }
	b.ReportMetric(per(0), "ms/step-nosync")
	b.ReportMetric(per(1), "ms/step-tau0")
	b.ReportMetric(per(2), "ms/step-tau1")
	b.ReportMetric(per(1)/per(0), "tau0/nosync")
	b.ReportMetric(per(2)/per(0), "tau1/nosync")
	// Where the rest goes: the time a sync held the training loop (ft
	// Step and Commit, the outer arithmetic, the unhidden exchange).
	for k := range 2 {
		var blocked time.Duration
		var syncs int64
		for _, r := range rs {
			s := r.ds[k].Stats()
			blocked, syncs = blocked+s.Blocked, syncs+s.Syncs
		}
		b.ReportMetric(blocked.Seconds()*1e3/float64(syncs), fmt.Sprintf("blocked-ms/sync-tau%d", k))
	}
}
