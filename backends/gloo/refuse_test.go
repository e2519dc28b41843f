package gloo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// refusedWithin bounds how long a peer of a refused op may take to fail:
// far below the op deadline (testOptions: 60 s), so a peer that waited for
// its deadline, or for the comm's, cannot pass.
const refusedWithin = 5 * time.Second

// rcase is a collective one rank refuses: good is every other rank's valid
// op (it reports whether its output is untouched), bad the culprit's op
// with one bad argument, and why a word of the culprit's reason.
type rcase struct {
	name string
	good mop
	bad  func(ctx context.Context, c *comm.Comm, r, n int) error
	why  string
}

func refusedCollectives() []rcase {
	f32 := func(k int) comm.Tensor { return comm.Float32s(make([]float32, k)) }
	const small, large = 16, 100000 // one-shot or recursive doubling; ring
	return []rcase{
		{"allreduce small, no tensor", allReduceOp(comm.Float32, small, comm.Sum),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.AllReduce(ctx, comm.Tensor{}, comm.Sum)
			}, "no tensor"},
		{"allreduce small, bitwise op on floats", allReduceOp(comm.Float32, small, comm.Sum),
			func(ctx context.Context, c *comm.Comm, r, n int) error { return c.AllReduce(ctx, f32(small), comm.BOr) }, "not supported"},
		{"allreduce large, device tensor", allReduceOp(comm.Float32, large, comm.Sum),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.AllReduce(ctx, comm.DeviceTensor(0x1000, 0, large, comm.Float32), comm.Sum)
			}, "device tensor"},
		{"allreduce medium int8, bad reduce op", allReduceOp(comm.Int8, 3000, comm.Max),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.AllReduce(ctx, comm.Int8s(make([]int8, 3000)), 0)
			}, "not defined"},
		{"reducescatter, wrong in", reduceScatterOp(large / 4),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.ReduceScatter(ctx, f32(large/4), f32(large/4*n+1), comm.Sum)
			}, "in has"},
		{"reducescatterv, counts", reduceScatterVOp(),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.ReduceScatterV(ctx, f32(1), f32(n), make([]int, n+1), comm.Sum)
			}, "one per rank"},
		{"allgather, wrong out", allGatherOp(small),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.AllGather(ctx, f32(small*n-1), f32(small))
			}, "out has"},
		{"allgatherv, negative count", allGatherVOp(0),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				counts := make([]int, n)
				counts[(r+1)%n] = -1
				return c.AllGatherV(ctx, f32(1), f32(0), counts)
			}, "negative"},
		{"broadcast small, root outside", broadcastOp(small, 0),
			func(ctx context.Context, c *comm.Comm, r, n int) error { return c.Broadcast(ctx, f32(small), n) }, "root"},
		{"broadcast large, root negative", broadcastOp(large, 1),
			func(ctx context.Context, c *comm.Comm, r, n int) error { return c.Broadcast(ctx, f32(large), -1) }, "root -1"},
		{"reduce, root outside", reduceOp(large, 0),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.Reduce(ctx, f32(large), comm.Sum, n+2)
			}, "root"},
		{"scatter, root outside", scatterOp(small),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.Scatter(ctx, f32(small), f32(small*n), n)
			}, "root"},
		{"gather, root negative", gatherOp(small),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.Gather(ctx, f32(small*n), f32(small), -2)
			}, "root"},
		{"alltoall, unequal", allToAllOp(small),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.AllToAll(ctx, f32(small*n), f32(small*n+n))
			}, "must be equal"},
		{"alltoallv, counts", allToAllVOp(0),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.AllToAllV(ctx, f32(n), make([]int, n), f32(n), []int{n})
			}, "inCounts"},
		{"barrier, refused by the caller", barrierOp(),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				return c.Refuse(ctx, comm.Op{Kind: comm.OpBarrier}, errors.New("test: the caller refused"))
			}, "the caller refused"},
		{"async, behind an async op", asyncPairOp(),
			func(ctx context.Context, c *comm.Comm, r, n int) error {
				w1 := c.AllReduceAsync(ctx, f32s(1, 1, 1, 1, 1, 1, 1, 1), comm.Sum)
				w2 := c.BroadcastAsync(ctx, f32(8), n)
				if err := w1.Wait(ctx); err != nil {
					return fmt.Errorf("the valid op before the refused one: %w", err)
				}
				return w2.Wait(ctx)
			}, "root"},
	}
}

