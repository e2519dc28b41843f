package ft

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/coordinator/memcoord"
	"github.com/ftcomm/ftcomm/membership"
)

// A toy training job: every replica holds the same parameters; each step
// they average a gradient that depends on the step and the replica, and
// apply it. Replicas that commit a step must end it with identical state.

const defaultParams = 4096

type ledger struct {
	mu     sync.Mutex
	hashes map[int64]uint64 // committed step → state hash
	errs   []error
}

func (l *ledger) commit(who string, step int64, params []float32) {
	h := fnv.New64a()
	for _, p := range params {
		var b [4]byte
		u := math.Float32bits(p)
		b[0], b[1], b[2], b[3] = byte(u), byte(u>>8), byte(u>>16), byte(u>>24)
		h.Write(b[:])
	}
	sum := h.Sum64()
	l.mu.Lock()
	defer l.mu.Unlock()
	if prev, ok := l.hashes[step]; ok && prev != sum {
		l.errs = append(l.errs, fmt.Errorf("%s committed step %d with state %x, another replica with %x", who, step, sum, prev))
	}
	l.hashes[step] = sum
}

type replica struct {
	t        *testing.T
	id       string
	c        *Comm
	params   []float32
	m        *memcoord.Member
	cancel   context.CancelFunc
	done     chan struct{}
	commits  []commitRecord
	mu       sync.Mutex
	err      error
	progress chan struct{} // signalled after every commit
	satOut   chan struct{} // signalled when the replica sits an epoch out
	compute  atomic.Int64  // the loop's compute time per step (ns): a sleep between Step and the all-reduce
	events   *eventLog     // what its Comm reported
}

// eventLog keeps a Comm's events (Config.OnEvent).
type eventLog struct {
	mu  sync.Mutex
	evs []Event
}

func (l *eventLog) add(e Event) {
	l.mu.Lock()
	l.evs = append(l.evs, e)
	l.mu.Unlock()
}

// of returns the events of kind k.
func (l *eventLog) of(k EventKind) []Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []Event
	for _, e := range l.evs {
		if e.Kind == k {
			out = append(out, e)
		}
	}
	return out
}

type commitRecord struct {
	step         int64
	participants int
	epoch        uint64
}

type job struct {
	t       *testing.T
	coord   *memcoord.Coordinator
	cluster *inproc.Cluster
	ledger  *ledger
	cfg     Config
	nParams int
}

func newJob(t *testing.T, qc quorum.Config, minReplicas int) *job {
	j := &job{t: t, coord: memcoord.New("toy", qc), cluster: inproc.NewCluster(), ledger: &ledger{hashes: map[int64]uint64{}}, nParams: defaultParams}
	j.cfg = Config{Job: "toy", Backend: "inproc", BackendConfig: j.cluster, Secret: []byte("k"),
		MinReplicas: minReplicas, Timeout: 10 * time.Second, HealChunkSize: 4096}
	t.Cleanup(j.coord.Close)
	return j
}

// start launches replica group (rank groupRank of groupSize) training until
// it has committed `until` steps or is killed.
func (j *job) start(group string, groupRank, groupSize int, until int64) *replica {
	r := j.open(group, groupRank, groupSize)
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go r.train(ctx, j.ledger, until)
	return r
}

// open makes replica group's Comm (rank groupRank of groupSize), joined and
// with its state registered, not training yet.
func (j *job) open(group string, groupRank, groupSize int) *replica {
	return j.openWith(func(id, g string, min int) *memcoord.Member { return joinAs(j.coord, id, min) }, group, groupRank, groupSize)
}

// openWith is open, registering through join (memcoord's Join or JoinSpare).
func (j *job) openWith(join func(id, group string, minReplicas int) *memcoord.Member, group string, groupRank, groupSize int) *replica {
	cfg := j.cfg
	cfg.Group, cfg.GroupRank, cfg.GroupSize = group, groupRank, groupSize
	cfg.Logger = zaptest.NewLogger(j.t).Named(memberID(group, groupRank))
	m := join(memberID(group, groupRank), group, cfg.MinReplicas*groupSize)
	cfg.Membership = m
	satOut := make(chan struct{}, 1)
	events := &eventLog{}
	cfg.OnEvent = func(e Event) {
		events.add(e)
		if e.Kind == EventSatOut {
			select {
			case satOut <- struct{}{}:
			default:
			}
		}
	}
	c, err := New(context.Background(), cfg)
	if err != nil {
		j.t.Fatal(err)
	}
	r := &replica{t: j.t, id: memberID(group, groupRank), c: c, m: m, params: make([]float32, j.nParams), done: make(chan struct{}),
		progress: make(chan struct{}, 1), satOut: satOut, events: events}
	for i := range r.params {
		r.params[i] = 1
	}
	if err := c.Register("params", comm.Float32s(r.params)); err != nil {
		j.t.Fatal(err)
	}
	return r
}

