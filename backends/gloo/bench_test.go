package gloo

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

var benchSizes = []int{4 << 10, 1 << 20, 16 << 20, 64 << 20}

// cpuTime is the CPU time (user + system) this process has used. Per op it
// is a figure that other load on the machine disturbs much less than wall
// time: with 2 cores, 2 × wall ≥ CPU.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// benchCollective runs an op on every rank b.N times in lockstep. setup
// returns rank r's op (its buffers allocated once, outside the loop). It
// reports bytes/s of size, µs/op, busbw (nccl-tests: algbw × busFactor) and
// the CPU time the whole process (all ranks) spent per op.
func benchCollective(b *testing.B, ranks, size int, mut func(*Config), busFactor float64,
	setup func(r, n int) func(ctx context.Context, c *comm.Comm) error) {
	benchCollectiveCtx(b, ranks, size, mut, busFactor, context.Background(), false, setup)
}

// benchCollectiveCtx is benchCollective with the caller's ctx given; with
// callback, each rank's ops go through a Comm that cannot see that the
// backend watches the ctx itself (comm.CtxWatcher), so it arms a
// callback on every op's cancelable ctx, as every Comm used to.
func benchCollectiveCtx(b *testing.B, ranks, size int, mut func(*Config), busFactor float64,
	ctx context.Context, callback bool, setup func(r, n int) func(ctx context.Context, c *comm.Comm) error) {
	j := newJob(b, ranks, mut)
	if callback {
		for r, c := range j.comms {
			w, err := comm.Wrap(plainBackend{c.Backend()}, j.opts)
			if err != nil {
				b.Fatal(err)
			}
			j.comms[r] = w // closing it closes the backend; c's Close is then a no-op on it
			defer c.Close()
		}
	}
	ops := make([]func(context.Context, *comm.Comm) error, ranks)
	for r := range ranks {
		ops[r] = setup(r, ranks)
	}
	for range 2 { // warm up: scratch buffers, socket buffers, receive queues
		j.mustRun(func(r int, c *comm.Comm) error { return ops[r](ctx, c) })
	}
	b.SetBytes(int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	start, cpu0 := time.Now(), cpuTime()
	var wg sync.WaitGroup
	errs := make([]error, ranks)
	for r := 1; r < ranks; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < b.N && errs[r] == nil; i++ {
				errs[r] = ops[r](ctx, j.comms[r])
			}
		}()
	}
	for i := 0; i < b.N && errs[0] == nil; i++ {
		errs[0] = ops[0](ctx, j.comms[0])
	}
	wg.Wait()
	el, cpu := time.Since(start), cpuTime()-cpu0
	b.StopTimer()
	for r, err := range errs {
		if err != nil {
			b.Fatalf("rank %d: %v", r, err)
		}
	}
	per := el / time.Duration(b.N)
	b.ReportMetric(float64(per.Nanoseconds())/1e3, "µs/op")
	b.ReportMetric(float64(size)/per.Seconds()/1e9*busFactor, "busGB/s")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/op")
	j.close()
}

func ones(n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = 1
	}
	return x
}

// benchEach runs a benchmark per rank count and size.
func benchEach(b *testing.B, busFactor func(n int) float64,
	setup func(size, r, n int) func(ctx context.Context, c *comm.Comm) error) {
	for _, ranks := range []int{2, 4} {
		for _, size := range benchSizes {
			b.Run(fmt.Sprintf("ranks=%d/size=%s", ranks, sizeName(size)), func(b *testing.B) {
				benchCollective(b, ranks, size, nil, busFactor(ranks), func(r, n int) func(context.Context, *comm.Comm) error {
					return setup(size, r, n)
				})
			})
		}
	}
}

func allReduceBus(n int) float64 { return 2 * float64(n-1) / float64(n) }
func gatherBus(n int) float64    { return float64(n-1) / float64(n) }

func BenchmarkAllReduce(b *testing.B) {
	benchEach(b, allReduceBus, func(size, r, n int) func(context.Context, *comm.Comm) error {
		t := comm.Float32s(ones(size / 4))
		return func(ctx context.Context, c *comm.Comm) error { return c.AllReduce(ctx, t, comm.Sum) }
	})
}

// plainBackend hides every optional interface of the backend it holds.
type plainBackend struct{ comm.Backend }

// BenchmarkAllReduceCtx is the per-op cost of the caller's ctx, side by
// side on a 4 KiB all-reduce: ctx=background (nothing to watch),
// ctx=cancel (a cancelable ctx, as ft and ftbench pass: the backend
// watches it itself) and ctx=callback (the same through a Comm that arms
// context.AfterFunc on each op's ctx: the cost before comm.CtxWatcher).
func BenchmarkAllReduceCtx(b *testing.B) {
	for _, ranks := range []int{2, 4} {
		for _, mode := range []string{"background", "cancel", "callback"} {
			b.Run(fmt.Sprintf("ranks=%d/ctx=%s", ranks, mode), func(b *testing.B) {
				ctx := context.Background()
				if mode != "background" {
					var cancel context.CancelFunc
					ctx, cancel = context.WithCancel(ctx)
					defer cancel()
				}
				size := 4 << 10
				benchCollectiveCtx(b, ranks, size, nil, allReduceBus(ranks), ctx, mode == "callback",
					func(r, n int) func(context.Context, *comm.Comm) error {
						t := comm.Float32s(ones(size / 4))
						return func(ctx context.Context, c *comm.Comm) error { return c.AllReduce(ctx, t, comm.Sum) }
					})
			})
		}
	}
}

