package diloco

import (
	"encoding/binary"
	"math"
)

// A quantized payload carries n values of one replica (or of an average)
// as
//
//	[weight float32][scale float32 × ⌈n/block⌉][codes]
//
// little endian, where codes are n int8 (Int8) or ⌈n/2⌉ bytes of two 4-bit
// codes, low nibble first, each stored as code+8 (Int4). Value i is
// code_i × scale of its block; codes are symmetric, |code| ≤ 127 or 7, so
// a block's largest magnitude is exact and every value is within half a
// step (absmax/254 or absmax/14) of the original. The weight says how much
// this payload counts in an average (0: a replica with nothing to add).

const headerBytes = 4

// payloadSize is the size of a payload of n values.
func payloadSize(n int, q Quantization, block int) int {
	blocks := (n + block - 1) / block
	return headerBytes + 4*blocks + codeBytes(n, q)
}

func codeBytes(n int, q Quantization) int {
	if q == Int4 {
		return (n + 1) / 2
	}
	return n
}

// encode quantizes v into dst (payloadSize bytes) with the given weight,
// and writes what the receivers will decode into out (out may alias v: the
// error-feedback residual is then v − out computed by the caller before).
func encode(dst []byte, v, out []float32, weight float32, q Quantization, block int) {
	n := len(v)
	binary.LittleEndian.PutUint32(dst, math.Float32bits(weight))
	scales := dst[headerBytes:]
	codes := dst[headerBytes+4*((n+block-1)/block):]
	levels := q.levels()
	for b, lo := 0, 0; lo < n; b, lo = b+1, lo+block {
		hi := min(lo+block, n)
		var absmax float32
		for _, x := range v[lo:hi] {
			if x < 0 {
				x = -x
			}
			if x > absmax { // NaN never is
				absmax = x
			}
		}
		scale := absmax / levels
		binary.LittleEndian.PutUint32(scales[4*b:], math.Float32bits(scale))
		inv := float32(0)
		if scale > 0 && !math.IsInf(float64(scale), 0) {
			inv = 1 / scale
		}
		for i := lo; i < hi; i++ {
			c := v[i] * inv
			if c != c { // NaN in, or an infinite block: send nothing rather than garbage
				c = 0
			}
			c = max(-levels, min(levels, c))
			c = (c + roundMagic) - roundMagic // round half to even, exact for |c| < 2²²
			if q == Int4 {
				nib := byte(int8(c) + 8)
				if i%2 == 0 {
					codes[i/2] = codes[i/2]&0xf0 | nib
				} else {
					codes[i/2] = codes[i/2]&0x0f | nib<<4
				}
			} else {
				codes[i] = byte(int8(c))
			}
			out[i] = c * scale
		}
	}
}

// roundMagic is 1.5·2²³: adding and subtracting it rounds a float32 of
// magnitude below 2²² to the nearest integer, ties to even.
const roundMagic float32 = 12582912

// payloadWeight reads a payload's weight.
func payloadWeight(p []byte) float32 { return math.Float32frombits(binary.LittleEndian.Uint32(p)) }

// decodeAdd adds f × the n values of payload p to acc.
func decodeAdd(acc []float32, p []byte, f float32, q Quantization, block int) {
	n := len(acc)
	scales := p[headerBytes:]
	codes := p[headerBytes+4*((n+block-1)/block):]
	for b, lo := 0, 0; lo < n; b, lo = b+1, lo+block {
		hi := min(lo+block, n)
		s := f * math.Float32frombits(binary.LittleEndian.Uint32(scales[4*b:]))
		if q == Int4 {
			for i := lo; i < hi; i++ {
				nib := codes[i/2] >> (4 * (i % 2)) & 0x0f
				acc[i] += float32(int8(nib)-8) * s
			}
		} else {
			for i := lo; i < hi; i++ {
				acc[i] += float32(int8(codes[i])) * s
			}
		}
	}
}
