package main

import (
	"encoding/json"
	"io"
	"sort"
	"sync"
	"time"
)

// recorder keeps a run's timeline: every event a replica reported and
// everything the harness did or saw, in arrival order, plus what the
// harness needs to decide while the run goes on (who is committing in
// which epoch). Waiters block on changed() and recheck.
type recorder struct {
	mu      sync.Mutex
	evs     []Event
	changed chan struct{}
	out     io.Writer // events.jsonl, or nil

	// Live state.
	maxEpoch   uint64
	maxStep    int64
	lastCommit map[string]Event // replica → its latest commit
	lastStart  map[string]int64 // replica → its latest launch's start
}

func newRecorder(out io.Writer) *recorder {
	return &recorder{changed: make(chan struct{}), out: out, lastCommit: map[string]Event{}, lastStart: map[string]int64{}}
}

func (r *recorder) add(e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.evs = append(r.evs, e)
	if r.out != nil {
		b, _ := json.Marshal(e)
		r.out.Write(append(b, '\n'))
	}
	if e.Epoch > r.maxEpoch && (e.Kind == evCommit || e.Kind == evReconf || e.Kind == evQuorum) {
		r.maxEpoch = e.Epoch
	}
	if e.Kind == evCommit {
		r.maxStep = max(r.maxStep, e.Step)
		r.lastCommit[e.Replica] = e
	}
	if e.Kind == evStart {
		r.lastStart[e.Replica] = e.T
	}
	close(r.changed)
	r.changed = make(chan struct{})
}

// harness records something the harness did, stamped now.
func (r *recorder) harness(e Event) {
	if e.T == 0 {
		e.T = time.Now().UnixNano()
	}
	r.add(e)
}

// wait returns when cond (called with the lock held) holds, or false at
// the deadline.
func (r *recorder) wait(deadline time.Time, cond func(r *recorder) bool) bool {
	for {
		r.mu.Lock()
		ok, ch := cond(r), r.changed
		r.mu.Unlock()
		if ok {
			return true
		}
		d := time.Until(deadline)
		if d <= 0 {
			return false
		}
		t := time.NewTimer(d)
		select {
		case <-ch:
			t.Stop()
		case <-t.C:
		}
	}
}

// snapshot returns the events so far, ordered by time (stable).
func (r *recorder) snapshot() []Event {
	r.mu.Lock()
	evs := append([]Event(nil), r.evs...)
	r.mu.Unlock()
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].T < evs[j].T })
	return evs
}

func (r *recorder) epoch() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.maxEpoch
}

func (r *recorder) step() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.maxStep
}

// together reports whether every one of names has committed since t, in one
// epoch, with all of them taking part.
func (r *recorder) together(names []string, since time.Time) bool {
	var epoch uint64
	for i, n := range names {
		c, ok := r.lastCommit[n]
		if !ok || c.T < since.UnixNano() || c.N != len(names) || (i > 0 && c.Epoch != epoch) {
			return false
		}
		epoch = c.Epoch
	}
	return true
}

// startedSince reports whether every one of names has started (registered)
// since t.
func (r *recorder) startedSince(names []string, since time.Time) bool {
	for _, n := range names {
		if r.lastStart[n] < since.UnixNano() {
			return false
		}
	}
	return true
}

// fullSize returns the replicas whose latest commits, all since t, are in
// one epoch of n participants or more, every one of them (the job at full
// size; above it, a violation the checker reports), or nil.
func (r *recorder) fullSize(n int, since time.Time) []string {
	byEpoch := map[uint64][]string{}
	size := map[uint64]int{}
	for name, c := range r.lastCommit {
		if c.T >= since.UnixNano() && c.N >= n {
			byEpoch[c.Epoch] = append(byEpoch[c.Epoch], name)
			size[c.Epoch] = c.N
		}
	}
	for epoch, names := range byEpoch {
		if len(names) == size[epoch] {
			sort.Strings(names)
			return names
		}
	}
	return nil
}
