package comm_test

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
)

func TestDTypeNamesAndSizes(t *testing.T) {
	want := map[comm.DType]struct {
		name string
		size int
	}{
		comm.Float32: {"float32", 4}, comm.Float64: {"float64", 8}, comm.Float16: {"float16", 2},
		comm.BFloat16: {"bfloat16", 2}, comm.Int8: {"int8", 1}, comm.Uint8: {"uint8", 1},
		comm.Int32: {"int32", 4}, comm.Int64: {"int64", 8},
	}
	for d, w := range want {
		if d.String() != w.name || d.Size() != w.size {
			t.Errorf("%d: %s/%d, want %s/%d", d, d, d.Size(), w.name, w.size)
		}
		p, err := comm.ParseDType(w.name)
		if err != nil || p != d {
			t.Errorf("ParseDType(%q) = %v, %v", w.name, p, err)
		}
	}
	for s, d := range map[string]comm.DType{"fp16": comm.Float16, "BF16": comm.BFloat16, " half ": comm.Float16, "double": comm.Float64, "f32": comm.Float32} {
		if p, err := comm.ParseDType(s); err != nil || p != d {
			t.Errorf("ParseDType(%q) = %v, %v", s, p, err)
		}
	}
	if _, err := comm.ParseDType("complex64"); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("unknown dtype: %v", err)
	}
	if comm.DType(0).Valid() || comm.DType(0).Size() != 0 || comm.DType(99).String() != "dtype(99)" {
		t.Error("invalid dtypes must say so")
	}
	for _, s := range []string{"sum", "prod", "min", "max", "avg", "band", "bor", "bxor"} {
		o, err := comm.ParseReduceOp(s)
		if err != nil || o.String() != s {
			t.Errorf("ParseReduceOp(%q) = %v, %v", s, o, err)
		}
	}
	if _, err := comm.ParseReduceOp("premul_sum"); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Error(err)
	}
	if !comm.Avg.Supports(comm.Int32) || !comm.Avg.Supports(comm.BFloat16) || !comm.Max.Supports(comm.Uint8) ||
		comm.BAnd.Supports(comm.Float32) || !comm.BXor.Supports(comm.Int8) {
		t.Error("Supports table wrong")
	}
}

// Every binary16 value converts to float32 exactly and back unchanged.
func TestF16RoundTripExhaustive(t *testing.T) {
	for i := range 1 << 16 {
		h := comm.F16(i)
		f := h.Float32()
		if math.IsNaN(float64(f)) {
			if !math.IsNaN(float64(comm.NewF16(f).Float32())) {
				t.Fatalf("%#04x: NaN lost", i)
			}
			continue
		}
		if back := comm.NewF16(f); back != h {
			t.Fatalf("%#04x -> %g -> %#04x", i, f, back)
		}
	}
}

func TestBF16RoundTripExhaustive(t *testing.T) {
	for i := range 1 << 16 {
		h := comm.BF16(i)
		f := h.Float32()
		if math.IsNaN(float64(f)) {
			if !math.IsNaN(float64(comm.NewBF16(f).Float32())) {
				t.Fatalf("%#04x: NaN lost", i)
			}
			continue
		}
		if back := comm.NewBF16(f); back != h {
			t.Fatalf("%#04x -> %g -> %#04x", i, f, back)
		}
	}
}

// Rounding is to nearest, ties to even: checked against the two neighbours
// of the result, for random floats, halfway points and overflow.
func TestHalfRounding(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	check := func(name string, f float32, got uint16, val func(uint16) float32, maxFinite float64) {
		t.Helper()
		g := float64(val(got))
		x := float64(f)
		if math.Abs(x) > maxFinite {
			// beyond the largest finite value: Inf only if past the halfway point to the next binade step
			return
		}
		for _, n := range []uint16{got - 1, got + 1} {
			nv := float64(val(n))
			if math.IsNaN(nv) || math.IsInf(nv, 0) || (nv < 0) != (g < 0) && g != 0 {
				continue
			}
			dg, dn := math.Abs(x-g), math.Abs(x-nv)
			if dn < dg || (dn == dg && got&1 == 1) {
				t.Fatalf("%s(%g) = %g (%#04x), but %g (%#04x) is nearer or an even tie", name, f, g, got, nv, n)
			}
		}
	}
	f16 := func(h uint16) float32 { return comm.F16(h).Float32() }
	bf16 := func(h uint16) float32 { return comm.BF16(h).Float32() }
	var inputs []float32
	for range 200000 {
		inputs = append(inputs, math.Float32frombits(r.Uint32()))
		inputs = append(inputs, float32(r.NormFloat64()*1000))
		inputs = append(inputs, float32(r.NormFloat64()*1e-6)) // fp16 subnormal range
	}
	for i := range 1 << 16 { // exact halfway points between adjacent values
		a, b := comm.F16(i).Float32(), comm.F16(i+1).Float32()
		if !math.IsNaN(float64(a)) && !math.IsNaN(float64(b)) && !math.IsInf(float64(b), 0) {
			inputs = append(inputs, (a+b)/2)
		}
	}
	for _, f := range inputs {
		if math.IsNaN(float64(f)) {
			continue
		}
		check("NewF16", f, uint16(comm.NewF16(f)), f16, 65504)
		check("NewBF16", f, uint16(comm.NewBF16(f)), bf16, float64(comm.BF16(0x7f7f).Float32()))
	}
	if !math.IsInf(float64(comm.NewF16(70000).Float32()), 1) || !math.IsInf(float64(comm.NewF16(-1e9).Float32()), -1) {
		t.Error("fp16 overflow must give Inf")
	}
	if comm.NewF16(65519).Float32() != 65504 || !math.IsInf(float64(comm.NewF16(65520).Float32()), 1) {
		t.Error("fp16 rounding at the top of the range")
	}
	if comm.NewF16(1e-8) != 0 || comm.NewF16(-1e-8) != 0x8000 {
		t.Error("fp16 underflow keeps the sign")
	}
}

func TestTensorViews(t *testing.T) {
	x := []float32{1, 2, 3, 4, 5}
	tt := comm.Float32s(x)
	if tt.Count() != 5 || tt.NumBytes() != 20 || tt.IsDevice() || tt.Device() != -1 || tt.DType() != comm.Float32 {
		t.Fatal(tt)
	}
	s := tt.Slice(1, 3)
	s.AsFloat32s()[0] = 20
	if x[1] != 20 || s.Count() != 3 || len(s.Bytes()) != 12 {
		t.Fatal("slice does not alias", x)
	}
	if tt.AsInt32s() != nil {
		t.Fatal("view of the wrong dtype must be nil")
	}
	d := comm.DeviceTensor(0x1000, 1, 8, comm.BFloat16)
	if !d.IsDevice() || d.Bytes() != nil || d.Slice(2, 2).Ptr() != 0x1004 {
		t.Fatal(d)
	}
	if !(comm.Tensor{}).IsZero() || comm.Float32s(nil).IsZero() {
		t.Fatal("IsZero")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("out-of-range Slice must panic like a slice expression")
		}
	}()
	tt.Slice(4, 2)
}
