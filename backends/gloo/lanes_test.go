package gloo

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// TestAllReduceLanes: large all-reduces spread over several lanes give the
// reference result, the same bits at every rank, for rank counts whose
// ring has one or two distinct neighbours, and sizes that do not split
// evenly into lanes, pieces and chunks.
func TestAllReduceLanes(t *testing.T) {
	skipWithoutShm(t)
	for _, n := range []int{2, 3, 4} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			j := newJob(t, n, func(c *Config) { c.SharedMemoryLanes = 3; c.SegmentSize = 256 << 10 })
			for _, l := range backendOf(j.comms[0]).links {
				if l != nil && (l.shm == nil || len(l.shm.lanes) != 3) {
					t.Fatalf("link without 3 lanes")
				}
			}
			for _, tc := range []struct {
				dt    comm.DType
				op    comm.ReduceOp
				count int
			}{
				{comm.Float32, comm.Sum, 3<<20 + 5}, // 12 MiB + 20 B: 3 lanes
				{comm.Float64, comm.Avg, 1<<18 + 3}, // 2 MiB: 2 lanes
				{comm.Int32, comm.Max, 5 << 18},     // 5 MiB
			} {
				bufs := make([][]byte, n)
				for r := range n {
					bufs[r] = input(tc.dt, tc.op, r, tc.count, 7)
				}
				want := refReduce(tc.dt, tc.op, bufs)
				j.mustRun(func(r int, c *comm.Comm) error {
					x := input(tc.dt, tc.op, r, tc.count, 7)
					// A bound per op, against a hang: one 60 s ctx for
					// the three ops of a subtest, their inputs,
					// references and checks (19 MiB) left no room on 2
					// loaded cores under -race (subtest 3 took 59.8 s).
					ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
					defer cancel()
					if err := c.AllReduce(ctx, tensor(tc.dt, x), tc.op); err != nil {
						return err
					}
					if err := diff(x, want); err != nil {
						return fmt.Errorf("%s %s [%d]: %w", tc.dt, tc.op, tc.count, err)
					}
					return nil
				})
			}
			if b := backendOf(j.comms[0]); b.laneHelpers.Load() != 2 {
				t.Errorf("%d lane helpers running, want 2", b.laneHelpers.Load())
			}
		})
	}
}

// TestLanesAbortThenShrink aborts while four ranks stream all-reduces over
// three lanes, so lane frames are cut off half written and half read;
// the survivors shrink over the same links (the resync carries every
// lane's position) and compute correctly on every lane again.
func TestLanesAbortThenShrink(t *testing.T) {
	skipWithoutShm(t)
	j := newJob(t, 4, func(c *Config) { c.SharedMemoryLanes = 3; c.SegmentSize = 256 << 10 })
	const count = 4 << 20 // 16 MiB of float32
	var ops atomic.Int32
	errs := j.run(func(r int, c *comm.Comm) error {
		x := make([]float32, count)
		for {
			if r == 0 && ops.Load() >= 6 {
				c.Abort(errors.New("test aborts mid-transfer"))
			}
			if err := c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum); err != nil {
				return err
			}
			ops.Add(1)
		}
	})
	for r, err := range errs {
		if !errors.Is(err, comm.ErrAborted) {
			t.Errorf("rank %d: got %v, want ErrAborted", r, err)
		}
	}
	j.comms[3].Close()
	j.comms[3] = nil
	shrinkAndCheck(t, j.comms[:3], []int{3}, 1)
	j.mustRun(func(r int, c *comm.Comm) error {
		if c == nil {
			return nil
		}
		x := make([]float32, count)
		for i := range x {
			x[i] = float32(r + i%7)
		}
		if err := c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum); err != nil {
			return err
		}
		for i := range x {
			if want := float32(3 + 3*(i%7)); x[i] != want {
				return fmt.Errorf("x[%d] = %v, want %v", i, x[i], want)
			}
		}
		return nil
	})
}

// TestAllReduceSameBitsEverywhere: with values whose float32 sums depend
// on the order of the additions, every rank must still end with the same
// bits — through the one-shot path (reduced in rank order at every rank),
// recursive doubling, the ring and the lanes.
func TestAllReduceSameBitsEverywhere(t *testing.T) {
	for _, tc := range []struct {
		name  string
		n     int
		count int
		mut   func(*Config)
	}{
		{"one-shot", 5, 1000, nil},
		{"recursive-doubling", 5, 1000, func(c *Config) { c.OneShotBytes = 0 }},
		{"ring", 3, 300000, func(c *Config) { c.SharedMemoryLanes = 1 }},
		{"lanes", 3, 1 << 20, func(c *Config) { c.SharedMemoryLanes = 3; c.SegmentSize = 128 << 10 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := newJob(t, tc.n, tc.mut)
			out := make([][]float32, tc.n)
			j.mustRun(func(r int, c *comm.Comm) error {
				x := make([]float32, tc.count)
				for i := range x {
					x[i] = float32(1+r) * (1 + float32(i%977)/3.0) / 7.0 // not exactly representable sums
				}
				out[r] = x
				return c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum)
			})
			for r := 1; r < tc.n; r++ {
				for i := range out[0] {
					if math.Float32bits(out[r][i]) != math.Float32bits(out[0][i]) {
						t.Fatalf("rank %d element %d: %v, rank 0 has %v", r, i, out[r][i], out[0][i])
					}
				}
			}
		})
	}
}
