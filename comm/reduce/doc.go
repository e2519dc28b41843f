// Package reduce holds the elementwise reduction kernels that CPU backends
// share: dst[i] = op(dst[i], src[i]) over raw bytes of any comm.DType.
// Float16 and BFloat16 are computed in float32 and rounded back (ties to
// even). Float32 and float64 sums run on AVX2 where the CPU has it, with
// the same bits as the generic loop. The kernels allocate nothing and are safe for concurrent use on
// disjoint buffers.
package reduce
