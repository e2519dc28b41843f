package gloo

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/ftcomm/ftcomm/comm"
)

// childEnv makes the test binary run one rank of a job instead of the
// tests (see startChild): real processes to kill with real signals.
const childEnv = "GLOO_TEST_CHILD_RANK"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(childMain())
	}
	goleak.VerifyTestMain(m)
}

// childMain is a rank that all-reduces in a loop until it is killed, or,
// with GLOO_TEST_ITERS set, a joiner of a Grow (see TestGrowJoinerProcess)
// that runs that many checked all-reduces and exits 0 if all succeeded.
func childMain() int {
	rank, _ := strconv.Atoi(os.Getenv(childEnv))
	size, _ := strconv.Atoi(os.Getenv("GLOO_TEST_SIZE"))
	count, _ := strconv.Atoi(os.Getenv("GLOO_TEST_COUNT"))
	pt, _ := time.ParseDuration(os.Getenv("GLOO_TEST_PEER_TIMEOUT"))
	epoch, _ := strconv.ParseUint(os.Getenv("GLOO_TEST_EPOCH"), 10, 64)
	iters, _ := strconv.Atoi(os.Getenv("GLOO_TEST_ITERS"))
	cfg := DefaultConfig()
	if pt > 0 {
		cfg.PeerTimeout = pt
	}
	o := testOptions(httpStore{os.Getenv("GLOO_TEST_STORE")}, cfg, nil)
	o.Rank, o.Size, o.Epoch = rank, size, epoch
	ctx := context.Background()
	if os.Getenv("GLOO_TEST_MODE") == "shrink" {
		return shrinkerMain(ctx, o, count)
	}
	if iters > 0 {
		if err := joinAndCheck(ctx, o, count, iters); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 1
		}
		return 0
	}
	c, err := comm.New(ctx, "gloo", o)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 1
	}
	buf := make([]float32, count)
	for i := 0; ; i++ {
		for k := range buf {
			buf[k] = float32(rank)
		}
		if err := c.AllReduce(ctx, comm.Float32s(buf), comm.Sum); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
	}
}

// joinAndCheck is a joiner process of a Grow: it first abandons a New at
// the epoch before (as ft does when a newer quorum supersedes the one it was
// forming), then joins at o.Epoch, runs iters checked all-reduces and
// closes the comm once every rank has finished.
func joinAndCheck(ctx context.Context, o comm.Options, count, iters int) error {
	if o.Epoch > 0 {
		ao := o
		ao.Epoch--
		// Nobody forms that epoch: its dials are refused and retried until
		// the ctx ends, mid-formation.
		actx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		c, err := comm.New(actx, "gloo", ao)
		cancel()
		if err == nil {
			c.Close()
			return fmt.Errorf("abandoned New at epoch %d succeeded", ao.Epoch)
		}
	}
	c, err := comm.New(ctx, "gloo", o)
	if err != nil {
		return err
	}
	defer c.Close()
	for i := range iters {
		if err := checkedAllReduce(ctx, c, count, i); err != nil {
			return err
		}
	}
	return allFinished(ctx, o.Store, c)
}

// allFinished records that c's rank has finished and waits until every
// rank of c has: a rank that closes its comm while a peer still runs the
// last op fails that op on the peer (a bye fails the pending op).
func allFinished(ctx context.Context, s comm.Store, c *comm.Comm) error {
	key := func(r int) string { return fmt.Sprintf("test/finished/%d/%d", c.Epoch(), r) }
	if err := s.Set(ctx, key(c.Rank()), nil); err != nil {
		return err
	}
	for r := range c.Size() {
		if _, err := s.Get(ctx, key(r)); err != nil {
			return err
		}
	}
	return nil
}

// checkedAllReduce sums a rank- and iteration-dependent vector and checks
// every element, so data of another iteration or epoch cannot pass.
func checkedAllReduce(ctx context.Context, c *comm.Comm, count, iter int) error {
	x := make([]float32, count)
	r, n, f := c.Rank(), c.Size(), iter%7+1
	for k := range x {
		x[k] = float32((r+1)*f + k%5)
	}
	if err := c.AllReduce(ctx, comm.Float32s(x), comm.Sum); err != nil {
		return fmt.Errorf("rank %d/%d all-reduce %d: %w", r, n, iter, err)
	}
	for k, v := range x {
		if want := float32(n*(n+1)/2*f + n*(k%5)); v != want {
			return fmt.Errorf("rank %d/%d all-reduce %d: x[%d] = %v, want %v", r, n, iter, k, v, want)
		}
	}
	return nil
}
