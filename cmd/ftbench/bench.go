package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// rankRow is one rank's measurement of one row; the launcher combines the
// ranks' rows into a Row (slowest time, summed #wrong).
type rankRow struct {
	Index int     `json:"index"`
	Op    string  `json:"op"`
	DType string  `json:"dtype"`
	RedOp string  `json:"redop"` // "none" for ops that do not reduce
	Root  int     `json:"root"`  // -1 for ops without a root
	Bytes int64   `json:"bytes"`
	Count int     `json:"count"`
	Usec  float64 `json:"usec"` // this rank's mean time per timed iteration
	Wrong int64   `json:"wrong"`
}

// bench runs the plan of one rank over an established communicator.
type bench struct {
	cfg   Config
	c     *comm.Comm
	dev   deviceMemory // nil for host-memory backends
	raw   *rawRing     // nil without the baseline
	emit  func(rankRow) error
	alive func() // called after every op; the worker turns it into heartbeats
}

// run executes every row of the plan, in the same order on every rank.
func (b *bench) run(ctx context.Context) error {
	plan := b.cfg.plan()
	rs := rawSeries(plan)
	sizes := b.cfg.Sizes()
	n := b.c.Size()
	idx := 0
	for si, s := range plan {
		var maxCount int
		for _, req := range sizes {
			maxCount = max(maxCount, geometryOf(s.Op, req, s.DType, n).Count)
		}
		bufs, err := b.alloc(s, maxCount)
		if err != nil {
			return err
		}
		for _, req := range sizes {
			g := geometryOf(s.Op, req, s.DType, n)
			if g.Count == 0 {
				continue // smaller than one element (per rank): nothing to move
			}
			row, err := b.row(ctx, s, g, bufs)
			if err != nil {
				bufs.free()
				return err
			}
			row.Index = idx
			idx++
			if err := b.emit(row); err != nil {
				bufs.free()
				return err
			}
			if b.raw != nil && si == rs {
				usec, wrong, err := b.raw.run(ctx, g.Bytes, b.cfg.Warmup, b.cfg.Iters, b.c.Barrier, b.alive)
				if err != nil {
					bufs.free()
					return err
				}
				if err := b.emit(rankRow{Index: idx, Op: rawOp, DType: "uint8", RedOp: "none", Root: -1,
					Bytes: g.Bytes, Count: int(perRankBytes(g.Bytes, n)), Usec: usec, Wrong: wrong}); err != nil {
					bufs.free()
					return err
				}
				idx++
			}
		}
		if err := bufs.free(); err != nil {
			return err
		}
	}
	return nil
}

// seriesBufs are the two buffers of a series: out (the in-place tensor or
// the output) and in (the input of out-of-place ops).
type seriesBufs struct{ out, in *buffer }

func (sb seriesBufs) free() error {
	var errs []error
	for _, b := range []*buffer{sb.out, sb.in} {
		if b != nil {
			errs = append(errs, b.free())
		}
	}
	return errors.Join(errs...)
}

// bufCounts gives the element counts of out and in for block count c.
func bufCounts(op string, c, n int) (out, in int) {
	switch op {
	case "allgather":
		return n * c, c
	case "reducescatter":
		return c, n * c
	case "alltoall":
		return n * c, n * c
	case "sendrecv":
		return c, c
	}
	return c, 0 // in place
}

func (b *bench) alloc(s combo, maxCount int) (seriesBufs, error) {
	outN, inN := bufCounts(s.Op.name, maxCount, b.c.Size())
	e := s.DType.Size()
	var sb seriesBufs
	var err error
	if sb.out, err = newBuffer(outN*e, b.dev, b.c.Rank()); err != nil {
		return sb, err
	}
	if inN > 0 {
		if sb.in, err = newBuffer(inN*e, b.dev, b.c.Rank()); err != nil {
			sb.free()
			return seriesBufs{}, err
		}
	}
	return sb, nil
}

// poisonOf is what output elements hold before the checked op: -1 (255
// for uint8), which no input and no expected value is unless integer
// wrapping makes it so, so an element the op forgot is counted as wrong.
func poisonOf(dt comm.DType) float64 {
	if dt == comm.Uint8 {
		return 255
	}
	return -1
}

