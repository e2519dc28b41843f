package diloco

import "math/bits"

// What one replica puts on the wire for a collective, as the gloo
// backend's algorithms move data (frame headers and the few bytes of the
// descriptor agreement excluded). The figures are the algorithms' volumes,
// averaged over the ranks; BenchmarkSyncBytes checks them against the bytes
// the processes really write to their sockets.

// smallAllReduce is gloo's default switch (Config.SmallThreshold) from
// recursive doubling to the ring.
const smallAllReduce = 64 << 10

// allReduceWire: b bytes all-reduced among n ranks. Recursive doubling
// (n = 2^k + m) sends the whole buffer k times at the 2^k core ranks, once
// from each of the m extra ranks and once back to it; the ring sends
// 2(n−1) chunks of b/n.
func allReduceWire(n, b int) int64 {
	if n <= 1 {
		return 0
	}
	if b <= smallAllReduce {
		p2 := 1 << (bits.Len(uint(n)) - 1)
		m, k := n-p2, bits.Len(uint(p2))-1
		return int64(2*m*b+p2*k*b) / int64(n)
	}
	return int64(2*(n-1)) * int64(b) / int64(n)
}

// allGatherWire: each of n ranks contributes b bytes; the ring forwards
// n−1 blocks.
func allGatherWire(n, b int) int64 { return int64(max(n-1, 0)) * int64(b) }

// allToAllWire: each rank sends n−1 of its n blocks of b bytes.
func allToAllWire(n, b int) int64 { return int64(max(n-1, 0)) * int64(b) }