func reduceScatterVOp() mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		counts := make([]int, n)
		for i := range counts {
			counts[i] = 5 + i
		}
		in := input(comm.Float32, comm.Sum, r, sum(counts), 1)
		out := sentinel(counts[r] * 4)
		err := c.ReduceScatterV(ctx, tensor(comm.Float32, out), tensor(comm.Float32, in), counts, comm.Sum)
		return err, bytes.Equal(out, sentinel(len(out)))
	}
}

func allGatherOp(count int) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		in := input(comm.Float32, comm.Sum, r, count, 1)
		out := sentinel(count * n * 4)
		err := c.AllGather(ctx, tensor(comm.Float32, out), tensor(comm.Float32, in))
		return err, bytes.Equal(out, sentinel(len(out)))
	}
}

func scatterOp(count int) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		in := input(comm.Float32, comm.Sum, r, count*n, 1)
		out := sentinel(count * 4)
		err := c.Scatter(ctx, tensor(comm.Float32, out), tensor(comm.Float32, in), 0)
		return err, bytes.Equal(out, sentinel(len(out)))
	}
}

func gatherOp(count int) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		in := input(comm.Float32, comm.Sum, r, count, 1)
		out := sentinel(count * n * 4)
		err := c.Gather(ctx, tensor(comm.Float32, out), tensor(comm.Float32, in), n-1)
		return err, bytes.Equal(out, sentinel(len(out)))
	}
}

func allToAllOp(count int) mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		in := input(comm.Float32, comm.Sum, r, count*n, 1)
		out := sentinel(count * n * 4)
		err := c.AllToAll(ctx, tensor(comm.Float32, out), tensor(comm.Float32, in))
		return err, bytes.Equal(out, sentinel(len(out)))
	}
}

func barrierOp() mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) { return c.Barrier(ctx), true }
}

// asyncPairOp is an async all-reduce and an async broadcast issued back to
// back: the first must succeed at every rank, the second is what is
// refused.
func asyncPairOp() mop {
	return func(ctx context.Context, c *comm.Comm, r, n int) (error, bool) {
		x := make([]float32, 8)
		for i := range x {
			x[i] = 1
		}
		in := input(comm.Float32, comm.Sum, r, 8, 1)
		buf := bytes.Clone(in)
		w1 := c.AllReduceAsync(ctx, comm.Float32s(x), comm.Sum)
		w2 := c.BroadcastAsync(ctx, tensor(comm.Float32, buf), 0)
		if err := w1.Wait(ctx); err != nil {
			return fmt.Errorf("the valid op before the refused one: %w", err), false
		}
		if x[0] != float32(n) {
			return fmt.Errorf("the valid op before the refused one summed to %v, want %d", x[0], n), false
		}
		err := w2.Wait(ctx)
		return err, bytes.Equal(buf, in)
	}
}

// checkRefused checks what each rank's op of a step returned: the culprit
// its own ErrInvalidArgument, every other rank ErrPeerRefused naming the
// culprit with its reason, within refusedWithin, its buffers untouched;
// and every comm still usable.
func checkRefused(t *testing.T, what string, culprit int, why string, errs []error, took []time.Duration, untouched []bool, comms []*comm.Comm) {
	t.Helper()
	for r, err := range errs {
		if took[r] > refusedWithin {
			t.Errorf("%s: rank %d took %v", what, r, took[r])
		}
		if r == culprit {
			if !errors.Is(err, comm.ErrInvalidArgument) || errors.Is(err, comm.ErrPeerRefused) {
				t.Errorf("%s: culprit %d: got %v, want its own ErrInvalidArgument", what, r, err)
			}
			continue
		}
		var re *comm.RankError
		var ref *comm.Refusal
		switch {
		case !errors.Is(err, comm.ErrPeerRefused) || errors.Is(err, comm.ErrInvalidArgument):
			t.Errorf("%s: rank %d: got %v, want ErrPeerRefused", what, r, err)
		case !errors.As(err, &re) || re.Rank != culprit:
			t.Errorf("%s: rank %d: %v does not name rank %d", what, r, err, culprit)
		case !errors.As(err, &ref) || ref.Rank != culprit || !strings.Contains(ref.Reason, why) || !strings.Contains(err.Error(), why):
			t.Errorf("%s: rank %d: %v does not say why (%q)", what, r, err, why)
		case untouched != nil && !untouched[r]:
			t.Errorf("%s: rank %d: buffer written", what, r)
		}
	}
	for r, c := range comms {
		if err := c.Err(); err != nil {
			t.Errorf("%s: rank %d: comm broken: %v", what, r, err)
		}
	}
}

