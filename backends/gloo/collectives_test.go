package gloo

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

var algorithms = []Algorithm{AlgorithmAuto, AlgorithmRing, AlgorithmRecursiveDoubling}

// mcase is one collective of the matrix with every rank's input and
// expected output, computed once (read-only while ranks run).
type mcase struct {
	name     string
	kind     comm.OpType
	dt       comm.DType
	op       comm.ReduceOp
	root     int
	in       [][]byte // by rank
	want     [][]byte // by rank: expected out (or buffer, for in-place ops)
	outLen   []int    // by rank: bytes of the out buffer
	counts   []int    // AllGatherV, ReduceScatterV
	inCounts [][]int  // AllToAllV, by rank
	outCnts  [][]int
	p2pSize  int // Send/Recv, BatchP2P: elements per message
}

// countsFor are element counts that cover empty, single, not divisible by
// the world size, and several pipeline segments (the matrix runs with 4 KiB
// segments and a 256-byte small-message threshold).
func countsFor(n int) []int { return []int{0, 1, 13*n + 5, 1601} }

var (
	casesMu    sync.Mutex
	casesCache = map[int][]*mcase{}
)

// matrixCases builds the op sequence of the matrix for n ranks.
func matrixCases(n int) []*mcase {
	casesMu.Lock()
	defer casesMu.Unlock()
	if cs, ok := casesCache[n]; ok {
		return cs
	}
	var cs []*mcase
	salt := 0
	all := func(dt comm.DType, op comm.ReduceOp, count int) [][]byte {
		salt++
		in := make([][]byte, n)
		for q := range n {
			in[q] = input(dt, op, q, count, salt)
		}
		return in
	}
	same := func(b []byte) [][]byte {
		w := make([][]byte, n)
		for q := range w {
			w[q] = b
		}
		return w
	}
	lens := func(k int) []int {
		l := make([]int, n)
		for q := range l {
			l[q] = k
		}
		return l
	}
	for _, dt := range allDTypes {
		es := dt.Size()
		for _, op := range allOps {
			if !op.Supports(dt) {
				continue
			}
			for _, count := range countsFor(n) {
				in := all(dt, op, count)
				cs = append(cs, &mcase{name: fmt.Sprintf("allreduce %s %s count %d", dt, op, count), kind: comm.OpAllReduce,
					dt: dt, op: op, in: in, want: same(refReduce(dt, op, in)), outLen: lens(count * es)})

				in = all(dt, op, count)
				root := salt % n
				want := make([][]byte, n)
				copy(want, in)
				want[root] = refReduce(dt, op, in)
				cs = append(cs, &mcase{name: fmt.Sprintf("reduce %s %s count %d root %d", dt, op, count, root), kind: comm.OpReduce,
					dt: dt, op: op, root: root, in: in, want: want, outLen: lens(count * es)})

				in = all(dt, op, count*n)
				ref := refReduce(dt, op, in)
				want = make([][]byte, n)
				for q := range n {
					want[q] = ref[q*count*es : (q+1)*count*es]
				}
				cs = append(cs, &mcase{name: fmt.Sprintf("reducescatter %s %s count %d", dt, op, count), kind: comm.OpReduceScatter,
					dt: dt, op: op, in: in, want: want, outLen: lens(count * es)})
			}
		}
		for _, count := range countsFor(n) {
			in := all(dt, comm.Sum, count)
			cs = append(cs, &mcase{name: fmt.Sprintf("allgather %s count %d", dt, count), kind: comm.OpAllGather,
				dt: dt, in: in, want: same(bytes.Join(in, nil)), outLen: lens(n * count * es)})

			for _, root := range uniq(0, n-1, salt%n) {
				in = all(dt, comm.Sum, count)
				cs = append(cs, &mcase{name: fmt.Sprintf("broadcast %s count %d root %d", dt, count, root), kind: comm.OpBroadcast,
					dt: dt, root: root, in: in, want: same(in[root]), outLen: lens(count * es)})
			}

			in = all(dt, comm.Sum, count)
			root := salt % n
			gl := make([]int, n)
			gl[root] = n * count * es
			cs = append(cs, &mcase{name: fmt.Sprintf("gather %s count %d root %d", dt, count, root), kind: comm.OpGather,
				dt: dt, root: root, in: in, want: same(bytes.Join(in, nil)), outLen: gl})

			in = all(dt, comm.Sum, count*n)
			root = salt % n
			want := make([][]byte, n)
			for q := range n {
				want[q] = in[root][q*count*es : (q+1)*count*es]
			}
			cs = append(cs, &mcase{name: fmt.Sprintf("scatter %s count %d root %d", dt, count, root), kind: comm.OpScatter,
				dt: dt, root: root, in: in, want: want, outLen: lens(count * es)})

			in = all(dt, comm.Sum, count*n)
			want = make([][]byte, n)
			for p := range n {
				for q := range n {
					want[p] = append(want[p], in[q][p*count*es:(p+1)*count*es]...)
				}
			}
			cs = append(cs, &mcase{name: fmt.Sprintf("alltoall %s count %d", dt, count), kind: comm.OpAllToAll,
				dt: dt, in: in, want: want, outLen: lens(count * n * es)})
		}

		// AllGatherV with uneven counts, some zero.
		salt++
		counts := make([]int, n)
		ins := make([][]byte, n)
		for q := range n {
			counts[q] = (q*7 + salt) % 5 * (1 + q%3*100)
			ins[q] = input(dt, comm.Sum, q, counts[q], salt)
		}
		cs = append(cs, &mcase{name: fmt.Sprintf("allgatherv %s counts %v", dt, counts), kind: comm.OpAllGatherV,
			dt: dt, in: ins, counts: counts, want: same(bytes.Join(ins, nil)), outLen: lens(sum(counts) * es)})

		// ReduceScatterV with uneven blocks, some empty, each op once.
		for _, op := range allOps {
			if !op.Supports(dt) {
				continue
			}
			salt++
			counts := make([]int, n)
			for q := range n {
				counts[q] = (q*5 + salt) % 4 * (1 + q%2*200)
			}
			in := all(dt, op, sum(counts))
			ref := refReduce(dt, op, in)
			want := make([][]byte, n)
			off := 0
			for q := range n {
				want[q] = ref[off*es : (off+counts[q])*es]
				off += counts[q]
			}
			outLen := make([]int, n)
			for q := range n {
				outLen[q] = counts[q] * es
			}
			cs = append(cs, &mcase{name: fmt.Sprintf("reducescatterv %s %s counts %v", dt, op, counts), kind: comm.OpReduceScatterV,
				dt: dt, op: op, in: in, counts: counts, want: want, outLen: outLen})
		}

		// AllToAllV: rank q sends m(q, p) elements to p.
		salt++
		s := salt
		m := func(q, p int) int { return (q*3 + p*5 + s) % 4 * (1 + (q+p)%2*300) }
		c := &mcase{name: fmt.Sprintf("alltoallv %s", dt), kind: comm.OpAllToAllV, dt: dt,
			in: make([][]byte, n), want: make([][]byte, n), outLen: make([]int, n), inCounts: make([][]int, n), outCnts: make([][]int, n)}
		for q := range n {
			c.inCounts[q], c.outCnts[q] = make([]int, n), make([]int, n)
			for p := range n {
				c.inCounts[q][p], c.outCnts[q][p] = m(q, p), m(p, q)
			}
			c.in[q] = input(dt, comm.Sum, q, sum(c.inCounts[q]), s)
			c.outLen[q] = sum(c.outCnts[q]) * es
		}
		for p := range n {
			for q := range n {
				start := 0
				for k := 0; k < p; k++ {
					start += m(q, k)
				}
				c.want[p] = append(c.want[p], c.in[q][start*es:(start+m(q, p))*es]...)
			}
		}
		cs = append(cs, c)

		if n > 1 {
			count := 1000 + salt
			in := all(dt, comm.Sum, count)
			want := make([][]byte, n)
			for q := range n {
				want[q] = in[(q+n-1)%n]
			}
			cs = append(cs, &mcase{name: fmt.Sprintf("send/recv %s", dt), kind: comm.OpSend, dt: dt, in: in, want: want, p2pSize: count})
			in = all(dt, comm.Sum, 7*n)
			cs = append(cs, &mcase{name: fmt.Sprintf("batch p2p %s", dt), kind: comm.OpBatchP2P, dt: dt, in: in, p2pSize: 7})
		}
	}
	cs = append(cs, &mcase{name: "barrier", kind: comm.OpBarrier})
	casesCache[n] = cs
	return cs
}