func (r *replica) train(ctx context.Context, l *ledger, until int64) {
	defer close(r.done)
	grads := make([]float32, len(r.params))
	for r.c.CommittedStep() < until {
		// A rollback has started the step as nil does (the state healed).
		if err := r.c.Step(ctx); err != nil && !errors.Is(err, ErrRolledBack) {
			r.setErr(err)
			return
		}
		if d := time.Duration(r.compute.Load()); d > 0 {
			time.Sleep(d) // the workload's compute, not a synchronisation
		}
		step := r.c.CommittedStep()
		for i := range grads { // depends on the step and the replica; the average does not depend on who computed it
			grads[i] = float32((int(step)*7+i)%13) / 8
		}
		r.c.AllReduce(ctx, comm.Float32s(grads), comm.Avg)
		ok, err := r.c.Commit(ctx)
		if err != nil {
			r.setErr(err)
			return
		}
		r.checkDeadlines()
		if ok {
			r.applyCommit(l, grads)
		}
	}
}

// applyCommit applies a committed step's update, records it in the
// ledger and the replica's commits, and signals progress.
func (r *replica) applyCommit(l *ledger, grads []float32) {
	for i := range r.params {
		r.params[i] -= 0.01 * grads[i]
	}
	l.commit(r.id, r.c.CommittedStep(), r.params)
	r.noteCommit()
}

// noteCommit records the replica's commit and tells a test waiting on its
// progress.
func (r *replica) noteCommit() {
	r.mu.Lock()
	r.commits = append(r.commits, commitRecord{r.c.CommittedStep(), r.c.Participants(), r.c.Epoch()})
	r.mu.Unlock()
	select {
	case r.progress <- struct{}{}:
	default:
	}
}

// checkDeadlines asserts that no op of the current FT comm ran past the
// comm's deadline (with a little room for the scheduler on a loaded machine).
func (r *replica) checkDeadlines() {
	ft := r.c.ftData()
	if ft == nil {
		return
	}
	for _, op := range ft.FlightRecord().Ops {
		if !op.Finished.IsZero() && !op.Started.IsZero() && op.Finished.Sub(op.Started) > r.c.cfg.Timeout+2*time.Second {
			r.setErr(fmt.Errorf("%s #%d ran %v, past its %v deadline", op.Op, op.Seq, op.Finished.Sub(op.Started), r.c.cfg.Timeout))
		}
	}
}

func (r *replica) setErr(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err == nil {
		r.err = err
	}
}

// wait waits for the replica's loop to end and returns its error.
func (r *replica) wait() error {
	select {
	case <-r.done:
	case <-time.After(60 * time.Second):
		r.t.Fatalf("%s did not finish", r.id)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// kill simulates the death of the process: its training stops mid-flight,
// its peers see it fail, and the coordinator learns of it as from gossip.
func (j *job) kill(r *replica) {
	ft := r.c.ftData()
	if ft != nil {
		ft.Backend().(*inproc.Backend).Fail()
	}
	r.cancel()
	j.coord.Remove(r.id, quorum.PortClosed)
	<-r.done
	r.c.d.server.Close() // its state endpoint dies with it
	// Its driver outlives the "process" (its ticks may still log): stop it
	// before the test's logger goes.
	j.t.Cleanup(func() { r.c.Close() })
}

// waitStep blocks until r has committed step s.
func (r *replica) waitStep(s int64) {
	deadline := time.After(60 * time.Second)
	for r.c.CommittedStep() < s {
		select {
		case <-r.progress:
		case <-r.done:
			r.t.Fatalf("%s stopped at step %d before %d: %v", r.id, r.c.CommittedStep(), s, r.err)
		case <-deadline:
			r.t.Fatalf("%s stuck at step %d", r.id, r.c.CommittedStep())
		}
	}
}

// waitParticipants blocks until r commits a step with n participants.
func (r *replica) waitParticipants(n int) {
	deadline := time.After(60 * time.Second)
	for {
		if recs := r.records(); len(recs) > 0 && recs[len(recs)-1].participants == n {
			return
		}
		select {
		case <-r.progress:
		case <-r.done:
			r.t.Fatalf("%s stopped before committing with %d participants: %v", r.id, n, r.err)
		case <-deadline:
			r.t.Fatalf("%s never committed with %d participants", r.id, n)
		}
	}
}

func (r *replica) records() []commitRecord {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]commitRecord(nil), r.commits...)
}

