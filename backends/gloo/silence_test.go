package gloo

import (
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/internal/testutil"
)

// TestSilentPeers: a peer that sends nothing (its process stopped) is
// named by SilentPeers while no op runs, and no longer once it sends
// again; a live peer is never named.
func TestSilentPeers(t *testing.T) {
	const n, victim = 3, 2
	ch, comms, _ := processJob(t, n, victim, 1<<10, time.Second)
	silent := func(r int) []int { return comms[r].Backend().(comm.SilenceReporter).SilentPeers() }
	ctx := testutil.Ctx(t, 30*time.Second)
	testutil.WaitFor(t, ctx, "a job whose peers all hear each other", func() bool {
		return len(silent(0)) == 0 && len(silent(1)) == 0
	})
	if err := ch.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, ctx, "the stopped rank named silent by both survivors", func() bool {
		return slices.Equal(silent(0), []int{victim}) && slices.Equal(silent(1), []int{victim})
	})
	if err := ch.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, ctx, "the continued rank heard again", func() bool {
		return len(silent(0)) == 0 && len(silent(1)) == 0
	})
}
