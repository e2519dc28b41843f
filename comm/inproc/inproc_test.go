package inproc_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// world starts n ranks of one comm and returns them by rank.
func world(t *testing.T, cl *inproc.Cluster, n int, epoch uint64) []*comm.Comm {
	t.Helper()
	cs := make([]*comm.Comm, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cs[r], errs[r] = comm.New(context.Background(), "inproc", comm.Options{
				Rank: r, Size: n, Epoch: epoch, Store: memstore.New(), BackendConfig: cl, Timeout: 10 * time.Second})
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	t.Cleanup(func() {
		for _, c := range cs {
			c.Close()
		}
	})
	return cs
}

// each runs f on every rank concurrently and returns the errors by rank.
func each(n int, f func(r int) error) []error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() { defer wg.Done(); errs[r] = f(r) }()
	}
	wg.Wait()
	return errs
}

func noErr(t *testing.T, errs []error) {
	t.Helper()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
}

func TestCollectives(t *testing.T) {
	ctx := context.Background()
	for _, n := range []int{1, 2, 3, 5} {
		for _, count := range []int{0, 1, 7} {
			t.Run(fmt.Sprintf("n%d/count%d", n, count), func(t *testing.T) {
				cs := world(t, inproc.NewCluster(), n, 0)
				val := func(r, i int) int64 { return int64(r*100 + i) }
				in := func(r, k int) []int64 {
					x := make([]int64, k)
					for i := range x {
						x[i] = val(r, i)
					}
					return x
				}
				noErr(t, each(n, func(r int) error {
					c := cs[r]
					// AllReduce sum and max
					x := in(r, count)
					if err := c.AllReduce(ctx, comm.Int64s(x), comm.Sum); err != nil {
						return err
					}
					for i := range x {
						var want int64
						for p := range n {
							want += val(p, i)
						}
						if x[i] != want {
							return fmt.Errorf("allreduce[%d] = %d, want %d", i, x[i], want)
						}
					}
					// Avg on floats
					f := []float64{float64(r), 1}
					if err := c.AllReduce(ctx, comm.Float64s(f), comm.Avg); err != nil {
						return err
					}
					if f[0] != float64(n-1)/2 || f[1] != 1 {
						return fmt.Errorf("avg = %v", f)
					}
					// AllGather
					out := make([]int64, count*n)
					if err := c.AllGather(ctx, comm.Int64s(out), comm.Int64s(in(r, count))); err != nil {
						return err
					}
					for p := range n {
						for i := range count {
							if out[p*count+i] != val(p, i) {
								return fmt.Errorf("allgather block %d = %v", p, out[p*count:(p+1)*count])
							}
						}
					}
					// ReduceScatter
					rs := make([]int64, count)
					if err := c.ReduceScatter(ctx, comm.Int64s(rs), comm.Int64s(in(r, count*n)), comm.Max); err != nil {
						return err
					}
					for i := range rs {
						if rs[i] != val(n-1, r*count+i) {
							return fmt.Errorf("reducescatter[%d] = %d", i, rs[i])
						}
					}
					// Broadcast from the last rank; Reduce to rank 0
					b := in(r, count)
					if err := c.Broadcast(ctx, comm.Int64s(b), n-1); err != nil {
						return err
					}
					for i := range b {
						if b[i] != val(n-1, i) {
							return fmt.Errorf("broadcast[%d] = %d", i, b[i])
						}
					}
					red := in(r, count)
					if err := c.Reduce(ctx, comm.Int64s(red), comm.Min, 0); err != nil {
						return err
					}
					for i := range red {
						want := val(0, i)
						if r != 0 {
							want = val(r, i) // unchanged off root
						}
						if red[i] != want {
							return fmt.Errorf("reduce[%d] = %d, want %d", i, red[i], want)
						}
					}
					// Scatter and Gather rooted at n/2
					root := n / 2
					var big comm.Tensor
					if r == root {
						big = comm.Int64s(in(r, count*n))
					}
					sc := make([]int64, count)
					if err := c.Scatter(ctx, comm.Int64s(sc), big, root); err != nil {
						return err
					}
					for i := range sc {
						if sc[i] != val(root, r*count+i) {
							return fmt.Errorf("scatter[%d] = %d", i, sc[i])
						}
					}
					var gout comm.Tensor
					g := make([]int64, count*n)
					if r == root {
						gout = comm.Int64s(g)
					}
					if err := c.Gather(ctx, gout, comm.Int64s(in(r, count)), root); err != nil {
						return err
					}
					if r == root {
						for p := range n {
							for i := range count {
								if g[p*count+i] != val(p, i) {
									return fmt.Errorf("gather block %d wrong: %v", p, g)
								}
							}
						}
					}
					// AllToAll: block p of rank r's input is val(r, p*count+i)
					a2a := make([]int64, count*n)
					if err := c.AllToAll(ctx, comm.Int64s(a2a), comm.Int64s(in(r, count*n))); err != nil {
						return err
					}
					for p := range n {
						for i := range count {
							if a2a[p*count+i] != val(p, r*count+i) {
								return fmt.Errorf("alltoall block %d wrong: %v", p, a2a)
							}
						}
					}
					// AllGatherV: rank p contributes p+count elements
					counts := make([]int, n)
					total := 0
					for p := range counts {
						counts[p] = p + count
						total += counts[p]
					}
					gv := make([]int64, total)
					if err := c.AllGatherV(ctx, comm.Int64s(gv), comm.Int64s(in(r, r+count)), counts); err != nil {
						return err
					}
					off := 0
					for p := range n {
						for i := range counts[p] {
							if gv[off+i] != val(p, i) {
								return fmt.Errorf("allgatherv block %d wrong: %v", p, gv)
							}
						}
						off += counts[p]
					}
					// AllToAllV: rank r sends (r+q)%2+count elements to rank q
					sendTo := func(from, to int) int { return (from+to)%2 + count }
					inC, outC := make([]int, n), make([]int, n)
					inTotal, outTotal := 0, 0
					for q := range n {
						inC[q], outC[q] = sendTo(r, q), sendTo(q, r)
						inTotal += inC[q]
						outTotal += outC[q]
					}
					src := make([]int64, inTotal)
					off = 0
					for q := range n {
						for i := range inC[q] {
							src[off+i] = int64(r*1000 + q*10 + i)
						}
						off += inC[q]
					}
					dst := make([]int64, outTotal)
					if err := c.AllToAllV(ctx, comm.Int64s(dst), outC, comm.Int64s(src), inC); err != nil {
						return err
					}
					off = 0
					for q := range n {
						for i := range outC[q] {
							if dst[off+i] != int64(q*1000+r*10+i) {
								return fmt.Errorf("alltoallv from %d wrong: %v", q, dst)
							}
						}
						off += outC[q]
					}
					return c.Barrier(ctx)
				}))
			})
		}
	}
}

