package diloco

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	_ "github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// rawComm runs an exchange over a plain comm.Comm (no ft): the exchange
// needs only the collectives, Rank and Participants.
type rawComm struct{ c *comm.Comm }

func (r rawComm) Register(string, comm.Tensor) error { return nil }
func (r rawComm) Step(context.Context) error         { return nil }
func (r rawComm) AllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) *comm.Work {
	return r.c.AllReduceAsync(ctx, t, op)
}
func (r rawComm) AllGather(ctx context.Context, out, in comm.Tensor) *comm.Work {
	return r.c.AllGatherAsync(ctx, out, in)
}
func (r rawComm) Commit(context.Context) (bool, error) { return true, nil }
func (r rawComm) CommittedStep() int64                 { return 0 }
func (r rawComm) Epoch() uint64                        { return r.c.Epoch() }
func (r rawComm) Participants() int                    { return r.c.Size() }
func (r rawComm) Rank() int                            { return r.c.Rank() }

// rawA2A adds the all-to-all.
type rawA2A struct{ rawComm }

func (r rawA2A) AllToAll(ctx context.Context, out, in comm.Tensor) *comm.Work {
	return r.c.AllToAllAsync(ctx, out, in)
}

// glooComms forms n gloo comms on loopback in this process.
func glooComms(t testing.TB, n int) []*comm.Comm {
	t.Helper()
	store := memstore.New()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cs := make([]*comm.Comm, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cs[r], errs[r] = comm.New(ctx, "gloo", comm.Options{Name: "x", Rank: r, Size: n, Epoch: 1, JobID: "diloco-test",
				Secret: []byte("s"), Store: store, Prefix: "x", Timeout: 30 * time.Second})
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, c := range cs {
			if c != nil {
				c.Close()
			}
		}
		store.Close()
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return cs
}

func wrap(c *comm.Comm, how method) Comm {
	if how == viaAllToAll {
		return rawA2A{rawComm{c}}
	}
	return rawComm{c}
}

// Every method averages the replicas' outer gradients, weighted, to within
// its quantization error, and every replica gets bit-identical results
// (the global parameters must stay identical everywhere).
func TestExchangeAverages(t *testing.T) {
	const ranks = 4
	cs := glooComms(t, ranks)
	for _, tc := range []struct {
		how method
		q   Quantization
	}{{viaAllReduce, Float32}, {viaAllGather, Int8}, {viaAllGather, Int4}, {viaAllToAll, Int8}, {viaAllToAll, Int4}} {
		for _, n := range []int{5, 1000, 40000} {
			t.Run(fmt.Sprintf("%v/%v/%d", tc.how, tc.q, n), func(t *testing.T) {
				r := rand.New(rand.NewPCG(uint64(n), 7))
				deltas := make([][]float32, ranks)
				weights := []float32{1, 1, 0, 1} // rank 2 just healed: it must not count
				want := make([]float64, n)
				var absmax float64
				for i := range deltas {
					deltas[i] = randVec(r, n, 0.1)
					for k, d := range deltas[i] {
						absmax = max(absmax, math.Abs(float64(d)))
						want[k] += float64(weights[i]*d) / 3
					}
				}
				xs := make([]*exchange, ranks)
				var wg sync.WaitGroup
				ctx := context.Background()
				ok := make([]bool, ranks)
				for i := range ranks {
					xs[i] = &exchange{q: tc.q, block: 128}
					wg.Add(1)
					go func() {
						defer wg.Done()
						c := wrap(cs[i], tc.how)
						xs[i].begin(ctx, c, tc.how, deltas[i], make([]float32, n), weights[i], nil, nil)
						xs[i].poll(ctx, c)
						ok[i] = xs[i].finish(ctx, c)
					}()
				}
				wg.Wait()
				bound := 1e-6 * absmax
				if tc.q != Float32 {
					bound = absmax / float64(tc.q.levels()) // one half step per quantization, two at most
				}
				for i, x := range xs {
					if !ok[i] || x.wsum != 3 {
						t.Fatalf("rank %d: ok %v, total weight %v", i, ok[i], x.wsum)
					}
					for k := range want {
						got := x.avg[k] * x.scale
						if got != xs[0].avg[k]*xs[0].scale {
							t.Fatalf("rank %d value %d: %v, rank 0 has %v", i, k, got, xs[0].avg[k]*xs[0].scale)
						}
						if e := math.Abs(float64(got) - want[k]); e > bound {
							t.Fatalf("value %d: %v, want %v ± %v", k, got, want[k], bound)
						}
					}
				}
			})
		}
	}
}

// The bytes an exchange reports: float32 is the all-reduce of n+1 values;
// 4-bit through all-to-all sends ≤ 1/7 of that, through all-gather n−1
// whole payloads.
func TestExchangeBytes(t *testing.T) {
	const ranks, n = 4, 1 << 16
	cs := glooComms(t, ranks)
	wire := map[method]int64{}
	for _, tc := range []struct {
		how method
		q   Quantization
	}{{viaAllReduce, Float32}, {viaAllGather, Int4}, {viaAllToAll, Int4}} {
		var wg sync.WaitGroup
		xs := make([]*exchange, ranks)
		for i := range ranks {
			xs[i] = &exchange{q: tc.q, block: 128}
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := wrap(cs[i], tc.how)
				xs[i].begin(context.Background(), c, tc.how, make([]float32, n), make([]float32, n), 1, nil, nil)
				xs[i].finish(context.Background(), c)
			}()
		}
		wg.Wait()
		wire[tc.how] = xs[0].wire
	}
	f32 := wire[viaAllReduce]
	if f32 != 2*3*4*(n+1)/4 {
		t.Errorf("float32 all-reduce wire %d", f32)
	}
	if r := float64(wire[viaAllToAll]) / float64(f32); r > 1.0/7 {
		t.Errorf("int4 all-to-all sends %.3f of float32, want ≤ 1/7", r)
	}
	if r := float64(wire[viaAllGather]) / float64(f32); math.Abs(r-4*4.25/64) > 0.01 {
		t.Errorf("int4 all-gather sends %.3f of float32, want n·4.25/64 = %.3f", r, 4*4.25/64)
	}
}
