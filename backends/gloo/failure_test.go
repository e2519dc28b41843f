package gloo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
	"github.com/ftcomm/ftcomm/internal/testutil"
)

// waitFor polls cond (an observable event, not a timer) until it holds.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, testutil.Ctx(t, 20*time.Second), what, cond)
}

func backendOf(c *comm.Comm) *Backend { return c.Backend().(*Backend) }

// inOp reports whether c's backend has an op pending.
func inOp(c *comm.Comm) bool { return backendOf(c).active.Load() }

func rankOf(err error) int {
	var re *comm.RankError
	if errors.As(err, &re) {
		return re.Rank
	}
	return -1
}

// child is a rank running in another process (childMain).
type child struct {
	cmd    *exec.Cmd
	out    bytes.Buffer
	done   chan struct{}
	exited error
}

func startChild(t *testing.T, storeURL string, rank, size, count int, peerTimeout time.Duration, env ...string) *child {
	t.Helper()
	c := &child{done: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0], "-test.run=^$")
	c.cmd.Env = append(os.Environ(), childEnv+"="+strconv.Itoa(rank), "GLOO_TEST_SIZE="+strconv.Itoa(size),
		"GLOO_TEST_COUNT="+strconv.Itoa(count), "GLOO_TEST_STORE="+storeURL, "GLOO_TEST_PEER_TIMEOUT="+peerTimeout.String())
	// A -race child would sleep a second at exit (atexit_sleep_ms).
	c.cmd.Env = append(c.cmd.Env, "GORACE="+os.Getenv("GORACE")+" atexit_sleep_ms=0")
	c.cmd.Env = append(c.cmd.Env, env...)
	c.cmd.Stdout, c.cmd.Stderr = &c.out, &c.out
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { c.exited = c.cmd.Wait(); close(c.done) }()
	t.Cleanup(func() {
		c.cmd.Process.Signal(syscall.SIGCONT)
		c.cmd.Process.Kill()
		<-c.done
	})
	return c
}

// processJob is a job whose rank childRank runs in a child process.
func processJob(t *testing.T, n, childRank, count int, peerTimeout time.Duration) (*child, []*comm.Comm, *memstore.Store) {
	return processJobWith(t, n, childRank, count, peerTimeout, nil)
}

// processJobWith is processJob whose in-process ranks' config mut may
// change (the child's is the default with peerTimeout).
func processJobWith(t *testing.T, n, childRank, count int, peerTimeout time.Duration, mut func(*Config)) (*child, []*comm.Comm, *memstore.Store) {
	store := memstore.New()
	srv := storeServer(store)
	t.Cleanup(srv.Close)
	t.Cleanup(func() { store.Close() })
	ch := startChild(t, srv.URL, childRank, n, count, peerTimeout)
	cfg := testConfig()
	cfg.PeerTimeout = peerTimeout
	if mut != nil {
		mut(cfg)
	}
	comms := make([]*comm.Comm, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for r := range n {
		if r == childRank {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := testOptions(store, cfg, nil)
			o.Rank, o.Size, o.Timeout = r, n, 30*time.Second
			comms[r], errs[r] = comm.New(ctx, "gloo", o)
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, c := range comms {
			if c != nil {
				c.Close()
			}
		}
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v (child output: %s)", r, err, ch.out.String())
		}
	}
	return ch, comms, store
}

// loopUntilError all-reduces on every in-process rank until each fails;
// started is closed once every rank has completed two ops.
func loopUntilError(comms []*comm.Comm, count int, started chan struct{}) []error {
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	var ready atomic.Int32
	want := int32(0)
	for _, c := range comms {
		if c != nil {
			want++
		}
	}
	for r, c := range comms {
		if c == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]float32, count)
			for i := 0; ; i++ {
				if err := c.AllReduce(context.Background(), comm.Float32s(buf), comm.Sum); err != nil {
					errs[r] = err
					return
				}
				if i == 1 && ready.Add(1) == want {
					close(started)
				}
			}
		}()
	}
	wg.Wait()
	return errs
}

