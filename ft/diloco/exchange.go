package diloco

import (
	"context"

	"github.com/ftcomm/ftcomm/comm"
)

// How an exchange averages a fragment's outer gradients.
type method int

const (
	// viaAllReduce: float32 values and the weight, summed by one all-reduce.
	viaAllReduce method = iota
	// viaAllGather: every replica's quantized payload goes to every
	// replica, which decodes and averages them all (one all-gather).
	viaAllGather
	// viaAllToAll: reduce-scatter then all-gather, both quantized. Each
	// replica sends chunk j of its payload to replica j (all-to-all),
	// which averages the chunks it received, quantizes that average (with
	// error feedback of its own) and all-gathers it. Half the bytes of an
	// all-gather's n−1 payloads at 4 replicas, a quarter at 8.
	viaAllToAll
)

func (m method) String() string {
	return [...]string{"all-reduce", "all-gather", "all-to-all+all-gather"}[m]
}

// exchange averages one fragment's outer gradient over the replicas of a
// step, weighted (a replica with nothing to add sends weight 0). begin
// issues the first collective, poll moves on to the second (two-phase)
// once the first is done, finish waits and decodes. All three run on the
// training goroutine; only the collectives run behind it, on the comm's
// own worker, so the caller may do inner steps between begin and finish
// as long as it touches none of the exchange's buffers.
type exchange struct {
	q      Quantization
	block  int
	how    method
	n      int // values in the fragment
	size   int // participants
	rank   int
	weight float32

	sum []float32 // viaAllReduce: w·Δ, then w; summed in place

	v, dec    []float32 // values quantized (Δ + residual) and what receivers decode of them
	res1      []float32 // v − dec: this sync's residual, the next sync's ef1 if it commits
	mine, all []byte    // this replica's payload; everyone's (n·size or size chunks)

	chunk          int       // viaAllToAll: values per chunk (a multiple of block)
	own, ownDec    []float32 // this replica's chunk average (+ its residual), and its decoding
	res2           []float32 // own − ownDec, the next ef2 if the sync commits
	mine2, all2    []byte
	work           *comm.Work
	phase          int // 1: first collective in flight; 2: second; 3: decoded
	failed         bool
	avg            []float32 // the average is avg × scale, n values
	scale          float32
	wsum           float32
	payload, wire  int64 // bytes handed to the collectives, and sent on the wire
	chunkSize, ext int   // viaAllToAll: payload bytes per chunk; padded length size·chunk
}

func grow[T any](s []T, n int) []T {
	if cap(s) < n {
		return make([]T, n)
	}
	s = s[:n]
	clear(s)
	return s
}

// begin starts averaging global − local, the outer gradient (+ ef1, the
// residual of earlier quantization), with weight w. ef2 is this replica's residual of its
// chunk's average from earlier syncs of this fragment (viaAllToAll), or nil.
func (x *exchange) begin(ctx context.Context, c Comm, how method, global, local []float32, w float32, ef1, ef2 []float32) {
	x.how, x.n, x.weight, x.phase, x.failed, x.scale = how, len(global), w, 1, false, 1
	x.size, x.rank = max(c.Participants(), 1), max(c.Rank(), 0)
	x.payload, x.wire = 0, 0
	switch how {
	case viaAllReduce:
		x.sum = grow(x.sum, x.n+1)
		local = local[:len(global)]
		for i, g := range global {
			x.sum[i] = w * (g - local[i])
		}
		x.sum[x.n] = w
		x.payload = int64(4 * (x.n + 1))
		x.wire = allReduceWire(x.size, 4*(x.n+1))
		x.work = c.AllReduce(ctx, comm.Float32s(x.sum), comm.Sum)
	case viaAllGather:
		x.quantizeOwn(global, local, ef1, x.n)
		p := payloadSize(x.n, x.q, x.block)
		x.mine = grow(x.mine, p)
		encode(x.mine, x.v, x.dec, w, x.q, x.block)
		x.residual()
		x.all = grow(x.all, p*x.size)
		x.payload, x.wire = int64(p), allGatherWire(x.size, p)
		x.work = c.AllGather(ctx, comm.Uint8s(x.all), comm.Uint8s(x.mine))
	case viaAllToAll:
		// Chunks of whole blocks; the padding is zeros and stays zero.
		x.chunk = (x.n + x.size - 1) / x.size
		x.chunk = (x.chunk + x.block - 1) / x.block * x.block
		x.ext = x.chunk * x.size
		x.quantizeOwn(global, local, ef1, x.ext)
		x.chunkSize = payloadSize(x.chunk, x.q, x.block)
		x.mine = grow(x.mine, x.chunkSize*x.size)
		for j := range x.size {
			lo := j * x.chunk
			encode(x.mine[j*x.chunkSize:(j+1)*x.chunkSize], x.v[lo:lo+x.chunk], x.dec[lo:lo+x.chunk], w, x.q, x.block)
		}
		x.residual()
		x.all = grow(x.all, x.chunkSize*x.size)
		x.payload = int64((x.size + 1) * x.chunkSize) // the all-to-all's input, then this replica's chunk
		x.wire = allToAllWire(x.size, x.chunkSize) + allGatherWire(x.size, x.chunkSize)
		x.own = grow(x.own, x.chunk)
		if len(ef2) == x.chunk {
			copy(x.own, ef2)
		}
		x.work = c.(AllToAller).AllToAll(ctx, comm.Uint8s(x.all), comm.Uint8s(x.mine))
	}
}

