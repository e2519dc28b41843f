package main

import (
	"slices"
	"testing"

	"github.com/ftcomm/ftcomm/ft"
)

// A window's inner steps read its plan's micro-batches once each, in
// order, however many the plan has against the window's inner steps: one
// each at the job's size, more when survivors keep the global batch,
// some steps none when the plan has fewer.
func TestWindowReadsThePlanOnce(t *testing.T) {
	for _, k := range []int{25, 34, 100, 10, 0} {
		var plan ft.Plan
		for m := range k {
			plan.Micro = append(plan.Micro, ft.MicroBatch{Indices: []int64{int64(m)}})
		}
		w := window{plan: plan, steps: 25}
		var read []int64
		for step := range 30 {
			mbs := w.next()
			if step >= 25 && mbs != nil {
				t.Fatalf("%d micro-batches: inner step %d of a window of 25 read %d", k, step, len(mbs))
			}
			if n := len(mbs); n > (k+24)/25 {
				t.Fatalf("%d micro-batches: inner step %d read %d at once", k, step, n)
			}
			for _, mb := range mbs {
				read = append(read, mb.Indices...)
			}
		}
		if len(read) != k || !slices.IsSorted(read) || (k > 0 && read[k-1] != int64(k-1)) {
			t.Fatalf("%d micro-batches read as %v", k, read)
		}
	}
	if mbs := (&window{}).next(); mbs != nil {
		t.Fatalf("no plan: %v", mbs)
	}
}

// The summary's check of the replicas' plans logs: two syncs of two
// replicas over a set of 10 samples, read once; then a sample read twice,
// a gap, a killed replica's commit that was its alone (left out), and a
// conflict that is not one (a problem).
func TestCoverage(t *testing.T) {
	rec := func(step, pos, first int64, samples, parts int, idx ...int64) planRecord {
		return planRecord{Step: step, Position: pos, First: first, Samples: samples, Participants: parts, Target: 2,
			Policy: "replica", Indices: idx}
	}
	logs := func() map[string][]planRecord {
		return map[string][]planRecord{
			"a": {rec(1, 0, 0, 4, 2, 3, 1), rec(2, 4, 4, 4, 2, 9, 0)},
			"b": {rec(1, 0, 2, 4, 2, 7, 5), rec(2, 4, 6, 4, 2, 2, 8)},
		}
	}
	if cv := checkCoverage(10, 2, logs(), nil); !cv.ExactlyOnce() || cv.Samples != 8 || cv.Recorded != 8 {
		t.Fatalf("clean: %+v", cv)
	}
	l := logs()
	l["b"][1].Indices[0] = 9 // sample 9 again in epoch 0
	if cv := checkCoverage(10, 2, l, nil); cv.ExactlyOnce() || cv.Twice != 1 {
		t.Fatalf("a sample twice: %+v", cv)
	}
	l = logs()
	l["a"][1].Position, l["b"][1].Position = 5, 5
	if cv := checkCoverage(10, 2, l, nil); cv.ExactlyOnce() {
		t.Fatalf("a gap: %+v", cv)
	}
	// b died holding a sync 2 of its own (2 replicas); a took sync 2
	// alone, as the job did.
	l = logs()
	l["a"][1] = rec(2, 4, 4, 2, 1, 9, 0)
	if cv := checkCoverage(10, 2, l, map[string]bool{"b": true}); !cv.ExactlyOnce() || cv.Lone != 1 || cv.Samples != 6 {
		t.Fatalf("a killed replica's lone commit: %+v", cv)
	}
	if cv := checkCoverage(10, 2, l, nil); cv.ExactlyOnce() {
		t.Fatalf("a sync recorded two ways by live replicas: %+v", cv)
	}
	if cv := checkCoverage(10, 3, logs(), nil); cv.ExactlyOnce() {
		t.Fatalf("a committed sync nobody recorded: %+v", cv)
	}
}