func shrinkAndCheck(t *testing.T, comms []*comm.Comm, exclude []int, epoch uint64) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(comms))
	next := make([]*comm.Comm, len(comms))
	for r, c := range comms {
		if c == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			nc, err := c.Shrink(ctx, exclude, epoch)
			if err != nil {
				errs[r] = fmt.Errorf("shrink: %w", err)
				return
			}
			next[r] = nc
			x := []float32{float32(nc.Rank() + 1), 2}
			if err := nc.AllReduce(ctx, comm.Float32s(x), comm.Sum); err != nil {
				errs[r] = fmt.Errorf("allreduce after shrink: %w", err)
				return
			}
			m := nc.Size()
			if x[0] != float32(m*(m+1)/2) || x[1] != float32(2*m) {
				errs[r] = fmt.Errorf("allreduce after shrink: got %v", x)
			}
		}()
	}
	wg.Wait()
	for r, c := range next {
		if c != nil {
			comms[r] = c // the old comm was closed by Shrink
		}
	}
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// TestPeerKilledMidAllReduce SIGKILLs a rank running in another process
// while the job all-reduces: every survivor's pending op fails with
// ErrPeerFailed naming it (from the connection reset, not the timeout),
// and the survivors shrink and go on.
func TestPeerKilledMidAllReduce(t *testing.T) {
	const n, victim, count = 3, 1, 1 << 18
	ch, comms, _ := processJob(t, n, victim, count, 3*time.Second)
	started := make(chan struct{})
	go func() {
		<-started
		ch.cmd.Process.Signal(syscall.SIGKILL)
	}()
	errs := loopUntilError(comms, count, started)
	for r, err := range errs {
		if r == victim {
			continue
		}
		if !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != victim || errors.Is(err, comm.ErrTimeout) {
			t.Errorf("rank %d: got %v, want ErrPeerFailed naming rank %d", r, err, victim)
		}
	}
	<-ch.done
	shrinkAndCheck(t, comms, []int{victim}, 1)
}

// TestFrozenPeerDetected SIGSTOPs a rank mid-op: the survivors' heartbeat
// check declares it failed after PeerTimeout, long before the op timeout.
func TestFrozenPeerDetected(t *testing.T) {
	const n, victim, count = 3, 2, 1 << 16
	ch, comms, _ := processJob(t, n, victim, count, time.Second)
	started := make(chan struct{})
	go func() {
		<-started
		ch.cmd.Process.Signal(syscall.SIGSTOP)
	}()
	errs := loopUntilError(comms, count, started)
	for r, err := range errs {
		if r == victim {
			continue
		}
		if !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != victim || errors.Is(err, comm.ErrTimeout) {
			t.Errorf("rank %d: got %v, want ErrPeerFailed naming rank %d", r, err, victim)
		}
	}
	shrinkAndCheck(t, comms, []int{victim}, 1)
}

// TestLatePeerNotDeclaredFailed: a live rank that starts its op well after
// PeerTimeout is not a failure (its idle heartbeats keep it alive).
func TestLatePeerNotDeclaredFailed(t *testing.T) {
	j := newJob(t, 3, func(c *Config) { c.HeartbeatInterval = 50 * time.Millisecond; c.PeerTimeout = 500 * time.Millisecond })
	j.mustRun(func(r int, c *comm.Comm) error {
		if r == 1 {
			time.Sleep(1500 * time.Millisecond) // the scenario: 3 × PeerTimeout late
		}
		x := []float32{1}
		if err := c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum); err != nil {
			return err
		}
		if x[0] != 3 {
			return fmt.Errorf("got %v", x)
		}
		return nil
	})
}

// TestPeerClosedMidOp: a rank that closes its comm while the others wait
// for it fails their op with ErrPeerFailed naming it.
func TestPeerClosedMidOp(t *testing.T) {
	j := newJob(t, 4, nil)
	errs := j.run(func(r int, c *comm.Comm) error {
		if r == 3 {
			for _, o := range j.comms[:3] {
				waitFor(t, "ops pending", func() bool { return inOp(o) })
			}
			return c.Close()
		}
		return c.AllReduce(context.Background(), comm.Float32s(make([]float32, 1<<16)), comm.Sum)
	})
	for r, err := range errs[:3] {
		if !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != 3 {
			t.Errorf("rank %d: got %v, want ErrPeerFailed naming rank 3", r, err)
		}
	}
	j.comms[3] = nil
	shrinkAndCheck(t, j.comms[:3], []int{3}, 1)
}

