package membership_test

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

var (
	leaseMembers = flag.Int("membership.leases", 0, "simulated members renewing leases against one embedded etcd (0: skip)")
	leaseTTL     = flag.Duration("membership.leases.ttl", 6*time.Second, "lease TTL of the simulated members")
	leaseFor     = flag.Duration("membership.leases.for", time.Minute, "how long the lease test runs")
)

// TestLeaseScale: N simulated members each hold a lease and a member key
// and renew the lease every TTL/3 (as clientv3's keepalive does), spread
// over 16 clients, against one embedded etcd with fsync on. It reports the
// renewal rate, renewal latency and any lease that expired.
//
//	go test -run TestLeaseScale ./membership -args -membership.leases=2000
func TestLeaseScale(t *testing.T) {
	if *leaseMembers == 0 {
		t.Skip("lease scale test: enable with -membership.leases=2000")
	}
	ctx := clustertest.Ctx(t, *leaseFor+5*time.Minute)
	cfg := etcdhost.DefaultEmbeddedConfig()
	cfg.Dir = t.TempDir() // on disk, fsync on: what ftcoord runs
	e, err := etcdhost.StartEmbedded(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	const nClients = 16
	clients := make([]*clientv3.Client, nClients)
	for i := range clients {
		clients[i] = clustertest.NewClient(t, e)
	}
	n, ttl := *leaseMembers, *leaseTTL
	leases := make([]clientv3.LeaseID, n)
	// Register everyone (bounded concurrency).
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	regStart := time.Now()
	var regErr atomic.Value
	for i := 0; i < n; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			cli := clients[i%nClients]
			lr, err := cli.Grant(ctx, int64(ttl/time.Second))
			if err != nil {
				regErr.Store(err)
				return
			}
			leases[i] = lr.ID
			if _, err := cli.Put(ctx, fmt.Sprintf("/scale/job/members/m%05d", i), `{"step":0}`, clientv3.WithLease(lr.ID)); err != nil {
				regErr.Store(err)
			}
		}(i)
	}
	wg.Wait()
	if err, _ := regErr.Load().(error); err != nil {
		t.Fatal(err)
	}
	t.Logf("registered %d members in %v", n, time.Since(regStart).Round(time.Millisecond))

	// Watch for expirations.
	var expired atomic.Int64
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	go func() {
		for wr := range clients[0].Watch(wctx, "/scale/job/members/", clientv3.WithPrefix(), clientv3.WithFilterPut()) {
			expired.Add(int64(len(wr.Events)))
		}
	}()

	// Renew every TTL/3 with jitter, each member on its own schedule.
	var renewals, failures atomic.Int64
	var latMu sync.Mutex
	var lat []time.Duration
	rctx, rcancel := context.WithTimeout(ctx, *leaseFor)
	defer rcancel()
	period := ttl / 3
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			cli := clients[i%nClients]
			timer := time.NewTimer(time.Duration(rand.Int64N(int64(period))))
			defer timer.Stop()
			var mine []time.Duration
			defer func() {
				latMu.Lock()
				lat = append(lat, mine...)
				latMu.Unlock()
			}()
			for {
				select {
				case <-timer.C:
				case <-rctx.Done():
					return
				}
				start := time.Now()
				_, err := cli.KeepAliveOnce(rctx, leases[i])
				if rctx.Err() != nil {
					return
				}
				if err != nil {
					failures.Add(1)
				} else {
					renewals.Add(1)
					mine = append(mine, time.Since(start))
				}
				timer.Reset(period)
			}
		}(i)
	}
	wg.Wait()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	q := func(p float64) time.Duration {
		if len(lat) == 0 {
			return 0
		}
		return lat[int(p*float64(len(lat)-1))].Round(time.Microsecond)
	}
	t.Logf("%d members, TTL %v, %v: %d renewals (%.0f/s), %d failed, %d leases expired; renewal latency p50 %v p99 %v max %v",
		n, ttl, *leaseFor, renewals.Load(), float64(renewals.Load())/leaseFor.Seconds(), failures.Load(), expired.Load(), q(0.5), q(0.99), q(1))
	if expired.Load() > 0 || failures.Load() > 0 {
		t.Errorf("renewals were not stable")
	}
}
