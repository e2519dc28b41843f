package gloo

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// A comm learns of a peer's failure with no op running: Comm.Broken closes
// and Comm.Err names the peer, so a layer above (ft) can act at once
// instead of at its next op. A peer that closed its comm in an orderly way
// is told apart (comm.ErrPeerClosed); one whose connection broke is not.
func TestBrokenWithNoOpRunning(t *testing.T) {
	waitBroken := func(t *testing.T, c *comm.Comm) error {
		t.Helper()
		select {
		case <-c.Broken():
		case <-time.After(30 * time.Second):
			t.Fatal("Broken not closed within 30 s of the peer's failure")
		}
		return c.Err()
	}
	t.Run("orderly", func(t *testing.T) {
		j := newJob(t, 2, nil)
		defer j.close()
		j.comms[1].Close()
		err := waitBroken(t, j.comms[0])
		if !errors.Is(err, comm.ErrPeerFailed) || !errors.Is(err, comm.ErrPeerClosed) || !slices.Equal(comm.FailedRanks(err), []int{1}) {
			t.Fatalf("Err() = %v; want rank 1 named, ErrPeerFailed and ErrPeerClosed", err)
		}
	})
	t.Run("connection reset", func(t *testing.T) {
		j := newJob(t, 2, nil)
		defer j.close()
		// Rank 1's connections die as in a crash: no goodbye.
		for _, l := range j.comms[1].Backend().(*Backend).linkList() {
			if l != nil {
				l.conn.Close()
			}
		}
		err := waitBroken(t, j.comms[0])
		if !errors.Is(err, comm.ErrPeerFailed) || errors.Is(err, comm.ErrPeerClosed) || !slices.Contains(comm.FailedRanks(err), 1) {
			t.Fatalf("Err() = %v; want rank 1 named as failed, not as closed", err)
		}
	})
	t.Run("abort", func(t *testing.T) {
		j := newJob(t, 2, nil)
		defer j.close()
		j.comms[1].Abort(errors.New("injected"))
		if err := waitBroken(t, j.comms[0]); !errors.Is(err, comm.ErrAborted) {
			t.Fatalf("Err() = %v; want ErrAborted", err)
		}
		select {
		case <-j.comms[1].Broken():
		default:
			t.Fatal("the aborted comm's own Broken is open")
		}
	})
}