func (j *job) check(rs ...*replica) { j.t.Helper(); j.ledger.check(j.t, rs...) }

// check asserts that every committed step's state was the same on every
// replica that committed it, and that each replica's steps only grew.
func (l *ledger) check(t *testing.T, rs ...*replica) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, err := range l.errs {
		t.Error(err)
	}
	for _, r := range rs {
		var last int64
		for _, c := range r.records() {
			if c.step <= last {
				t.Errorf("%s: committed step %d after %d", r.id, c.step, last)
			}
			last = c.step
		}
	}
}

func quick() quorum.Config {
	return quorum.Config{MinReplicas: 1, JoinTimeout: 200 * time.Millisecond}
}

// forever makes a replica train until it is stopped.
const forever = 1 << 40

// stopAll stops replicas' training, fails the test on any error but the
// cancellation, checks the ledger and closes them.
func (j *job) stopAll(rs ...*replica) {
	j.t.Helper()
	stopAll(j.t, j.ledger, rs...)
}

func stopAll(t *testing.T, l *ledger, rs ...*replica) {
	t.Helper()
	for _, r := range rs {
		r.cancel()
	}
	for _, r := range rs {
		if err := r.wait(); err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("%s: %v", r.id, err)
		}
	}
	l.check(t, rs...)
	for _, r := range rs {
		if err := r.c.Close(); err != nil {
			t.Errorf("close %s: %v", r.id, err)
		}
	}
}

func TestKillOneThenRejoin(t *testing.T) {
	j := newJob(t, quick(), 2)
	var rs []*replica
	for _, g := range []string{"a", "b", "c", "d"} {
		rs = append(rs, j.start(g, 0, 1, forever))
	}
	rs[0].waitParticipants(4)
	j.kill(rs[3])
	killedAt := rs[0].c.CommittedStep()
	rs[0].waitStep(killedAt + 5)
	// The survivors kept committing with 3 participants, without restarting.
	for _, r := range rs[:3] {
		n3 := 0
		for _, c := range r.records() {
			if c.step > killedAt+1 && c.participants == 3 {
				n3++
			}
		}
		if n3 < 3 {
			t.Fatalf("%s committed %d steps with 3 participants after the kill: %+v", r.id, n3, r.records())
		}
	}
	// d restarts as a new incarnation, heals from its peers and rejoins.
	d := j.start("d", 0, 1, forever)
	d.waitParticipants(4)
	if recs := d.records(); recs[0].step <= killedAt+5 {
		t.Fatalf("the restarted replica's first commit was step %d: it did not heal", recs[0].step)
	}
	j.stopAll(append(rs[:3], d)...)
}

func TestLateJoinerHeals(t *testing.T) {
	j := newJob(t, quick(), 1)
	a, b := j.start("a", 0, 1, forever), j.start("b", 0, 1, forever)
	a.waitParticipants(2)
	a.waitStep(a.c.CommittedStep() + 5)
	c := j.start("c", 0, 1, forever)
	c.waitParticipants(3)
	if recs := c.records(); recs[0].step < 7 || recs[0].participants != 3 {
		t.Fatalf("late joiner's first commit: %+v", recs[0])
	}
	j.stopAll(a, b, c)
}

// One replica's step fails (an op error it records): its commit fails, the
// epoch is bumped, and it heals the step it missed from the others.
func TestFailedCommitForcesNextEpoch(t *testing.T) {
	j := newJob(t, quick(), 1)
	a, b := j.start("a", 0, 1, forever), j.start("b", 0, 1, forever)
	b.waitParticipants(2)
	e0 := a.c.Epoch()
	// Break b's FT comm under it, as a flaky link would.
	for {
		ft := b.c.ftData()
		if ft != nil {
			ft.Abort(errors.New("injected link failure"))
			break
		}
		select { // b is between epochs: try again after its next commit
		case <-b.progress:
		case <-b.done:
			t.Fatal("b stopped")
		}
	}
	at := b.c.CommittedStep()
	b.waitStep(at + 3)
	if a.c.Epoch() <= e0 {
		t.Fatalf("epoch did not advance after a failed commit: %d", a.c.Epoch())
	}
	j.stopAll(a, b)
}