// TestAbortWakesBlockedOp aborts a rank blocked in an op (its peer never
// joins): the op returns ErrAborted at once, and the peers learn of it.
func TestAbortWakesBlockedOp(t *testing.T) {
	j := newJob(t, 3, nil)
	errs := j.run(func(r int, c *comm.Comm) error {
		switch r {
		case 0:
			return c.AllReduce(context.Background(), comm.Float32s(make([]float32, 1000)), comm.Sum)
		case 1:
			waitFor(t, "rank 0 blocked", func() bool { return inOp(j.comms[0]) })
			err := c.AllReduce(context.Background(), comm.Float32s(make([]float32, 1000)), comm.Sum)
			return err
		default:
			waitFor(t, "ranks 0 and 1 blocked", func() bool { return inOp(j.comms[0]) && inOp(j.comms[1]) })
			j.comms[0].Abort(errors.New("operator said so"))
			// This rank now learns of the abort too: its op fails fast.
			waitFor(t, "the abort notice", func() bool { return backendOf(c).isBroken() })
			return c.AllReduce(context.Background(), comm.Float32s(make([]float32, 1000)), comm.Sum)
		}
	})
	for r, err := range errs {
		if !errors.Is(err, comm.ErrAborted) || errors.Is(err, comm.ErrTimeout) {
			t.Errorf("rank %d: got %v, want ErrAborted", r, err)
		}
	}
}

// TestRevokeInBand revokes at one rank while two others are blocked and the
// last is idle: every rank's pending or next op fails with ErrRevoked, and
// Shrink then reuses the live connections (no new handshakes).
func TestRevokeInBand(t *testing.T) {
	j := newJob(t, 4, nil)
	accepted := func() int64 {
		var s int64
		for _, c := range j.comms {
			if c != nil {
				s += backendOf(c).node.accepted.Load()
			}
		}
		return s
	}
	before := accepted()
	errs := j.run(func(r int, c *comm.Comm) error {
		switch r {
		case 0, 1:
			return c.AllReduce(context.Background(), comm.Float32s(make([]float32, 1<<15)), comm.Sum)
		case 2:
			waitFor(t, "ranks 0 and 1 blocked", func() bool { return inOp(j.comms[0]) && inOp(j.comms[1]) })
			c.Revoke(errors.New("new quorum"))
			return c.Barrier(context.Background())
		default:
			waitFor(t, "the revocation", func() bool { return backendOf(c).isBroken() })
			return c.AllReduce(context.Background(), comm.Float32s(make([]float32, 4)), comm.Sum)
		}
	})
	for r, err := range errs {
		if !errors.Is(err, comm.ErrRevoked) {
			t.Errorf("rank %d: got %v, want ErrRevoked", r, err)
		}
	}
	// Shrink away rank 3 (say the quorum dropped it); 0-2 reuse their links.
	j.comms[3].Close()
	j.comms[3] = nil
	shrinkAndCheck(t, j.comms[:3], []int{3}, 7)
	if got := accepted(); got != before {
		t.Errorf("shrink made %d new connections, want 0 (reuse)", got-before)
	}
	j.mustRun(func(r int, c *comm.Comm) error {
		if c == nil {
			return nil
		}
		if c.Epoch() != 7 || c.Size() != 3 {
			return fmt.Errorf("after shrink: epoch %d size %d", c.Epoch(), c.Size())
		}
		x := make([]float32, 100000) // a multi-segment op over the resynchronised links
		for i := range x {
			x[i] = float32(r)
		}
		if err := c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum); err != nil {
			return err
		}
		if x[0] != 3 || x[len(x)-1] != 3 {
			return fmt.Errorf("got %v", x[0])
		}
		return nil
	})
}

