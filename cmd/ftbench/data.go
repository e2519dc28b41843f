package main

import (
	"math"

	"github.com/ftcomm/ftcomm/comm"
)

// The benchmark's data. Every input element is a small non-negative
// integer drawn from a hash of (rank, index), so
//   - every sum, product, min and max the ranks can form is exact in every
//     dtype (sums stay below the dtype's largest exact integer, products
//     are powers of two, integer types wrap identically in any order), so
//     the expected result is known exactly and any misplaced or corrupted
//     element is counted;
//   - avg divides an exact sum once; implementations may divide or multiply
//     by the reciprocal, so avg results are accepted within one unit in the
//     last place of the dtype — the one comparison that is not exact.

// mix is splitmix64's finalizer: a cheap, well-spread hash.
func mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func hashOf(rank, i int) uint64 { return mix(uint64(rank)<<40 ^ uint64(i)) }

// exactLimit is the largest integer up to which every integer is exact in dt
// (for float types); integer types wrap, so they have no limit.
func exactLimit(dt comm.DType) float64 {
	switch dt {
	case comm.Float16:
		return 2048
	case comm.BFloat16:
		return 256
	case comm.Float32:
		return 1 << 24
	case comm.Float64:
		return 1 << 53
	}
	return math.Inf(1)
}

// mantissaBits is the stored significand width of a float dtype.
func mantissaBits(dt comm.DType) int {
	switch dt {
	case comm.Float16:
		return 10
	case comm.BFloat16:
		return 7
	case comm.Float32:
		return 23
	}
	return 52
}

// dataset generates one series' inputs and expected outputs for n ranks.
type dataset struct {
	dt   comm.DType
	red  comm.ReduceOp // 0 for ops that only move data
	n    int
	k    uint64 // inputs are hash % k (+1 for prod)
	base float64
}

func newDataset(dt comm.DType, red comm.ReduceOp, n int) dataset {
	d := dataset{dt: dt, red: red, n: n, k: 16}
	switch red {
	case comm.Sum, comm.Avg:
		// n*(k-1) must stay exact: k = min(16, limit/n + 1), at least 2.
		if lim := exactLimit(dt); !math.IsInf(lim, 1) {
			if k := uint64(lim)/uint64(n) + 1; k < d.k {
				d.k = max(k, 2)
			}
		}
	case comm.Prod:
		d.k, d.base = 2, 1 // {1, 2}: products are powers of two
	case 0:
		d.k = 64
	}
	return d
}

// input is rank r's element i.
func (d dataset) input(r, i int) float64 { return d.base + float64(hashOf(r, i)%d.k) }

// reduced is the expected reduction over all ranks of their element i,
// rounded or wrapped as dt stores it.
func (d dataset) reduced(i int) float64 {
	if d.dt.IsFloat() {
		acc := d.input(0, i)
		for r := 1; r < d.n; r++ {
			x := d.input(r, i)
			switch d.red {
			case comm.Sum, comm.Avg:
				acc += x
			case comm.Prod:
				acc *= x
			case comm.Min:
				acc = math.Min(acc, x)
			case comm.Max:
				acc = math.Max(acc, x)
			}
		}
		if d.red == comm.Avg {
			acc /= float64(d.n)
		}
		return roundTo(d.dt, acc)
	}
	acc := int64(d.input(0, i))
	for r := 1; r < d.n; r++ {
		x := int64(d.input(r, i))
		switch d.red {
		case comm.Sum, comm.Avg:
			acc += x
		case comm.Prod:
			acc *= x // wraps mod 2^64, which wrapTo narrows consistently
		case comm.Min:
			acc = min(acc, x)
		case comm.Max:
			acc = max(acc, x)
		case comm.BAnd:
			acc &= x
		case comm.BOr:
			acc |= x
		case comm.BXor:
			acc ^= x
		}
	}
	if d.red == comm.Avg { // the wrapped sum divided, truncating (ncclAvg)
		return float64(int64(wrapTo(d.dt, acc)) / int64(d.n))
	}
	return wrapTo(d.dt, acc)
}