func TestMinReplicasBlocksCommit(t *testing.T) {
	j := newJob(t, quick(), 2)
	cfg := j.cfg
	// The member does not tell the coordinator the job's minimum (as with a
	// coordinator configured apart from the job), so a quorum of one forms:
	// ft's own check must refuse to commit with it.
	cfg.Group, cfg.Membership, cfg.MaxCommitFailures = "solo", joinAs(j.coord, "solo.0", 0), 3
	c, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var last error
	for i := 0; i < 3; i++ {
		if err := c.Step(ctx); err != nil {
			t.Fatal(err)
		}
		ok, err := c.Commit(ctx)
		if ok {
			t.Fatal("committed with 1 of 2 replicas")
		}
		last = err
	}
	if !errors.Is(last, ErrTooManyCommitFailures) {
		t.Fatalf("after 3 failed commits: %v", last)
	}
}

// HSDP: two groups of two ranks. Rank 1 of group b dies: group b leaves as a
// whole, group a keeps training alone; b restarts its rank and rejoins whole.
func TestReplicaGroups(t *testing.T) {
	j := newJob(t, quick(), 1)
	a0, a1 := j.start("a", 0, 2, forever), j.start("a", 1, 2, forever)
	b0, b1 := j.start("b", 0, 2, forever), j.start("b", 1, 2, forever)
	a0.waitParticipants(2)
	select { // an early sit-out (before b1 joined) is not the one to wait for
	case <-b0.satOut:
	default:
	}
	j.kill(b1)
	a0.waitParticipants(1)
	a0.waitStep(a0.c.CommittedStep() + 3)
	select {
	case <-b0.satOut:
	case <-time.After(60 * time.Second):
		t.Fatal("b0 never sat out without its group")
	}
	if n := b0.c.Participants(); n != 0 {
		t.Fatalf("b0 sits out with %d participants", n)
	}
	b1 = j.start("b", 1, 2, forever)
	b0.waitParticipants(2)
	b1.waitParticipants(2)
	j.stopAll(a0, a1, b0, b1)
}

// A replica heals from three sources and one of them dies mid-transfer:
// the healer finishes from the others (in this epoch or, resuming, in the
// next) and every replica's state stays identical.
func TestHealingSourceDiesMidTransfer(t *testing.T) {
	j := newJob(t, quick(), 1)
	// 16 MiB of state in 64 KiB chunks: 256 chunks striped over three
	// sources that take them as they go, so a serves some of them even
	// when its goroutines start late (with 4 MiB, under a CPU hog, b and c
	// once served the whole heal before a served its first chunk).
	j.nParams = 1 << 22
	j.cfg.HealChunkSize = 64 << 10
	srcs := []*replica{j.start("a", 0, 1, forever), j.start("b", 0, 1, forever), j.start("c", 0, 1, forever)}
	srcs[0].waitParticipants(3)
	// The source to die is the first to serve a chunk: which one that is
	// depends on when each offers the state and on the scheduler.
	cut := make([]<-chan struct{}, len(srcs))
	for i, r := range srcs {
		cut[i] = r.c.d.server.ServedAtLeast(64 << 10)
	}
	d := j.start("d", 0, 1, forever)
	dead := -1
	select {
	case <-cut[0]:
		dead = 0
	case <-cut[1]:
		dead = 1
	case <-cut[2]:
		dead = 2
	case <-time.After(60 * time.Second):
		t.Fatal("the healer never fetched")
	}
	j.kill(srcs[dead])
	d.waitParticipants(3)
	if recs := d.records(); recs[0].step <= 1 {
		t.Fatalf("the healer's commits: %+v", recs)
	}
	j.stopAll(append(slices.Delete(srcs, dead, dead+1), d)...)
}

func TestCriticalHealthSitsOut(t *testing.T) {
	j := newJob(t, quick(), 1)
	a, b, c := j.start("a", 0, 1, forever), j.start("b", 0, 1, forever), j.start("c", 0, 1, forever)
	a.waitParticipants(3)
	if err := c.c.ReportHealth(context.Background(), membership.Critical, "XID 79: GPU fell off the bus"); err != nil {
		t.Fatal(err)
	}
	at := a.c.CommittedStep()
	a.waitStep(at + 3)
	if p := a.c.Participants(); p != 2 {
		t.Fatalf("participants with c critical: %d", p)
	}
	if err := c.c.ReportHealth(context.Background(), membership.Healthy, ""); err != nil {
		t.Fatal(err)
	}
	c.waitParticipants(3)
	j.stopAll(a, b, c)
}