func TestPointToPoint(t *testing.T) {
	ctx := context.Background()
	cs := world(t, inproc.NewCluster(), 3, 0)
	noErr(t, each(3, func(r int) error {
		c := cs[r]
		// a ring exchange through a batch
		send := []float32{float32(r), float32(r) + 0.5}
		recv := make([]float32, 2)
		left, right := (r+2)%3, (r+1)%3
		if err := c.BatchP2P(ctx, []comm.P2POp{
			{Kind: comm.P2PSend, Tensor: comm.Float32s(send), Peer: right},
			{Kind: comm.P2PRecv, Tensor: comm.Float32s(recv), Peer: left},
		}); err != nil {
			return err
		}
		if recv[0] != float32(left) || recv[1] != float32(left)+0.5 {
			return fmt.Errorf("batch received %v from %d", recv, left)
		}
		// rank 0 sends 3 elements to rank 1, which posts room for 2: a mismatch
		switch r {
		case 0:
			return c.Send(ctx, comm.Float32s(make([]float32, 3)), 1)
		case 1:
			err := c.Recv(ctx, comm.Float32s(make([]float32, 2)), 0)
			if !errors.Is(err, comm.ErrMismatch) {
				return fmt.Errorf("size mismatch: %v", err)
			}
		}
		return nil
	}))
}

