package reduce_test

import (
	"math"
	"slices"
	"testing"
	"unsafe"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

func bytesOf[T any](s []T) []byte {
	var z T
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(z)))
}

func TestIntoAllOps(t *testing.T) {
	for _, tc := range []struct {
		op   comm.ReduceOp
		want []int32
	}{
		{comm.Sum, []int32{5, -1, 9}},
		{comm.Avg, []int32{5, -1, 9}}, // Avg reduces as Sum
		{comm.Prod, []int32{6, -6, 0}},
		{comm.Min, []int32{2, -3, 0}},
		{comm.Max, []int32{3, 2, 9}},
	} {
		d, s := []int32{2, -3, 9}, []int32{3, 2, 0}
		reduce.Into(comm.Int32, tc.op, bytesOf(d), bytesOf(s))
		for i := range d {
			if d[i] != tc.want[i] {
				t.Fatalf("%s: %v, want %v", tc.op, d, tc.want)
			}
		}
	}
}

func TestIntoHalfInFloat32(t *testing.T) {
	d := []comm.BF16{comm.NewBF16(1.5), comm.NewBF16(-2)}
	s := []comm.BF16{comm.NewBF16(0.25), comm.NewBF16(8)}
	reduce.Into(comm.BFloat16, comm.Sum, bytesOf(d), bytesOf(s))
	if d[0].Float32() != 1.75 || d[1].Float32() != 6 {
		t.Fatalf("bf16 sum: %v %v", d[0].Float32(), d[1].Float32())
	}
	h := []comm.F16{comm.NewF16(3), comm.NewF16(-1)}
	g := []comm.F16{comm.NewF16(0.5), comm.NewF16(4)}
	reduce.Into(comm.Float16, comm.Max, bytesOf(h), bytesOf(g))
	if h[0].Float32() != 3 || h[1].Float32() != 4 {
		t.Fatalf("fp16 max: %v %v", h[0].Float32(), h[1].Float32())
	}
	reduce.Divide(comm.Float16, bytesOf(h), 4)
	if h[0].Float32() != 0.75 || h[1].Float32() != 1 {
		t.Fatalf("fp16 divide: %v %v", h[0].Float32(), h[1].Float32())
	}
}

func TestDivide(t *testing.T) {
	f := []float32{3, 1}
	reduce.Divide(comm.Float32, bytesOf(f), 3)
	if f[0] != 1 || f[1] != float32(1)/3 {
		t.Fatal(f)
	}
	g := []float64{1, math.Inf(1)}
	reduce.Divide(comm.Float64, bytesOf(g), 4)
	if g[0] != 0.25 || !math.IsInf(g[1], 1) {
		t.Fatal(g)
	}
}

// An integer Avg divides the (wrapped) sum and truncates toward zero, as
// NCCL's ncclAvg does; a rank count the type cannot hold divides by the
// type's maximum.
func TestDivideIntegersTruncates(t *testing.T) {
	i := []int32{7, -7, 6, 0}
	reduce.Divide(comm.Int32, bytesOf(i), 2)
	if want := []int32{3, -3, 3, 0}; !slices.Equal(i, want) {
		t.Fatalf("int32 / 2: %v, want %v", i, want)
	}
	b := []int8{127, -128, 5}
	reduce.Divide(comm.Int8, bytesOf(b), 4)
	if want := []int8{31, -32, 1}; !slices.Equal(b, want) {
		t.Fatalf("int8 / 4: %v, want %v", b, want)
	}
	u := []uint8{255, 9}
	reduce.Divide(comm.Uint8, bytesOf(u), 300) // more ranks than uint8 holds: / 255
	if want := []uint8{1, 0}; !slices.Equal(u, want) {
		t.Fatalf("uint8 / 300: %v, want %v", u, want)
	}
	l := []int64{-9}
	reduce.Divide(comm.Int64, bytesOf(l), 4)
	if l[0] != -2 {
		t.Fatalf("int64 -9 / 4: %d, want -2", l[0])
	}
}