// BenchmarkReduceScatter: size is the input (n blocks).
func BenchmarkReduceScatter(b *testing.B) {
	benchEach(b, gatherBus, func(size, r, n int) func(context.Context, *comm.Comm) error {
		in, out := comm.Float32s(ones(size/4/n*n)), comm.Float32s(ones(size/4/n))
		return func(ctx context.Context, c *comm.Comm) error { return c.ReduceScatter(ctx, out, in, comm.Sum) }
	})
}

// BenchmarkAllGather: size is the output (n blocks).
func BenchmarkAllGather(b *testing.B) {
	benchEach(b, gatherBus, func(size, r, n int) func(context.Context, *comm.Comm) error {
		in, out := comm.Float32s(ones(size/4/n)), comm.Float32s(ones(size/4/n*n))
		return func(ctx context.Context, c *comm.Comm) error { return c.AllGather(ctx, out, in) }
	})
}

func BenchmarkBroadcast(b *testing.B) {
	benchEach(b, func(int) float64 { return 1 }, func(size, r, n int) func(context.Context, *comm.Comm) error {
		t := comm.Float32s(ones(size / 4))
		return func(ctx context.Context, c *comm.Comm) error { return c.Broadcast(ctx, t, 0) }
	})
}

func BenchmarkAllToAll(b *testing.B) {
	benchEach(b, gatherBus, func(size, r, n int) func(context.Context, *comm.Comm) error {
		in, out := comm.Float32s(ones(size/4/n*n)), comm.Float32s(ones(size/4/n*n))
		return func(ctx context.Context, c *comm.Comm) error { return c.AllToAll(ctx, out, in) }
	})
}

// BenchmarkTCPRing is the yardstick: the bytes an n-rank ring all-reduce
// moves (2(n-1)/n of the buffer per rank), streamed over plain loopback
// connections around a ring, with no framing and no reduction. With 3 or
// more ranks each connection carries one direction, as in the backend's
// ring. With 2, "pair=shared" uses one connection both ways, the
// backend's topology (exactly one connection per pair); "pair=split" uses
// one per direction. Linux serialises a socket's send and receive copies,
// so the shared form is the fair yardstick for 2 ranks.
func BenchmarkTCPRing(b *testing.B) {
	for _, ranks := range []int{2, 4} {
		for _, split := range []bool{false, true} {
			if split && ranks != 2 {
				continue
			}
			pair := ""
			if ranks == 2 {
				pair = "/pair=shared"
				if split {
					pair = "/pair=split"
				}
			}
			for _, size := range benchSizes[1:] {
				b.Run(fmt.Sprintf("ranks=%d%s/size=%s", ranks, pair, sizeName(size)), func(b *testing.B) {
					benchTCPRing(b, ranks, size, ranks == 2 && !split)
				})
			}
		}
	}
}

func loopbackPair(b *testing.B) (net.Conn, net.Conn) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	acc := make(chan net.Conn, 1)
	go func() { c, _ := ln.Accept(); acc <- c }()
	w, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	rd := <-acc
	cfg := DefaultConfig()
	tune(w.(*net.TCPConn), cfg)
	tune(rd.(*net.TCPConn), cfg)
	return w, rd
}

func benchTCPRing(b *testing.B, ranks, size int, shared bool) {
	// out[i] is where rank i writes (to rank i+1), in[i] where it reads (from i-1).
	out, in := make([]net.Conn, ranks), make([]net.Conn, ranks)
	if shared {
		x, y := loopbackPair(b)
		out[0], in[1], out[1], in[0] = x, y, y, x
	} else {
		for i := range ranks {
			out[i], in[(i+1)%ranks] = loopbackPair(b)
		}
	}
	defer func() {
		for i := range ranks {
			out[i].Close()
			in[i].Close()
		}
	}()
	per := size * 2 * (ranks - 1) / ranks
	seg := DefaultConfig().SegmentSize
	bufs := make([][]byte, 2*ranks)
	for i := range bufs {
		bufs[i] = make([]byte, size)
	}
	b.SetBytes(int64(size))
	b.ResetTimer()
	start, cpu0 := time.Now(), cpuTime()
	var wg sync.WaitGroup
	for i := range ranks {
		wg.Add(2)
		go func() {
			defer wg.Done()
			src := bufs[2*i]
			for range b.N {
				for off := 0; off < per; off += seg {
					k := min(seg, per-off)
					o := off % size
					if o+k > size {
						o = 0
					}
					if _, err := out[i].Write(src[o : o+k]); err != nil {
						b.Error(err)
						return
					}
				}
			}
		}()
		go func() {
			defer wg.Done()
			dst := bufs[2*i+1]
			for range b.N {
				for got := 0; got < per; {
					n, err := io.ReadFull(in[i], dst[:min(len(dst), per-got)])
					got += n
					if err != nil {
						b.Error(err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	b.ReportMetric(float64((cpuTime()-cpu0).Microseconds())/float64(b.N), "cpu-µs/op")
	el := time.Since(start) / time.Duration(b.N)
	b.ReportMetric(float64(el.Nanoseconds())/1e3, "µs/op")
	b.ReportMetric(float64(size)/el.Seconds()/1e9*2*float64(ranks-1)/float64(ranks), "busGB/s")
}