// TestRevokeMidTransferThenShrink revokes while four ranks stream large
// all-reduces, so writes are interrupted mid-frame; the survivors then
// shrink over the same connections (the unfinished frames are completed
// as abandoned and skipped by the resync) and get correct results.
func TestRevokeMidTransferThenShrink(t *testing.T) {
	for _, how := range []string{"revoke", "abort"} {
		t.Run(how, func(t *testing.T) {
			j := newJob(t, 4, func(c *Config) { c.SegmentSize = 256 << 10 })
			const count = 1 << 20 // 4 MiB of float32: many frames in flight
			var ops atomic.Int32
			errs := j.run(func(r int, c *comm.Comm) error {
				x := make([]float32, count)
				for {
					if r == 0 && ops.Load() >= 4 {
						// Everyone is mid-stream in some op now.
						if how == "revoke" {
							c.Revoke(errors.New("test revokes mid-transfer"))
						} else {
							c.Abort(errors.New("test aborts mid-transfer"))
						}
					}
					if err := c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum); err != nil {
						return err
					}
					ops.Add(1)
				}
			})
			for r, err := range errs {
				want := comm.ErrRevoked
				if how == "abort" {
					want = comm.ErrAborted
				}
				if !errors.Is(err, want) {
					t.Errorf("rank %d: got %v, want %v", r, err, want)
				}
			}
			accepted := func() (n int64) {
				for _, c := range j.comms[:3] {
					n += backendOf(c).node.accepted.Load()
				}
				return n
			}
			before := accepted()
			j.comms[3].Close()
			j.comms[3] = nil
			shrinkAndCheck(t, j.comms[:3], []int{3}, 1)
			if got := accepted() - before; got != 0 {
				t.Errorf("shrink made %d new connections, want 0 (reuse)", got)
			}
			// (Whether a write was cut mid-frame here depends on timing;
			// TestAbortCutsFrameThenShrink makes sure it is.)
			j.mustRun(func(r int, c *comm.Comm) error {
				if c == nil {
					return nil
				}
				x := make([]float32, count)
				for i := range x {
					x[i] = float32(r + i%7)
				}
				if err := c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum); err != nil {
					return err
				}
				for i := range x {
					if want := float32(3 + 3*(i%7)); x[i] != want {
						return fmt.Errorf("x[%d] = %v, want %v", i, x[i], want)
					}
				}
				return nil
			})
		})
	}
}

// TestAbortCutsFrameThenShrink: rank 0 sends one 16 MiB frame to rank 1,
// which has not posted its receive, so the write blocks mid-frame (the
// frame is larger than any socket buffer and than the shared-memory ring);
// rank 0 is aborted. Its Send returns at once; rank 1's late Recv fails (it
// never returns the partial data), rank 2 hears of the abort, and the three
// shrink over the same connections and compute correctly. Over TCP the
// unfinished frame is completed with filler and marked abandoned; over
// shared memory the resync tells rank 1 where the new epoch's data starts.
func TestAbortCutsFrameThenShrink(t *testing.T) {
	for _, shm := range []bool{false, true} {
		t.Run(transportName(shm), func(t *testing.T) {
			if shm {
				skipWithoutShm(t)
			}
			const count = 4 << 20 // 16 MiB of float32 in one frame
			j := newJob(t, 4, func(c *Config) { c.SegmentSize = 16 << 20; c.SharedMemory = shm })
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			l01 := backendOf(j.comms[1]).links[0]
			if (l01.shm != nil) != shm {
				t.Fatalf("link uses shared memory: %v, want %v", l01.shm != nil, shm)
			}
			errs := j.run(func(r int, c *comm.Comm) error {
				switch r {
				case 0:
					return c.Send(ctx, comm.Float32s(make([]float32, count)), 1)
				case 1:
					// Wait until rank 0's frame is piling up unread here.
					waitFor(t, "rank 0 blocked mid-frame", func() bool { return inOp(j.comms[0]) && pendingBytes(l01) > 16<<10 })
					j.comms[0].Abort(errors.New("test aborts a blocked send"))
					waitFor(t, "rank 0's send to return", func() bool { return !inOp(j.comms[0]) })
					buf := make([]float32, count)
					err := c.Recv(ctx, comm.Float32s(buf), 0)
					if err == nil {
						return errors.New("recv of an abandoned frame succeeded")
					}
					return err
				case 2:
					waitFor(t, "the abort notice", func() bool { return backendOf(c).isBroken() })
					return c.Barrier(ctx)
				}
				return nil
			})
			for r, err := range errs[:3] {
				if !errors.Is(err, comm.ErrAborted) {
					t.Errorf("rank %d: got %v, want ErrAborted", r, err)
				}
			}
			if n := backendOf(j.comms[0]).links[1].abandoned.Load(); !shm && n != 1 {
				t.Errorf("%d frames completed as abandoned on rank 0's link to rank 1, want 1", n)
			}
			j.comms[3].Close()
			j.comms[3] = nil
			shrinkAndCheck(t, j.comms[:3], []int{3}, 1)
			j.mustRun(func(r int, c *comm.Comm) error {
				if c == nil {
					return nil
				}
				return sumCheck(ctx, c, 1<<20)
			})
		})
	}
}

