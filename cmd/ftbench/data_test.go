package main

import (
	"testing"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

// The expected results must be exact whatever order an implementation
// reduces in: reduce the ranks' inputs with the kernels the CPU backends
// use, in rank order and in reverse (as a ring does from different
// starting points), and require both to match the checker's expectation.
func TestDatasetExpectationsAreExact(t *testing.T) {
	const count = 4096
	for _, dt := range []comm.DType{comm.Float32, comm.Float64, comm.Float16, comm.BFloat16, comm.Int8, comm.Uint8, comm.Int32, comm.Int64} {
		for _, red := range []comm.ReduceOp{comm.Sum, comm.Prod, comm.Min, comm.Max, comm.Avg, comm.BAnd, comm.BOr, comm.BXor} {
			if !red.Supports(dt) {
				continue
			}
			for _, n := range []int{2, 3, 4, 7, 8, 64} {
				ds := newDataset(dt, red, n)
				for _, order := range []string{"forward", "reverse"} {
					acc := make([]byte, count*dt.Size())
					in := make([]byte, len(acc))
					for k := range n {
						r := k
						if order == "reverse" {
							r = n - 1 - k
						}
						if k == 0 {
							fill(dt, acc, func(i int) float64 { return ds.input(r, i) })
							continue
						}
						fill(dt, in, func(i int) float64 { return ds.input(r, i) })
						reduce.Into(dt, red, acc, in)
					}
					if red == comm.Avg {
						reduce.Divide(dt, acc, n)
					}
					if w := countWrong(dt, acc, ds.reduced, ds.tolerance); w != 0 {
						t.Errorf("%s %s n=%d %s: %d of %d elements differ from the expectation", dt, red, n, order, w, count)
					}
				}
			}
		}
	}
}

func TestCountWrongCatchesCorruption(t *testing.T) {
	for _, dt := range []comm.DType{comm.Float32, comm.Float16, comm.BFloat16, comm.Int8, comm.Uint8, comm.Int64} {
		ds := newDataset(dt, comm.Sum, 4)
		b := make([]byte, 1000*dt.Size())
		fill(dt, b, ds.reduced)
		if w := countWrong(dt, b, ds.reduced, ds.tolerance); w != 0 {
			t.Fatalf("%s: %d wrong in a correct buffer", dt, w)
		}
		// Corrupt three elements: one off by one, one swapped with a
		// neighbour holding a different value, one left at the poison.
		fill(dt, b[17*dt.Size():18*dt.Size()], func(int) float64 { return ds.reduced(17) + 1 })
		i := 100
		for ds.reduced(i) == ds.reduced(i+1) {
			i++
		}
		fill(dt, b[i*dt.Size():(i+1)*dt.Size()], func(int) float64 { return ds.reduced(i + 1) })
		fill(dt, b[500*dt.Size():501*dt.Size()], func(int) float64 { return poisonOf(dt) })
		if w := countWrong(dt, b, ds.reduced, ds.tolerance); w != 3 {
			t.Errorf("%s: counted %d wrong, want 3", dt, w)
		}
	}
}

func TestAvgToleranceIsOneULP(t *testing.T) {
	ds := newDataset(comm.Float32, comm.Avg, 3)
	if tol := ds.tolerance(1); tol != 1.0/(1<<23) {
		t.Errorf("float32 tolerance at 1 = %g, want 2^-23", tol)
	}
	if tol := ds.tolerance(1.5); tol != 1.0/(1<<23) {
		t.Errorf("float32 tolerance at 1.5 = %g, want 2^-23", tol)
	}
	if tol := newDataset(comm.BFloat16, comm.Avg, 3).tolerance(3); tol != 1.0/(1<<6) {
		t.Errorf("bfloat16 tolerance at 3 = %g, want 2^-6", tol)
	}
	if tol := newDataset(comm.Float32, comm.Sum, 3).tolerance(3); tol != 0 {
		t.Errorf("sum tolerance = %g, want 0 (exact)", tol)
	}
}

func TestInputsStayInRange(t *testing.T) {
	// Sums of n inputs stay exact in the narrowest float types.
	for _, c := range []struct {
		dt comm.DType
		n  int
	}{{comm.BFloat16, 2}, {comm.BFloat16, 64}, {comm.BFloat16, 200}, {comm.Float16, 200}} {
		ds := newDataset(c.dt, comm.Sum, c.n)
		if max := float64(c.n) * float64(ds.k-1); max > exactLimit(c.dt) {
			t.Errorf("%s n=%d: sums reach %g > exact limit %g", c.dt, c.n, max, exactLimit(c.dt))
		}
		if ds.k < 2 {
			t.Errorf("%s n=%d: inputs are constant", c.dt, c.n)
		}
	}
}