// quantizeOwn sets v = global − local + ef1, padded with zeros to ext values.
func (x *exchange) quantizeOwn(global, local, ef1 []float32, ext int) {
	x.v, x.dec = grow(x.v, ext), grow(x.dec, ext)
	local = local[:len(global)]
	for i, g := range global {
		x.v[i] = g - local[i]
	}
	if len(ef1) == len(global) {
		for i, e := range ef1 {
			x.v[i] += e
		}
	}
}

// residual keeps v − dec over the fragment's values.
func (x *exchange) residual() {
	x.res1 = grow(x.res1, x.n)
	for i := range x.res1 {
		x.res1[i] = x.v[i] - x.dec[i]
	}
}

// poll moves a two-phase exchange on when its first collective is done;
// it never blocks.
func (x *exchange) poll(ctx context.Context, c Comm) {
	if x.how != viaAllToAll || x.phase != 1 {
		return
	}
	select {
	case <-x.work.Done():
		x.second(ctx, c)
	default:
	}
}

// second averages this replica's chunk from what the all-to-all brought
// and all-gathers it.
func (x *exchange) second(ctx context.Context, c Comm) {
	x.phase = 2
	if err := x.work.Wait(ctx); err != nil {
		x.failed = true // recorded by the comm for Commit; nothing more to send
		return
	}
	var wsum float32
	for i := range x.size {
		wsum += payloadWeight(x.all[i*x.chunkSize:])
	}
	if wsum > 0 { // own holds the residual of earlier syncs: add the average
		for i := range x.size {
			p := x.all[i*x.chunkSize : (i+1)*x.chunkSize]
			decodeAdd(x.own, p, payloadWeight(p)/wsum, x.q, x.block)
		}
	} else {
		clear(x.own) // nothing to average: nothing is applied, the residual waits
	}
	x.ownDec = grow(x.ownDec, x.chunk)
	x.mine2 = grow(x.mine2, x.chunkSize)
	encode(x.mine2, x.own, x.ownDec, wsum, x.q, x.block)
	x.res2 = grow(x.res2, x.chunk)
	for i := range x.res2 {
		x.res2[i] = x.own[i] - x.ownDec[i]
	}
	x.all2 = grow(x.all2, x.chunkSize*x.size)
	x.work = c.AllGather(ctx, comm.Uint8s(x.all2), comm.Uint8s(x.mine2))
}

// finish waits for the exchange and decodes the average into x.avg ×
// x.scale (and the total weight into x.wsum). It reports false if a collective failed:
// the step will not commit, and x.avg means nothing.
func (x *exchange) finish(ctx context.Context, c Comm) bool {
	if x.how == viaAllToAll && x.phase == 1 {
		x.second(ctx, c)
	}
	if x.failed {
		x.phase = 3
		return false
	}
	err := x.work.Wait(ctx)
	x.phase = 3
	if err != nil {
		return false
	}
	if x.how == viaAllReduce { // the sums, scaled by the caller's pass over them
		x.wsum, x.avg = x.sum[x.n], x.sum[:x.n]
		if x.wsum > 0 {
			x.scale = 1 / x.wsum
		}
		return true
	}
	x.avg = grow(x.avg, x.n)
	switch x.how {
	case viaAllGather:
		p := len(x.mine)
		x.wsum = 0
		for i := range x.size {
			x.wsum += payloadWeight(x.all[i*p:])
		}
		if x.wsum > 0 {
			for i := range x.size {
				q := x.all[i*p : (i+1)*p]
				decodeAdd(x.avg, q, payloadWeight(q)/x.wsum, x.q, x.block)
			}
		}
	case viaAllToAll:
		x.wsum = payloadWeight(x.all2)
		full := grow(x.v, x.ext) // v is spent (its residual is in res1): reuse it for the padded average
		for j := range x.size {
			decodeAdd(full[j*x.chunk:(j+1)*x.chunk], x.all2[j*x.chunkSize:(j+1)*x.chunkSize], 1, x.q, x.block)
		}
		copy(x.avg, full[:x.n])
	}
	return true
}
