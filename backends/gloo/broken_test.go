package gloo

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
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
	t.Run("orderly, while an op needs it", func(t *testing.T) {
		// Ranks 0 and 1 wait in an all-reduce for rank 2, which closes:
		// the op fails at both, naming rank 2 as closed, not crashed
		// (rank 1 may learn it from rank 0's notice).
		j := newJob(t, 3, nil)
		defer j.close()
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for r := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[r] = j.comms[r].AllReduce(context.Background(), comm.Float32s(make([]float32, 1024)), comm.Sum)
			}()
		}
		j.comms[2].Close()
		wg.Wait()
		for r, err := range errs {
			if !errors.Is(err, comm.ErrPeerFailed) || !errors.Is(err, comm.ErrPeerClosed) || !slices.Contains(comm.FailedRanks(err), 2) {
				t.Errorf("rank %d: %v; want rank 2 named, ErrPeerFailed and ErrPeerClosed", r, err)
			}
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

// A formation that passes its deadline names the ranks that never
// connected (a *comm.RankError wrapping comm.ErrPeerFailed each), so that
// the layer above can blame them; one cancelled before its deadline names
// nobody.
func TestFormationNamesAbsentPeers(t *testing.T) {
	store := memstore.New()
	defer store.Close()
	cfg := testConfig()
	form := func(ctx context.Context, r int) error {
		o := testOptions(store, cfg, nil)
		o.Rank, o.Size = r, 3
		c, err := comm.New(ctx, "gloo", o)
		if err == nil {
			c.Close()
		}
		return err
	}
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 { // rank 2 never comes
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Long enough for ranks 0 and 1 to connect to each other
			// first, or they would rightly name each other too: forming
			// 3 ranks took up to 0.5 s on 2 cores beside a CPU hog under
			// -race, half of the 1 s this was.
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			errs[r] = form(ctx, r)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, comm.ErrPeerFailed) || !slices.Equal(comm.FailedRanks(err), []int{2}) {
			t.Errorf("rank %d: %v; want a deadline error naming rank 2 (ranks %v)", r, err, comm.FailedRanks(err))
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // a cancellation, not a deadline
	if err := form(ctx, 0); err == nil || len(comm.FailedRanks(err)) != 0 {
		t.Errorf("cancelled formation: %v names %v; want nobody named", err, comm.FailedRanks(err))
	}
}
