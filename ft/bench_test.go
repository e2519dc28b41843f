package ft

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/coordinator/memcoord"
	"github.com/ftcomm/ftcomm/etcdhost"
)

// benchReplicas runs n replicas of a one-float job in lockstep: every
// replica does Step, AllReduce, Commit b.N times. Replica 0 runs on the
// benchmark goroutine.
func benchSteps(b *testing.B, cs []*Comm) {
	ctx := context.Background()
	step := func(c *Comm, v []float32) {
		if err := c.Step(ctx); err != nil {
			b.Error(err)
			return
		}
		c.AllReduce(ctx, comm.Float32s(v), comm.Sum)
		if ok, err := c.Commit(ctx); !ok || err != nil {
			b.Errorf("commit: %v %v", ok, err)
		}
	}
	// Warm up: the first Step forms the comms.
	var wg sync.WaitGroup
	for _, c := range cs {
		wg.Add(1)
		go func() { defer wg.Done(); step(c, []float32{1}) }()
	}
	wg.Wait()
	b.ResetTimer()
	for _, c := range cs[1:] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			v := []float32{1}
			for range b.N {
				step(c, v)
			}
		}()
	}
	v := []float32{1}
	for range b.N {
		step(cs[0], v)
	}
	wg.Wait()
}

// BenchmarkStepOverhead compares a steady-state ft step (Step + a one-float
// AllReduce + Commit, epoch unchanged) with the raw all-reduce on the same
// backend: the difference is ft's own host work per step, and no call
// reaches the coordinator.
func BenchmarkStepOverhead(b *testing.B) {
	const n = 2
	b.Run("raw-allreduce", func(b *testing.B) {
		cl := inproc.NewCluster()
		cs := make([]*comm.Comm, n)
		var wg sync.WaitGroup
		for r := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c, err := comm.New(context.Background(), "inproc", comm.Options{Rank: r, Size: n, BackendConfig: cl, Store: noopStore{}})
				if err != nil {
					b.Error(err)
					return
				}
				cs[r] = c
			}()
		}
		wg.Wait()
		b.ResetTimer()
		for r := 1; r < n; r++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				v := []float32{1}
				for range b.N {
					cs[r].AllReduce(context.Background(), comm.Float32s(v), comm.Sum)
				}
			}()
		}
		v := []float32{1}
		for range b.N {
			cs[0].AllReduce(context.Background(), comm.Float32s(v), comm.Sum)
		}
		wg.Wait()
		for _, c := range cs {
			c.Close()
		}
	})
	b.Run("ft-step", func(b *testing.B) {
		coord := memcoord.New("bench", quorum.Config{MinReplicas: 1, JoinTimeout: time.Second})
		defer coord.Close()
		cl := inproc.NewCluster()
		var cs []*Comm
		for _, g := range []string{"a", "b"}[:n] {
			c, err := New(context.Background(), Config{Job: "bench", Group: g, Membership: joinAs(coord, memberID(g, 0), 1),
				Backend: "inproc", BackendConfig: cl, Secret: []byte("k"), MinReplicas: n, Logger: zap.NewNop()})
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			cs = append(cs, c)
		}
		benchSteps(b, cs)
	})
}

// BenchmarkGroupGate measures the group's gate: steady-state steps of two
// replica groups of two ranks over gloo on loopback (the group's vote and
// gate ride on the group's host comm, as in FT-HSDP), with the gate and
// with it turned off, in one run: the difference is what the gate costs a
// step.
func BenchmarkGroupGate(b *testing.B) {
	for _, gate := range []bool{true, false} {
		name := "gate"
		if !gate {
			name = "no-gate"
		}
		b.Run(name, func(b *testing.B) {
			coord := memcoord.New("bench", quorum.Config{MinReplicas: 1, JoinTimeout: time.Second})
			defer coord.Close()
			gcfg := gloo.DefaultConfig()
			gcfg.ListenAddr = "127.0.0.1:0"
			var cs []*Comm
			for _, g := range []string{"a", "b"} {
				for r := range 2 {
					c, err := New(context.Background(), Config{Job: "bench", Group: g, GroupRank: r, GroupSize: 2,
						Membership: joinAs(coord, memberID(g, r), 4), Backend: "gloo", BackendConfig: gcfg,
						Secret: []byte("k"), MinReplicas: 2, Logger: zap.NewNop()})
					if err != nil {
						b.Fatal(err)
					}
					defer c.Close()
					if !gate {
						c.onDriver(func(d *driver) { d.mach.cfg.noGate = true })
					}
					cs = append(cs, c)
				}
			}
			benchSteps(b, cs)
		})
	}
}