func TestIntoBitwise(t *testing.T) {
	for _, tc := range []struct {
		op   comm.ReduceOp
		want []int64
	}{
		{comm.BAnd, []int64{0b1000, 0, -8}},
		{comm.BOr, []int64{0b1110, 5, -1}},
		{comm.BXor, []int64{0b0110, 5, 7}},
	} {
		d, s := []int64{0b1100, 5, -8}, []int64{0b1010, 0, -1}
		reduce.Into(comm.Int64, tc.op, bytesOf(d), bytesOf(s))
		if !slices.Equal(d, tc.want) {
			t.Fatalf("int64 %s: %v, want %v", tc.op, d, tc.want)
		}
		x, y := []uint8{0b1100, 1, 0}, []uint8{0b1010, 1, 1}
		dst := make([]uint8, 3)
		reduce.Into3(comm.Uint8, tc.op, bytesOf(dst), bytesOf(x), bytesOf(y))
		for i := range dst {
			var w uint8
			switch tc.op {
			case comm.BAnd:
				w = x[i] & y[i]
			case comm.BOr:
				w = x[i] | y[i]
			default:
				w = x[i] ^ y[i]
			}
			if dst[i] != w {
				t.Fatalf("uint8 %s: %v, want element %d = %d", tc.op, dst, i, w)
			}
		}
	}
}

func TestBitwiseOnlyForIntegers(t *testing.T) {
	for _, op := range []comm.ReduceOp{comm.BAnd, comm.BOr, comm.BXor} {
		for _, dt := range []comm.DType{comm.Float32, comm.Float64, comm.Float16, comm.BFloat16} {
			if op.Supports(dt) {
				t.Errorf("%s supports %s", op, dt)
			}
		}
		for _, dt := range []comm.DType{comm.Int8, comm.Uint8, comm.Int32, comm.Int64} {
			if !op.Supports(dt) {
				t.Errorf("%s does not support %s", op, dt)
			}
		}
		if got, err := comm.ParseReduceOp(op.String()); err != nil || got != op {
			t.Errorf("ParseReduceOp(%q) = %v, %v", op, got, err)
		}
	}
	if !comm.Avg.Supports(comm.Int32) {
		t.Error("avg does not support int32")
	}
}

func TestIntoRejectsMismatchedLengths(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("mismatched lengths must panic (a backend bug, never user input)")
		}
	}()
	reduce.Into(comm.Float32, comm.Sum, make([]byte, 8), make([]byte, 4))
}

func BenchmarkIntoFloat32Sum(b *testing.B) {
	d, s := make([]float32, 1<<20), make([]float32, 1<<20)
	b.SetBytes(int64(len(d) * 4))
	for b.Loop() {
		reduce.Into(comm.Float32, comm.Sum, bytesOf(d), bytesOf(s))
	}
}

func BenchmarkIntoBF16Sum(b *testing.B) {
	d, s := make([]comm.BF16, 1<<20), make([]comm.BF16, 1<<20)
	b.SetBytes(int64(len(d) * 2))
	for b.Loop() {
		reduce.Into(comm.BFloat16, comm.Sum, bytesOf(d), bytesOf(s))
	}
}

// The inlined bf16 kernel agrees with the reference conversion for every
// pair drawn from a spread of values, NaN and Inf included.
func TestBF16KernelMatchesReference(t *testing.T) {
	var vals []comm.BF16
	for i := 0; i < 1<<16; i += 97 {
		vals = append(vals, comm.BF16(i))
	}
	for _, op := range []comm.ReduceOp{comm.Sum, comm.Prod, comm.Min, comm.Max} {
		d := make([]comm.BF16, 0, len(vals)*len(vals)/64)
		s := make([]comm.BF16, 0, cap(d))
		for i, a := range vals {
			for j := i % 64; j < len(vals); j += 64 {
				d, s = append(d, a), append(s, vals[j])
			}
		}
		want := make([]comm.BF16, len(d))
		for i := range d {
			a, b := d[i].Float32(), s[i].Float32()
			var r float32
			switch op {
			case comm.Sum:
				r = a + b
			case comm.Prod:
				r = a * b
			case comm.Min:
				r = min(a, b)
			case comm.Max:
				r = max(a, b)
			}
			want[i] = comm.NewBF16(r)
		}
		reduce.Into(comm.BFloat16, op, bytesOf(d), bytesOf(s))
		for i := range d {
			if d[i] != want[i] && !(math.IsNaN(float64(d[i].Float32())) && math.IsNaN(float64(want[i].Float32()))) {
				t.Fatalf("%s element %d: %#04x, want %#04x", op, i, d[i], want[i])
			}
		}
	}
}
