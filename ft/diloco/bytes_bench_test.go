package diloco

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"

	"github.com/ftcomm/ftcomm/backends/gloo"
)

// wchar reads the bytes this process has written through write system
// calls (sockets included) from /proc/self/io.
func wchar() (int64, bool) {
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		return 0, false
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte("wchar: ")); ok {
			n, err := strconv.ParseInt(string(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

// BenchmarkSyncBytes measures what one replica sends per sync, for the
// demo's model (92,546 parameters) among 4 replicas, for each way of
// syncing: plain DiLoCo (one fragment), Streaming DiLoCo (F = 4), and
// 8/4-bit outer gradients through an all-gather (what ft.Comm offers
// today) or all-to-all + all-gather. Metrics per sync and replica:
// payload-B (bytes handed to the collectives: the peak a sync holds),
// wire-B (the algorithm's volume, as Outcome.Wire reports it), sock-B
// (bytes really written to the sockets, from /proc/self/io, with gloo's
// shared-memory path off so that data goes through TCP), and x-f32 (wire
// bytes relative to plain DiLoCo in float32).
func BenchmarkSyncBytes(b *testing.B) {
	const ranks, n = 4, 92546
	b.Setenv(gloo.EnvSharedMemory, "0")
	cs := glooComms(b, ranks)
	f32 := allReduceWire(ranks, 4*(n+1))
	for _, tc := range []struct {
		name string
		frag int
		how  method
		q    Quantization
	}{
		{"diloco/float32", n, viaAllReduce, Float32},
		{"streaming-F4/float32", n / 4, viaAllReduce, Float32},
		{"diloco/int8/all-gather", n, viaAllGather, Int8},
		{"diloco/int4/all-gather", n, viaAllGather, Int4},
		{"diloco/int8/all-to-all", n, viaAllToAll, Int8},
		{"diloco/int4/all-to-all", n, viaAllToAll, Int4},
		{"streaming-F4/int4/all-to-all", n / 4, viaAllToAll, Int4},
	} {
		b.Run(tc.name, func(b *testing.B) {
			xs := make([]*exchange, ranks)
			deltas := make([][]float32, ranks)
			for i := range xs {
				xs[i] = &exchange{q: tc.q, block: 128}
				deltas[i] = make([]float32, tc.frag)
				for k := range deltas[i] {
					deltas[i][k] = float32((k*7+i)%13) / 13
				}
			}
			zeros := make([]float32, tc.frag)
			w0, measured := wchar()
			b.ResetTimer()
			for range b.N {
				var wg sync.WaitGroup
				for i := range ranks {
					wg.Add(1)
					go func() {
						defer wg.Done()
						c := wrap(cs[i], tc.how)
						xs[i].begin(context.Background(), c, tc.how, deltas[i], zeros, 1, nil, nil)
						if !xs[i].finish(context.Background(), c) {
							b.Errorf("rank %d: exchange failed", i)
						}
					}()
				}
				wg.Wait()
			}
			b.StopTimer()
			x := xs[0]
			b.ReportMetric(float64(x.payload), "payload-B")
			b.ReportMetric(float64(x.wire), "wire-B")
			b.ReportMetric(float64(x.wire)/float64(f32), "x-f32")
			if w1, ok := wchar(); ok && measured {
				b.ReportMetric(float64(w1-w0)/float64(ranks*b.N), "sock-B")
			}
		})
	}
}

func ExampleParseQuantization() {
	q, _ := ParseQuantization("int4")
	fmt.Println(q, q.bits())
	// Output: int4 4
}