// noopStore serves inproc comms, which rendezvous through their Cluster.
type noopStore struct{ comm.Store }

// BenchmarkDurableCommit measures what DurableCommit adds to a step: one
// etcd transaction per rank, against a real embedded etcd that syncs its
// log to disk (as a deployment does) and the real coordinator.
func BenchmarkDurableCommit(b *testing.B) {
	for _, durable := range []bool{false, true} {
		name := "default"
		if durable {
			name = "durable"
		}
		b.Run(name, func(b *testing.B) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			e, err := etcdhost.StartEmbedded(ctx, etcdhost.EmbeddedConfig{})
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close()
			cli, err := e.NewClient(nil)
			if err != nil {
				b.Fatal(err)
			}
			defer cli.Close()
			ccfg := coordinator.DefaultConfig()
			ccfg.Client, ccfg.Quorum.JoinTimeout = cli, 200*time.Millisecond
			coord, err := coordinator.New(ccfg)
			if err != nil {
				b.Fatal(err)
			}
			cctx, stop := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); coord.Run(cctx) }()
			defer func() { stop(); <-done }()
			cl := inproc.NewCluster()
			var cs []*Comm
			for _, g := range []string{"a", "b"} {
				c, err := New(ctx, Config{Job: "bench", Group: g, Coordinator: e.Endpoints(), Backend: "inproc", BackendConfig: cl,
					Secret: []byte("k"), DurableCommit: durable, MinReplicas: 2, Logger: zap.NewNop()})
				if err != nil {
					b.Fatal(err)
				}
				defer c.Close()
				cs = append(cs, c)
			}
			benchSteps(b, cs)
		})
	}
}

// BenchmarkSnapshotStep measures what peer snapshots cost a step: a group
// of 3 ranks (inproc, one process), each holding 16 MiB of registered
// state that its "optimizer" rewrites after every commit, with snapshots
// off and every 20, 5 and 1 steps, in one run: ns/op is one step of the
// group; the ratio to "off" is the overhead. The own copy runs beside the
// step (Commit waits for what is left of it), the buddy's pull over
// loopback TCP across the following steps.
func BenchmarkSnapshotStep(b *testing.B) {
	const ranks = 3
	floats := envInts(b, "FTCOMM_FT_SNAPSHOT_BENCH_FLOATS", []int{4 << 20})[0]
	for _, every := range []int{0, 20, 5, 1} {
		name := "off"
		if every > 0 {
			name = fmt.Sprintf("every=%d", every)
		}
		b.Run(name, func(b *testing.B) {
			coord := memcoord.New("bench", quorum.Config{MinReplicas: 1, JoinTimeout: time.Second})
			defer coord.Close()
			cl := inproc.NewCluster()
			cs := make([]*Comm, ranks)
			states := make([][]float32, ranks)
			for r := range ranks {
				c, err := New(context.Background(), Config{Job: "bench", Group: "g", GroupRank: r, GroupSize: ranks,
					Membership: joinAs(coord, memberID("g", r), ranks), Backend: "inproc", BackendConfig: cl, Secret: []byte("k"),
					MinReplicas: 1, SnapshotEvery: every, Logger: zap.NewNop()})
				if err != nil {
					b.Fatal(err)
				}
				defer c.Close()
				states[r] = make([]float32, floats)
				if err := c.Register("state", comm.Float32s(states[r])); err != nil {
					b.Fatal(err)
				}
				cs[r] = c
			}
			step := func(r int) error {
				c := cs[r]
				if err := c.Step(context.Background()); err != nil {
					return err
				}
				v := []float32{1}
				c.Group().AllReduce(context.Background(), comm.Float32s(v), comm.Sum)
				ok, err := c.Commit(context.Background())
				if err != nil || !ok {
					return fmt.Errorf("commit: %v %v", ok, err)
				}
				for i := range states[r] { // the optimizer writes the state
					states[r][i] += v[0]
				}
				return nil
			}
			run := func(n int) {
				var wg sync.WaitGroup
				for r := range ranks {
					wg.Go(func() {
						for range n {
							if err := step(r); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
			}
			run(3) // the group forms; the first snapshots map their buffers
			b.SetBytes(int64(4 * floats))
			b.ResetTimer()
			run(b.N)
		})
	}
}
