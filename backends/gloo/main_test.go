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

// childMain is a rank that all-reduces in a loop until it is killed.
func childMain() int {
	rank, _ := strconv.Atoi(os.Getenv(childEnv))
	size, _ := strconv.Atoi(os.Getenv("GLOO_TEST_SIZE"))
	count, _ := strconv.Atoi(os.Getenv("GLOO_TEST_COUNT"))
	pt, _ := time.ParseDuration(os.Getenv("GLOO_TEST_PEER_TIMEOUT"))
	cfg := DefaultConfig()
	if pt > 0 {
		cfg.PeerTimeout = pt
	}
	o := testOptions(httpStore{os.Getenv("GLOO_TEST_STORE")}, cfg, nil)
	o.Rank, o.Size = rank, size
	ctx := context.Background()
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
