package gloo

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// shrinkInFlight starts rank 0's Shrink of rank 2 out of j (rank 2 closed,
// rank 1 never shrinking) and returns once it is forming: its address for
// the new epoch is in the Store.
func shrinkInFlight(t *testing.T, j *job) <-chan error {
	t.Helper()
	j.comms[2].Close()
	j.comms[2] = nil
	done := make(chan error, 1)
	go func() {
		nc, err := j.comms[0].Shrink(context.Background(), []int{2}, 1)
		if nc != nil {
			nc.Close()
		}
		done <- err
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := j.store.Get(ctx, j.opts.Prefix+"/epoch/1/addr/0"); err != nil {
		t.Fatalf("rank 0 never started forming: %v", err)
	}
	return done
}

// waitShrink waits for a Shrink that must end by itself (its own bounds).
func waitShrink(t *testing.T, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second): // a hang, not a slow machine
		t.Fatal("the Shrink still ran after 30 s")
		return nil
	}
}

// Close of a comm whose Shrink waits for a peer wakes the Shrink at once
// (comm/doc.go: Abort, Revoke and Close each wake a running op), which
// fails with ErrClosed. Before, the formation ignored the abort and ran
// until ConnectTimeout (60 s), holding Close.
func TestCloseWakesShrink(t *testing.T) {
	j := newJob(t, 3, func(c *Config) { c.ConnectTimeout = 10 * time.Minute })
	done := shrinkInFlight(t, j)
	closed := make(chan error, 1)
	go func() { closed <- j.comms[0].Close() }()
	if err := waitShrink(t, done); !errors.Is(err, comm.ErrClosed) {
		t.Fatalf("Shrink of a closed comm: %v, want ErrClosed", err)
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
}

// A Shrink's deadline (Options.Timeout) ends its formation, as it ends
// any op: it fails with ErrTimeout, not at ConnectTimeout.
func TestShrinkKeepsItsDeadline(t *testing.T) {
	j := newJobWith(t, 3, func(r int, o *comm.Options) {
		o.Timeout = 500 * time.Millisecond
		o.BackendConfig.(*Config).ConnectTimeout = 10 * time.Minute
	})
	done := shrinkInFlight(t, j)
	if err := waitShrink(t, done); !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("Shrink past its deadline: %v, want ErrTimeout", err)
	}
}
