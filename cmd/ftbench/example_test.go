package main

import (
	"fmt"

	"github.com/ftcomm/ftcomm/comm"
)

// A row as ftbench prints it: 64 MiB of float32 summed across 4 ranks in
// 84 ms is an algorithm bandwidth of 0.80 GB/s (GB = 1e9 B) and, with
// nccl-tests' allreduce factor 2(n-1)/n = 1.5, a bus bandwidth of 1.20 GB/s.
func Example() {
	ar, _ := lookupOp("allreduce")
	g := geometryOf(ar, 64<<20, comm.Float32, 4)
	alg, bus := bandwidth(g.Bytes, 83886.08, ar.busFactor(4))
	fmt.Println(tableHead1)
	fmt.Println(formatRow(Row{Op: "allreduce", Bytes: g.Bytes, Count: g.Count, DType: "float32", RedOp: "sum", Root: -1,
		Usec: 83886.08, AlgBW: alg, BusBW: bus}))
	// Output:
	// #       size         count      type   redop    root     time   algbw   busbw  #wrong
	//     67108864      16777216     float     sum      -1    83886    0.80    1.20       0
}
