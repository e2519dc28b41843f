package reduce

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/ftcomm/ftcomm/comm"
)

// TestInto3MatchesInto checks the fused kernel against copy + Into for
// every dtype and op, including dst aliasing a.
func TestInto3MatchesInto(t *testing.T) {
	for dt := comm.Float32; dt <= comm.Int64; dt++ {
		for op := comm.Sum; op <= comm.Avg; op++ {
			if !op.Supports(dt) {
				continue
			}
			n := 37 * dt.Size()
			a, b := make([]byte, n), make([]byte, n)
			for i := range a {
				a[i], b[i] = byte(i*7+3), byte(i*5+1)
			}
			if dt == comm.Float32 || dt == comm.Float64 || dt == comm.Float16 || dt == comm.BFloat16 {
				fillSmall(dt, a, 1)
				fillSmall(dt, b, 2)
			}
			want := bytes.Clone(a)
			Into(dt, op, want, b)
			got := make([]byte, n)
			Into3(dt, op, got, a, b)
			if !bytes.Equal(got, want) {
				t.Errorf("%s %s: Into3 differs from Into", dt, op)
			}
			alias := bytes.Clone(a)
			Into3(dt, op, alias, alias, b)
			if !bytes.Equal(alias, want) {
				t.Errorf("%s %s: Into3 with dst == a differs from Into", dt, op)
			}
		}
	}
}

func fillSmall(dt comm.DType, buf []byte, seed int) {
	for i := 0; i < len(buf)/dt.Size(); i++ {
		v := float32((i*seed)%9 - 4)
		switch dt {
		case comm.Float32:
			*(*float32)(unsafe.Pointer(&buf[i*4])) = v
		case comm.Float64:
			*(*float64)(unsafe.Pointer(&buf[i*8])) = float64(v)
		case comm.Float16:
			*(*comm.F16)(unsafe.Pointer(&buf[i*2])) = comm.NewF16(v)
		case comm.BFloat16:
			*(*comm.BF16)(unsafe.Pointer(&buf[i*2])) = comm.NewBF16(v)
		}
	}
}

// TestIntoMatchesNaive checks the unrolled kernels against a plain loop for
// lengths around the unroll width, every integer and float type and op.
func TestIntoMatchesNaive(t *testing.T) {
	for _, n := range []int{0, 1, 7, 8, 9, 16, 23, 100} {
		for op := comm.Sum; op <= comm.Max; op++ {
			d, s := make([]float64, n), make([]float64, n)
			di, si := make([]int32, n), make([]int32, n)
			for i := range n {
				d[i], s[i] = float64(i%5-2), float64(i%7-3)
				di[i], si[i] = int32(i*3-7), int32(11-i)
			}
			want, wanti := make([]float64, n), make([]int32, n)
			for i := range n {
				switch op {
				case comm.Sum:
					want[i], wanti[i] = d[i]+s[i], di[i]+si[i]
				case comm.Prod:
					want[i], wanti[i] = d[i]*s[i], di[i]*si[i]
				case comm.Min:
					want[i], wanti[i] = min(d[i], s[i]), min(di[i], si[i])
				case comm.Max:
					want[i], wanti[i] = max(d[i], s[i]), max(di[i], si[i])
				}
			}
			got3, got3i := make([]float64, n), make([]int32, n)
			apply3(op, got3, d, s)
			apply3(op, got3i, di, si)
			apply(op, d, s)
			apply(op, di, si)
			for i := range n {
				if d[i] != want[i] || got3[i] != want[i] || di[i] != wanti[i] || got3i[i] != wanti[i] {
					t.Fatalf("n=%d %s: element %d: into %v/%v into3 %v/%v want %v/%v", n, op, i, d[i], di[i], got3[i], got3i[i], want[i], wanti[i])
				}
			}
		}
	}
}

func BenchmarkIntoFloat32Sum(b *testing.B) {
	d, s := make([]byte, 256<<10), make([]byte, 256<<10)
	b.SetBytes(int64(len(d)))
	for range b.N {
		Into(comm.Float32, comm.Sum, d, s)
	}
}