// Close from another goroutine while Step forms the epoch's comms (here,
// waiting for a peer that never steps): the reconfiguration is cancelled
// and has ended by the time Close returns, so no comm it formed outlives
// Close, and Step returns ErrClosed. Before, Close returned at once and
// Step went on waiting for the peer until Config.Timeout, then stored
// whatever formed into the closed Comm.
func TestCloseDuringFormation(t *testing.T) {
	j := newJob(t, quick(), 2)
	j.cfg.Timeout = 5 * time.Minute // what the formation would wait for the absent peer
	idle := j.open("idle", 0, 1)    // joins the job, never steps
	defer idle.c.Close()
	r := j.start("g0", 0, 1, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := j.cluster.AwaitJoined(ctx, "ft-0", 1); err != nil {
		t.Fatal(err) // g0 never reached the formation
	}
	if err := r.c.Close(); err != nil {
		t.Fatal(err)
	}
	// The driver has ended (Close waits for it): its state is ours to read.
	if n := len(r.c.d.cancels); n > 0 {
		t.Fatalf("Close returned while %d tasks (forming comms) still ran", n)
	}
	if err := r.wait(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Step ended with %v, want ErrClosed", err)
	}
	if n := len(r.c.d.comms); n > 0 {
		t.Fatalf("%d comms left open by the closed Comm", n)
	}
}

// Close from another goroutine at some point of a running training loop
// (Step, the all-reduce, Commit): the loop ends with ErrClosed, no data
// race (under -race), and the other replica trains on without it.
func TestCloseWhileTraining(t *testing.T) {
	j := newJob(t, quick(), 1)
	b := j.start("b", 0, 1, forever)
	for round := range 5 {
		a := j.start("a", 0, 1, forever)
		a.waitStep(b.c.CommittedStep() + int64(1+round%3))
		if err := a.c.Close(); err != nil {
			t.Fatalf("round %d: close: %v", round, err)
		}
		if err := a.wait(); !errors.Is(err, ErrClosed) {
			t.Fatalf("round %d: the loop ended with %v, want ErrClosed", round, err)
		}
		b.waitStep(b.c.CommittedStep() + 2)
	}
	j.stopAll(b)
}

// Close from another goroutine while the replica heals: the transfer stops,
// Step returns ErrClosed, and nothing writes the replica's state after Close
// returned (the caller may reuse or free it).
func TestCloseWhileHealing(t *testing.T) {
	j := newJob(t, quick(), 1)
	j.nParams = 1 << 22 // 16 MiB in 4 KiB chunks: a heal of 4096 requests
	j.cfg.HealChunkSize = 4 << 10
	b := j.start("b", 0, 1, forever)
	b.waitStep(2)
	healing := b.c.d.server.ServedAtLeast(64 << 10)
	d := j.start("d", 0, 1, forever)
	select {
	case <-healing:
	case <-time.After(60 * time.Second): // a hang, not a slow machine
		t.Fatal("d never started healing from b")
	}
	if err := d.c.Close(); err != nil {
		t.Fatal(err)
	}
	after := slices.Clone(d.params)
	if err := d.wait(); !errors.Is(err, ErrClosed) {
		t.Fatalf("the healer's loop ended with %v, want ErrClosed", err)
	}
	served := b.c.d.server.Served()
	b.waitStep(b.c.CommittedStep() + 2)
	if !slices.Equal(after, d.params) {
		t.Fatal("the healer's state changed after Close returned")
	}
	if served >= int64(len(after)*4) {
		t.Logf("the heal had completed before Close (served %d bytes): nothing to stop", served)
	}
	j.stopAll(b)
}

// Close from another goroutine at every point of a reconfiguration — as
// each of the driver's actions is carried out, in a replica that joins a
// running job of replica groups (so it forms its group's comm and an FT
// comm by grow, gathers records, heals, checks its group, votes): Close
// returns, the loop ends with ErrClosed (or its step ended first), no comm
// is left open, nothing panics or races (run with -race), and the rest of
// the job trains on.
func TestCloseAtEveryPointOfReconfiguration(t *testing.T) {
	points := []string{"form group", "form ft", "report formed", "gather", "heal", "check group",
		"offer", "step started", "vote", "withdraw", "commit returns"}
	for _, point := range points {
		t.Run(point, func(t *testing.T) {
			j := newJob(t, quick(), 1)
			a0, a1 := j.start("a", 0, 2, forever), j.start("a", 1, 2, forever)
			a0.waitStep(3)
			b0 := j.start("b", 0, 2, forever)
			b1 := j.open("b", 1, 2)
			closed := make(chan error, 1)
			var once sync.Once
			b1.c.onDriver(func(d *driver) {
				d.hook = func(a action) {
					if !strings.HasPrefix(describe(a), point) {
						return
					}
					once.Do(func() { go func() { closed <- b1.c.Close() }() })
				}
			})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			b1.cancel = cancel
			go b1.train(ctx, j.ledger, forever)
			select {
			case err := <-closed:
				if err != nil {
					t.Fatalf("close: %v", err)
				}
			case <-time.After(60 * time.Second):
				t.Fatalf("Close at %q did not return within 60 s (or the point was never reached: %v)", point, b1.c.Epoch())
			}
			if err := b1.wait(); !errors.Is(err, ErrClosed) {
				t.Fatalf("b.1's loop ended with %v, want ErrClosed", err)
			}
			if n := len(b1.c.d.comms); n > 0 {
				t.Fatalf("%d comms left open after Close", n)
			}
			a0.waitStep(a0.c.CommittedStep() + 2) // group b is incomplete: a trains on alone
			j.stopAll(a0, a1, b0)
			j.check(a0, a1, b0)
		})
	}
}

// A replica whose compute is much slower than its peers' is taken out of
// the job under a straggler policy (ft reports each step's compute time),
// the others train on at their pace, and it is let back after its
// probation once it keeps up.
func TestStragglerIsTakenOutAndLetBack(t *testing.T) {
	qc := quick()
	qc.Stragglers = membership.StragglerPolicy{Factor: 4, Window: 300 * time.Millisecond, Probation: 500 * time.Millisecond}
	j := newJob(t, qc, 1)
	var rs []*replica
	for _, g := range []string{"a", "b", "c"} {
		r := j.open(g, 0, 1)
		r.compute.Store(int64(2 * time.Millisecond))
		rs = append(rs, r)
	}
	rs[2].compute.Store(int64(60 * time.Millisecond))
	for _, r := range rs {
		ctx, cancel := context.WithCancel(context.Background())
		r.cancel = cancel
		go r.train(ctx, j.ledger, forever)
	}
	rs[0].waitParticipants(3)
	rs[0].waitParticipants(2) // c is out
	if rec, _ := j.coord.Record("c.0"); rec.StepTime < 30*time.Millisecond {
		t.Errorf("c's reported step time is %v, its compute 60ms", rec.StepTime)
	}
	q, _ := j.coord.Latest()
	for _, p := range q.Participants {
		if p.ID == "c.0" {
			t.Fatalf("c is still a participant of epoch %d: %+v", q.Epoch, q.Participants)
		}
	}
	rs[2].compute.Store(int64(2 * time.Millisecond))
	rs[0].waitParticipants(3) // back after its probation
	rs[2].waitParticipants(3)
	j.stopAll(rs...)
}

// New refuses a misconfiguration with comm.ErrInvalidArgument and a
// message naming the setting, before it registers anything: the job's
// Membership stays without a member.
func TestNewRefusesMisconfiguration(t *testing.T) {
	j := newJob(t, quick(), 1)
	for _, tc := range []struct {
		name, want string
		mod        func(*Config)
	}{
		{"run with a Membership of one's own", "run", func(c *Config) { c.Run = "r2" }},
		{"bad job name", "job", func(c *Config) { c.Job = "a job" }},
		{"group rank outside the group", "group rank", func(c *Config) { c.GroupSize, c.GroupRank = 2, 2 }},
		{"no secret", "Secret", func(c *Config) { c.Secret = nil }},
		{"negative timeout", "Timeout", func(c *Config) { c.Timeout = -time.Second }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := j.cfg
			cfg.Group = "a"
			cfg.Membership = joinAs(j.coord, "a.0", 1)
			defer cfg.Membership.Close()
			tc.mod(&cfg)
			c, err := New(context.Background(), cfg)
			if err == nil {
				c.Close()
				t.Fatal("New accepted it")
			}
			if !errors.Is(err, comm.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New: %v, want comm.ErrInvalidArgument naming %q", err, tc.want)
			}
		})
	}
}