// runTimed runs f on every rank and returns the errors and how long each
// rank's f took.
func runTimed(j *job, f func(r int, c *comm.Comm) error) ([]error, []time.Duration) {
	took := make([]time.Duration, len(j.comms))
	errs := j.run(func(r int, c *comm.Comm) error {
		t0 := time.Now()
		err := f(r, c)
		took[r] = time.Since(t0)
		return err
	})
	return errs, took
}

// TestRefusedCollective: when one rank refuses a collective (an invalid
// argument there) and the others issue it validly, every other rank's op
// fails at once with ErrPeerRefused naming that rank and its reason, no
// buffer is written, and the same comm runs the next op correctly on every
// rank — over TCP and shared memory, for every collective, with several
// refusals in a row on one comm.
func TestRefusedCollective(t *testing.T) {
	for _, shm := range []bool{false, true} {
		for _, n := range []int{2, 3, 4} {
			t.Run(fmt.Sprintf("%s/n=%d", transportName(shm), n), func(t *testing.T) {
				j := newJob(t, n, func(c *Config) { c.SharedMemory = shm })
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				defer cancel()
				for i, tc := range refusedCollectives() {
					culprit := []int{0, n - 1, 1}[i%3] % n
					untouched := make([]bool, n)
					errs, next := make([]error, n), make([]error, n)
					count := []int{1000, 100000}[i%2] // the next all-reduce: small, then ring
					_, took := runTimed(j, func(r int, c *comm.Comm) error {
						// Each rank goes on to the next op as soon as its own
						// is over: a fast rank's next frames meet a slow
						// one still in the refused op.
						if r == culprit {
							errs[r] = tc.bad(ctx, c, r, n)
						} else {
							errs[r], untouched[r] = tc.good(ctx, c, r, n)
						}
						next[r] = sumCheck(ctx, c, count)
						return nil
					})
					checkRefused(t, tc.name, culprit, tc.why, errs, took, untouched, nil)
					for r, err := range next {
						if err != nil {
							t.Fatalf("%s: the op after the refused one: rank %d: %v", tc.name, r, err)
						}
					}
					for r, c := range j.comms {
						if err := c.Err(); err != nil {
							t.Fatalf("%s: rank %d: comm broken: %v", tc.name, r, err)
						}
					}
				}
			})
		}
	}
}

