// Command ncclbench measures the nccl backend's collectives on the GPUs of
// one machine and prints nccl-tests' table (size, count, type, redop, root,
// time, algbw, busbw, #wrong).
//
//	ncclbench                          # all-reduce float32, 8 B … 1 GiB ×8, 2 GPUs
//	ncclbench -op allgather -b 1M -e 256M -f 4 -g 2
//	ncclbench -mode stream             # the stream-ordered path (see below)
//
// The ranks are goroutines of this process, one per GPU (as nccl-tests
// -g N runs them from one process), rendezvousing through an in-memory
// store. Each size: fill the inputs so that the result is exactly known,
// run the op once and count the wrong elements (#wrong, summed over the
// ranks), run -w warm-up iterations, barrier, then time -n iterations back
// to back on every rank; time is the mean per iteration of the slowest
// rank; algbw = size/time, busbw = algbw × 2(n-1)/n for allreduce,
// × (n-1)/n for allgather and reducescatter, × 1 for broadcast; GB = 1e9 B.
//
// -mode blocking (default) times comm.Comm's ops: each op is enqueued,
// waited for and returned before the next, as the comm contract requires.
// -mode stream (allreduce only) enqueues the n iterations on the comm's
// stream and waits once at the end, as nccl-tests and PyTorch loops do: the
// difference between the two modes is what the blocking contract costs.
//
// -commmode picks how the backend uses NCCL comms (nccl.Config.Mode:
// blocking-data, the default, nonblocking or blocking),
// -stats prints where rank 0's time went per op (the NCCL enqueue call,
// polling the async state of a nonblocking comm, waiting for the stream),
// -lockthread pins each rank's goroutine to an OS thread. ref/latency.c is
// the same measurement in C, as a floor.
//
// Keep NCCL_NVLS_ENABLE=0 in the environment on shared machines.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "ncclbench:", err)
		os.Exit(1)
	}
}

type options struct {
	minB, maxB int
	factor     int
	gpus       int
	iters      int
	warmup     int
	op         string
	dtype      comm.DType
	mode       string
	timeout    time.Duration
	commMode   nccl.Mode
	lock       bool
	stats      bool
	spin       time.Duration
	yield      time.Duration
}

func parseSize(s string) (int, error) {
	mult := 1
	switch {
	case strings.HasSuffix(s, "G"):
		mult, s = 1<<30, strings.TrimSuffix(s, "G")
	case strings.HasSuffix(s, "M"):
		mult, s = 1<<20, strings.TrimSuffix(s, "M")
	case strings.HasSuffix(s, "K"):
		mult, s = 1<<10, strings.TrimSuffix(s, "K")
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("bad size %q", s)
	}
	return n * mult, nil
}