// An op the caller refused before issuing it (Refuse: the Python API's
// checks) fails the step like an op with an invalid argument: Refuse
// returns comm.ErrInvalidArgument, the commit does not go through, and the
// next step commits.
func TestRefusedOpFailsTheStep(t *testing.T) {
	j := newJob(t, quick(), 1)
	r := j.open("a", 0, 1)
	defer r.c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := 0; ; i++ {
		if err := r.c.Step(ctx); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			err := r.c.Refuse(ctx, comm.Op{Kind: comm.OpBroadcast, Root: 7}, errors.New("root 7 outside [0, 1)"))
			if !errors.Is(err, comm.ErrInvalidArgument) || !strings.Contains(err.Error(), "root 7") {
				t.Fatalf("Refuse: %v", err)
			}
		}
		ok, err := r.c.Commit(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 && ok {
			t.Fatal("the step with the refused op committed")
		}
		if i > 0 && ok {
			return
		}
	}
}

// A spare (Config.Spare) waits in Step, reporting Spare, while the job is
// at its size; when a replica dies it is promoted, heals and commits with
// the survivors at full size, and is a spare no more.
func TestSpareWaitsThenTakesAPlace(t *testing.T) {
	j := newJob(t, quick(), 1)
	var rs []*replica
	for _, g := range []string{"a", "b", "c"} {
		rs = append(rs, j.start(g, 0, 1, forever))
	}
	rs[0].waitParticipants(3)
	cfg := j.cfg
	j.cfg.Spare = true
	s := j.openWith(j.coord.JoinSpare, "s", 0, 1)
	j.cfg = cfg
	if !s.c.Spare() {
		t.Fatal("a spare's Comm does not say it is one")
	}
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	go s.train(ctx, j.ledger, forever)
	at := rs[0].c.CommittedStep()
	rs[0].waitStep(at + 20)
	if n := len(s.records()); n != 0 || !s.c.Spare() {
		t.Fatalf("the spare committed %d steps (spare: %v) while the job was at its size", n, s.c.Spare())
	}
	j.kill(rs[2])
	t.Cleanup(func() { rs[2].c.Close() }) // its driver outlives the "process": stop it before the test's logger goes
	s.waitParticipants(3)
	if s.c.Spare() {
		t.Error("a promoted spare still says it is one")
	}
	if first := s.records()[0].step; first <= at {
		t.Errorf("the spare's first commit was step %d: it did not heal to the job's step (above %d)", first, at)
	}
	j.stopAll(rs[0], rs[1], s)
}

