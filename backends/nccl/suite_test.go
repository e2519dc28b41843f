package nccl

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// This file holds what the simulated tests (CI) and the GPU tests share: making
// a job of ranks as goroutines, and a suite that checks every collective
// against a host reference.

// rank is one rank of a test job.
type rank struct {
	r   int
	c   *comm.Comm
	L   *Library
	dev int
}

// startJob creates size ranks as goroutines, rank r on device devs[r],
// through comm.New("nccl", …) and a shared memstore.
func startJob(t testing.TB, ctx context.Context, L *Library, devs []int, epoch uint64, prefix string, mod func(*Config, *comm.Options)) []*rank {
	t.Helper()
	store := memstore.New()
	t.Cleanup(func() { store.Close() })
	size := len(devs)
	ranks := make([]*rank, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Go(func() {
			cfg := Config{Library: L}
			o := comm.Options{Name: "t", Rank: r, Size: size, Epoch: epoch, Store: store, Prefix: prefix, Device: devs[r],
				Timeout: 30 * time.Second}
			if mod != nil {
				mod(&cfg, &o)
			}
			o.BackendConfig = &cfg
			c, err := comm.New(ctx, "nccl", o)
			if err != nil {
				errs[r] = err
				return
			}
			ranks[r] = &rank{r: r, c: c, L: L, dev: devs[r]}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, rk := range ranks {
			if rk != nil {
				rk.c.Close()
			}
		}
		t.Fatalf("start job: %v", err)
	}
	t.Cleanup(func() { closeJob(t, ranks) })
	return ranks
}

// closeJob closes every rank's comm and waits until each backend has
// released its NCCL comm and memory.
func closeJob(t testing.TB, ranks []*rank) {
	for _, rk := range ranks {
		if rk == nil {
			continue
		}
		b, _ := rk.c.Backend().(*Backend)
		rk.c.Close()
		if b != nil {
			waitReleased(t, b)
		}
	}
}

func waitReleased(t testing.TB, b *Backend) {
	t.Helper()
	select {
	case <-b.Released():
	case <-time.After(30 * time.Second):
		t.Errorf("backend of rank %d not released 30 s after Close", b.Rank())
	}
}

// each runs fn for every rank concurrently and fails the test with every
// error.
func each(t testing.TB, ranks []*rank, fn func(rk *rank) error) {
	t.Helper()
	errs := make([]error, len(ranks))
	var wg sync.WaitGroup
	for i, rk := range ranks {
		wg.Go(func() {
			if err := fn(rk); err != nil {
				errs[i] = fmt.Errorf("rank %d: %w", rk.r, err)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// ---- host data ----

// encode writes vals as dt (values are small integers, exact in every type).
func encode(dt comm.DType, vals []float64) []byte {
	out := make([]byte, len(vals)*dt.Size())
	for i, v := range vals {
		switch dt {
		case comm.Float32:
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(float32(v)))
		case comm.Float64:
			binary.LittleEndian.PutUint64(out[8*i:], math.Float64bits(v))
		case comm.Float16:
			binary.LittleEndian.PutUint16(out[2*i:], uint16(comm.NewF16(float32(v))))
		case comm.BFloat16:
			binary.LittleEndian.PutUint16(out[2*i:], uint16(comm.NewBF16(float32(v))))
		case comm.Int8:
			out[i] = byte(int8(v))
		case comm.Uint8:
			out[i] = byte(v)
		case comm.Int32:
			binary.LittleEndian.PutUint32(out[4*i:], uint32(int32(v)))
		case comm.Int64:
			binary.LittleEndian.PutUint64(out[8*i:], uint64(int64(v)))
		}
	}
	return out
}

func decode(dt comm.DType, b []byte) []float64 {
	n := len(b) / dt.Size()
	out := make([]float64, n)
	for i := range n {
		switch dt {
		case comm.Float32:
			out[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
		case comm.Float64:
			out[i] = math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:]))
		case comm.Float16:
			out[i] = float64(comm.F16(binary.LittleEndian.Uint16(b[2*i:])).Float32())
		case comm.BFloat16:
			out[i] = float64(comm.BF16(binary.LittleEndian.Uint16(b[2*i:])).Float32())
		case comm.Int8:
			out[i] = float64(int8(b[i]))
		case comm.Uint8:
			out[i] = float64(b[i])
		case comm.Int32:
			out[i] = float64(int32(binary.LittleEndian.Uint32(b[4*i:])))
		case comm.Int64:
			out[i] = float64(int64(binary.LittleEndian.Uint64(b[8*i:])))
		}
	}
	return out
}

// randVals draws n small integers (in [-3, 3], or [0, 3] for uint8), so
// sums and products of a few ranks are exact in every dtype.
func randVals(rng *rand.Rand, dt comm.DType, n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		if dt == comm.Uint8 {
			out[i] = float64(rng.IntN(4))
		} else {
			out[i] = float64(rng.IntN(7) - 3)
		}
	}
	return out
}

func reduceVals(op comm.ReduceOp, parts [][]float64) []float64 {
	out := append([]float64(nil), parts[0]...)
	for _, p := range parts[1:] {
		for i, v := range p {
			switch op {
			case comm.Sum, comm.Avg:
				out[i] += v
			case comm.Prod:
				out[i] *= v
			case comm.Min:
				out[i] = math.Min(out[i], v)
			case comm.Max:
				out[i] = math.Max(out[i], v)
			}
		}
	}
	if op == comm.Avg {
		for i := range out {
			out[i] /= float64(len(parts))
		}
	}
	return out
}

// reduceValsOf is reduceVals with an integer type's Avg truncated toward
// zero, as ncclAvg computes it.
func reduceValsOf(dt comm.DType, op comm.ReduceOp, parts [][]float64) []float64 {
	out := reduceVals(op, parts)
	if op == comm.Avg && !dt.IsFloat() {
		for i := range out {
			out[i] = math.Trunc(out[i])
		}
	}
	return out
}

// tolerance is the largest relative error accepted: results of small
// integers are exact, except Avg, which rounds to the dtype.
func tolerance(dt comm.DType, op comm.ReduceOp) float64 {
	if op != comm.Avg {
		return 0
	}
	switch dt {
	case comm.Float16:
		return 1e-3
	case comm.BFloat16:
		return 8e-3
	case comm.Float32:
		return 1e-6
	}
	return 1e-12
}

func compareVals(got, want []float64, tol float64) error {
	if len(got) != len(want) {
		return fmt.Errorf("got %d values, want %d", len(got), len(want))
	}
	for i := range got {
		d := math.Abs(got[i] - want[i])
		if math.IsNaN(got[i]) || d > tol*math.Max(1, math.Abs(want[i])) {
			return fmt.Errorf("element %d: got %v, want %v (first mismatch of %d)", i, got[i], want[i], len(got))
		}
	}
	return nil
}

// devBuf is device memory for one rank's side of a test op.
type devBuf struct {
	rk *rank
	b  *DeviceBuffer
	dt comm.DType
}

func (rk *rank) alloc(dt comm.DType, n int) (*devBuf, error) {
	b, err := rk.L.Alloc(rk.dev, n*dt.Size())
	if err != nil {
		return nil, err
	}
	return &devBuf{rk: rk, b: b, dt: dt}, nil
}

func (d *devBuf) t() comm.Tensor { return d.b.Tensor(d.dt) }

func (d *devBuf) set(ctx context.Context, vals []float64) error {
	return d.b.CopyFromHost(ctx, encode(d.dt, vals))
}

// poison fills the buffer with a pattern no test value has.
func (d *devBuf) poison(ctx context.Context) error { return d.b.Fill(ctx, 0x7d) }

func (d *devBuf) get(ctx context.Context) ([]float64, error) {
	out := make([]byte, d.b.Len())
	if err := d.b.CopyToHost(ctx, out); err != nil {
		return nil, err
	}
	return decode(d.dt, out), nil
}

// ---- the suite ----

// suiteDTypes are the dtypes every collective is checked with.
var suiteDTypes = []comm.DType{comm.Float32, comm.BFloat16, comm.Float16, comm.Int32}

// collectiveSuite checks every collective of the ranks' comms against a
// host reference, for each dtype. n is the per-rank element count.
func collectiveSuite(t *testing.T, ctx context.Context, ranks []*rank, dtypes []comm.DType, n int, seed uint64) {
	size := len(ranks)
	for _, dt := range dtypes {
		rng := rand.New(rand.NewPCG(seed, uint64(dt)))
		t.Run(dt.String(), func(t *testing.T) {
			// Avg on an integer type truncates (ncclAvg).
			ops := []comm.ReduceOp{comm.Sum, comm.Prod, comm.Min, comm.Max, comm.Avg}
			for _, op := range ops {
				in := make([][]float64, size)
				for r := range in {
					in[r] = randVals(rng, dt, n)
				}
				want := reduceValsOf(dt, op, in)
				runOp(t, ctx, ranks, "allreduce/"+op.String(), dt, func(rk *rank, bufs *bufSet) error {
					x, err := bufs.with(in[rk.r])
					if err != nil {
						return err
					}
					if err := rk.c.AllReduce(ctx, x.t(), op); err != nil {
						return err
					}
					return bufs.expect(x, want, tolerance(dt, op))
				})
			}

			// ReduceScatter (sum): block r of the sum over ranks.
			rsIn := make([][]float64, size)
			for r := range rsIn {
				rsIn[r] = randVals(rng, dt, n*size)
			}
			rsSum := reduceVals(comm.Sum, rsIn)
			runOp(t, ctx, ranks, "reducescatter", dt, func(rk *rank, bufs *bufSet) error {
				in, err := bufs.with(rsIn[rk.r])
				if err != nil {
					return err
				}
				out, err := bufs.poisoned(n)
				if err != nil {
					return err
				}
				if err := rk.c.ReduceScatter(ctx, out.t(), in.t(), comm.Sum); err != nil {
					return err
				}
				return bufs.expect(out, rsSum[rk.r*n:(rk.r+1)*n], 0)
			})

			// ReduceScatterV: uneven blocks (one empty where n allows), sum
			// and avg.
			rsvCounts := make([]int, size)
			total := 0
			for r := range rsvCounts {
				rsvCounts[r] = (r*n/3 + 2) % (n + 1)
				total += rsvCounts[r]
			}
			for _, op := range []comm.ReduceOp{comm.Sum, comm.Avg} {
				rsvIn := make([][]float64, size)
				for r := range rsvIn {
					rsvIn[r] = randVals(rng, dt, total)
				}
				rsvWant := reduceValsOf(dt, op, rsvIn)
				runOp(t, ctx, ranks, "reducescatterv/"+op.String(), dt, func(rk *rank, bufs *bufSet) error {
					in, err := bufs.with(rsvIn[rk.r])
					if err != nil {
						return err
					}
					out, err := bufs.poisoned(rsvCounts[rk.r])
					if err != nil {
						return err
					}
					if err := rk.c.ReduceScatterV(ctx, out.t(), in.t(), rsvCounts, op); err != nil {
						return err
					}
					off := 0
					for _, c := range rsvCounts[:rk.r] {
						off += c
					}
					return bufs.expect(out, rsvWant[off:off+rsvCounts[rk.r]], tolerance(dt, op))
				})
			}

			// AllGather and AllGatherV.
			agIn := make([][]float64, size)
			var agWant []float64
			counts := make([]int, size)
			var agvWant []float64
			for r := range agIn {
				agIn[r] = randVals(rng, dt, n)
				agWant = append(agWant, agIn[r]...)
				counts[r] = (r*n/2 + 1) % (n + 1)
				agvWant = append(agvWant, agIn[r][:counts[r]]...)
			}
			runOp(t, ctx, ranks, "allgather", dt, func(rk *rank, bufs *bufSet) error {
				in, err := bufs.with(agIn[rk.r])
				if err != nil {
					return err
				}
				out, err := bufs.poisoned(n * size)
				if err != nil {
					return err
				}
				if err := rk.c.AllGather(ctx, out.t(), in.t()); err != nil {
					return err
				}
				return bufs.expect(out, agWant, 0)
			})
			runOp(t, ctx, ranks, "allgatherv", dt, func(rk *rank, bufs *bufSet) error {
				in, err := bufs.with(agIn[rk.r][:counts[rk.r]])
				if err != nil {
					return err
				}
				out, err := bufs.poisoned(len(agvWant))
				if err != nil {
					return err
				}
				if err := rk.c.AllGatherV(ctx, out.t(), in.t(), counts); err != nil {
					return err
				}
				return bufs.expect(out, agvWant, 0)
			})

			// Broadcast from the last rank; Reduce to rank 0 (others unchanged).
			bIn := make([][]float64, size)
			for r := range bIn {
				bIn[r] = randVals(rng, dt, n)
			}
			root := size - 1
			runOp(t, ctx, ranks, "broadcast", dt, func(rk *rank, bufs *bufSet) error {
				x, err := bufs.with(bIn[rk.r])
				if err != nil {
					return err
				}
				if err := rk.c.Broadcast(ctx, x.t(), root); err != nil {
					return err
				}
				return bufs.expect(x, bIn[root], 0)
			})
			redSum := reduceVals(comm.Sum, bIn)
			runOp(t, ctx, ranks, "reduce", dt, func(rk *rank, bufs *bufSet) error {
				x, err := bufs.with(bIn[rk.r])
				if err != nil {
					return err
				}
				if err := rk.c.Reduce(ctx, x.t(), comm.Sum, 0); err != nil {
					return err
				}
				if rk.r == 0 {
					return bufs.expect(x, redSum, 0)
				}
				return bufs.expect(x, bIn[rk.r], 0) // non-root buffers unchanged
			})

			// Scatter from and Gather to rank 1%size.
			sroot := 1 % size
			sIn := randVals(rng, dt, n*size)
			runOp(t, ctx, ranks, "scatter", dt, func(rk *rank, bufs *bufSet) error {
				var in comm.Tensor
				if rk.r == sroot {
					x, err := bufs.with(sIn)
					if err != nil {
						return err
					}
					in = x.t()
				}
				out, err := bufs.poisoned(n)
				if err != nil {
					return err
				}
				if err := rk.c.Scatter(ctx, out.t(), in, sroot); err != nil {
					return err
				}
				return bufs.expect(out, sIn[rk.r*n:(rk.r+1)*n], 0)
			})
			runOp(t, ctx, ranks, "gather", dt, func(rk *rank, bufs *bufSet) error {
				in, err := bufs.with(agIn[rk.r])
				if err != nil {
					return err
				}
				var out *devBuf
				var outT comm.Tensor
				if rk.r == sroot {
					if out, err = bufs.poisoned(n * size); err != nil {
						return err
					}
					outT = out.t()
				}
				if err := rk.c.Gather(ctx, outT, in.t(), sroot); err != nil {
					return err
				}
				if rk.r == sroot {
					return bufs.expect(out, agWant, 0)
				}
				return bufs.expect(in, agIn[rk.r], 0)
			})

			// AllToAll and AllToAllV.
			aIn := make([][]float64, size)
			for r := range aIn {
				aIn[r] = randVals(rng, dt, n*size)
			}
			runOp(t, ctx, ranks, "alltoall", dt, func(rk *rank, bufs *bufSet) error {
				in, err := bufs.with(aIn[rk.r])
				if err != nil {
					return err
				}
				out, err := bufs.poisoned(n * size)
				if err != nil {
					return err
				}
				if err := rk.c.AllToAll(ctx, out.t(), in.t()); err != nil {
					return err
				}
				var want []float64
				for k := range size {
					want = append(want, aIn[k][rk.r*n:(rk.r+1)*n]...)
				}
				return bufs.expect(out, want, 0)
			})
			// rank r sends cnt(r, j) elements to rank j.
			cnt := func(r, j int) int { return (r+2*j)%3 + 1 }
			vIn := make([][]float64, size)
			for r := range vIn {
				tot := 0
				for j := range size {
					tot += cnt(r, j)
				}
				vIn[r] = randVals(rng, dt, tot)
			}
			runOp(t, ctx, ranks, "alltoallv", dt, func(rk *rank, bufs *bufSet) error {
				inC, outC := make([]int, size), make([]int, size)
				var want []float64
				for j := range size {
					inC[j], outC[j] = cnt(rk.r, j), cnt(j, rk.r)
					off := 0
					for k := 0; k < rk.r; k++ {
						off += cnt(j, k)
					}
					want = append(want, vIn[j][off:off+outC[j]]...)
				}
				in, err := bufs.with(vIn[rk.r])
				if err != nil {
					return err
				}
				out, err := bufs.poisoned(len(want))
				if err != nil {
					return err
				}
				if err := rk.c.AllToAllV(ctx, out.t(), outC, in.t(), inC); err != nil {
					return err
				}
				return bufs.expect(out, want, 0)
			})

			if size < 2 {
				return
			}
			// A ring of sends and receives in one batch, then Send/Recv 0 → 1.
			pIn := make([][]float64, size)
			for r := range pIn {
				pIn[r] = randVals(rng, dt, n)
			}
			runOp(t, ctx, ranks, "batchp2p", dt, func(rk *rank, bufs *bufSet) error {
				src, err := bufs.with(pIn[rk.r])
				if err != nil {
					return err
				}
				dst, err := bufs.poisoned(n)
				if err != nil {
					return err
				}
				next, prev := (rk.r+1)%size, (rk.r+size-1)%size
				if err := rk.c.BatchP2P(ctx, []comm.P2POp{{Kind: comm.P2PSend, Tensor: src.t(), Peer: next},
					{Kind: comm.P2PRecv, Tensor: dst.t(), Peer: prev}}); err != nil {
					return err
				}
				return bufs.expect(dst, pIn[prev], 0)
			})
			runOp(t, ctx, ranks, "sendrecv", dt, func(rk *rank, bufs *bufSet) error {
				switch rk.r {
				case 0:
					src, err := bufs.with(pIn[0])
					if err != nil {
						return err
					}
					return rk.c.Send(ctx, src.t(), 1)
				case 1:
					dst, err := bufs.poisoned(n)
					if err != nil {
						return err
					}
					if err := rk.c.Recv(ctx, dst.t(), 0); err != nil {
						return err
					}
					return bufs.expect(dst, pIn[0], 0)
				}
				return nil
			})
			runOp(t, ctx, ranks, "barrier", dt, func(rk *rank, bufs *bufSet) error { return rk.c.Barrier(ctx) })
		})
	}
}

// bufSet tracks one rank's buffers for one op and frees them after.
type bufSet struct {
	ctx  context.Context
	rk   *rank
	dt   comm.DType
	bufs []*devBuf
}

func (s *bufSet) poisoned(n int) (*devBuf, error) {
	d, err := s.rk.alloc(s.dt, n)
	if err != nil {
		return nil, err
	}
	s.bufs = append(s.bufs, d)
	return d, d.poison(s.ctx)
}

func (s *bufSet) with(vals []float64) (*devBuf, error) {
	d, err := s.poisoned(len(vals))
	if err != nil {
		return nil, err
	}
	return d, d.set(s.ctx, vals)
}

func (s *bufSet) expect(d *devBuf, want []float64, tol float64) error {
	got, err := d.get(s.ctx)
	if err != nil {
		return err
	}
	return compareVals(got, want, tol)
}

func runOp(t *testing.T, ctx context.Context, ranks []*rank, name string, dt comm.DType, fn func(rk *rank, bufs *bufSet) error) {
	t.Helper()
	t.Run(name, func(t *testing.T) {
		each(t, ranks, func(rk *rank) error {
			bufs := &bufSet{ctx: ctx, rk: rk, dt: dt}
			defer func() {
				for _, b := range bufs.bufs {
					b.b.Free()
				}
			}()
			return fn(rk, bufs)
		})
	})
}
