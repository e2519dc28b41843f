package comm

import (
	"fmt"
	"math"
	"strings"
)

// DType is the element type of a Tensor. The zero value is invalid, so a
// forgotten field is caught by validation instead of being read as Float32.
type DType uint8

// The element types every backend understands.
const (
	Float32 DType = iota + 1
	Float64
	Float16
	BFloat16
	Int8
	Uint8
	Int32
	Int64
	numDTypes
)

var dtypeInfo = [numDTypes]struct {
	name string
	size int
}{
	Float32:  {"float32", 4},
	Float64:  {"float64", 8},
	Float16:  {"float16", 2},
	BFloat16: {"bfloat16", 2},
	Int8:     {"int8", 1},
	Uint8:    {"uint8", 1},
	Int32:    {"int32", 4},
	Int64:    {"int64", 8},
}

// Valid reports whether d names one of the defined element types.
func (d DType) Valid() bool { return d > 0 && d < numDTypes }

// Size is the size of one element in bytes, or 0 for an invalid DType.
func (d DType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dtypeInfo[d].size
}

// String returns the canonical lowercase name ("float32", "bfloat16", …).
func (d DType) String() string {
	if !d.Valid() {
		return fmt.Sprintf("dtype(%d)", uint8(d))
	}
	return dtypeInfo[d].name
}

// IsFloat reports whether d is a floating-point type.
func (d DType) IsFloat() bool {
	return d == Float32 || d == Float64 || d == Float16 || d == BFloat16
}

// ParseDType accepts the canonical names and the usual short forms
// (f32, fp32, float, half, fp16, bf16, double, int, long, …).
func ParseDType(s string) (DType, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "float32", "f32", "fp32", "float":
		return Float32, nil
	case "float64", "f64", "fp64", "double":
		return Float64, nil
	case "float16", "f16", "fp16", "half":
		return Float16, nil
	case "bfloat16", "bf16":
		return BFloat16, nil
	case "int8", "i8", "char":
		return Int8, nil
	case "uint8", "u8", "byte":
		return Uint8, nil
	case "int32", "i32", "int":
		return Int32, nil
	case "int64", "i64", "long":
		return Int64, nil
	}
	return 0, fmt.Errorf("%w: unknown dtype %q", ErrInvalidArgument, s)
}

// ReduceOp is the reduction applied by AllReduce, Reduce and ReduceScatter.
// The zero value is invalid.
type ReduceOp uint8

// The reductions. Avg is Sum divided by the number of participating ranks;
// on an integer type the division truncates toward zero after the sum
// (which wraps like the type), as NCCL's ncclAvg does. BAnd, BOr and BXor
// are bitwise, for integer types only.
const (
	Sum ReduceOp = iota + 1
	Prod
	Min
	Max
	Avg
	BAnd
	BOr
	BXor
	numReduceOps
)

var reduceNames = [numReduceOps]string{Sum: "sum", Prod: "prod", Min: "min", Max: "max", Avg: "avg",
	BAnd: "band", BOr: "bor", BXor: "bxor"}

// Valid reports whether o is a defined reduction.
func (o ReduceOp) Valid() bool { return o > 0 && o < numReduceOps }

func (o ReduceOp) String() string {
	if !o.Valid() {
		return fmt.Sprintf("reduceop(%d)", uint8(o))
	}
	return reduceNames[o]
}

// ParseReduceOp accepts the names String returns: "sum", "prod", "min",
// "max", "avg", "band", "bor" and "bxor" (any case).
func ParseReduceOp(s string) (ReduceOp, error) {
	want := strings.ToLower(strings.TrimSpace(s))
	for o := Sum; o < numReduceOps; o++ {
		if reduceNames[o] == want {
			return o, nil
		}
	}
	return 0, fmt.Errorf("%w: unknown reduce op %q", ErrInvalidArgument, s)
}

// Supports reports whether the pair (op, d) is defined: every op on every
// type, except the bitwise ones on floating-point types.
func (o ReduceOp) Supports(d DType) bool {
	if !o.Valid() || !d.Valid() {
		return false
	}
	return !o.Bitwise() || !d.IsFloat()
}

// Bitwise reports whether o is BAnd, BOr or BXor.
func (o ReduceOp) Bitwise() bool { return o == BAnd || o == BOr || o == BXor }

// F16 is an IEEE 754 binary16 value stored as its 16-bit pattern.
type F16 uint16

// BF16 is a bfloat16 value (the top 16 bits of a float32) stored as its
// 16-bit pattern.
type BF16 uint16

// Float32 converts h to float32 exactly (every binary16 value is a float32).
func (h F16) Float32() float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // inf or NaN; keep the payload
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp != 0: // normal
		return math.Float32frombits(sign | (exp+112)<<23 | mant<<13)
	case mant == 0: // signed zero
		return math.Float32frombits(sign)
	}
	// subnormal: value = mant * 2^-24, exact in float32
	f := float32(mant) * (1.0 / (1 << 24))
	if sign != 0 {
		f = -f
	}
	return f
}

// NewF16 rounds f to the nearest binary16 value, ties to even, with
// overflow to ±Inf and NaN kept a NaN.
func NewF16(f float32) F16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	mant := b & 0x7fffff
	if exp == 0xff {
		if mant != 0 {
			return F16(sign | 0x7e00 | uint16(mant>>13)) // quiet NaN
		}
		return F16(sign | 0x7c00)
	}
	e := exp - 127 + 15
	if e >= 0x1f {
		return F16(sign | 0x7c00)
	}
	if e <= 0 {
		// subnormal or zero in binary16
		if e < -10 {
			return F16(sign)
		}
		m := mant | 0x800000 // implicit bit
		shift := uint32(14 - e)
		half := uint32(1) << (shift - 1)
		rest := m & (1<<shift - 1)
		r := m >> shift
		if rest > half || (rest == half && r&1 == 1) {
			r++
		}
		return F16(sign | uint16(r))
	}
	r := uint32(e)<<10 | mant>>13
	rest := mant & 0x1fff
	if rest > 0x1000 || (rest == 0x1000 && r&1 == 1) {
		r++ // may carry into the exponent, up to Inf: that is correct rounding
	}
	return F16(sign | uint16(r))
}

// Float32 converts b to float32 exactly.
func (b BF16) Float32() float32 { return math.Float32frombits(uint32(b) << 16) }

// NewBF16 rounds f to the nearest bfloat16 value, ties to even; NaN stays NaN.
func NewBF16(f float32) BF16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return BF16(b>>16 | 0x40) // quiet NaN, sign kept
	}
	b += 0x7fff + (b>>16)&1
	return BF16(b >> 16)
}