func transportName(shm bool) string {
	if shm {
		return "shm"
	}
	return "tcp"
}

// pendingBytes is how much the peer has sent that l has not read yet.
func pendingBytes(l *link) int {
	if l.shm == nil {
		return l.inq()
	}
	s := l.shm
	s.mu.RLock()
	defer s.mu.RUnlock()
	if !s.live {
		return 0
	}
	return int(s.rx.head.Load() - s.rx.tail.Load())
}

// TestCloseAfterLastOpKeepsSlowerPeers: ranks close their comm right after
// their last collective, as programs do. A rank that still finishes that
// collective when a faster one's goodbye arrives completes it with correct
// data; its next op fails at once with ErrPeerFailed naming a rank that
// left. Repeated, since which rank finishes first is up to the scheduler.
func TestCloseAfterLastOpKeepsSlowerPeers(t *testing.T) {
	for _, shm := range []bool{true, false} {
		t.Run(transportName(shm), func(t *testing.T) {
			for round := range 15 {
				j := newJob(t, 3, func(c *Config) { c.SharedMemory = shm })
				const count = 1 << 16
				errs := j.run(func(r int, c *comm.Comm) error {
					x := make([]float32, count)
					for i := range x {
						x[i] = float32(r + 1)
					}
					if err := c.AllReduce(context.Background(), comm.Float32s(x), comm.Sum); err != nil {
						return fmt.Errorf("last all-reduce: %w", err)
					}
					for i, v := range x {
						if v != 6 {
							return fmt.Errorf("x[%d] = %v, want 6", i, v)
						}
					}
					if r == 0 {
						return c.Close()
					}
					return nil
				})
				for r, err := range errs {
					if err != nil {
						t.Fatalf("round %d rank %d: %v", round, r, err)
					}
				}
				for r, c := range j.comms[1:] {
					waitFor(t, "rank 0's goodbye", func() bool { return backendOf(c).links[0].isClosed() })
					err := c.Barrier(context.Background())
					if !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != 0 {
						t.Fatalf("round %d rank %d: barrier after rank 0 left: %v, want ErrPeerFailed naming rank 0", round, r+1, err)
					}
				}
				j.comms[0] = nil
				j.close()
			}
		})
	}
}

// TestRecvAfterSenderClosed: rank 0 sends and closes its comm before rank 1
// posts the receive: the data is delivered. A second receive, which rank 0
// will never serve, fails at once instead of waiting for the deadline.
func TestRecvAfterSenderClosed(t *testing.T) {
	for _, shm := range []bool{true, false} {
		t.Run(transportName(shm), func(t *testing.T) {
			j := newJob(t, 2, func(c *Config) { c.SharedMemory = shm })
			ctx := context.Background()
			msg := []int32{7, 8, 9}
			if err := j.comms[0].Send(ctx, comm.Int32s(msg), 1); err != nil {
				t.Fatal(err)
			}
			if err := j.comms[0].Close(); err != nil {
				t.Fatal(err)
			}
			j.comms[0] = nil
			got := make([]int32, 3)
			if err := j.comms[1].Recv(ctx, comm.Int32s(got), 0); err != nil {
				t.Fatalf("recv of data sent before the goodbye: %v", err)
			}
			if fmt.Sprint(got) != fmt.Sprint(msg) {
				t.Fatalf("got %v, want %v", got, msg)
			}
			waitFor(t, "rank 0's goodbye", func() bool { return backendOf(j.comms[1]).links[0].isClosed() })
			ctx2, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			err := j.comms[1].Recv(ctx2, comm.Int32s(got), 0)
			if !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != 0 {
				t.Fatalf("recv from a rank that left: %v, want ErrPeerFailed naming rank 0", err)
			}
		})
	}
}

