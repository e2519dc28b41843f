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