// A replica joins four that train: a prepared grow with four survivors
// for one joiner, so the survivors do not move at once — they form the
// grown epoch's comms in the background, step on in their epoch up to
// the step they agreed on, and move after it. None of their steps fails;
// each moves to the joiner's epoch as a prepared grow; the joiner heals
// and commits with them.
func TestPreparedGrowLetsTheSurvivorsStepOn(t *testing.T) {
	j := newJob(t, quick(), 1)
	var rs []*replica
	for _, g := range []string{"a", "b", "c", "d"} {
		r := j.start(g, 0, 1, forever)
		r.compute.Store(int64(2 * time.Millisecond)) // steps long enough to be known and short next to the timeout
		rs = append(rs, r)
	}
	rs[0].waitParticipants(4)
	rs[0].waitStep(rs[0].c.CommittedStep() + 5) // a few steps' length known (the stall window's minimum)
	e := j.start("e", 0, 1, forever)
	e.waitParticipants(5)
	for _, r := range rs {
		r.waitParticipants(5)
		grown := r.c.Epoch()
		var moved []Event
		for _, ev := range r.events.of(EventReconfigured) {
			if ev.Participants == 5 {
				moved = append(moved, ev)
			}
		}
		if len(moved) != 1 || moved[0].How != "prepared" {
			t.Errorf("%s reached 5 participants (epoch %d) by %+v, want one prepared grow", r.id, grown, moved)
		}
		if failed := r.events.of(EventCommitFailed); len(failed) > 0 {
			t.Errorf("%s failed %d steps around the joiner's arrival (first: %s), want none", r.id, len(failed), failed[0].Reason)
		}
	}
	j.stopAll(append(rs, e)...)
}