// tolerance is how far a result may be from want: one ulp of a float dt
// for avg, zero (exact) for everything else.
func (d dataset) tolerance(want float64) float64 {
	if d.red != comm.Avg || !d.dt.IsFloat() || want == 0 || math.IsInf(want, 0) {
		return 0
	}
	_, exp := math.Frexp(want)
	return math.Ldexp(1, exp-1-mantissaBits(d.dt))
}

// roundTo rounds x to the nearest value of float dtype dt.
func roundTo(dt comm.DType, x float64) float64 {
	switch dt {
	case comm.Float32:
		return float64(float32(x))
	case comm.Float16:
		return float64(comm.NewF16(float32(x)).Float32())
	case comm.BFloat16:
		return float64(comm.NewBF16(float32(x)).Float32())
	}
	return x
}

// wrapTo narrows x to integer dtype dt with two's-complement wrapping.
func wrapTo(dt comm.DType, x int64) float64 {
	switch dt {
	case comm.Int8:
		return float64(int8(x))
	case comm.Uint8:
		return float64(uint8(x))
	case comm.Int32:
		return float64(int32(x))
	}
	return float64(x)
}

// fill sets element i of the dt-typed bytes b to f(i).
func fill(dt comm.DType, b []byte, f func(i int) float64) {
	t := comm.HostBytes(dt, b)
	switch dt {
	case comm.Float32:
		fillAs(t.AsFloat32s(), f)
	case comm.Float64:
		fillAs(t.AsFloat64s(), f)
	case comm.Int8:
		fillAs(t.AsInt8s(), f)
	case comm.Uint8:
		fillAs(t.AsUint8s(), f)
	case comm.Int32:
		fillAs(t.AsInt32s(), f)
	case comm.Int64:
		fillAs(t.AsInt64s(), f)
	case comm.Float16:
		s := t.AsFloat16s()
		for i := range s {
			s[i] = comm.NewF16(float32(f(i)))
		}
	case comm.BFloat16:
		s := t.AsBFloat16s()
		for i := range s {
			s[i] = comm.NewBF16(float32(f(i)))
		}
	}
}

type number interface {
	~float32 | ~float64 | ~int8 | ~uint8 | ~int32 | ~int64
}

func fillAs[T number](s []T, f func(int) float64) {
	for i := range s {
		s[i] = T(f(i))
	}
}

// countWrong counts the elements of the dt-typed bytes b that differ from
// want(i) by more than tol(want(i)).
func countWrong(dt comm.DType, b []byte, want func(i int) float64, tol func(float64) float64) int64 {
	t := comm.HostBytes(dt, b)
	switch dt {
	case comm.Float32:
		return wrongAs(t.AsFloat32s(), func(x float32) float64 { return float64(x) }, want, tol)
	case comm.Float64:
		return wrongAs(t.AsFloat64s(), func(x float64) float64 { return x }, want, tol)
	case comm.Int8:
		return wrongAs(t.AsInt8s(), func(x int8) float64 { return float64(x) }, want, tol)
	case comm.Uint8:
		return wrongAs(t.AsUint8s(), func(x uint8) float64 { return float64(x) }, want, tol)
	case comm.Int32:
		return wrongAs(t.AsInt32s(), func(x int32) float64 { return float64(x) }, want, tol)
	case comm.Int64:
		return wrongAs(t.AsInt64s(), func(x int64) float64 { return float64(x) }, want, tol)
	case comm.Float16:
		return wrongAs(t.AsFloat16s(), func(x comm.F16) float64 { return float64(x.Float32()) }, want, tol)
	case comm.BFloat16:
		return wrongAs(t.AsBFloat16s(), func(x comm.BF16) float64 { return float64(x.Float32()) }, want, tol)
	}
	return int64(t.Count())
}

func wrongAs[T any](s []T, get func(T) float64, want func(int) float64, tol func(float64) float64) int64 {
	var wrong int64
	for i, x := range s {
		g, w := get(x), want(i)
		if g == w {
			continue
		}
		if t := tol(w); t > 0 && math.Abs(g-w) <= t {
			continue
		}
		wrong++
	}
	return wrong
}
