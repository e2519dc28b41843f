package ft

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/internal/testutil"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

// etcdJob runs replicas registered through a real embedded etcd with a real
// Coordinator, in one process.
type etcdJob struct {
	t       *testing.T
	etcd    *etcdhost.Embedded
	coord   *coordinator.Coordinator
	stopC   context.CancelFunc
	coordWG sync.WaitGroup
	ledger  *ledger
	cfg     Config
	reg     *prometheus.Registry // the running coordinator's metrics
}

func newEtcdJob(t *testing.T, backend string, backendConfig any) *etcdJob {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e, err := etcdhost.StartEmbedded(ctx, etcdhost.EmbeddedConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	j := &etcdJob{t: t, etcd: e, ledger: &ledger{hashes: map[int64]uint64{}}}
	mc := membership.DefaultMemberConfig()
	mc.LeaseTTL = 2 * time.Second
	j.cfg = Config{Job: "toy", Coordinator: e.Endpoints(), Member: mc, Backend: backend, BackendConfig: backendConfig,
		Secret: []byte("k"), MinReplicas: 1, Timeout: 10 * time.Second, HealChunkSize: 4096}
	j.startCoordinator()
	t.Cleanup(j.stopCoordinator)
	return j
}

func (j *etcdJob) startCoordinator() {
	cli, err := j.etcd.NewClient(nil)
	if err != nil {
		j.t.Fatal(err)
	}
	cfg := coordinator.DefaultConfig()
	cfg.Client, cfg.Quorum.JoinTimeout, cfg.SessionTTL = cli, 300*time.Millisecond, 2*time.Second
	cfg.Logger = zaptest.NewLogger(j.t).Named("coordinator")
	j.reg = prometheus.NewRegistry()
	cfg.Registerer = j.reg
	c, err := coordinator.New(cfg)
	if err != nil {
		j.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	j.coord, j.stopC = c, cancel
	j.coordWG.Add(1)
	go func() {
		defer j.coordWG.Done()
		defer cli.Close()
		if err := c.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
			j.t.Errorf("coordinator: %v", err)
		}
	}()
}

func (j *etcdJob) stopCoordinator() {
	if j.stopC != nil {
		j.stopC()
		j.coordWG.Wait()
		j.stopC = nil
	}
}

func (j *etcdJob) start(group string, until int64, params int) *replica {
	r := j.register(group, params)
	r.startTraining(j.ledger, until)
	return r
}

// register makes a replica's Comm (New) and registers its state, without
// stepping yet.
func (j *etcdJob) register(group string, params int) *replica {
	cfg := j.cfg
	cfg.Group = group
	cfg.Logger = zaptest.NewLogger(j.t).Named(group)
	c, err := New(context.Background(), cfg)
	if err != nil {
		j.t.Fatal(err)
	}
	r := &replica{t: j.t, id: memberID(group, 0), c: c, params: make([]float32, params), done: make(chan struct{}), progress: make(chan struct{}, 1)}
	for i := range r.params {
		r.params[i] = 1
	}
	if err := c.Register("params", comm.Float32s(r.params)); err != nil {
		j.t.Fatal(err)
	}
	r.cancel = func() {}
	return r
}

// startTraining runs r's training loop until its committed step reaches
// until (or r.cancel).
func (r *replica) startTraining(l *ledger, until int64) {
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go r.train(ctx, l, until)
}

// A replica asks to take part at its first Step, not when New registers
// it: while it builds its model after New (seconds for a PyTorch job) the
// others train on in their epoch — before, the coordinator admitted it at
// once and every other replica waited in the grow for its first Step.
func TestEtcdJoinerAsksAtItsFirstStep(t *testing.T) {
	j := newEtcdJob(t, "inproc", inproc.NewCluster())
	a, b := j.start("a", forever, 256), j.start("b", forever, 256)
	a.waitParticipants(2)
	cli, err := j.etcd.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx := testutil.Ctx(t, time.Minute)
	record := func() membership.MemberRecord {
		resp, err := cli.Get(ctx, etcdkeys.Layout{}.Member("toy", "c.0"))
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("c's registration: %v (%d keys)", err, len(resp.Kvs))
		}
		var rec membership.MemberRecord
		if err := json.Unmarshal(resp.Kvs[0].Value, &rec); err != nil {
			t.Fatal(err)
		}
		return rec
	}

	c := j.register("c", 256) // New: registered, not stepping yet
	if rec := record(); rec.WantQuorum {
		t.Fatalf("c asks to take part before its first Step: %+v", rec)
	}
	// The coordinator knows c is there; the others keep their epoch.
	testutil.WaitFor(t, ctx, "the coordinator seeing c", func() bool {
		s, ok := j.coord.Status("toy")
		return ok && s.Members == 3
	})
	// A joiner that steps at once makes the coordinator decide with c
	// registered: one grow, without c (before: a grow that took c in,
	// failed for want of its first Step, and another without it).
	epoch := a.c.Epoch()
	d := j.start("d", forever, 256)
	d.waitParticipants(3)
	a.waitParticipants(3)
	if got := a.c.Epoch(); got != epoch+1 {
		t.Fatalf("d's join took a from epoch %d to %d: not one grow", epoch, got)
	}

	c.startTraining(j.ledger, forever) // its first Step asks
	c.waitParticipants(4)
	if rec := record(); !rec.WantQuorum {
		t.Fatalf("c takes part without asking: %+v", rec)
	}
	stopAll(t, j.ledger, a, b, c, d)
}

