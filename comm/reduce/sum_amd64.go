package reduce

import (
	"golang.org/x/sys/cpu"

	"github.com/ftcomm/ftcomm/comm"
)

// The float sums every all-reduce of float32 or float64 runs (and so every
// byte a CPU backend reduces) go through AVX2 where the CPU has it: four
// 256-bit adds per iteration instead of the scalar SSE adds the Go compiler
// emits. Each element is still one IEEE add of the same two operands, so
// the results are bit for bit those of the generic loop.

var haveAVX2 = cpu.X86.HasAVX && cpu.X86.HasAVX2

//go:noescape
func addF32AVX2(d, a, b *float32, n int)

//go:noescape
func addF64AVX2(d, a, b *float64, n int)

// sumF32 sets d[i] = a[i] + b[i] (d may alias a or b exactly).
func sumF32(d, a, b []float32) {
	a, b = a[:len(d)], b[:len(d)]
	k := 0
	if haveAVX2 {
		k = len(d) &^ 31
		if k > 0 {
			addF32AVX2(&d[0], &a[0], &b[0], k)
		}
	}
	apply3(comm.Sum, d[k:], a[k:], b[k:])
}

// sumF64 is sumF32 for float64.
func sumF64(d, a, b []float64) {
	a, b = a[:len(d)], b[:len(d)]
	k := 0
	if haveAVX2 {
		k = len(d) &^ 15
		if k > 0 {
			addF64AVX2(&d[0], &a[0], &b[0], k)
		}
	}
	apply3(comm.Sum, d[k:], a[k:], b[k:])
}