func run() error {
	var o options
	var b, e, dt, cm string
	flag.StringVar(&b, "b", "8", "smallest size in bytes (K, M, G suffixes)")
	flag.StringVar(&e, "e", "1G", "largest size in bytes")
	flag.IntVar(&o.factor, "f", 8, "size multiplication factor")
	flag.IntVar(&o.gpus, "g", 2, "GPUs (ranks), devices 0..g-1")
	flag.IntVar(&o.iters, "n", 20, "timed iterations per size")
	flag.IntVar(&o.warmup, "w", 5, "warm-up iterations per size")
	flag.StringVar(&o.op, "op", "allreduce", "allreduce, allgather, reducescatter or broadcast")
	flag.StringVar(&dt, "d", "float32", "dtype")
	flag.StringVar(&o.mode, "mode", "blocking", "blocking (comm.Comm ops) or stream (enqueue all, wait once; allreduce)")
	flag.DurationVar(&o.timeout, "timeout", 2*time.Minute, "deadline of each op")
	flag.StringVar(&cm, "commmode", nccl.ModeBlockingData.String(), "NCCL comm mode: blocking-data, nonblocking or blocking (measurement only: not abortable)")
	flag.BoolVar(&o.lock, "lockthread", false, "lock each rank's goroutine to its OS thread")
	flag.BoolVar(&o.stats, "stats", false, "print where each op's time went (enqueue, async-state polling, stream wait)")
	flag.DurationVar(&o.spin, "spin", 0, "nccl.Config.SpinWait (0: default)")
	flag.DurationVar(&o.yield, "yield", 0, "nccl.Config.YieldWait (0: default)")
	flag.Parse()
	var err error
	if o.minB, err = parseSize(b); err != nil {
		return err
	}
	if o.maxB, err = parseSize(e); err != nil {
		return err
	}
	if o.dtype, err = comm.ParseDType(dt); err != nil {
		return err
	}
	if o.commMode, err = nccl.ParseMode(cm); err != nil {
		return err
	}
	if o.factor < 2 || o.gpus < 1 || o.iters < 1 || o.minB > o.maxB {
		return errors.New("need -f >= 2, -g >= 1, -n >= 1, -b <= -e")
	}
	if o.mode != "blocking" && !(o.mode == "stream" && o.op == "allreduce") {
		return fmt.Errorf("mode %q with op %q: stream mode is for allreduce only", o.mode, o.op)
	}
	L, err := nccl.Open(nccl.LibraryConfig{})
	if err != nil {
		return err
	}
	ctx := context.Background()
	ranks, err := startRanks(ctx, L, o)
	if err != nil {
		return err
	}
	defer func() {
		for _, r := range ranks {
			r.c.Close()
		}
	}()
	info := L.Info()
	fmt.Printf("# ncclbench: NCCL %s (%s), CUDA runtime %d; %d ranks on GPUs 0..%d in one process; op %s, mode %s; comm mode %s, eager connect %v, locked threads %v\n",
		info.NCCL, info.NCCLPath, info.CUDARuntime, o.gpus, o.gpus-1, o.op, o.mode, o.commMode, info.EagerConnect, o.lock)
	fmt.Printf("# %10s %12s %8s %6s %6s %9s %7s %7s %7s\n", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong")
	fmt.Printf("# %10s %12s %8s %6s %6s %9s %7s %7s %7s\n", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "")
	es := o.dtype.Size()
	for size := o.minB; size <= o.maxB; size *= o.factor {
		count := size / es
		if o.op == "allgather" || o.op == "reducescatter" {
			count = size / es / o.gpus // one rank's block
		}
		if count == 0 {
			continue
		}
		before := ranks[0].b.Stats()
		row, err := measure(ctx, o, ranks, count)
		if err != nil {
			return fmt.Errorf("size %d: %w", size, err)
		}
		bytes := count * es
		if o.op == "allgather" || o.op == "reducescatter" {
			bytes *= o.gpus
		}
		algbw := float64(bytes) / row.time.Seconds() / 1e9
		n := float64(o.gpus)
		bus := algbw
		switch o.op {
		case "allreduce":
			bus = algbw * 2 * (n - 1) / n
		case "allgather", "reducescatter":
			bus = algbw * (n - 1) / n
		}
		redop, root := "sum", "-1"
		switch o.op {
		case "allgather":
			redop = "none"
		case "broadcast":
			redop, root = "none", "0"
		}
		fmt.Printf("  %10d %12d %8s %6s %6s %9.2f %7.2f %7.2f %7d\n", bytes, count, typeName(o.dtype), redop, root,
			float64(row.time)/float64(time.Microsecond), algbw, bus, row.wrong)
		if o.stats {
			s := ranks[0].b.Stats()
			ops := float64(s.Ops - before.Ops)
			us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / ops }
			fmt.Printf("#   rank 0 per op: enqueue %.2f us, async-state polling %.2f us (%d of %.0f in progress, %.1f polls), stream wait %.2f us (%.1f polls)\n",
				us(s.Enqueue-before.Enqueue), us(s.Settle-before.Settle), s.InProgress-before.InProgress, ops,
				float64(s.SettlePolls-before.SettlePolls)/ops, us(s.Wait-before.Wait), float64(s.WaitPolls-before.WaitPolls)/ops)
		}
	}
	return nil
}

