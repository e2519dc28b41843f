package main

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"go.uber.org/zap"
)

// slowRelease is a backend that frees its device resources in the
// background after Close, as nccl's does (ncclCommAbort takes about half
// a second): released closes when the test lets it.
type slowRelease struct {
	comm.Backend
	asked    chan struct{} // closed at the first Released call: someone waits
	released chan struct{}
}

func (s *slowRelease) Released() <-chan struct{} {
	select {
	case <-s.asked:
	default:
		close(s.asked)
	}
	return s.released
}
func (s *slowRelease) ReleaseErr() error { return nil }

var slow = make(chan *slowRelease, 1)

func init() {
	comm.Register("capi-test-slow-release", func(ctx context.Context, o comm.Options) (comm.Backend, error) {
		c, err := comm.New(ctx, "inproc", o)
		if err != nil {
			return nil, err
		}
		s := &slowRelease{Backend: c.Backend(), asked: make(chan struct{}), released: make(chan struct{})}
		slow <- s
		return s, nil
	})
}

// Freeing a comm does not wait for its backend's release (it would stall
// every shrink and grow by half a second), but ftcomm_quiesce does: a
// process that exited during it tore CUDA down under ncclCommAbort (a
// SIGSEGV at the end of train_hsdp's spare).
func TestQuiesceWaitsForTheReleases(t *testing.T) {
	ctx := context.Background()
	c, err := comm.New(ctx, "capi-test-slow-release", comm.Options{Rank: 0, Size: 1, Name: "free", BackendConfig: inproc.NewCluster()})
	if err != nil {
		t.Fatal(err)
	}
	s := <-slow
	h := abi.put(&commObj{c: c, can: newCanceler(), backend: "capi-test-slow-release", device: -1, log: zap.NewNop()})
	if err := freeComm(h); err != nil {
		t.Fatal(err)
	}
	quiet := make(chan error, 1)
	go func() { quiet <- releases.await(time.Minute) }()
	select {
	case <-s.asked:
	case err := <-quiet:
		t.Fatalf("quiesce returned (%v) without waiting for the freed comm's release", err)
	case <-time.After(10 * time.Second): // a bound on the failure, not a synchronisation
		t.Fatal("quiesce neither returned nor waited for the freed comm's release")
	}
	select {
	case err := <-quiet:
		t.Fatalf("quiesce returned (%v) before the backend released its resources", err)
	default:
	}
	close(s.released)
	if err := <-quiet; err != nil {
		t.Fatalf("quiesce: %v", err)
	}
	// A release that never comes is a typed error at the bound, not a hang.
	releases.track(&slowRelease{asked: make(chan struct{}), released: make(chan struct{})})
	if err := releases.await(10 * time.Millisecond); !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("a release past the bound: %v, want ErrTimeout", err)
	}
}