func uniq(v ...int) []int {
	var out []int
	for _, x := range v {
		dup := false
		for _, y := range out {
			dup = dup || x == y
		}
		if !dup {
			out = append(out, x)
		}
	}
	return out
}

func sum(v []int) int {
	t := 0
	for _, x := range v {
		t += x
	}
	return t
}

// runCase executes c on rank r of n and checks the result.
func runCase(ctx context.Context, cm *comm.Comm, c *mcase, n, r int) error {
	dt := c.dt
	var out []byte
	if c.outLen != nil && c.outLen[r] >= 0 {
		out = sentinel(c.outLen[r])
	}
	var in []byte
	if c.in != nil {
		in = bytes.Clone(c.in[r])
	}
	var err error
	switch c.kind {
	case comm.OpAllReduce:
		err = cm.AllReduce(ctx, tensor(dt, in), c.op)
		out = in
	case comm.OpReduce:
		err = cm.Reduce(ctx, tensor(dt, in), c.op, c.root)
		out = in
	case comm.OpBroadcast:
		err = cm.Broadcast(ctx, tensor(dt, in), c.root)
		out = in
	case comm.OpReduceScatter:
		err = cm.ReduceScatter(ctx, tensor(dt, out), tensor(dt, in), c.op)
	case comm.OpAllGather:
		err = cm.AllGather(ctx, tensor(dt, out), tensor(dt, in))
	case comm.OpAllGatherV:
		err = cm.AllGatherV(ctx, tensor(dt, out), tensor(dt, in), c.counts)
	case comm.OpReduceScatterV:
		err = cm.ReduceScatterV(ctx, tensor(dt, out), tensor(dt, in), c.counts, c.op)
	case comm.OpGather:
		var o comm.Tensor
		if r == c.root {
			o = tensor(dt, out)
		}
		err = cm.Gather(ctx, o, tensor(dt, in), c.root)
		if r != c.root {
			return err
		}
	case comm.OpScatter:
		var i comm.Tensor
		if r == c.root {
			i = tensor(dt, in)
		}
		err = cm.Scatter(ctx, tensor(dt, out), i, c.root)
	case comm.OpAllToAll:
		err = cm.AllToAll(ctx, tensor(dt, out), tensor(dt, in))
	case comm.OpAllToAllV:
		err = cm.AllToAllV(ctx, tensor(dt, out), c.outCnts[r], tensor(dt, in), c.inCounts[r])
	case comm.OpBarrier:
		return cm.Barrier(ctx)
	case comm.OpSend: // a ring of Send/Recv; even ranks send first
		out = sentinel(len(in))
		right, left := (r+1)%n, (r+n-1)%n
		if r%2 == 0 {
			if err = cm.Send(ctx, tensor(dt, in), right); err == nil {
				err = cm.Recv(ctx, tensor(dt, out), left)
			}
		} else {
			if err = cm.Recv(ctx, tensor(dt, out), left); err == nil {
				err = cm.Send(ctx, tensor(dt, in), right)
			}
		}
	case comm.OpBatchP2P: // everyone exchanges block p of its input with p
		es, k := dt.Size(), c.p2pSize
		out = sentinel(len(in))
		var ops []comm.P2POp
		for p := range n {
			if p != r {
				ops = append(ops, comm.P2POp{Kind: comm.P2PRecv, Tensor: tensor(dt, out[p*k*es:(p+1)*k*es]), Peer: p},
					comm.P2POp{Kind: comm.P2PSend, Tensor: tensor(dt, in[p*k*es:(p+1)*k*es]), Peer: p})
			}
		}
		if err = cm.BatchP2P(ctx, ops); err != nil {
			return err
		}
		for p := range n {
			if p != r {
				if e := diff(out[p*k*es:(p+1)*k*es], c.in[p][r*k*es:(r+1)*k*es]); e != nil {
					return fmt.Errorf("from rank %d: %w", p, e)
				}
			}
		}
		return nil
	}
	if err != nil {
		return err
	}
	if err := diff(out, c.want[r]); err != nil {
		return err
	}
	if c.kind != comm.OpAllReduce && c.kind != comm.OpReduce && c.kind != comm.OpBroadcast && c.in != nil {
		if err := diff(in, c.in[r]); err != nil {
			return fmt.Errorf("input modified: %w", err)
		}
	}
	return nil
}