func typeName(d comm.DType) string {
	switch d {
	case comm.Float32:
		return "float"
	case comm.Float16:
		return "half"
	case comm.Int32:
		return "int32"
	}
	return d.String()
}

type rank struct {
	r   int
	c   *comm.Comm
	b   *nccl.Backend
	L   *nccl.Library
	in  *nccl.DeviceBuffer
	out *nccl.DeviceBuffer
}

func startRanks(ctx context.Context, L *nccl.Library, o options) ([]*rank, error) {
	n := o.gpus
	store := memstore.New()
	ranks := make([]*rank, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Go(func() {
			c, err := comm.New(ctx, "nccl", comm.Options{Name: "bench", Rank: r, Size: n, Store: store, Device: r,
				BackendConfig: &nccl.Config{Library: L, Mode: o.commMode, SpinWait: o.spin, YieldWait: o.yield}})
			if err != nil {
				errs[r] = err
				return
			}
			ranks[r] = &rank{r: r, c: c, b: c.Backend().(*nccl.Backend), L: L}
		})
	}
	wg.Wait()
	return ranks, errors.Join(errs...)
}

type result struct {
	time  time.Duration
	wrong int
}

// measure runs one size on every rank and combines: the slowest rank's time
// and the sum of the wrong elements.
func measure(ctx context.Context, o options, ranks []*rank, count int) (result, error) {
	times := make([]time.Duration, len(ranks))
	wrong := make([]int, len(ranks))
	errs := make([]error, len(ranks))
	var wg sync.WaitGroup
	for i, rk := range ranks {
		wg.Go(func() { times[i], wrong[i], errs[i] = rk.measure(ctx, o, count, len(ranks)) })
	}
	wg.Wait()
	var res result
	for i := range ranks {
		res.time = max(res.time, times[i])
		res.wrong += wrong[i]
	}
	return res, errors.Join(errs...)
}

// input is element i of rank r's input: small integers, exact in every
// dtype after summing a few ranks.
func input(r, i int) float64 { return float64(i%7 + r) }

func (rk *rank) measure(ctx context.Context, o options, count, n int) (time.Duration, int, error) {
	if o.lock {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
	}
	es := o.dtype.Size()
	inN, outN := count, count
	switch o.op {
	case "allgather":
		outN = count * n
	case "reducescatter":
		inN = count * n
	}
	if err := rk.ensure(inN*es, outN*es); err != nil {
		return 0, 0, err
	}
	in, out := rk.in.Tensor(o.dtype).Slice(0, inN), rk.out.Tensor(o.dtype).Slice(0, outN)
	op := func(ctx context.Context) error {
		switch o.op {
		case "allreduce":
			return rk.c.AllReduce(ctx, in, comm.Sum)
		case "allgather":
			return rk.c.AllGather(ctx, out, in)
		case "reducescatter":
			return rk.c.ReduceScatter(ctx, out, in, comm.Sum)
		case "broadcast":
			return rk.c.Broadcast(ctx, in, 0)
		}
		return fmt.Errorf("unknown op %q", o.op)
	}
	octx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	// Check once.
	host := make([]byte, in.NumBytes())
	fill(o.dtype, host, func(i int) float64 { return input(rk.r, i) })
	if err := rk.L.CopyToDevice(octx, in, host); err != nil {
		return 0, 0, err
	}
	if err := op(octx); err != nil {
		return 0, 0, err
	}
	res := in
	var want func(i int) float64
	switch o.op {
	case "allreduce":
		want = func(i int) float64 { return float64(n*(i%7) + n*(n-1)/2) }
	case "broadcast":
		want = func(i int) float64 { return input(0, i) }
	case "allgather":
		res, want = out, func(i int) float64 { return input(i/count, i%count) }
	case "reducescatter":
		res, want = out, func(i int) float64 { j := rk.r*count + i; return float64(n*(j%7) + n*(n-1)/2) }
	}
	got := make([]byte, res.NumBytes())
	if err := rk.L.CopyFromDevice(octx, got, res); err != nil {
		return 0, 0, err
	}
	bad := countWrong(o.dtype, got, want)
	// Warm up, line up, time.
	for range o.warmup {
		if err := op(octx); err != nil {
			return 0, 0, err
		}
	}
	if err := rk.c.Barrier(octx); err != nil {
		return 0, 0, err
	}
	t0 := time.Now()
	if o.mode == "stream" {
		for range o.iters {
			if err := rk.b.EnqueueAllReduce(octx, in, comm.Sum); err != nil {
				return 0, 0, err
			}
		}
		if err := rk.b.Synchronize(octx); err != nil {
			return 0, 0, err
		}
	} else {
		for range o.iters {
			if err := op(octx); err != nil {
				return 0, 0, err
			}
		}
	}
	return time.Since(t0) / time.Duration(o.iters), bad, nil
}

