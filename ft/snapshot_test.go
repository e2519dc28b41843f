package ft

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/coordinator/memcoord"
	"github.com/ftcomm/ftcomm/coordinator/quorum"
)

func TestDecideRestore(t *testing.T) {
	inv := func(rank int, step int64, own []int64, heldSlot int, held []int64, complete int64) snapInventory {
		return snapInventory{Rank: rank, Step: step, Own: own, HeldSlot: heldSlot, Held: held, Complete: complete}
	}
	cases := []struct {
		name    string
		invs    []snapInventory
		restore bool
		step    int64
		from    []int
		lost    []int
	}{
		{name: "same steps: nothing to do",
			invs: []snapInventory{inv(0, 9, []int64{8}, 2, []int64{8}, 8), inv(1, 9, []int64{8}, 0, []int64{8}, 8), inv(2, 9, []int64{8}, 1, []int64{8}, 8)}},
		{name: "a fresh rank restores from its buddy, the others from their own",
			invs:    []snapInventory{inv(0, 11, []int64{8}, 2, []int64{8}, 8), inv(1, 0, nil, -1, nil, -1), inv(2, 11, []int64{8}, 1, []int64{8}, 8)},
			restore: true, step: 8, from: []int{-1, 2, -1}},
		{name: "a pending snapshot is not used before it is known complete",
			invs:    []snapInventory{inv(0, 13, []int64{8, 12}, 2, []int64{8, 12}, 8), inv(1, 0, nil, -1, nil, -1), inv(2, 13, []int64{8, 12}, 1, []int64{8, 12}, 8)},
			restore: true, step: 8, from: []int{-1, 2, -1}},
		{name: "the newest complete snapshot wins",
			invs:    []snapInventory{inv(0, 13, []int64{8, 12}, 2, []int64{8, 12}, 12), inv(1, 0, nil, -1, nil, -1), inv(2, 13, []int64{8, 12}, 1, []int64{8, 12}, 8)},
			restore: true, step: 12, from: []int{-1, 2, -1}},
		{name: "a newer complete snapshot some slot lacks gives way to an older one",
			invs:    []snapInventory{inv(0, 13, []int64{8, 12}, 2, []int64{8, 12}, 12), inv(1, 0, nil, -1, nil, -1), inv(2, 13, []int64{8, 12}, 1, []int64{8}, 12)},
			restore: true, step: 8, from: []int{-1, 2, -1}},
		{name: "a vote that completed at one rank only: the lagging rank rolls back with the rest",
			invs:    []snapInventory{inv(0, 10, []int64{8}, 1, []int64{8}, 8), inv(1, 11, []int64{8}, 0, []int64{8}, 8)},
			restore: true, step: 8, from: []int{-1, -1}},
		{name: "a rank and its buddy both lost",
			invs: []snapInventory{inv(0, 11, []int64{8}, 2, []int64{8}, 8), inv(1, 0, nil, -1, nil, -1), inv(2, 0, nil, -1, nil, -1)},
			lost: []int{1}},
		{name: "no snapshot complete yet",
			invs: []snapInventory{inv(0, 3, []int64{0}, 1, nil, -1), inv(1, 0, nil, -1, nil, -1)},
			lost: []int{1}},
		{name: "every rank fresh: nothing to restore, nothing to lose",
			invs: []snapInventory{inv(0, 0, nil, -1, nil, -1), inv(1, 0, nil, -1, nil, -1)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, err := decideRestore("g", tc.invs)
			if tc.lost != nil {
				var le *SnapshotLostError
				if !errors.As(err, &le) || !errors.Is(err, ErrSnapshotLost) {
					t.Fatalf("got %+v, %v; want a *SnapshotLostError", p, err)
				}
				if !slices.Equal(le.Slots, tc.lost) {
					t.Fatalf("lost slots %v, want %v (%v)", le.Slots, tc.lost, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if p.Restore != tc.restore || p.Step != tc.step || !slices.Equal(p.From, tc.from) {
				t.Fatalf("got %+v, want restore=%v step %d from %v", p, tc.restore, tc.step, tc.from)
			}
		})
	}
}

func TestBuddies(t *testing.T) {
	for _, hosts := range [][]string{
		{"a", "a", "b", "b"},
		{"b", "a", "b", "a", "c", "c"},
		{"a", "a", "a"},
		{"a", "b"},
		{"a", "a", "b"},
		{"x"},
	} {
		b := buddies(hosts)
		if !slices.Equal(slices.Sorted(slices.Values(b)), func() []int {
			out := make([]int, len(hosts))
			for i := range out {
				out[i] = i
			}
			return out
		}()) {
			t.Fatalf("%v: buddies %v are not a permutation", hosts, b)
		}
		even := true
		per := map[string]int{}
		for _, h := range hosts {
			per[h]++
		}
		for _, n := range per {
			even = even && n == per[hosts[0]]
		}
		for r, x := range b {
			if len(hosts) > 1 && x == r {
				t.Errorf("%v: slot %d is its own buddy", hosts, r)
			}
			if even && len(per) > 1 && hosts[x] == hosts[r] {
				t.Errorf("%v: slot %d's buddy %d shares its host", hosts, r, x)
			}
		}
	}
}

// A toy FSDP job with no replicas: one group of shardSlots ranks, each
// holding a shard of its own. Each step the ranks all-reduce a vector over
// the group comm (exact in float32) and each applies it to its shard, so
// every shard's state after step s is a pure function of s: the test
// computes it (shardAt) and compares bit for bit.
const (
	shardSlots = 3
	shardLen   = 1024
)

func shardInit(slot, n int) []float32 {
	p := make([]float32, n)
	for i := range p {
		p[i] = float32(slot + 1)
	}
	return p
}

func shardContribution(step int64, slot int, v []float32) {
	for i := range v {
		v[i] = float32((int(step)*7+i+slot)%13) / 8
	}
}

func shardApply(p, u []float32) {
	for i := range p {
		p[i] = p[i]*0.999 - 0.01*u[i]
	}
}

// shardAt is slot's shard of n elements after committed step step.
func shardAt(slot int, step int64, n int) []float32 {
	return shardRun(slot, shardSlots, step, n, nil)
}

// shardRun replays the run without failures of a group of slots ranks for
// slot up to committed step upto, calling each (if set) with the shard
// after every step from 0.
func shardRun(slot, slots int, upto int64, n int, each func(p []float32)) []float32 {
	p := shardInit(slot, n)
	u, v := make([]float32, n), make([]float32, n)
	if each != nil {
		each(p)
	}
	for s := int64(0); s < upto; s++ {
		clear(u)
		for r := range slots {
			shardContribution(s, r, v)
			for i := range u {
				u[i] += v[i]
			}
		}
		shardApply(p, u)
		if each != nil {
			each(p)
		}
	}
	return p
}

type shardRank struct {
	t      *testing.T
	slot   int
	c      *Comm
	m      *memcoord.Member
	params []float32
	cancel context.CancelFunc
	done   chan struct{}

	mu     sync.Mutex
	err    error
	events []Event
	rolled []*RollbackError
	commit chan int64
}

func startShard(t *testing.T, coord *memcoord.Coordinator, cluster *inproc.Cluster, slot int, every int, until int64) *shardRank {
	return startShardWith(t, coord, cluster, slot, every, until, nil)
}

// startShardWith is startShard; prepare (if set) sees the rank before it
// trains.
func startShardWith(t *testing.T, coord *memcoord.Coordinator, cluster *inproc.Cluster, slot int, every int, until int64,
	prepare func(*shardRank)) *shardRank {
	id := memberID("fsdp", slot)
	r := &shardRank{t: t, slot: slot, params: shardInit(slot, shardLen), done: make(chan struct{}), commit: make(chan int64, 1024)}
	r.m = joinAs(coord, id, shardSlots)
	cfg := Config{Job: "toy", Group: "fsdp", GroupRank: slot, GroupSize: shardSlots, Backend: "inproc", BackendConfig: cluster,
		Secret: []byte("k"), MinReplicas: 1, Timeout: 10 * time.Second, HealChunkSize: 1024, SnapshotEvery: every,
		Membership: r.m, Logger: zaptest.NewLogger(t).Named(fmt.Sprintf("%s#%d", id, r.m.Incarnation()))}
	cfg.OnEvent = func(e Event) {
		r.mu.Lock()
		r.events = append(r.events, e)
		r.mu.Unlock()
	}
	c, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.c = c
	if err := c.Register("shard", comm.Float32s(r.params)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	if prepare != nil {
		prepare(r)
	}
	go r.train(ctx, until)
	return r
}

func (r *shardRank) train(ctx context.Context, until int64) {
	defer close(r.done)
	v := make([]float32, shardLen)
	for r.c.CommittedStep() < until {
		err := r.c.Step(ctx)
		var rb *RollbackError
		if errors.As(err, &rb) {
			r.mu.Lock()
			r.rolled = append(r.rolled, rb)
			r.mu.Unlock()
		} else if err != nil {
			r.setErr(err)
			return
		}
		shardContribution(r.c.CommittedStep(), r.slot, v)
		if g := r.c.Group(); g != nil {
			g.AllReduce(ctx, comm.Float32s(v), comm.Sum) // a failure fails the group's vote
		}
		ok, err := r.c.Commit(ctx)
		if err != nil {
			r.setErr(err)
			return
		}
		if ok {
			shardApply(r.params, v)
			select {
			case r.commit <- r.c.CommittedStep():
			default:
			}
		}
	}
}

func (r *shardRank) setErr(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err == nil {
		r.err = err
	}
}

func (r *shardRank) waitStep(s int64) {
	r.t.Helper()
	deadline := time.After(60 * time.Second)
	for r.c.CommittedStep() < s {
		select {
		case <-r.commit:
		case <-r.done:
			r.t.Fatalf("slot %d stopped at step %d before %d: %v", r.slot, r.c.CommittedStep(), s, r.err)
		case <-deadline:
			r.t.Fatalf("slot %d stuck at step %d", r.slot, r.c.CommittedStep())
		}
	}
}

// waitSnapshot waits until r knows a snapshot of at least step complete.
func (r *shardRank) waitSnapshot(step int64) int64 {
	r.t.Helper()
	deadline := time.After(60 * time.Second)
	for {
		r.c.d.snaps.mu.Lock()
		got := r.c.d.snaps.complete
		r.c.d.snaps.mu.Unlock()
		if got >= step {
			return got
		}
		select {
		case <-r.commit:
		case <-r.done:
			r.t.Fatalf("slot %d stopped before snapshot %d was complete: %v", r.slot, step, r.err)
		case <-deadline:
			r.t.Fatalf("slot %d: snapshot %d never complete", r.slot, step)
		}
	}
}

// kill ends r as a process death would: its loop stops mid-step, its
// comms fail at its peers, its memory (state, snapshot copies, servers) is
// gone, and the coordinator removes it.
func (r *shardRank) kill(coord *memcoord.Coordinator) { r.killThen(coord, nil) }

// killThen is kill; removed (if set) runs once the coordinator removed
// the rank, before its loop is waited for.
func (r *shardRank) killThen(coord *memcoord.Coordinator, removed func()) {
	if g := r.c.Group(); g != nil {
		g.Backend().(*inproc.Backend).Fail()
	}
	if d := r.c.ftData(); d != nil {
		d.Backend().(*inproc.Backend).Fail()
	}
	r.cancel()
	coord.Remove(r.m.ID(), quorum.PortClosed)
	if removed != nil {
		removed()
	}
	<-r.done
	r.c.d.server.Close()
	r.c.d.snaps.close()
	r.c.Close() // what is left of it: its driver would log after the test
}

func (r *shardRank) stop() error {
	r.cancel()
	<-r.done
	r.mu.Lock()
	err := r.err
	r.mu.Unlock()
	if errors.Is(err, context.Canceled) {
		err = nil
	}
	return errors.Join(err, r.c.Close())
}

func (r *shardRank) eventsOf(k EventKind) []Event {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Event
	for _, e := range r.events {
		if e.Kind == k {
			out = append(out, e)
		}
	}
	return out
}

// A rank of a group with no replica dies; its restarted process holds
// nothing. The group restores the newest complete snapshot — the new rank
// from its buddy's copy, the others from their own — and trains on; every
// shard ends bit-identical to the run without the failure. With a snapshot
// every step, the death always comes during a snapshot's transfer.
func TestSnapshotRestoresAReplacedRank(t *testing.T) {
	for _, every := range []int{4, 1} {
		t.Run("every"+string(rune('0'+every)), func(t *testing.T) {
			coord, cluster := memcoord.New("toy", quick()), inproc.NewCluster()
			t.Cleanup(coord.Close)
			rs := make([]*shardRank, shardSlots)
			for s := range rs {
				rs[s] = startShard(t, coord, cluster, s, every, forever)
			}
			rs[0].waitSnapshot(8)
			rs[1].kill(coord)
			killedAt := rs[0].c.CommittedStep()
			rs[1] = startShard(t, coord, cluster, 1, every, forever)
			for _, r := range rs {
				r.waitStep(killedAt + 10)
			}
			for _, r := range rs {
				if err := r.stop(); err != nil {
					t.Errorf("slot %d: %v", r.slot, err)
				}
			}
			for _, r := range rs {
				if want := shardAt(r.slot, r.c.CommittedStep(), shardLen); !slices.Equal(r.params, want) {
					t.Errorf("slot %d at step %d differs from the run without the failure", r.slot, r.c.CommittedStep())
				}
			}
			restored := rs[1].eventsOf(EventRestored)
			if len(restored) != 1 || restored[0].Bytes != shardLen*4 {
				t.Fatalf("the new rank's restores: %v, want one of %d bytes from its buddy", restored, shardLen*4)
			}
			step := restored[0].Step
			if step%int64(every) != 0 || step > killedAt || step < 8 {
				t.Errorf("restored step %d: want a snapshot step (every %d) in [8, %d]", step, every, killedAt)
			}
			for _, r := range []*shardRank{rs[0], rs[2]} {
				ev := r.eventsOf(EventRestored)
				if len(ev) != 1 || ev[0].Bytes != 0 || ev[0].Step != step {
					t.Errorf("slot %d restores %v: want one of step %d from its own copy", r.slot, ev, step)
				}
				r.mu.Lock()
				rolled := slices.Clone(r.rolled)
				r.mu.Unlock()
				if ev[0].FromStep > step && (len(rolled) != 1 || !rolled[0].Snapshot || rolled[0].Step != step || rolled[0].ToStep != ev[0].FromStep) {
					t.Errorf("slot %d: rollbacks %+v, want one to step %d from %d", r.slot, rolled, step, ev[0].FromStep)
				}
				t.Logf("slot %d: held step %d, restored %d", r.slot, ev[0].FromStep, step)
			}
		})
	}
}

// The replacement dies after it fetched its copy, before the group's
// barrier: no survivor has written anything (each still holds the state
// of its own committed step), and the next replacement restores the
// group; every shard ends as in the run without failures.
func TestSnapshotReplacementDiesDuringRestore(t *testing.T) {
	coord, cluster := memcoord.New("toy", quick()), inproc.NewCluster()
	t.Cleanup(coord.Close)
	rs := make([]*shardRank, shardSlots)
	for s := range rs {
		rs[s] = startShard(t, coord, cluster, s, 4, forever)
	}
	rs[0].waitSnapshot(8)
	rs[1].kill(coord)
	fetched, dead := make(chan struct{}), make(chan struct{})
	doomed := startShardWith(t, coord, cluster, 1, 4, forever, func(r *shardRank) {
		r.c.d.snaps.testHook = func(phase string) {
			if phase == "fetched" {
				close(fetched)
				<-dead // held here until the test has killed it: its restore goes no further
			}
		}
	})
	select {
	case <-fetched:
	case <-time.After(60 * time.Second):
		t.Fatal("the replacement never fetched its copy")
	}
	killed := make(chan struct{})
	go func() { doomed.killThen(coord, func() { close(dead) }); close(killed) }()
	for _, r := range []*shardRank{rs[0], rs[2]} {
		if ev := r.eventsOf(EventRestored); len(ev) != 0 {
			t.Fatalf("slot %d restored %v with its replacement gone before the barrier", r.slot, ev)
		}
		if held := r.c.CommittedStep(); !slices.Equal(r.params, shardAt(r.slot, held, shardLen)) {
			t.Fatalf("slot %d's state is not its committed step %d's", r.slot, held)
		}
	}
	<-killed // before its place is taken: the kill removes "fsdp.1"
	rs[1] = startShard(t, coord, cluster, 1, 4, forever)
	target := rs[0].c.CommittedStep() + 10
	for _, r := range rs {
		r.waitStep(target)
	}
	for _, r := range rs {
		if err := r.stop(); err != nil {
			t.Errorf("slot %d: %v", r.slot, err)
		}
		if want := shardAt(r.slot, r.c.CommittedStep(), shardLen); !slices.Equal(r.params, want) {
			t.Errorf("slot %d at step %d differs from the run without the failure", r.slot, r.c.CommittedStep())
		}
	}
}

// A rank and the buddy that holds its copy die together: the shard is
// gone. Every rank of the group gets a *SnapshotLostError, and nothing is
// restored: the survivor's state is what it committed.
func TestSnapshotLostWhenBothCopiesDie(t *testing.T) {
	coord, cluster := memcoord.New("toy", quick()), inproc.NewCluster()
	t.Cleanup(coord.Close)
	rs := make([]*shardRank, shardSlots)
	for s := range rs {
		rs[s] = startShard(t, coord, cluster, s, 2, forever)
	}
	rs[0].waitSnapshot(4)
	// One host: slot 1's buddy is slot 2, slot 2's is slot 0.
	if b := buddies([]string{"h", "h", "h"}); b[1] != 2 {
		t.Fatalf("buddies %v", b)
	}
	rs[1].kill(coord)
	rs[2].kill(coord)
	rs[1] = startShard(t, coord, cluster, 1, 2, forever)
	rs[2] = startShard(t, coord, cluster, 2, 2, forever)
	for _, r := range rs {
		select {
		case <-r.done:
		case <-time.After(60 * time.Second):
			t.Fatalf("slot %d never gave up", r.slot)
		}
		r.mu.Lock()
		err := r.err
		r.mu.Unlock()
		var le *SnapshotLostError
		if !errors.As(err, &le) || !slices.Equal(le.Slots, []int{1}) {
			t.Errorf("slot %d: %v; want a *SnapshotLostError naming slot 1 (slot 2's copy is at slot 0)", r.slot, err)
		}
		if err := r.c.Close(); err != nil {
			t.Errorf("close slot %d: %v", r.slot, err)
		}
	}
	// Nothing was restored: the survivor holds its own committed state.
	if held := rs[0].c.CommittedStep(); !slices.Equal(rs[0].params, shardAt(0, held, shardLen)) {
		t.Fatalf("the survivor's state is not its committed step %d's", held)
	}
	if ev := rs[0].eventsOf(EventRestored); len(ev) != 0 {
		t.Fatalf("restores %v", ev)
	}
}