// TestCollectivesAgainstReference runs every collective × dtype × reduce op over world
// sizes 1–8 with each algorithm forced and auto, and compares every rank's
// buffers with a direct computation (reductions in rank order, as
// comm/inproc does). The 18 jobs run at once: each is latency-bound, and
// t.Parallel would run only GOMAXPROCS of them at a time.
// matrixJobs is every algorithm over both transports (shared memory and
// TCP; the same-host default is shared memory).
func matrixJobs() (jobs []struct {
	algo Algorithm
	shm  bool
}) {
	for _, algo := range algorithms {
		for _, shm := range []bool{true, false} {
			jobs = append(jobs, struct {
				algo Algorithm
				shm  bool
			}{algo, shm})
		}
	}
	return jobs
}

func TestCollectivesAgainstReference(t *testing.T) {
	type jobResult struct {
		name string
		err  error
	}
	var wg sync.WaitGroup
	results := make(chan jobResult, 64)
	// A few jobs at a time: all 36 at once oversubscribed 2 cores under
	// -race so much that a job could miss its deadline.
	slots := make(chan struct{}, 4)
	for _, n := range []int{1, 2, 3, 4, 7, 8} {
		cases := matrixCases(n)
		for _, job := range matrixJobs() {
			algo, shm := job.algo, job.shm
			name := fmt.Sprintf("n=%d/%s/%s", n, algo, transportName(shm))
			slots <- struct{}{}
			j := newJob(t, n, func(c *Config) {
				c.Algorithm = algo
				c.SegmentSize = 4 << 10
				c.SmallThreshold = 256
				c.SharedMemory = shm
			})
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-slots }()
				defer j.close()
				errs := j.run(func(r int, cm *comm.Comm) error {
					var failed []string
					for _, c := range cases {
						// A deadline per case, not per job: a job's ~700
						// cases on a loaded 2-core machine under -race can
						// take minutes in all, while one case taking a
						// minute is a hang.
						ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
						err := runCase(ctx, cm, c, n, r)
						cancel()
						if err != nil {
							failed = append(failed, fmt.Sprintf("%s: %v", c.name, err))
							if len(failed) > 4 || cm.Err() != nil {
								break
							}
						}
					}
					if len(failed) > 0 {
						return fmt.Errorf("%d of %d cases failed: %v", len(failed), len(cases), failed)
					}
					return nil
				})
				for r, err := range errs {
					if err != nil {
						results <- jobResult{fmt.Sprintf("%s rank %d", name, r), err}
					}
				}
			}()
		}
	}
	wg.Wait()
	close(results)
	for res := range results {
		t.Errorf("%s: %v", res.name, res.err)
	}
}