// row measures one size: a checked op on fresh data, warm-up, barrier,
// timed iterations.
func (b *bench) row(ctx context.Context, s combo, g geometry, sb seriesBufs) (rankRow, error) {
	rank, n := b.c.Rank(), b.c.Size()
	c, dt := g.Count, s.DType
	e := dt.Size()
	ds := newDataset(dt, s.Red, n)
	left, right := (rank+n-1)%n, (rank+1)%n
	outN, inN := bufCounts(s.Op.name, c, n)
	out := sb.out.tensor(dt, outN)
	var in comm.Tensor
	if inN > 0 {
		in = sb.in.tensor(dt, inN)
	}
	row := rankRow{Op: s.Op.name, DType: dt.String(), RedOp: "none", Root: -1, Bytes: g.Bytes, Count: c}
	if s.Op.reduces {
		row.RedOp = s.Red.String()
	}
	if s.Op.rooted {
		row.Root = b.cfg.Root
	}
	root := b.cfg.Root

	// Inputs and the expected output of the checked op.
	mine := func(i int) float64 { return ds.input(rank, i) }
	var want func(i int) float64
	switch s.Op.name {
	case "allreduce":
		want = ds.reduced
	case "reduce":
		want = mine
		if rank == root {
			want = ds.reduced
		}
	case "broadcast":
		want = func(i int) float64 { return ds.input(root, i) }
	case "allgather":
		want = func(i int) float64 { return ds.input(i/c, i%c) }
	case "reducescatter":
		want = func(i int) float64 { return ds.reduced(rank*c + i) }
	case "alltoall":
		want = func(i int) float64 { return ds.input(i/c, rank*c+i%c) }
	case "sendrecv":
		want = func(i int) float64 { return ds.input(left, i) }
	default:
		return row, fmt.Errorf("ftbench: op %s has no checker", s.Op.name)
	}
	p2p := []comm.P2POp{{Kind: comm.P2PSend, Tensor: in, Peer: right}, {Kind: comm.P2PRecv, Tensor: out, Peer: left}}
	runOp := func() error {
		switch s.Op.name {
		case "allreduce":
			return b.c.AllReduce(ctx, out, s.Red)
		case "reduce":
			return b.c.Reduce(ctx, out, s.Red, root)
		case "broadcast":
			return b.c.Broadcast(ctx, out, root)
		case "allgather":
			return b.c.AllGather(ctx, out, in)
		case "reducescatter":
			return b.c.ReduceScatter(ctx, out, in, s.Red)
		case "alltoall":
			return b.c.AllToAll(ctx, out, in)
		default: // sendrecv
			return b.c.BatchP2P(ctx, p2p)
		}
	}
	// runAsync issues the op without waiting for it (-async).
	runAsync := func() *comm.Work {
		switch s.Op.name {
		case "allreduce":
			return b.c.AllReduceAsync(ctx, out, s.Red)
		case "reduce":
			return b.c.ReduceAsync(ctx, out, s.Red, root)
		case "broadcast":
			return b.c.BroadcastAsync(ctx, out, root)
		case "allgather":
			return b.c.AllGatherAsync(ctx, out, in)
		case "reducescatter":
			return b.c.ReduceScatterAsync(ctx, out, in, s.Red)
		case "alltoall":
			return b.c.AllToAllAsync(ctx, out, in)
		default: // sendrecv
			return b.c.BatchP2PAsync(ctx, p2p)
		}
	}
	// repeat runs the op k times: one after another, or, with -async, all
	// issued back to back and then waited for (as nccl-tests times them).
	works := make([]*comm.Work, 0, max(b.cfg.Iters, b.cfg.Warmup))
	repeat := func(k int) error {
		if !b.cfg.Async {
			for range k {
				if err := runOp(); err != nil {
					return err
				}
				b.alive()
			}
			return nil
		}
		works = works[:0]
		for range k {
			works = append(works, runAsync())
		}
		var first error
		for _, w := range works {
			if err := w.Wait(ctx); err != nil && first == nil {
				first = err
			}
		}
		b.alive()
		return first
	}
	fail := func(phase string, err error) (rankRow, error) {
		return row, fmt.Errorf("ftbench: rank %d: %s %s %s %d bytes (%s): %w", rank, s.Op.name, dt, row.RedOp, g.Bytes, phase, err)
	}

	// The checked op, on fresh data.
	if inN > 0 {
		fill(dt, sb.in.bytes(inN*e), mine)
		fill(dt, sb.out.bytes(outN*e), func(int) float64 { return poisonOf(dt) })
		if err := sb.in.upload(inN * e); err != nil {
			return fail("upload", err)
		}
	} else {
		fill(dt, sb.out.bytes(outN*e), mine)
	}
	if err := sb.out.upload(outN * e); err != nil {
		return fail("upload", err)
	}
	if err := runOp(); err != nil {
		return fail("checked op", err)
	}
	b.alive()
	if err := sb.out.download(outN * e); err != nil {
		return fail("download", err)
	}
	row.Wrong = countWrong(dt, sb.out.bytes(outN*e), want, ds.tolerance)

	// Warm-up and timed iterations. In-place ops keep reducing their own
	// output; the values may grow (to Inf, or wrap) but never become
	// subnormal, so the time does not depend on them.
	if err := repeat(b.cfg.Warmup); err != nil {
		return fail("warm-up", err)
	}
	if err := b.c.Barrier(ctx); err != nil {
		return fail("barrier", err)
	}
	t0 := time.Now()
	if err := repeat(b.cfg.Iters); err != nil {
		return fail("timed op", err)
	}
	row.Usec = float64(time.Since(t0).Nanoseconds()) / 1e3 / float64(b.cfg.Iters)
	return row, nil
}
