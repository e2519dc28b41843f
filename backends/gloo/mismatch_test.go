package gloo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// mop is one rank's side of a mismatch case: it runs an op on buffers it
// owns and reports whether they are still as they were before.
type mop func(ctx context.Context, c *comm.Comm, r, n int) (err error, untouched bool)

func allReduceOp(dt comm.DType, count int, op comm.ReduceOp) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		in := input(dt, comm.Sum, r, count, 1)
		buf := bytes.Clone(in)
		err := c.AllReduce(ctx, tensor(dt, buf), op)
		return err, bytes.Equal(buf, in)
	}
}

func broadcastOp(count, root int) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		in := input(comm.Float32, comm.Sum, r, count, 1)
		buf := bytes.Clone(in)
		err := c.Broadcast(ctx, tensor(comm.Float32, buf), root%n)
		return err, bytes.Equal(buf, in)
	}
}

func reduceOp(count, root int) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		in := input(comm.Float32, comm.Sum, r, count, 1)
		buf := bytes.Clone(in)
		err := c.Reduce(ctx, tensor(comm.Float32, buf), comm.Sum, root%n)
		return err, bytes.Equal(buf, in)
	}
}

func allGatherVOp(extra int) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		counts := make([]int, n)
		for i := range counts {
			counts[i] = 50 + i
		}
		counts[(r+1)%n] += extra // changes the vector, not this rank's own count
		in := input(comm.Float32, comm.Sum, r, counts[r], 1)
		out := sentinel(sum(counts) * 4)
		err := c.AllGatherV(ctx, tensor(comm.Float32, out), tensor(comm.Float32, in), counts)
		return err, bytes.Equal(out, sentinel(len(out)))
	}
}

func allToAllVOp(extra int) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		inC, outC := make([]int, n), make([]int, n)
		for p := range n {
			inC[p], outC[p] = 3000+p, 3000+r
		}
		inC[(r+1)%n] += extra // sends more than the next rank expects
		in := input(comm.Float32, comm.Sum, r, sum(inC), 1)
		out := sentinel(sum(outC) * 4)
		err := c.AllToAllV(ctx, tensor(comm.Float32, out), outC, tensor(comm.Float32, in), inC)
		return err, bytes.Equal(out, sentinel(len(out)))
	}
}

func reduceScatterOp(count int) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		in := input(comm.Float32, comm.Sum, r, count*n, 1)
		out := sentinel(count * 4)
		err := c.ReduceScatter(ctx, tensor(comm.Float32, out), tensor(comm.Float32, in), comm.Sum)
		return err, bytes.Equal(out, sentinel(len(out)))
	}
}

// TestOpsDisagree: one rank issues a different op, count, dtype, reduce op,
// root or counts vector. Every rank gets ErrMismatch (no hang) and no
// rank's buffers are written.
func TestOpsDisagree(t *testing.T) {
	const small, large = 16, 100000
	cases := []struct {
		name      string
		base, alt mop
	}{
		{"op allreduce vs broadcast", allReduceOp(comm.Float32, small, comm.Sum), broadcastOp(small, 0)},
		{"op allreduce vs reducescatter", allReduceOp(comm.Float32, large, comm.Sum), reduceScatterOp(large / 4)},
		{"count small", allReduceOp(comm.Float32, small, comm.Sum), allReduceOp(comm.Float32, small+1, comm.Sum)},
		{"count large", allReduceOp(comm.Float32, large, comm.Sum), allReduceOp(comm.Float32, large+1, comm.Sum)},
		{"count across algorithms", allReduceOp(comm.Float32, 64, comm.Sum), allReduceOp(comm.Float32, 65, comm.Sum)},
		{"dtype", allReduceOp(comm.Float32, large, comm.Sum), allReduceOp(comm.Float64, large, comm.Sum)},
		{"dtype small", allReduceOp(comm.Float32, small, comm.Sum), allReduceOp(comm.Int32, small, comm.Sum)},
		{"reduce op", allReduceOp(comm.Float32, small, comm.Sum), allReduceOp(comm.Float32, small, comm.Max)},
		{"reduce root", reduceOp(large, 0), reduceOp(large, 1)},
		{"broadcast root", broadcastOp(large, 0), broadcastOp(large, 1)},
		{"allgatherv counts", allGatherVOp(0), allGatherVOp(1)},
		{"alltoallv counts", allToAllVOp(0), allToAllVOp(1)},
	}
	for _, n := range []int{2, 3, 4} {
		t.Run(fmt.Sprintf("n=%d", n), func(t *testing.T) {
			for _, tc := range cases {
				for _, culprit := range uniq(0, n-1) {
					// Each case breaks the comm: shrink is not the point here,
					// so make a fresh one.
					j := newJob(t, n, func(c *Config) { c.SmallThreshold = 256 })
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
					untouched := make([]bool, n)
					errs := j.run(func(r int, c *comm.Comm) error {
						f := tc.base
						if r == culprit {
							f = tc.alt
						}
						err, ok := f(ctx, c, r, n)
						untouched[r] = ok
						return err
					})
					cancel()
					for r, err := range errs {
						if !errors.Is(err, comm.ErrMismatch) {
							t.Errorf("%s, culprit %d: rank %d: got %v, want ErrMismatch", tc.name, culprit, r, err)
						} else if !untouched[r] {
							t.Errorf("%s, culprit %d: rank %d: buffer was written", tc.name, culprit, r)
						}
					}
					j.close()
				}
			}
		})
	}
}

// TestPointToPointDisagree: a Recv whose size differs from the Send fails
// with ErrMismatch and leaves its buffer alone; the sender learns of it.
func TestPointToPointDisagree(t *testing.T) {
	j := newJob(t, 2, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	errs := j.run(func(r int, c *comm.Comm) error {
		if r == 0 {
			if err := c.Send(ctx, comm.Float32s(make([]float32, 10)), 1); err != nil {
				return err
			}
			return c.Barrier(ctx)
		}
		buf := []float32{7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7}
		err := c.Recv(ctx, comm.Float32s(buf), 0)
		for _, v := range buf {
			if v != 7 {
				return fmt.Errorf("buffer written despite %v", err)
			}
		}
		return err
	})
	for r, err := range errs {
		if !errors.Is(err, comm.ErrMismatch) {
			t.Errorf("rank %d: got %v, want ErrMismatch", r, err)
		}
	}
}
