package main

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// runInProcess runs the benchmark loop of n ranks as goroutines over the
// inproc reference backend (the raw baseline still uses real loopback TCP)
// and returns the combined rows. wrap may decorate each rank's backend.
func runInProcess(t *testing.T, cfg Config, wrap func(comm.Backend) comm.Backend) []Row {
	t.Helper()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	n := cfg.NP
	cl := inproc.NewCluster()
	store := memstore.New()
	defer store.Close()
	perRank := make([][]rankRow, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = func() error {
				be, err := cl.Join(ctx, "comm/ftbench", 1, r, n)
				if err != nil {
					return err
				}
				var b comm.Backend = be
				if wrap != nil {
					b = wrap(b)
				}
				c, err := comm.Wrap(b, comm.Options{Name: "ftbench", Timeout: 30 * time.Second})
				if err != nil {
					return err
				}
				defer c.Close()
				bn := &bench{cfg: cfg, c: c, alive: func() {}, emit: func(row rankRow) error {
					perRank[r] = append(perRank[r], row)
					return nil
				}}
				if cfg.Raw {
					raw, err := newRawRing(ctx, store, r, n, []byte("secret"), cfg.RawBuf, 10*time.Second)
					if err != nil {
						return err
					}
					defer raw.Close()
					bn.raw = raw
				}
				return bn.run(ctx)
			}()
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	var rows []Row
	for i := range perRank[0] {
		rs := make([]rankRow, n)
		for r := range n {
			if len(perRank[r]) != len(perRank[0]) {
				t.Fatalf("rank %d reported %d rows, rank 0 %d", r, len(perRank[r]), len(perRank[0]))
			}
			rs[r] = perRank[r][i]
		}
		row, err := combine(rs, cfg.Average)
		if err != nil {
			t.Fatal(err)
		}
		if rs[0].Index != i {
			t.Fatalf("row %d has index %d", i, rs[0].Index)
		}
		rows = append(rows, row)
	}
	return rows
}

// Every op, dtype and reduction, over 3 ranks (odd, so avg divides by a
// non-power of two): all results check out, and the rows are the plan.
func TestBenchEveryCollectiveChecksOut(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NP = 3
	cfg.Ops, cfg.DTypes, cfg.RedOps = opNames(), allDTypes(), allRedOps()
	cfg.MinSize, cfg.MaxSize, cfg.Factor = 4, 4096, 8
	cfg.Warmup, cfg.Iters = 1, 2
	rows := runInProcess(t, cfg, nil)
	want := 0
	for _, s := range cfg.plan() {
		for _, req := range cfg.Sizes() {
			if geometryOf(s.Op, req, s.DType, cfg.NP).Count > 0 {
				want++
				if s.Op.name == "allreduce" && s.DType == comm.Float32 && s.Red == comm.Sum {
					want++ // the raw baseline row after it
				}
			}
		}
	}
	if len(rows) != want {
		t.Fatalf("%d rows, want %d", len(rows), want)
	}
	seen := map[string]bool{}
	raws := 0
	for _, r := range rows {
		if r.Wrong != 0 {
			t.Errorf("%s %s %s %d B: %d wrong", r.Op, r.DType, r.RedOp, r.Bytes, r.Wrong)
		}
		if r.Usec <= 0 || r.BusBW <= 0 {
			t.Errorf("%s %d B: time %v busbw %v", r.Op, r.Bytes, r.Usec, r.BusBW)
		}
		seen[r.Op] = true
		if r.Op == rawOp {
			raws++
		}
	}
	for _, o := range append(opNames(), rawOp) {
		if !seen[o] {
			t.Errorf("no %s rows", o)
		}
	}
	if raws != len(cfg.Sizes()) {
		t.Errorf("%d raw baseline rows, want one per size (%d)", raws, len(cfg.Sizes()))
	}
}

// corruptAllReduce wraps a backend and breaks element 3 of every allreduce
// result on rank 1.
type corruptAllReduce struct{ comm.Backend }

func (c corruptAllReduce) AllReduce(ctx context.Context, t comm.Tensor, op comm.ReduceOp) error {
	err := c.Backend.AllReduce(ctx, t, op)
	if s := t.AsFloat32s(); c.Rank() == 1 && len(s) > 3 {
		s[3] += 0.5
	}
	return err
}

// skipBroadcast wraps a backend whose broadcast never writes off root.
type skipBroadcast struct{ comm.Backend }

func (c skipBroadcast) Broadcast(ctx context.Context, t comm.Tensor, root int) error {
	if c.Rank() == root {
		return c.Backend.Broadcast(ctx, t, root)
	}
	tmp := make([]byte, t.NumBytes())
	return c.Backend.Broadcast(ctx, comm.HostBytes(t.DType(), tmp), root)
}

func TestBenchCountsWrongResults(t *testing.T) {
	cfg := DefaultConfig()
	cfg.MinSize, cfg.MaxSize, cfg.Factor = 8, 1024, 4
	cfg.Warmup, cfg.Iters, cfg.Raw = 0, 1, false
	rows := runInProcess(t, cfg, func(b comm.Backend) comm.Backend { return corruptAllReduce{b} })
	if len(rows) != len(cfg.Sizes()) {
		t.Fatalf("%d rows, want %d", len(rows), len(cfg.Sizes()))
	}
	for _, r := range rows {
		want := int64(0)
		if r.Count > 3 {
			want = 1
		}
		if r.Wrong != want {
			t.Errorf("allreduce %d elements: %d wrong, want %d", r.Count, r.Wrong, want)
		}
	}
	cfg.Ops = []string{"broadcast"}
	cfg.DTypes = []string{"int32"}
	rows = runInProcess(t, cfg, func(b comm.Backend) comm.Backend { return skipBroadcast{b} })
	if len(rows) != len(cfg.Sizes()) {
		t.Fatalf("%d broadcast rows, want %d", len(rows), len(cfg.Sizes()))
	}
	for _, r := range rows {
		// rank 1 keeps its own inputs: every element whose input differs
		// from root 0's is wrong.
		ds := newDataset(comm.Int32, 0, 2)
		var want int64
		for i := range r.Count {
			if ds.input(1, i) != ds.input(0, i) {
				want++
			}
		}
		if r.Wrong != want || want == 0 {
			t.Errorf("broadcast %d elements: %d wrong, want %d", r.Count, r.Wrong, want)
		}
	}
}