func TestMismatchFailsEveryRank(t *testing.T) {
	cs := world(t, inproc.NewCluster(), 3, 0)
	bufs := [][]int32{{1, 2}, {1, 2}, {1, 2, 3}}
	errs := each(3, func(r int) error {
		return cs[r].AllReduce(context.Background(), comm.Int32s(bufs[r]), comm.Sum)
	})
	for r, err := range errs {
		if !errors.Is(err, comm.ErrMismatch) {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	if bufs[0][0] != 1 || bufs[2][2] != 3 {
		t.Fatal("buffers changed by a mismatched op")
	}
}

func TestPeerFailureThenShrinkAndGrow(t *testing.T) {
	ctx := context.Background()
	cl := inproc.NewCluster()
	cs := world(t, cl, 4, 1)
	// Rank 2 dies; the others' allreduce fails naming it.
	cs[2].Backend().(*inproc.Backend).Fail()
	errs := each(4, func(r int) error {
		if r == 2 {
			return nil
		}
		return cs[r].AllReduce(ctx, comm.Float32s([]float32{1}), comm.Sum)
	})
	for _, r := range []int{0, 1, 3} {
		var re *comm.RankError
		if !errors.As(errs[r], &re) || re.Rank != 2 || !errors.Is(errs[r], comm.ErrPeerFailed) {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
	}
	// Survivors shrink to 3 ranks at epoch 2, renumbered in order.
	small := make([]*comm.Comm, 3)
	noErr(t, each(3, func(i int) error {
		old := []int{0, 1, 3}[i]
		nc, err := cs[old].Shrink(ctx, []int{2}, 2)
		small[i] = nc
		return err
	}))
	for i, c := range small {
		if c.Rank() != i || c.Size() != 3 || c.Epoch() != 2 {
			t.Fatalf("shrunk comm %d: rank %d size %d epoch %d", i, c.Rank(), c.Size(), c.Epoch())
		}
	}
	noErr(t, each(3, func(i int) error {
		x := []float32{1}
		if err := small[i].AllReduce(ctx, comm.Float32s(x), comm.Sum); err != nil {
			return err
		}
		if x[0] != 3 {
			return fmt.Errorf("sum over 3 = %v", x[0])
		}
		return nil
	}))
	// A replacement joins: grow back to 4 at epoch 3.
	grown := make([]*comm.Comm, 4)
	noErr(t, each(4, func(r int) error {
		var err error
		if r < 3 {
			grown[r], err = small[r].Grow(ctx, 4, 3)
		} else {
			grown[r], err = comm.New(ctx, "inproc", comm.Options{Rank: 3, Size: 4, Epoch: 3, Store: memstore.New(), BackendConfig: cl})
		}
		return err
	}))
	noErr(t, each(4, func(r int) error {
		defer grown[r].Close()
		x := []int32{int32(r)}
		if err := grown[r].AllReduce(ctx, comm.Int32s(x), comm.Sum); err != nil {
			return err
		}
		if x[0] != 6 {
			return fmt.Errorf("sum over 4 = %d", x[0])
		}
		return nil
	}))
}

func TestRevokeReachesPeers(t *testing.T) {
	cs := world(t, inproc.NewCluster(), 3, 0)
	started := make(chan struct{}, 2)
	errs := each(3, func(r int) error {
		if r == 0 {
			<-started
			<-started
			cs[0].Revoke(errors.New("new epoch"))
			return nil
		}
		started <- struct{}{}
		return cs[r].Barrier(context.Background()) // waits for rank 0, which never joins
	})
	for _, r := range []int{1, 2} {
		if !errors.Is(errs[r], comm.ErrRevoked) {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
	}
}

func TestSplit(t *testing.T) {
	ctx := context.Background()
	cs := world(t, inproc.NewCluster(), 5, 0)
	subs := make([]*comm.Comm, 5)
	noErr(t, each(5, func(r int) error {
		color := r % 2
		if r == 4 {
			color = comm.NoColor
		}
		var err error
		subs[r], err = cs[r].Split(ctx, color, -r) // key reverses the order
		return err
	}))
	if subs[4] != nil {
		t.Fatal("NoColor rank got a comm")
	}
	// color 0: ranks 0, 2 → new ranks 1, 0; color 1: ranks 1, 3 → 1, 0
	for r, want := range map[int]int{0: 1, 2: 0, 1: 1, 3: 0} {
		if subs[r].Rank() != want || subs[r].Size() != 2 {
			t.Fatalf("rank %d: split rank %d size %d", r, subs[r].Rank(), subs[r].Size())
		}
	}
	noErr(t, each(4, func(r int) error {
		defer subs[r].Close()
		x := []int64{int64(r)}
		if err := subs[r].AllReduce(ctx, comm.Int64s(x), comm.Sum); err != nil {
			return err
		}
		if want := int64(2 + 2*(r%2)); x[0] != want {
			return fmt.Errorf("rank %d: split sum %d, want %d", r, x[0], want)
		}
		return nil
	}))
	// the parent still works
	noErr(t, each(5, func(r int) error { return cs[r].Barrier(ctx) }))
}

// A rank that grows into a new epoch posts nothing more on the old comm:
// a peer still in an op of the old comm that waits for it fails at once
// with ErrPeerClosed (as gloo's peers do when its links move to the new
// comm), then grows too. Before, the peer waited out the op's timeout
// while the grower waited for it in the new epoch.
func TestGrowWhilePeerInOldOp(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cl := inproc.NewCluster()
	cs := world(t, cl, 2, 1)
	grown := make([]*comm.Comm, 3)
	errs := each(3, func(r int) error {
		var err error
		switch r {
		case 0:
			grown[0], err = cs[0].Grow(ctx, 3, 2)
		case 1: // still in the old epoch's step
			opErr := cs[1].AllReduce(ctx, comm.Float32s([]float32{1}), comm.Sum)
			if !errors.Is(opErr, comm.ErrPeerClosed) {
				return fmt.Errorf("op on the old comm while rank 0 grew: %v, want ErrPeerClosed", opErr)
			}
			grown[1], err = cs[1].Grow(ctx, 3, 2)
		case 2:
			grown[2], err = comm.New(ctx, "inproc", comm.Options{Rank: 2, Size: 3, Epoch: 2, Store: memstore.New(), BackendConfig: cl})
		}
		return err
	})
	noErr(t, errs)
	noErr(t, each(3, func(r int) error {
		defer grown[r].Close()
		return grown[r].AllReduce(ctx, comm.Float32s([]float32{1}), comm.Sum)
	}))
}
