package main

import (
	"context"
	"io"
	mrand "math/rand/v2"
	"sync"
	"testing"
	"time"
)

// The watcher checks the invariants while the nemesis fills in the fault
// it is injecting (its errors, its end): under -race they must not race
// (the CI mix found this one).
func TestInjectWhileWatching(t *testing.T) {
	h := &harness{cfg: DefaultConfig(), net: noNetwork{}, rec: newRecorder(io.Discard), names: []string{"a", "b"},
		index: map[string]int{"a": 0, "b": 1}, reps: map[string]*replica{"a": {name: "a"}, "b": {name: "b", index: 1}}, printed: map[string]bool{},
		quorums: map[uint64]bool{}, start: time.Now(), rng: mrand.New(mrand.NewPCG(1, 2))}
	var wg sync.WaitGroup
	wg.Add(1)
	stop := make(chan struct{})
	go func() { // the watcher
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			check(h.checkInput(h.rec.snapshot(), false))
		}
	}()
	for id := 1; id <= 50; id++ {
		kind := FaultSlow // noNetwork cannot shape
		if id%2 == 0 {
			kind = FaultStop // no replica process to stop
		}
		f := &Fault{ID: id, Kind: kind, Detection: -1, Recovery: -1, Rejoin: -1}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond) // the fault's pause
		h.inject(ctx, f)
		cancel()
		if f.Err == "" || f.End.IsZero() {
			t.Fatalf("fault %d: err %q, end %v: want an error and an end", id, f.Err, f.End)
		}
	}
	close(stop)
	wg.Wait()
}
