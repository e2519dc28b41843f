package gloo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// errorKinds says which kinds err matches, for a child to report.
func errorKinds(err error) string {
	return fmt.Sprintf("peerfailed=%v timeout=%v aborted=%v ranks=%v: %v",
		errors.Is(err, comm.ErrPeerFailed), errors.Is(err, comm.ErrTimeout), errors.Is(err, comm.ErrAborted),
		comm.FailedRanks(err), err)
}

// shrinkerMain is a rank (GLOO_TEST_MODE=shrink) that all-reduces until an
// op fails, reports the error's kinds under test/result/<rank>, shrinks
// GLOO_TEST_VICTIM away at once (as a training loop told of the death
// would), runs a checked all-reduce on the new comm and exits 0 once every
// survivor has.
func shrinkerMain(ctx context.Context, o comm.Options, count int) int {
	victim, _ := strconv.Atoi(os.Getenv("GLOO_TEST_VICTIM"))
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	c, err := comm.New(ctx, "gloo", o)
	if err != nil {
		return fail(err)
	}
	defer c.Close()
	buf := make([]float32, count)
	for i := 0; ; i++ {
		err := c.AllReduce(ctx, comm.Float32s(buf), comm.Sum)
		if i == 1 {
			if err := o.Store.Set(ctx, "test/started/"+strconv.Itoa(o.Rank), nil); err != nil {
				return fail(err)
			}
		}
		if err == nil {
			continue
		}
		if err := o.Store.Set(ctx, "test/result/"+strconv.Itoa(o.Rank), []byte(errorKinds(err))); err != nil {
			return fail(err)
		}
		break
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	nc, err := c.Shrink(sctx, []int{victim}, o.Epoch+1)
	if err != nil {
		return fail(fmt.Errorf("shrink: %w", err))
	}
	defer nc.Close()
	if err := checkedAllReduce(sctx, nc, 1000, 0); err != nil {
		return fail(err)
	}
	if err := allFinished(sctx, o.Store, nc); err != nil {
		return fail(err)
	}
	return 0
}

// roundsFromEnv is GLOO_TEST_ROUNDS if set (to measure a failure rate), else def.
func roundsFromEnv(def int) int {
	if n, err := strconv.Atoi(os.Getenv("GLOO_TEST_ROUNDS")); err == nil && n > 0 {
		return n
	}
	return def
}

// TestKilledPeerNamedAtEverySurvivorProcesses: four rank processes
// all-reduce; one is SIGKILLed; each survivor shrinks it away as soon as
// its own op fails. A fast survivor's resync can reach a slower one before
// the dead rank's connection reset does: every survivor must still get a
// *RankError naming the dead rank, wrapping comm.ErrPeerFailed. A survivor
// whose backend learns of the death between two ops (its op ended before
// the dead rank's part was missed) has its next op refused with the comm's
// refusal, which wraps the same *RankError in comm.ErrAborted (Comm.Err):
// about one survivor result in 180 here, and as good for the caller.
func TestKilledPeerNamedAtEverySurvivorProcesses(t *testing.T) {
	const n, victim, count = 4, 2, 1 << 10
	rounds := roundsFromEnv(6)
	bad := 0
	for round := range rounds {
		store := memstore.New()
		srv := storeServer(store)
		kids := make([]*child, n)
		for r := range n {
			kids[r] = startChild(t, srv.URL, r, n, count, 3*time.Second, "GLOO_TEST_MODE=shrink", "GLOO_TEST_VICTIM="+strconv.Itoa(victim))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		for r := range n {
			if _, err := store.Get(ctx, "test/started/"+strconv.Itoa(r)); err != nil {
				t.Fatalf("round %d: rank %d did not start: %v: %s", round, r, err, kids[r].out.String())
			}
		}
		kids[victim].cmd.Process.Signal(syscall.SIGKILL)
		for r, k := range kids {
			if r == victim {
				continue
			}
			v, err := store.Get(ctx, "test/result/"+strconv.Itoa(r))
			if err != nil {
				t.Fatalf("round %d: rank %d reported nothing: %v: %s", round, r, err, k.out.String())
			}
			got := string(v)
			named := func(aborted bool) bool {
				return strings.HasPrefix(got, fmt.Sprintf("peerfailed=true timeout=false aborted=%v ranks=[%d]:", aborted, victim))
			}
			if !named(false) && !(named(true) && strings.Contains(got, "comm: aborted: rank "+strconv.Itoa(victim)+" (")) {
				bad++
				t.Errorf("round %d: rank %d: %s; want a *RankError naming rank %d, wrapping ErrPeerFailed", round, r, got, victim)
			}
			<-k.done
			if k.exited != nil {
				t.Errorf("round %d: rank %d: %v: %s", round, r, k.exited, k.out.String())
			}
		}
		cancel()
		srv.Close()
		store.Close()
	}
	t.Logf("%d of %d survivor results lacked the dead rank", bad, rounds*(n-1))
}

// TestTimeoutReachesPeersAsTimeout: one rank never posts its all-reduce.
// Every waiting rank's op must fail with an error matching comm.ErrTimeout,
// whether its own deadline fired first or a peer's abort notice (sent when
// the peer's deadline fired) arrived first.
func TestTimeoutReachesPeersAsTimeout(t *testing.T) {
	// Deterministic: rank 0's deadline is short and fires while rank 1 (a
	// long deadline) waits, so rank 1 learns of the timeout only from rank
	// 0's notice. Rank 0's deadline is the comm's (Options.Timeout) or the
	// caller's ctx.
	for _, how := range []string{"comm", "ctx"} {
		t.Run("notice/"+how, func(t *testing.T) {
			const short = 200 * time.Millisecond
			j := newJobWith(t, 3, func(r int, o *comm.Options) {
				if r == 0 && how == "comm" {
					o.Timeout = short
				}
			})
			release := make(chan struct{})
			errs := j.run(func(r int, c *comm.Comm) error {
				ctx := context.Background()
				switch r {
				case 0:
					if how == "ctx" {
						var cancel context.CancelFunc
						ctx, cancel = context.WithTimeout(ctx, short)
						defer cancel()
					}
				case 1:
					waitFor(t, "rank 0 in its op", func() bool { return inOp(j.comms[0]) })
					defer close(release)
				case 2:
					<-release // never posts the op
					return nil
				}
				return c.AllReduce(ctx, comm.Float32s(make([]float32, 1000)), comm.Sum)
			})
			for r, err := range errs[:2] {
				if !errors.Is(err, comm.ErrTimeout) || !errors.Is(err, comm.ErrAborted) || errors.Is(err, comm.ErrPeerFailed) {
					t.Errorf("rank %d: %s; want an error matching ErrTimeout and ErrAborted", r, errorKinds(err))
				}
			}
			if !strings.Contains(errs[1].Error(), "rank 0 timed out") {
				t.Errorf("rank 1: %v; want it to name rank 0 as the rank that timed out", errs[1])
			}
		})
	}
	// The scenario as users meet it: every waiting rank has the same
	// deadline, and which of them fires first is up to the scheduler.
	t.Run("simultaneous", func(t *testing.T) {
		const n = 4
		rounds := roundsFromEnv(10)
		bad := 0
		for round := range rounds {
			j := newJobWith(t, n, func(r int, o *comm.Options) { o.Timeout = 100 * time.Millisecond })
			release := make(chan struct{})
			errs := j.run(func(r int, c *comm.Comm) error {
				if r == n-1 {
					<-release
					return nil
				}
				err := c.AllReduce(context.Background(), comm.Float32s(make([]float32, 1000)), comm.Sum)
				if r == 0 {
					close(release)
				}
				return err
			})
			for r, err := range errs[:n-1] {
				if !errors.Is(err, comm.ErrTimeout) {
					bad++
					t.Errorf("round %d rank %d: %s; want an error matching ErrTimeout", round, r, errorKinds(err))
				}
			}
			j.close()
		}
		t.Logf("%d of %d waiting ranks' errors did not match ErrTimeout", bad, rounds*(n-1))
	})
}

// TestShrinkByOthersNamesExcluded: rank 1 waits in an all-reduce that rank
// 2 never joins; rank 0, told by its membership that rank 2 is gone, shrinks
// it away without an op failing first. Rank 1's op fails with a
// *RankError naming rank 2 (wrapping comm.ErrPeerFailed), not with a bare
// abort, so its caller can act on it, and it shrinks the same way.
func TestShrinkByOthersNamesExcluded(t *testing.T) {
	j := newJob(t, 3, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	next := make([]*comm.Comm, 3)
	errs := j.run(func(r int, c *comm.Comm) error {
		switch r {
		case 0:
			waitFor(t, "rank 1 in its op", func() bool { return inOp(j.comms[1]) })
			nc, err := c.Shrink(ctx, []int{2}, 1)
			if err != nil {
				return err
			}
			next[r] = nc
			return sumCheck(ctx, nc, 1000)
		case 1:
			opErr := c.AllReduce(ctx, comm.Float32s(make([]float32, 1000)), comm.Sum)
			nc, err := c.Shrink(ctx, []int{2}, 1)
			if err != nil {
				return err
			}
			next[r] = nc
			if err := sumCheck(ctx, nc, 1000); err != nil {
				return err
			}
			if !errors.Is(opErr, comm.ErrPeerFailed) || fmt.Sprint(comm.FailedRanks(opErr)) != "[2]" {
				return fmt.Errorf("%s; want a *RankError naming rank 2, wrapping ErrPeerFailed", errorKinds(opErr))
			}
			return nil
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
	j.comms[0], j.comms[1] = next[0], next[1]
}