// In-place all-gather (in is this rank's block of out) and reduce-scatter
// (out is this rank's block of in) give the results of the out-of-place
// ops, with every algorithm and transport.
func TestInPlaceAllGatherAndReduceScatter(t *testing.T) {
	for _, job := range matrixJobs() {
		t.Run(fmt.Sprintf("%s/%s", job.algo, transportName(job.shm)), func(t *testing.T) {
			const n, count = 3, 1000
			j := newJob(t, n, func(c *Config) {
				c.Algorithm = job.algo
				c.SharedMemory = job.shm
				c.SegmentSize = 4 << 10
				c.SmallThreshold = 256
			})
			defer j.close()
			j.mustRun(func(r int, cm *comm.Comm) error {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				buf := make([]float32, n*count)
				for i := range count {
					buf[r*count+i] = float32(r*10 + i%7)
				}
				if err := cm.AllGather(ctx, comm.Float32s(buf), comm.Float32s(buf[r*count:(r+1)*count])); err != nil {
					return err
				}
				for q := range n {
					for i := range count {
						if want := float32(q*10 + i%7); buf[q*count+i] != want {
							return fmt.Errorf("all-gather: element %d of block %d is %v, want %v", i, q, buf[q*count+i], want)
						}
					}
				}
				for i := range buf {
					buf[i] = float32(r + 1 + i%5)
				}
				if err := cm.ReduceScatter(ctx, comm.Float32s(buf[r*count:(r+1)*count]), comm.Float32s(buf), comm.Sum); err != nil {
					return err
				}
				for i := range count {
					k := r*count + i
					if want := float32(n*(n+1)/2 + n*(k%5)); buf[k] != want {
						return fmt.Errorf("reduce-scatter: element %d is %v, want %v", i, buf[k], want)
					}
				}
				return nil
			})
		})
	}
}
