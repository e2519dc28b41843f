package comm_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
)

// Every validation error is ErrInvalidArgument naming the argument, is
// returned before the backend sees anything, and leaves the comm usable.
func TestValidation(t *testing.T) {
	f := newFake(1, 4) // rank 1 of 4
	c := newComm(t, f, comm.Options{})
	ctx := context.Background()
	f32 := func(n int) comm.Tensor { return comm.Float32s(make([]float32, n)) }
	buf := make([]float32, 8)
	i32 := comm.Int32s(make([]int32, 4))
	dev := comm.DeviceTensor(0x1000, 0, 4, comm.Float32)

	cases := []struct {
		name string
		run  func() error
		want string
	}{
		{"zero tensor", func() error { return c.AllReduce(ctx, comm.Tensor{}, comm.Sum) }, "tensor: no tensor"},
		{"bad dtype", func() error { return c.AllReduce(ctx, comm.HostBytes(0, make([]byte, 4)), comm.Sum) }, "invalid dtype"},
		{"ragged bytes", func() error { return c.AllReduce(ctx, comm.HostBytes(comm.Float64, make([]byte, 12)), comm.Sum) }, "not a whole number"},
		{"nil device ptr", func() error { return c.AllReduce(ctx, comm.DeviceTensor(0, 0, 4, comm.Float32), comm.Sum) }, "nil device pointer"},
		{"device to host backend", func() error { return c.AllReduce(ctx, dev, comm.Sum) }, "device tensor given to a host-memory backend"},
		{"bad reduce op", func() error { return c.AllReduce(ctx, f32(2), 0) }, "reduce op reduceop(0) is not defined"},
		{"bitwise on floats", func() error { return c.AllReduce(ctx, f32(2), comm.BOr) }, "bor is not supported for dtype float32"},
		{"reducescatterv counts", func() error { return c.ReduceScatterV(ctx, f32(2), f32(7), []int{1, 3, 2, 1}, comm.Sum) }, "counts[1] = 3 but out has 2 elements"},
		{"reducescatterv sum", func() error { return c.ReduceScatterV(ctx, f32(1), f32(7), []int{2, 1, 3, 2}, comm.Sum) }, "in has 7 elements, want sum(counts) = 8"},
		{"reducescatterv ranks", func() error { return c.ReduceScatterV(ctx, f32(1), f32(3), []int{1, 2}, comm.Sum) }, "counts has 2 entries, want one per rank (4)"},
		{"reduce root", func() error { return c.Reduce(ctx, f32(2), comm.Sum, 4) }, "root 4 outside [0, 4)"},
		{"broadcast root", func() error { return c.Broadcast(ctx, f32(2), -1) }, "root -1 outside"},
		{"reducescatter sizes", func() error { return c.ReduceScatter(ctx, f32(2), f32(7), comm.Sum) }, "in has 7 elements, want out's 2 × size 4 = 8"},
		{"reducescatter dtypes", func() error { return c.ReduceScatter(ctx, f32(1), i32, comm.Sum) }, "out dtype float32 differs from in dtype int32"},
		{"overlap", func() error {
			return c.AllGather(ctx, comm.Float32s(buf), comm.Float32s(buf[1:3]))
		}, "out and in overlap"},
		{"overlap, another rank's block", func() error {
			return c.ReduceScatter(ctx, comm.Float32s(buf[4:6]), comm.Float32s(buf), comm.Sum)
		}, "out and in overlap"},
		{"allgather sizes", func() error { return c.AllGather(ctx, f32(7), f32(2)) }, "out has 7 elements, want in's 2 × size 4 = 8"},
		{"allgatherv len", func() error { return c.AllGatherV(ctx, f32(3), f32(1), []int{1, 1, 1}) }, "counts has 3 entries, want one per rank (4)"},
		{"allgatherv negative", func() error { return c.AllGatherV(ctx, f32(3), f32(1), []int{3, 1, -1, 0}) }, "counts[2] = -1 is negative"},
		{"allgatherv own count", func() error { return c.AllGatherV(ctx, f32(4), f32(1), []int{1, 2, 1, 0}) }, "counts[1] = 2 but in has 1"},
		{"allgatherv sum", func() error { return c.AllGatherV(ctx, f32(5), f32(1), []int{1, 1, 1, 1}) }, "want sum(counts) = 4"},
		{"scatter root sizes", func() error { return c.Scatter(ctx, f32(2), f32(7), 1) }, "in has 7 elements, want out's 2 × size 4 = 8"},
		{"scatter nonroot out", func() error { return c.Scatter(ctx, comm.Tensor{}, comm.Tensor{}, 0) }, "out: no tensor"},
		{"gather root sizes", func() error { return c.Gather(ctx, f32(3), f32(1), 1) }, "out has 3 elements, want in's 1 × size 4 = 4"},
		{"gather root", func() error { return c.Gather(ctx, f32(4), f32(1), 9) }, "root 9 outside"},
		{"alltoall unequal", func() error { return c.AllToAll(ctx, f32(8), f32(4)) }, "out has 8 elements, in has 4"},
		{"alltoall divisible", func() error { return c.AllToAll(ctx, f32(6), f32(6)) }, "not divisible by size 4"},
		{"alltoallv out sum", func() error {
			return c.AllToAllV(ctx, f32(3), []int{1, 1, 1, 1}, f32(4), []int{1, 1, 1, 1})
		}, "want sum(outCounts) = 4"},
		{"alltoallv in len", func() error {
			return c.AllToAllV(ctx, f32(4), []int{1, 1, 1, 1}, f32(4), []int{4})
		}, "inCounts has 1 entries"},
		{"send self", func() error { return c.Send(ctx, f32(1), 1) }, "peer 1 is this rank"},
		{"recv range", func() error { return c.Recv(ctx, f32(1), 4) }, "peer 4 outside [0, 4)"},
		{"empty batch", func() error { return c.BatchP2P(ctx, nil) }, "batch is empty"},
		{"batch kind", func() error { return c.BatchP2P(ctx, []comm.P2POp{{Kind: 9, Tensor: f32(1), Peer: 0}}) }, "batch[0]: kind 9"},
		{"batch peer", func() error {
			return c.BatchP2P(ctx, []comm.P2POp{{Kind: comm.P2PSend, Tensor: f32(1), Peer: 0}, {Kind: comm.P2PRecv, Tensor: f32(1), Peer: 7}})
		}, "batch[1]: comm: invalid argument: peer 7 outside"},
		{"batch recv aliasing", func() error {
			x := comm.Float32s(buf[:2])
			return c.BatchP2P(ctx, []comm.P2POp{{Kind: comm.P2PSend, Tensor: x, Peer: 0}, {Kind: comm.P2PRecv, Tensor: x, Peer: 2}})
		}, "batch[1] receives into memory that batch[0] also uses"},
		{"grow smaller", func() error { _, err := c.Grow(ctx, 4, 1); return err }, "new size 4 is not larger than 4"},
		{"split color", func() error { _, err := c.Split(ctx, -2, 0); return err }, "color -2 is negative"},
		{"async too", func() error { return c.AllReduceAsync(ctx, comm.Tensor{}, comm.Sum).Err() }, "tensor: no tensor"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.run()
			if !errors.Is(err, comm.ErrInvalidArgument) {
				t.Fatalf("err = %v, want ErrInvalidArgument", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %q, want it to contain %q", err, tc.want)
			}
		})
	}
	if n := len(f.ops()); n != 0 {
		t.Fatalf("the backend saw %d invalid ops", n)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("comm broken by invalid arguments: %v", err)
	}
	// The root-side buffer is ignored off root.
	if err := c.Scatter(ctx, f32(2), comm.Tensor{}, 0); err != nil {
		t.Fatal(err)
	}
	if err := c.Gather(ctx, comm.Tensor{}, f32(2), 0); err != nil {
		t.Fatal(err)
	}
	// In place, as NCCL allows and FSDP2 does: in is this rank's block of
	// out (all-gather), out is this rank's block of in (reduce-scatter).
	if err := c.AllGather(ctx, comm.Float32s(buf), comm.Float32s(buf[2:4])); err != nil {
		t.Fatalf("in-place all-gather: %v", err)
	}
	if err := c.ReduceScatter(ctx, comm.Float32s(buf[2:4]), comm.Float32s(buf), comm.Sum); err != nil {
		t.Fatalf("in-place reduce-scatter: %v", err)
	}
}

func TestOptionsValidate(t *testing.T) {
	for _, tc := range []struct {
		o    comm.Options
		want string
	}{
		{comm.Options{Size: 0}, "size 0 < 1"},
		{comm.Options{Size: 2, Rank: 2}, "rank 2 outside [0, 2)"},
		{comm.Options{Size: 2, Rank: 1}, "needs a Store"},
		{comm.Options{Size: 1, FlightRecorder: -1}, "negative flight recorder"},
		{comm.Options{Size: 1, Device: -1}, "negative device"},
		{comm.Options{Size: 1, Name: "a/b"}, "contains '/'"},
	} {
		err := tc.o.Validate()
		if !errors.Is(err, comm.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.o, err, tc.want)
		}
	}
	if err := (&comm.Options{Size: 1}).Validate(); err != nil {
		t.Fatal(err)
	}
}