// ensure grows the rank's buffers to at least the given sizes.
func (rk *rank) ensure(inBytes, outBytes int) error {
	grow := func(b **nccl.DeviceBuffer, n int) error {
		if *b != nil && (*b).Len() >= n {
			return nil
		}
		if *b != nil {
			(*b).Free()
		}
		nb, err := rk.L.Alloc(rk.r, n)
		*b = nb
		return err
	}
	if err := grow(&rk.in, inBytes); err != nil {
		return err
	}
	return grow(&rk.out, outBytes)
}

// fill writes f(i) as element i of buf.
func fill(dt comm.DType, buf []byte, f func(int) float64) {
	es := dt.Size()
	for i := 0; i < len(buf)/es; i++ {
		v := f(i)
		switch dt {
		case comm.Float32:
			putU32(buf[4*i:], math.Float32bits(float32(v)))
		case comm.Int32:
			putU32(buf[4*i:], uint32(int32(v)))
		case comm.BFloat16:
			putU16(buf[2*i:], uint16(comm.NewBF16(float32(v))))
		case comm.Float16:
			putU16(buf[2*i:], uint16(comm.NewF16(float32(v))))
		case comm.Float64:
			putU64(buf[8*i:], math.Float64bits(v))
		case comm.Int64:
			putU64(buf[8*i:], uint64(int64(v)))
		default:
			buf[i] = byte(v)
		}
	}
}

// countWrong counts the elements of buf that are not want(i).
func countWrong(dt comm.DType, buf []byte, want func(int) float64) int {
	es, bad := dt.Size(), 0
	for i := 0; i < len(buf)/es; i++ {
		var v float64
		switch dt {
		case comm.Float32:
			v = float64(math.Float32frombits(u32(buf[4*i:])))
		case comm.Int32:
			v = float64(int32(u32(buf[4*i:])))
		case comm.BFloat16:
			v = float64(comm.BF16(u16(buf[2*i:])).Float32())
		case comm.Float16:
			v = float64(comm.F16(u16(buf[2*i:])).Float32())
		case comm.Float64:
			v = math.Float64frombits(u64(buf[8*i:]))
		case comm.Int64:
			v = float64(int64(u64(buf[8*i:])))
		default:
			v = float64(buf[i])
		}
		if v != want(i) {
			bad++
		}
	}
	return bad
}

func putU16(b []byte, v uint16) { b[0], b[1] = byte(v), byte(v>>8) }
func putU32(b []byte, v uint32) { putU16(b, uint16(v)); putU16(b[2:], uint16(v>>16)) }
func putU64(b []byte, v uint64) { putU32(b, uint32(v)); putU32(b[4:], uint32(v>>32)) }
func u16(b []byte) uint16       { return uint16(b[0]) | uint16(b[1])<<8 }
func u32(b []byte) uint32       { return uint32(u16(b)) | uint32(u16(b[2:]))<<16 }
func u64(b []byte) uint64       { return uint64(u32(b)) | uint64(u32(b[4:]))<<32 }
