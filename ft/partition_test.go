package ft

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/coordinator/memcoord"
	"github.com/ftcomm/ftcomm/membership"
)

// A partition in process and deterministic: at step
// S the all-reduce completes everywhere, but only a and b commit it (c and
// d's steps fail after the collective, as when a link is cut mid-way); a
// and b are then cut off (the coordinator sees them unfit), c and d go on
// alone, and later a and b return.

// pReplica trains with gradients that depend on the replica, so that a
// step's state depends on who took part in it.
type pReplica struct {
	id     string
	idx    int
	c      *Comm
	params []float32
	hook   func(step int64, r *pReplica) // after the step's all-reduce, before Commit
	done   chan struct{}
	cancel context.CancelFunc

	mu        sync.Mutex
	hashes    map[int64]uint64 // committed step → state hash (the last commit of that step)
	steps     []int64          // committed steps in order
	rollbacks []*RollbackError
	events    []Event
	err       error
	changed   chan struct{} // closed and replaced at every commit and event
}

// notifyLocked wakes everyone waiting for a change of r.
func (r *pReplica) notifyLocked() {
	close(r.changed)
	r.changed = make(chan struct{})
}

func (r *pReplica) train(ctx context.Context) {
	defer close(r.done)
	grads := make([]float32, len(r.params))
	for ctx.Err() == nil {
		err := r.c.Step(ctx)
		var rb *RollbackError
		if errors.As(err, &rb) {
			r.mu.Lock()
			r.rollbacks = append(r.rollbacks, rb)
			r.mu.Unlock()
		} else if err != nil {
			r.setErr(err)
			return
		}
		step := r.c.CommittedStep() + 1
		for i := range grads {
			grads[i] = float32((int(step)*7+i)%13+r.idx*5) / 8
		}
		r.c.AllReduce(ctx, comm.Float32s(grads), comm.Avg).Wait(ctx)
		if r.hook != nil {
			r.hook(step, r)
		}
		ok, err := r.c.Commit(ctx)
		if err != nil {
			r.setErr(err)
			return
		}
		if ok {
			for i := range r.params {
				r.params[i] -= 0.01 * grads[i]
			}
			r.mu.Lock()
			r.hashes[r.c.CommittedStep()] = stateHash(r.params)
			r.steps = append(r.steps, r.c.CommittedStep())
			r.notifyLocked()
			r.mu.Unlock()
		}
	}
}

func stateHash(params []float32) uint64 {
	h := fnv.New64a()
	var b [4]byte
	for _, p := range params {
		u := math.Float32bits(p)
		b[0], b[1], b[2], b[3] = byte(u), byte(u>>8), byte(u>>16), byte(u>>24)
		h.Write(b[:])
	}
	return h.Sum64()
}

func (r *pReplica) setErr(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err == nil {
		r.err = err
	}
}

func (r *pReplica) committed() int64 { return r.c.CommittedStep() }

// waitFor blocks until cond holds, re-checking after every commit and event.
func (r *pReplica) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if err := r.await(what, cond); err != nil {
		t.Fatal(err)
	}
}

// await is waitFor for goroutines other than the test's.
func (r *pReplica) await(what string, cond func() bool) error {
	deadline := time.After(60 * time.Second)
	for {
		r.mu.Lock()
		ch := r.changed
		r.mu.Unlock()
		if cond() {
			return nil
		}
		select {
		case <-ch:
		case <-r.done:
			return fmt.Errorf("%s stopped before %s: %v", r.id, what, r.err)
		case <-deadline:
			return fmt.Errorf("%s: %s did not happen (committed %d)", r.id, what, r.committed())
		}
	}
}

// waitEvent blocks until r has seen an event of kind k.
func (r *pReplica) waitEvent(t *testing.T, k EventKind) {
	t.Helper()
	r.waitFor(t, "event "+k.String(), func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, e := range r.events {
			if e.Kind == k {
				return true
			}
		}
		return false
	})
}

func setHealth(c *memcoord.Coordinator, id string, h membership.Health, why string) {
	c.Update(id, func(r *membership.MemberRecord) { r.Health, r.HealthReason = h, why })
}

type partitionRun struct {
	t     *testing.T
	coord *memcoord.Coordinator
	rs    []*pReplica
}