// Training goes on while the coordinator is down (steady state needs no
// coordinator), and a late joiner is admitted once a coordinator is back.
func TestEtcdCoordinatorRestartAndLateJoiner(t *testing.T) {
	for _, backend := range []string{"inproc", "gloo"} {
		t.Run(backend, func(t *testing.T) { testCoordinatorRestartAndLateJoiner(t, backend) })
	}
}

func backendConfig(backend string) any {
	if backend == "inproc" {
		return inproc.NewCluster()
	}
	return nil
}

func testCoordinatorRestartAndLateJoiner(t *testing.T, backend string) {
	j := newEtcdJob(t, backend, backendConfig(backend))
	a, b := j.start("a", forever, 1<<16), j.start("b", forever, 1<<16)
	a.waitParticipants(2)
	j.stopCoordinator()
	at := a.c.CommittedStep()
	a.waitStep(at + 20) // no coordinator, no change: steps still commit
	if got := a.c.Participants(); got != 2 {
		t.Fatalf("participants %d while the coordinator is down", got)
	}
	j.startCoordinator()
	c := j.start("c", forever, 1<<16)
	c.waitParticipants(3)
	if recs := c.records(); recs[0].step <= at+20 {
		t.Fatalf("late joiner did not heal: %+v", recs[0])
	}
	stopAll(t, j.ledger, a, b, c)
}

// A replica that leaves gracefully is dropped at once (no lease expiry
// wait); the others shrink and go on.
func TestEtcdGracefulLeave(t *testing.T) {
	for _, backend := range []string{"inproc", "gloo"} {
		t.Run(backend, func(t *testing.T) { testGracefulLeave(t, backend) })
	}
}

func testGracefulLeave(t *testing.T, backend string) {
	j := newEtcdJob(t, backend, backendConfig(backend))
	a, b, c := j.start("a", forever, 256), j.start("b", forever, 256), j.start("c", forever, 256)
	a.waitParticipants(3)
	c.cancel()
	<-c.done
	if err := c.c.Close(); err != nil {
		t.Fatal(err)
	}
	at := a.c.CommittedStep()
	a.waitStep(at + 3)
	b.waitStep(at + 3)
	if p := a.c.Participants(); p != 2 {
		t.Fatalf("participants after c left: %d", p)
	}
	stopAll(t, j.ledger, a, b)
}

