package testutil

import (
	"sync/atomic"
	"testing"
	"time"
)

// WaitFor returns as soon as the condition holds, however it became true.
func TestWaitFor(t *testing.T) {
	var n atomic.Int32
	go func() {
		for n.Add(1) < 3 {
		}
	}()
	WaitFor(t, Ctx(t, 10*time.Second), "three increments", func() bool { return n.Load() >= 3 })
}

// Ctx ends at its deadline.
func TestCtxDeadline(t *testing.T) {
	ctx := Ctx(t, time.Millisecond)
	<-ctx.Done()
	if ctx.Err() == nil {
		t.Fatal("no error after the deadline")
	}
}