// TestRefusedCollectiveDeliveryCountedBeforeNextOp: a peer's frame of a
// collective that is then refused is delivered, and the reader is held
// just after it let go of the link; the refused op ends and the next
// all-reduce posts its receive before the reader goes on. The next op
// must still wait for its own frame: the delivery of the refused op's one
// is counted before the link is released, not after (it was once counted
// after, and a next all-reduce then summed an empty scratch buffer
// without an error: 8 instead of 10 in TestRefusedCollective beside CPU
// hogs).
func TestRefusedCollectiveDeliveryCountedBeforeNextOp(t *testing.T) {
	const n = 3
	j := newJob(t, n, func(c *Config) { c.SharedMemory = false })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b2 := backendOf(j.comms[2])
	refused := b2.collSeq + 1 // the job is idle: no op goroutine runs
	held, release := make(chan struct{}), make(chan struct{})
	let := sync.OnceFunc(func() { close(release) })
	defer let() // a failed wait below must not leave the reader held
	var once bool
	hook := func(peer int, seq uint64) {
		if peer == 1 && seq == refused && !once { // only rank 2's reader of rank 1 calls it
			once = true
			close(held)
			<-release
		}
	}
	b2.testDelivered.Store(&hook)
	defer b2.testDelivered.Store(nil)
	ran := make(chan []error, 1)
	go func() {
		ran <- j.run(func(r int, c *comm.Comm) error {
			var err error
			if r == 0 {
				select {
				case <-held: // rank 1's frame reached rank 2 before the refusal
				case <-ctx.Done():
					return ctx.Err()
				}
				err = c.AllReduce(ctx, comm.Tensor{}, comm.Sum)
			} else {
				err = c.AllReduce(ctx, comm.Float32s(make([]float32, 16)), comm.Sum)
			}
			if want := []error{comm.ErrInvalidArgument, comm.ErrPeerRefused, comm.ErrPeerRefused}[r]; !errors.Is(err, want) {
				return fmt.Errorf("the refused op: %v, want %v", err, want)
			}
			return sumCheck(ctx, c, 16)
		})
	}()
	select {
	case <-held:
	case errs := <-ran:
		t.Fatalf("the ops ended before rank 1's frame reached rank 2: %v", errs)
	}
	// Rank 2's op is waiting for rank 0 now; its next op has to post its
	// receive from rank 1 while the reader is still held.
	waitFor(t, "rank 2 posted the next all-reduce's receive from rank 1", func() bool {
		l := b2.links[1]
		l.mu.Lock()
		defer l.mu.Unlock()
		return slices.ContainsFunc(l.posts[l.phead:], func(e entry) bool { return e.seq == refused+1 })
	})
	let()
	for r, err := range <-ran {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// TestRefusedCollectiveBeforeThePeersStart: two ranks refuse
// the same collective, and a peer that starts its op only after the
// refusals reached it fails at its start; the comm goes on.
func TestRefusedCollectiveBeforeThePeersStart(t *testing.T) {
	const n = 3
	// TCP: a rank reads a shared-memory ring only while it runs an op, so
	// there rank 2 would learn of the refusals only once its op runs.
	j := newJob(t, n, func(c *Config) { c.SharedMemory = false })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	x := comm.Float32s(make([]float32, 64))
	// Ranks 0 and 1 refuse; rank 2 waits until it has heard from both
	// before it issues its broadcast.
	errs := make([]error, n)
	for r := range 2 {
		errs[r] = j.comms[r].Broadcast(ctx, x, 7)
	}
	b2 := backendOf(j.comms[2])
	waitFor(t, "both refusals at rank 2", func() bool {
		b2.rmu.Lock()
		defer b2.rmu.Unlock()
		return len(b2.refColl) == 1 && b2.refColl[0].heard == 2
	})
	t0 := time.Now()
	errs[2] = j.comms[2].Broadcast(ctx, x, 0)
	if !errors.Is(errs[2], comm.ErrPeerRefused) || time.Since(t0) > refusedWithin {
		t.Fatalf("rank 2: %v after %v", errs[2], time.Since(t0))
	}
	if rk := rankOf(errs[2]); rk != 0 && rk != 1 {
		t.Fatalf("rank 2: %v names rank %d", errs[2], rk)
	}
	for r := range 2 {
		if !errors.Is(errs[r], comm.ErrInvalidArgument) {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
	}
	j.mustRun(func(r int, c *comm.Comm) error { return sumCheck(ctx, c, 1000) })
	// Every rank has forgotten the refusal: every marker came.
	waitFor(t, "refusals forgotten", func() bool {
		for _, c := range j.comms {
			if backendOf(c).nRefColl.Load() != 0 {
				return false
			}
		}
		return true
	})
}

// p2pStep is one step of TestRefusedPointToPoint: what each rank does.
type p2pStep struct {
	name    string
	culprit int
	why     string
	// peers: the ranks whose op must fail with the refusal; maybe: those
	// whose op may also succeed (a send that completed before the refusal
	// reached it); any other rank's op must succeed.
	peers, maybe []int
	run          func(ctx context.Context, r int, c *comm.Comm) error
}

func f32s(v ...float32) comm.Tensor { return comm.Float32s(v) }

// exchange has from send vals to to, which checks what it receives.
func exchange(ctx context.Context, c *comm.Comm, r, from, to int, vals []float32) error {
	switch r {
	case from:
		return c.Send(ctx, comm.Float32s(vals), to)
	case to:
		got := make([]float32, len(vals))
		if err := c.Recv(ctx, comm.Float32s(got), from); err != nil {
			return err
		}
		if !slicesEqual(got, vals) {
			return fmt.Errorf("rank %d received %v from %d, want %v", to, got[:min(4, len(got))], from, vals[:min(4, len(vals))])
		}
	}
	return nil
}

func slicesEqual(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func ramp(n int, base float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = base + float32(i)
	}
	return v
}

// TestRefusedPointToPoint: the peer of a refused send or receive fails at
// once with ErrPeerRefused naming the refusing rank (a send that had
// already handed its data over may succeed instead: the data is dropped),
// the other parts of a batch complete, and the next messages between the
// same ranks carry the right data, over TCP and shared memory.
func TestRefusedPointToPoint(t *testing.T) {
	const n, big = 3, 16 << 20 / 4 // big: more than socket buffers and a ring hold
	steps := []p2pStep{
		{name: "send without a tensor", culprit: 0, why: "no tensor", peers: []int{1},
			run: func(ctx context.Context, r int, c *comm.Comm) error {
				switch r {
				case 0:
					return c.Send(ctx, comm.Tensor{}, 1)
				case 1:
					return c.Recv(ctx, f32s(7, 7, 7), 0)
				}
				return nil
			}},
		{name: "recv into a ragged buffer", culprit: 1, why: "whole number", maybe: []int{0},
			run: func(ctx context.Context, r int, c *comm.Comm) error {
				switch r {
				case 0:
					return c.Send(ctx, f32s(1, 2, 3), 1)
				case 1:
					return c.Recv(ctx, comm.HostBytes(comm.Float32, make([]byte, 10)), 0)
				}
				return nil
			}},
		{name: "recv of a large message, refused", culprit: 2, why: "device tensor", maybe: []int{0},
			run: func(ctx context.Context, r int, c *comm.Comm) error {
				switch r {
				case 0:
					return c.Send(ctx, comm.Float32s(ramp(big, 1)), 2)
				case 2:
					return c.Recv(ctx, comm.DeviceTensor(0x1000, 0, big, comm.Float32), 0)
				}
				return nil
			}},
		{name: "send to a rank outside the comm", culprit: 2, why: "outside", peers: []int{0},
			run: func(ctx context.Context, r int, c *comm.Comm) error {
				switch r {
				case 2:
					return c.Send(ctx, f32s(5), n)
				case 0:
					return c.Recv(ctx, f32s(0), 2)
				}
				return nil
			}},
		{name: "a stray refusal fails a rank's next receive from the refuser once", culprit: -1,
			run: func(ctx context.Context, r int, c *comm.Comm) error {
				// Rank 1 was not the one rank 2's send to rank 3 (previous
				// step) was meant for; its next receive from 2 fails once,
				// and giving its number back, it receives the send on retry.
				switch r {
				case 2:
					return c.Send(ctx, f32s(9, 8), 1)
				case 1:
					got := make([]float32, 2)
					err := c.Recv(ctx, comm.Float32s(got), 2)
					if !errors.Is(err, comm.ErrPeerRefused) {
						return fmt.Errorf("first receive: %v, want ErrPeerRefused", err)
					}
					if err := c.Recv(ctx, comm.Float32s(got), 2); err != nil {
						return fmt.Errorf("second receive: %w", err)
					}
					if got[0] != 9 || got[1] != 8 {
						return fmt.Errorf("second receive got %v", got)
					}
				}
				return nil
			}},
		{name: "send to itself", culprit: 1, why: "this rank", peers: []int{0, 2},
			run: func(ctx context.Context, r int, c *comm.Comm) error {
				// Both other ranks wait for a message from 1: a stray
				// refusal reaches each.
				switch r {
				case 1:
					return c.Send(ctx, f32s(1), 1)
				default:
					return c.Recv(ctx, f32s(0), 1)
				}
			}},
		{name: "batch with one bad entry", culprit: 0, why: "no tensor", peers: []int{1}, maybe: []int{2},
			run: func(ctx context.Context, r int, c *comm.Comm) error {
				// Rank 0 refuses its whole batch; rank 1's receive from 0
				// fails, but its send to 2 completes, so 2's receive
				// from 1 gets its data.
				switch r {
				case 0:
					return c.BatchP2P(ctx, []comm.P2POp{
						{Kind: comm.P2PSend, Tensor: f32s(1, 1), Peer: 1},
						{Kind: comm.P2PRecv, Tensor: comm.Tensor{}, Peer: 2}})
				case 1:
					return c.BatchP2P(ctx, []comm.P2POp{
						{Kind: comm.P2PRecv, Tensor: f32s(0, 0), Peer: 0},
						{Kind: comm.P2PSend, Tensor: f32s(4, 5, 6), Peer: 2}})
				case 2:
					got := make([]float32, 3)
					err := c.BatchP2P(ctx, []comm.P2POp{
						{Kind: comm.P2PSend, Tensor: f32s(3), Peer: 0},
						{Kind: comm.P2PRecv, Tensor: comm.Float32s(got), Peer: 1}})
					if got[0] != 4 || got[2] != 6 {
						return fmt.Errorf("rank 2 received %v from 1 (batch error %v)", got, err)
					}
					return err
				}
				return nil
			}},
	}
	for _, shm := range []bool{false, true} {
		t.Run(transportName(shm), func(t *testing.T) {
			j := newJob(t, n, func(c *Config) { c.SharedMemory = shm })
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			for i, st := range steps {
				// Each rank goes on to the next messages and the all-reduce
				// as soon as its own op is over.
				vals := ramp(5+i, float32(100*i))
				errs, next := make([]error, n), make([]error, n)
				j.run(func(r int, c *comm.Comm) error {
					t0 := time.Now()
					errs[r] = st.run(ctx, r, c)
					if d := time.Since(t0); d > refusedWithin {
						errs[r] = fmt.Errorf("took %v: %w", d, errs[r])
					}
					for _, pair := range [][2]int{{0, 1}, {1, 2}, {2, 0}, {0, 2}} {
						if err := exchange(ctx, c, r, pair[0], pair[1], vals); err != nil {
							next[r] = fmt.Errorf("then %d→%d: %w", pair[0], pair[1], err)
							return nil
						}
					}
					next[r] = sumCheck(ctx, c, 1000)
					return nil
				})
				for r, err := range errs {
					want := "success"
					switch {
					case r == st.culprit:
						want = "ErrInvalidArgument"
						if errors.Is(err, comm.ErrInvalidArgument) && !errors.Is(err, comm.ErrPeerRefused) {
							continue
						}
					case contains(st.peers, r) || contains(st.maybe, r) && err != nil:
						want = "ErrPeerRefused naming the culprit"
						if errors.Is(err, comm.ErrPeerRefused) && rankOf(err) == st.culprit && strings.Contains(err.Error(), st.why) {
							continue
						}
					case err == nil:
						continue
					}
					t.Errorf("%s: rank %d: got %v, want %s", st.name, r, err, want)
				}
				// The next messages along each pair arrive whole and right,
				// and so does the all-reduce.
				for r, err := range next {
					if err != nil {
						t.Fatalf("%s: rank %d: %v", st.name, r, err)
					}
				}
				for r, c := range j.comms {
					if err := c.Err(); err != nil {
						t.Fatalf("%s: rank %d: comm broken: %v", st.name, r, err)
					}
				}
			}
		})
	}
}

func contains(v []int, x int) bool {
	for _, y := range v {
		if y == x {
			return true
		}
	}
	return false
}
