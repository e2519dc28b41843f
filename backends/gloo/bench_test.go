package gloo

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

var benchSizes = []int{4 << 10, 1 << 20, 16 << 20, 64 << 20}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// benchJob runs op on every rank b.N times in lockstep and reports bytes/s
// (of the buffer) and, via busbw, the nccl-tests bus bandwidth.
func benchCollective(b *testing.B, ranks, size int, mut func(*Config), busFactor float64,
	op func(ctx context.Context, c *comm.Comm, r int, buf []float32) error) {
	j := newJob(b, ranks, mut)
	bufs := make([][]float32, ranks)
	for r := range bufs {
		bufs[r] = make([]float32, size/4)
		for i := range bufs[r] {
			bufs[r][i] = 1
		}
	}
	ctx := context.Background()
	// warm up: scratch buffers, socket buffers
	j.mustRun(func(r int, c *comm.Comm) error { return op(ctx, c, r, bufs[r]) })
	b.SetBytes(int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	errs := make([]error, ranks)
	for r := 1; r < ranks; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < b.N && errs[r] == nil; i++ {
				errs[r] = op(ctx, j.comms[r], r, bufs[r])
			}
		}()
	}
	for i := 0; i < b.N && errs[0] == nil; i++ {
		errs[0] = op(ctx, j.comms[0], 0, bufs[0])
	}
	wg.Wait()
	el := time.Since(start)
	b.StopTimer()
	for r, err := range errs {
		if err != nil {
			b.Fatalf("rank %d: %v", r, err)
		}
	}
	per := el / time.Duration(b.N)
	b.ReportMetric(float64(per.Microseconds()), "µs/op")
	b.ReportMetric(float64(size)/per.Seconds()/1e9*busFactor, "busGB/s")
	j.close()
}

func BenchmarkAllReduce(b *testing.B) {
	for _, ranks := range []int{2, 4} {
		for _, size := range benchSizes {
			b.Run(fmt.Sprintf("ranks=%d/size=%s", ranks, sizeName(size)), func(b *testing.B) {
				benchCollective(b, ranks, size, nil, 2*float64(ranks-1)/float64(ranks),
					func(ctx context.Context, c *comm.Comm, r int, buf []float32) error {
						return c.AllReduce(ctx, comm.Float32s(buf), comm.Sum)
					})
			})
		}
	}
}

// BenchmarkTCPRing is the yardstick: the same bytes an n-rank ring
// all-reduce moves (2(n-1)/n of the buffer per rank), streamed over plain
// loopback connections in a ring with no framing and no reduction.
func BenchmarkTCPRing(b *testing.B) {
	for _, ranks := range []int{2, 4} {
		for _, size := range benchSizes[1:] {
			b.Run(fmt.Sprintf("ranks=%d/size=%s", ranks, sizeName(size)), func(b *testing.B) {
				conns := make([][2]net.Conn, ranks) // [i][0]: i writes to i+1; [i][1]: i+1 reads
				for i := range conns {
					ln, err := net.Listen("tcp", "127.0.0.1:0")
					if err != nil {
						b.Fatal(err)
					}
					acc := make(chan net.Conn, 1)
					go func() { c, _ := ln.Accept(); acc <- c }()
					w, err := net.Dial("tcp", ln.Addr().String())
					if err != nil {
						b.Fatal(err)
					}
					rd := <-acc
					ln.Close()
					cfg := DefaultConfig()
					tune(w.(*net.TCPConn), cfg)
					tune(rd.(*net.TCPConn), cfg)
					conns[i] = [2]net.Conn{w, rd}
				}
				defer func() {
					for _, c := range conns {
						c[0].Close()
						c[1].Close()
					}
				}()
				per := size * 2 * (ranks - 1) / ranks
				seg := 512 << 10
				bufs := make([][]byte, 2*ranks)
				for i := range bufs {
					bufs[i] = make([]byte, size)
				}
				b.SetBytes(int64(size))
				b.ResetTimer()
				start := time.Now()
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
								conns[i][0].Write(src[o : o+k])
							}
						}
					}()
					go func() {
						defer wg.Done()
						dst := bufs[2*i+1]
						rd := conns[(i+ranks-1)%ranks][1]
						for range b.N {
							for got := 0; got < per; {
								k := min(len(dst), per-got)
								n, err := io.ReadFull(rd, dst[:k])
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
				el := time.Since(start) / time.Duration(b.N)
				b.ReportMetric(float64(el.Microseconds()), "µs/op")
				b.ReportMetric(float64(size)/el.Seconds()/1e9*2*float64(ranks-1)/float64(ranks), "busGB/s")
			})
		}
	}
}
