package reduce

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
)

// TestFloatSumKernelsMatchGeneric checks the vector float sums bit for bit
// against the generic loop: every length up to a few vectors, slices that
// start off any alignment, dst aliasing a or b, and values that include
// infinities, NaNs, signed zeros and subnormals.
func TestFloatSumKernelsMatchGeneric(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	special := []float64{math.Inf(1), math.Inf(-1), math.NaN(), 0, math.Copysign(0, -1), 5e-324, 1e-40, math.MaxFloat32, -math.MaxFloat64}
	val := func() float64 {
		if rng.IntN(8) == 0 {
			return special[rng.IntN(len(special))]
		}
		return rng.NormFloat64() * math.Pow(10, float64(rng.IntN(20)-10))
	}
	for n := 0; n <= 200; n++ {
		for _, off := range []int{0, 1, 3} {
			// float32
			a32, b32 := make([]float32, n+off), make([]float32, n+off)
			for i := range a32 {
				a32[i], b32[i] = float32(val()), float32(val())
			}
			a, b := a32[off:], b32[off:]
			want := make([]float32, n)
			apply3(comm.Sum, want, a, b)
			got := make([]float32, n+off)[off:]
			sumF32(got, a, b)
			for i := range want {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("float32 n=%d off=%d [%d]: %v + %v = %v, want %v", n, off, i, a[i], b[i], got[i], want[i])
				}
			}
			alias := append([]float32(nil), a...)
			sumF32(alias, alias, b) // as Into runs it
			for i := range want {
				if math.Float32bits(alias[i]) != math.Float32bits(want[i]) {
					t.Fatalf("float32 n=%d off=%d dst==a [%d]: %v, want %v", n, off, i, alias[i], want[i])
				}
			}
			// float64
			a64, b64 := make([]float64, n+off), make([]float64, n+off)
			for i := range a64 {
				a64[i], b64[i] = val(), val()
			}
			c, d := a64[off:], b64[off:]
			want64 := make([]float64, n)
			apply3(comm.Sum, want64, c, d)
			alias64 := append([]float64(nil), d...)
			sumF64(alias64, c, alias64) // dst == b
			for i := range want64 {
				if math.Float64bits(alias64[i]) != math.Float64bits(want64[i]) {
					t.Fatalf("float64 n=%d off=%d dst==b [%d]: %v + %v = %v, want %v", n, off, i, c[i], d[i], alias64[i], want64[i])
				}
			}
		}
	}
}

// TestIntoUsesTheSameSumWithoutAVX2 runs Into and Into3 on both paths (the
// vector kernels and the generic loop, as on a CPU without AVX2) and
// compares them.
func TestIntoUsesTheSameSumWithoutAVX2(t *testing.T) {
	n := 1000
	a, b := make([]byte, n*8), make([]byte, n*8)
	fillSmall(comm.Float64, a, 3)
	fillSmall(comm.Float64, b, 7)
	for _, dt := range []comm.DType{comm.Float32, comm.Float64} {
		for _, op := range []comm.ReduceOp{comm.Sum, comm.Avg} {
			runBoth := func() (into, into3 []byte) {
				into = append([]byte(nil), a...)
				Into(dt, op, into, b)
				into3 = make([]byte, len(a))
				Into3(dt, op, into3, a, b)
				return
			}
			v1, v3 := runBoth()
			saved := haveAVX2
			haveAVX2 = false
			g1, g3 := runBoth()
			haveAVX2 = saved
			if string(v1) != string(g1) || string(v3) != string(g3) {
				t.Fatalf("%s %s: vector and generic sums differ", dt, op)
			}
		}
	}
}
