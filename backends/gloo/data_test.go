package gloo

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

var allDTypes = []comm.DType{comm.Float32, comm.Float64, comm.BFloat16, comm.Float16, comm.Int32, comm.Int8, comm.Uint8, comm.Int64}
var allOps = []comm.ReduceOp{comm.Sum, comm.Prod, comm.Min, comm.Max, comm.Avg, comm.BAnd, comm.BOr, comm.BXor}

// put stores v (an exactly representable small number) as element i of buf.
func put(dt comm.DType, buf []byte, i int, v float64) {
	switch dt {
	case comm.Float32:
		binary.LittleEndian.PutUint32(buf[4*i:], math.Float32bits(float32(v)))
	case comm.Float64:
		binary.LittleEndian.PutUint64(buf[8*i:], math.Float64bits(v))
	case comm.Float16:
		binary.LittleEndian.PutUint16(buf[2*i:], uint16(comm.NewF16(float32(v))))
	case comm.BFloat16:
		binary.LittleEndian.PutUint16(buf[2*i:], uint16(comm.NewBF16(float32(v))))
	case comm.Int8:
		buf[i] = byte(int8(v))
	case comm.Uint8:
		buf[i] = byte(uint8(v))
	case comm.Int32:
		binary.LittleEndian.PutUint32(buf[4*i:], uint32(int32(v)))
	case comm.Int64:
		binary.LittleEndian.PutUint64(buf[8*i:], uint64(int64(v)))
	}
}

// value is rank r's element i for reduce op op: small integers whose sums
// and products are exact in every dtype and every order (|prod| ≤ 2^8).
func value(dt comm.DType, op comm.ReduceOp, r, i, salt int) float64 {
	h := (r*131 + i*17 + salt*7) % 9
	if op == comm.Prod {
		return [...]float64{1, 2, -1, 1, -1, 1, 2, 1, -1}[h]
	}
	if dt == comm.Uint8 {
		return float64(h)
	}
	return float64(h - 4)
}

// input makes rank r's buffer of count elements.
func input(dt comm.DType, op comm.ReduceOp, r, count, salt int) []byte {
	b := make([]byte, count*dt.Size())
	for i := range count {
		put(dt, b, i, value(dt, op, r, i, salt))
	}
	return b
}

// tensor views raw bytes as a Tensor of dt.
func tensor(dt comm.DType, b []byte) comm.Tensor {
	if b == nil {
		b = []byte{}
	}
	return comm.HostBytes(dt, b)
}

// refReduce reduces the inputs in rank order, as comm/inproc does.
func refReduce(dt comm.DType, op comm.ReduceOp, in [][]byte) []byte {
	acc := bytes.Clone(in[0])
	if acc == nil {
		acc = []byte{}
	}
	for _, x := range in[1:] {
		reduce.Into(dt, op, acc, x)
	}
	if op == comm.Avg {
		reduce.Divide(dt, acc, len(in))
	}
	return acc
}

// sentinel fills an output buffer with a pattern no result has.
func sentinel(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = 0xEE
	}
	return b
}

func diff(got, want []byte) error {
	if bytes.Equal(got, want) {
		return nil
	}
	if len(got) != len(want) {
		return fmt.Errorf("%d bytes, want %d", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			return fmt.Errorf("first difference at byte %d: got %#02x want %#02x", i, got[i], want[i])
		}
	}
	return nil
}
