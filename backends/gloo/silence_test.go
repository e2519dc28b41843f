package gloo

import (
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/internal/testutil"
)

// TestSilentPeers: while the survivors wait in a collective, a peer that
// sends nothing (its process stopped) is named by SilentPeers once it has
// been silent for half the peer timeout, before the liveness check
// declares it failed; it is not named once it sends again, and a live
// peer never is. The all-reduce is large enough to take the ring: a small
// one is one-shot, and the stopped rank, which loops on all-reduces, may
// have sent its whole part before it stopped, so the survivors' op ended
// without waiting on it (2 runs in 6 failed so before).
//
// The survivors' monitors tick every second, not every 100 ms (the
// default): SilentPeers names nobody while this process's timers run late
// (a tick more than half an interval late marks them so for a second or
// more), and on 2 cores beside a CPU hog under -race a 100 ms ticker was
// late in 87% of samples, for up to 7 s in a row — longer than the 5 s
// between the naming and the liveness check's verdict, so the test could
// miss its window; a 1 s ticker was late in none.
func TestSilentPeers(t *testing.T) {
	const n, victim, count = 3, 2, 1 << 15
	ch, comms, _ := processJobWith(t, n, victim, count, 10*time.Second, // named after 5 s, failed after 10 s
		func(c *Config) { c.HeartbeatInterval = time.Second })
	silent := func(r int) []int { return comms[r].Backend().(comm.SilenceReporter).SilentPeers() }
	ctx := testutil.Ctx(t, 60*time.Second)
	if err := ch.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	works := make([]*comm.Work, 2)
	for r := range works {
		works[r] = comms[r].AllReduceAsync(ctx, comm.Float32s(make([]float32, count)), comm.Sum)
	}
	testutil.WaitFor(t, ctx, "the stopped rank named silent by both survivors", func() bool {
		return slices.Equal(silent(0), []int{victim}) && slices.Equal(silent(1), []int{victim})
	})
	if !slices.Equal(silent(0), []int{victim}) || len(slices.DeleteFunc(silent(1), func(p int) bool { return p == victim })) != 0 {
		t.Fatalf("a live peer named silent: %v %v", silent(0), silent(1))
	}
	if err := ch.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	for r, w := range works {
		if err := w.Wait(ctx); err != nil {
			t.Fatalf("rank %d: the all-reduce with the continued rank: %v", r, err)
		}
	}
	testutil.WaitFor(t, ctx, "the continued rank heard again", func() bool {
		return len(silent(0)) == 0 && len(silent(1)) == 0
	})
}