// A replica restarted while its dead predecessor's lease is still alive
// waits for the lease to expire instead of failing with a duplicate id.
func TestEtcdRestartWhileOldLeaseLives(t *testing.T) {
	j := newEtcdJob(t, "inproc", inproc.NewCluster())
	cli, err := j.etcd.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The dead incarnation: its record under a lease nobody renews.
	lease, err := cli.Grant(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	rec, _ := json.Marshal(membership.MemberRecord{Job: "toy", ID: "a.0", Group: "a", Addr: "127.0.0.1:1", Lease: int64(lease.ID)})
	if _, err := cli.Put(ctx, etcdkeys.Layout{}.Member("toy", "a.0"), string(rec), clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	a := j.start("a", forever, 256) // New returns once the old lease is gone
	b := j.start("b", forever, 256)
	a.waitParticipants(2)
	stopAll(t, j.ledger, a, b)
}

// A rank whose registration ended while its process lived on (its lease
// expired in a pause or a partition, or a coordinator removed it)
// registers again with the step it holds: the coordinator's history rule
// counts a rank that holds the job's step as holding it, and one that
// reported step 0 as holding nothing (its quorum then waited for lapsed
// holders that the rank had caught up with).
func TestEtcdRegisteredAgainWithItsStep(t *testing.T) {
	j := newEtcdJob(t, "inproc", inproc.NewCluster())
	a, b := j.start("a", forever, 256), j.start("b", forever, 256)
	a.waitParticipants(2)
	a.waitStep(5)
	cli, err := j.etcd.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx := testutil.Ctx(t, 30*time.Second)
	key := etcdkeys.Layout{}.Member("toy", "a.0")
	before := a.c.CommittedStep()
	resp, err := cli.Delete(ctx, key, clientv3.WithPrevKV())
	if err != nil || len(resp.PrevKvs) != 1 {
		t.Fatalf("delete a's registration: %+v, %v", resp, err)
	}
	old := resp.PrevKvs[0].CreateRevision
	var rec membership.MemberRecord
	testutil.WaitFor(t, ctx, "a registered again", func() bool {
		r, err := cli.Get(ctx, key)
		if err != nil || len(r.Kvs) == 0 || r.Kvs[0].CreateRevision == old {
			return false
		}
		return json.Unmarshal(r.Kvs[0].Value, &rec) == nil
	})
	if rec.Step < before {
		t.Fatalf("a registered again at step %d, holding step %d or more", rec.Step, before)
	}
	a.waitParticipants(2)
	stopAll(t, j.ledger, a, b)
}

// A replica that is behind when the run ends heals to the final step
// before its Step returns ErrFinished: every replica ends with the job's
// final state. c stops stepping (its loop paused) after a few commits; the
// stall rule leaves it out, a and b train to the end and Finish; when c
// steps again it receives the final state, then ErrFinished.
func TestEtcdReplicaBehindEndsWithTheFinalState(t *testing.T) {
	const end, pauseAt = 30, 5
	j := newEtcdJob(t, "inproc", inproc.NewCluster())
	ctx := testutil.Ctx(t, 2*time.Minute)
	a, b, c := j.register("a", 256), j.register("b", 256), j.register("c", 256)
	paused, resume := make(chan struct{}), make(chan struct{})
	// loop trains r until the run's end (then Finish) or until Step
	// returns an error; c pauses between two steps once at pauseAt.
	loop := func(r *replica, pause bool) <-chan error {
		done := make(chan error, 1)
		go func() {
			grads := make([]float32, len(r.params))
			for r.c.CommittedStep() < end {
				if pause && r.c.CommittedStep() >= pauseAt {
					pause = false
					close(paused)
					<-resume
				}
				if err := r.c.Step(ctx); err != nil && !errors.Is(err, ErrRolledBack) {
					done <- err
					return
				}
				step := r.c.CommittedStep()
				for i := range grads {
					grads[i] = float32((int(step)*7+i)%13) / 8
				}
				r.c.AllReduce(ctx, comm.Float32s(grads), comm.Avg)
				ok, err := r.c.Commit(ctx)
				if err != nil {
					done <- err
					return
				}
				if ok {
					for i := range r.params {
						r.params[i] -= 0.01 * grads[i]
					}
				}
			}
			done <- r.c.Finish(ctx)
		}()
		return done
	}
	da, db, dc := loop(a, false), loop(b, false), loop(c, true)
	<-paused
	for _, d := range []<-chan error{da, db} {
		if err := <-d; err != nil {
			t.Fatalf("a or b: %v", err)
		}
	}
	close(resume)
	if err := <-dc; !errors.Is(err, ErrFinished) {
		t.Fatalf("c after the run ended: %v, want ErrFinished", err)
	}
	if got := c.c.CommittedStep(); got != a.c.CommittedStep() {
		t.Errorf("c ended at step %d, the run at %d", got, a.c.CommittedStep())
	}
	if !slices.Equal(c.params, a.params) || !slices.Equal(b.params, a.params) {
		t.Errorf("the replicas' final states differ")
	}
	for _, r := range []*replica{a, b, c} {
		if err := r.c.Close(); err != nil {
			t.Errorf("close %s: %v", r.id, err)
		}
	}
}
