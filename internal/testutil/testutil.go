// Package testutil holds what the module's tests share and would otherwise
// copy: a ctx bounded by a deadline and by the test, and a wait for a
// condition. Nothing here sleeps to synchronise: WaitFor polls a condition
// until it holds or the ctx ends, and fails the test then.
package testutil

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"
)

// Ctx returns a context that ends after d or when the test ends.
func Ctx(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// maxPoll is the longest WaitFor waits between two checks.
const maxPoll = 50 * time.Millisecond

// WaitFor returns once cond holds; when ctx ends first it fails the test,
// naming what it waited for. It checks at once, then after 1 ms, doubling
// the interval up to 50 ms: an event that comes fast is seen fast, and a
// condition that costs a request is not asked many times a second. Call
// it from the test's goroutine.
func WaitFor(t testing.TB, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	wait := time.Millisecond
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("no %s: %v", what, context.Cause(ctx))
		case <-timer.C:
		}
		wait = min(2*wait, maxPoll)
		timer.Reset(wait)
	}
}

// Durations formats measured durations for a test's log: the one, or their
// count, min, median and max.
func Durations(ds []time.Duration) string {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s) == 1 {
		return s[0].Round(time.Millisecond).String()
	}
	return fmt.Sprintf("n=%d min %v median %v max %v", len(s), s[0].Round(time.Millisecond),
		s[len(s)/2].Round(time.Millisecond), s[len(s)-1].Round(time.Millisecond))
}