// With Config.KeepPointToPointAfterLeave, ranks that finalize after their
// part leave the comm usable for point-to-point between the others (the
// sends and receives they still exchange complete), while a collective,
// and a receive from a rank that left, fail with ErrPeerClosed naming it.
// Without it (the default) the goodbye breaks the comm for every later op.
func TestPointToPointAfterOthersLeft(t *testing.T) {
	for _, keep := range []bool{true, false} {
		for _, shm := range []bool{true, false} {
			t.Run(fmt.Sprintf("keep=%v/%s", keep, transportName(shm)), func(t *testing.T) {
				j := newJob(t, 4, func(c *Config) { c.SharedMemory = shm; c.KeepPointToPointAfterLeave = keep })
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				for _, r := range []int{2, 3} {
					if err := j.comms[r].Close(); err != nil {
						t.Fatal(err)
					}
					j.comms[r] = nil
				}
				for _, r := range []int{2, 3} {
					waitFor(t, "the goodbyes", func() bool {
						return backendOf(j.comms[0]).links[r].isClosed() && backendOf(j.comms[1]).links[r].isClosed()
					})
				}
				got := make([]int32, 1<<16)
				errs := make(chan error, 1)
				go func() {
					errs <- j.comms[1].BatchP2P(ctx, []comm.P2POp{{Kind: comm.P2PRecv, Tensor: comm.Int32s(got), Peer: 0}})
				}()
				sendErr := j.comms[0].Send(ctx, comm.Int32s(make([]int32, 1<<16)), 1)
				recvErr := <-errs
				if keep != (sendErr == nil && recvErr == nil) {
					t.Fatalf("keep=%v: send %v, receive %v", keep, sendErr, recvErr)
				}
				if !keep {
					for _, err := range []error{sendErr, recvErr} {
						if !errors.Is(err, comm.ErrPeerClosed) {
							t.Fatalf("point to point after a rank left: %v, want ErrPeerClosed", err)
						}
					}
					return
				}
				err := j.comms[0].Barrier(ctx)
				if !errors.Is(err, comm.ErrPeerClosed) || !slices.Contains([]int{2, 3}, rankOf(err)) {
					t.Fatalf("a collective after ranks left: %v, want ErrPeerClosed naming rank 2 or 3", err)
				}
				err = j.comms[1].Recv(ctx, comm.Int32s(got), 3)
				if !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != 3 {
					t.Fatalf("a receive from a rank that left: %v, want ErrPeerFailed naming rank 3", err)
				}
			})
		}
	}
}

// A rank that revokes and then closes its comm (what ft does when a new
// epoch begins) left in order: the others' ops fail with the revocation
// alone, not also with ErrPeerFailed naming it (the chaos soak of
// 2026-11-28 flagged exactly that: a live replica named as failed).
func TestRevokeThenCloseNamesNoFailedPeer(t *testing.T) {
	j := newJob(t, 3, nil)
	errs := j.run(func(r int, c *comm.Comm) error {
		switch r {
		case 0, 1:
			return c.AllReduce(context.Background(), comm.Float32s(make([]float32, 1<<15)), comm.Sum)
		default:
			waitFor(t, "ranks 0 and 1 blocked", func() bool { return inOp(j.comms[0]) && inOp(j.comms[1]) })
			c.Revoke(errors.New("new quorum"))
			return c.Close()
		}
	})
	for r, err := range errs[:2] {
		if !errors.Is(err, comm.ErrRevoked) || errors.Is(err, comm.ErrPeerFailed) {
			t.Errorf("rank %d: got %v, want ErrRevoked alone", r, err)
		}
	}
	j.comms[2] = nil
	b := backendOf(j.comms[0])
	waitFor(t, "rank 0 seeing rank 2's close", func() bool {
		b.mu.Lock()
		l := b.links[2]
		b.mu.Unlock()
		return l != nil && l.departed.Load()
	})
	err := j.comms[0].Barrier(context.Background())
	if !errors.Is(err, comm.ErrRevoked) || errors.Is(err, comm.ErrPeerFailed) {
		t.Errorf("rank 0 after rank 2 closed: got %v, want ErrRevoked alone", err)
	}
}