func startPartitionRun(t *testing.T, durable bool, s int64) *partitionRun {
	p := &partitionRun{t: t, coord: memcoord.New("toy", quick())}
	t.Cleanup(p.coord.Close)
	cluster := inproc.NewCluster()
	var cut sync.Once
	for i, g := range []string{"a", "b", "c", "d"} {
		id := memberID(g, 0)
		m := joinAs(p.coord, id, 1)
		r := &pReplica{id: id, idx: i, params: make([]float32, 1024), done: make(chan struct{}),
			hashes: map[int64]uint64{}, changed: make(chan struct{})}
		cfg := Config{Job: "toy", Group: g, Backend: "inproc", BackendConfig: cluster, Secret: []byte("k"), MinReplicas: 1,
			Timeout: 10 * time.Second, HealChunkSize: 1024, Membership: m, DurableCommit: durable,
			Logger: zaptest.NewLogger(t).Named(id),
			OnEvent: func(e Event) {
				r.mu.Lock()
				r.events = append(r.events, e)
				r.notifyLocked()
				r.mu.Unlock()
			}}
		c, err := New(context.Background(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		r.c = c
		if err := c.Register("params", comm.Float32s(r.params)); err != nil {
			t.Fatal(err)
		}
		var once sync.Once
		switch g {
		case "c", "d":
			r.hook = func(step int64, r *pReplica) {
				if step != s {
					return
				}
				once.Do(func() {
					for _, x := range p.rs[:2] { // a and b commit step s first
						if err := x.await("committing the step before the cut", func() bool { return x.committed() >= s }); err != nil {
							r.setErr(err)
						}
					}
					cut.Do(func() { // the partition: a and b are cut off
						setHealth(p.coord, "a.0", membership.Critical, "partitioned")
						setHealth(p.coord, "b.0", membership.Critical, "partitioned")
					})
					// The collective completed here too, but the step fails
					// after it, as when the link is cut before the end.
					r.c.AllReduce(context.Background(), comm.Tensor{}, comm.Sum)
				})
			}
		}
		p.rs = append(p.rs, r)
	}
	for _, r := range p.rs {
		ctx, cancel := context.WithCancel(context.Background())
		r.cancel = cancel
		go r.train(ctx)
	}
	return p
}

func (p *partitionRun) heal() {
	setHealth(p.coord, "a.0", membership.Healthy, "")
	setHealth(p.coord, "b.0", membership.Healthy, "")
}

func (p *partitionRun) stop() {
	for _, r := range p.rs {
		r.cancel()
	}
	for _, r := range p.rs {
		<-r.done
		if r.err != nil && !errors.Is(r.err, context.Canceled) {
			p.t.Errorf("%s: %v", r.id, r.err)
		}
		if err := r.c.Close(); err != nil {
			p.t.Errorf("close %s: %v", r.id, err)
		}
	}
}

// conflicts lists, for every step committed with different states, who
// committed which.
func (p *partitionRun) conflicts() map[int64]map[uint64][]string {
	out := map[int64]map[uint64][]string{}
	all := map[int64]map[uint64][]string{}
	for _, r := range p.rs {
		r.mu.Lock()
		for s, h := range r.hashes {
			if all[s] == nil {
				all[s] = map[uint64][]string{}
			}
			all[s][h] = append(all[s][h], r.id)
		}
		r.mu.Unlock()
	}
	for s, hs := range all {
		if len(hs) > 1 {
			out[s] = hs
		}
	}
	return out
}

// Default mode: the conflict happens (c and d redo step S), and a and b
// are told: a RollbackError from Step and an EventRolledBack, never a
// silent heal over their committed step.
func TestPartitionDefaultReportsRollback(t *testing.T) {
	const s = 5
	p := startPartitionRun(t, false, s)
	c, a := p.rs[2], p.rs[0]
	c.waitFor(t, "c commits 3 steps past the cut", func() bool { return c.committed() >= s+3 })
	p.heal()
	a.waitFor(t, "a rejoins and commits", func() bool { return a.committed() >= c.committed() && a.c.Participants() == 4 })
	c.waitFor(t, "four commit together", func() bool { return c.c.Participants() == 4 && c.committed() >= a.committed()+1 })
	p.stop()

	conflicts := p.conflicts()
	if len(conflicts) != 1 || conflicts[s] == nil {
		t.Fatalf("want exactly step %d committed twice with different states, got %v", s, conflicts)
	}
	for _, r := range p.rs[:2] {
		if len(r.rollbacks) != 1 || r.rollbacks[0].FromStep != s || r.rollbacks[0].ToStep != s {
			t.Errorf("%s: rollbacks %+v, want one of step %d", r.id, r.rollbacks, s)
		}
		var saw bool
		for _, e := range r.events {
			saw = saw || (e.Kind == EventRolledBack && e.FromStep == s && e.ToStep == s)
		}
		if !saw {
			t.Errorf("%s: no rolled-back event among %v", r.id, r.events)
		}
	}
	for _, r := range p.rs[2:] {
		if len(r.rollbacks) != 0 {
			t.Errorf("%s: rolled back %+v, but its history is the job's", r.id, r.rollbacks)
		}
	}
	// Past the rollback every replica agrees again.
	for st := int64(s + 1); st <= c.committed(); st++ {
		var want uint64
		for _, r := range p.rs {
			if h, ok := r.hashes[st]; ok {
				if want != 0 && h != want {
					t.Errorf("step %d: %s holds %x, another %x", st, r.id, h, want)
				}
				want = h
			}
		}
	}
}

// DurableCommit: a and b's commit of step S is recorded, so c and d never
// redo it: they wait for a holder, then heal from a and b. No conflict and
// no rollback, ever.
func TestPartitionDurableNeverRedoes(t *testing.T) {
	const s = 5
	p := startPartitionRun(t, true, s)
	a, c := p.rs[0], p.rs[2]
	a.waitFor(t, "a commits step S", func() bool { return a.committed() >= s })
	// c and d are cut off from every holder of step S: they wait for one
	// instead of redoing it.
	for _, r := range p.rs[2:] {
		r.waitEvent(t, EventWaiting)
		if r.committed() >= s {
			t.Fatalf("%s committed step %d while every holder of step %d was cut off", r.id, r.committed(), s)
		}
	}
	p.heal()
	c.waitFor(t, "c heals step S from a and b and goes on", func() bool { return c.committed() >= s+3 && c.c.Participants() == 4 })
	p.stop()
	if conflicts := p.conflicts(); len(conflicts) != 0 {
		t.Fatalf("steps committed with different states: %v", conflicts)
	}
	for _, r := range p.rs {
		if len(r.rollbacks) != 0 {
			t.Errorf("%s rolled back %+v", r.id, r.rollbacks)
		}
	}
}
