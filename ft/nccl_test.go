package ft

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/backends/nccl/health"
	"github.com/ftcomm/ftcomm/backends/nccl/ncclsim"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/coordinator/memcoord"
	"github.com/ftcomm/ftcomm/membership"
)

// ft over the NCCL backend with the simulated NCCL and CUDA
// (ncclsim.Simulation): each replica is a goroutine standing for a process
// with its own simulated GPU and its own nccl.Library; the data comms are
// NCCL comms over device tensors, the control comms gloo over loopback,
// membership the fake coordinator (membership's real quorum machine). The
// toy job of ft_test.go runs on device memory: gradients are copied to the
// device and all-reduced there, the optimizer step reads the device state
// back, and every committed step's state, read back from the device, is
// checked alike on every replica (per group rank: shards differ).

// gpuJob is one simulated GPU job.
type gpuJob struct {
	t       *testing.T
	coord   *memcoord.Coordinator
	sim     *ncclsim.Simulation
	cfg     Config
	nParams int
	reg     *prometheus.Registry

	log *endingT // the test, for zaptest, quiet once the test ends

	mu      sync.Mutex
	ledgers map[int]*ledger // by group rank
	all     []*gpuReplica   // every replica started, for the clean-up of a failed test
}

// simLibrary opens a nccl.Library on sim for one simulated process.
func simLibrary(t testing.TB, sim *ncclsim.Simulation) *nccl.Library {
	t.Helper()
	lib, err := nccl.OpenSimulation(sim, nccl.LibraryConfig{})
	if err != nil {
		t.Fatal(err)
	}
	return lib
}

func newGPUJob(t *testing.T, devices, minReplicas int) *gpuJob {
	j := &gpuJob{t: t, coord: memcoord.New("toy", quick()), sim: ncclsim.New(devices), nParams: 2048,
		reg: prometheus.NewRegistry(), ledgers: map[int]*ledger{}}
	ctl := gloo.DefaultConfig()
	// Peers that die are aborted (their sockets close) by kill; a long
	// heartbeat timeout keeps a loaded machine from failing healthy steps.
	ctl.HeartbeatInterval, ctl.PeerTimeout = 500*time.Millisecond, 5*time.Second
	j.cfg = Config{Job: "toy", Backend: "nccl", ControlBackend: "gloo", ControlBackendConfig: ctl,
		Secret: []byte("k"), MinReplicas: minReplicas, Timeout: 10 * time.Second, HealChunkSize: 2048,
		Registerer: j.reg}
	j.log = &endingT{TestingT: t}
	t.Cleanup(j.log.end) // last: comms closed earlier release in the background, and log
	t.Cleanup(j.coord.Close)
	t.Cleanup(func() {
		for _, f := range j.sim.Faults() {
			t.Errorf("simulated NCCL: %s", f)
		}
	})
	t.Cleanup(func() {
		// A killed replica not restarted, or a test that failed half-way,
		// leaves replicas behind: their processes end now (a dead one's GPU
		// work is dropped, so its comms release at once).
		j.mu.Lock()
		all := j.all
		j.mu.Unlock()
		for d := range j.sim.Devices() {
			if j.sim.Killed(d) {
				j.sim.Restart(d)
			}
		}
		for _, r := range all {
			r.shutdown()
		}
	})
	return j
}

func (j *gpuJob) ledger(groupRank int) *ledger {
	j.mu.Lock()
	defer j.mu.Unlock()
	l := j.ledgers[groupRank]
	if l == nil {
		l = &ledger{hashes: map[int64]uint64{}}
		j.ledgers[groupRank] = l
	}
	return l
}

// gpuReplica is one rank: a process with its own simulated GPU.
type gpuReplica struct {
	t         *testing.T
	j         *gpuJob
	id        string
	groupRank int
	groupSize int
	dev       int
	c         *Comm
	m         *healthMember
	lib       *nccl.Library
	params    *nccl.DeviceBuffer // the registered state
	grads     *nccl.DeviceBuffer
	one       *nccl.DeviceBuffer // for the shard dimension's all-reduce
	cancel    context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once

	mu sync.Mutex
	// hooks run on the training goroutine at points of a step (setHook),
	// with the step being trained.
	hooks   [nHooks]func(r *gpuReplica, step int64)
	commits []commitRecord
	results []stepResult // every Commit's outcome
	events  []Event
	heals   []int64 // steps healed to, each verified against the ledger
	started int64   // the step trained now (its Step returned)
	err     error
	changed chan struct{} // closed and replaced at every commit and event
}

type stepResult struct {
	step int64 // the step trained (committed step + 1)
	ok   bool
}

// healthMember is the fake member with every health report recorded.
type healthMember struct {
	*memcoord.Member
	mu      sync.Mutex
	reports []healthReport
	changed chan struct{}
}

type healthReport struct {
	h      membership.Health
	reason string
}

func (m *healthMember) SetHealth(ctx context.Context, h membership.Health, reason string) error {
	m.mu.Lock()
	m.reports = append(m.reports, healthReport{h, reason})
	close(m.changed)
	m.changed = make(chan struct{})
	m.mu.Unlock()
	return m.Member.SetHealth(ctx, h, reason)
}

// start starts rank groupRank of replica group group on simulated GPU dev,
// training until stopped. poison fills its state with garbage first (a
// restarted process that must heal).
func (j *gpuJob) start(group string, groupRank, groupSize, dev int, poison bool) *gpuReplica {
	j.t.Helper()
	r := j.prepare(group, groupRank, groupSize, dev, poison)
	r.run()
	return r
}

// gpuRank names one rank of the job: its replica group, group rank and GPU.
type gpuRank struct {
	group     string
	groupRank int
	groupSize int
	dev       int
}

// startAll registers every rank, waits for the quorum that holds them
// all, and only then starts their training: no rank trains in an epoch
// that another is about to leave (see TestNCCLGrowWhilePeerMidStep).
func (j *gpuJob) startAll(ranks ...gpuRank) []*gpuReplica {
	j.t.Helper()
	var rs []*gpuReplica
	for _, k := range ranks {
		rs = append(rs, j.prepare(k.group, k.groupRank, k.groupSize, k.dev, false))
	}
	last := rs[len(rs)-1]
	deadline := time.After(30 * time.Second)
	for {
		ch := last.m.Changed()
		if q, ok := last.m.Quorum(); ok && len(q.Participants) == len(rs) {
			break
		}
		select {
		case <-ch:
		case <-deadline:
			j.t.Fatalf("no quorum of all %d ranks within 30 s", len(rs))
		}
	}
	for _, r := range rs {
		r.run()
	}
	return rs
}

// prepare registers a rank with the coordinator and its state with a new
// Comm; run starts its training.
func (j *gpuJob) prepare(group string, groupRank, groupSize, dev int, poison bool) *gpuReplica {
	j.t.Helper()
	id := memberID(group, groupRank)
	r := &gpuReplica{t: j.t, j: j, id: id, groupRank: groupRank, groupSize: groupSize, dev: dev,
		lib: simLibrary(j.t, j.sim), done: make(chan struct{}), changed: make(chan struct{})}
	cfg := j.cfg
	cfg.Group, cfg.GroupRank, cfg.GroupSize, cfg.Device = group, groupRank, groupSize, dev
	cfg.Logger = zaptest.NewLogger(j.log).Named(id)
	cfg.BackendConfig = &nccl.Config{Library: r.lib, NVML: j.sim.NVML(),
		Health: health.Config{PollInterval: 20 * time.Millisecond, EventWait: 20 * time.Millisecond}}
	cfg.OnEvent = func(e Event) {
		r.mu.Lock()
		r.events = append(r.events, e)
		r.notifyLocked()
		r.mu.Unlock()
	}
	r.m = &healthMember{Member: joinAs(j.coord, id, cfg.MinReplicas*groupSize), changed: make(chan struct{})}
	cfg.Membership = r.m
	ctx := context.Background()
	var err error
	alloc := func(n int) *nccl.DeviceBuffer {
		b, aerr := r.lib.Alloc(dev, n)
		err = errors.Join(err, aerr)
		return b
	}
	r.params, r.grads, r.one = alloc(4*j.nParams), alloc(4*j.nParams), alloc(4)
	if err != nil {
		j.t.Fatal(err)
	}
	init := float32(1)
	if poison {
		init = float32(math.NaN())
	}
	if err := r.params.CopyFromHost(ctx, f32bytes(slices.Repeat([]float32{init}, j.nParams))); err != nil {
		j.t.Fatal(err)
	}
	if r.c, err = New(ctx, cfg); err != nil {
		j.t.Fatal(err)
	}
	j.mu.Lock()
	j.all = append(j.all, r)
	j.mu.Unlock()
	if err := r.c.Register("params", r.params.Tensor(comm.Float32)); err != nil {
		j.t.Fatal(err)
	}
	return r
}

func (r *gpuReplica) run() {
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go r.train(ctx)
}

// Where a hook runs in a training step.
const (
	afterStep    = iota // Step returned, before the collectives
	beforeCommit        // the collectives are done
	afterCommit         // Commit returned true, the optimizer step done
	nHooks
)

func (r *gpuReplica) setHook(at int, h func(r *gpuReplica, step int64)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.hooks[at] = h
}

func (r *gpuReplica) hook(at int, step int64) {
	r.mu.Lock()
	h := r.hooks[at]
	r.mu.Unlock()
	if h != nil {
		h(r, step)
	}
}

// holdAll holds replicas that train in lockstep (peers in an FT comm or
// a replica group) before the Commit of one step (after its collectives),
// the same step for all; it returns when all wait there, with the
// function that releases them. The step is chosen only once every hook is
// in place, two past the furthest one's committed step, so that none has
// passed it already.
func holdAll(t *testing.T, rs ...*gpuReplica) (release func()) {
	t.Helper()
	var at atomic.Int64
	at.Store(math.MaxInt64)
	rel := make(chan struct{})
	var helds []<-chan struct{}
	for _, r := range rs {
		h := make(chan struct{})
		helds = append(helds, h)
		var once sync.Once
		r.setHook(beforeCommit, func(r *gpuReplica, step int64) {
			if step < at.Load() {
				return
			}
			once.Do(func() {
				close(h)
				<-rel
			})
		})
	}
	var next int64
	for _, r := range rs {
		next = max(next, r.c.CommittedStep()+2)
	}
	at.Store(next)
	waitHeld(t, helds...)
	return func() { close(rel) }
}

// waitHeld waits for replicas held by hold to reach their Commit.
func waitHeld(t *testing.T, helds ...<-chan struct{}) {
	t.Helper()
	for _, h := range helds {
		select {
		case <-h:
		case <-time.After(60 * time.Second):
			t.Fatal("a held replica did not reach its Commit within 60 s")
		}
	}
}

// waitQuorumAfter waits until r's Comm has seen a quorum newer than epoch
// with n participants.
func (r *gpuReplica) waitQuorumAfter(epoch uint64, n int) {
	r.t.Helper()
	if err := r.awaitQuorumAfter(epoch, n); err != nil {
		r.t.Fatal(err)
	}
}

// awaitQuorumAfter is waitQuorumAfter for goroutines other than the test's.
func (r *gpuReplica) awaitQuorumAfter(epoch uint64, n int) error {
	deadline := time.After(60 * time.Second)
	for {
		m := r.c.member()
		ch := m.Changed()
		if q, ok := m.Quorum(); ok && q.Epoch > epoch && len(q.Participants) == n {
			return nil
		}
		select {
		case <-ch:
		case <-deadline:
			return fmt.Errorf("%s: no quorum of %d after epoch %d within 60 s", r.id, n, epoch)
		}
	}
}

func (r *gpuReplica) notifyLocked() {
	close(r.changed)
	r.changed = make(chan struct{})
}

func (r *gpuReplica) setErr(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err == nil {
		r.err = err
	}
	r.notifyLocked()
}

// deviceParams copies the registered state back from the device.
func (r *gpuReplica) deviceParams(ctx context.Context) ([]float32, error) {
	b := make([]byte, r.params.Len())
	if err := r.params.CopyToHost(ctx, b); err != nil {
		return nil, err
	}
	return f32s(b), nil
}

func (r *gpuReplica) train(ctx context.Context) {
	defer close(r.done)
	l := r.j.ledger(r.groupRank)
	grads := make([]float32, r.j.nParams)
	for ctx.Err() == nil {
		before := r.c.CommittedStep()
		if err := r.c.Step(ctx); err != nil {
			r.setErr(err)
			return
		}
		step := r.c.CommittedStep()
		r.mu.Lock()
		r.started = step + 1
		r.notifyLocked()
		r.mu.Unlock()
		if step != before { // healed: the device state must be the job's at that step
			if err := r.checkHealed(ctx, l, step); err != nil {
				r.setErr(err)
				return
			}
		}
		r.hook(afterStep, step+1)
		for i := range grads { // the average does not depend on who took part
			grads[i] = float32((int(step)*7+i+r.groupRank*5)%13) / 8
		}
		if err := r.grads.CopyFromHost(ctx, f32bytes(grads)); err != nil {
			r.setErr(err)
			return
		}
		if g := r.c.Group(); g != nil { // the shard dimension, on the group's NCCL comm
			if err := r.one.CopyFromHost(ctx, f32bytes([]float32{1})); err != nil {
				r.setErr(err)
				return
			}
			if err := g.AllReduce(ctx, r.one.Tensor(comm.Float32), comm.Sum); err == nil {
				if v, _ := r.sim().ReadDevice(r.one.Tensor(comm.Float32)); f32s(v)[0] != float32(r.groupSize) {
					r.setErr(fmt.Errorf("%s: group all-reduce of ones gave %v", r.id, f32s(v)))
					return
				}
			}
		}
		// Its error is recorded for Commit; waiting here lets the hooks
		// run after the collective.
		r.c.AllReduce(ctx, r.grads.Tensor(comm.Float32), comm.Avg).Wait(ctx)
		r.hook(beforeCommit, step+1)
		ok, err := r.c.Commit(ctx)
		if err != nil {
			r.setErr(err)
			return
		}
		r.mu.Lock()
		r.results = append(r.results, stepResult{step + 1, ok})
		r.mu.Unlock()
		if !ok {
			continue
		}
		// The optimizer step, with the all-reduced gradients read back
		// from the device; then the state as the device holds it.
		params, err := r.deviceParams(ctx)
		if err != nil {
			r.setErr(err)
			return
		}
		gb := make([]byte, r.grads.Len())
		if err := r.grads.CopyToHost(ctx, gb); err != nil {
			r.setErr(err)
			return
		}
		for i, g := range f32s(gb) {
			params[i] -= 0.01 * g
		}
		if err := r.params.CopyFromHost(ctx, f32bytes(params)); err != nil {
			r.setErr(err)
			return
		}
		if params, err = r.deviceParams(ctx); err != nil {
			r.setErr(err)
			return
		}
		l.commit(r.id, r.c.CommittedStep(), params)
		r.mu.Lock()
		r.commits = append(r.commits, commitRecord{r.c.CommittedStep(), r.c.Participants(), r.c.Epoch()})
		r.notifyLocked()
		r.mu.Unlock()
		r.hook(afterCommit, step+1)
	}
}

func (r *gpuReplica) sim() *ncclsim.Simulation { return r.j.sim }

// checkHealed compares the device state a heal left with what the
// replicas that committed that step recorded.
func (r *gpuReplica) checkHealed(ctx context.Context, l *ledger, step int64) error {
	params, err := r.deviceParams(ctx)
	if err != nil {
		return err
	}
	got := stateHash(params)
	l.mu.Lock()
	want, ok := l.hashes[step]
	l.mu.Unlock()
	switch {
	case !ok:
		return fmt.Errorf("%s healed to step %d, which no replica of group rank %d committed", r.id, step, r.groupRank)
	case got != want:
		return fmt.Errorf("%s healed to step %d with device state %x, the job's is %x", r.id, step, got, want)
	}
	r.mu.Lock()
	r.heals = append(r.heals, step)
	r.mu.Unlock()
	return nil
}

// waitFor blocks until cond holds, re-checking after every commit and
// event, for up to 60 s.
func (r *gpuReplica) waitFor(what string, cond func() bool) {
	r.t.Helper()
	r.waitWithin(60*time.Second, what, cond)
}

func (r *gpuReplica) waitWithin(d time.Duration, what string, cond func() bool) {
	r.t.Helper()
	if err := r.await(d, what, cond); err != nil {
		r.t.Fatal(err)
	}
}

// await is waitWithin for goroutines other than the test's.
func (r *gpuReplica) await(d time.Duration, what string, cond func() bool) error {
	deadline := time.After(d)
	for {
		r.mu.Lock()
		ch, err := r.changed, r.err
		r.mu.Unlock()
		if cond() {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s failed before %s: %v", r.id, what, err)
		}
		select {
		case <-ch:
		case <-r.done:
			r.mu.Lock()
			err := r.err
			r.mu.Unlock()
			return fmt.Errorf("%s stopped before %s: %v", r.id, what, err)
		case <-deadline:
			return fmt.Errorf("%s: %s did not happen within %v (committed %d)", r.id, what, d, r.c.CommittedStep())
		}
	}
}

// startedPast reports whether r's Step returned for a step after k.
func (r *gpuReplica) startedPast(k int64) func() bool {
	return func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.started > k
	}
}

// commitsWith counts the commits with n participants after step from.
func (r *gpuReplica) commitsWith(n int, from int64) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	k := 0
	for _, c := range r.commits {
		if c.step > from && c.participants == n {
			k++
		}
	}
	return k
}

func (r *gpuReplica) waitCommits(n, participants int, from int64) {
	r.t.Helper()
	r.waitFor(fmt.Sprintf("%d commits with %d participants after step %d", n, participants, from),
		func() bool { return r.commitsWith(participants, from) >= n })
}

func (r *gpuReplica) eventsOf(k EventKind) []Event {
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

func (r *gpuReplica) healed() []int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.heals)
}

// comms returns the replica's current FT comms (zero while sitting out).
func (r *gpuReplica) comms() comms { return r.c.current().ft }

// kill is the process's death: its GPU stops (the simulation kills its
// rank: its streams never advance again), its sockets close (its gloo
// control comms abort), and the coordinator learns of it as from gossip.
func (j *gpuJob) kill(r *gpuReplica) {
	// All at once, as a SIGKILL: first nothing more of it reaches the
	// coordinator (a dead process reports no commit failure of its own,
	// which would cost the survivors an extra epoch), then its GPU work
	// and sockets die, then its session ends.
	j.coord.Sever(r.id)
	j.sim.Kill(r.dev)
	cur := r.c.current()
	ctls := []*comm.Comm{cur.ft.ctl, cur.group.ctl}
	for _, c := range ctls {
		if c != nil {
			c.Abort(errors.New("process killed"))
		}
	}
	r.cancel()
	j.coord.Remove(r.id, quorum.PortClosed)
	<-r.done
	r.c.d.server.Close() // its state endpoint dies with it
}

// restart starts a new process in place of the killed r, on its GPU, with
// poisoned state: it must heal.
func (j *gpuJob) restart(r *gpuReplica) *gpuReplica {
	j.t.Helper()
	j.sim.Restart(r.dev)
	r.shutdown() // what the dead process left behind in this test process
	g, _, _ := parseMemberID(r.id)
	return j.start(g, r.groupRank, r.groupSize, r.dev, true)
}

// stop stops replicas' training, fails the test on any error but the
// cancellation, checks the ledgers and closes them.
func (j *gpuJob) stop(rs ...*gpuReplica) {
	j.t.Helper()
	for _, r := range rs {
		r.cancel()
	}
	for _, r := range rs {
		select {
		case <-r.done:
		case <-time.After(60 * time.Second):
			j.t.Fatalf("%s did not stop", r.id)
		}
		if r.err != nil && !errors.Is(r.err, context.Canceled) {
			j.t.Errorf("%s: %v", r.id, r.err)
		}
	}
	j.mu.Lock()
	for gr, l := range j.ledgers {
		for _, err := range l.errs {
			j.t.Errorf("group rank %d: %v", gr, err)
		}
	}
	j.mu.Unlock()
	for _, r := range rs {
		var last int64
		for _, c := range r.commits {
			if c.step <= last {
				j.t.Errorf("%s: committed step %d after %d", r.id, c.step, last)
			}
			last = c.step
		}
	}
	for _, r := range rs {
		if err := r.shutdown(); err != nil {
			j.t.Error(err)
		}
	}
}

// shutdown closes the replica's Comm and frees its device memory, as a
// training process does at its end. Once. Close promises that no GPU op
// of the Comm uses the memory any more (every NCCL comm it ever formed
// has released, so nothing of it logs after the test either); the
// simulation reports a free that breaks that promise as a fault.
func (r *gpuReplica) shutdown() error {
	var err error
	r.closeOnce.Do(func() {
		if r.cancel != nil {
			r.cancel()
		}
		if cerr := r.c.Close(); cerr != nil {
			err = fmt.Errorf("close %s: %w", r.id, cerr)
		}
		for _, b := range []*nccl.DeviceBuffer{r.params, r.grads, r.one} {
			b.Free()
		}
	})
	return err
}

// health is what the coordinator records of member id's health.
func recordedHealth(c *memcoord.Coordinator, id string) (membership.Health, string) {
	rec, _ := c.Record(id)
	return rec.Health, rec.HealthReason
}

func f32bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func f32s(b []byte) []float32 {
	v := make([]float32, len(b)/4)
	for i := range v {
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return v
}

// Steady training on device tensors: every replica commits every step with
// the same device state; the data comm is NCCL, the control comm gloo; the
// comms' op metrics reach the registerer with the job's label.
func TestNCCLSteadyTraining(t *testing.T) {
	j := newGPUJob(t, 3, 1)
	rs := j.startAll(gpuRank{"a", 0, 1, 0}, gpuRank{"b", 0, 1, 1}, gpuRank{"c", 0, 1, 2})
	for _, r := range rs {
		r.waitCommits(5, 3, 0)
	}
	x := rs[0].comms()
	if n := x.data.Backend().Name(); n != "nccl" || x.data.Backend().Memory() != comm.DeviceMemory {
		t.Errorf("data comm on %s (%v)", n, x.data.Backend().Memory())
	}
	if n := x.ctl.Backend().Name(); n != "gloo" || x.ctl == x.data {
		t.Errorf("control comm on %s", n)
	}
	if evs := rs[0].eventsOf(EventReconfigured); len(evs) == 0 || evs[0].How != "fresh" {
		t.Errorf("first reconfiguration: %v", evs)
	}
	// Op metrics: the NCCL all-reduces of the data comm and the gloo
	// all-gather of the step agreement, labelled with the job (gathered
	// before Close, which unregisters them).
	mfs, err := j.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "ftcomm_comm_ops_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			l := map[string]string{}
			for _, lp := range m.GetLabel() {
				l[lp.GetName()] = lp.GetValue()
			}
			if l["ftcomm_job"] == "toy" && l["result"] == "ok" {
				seen[l["comm"]+"/"+l["op"]] += m.GetCounter().GetValue()
			}
		}
	}
	if seen["ft-0/allreduce"] < 15 || seen["ft-0-ctl/allgather"] < 3 {
		t.Errorf("ftcomm_comm_ops_total{ftcomm_job=\"toy\",result=\"ok\"} by comm/op: %v", seen)
	}
	j.stop(rs...)
}

// A host tensor given to a collective of a device data backend fails with
// comm.ErrInvalidArgument; the step does not commit, and the job goes on.
func TestNCCLHostTensorRefused(t *testing.T) {
	j := newGPUJob(t, 2, 1)
	rs := j.startAll(gpuRank{"a", 0, 1, 0}, gpuRank{"b", 0, 1, 1})
	a, b := rs[0], rs[1]
	const bad = 4
	var opErr error
	a.setHook(beforeCommit, func(r *gpuReplica, step int64) {
		if step == bad {
			opErr = r.c.AllReduce(context.Background(), comm.Float32s(make([]float32, 8)), comm.Sum).Wait(context.Background())
		}
	})
	a.waitFor("a commits past the bad step", func() bool { return a.c.CommittedStep() >= bad+2 })
	b.waitCommits(1, 2, bad)
	j.stop(a, b)
	if !errors.Is(opErr, comm.ErrInvalidArgument) {
		t.Errorf("all-reduce of a host tensor on nccl: %v, want comm.ErrInvalidArgument", opErr)
	}
	if i := slices.Index(a.results, stepResult{bad, false}); i < 0 || slices.Contains(a.results[:i], stepResult{bad, true}) {
		t.Errorf("a's commits: %v; the step with the host tensor committed", a.results)
	}
	if len(a.eventsOf(EventCommitFailed)) == 0 {
		t.Error("no commit-failed event")
	}
}

// A replica's process dies: its rank in the NCCL comm never arrives, the
// survivors shrink their comms (NCCL shrink, gloo shrink) and keep
// committing; a new process on its GPU joins, the others grow their comms,
// and it heals its device state from its peers through the backend's
// HostCopier. Once with NCCL 2.28.3 (Grow falls back to a new comm), once
// with 2.29.2 (native ncclCommGrow and ncclCommRevoke).
func TestNCCLKillShrinkGrowHeal(t *testing.T) {
	for _, tc := range []struct {
		name string
		ver  int
		syms []string
	}{
		{"nccl-2.28.3", 0, nil},
		{"nccl-2.29.2", 22902, []string{"ncclGetLastError", "ncclCommSplit", "ncclCommShrink", "ncclCommRevoke",
			"ncclCommGrow", "ncclCommGetUniqueId", "ncclAlltoAll", "ncclGather", "ncclScatter"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			j := newGPUJob(t, 3, 1)
			if tc.ver != 0 {
				j.sim.WithVersion(tc.ver, tc.syms...)
			}
			rs := j.startAll(gpuRank{"a", 0, 1, 0}, gpuRank{"b", 0, 1, 1}, gpuRank{"c", 0, 1, 2})
			a, b, c := rs[0], rs[1], rs[2]
			a.waitCommits(2, 3, 0)
			killedAt := a.c.CommittedStep()
			j.kill(c)
			for _, r := range []*gpuReplica{a, b} {
				r.waitCommits(3, 2, killedAt)
				if !slices.ContainsFunc(r.eventsOf(EventReconfigured), func(e Event) bool { return e.How == "shrink" && e.Participants == 2 }) {
					t.Errorf("%s did not shrink to 2: %v", r.id, r.eventsOf(EventReconfigured))
				}
			}
			if n := j.sim.Calls("ncclCommShrink(abort)") + j.sim.Calls("ncclCommShrink"); n < 2 {
				t.Errorf("ncclCommShrink called %d times, want one per survivor at least", n)
			}
			// Hold a and b before a Commit while c returns, so both start
			// their next step in the new epoch (TestNCCLGrowWhilePeerMidStep
			// is what happens otherwise).
			release := holdAll(t, a, b)
			e := a.c.Epoch()
			c = j.restart(c)
			a.waitQuorumAfter(e, 3)
			b.waitQuorumAfter(e, 3)
			grownFrom := a.c.CommittedStep()
			release()
			c.waitCommits(2, 3, 0)
			for _, r := range []*gpuReplica{a, b} {
				r.waitCommits(1, 3, grownFrom)
				// A prepared grow: the survivors formed epoch 3's comms in
				// the background (held here, they had stepped on).
				if !slices.ContainsFunc(r.eventsOf(EventReconfigured), func(e Event) bool { return e.How == "prepared" && e.Participants == 3 }) {
					t.Errorf("%s did not grow to 3: %v", r.id, r.eventsOf(EventReconfigured))
				}
			}
			// The restarted process started with NaNs and healed: its
			// device state, copied back, is the job's at the healed step.
			if h := c.healed(); len(h) == 0 || h[0] < grownFrom {
				t.Errorf("the restarted replica healed to %v (the job was at step %d)", h, grownFrom)
			}
			if evs := c.eventsOf(EventHealed); len(evs) == 0 || evs[0].Bytes != int64(4*j.nParams) {
				t.Errorf("healed events %v, want %d bytes", evs, 4*j.nParams)
			}
			j.stop(a, b, c)
		})
	}
}

// HSDP: groups of two ranks; the group comm (shard dimension) is an NCCL
// comm too, and Group() returns it. A rank dies: its group sits out whole
// and the other commits alone; a new process takes the dead rank's GPU,
// the group rejoins whole and both its ranks heal, shard by shard, from
// the ranks of the same shard in the other group.
func TestNCCLReplicaGroups(t *testing.T) {
	j := newGPUJob(t, 4, 1)
	rs := j.startAll(gpuRank{"a", 0, 2, 0}, gpuRank{"a", 1, 2, 1}, gpuRank{"b", 0, 2, 2}, gpuRank{"b", 1, 2, 3})
	a0, a1, b0, b1 := rs[0], rs[1], rs[2], rs[3]
	a0.waitCommits(2, 2, 0)
	if g := a0.c.Group(); g == nil || g.Backend().Name() != "nccl" || g.Size() != 2 {
		t.Fatalf("Group(): %v", g)
	}
	killedAt := a0.c.CommittedStep()
	j.kill(b1)
	a0.waitCommits(3, 1, killedAt)
	a1.waitCommits(3, 1, killedAt)
	b0.waitFor("b0 to sit out", func() bool { return len(b0.eventsOf(EventSatOut)) > 0 })
	if p := b0.c.Participants(); p != 0 {
		t.Errorf("b0 takes part (%d participants) without its group", p)
	}
	b0at := b0.c.CommittedStep()
	// Hold a's ranks before a Commit while b returns, so both start their
	// next step in the new epoch (see TestNCCLGrowWhilePeerMidStep).
	release := holdAll(t, a0, a1)
	e := a0.c.Epoch()
	b1 = j.restart(b1)
	a0.waitQuorumAfter(e, 4)
	a1.waitQuorumAfter(e, 4)
	release()
	b0.waitCommits(2, 2, b0at)
	b1.waitCommits(2, 2, 0)
	a0.waitCommits(1, 2, b0at)
	// Both ranks of b healed their own shard: b0 from a0, b1 from a1.
	if len(b0.healed()) == 0 || len(b1.healed()) == 0 {
		t.Errorf("heals: b0 %v, b1 %v; both ranks of the returning group must heal", b0.healed(), b1.healed())
	}
	j.stop(a0, a1, b0, b1)
}

// The control comm fails (one replica's gloo control comm is aborted
// between the step's collectives and Commit, as when its host link drops):
// that replica's step must not commit, and the job recovers. The data
// comm (NCCL) is untouched, so only the control comm's failure can fail
// the step.
func TestNCCLControlCommFailure(t *testing.T) {
	j := newGPUJob(t, 3, 1)
	rs := j.startAll(gpuRank{"a", 0, 1, 0}, gpuRank{"b", 0, 1, 1}, gpuRank{"c", 0, 1, 2})
	a, b, c := rs[0], rs[1], rs[2]
	a.waitCommits(2, 3, 0)
	var at int64
	var once sync.Once
	b.setHook(beforeCommit, func(r *gpuReplica, step int64) {
		once.Do(func() {
			r.mu.Lock()
			at = step
			r.mu.Unlock()
			r.comms().ctl.Abort(errors.New("injected control link failure"))
		})
	})
	b.waitFor("the control comm's abort", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return len(b.results) > 0 && at != 0 && b.results[len(b.results)-1].step >= at
	})
	from := a.c.CommittedStep()
	for _, r := range []*gpuReplica{a, b, c} {
		r.waitCommits(2, 3, from)
	}
	j.stop(a, b, c)
	if i := slices.IndexFunc(b.results, func(s stepResult) bool { return s.step == at }); i < 0 || b.results[i].ok {
		t.Errorf("b's commits %v: step %d, whose control comm failed, committed", b.results, at)
	}
}

// HSDP: the control comm of a replica group (gloo, beside the group's
// NCCL comm) fails at one rank just before Commit: the group's vote runs
// on it, so neither rank of the group commits the step, and the job
// recovers in a new epoch.
func TestNCCLGroupControlCommFailure(t *testing.T) {
	j := newGPUJob(t, 4, 1)
	rs := j.startAll(gpuRank{"a", 0, 2, 0}, gpuRank{"a", 1, 2, 1}, gpuRank{"b", 0, 2, 2}, gpuRank{"b", 1, 2, 3})
	a0, a1 := rs[0], rs[1]
	a0.waitCommits(2, 2, 0)
	bad := make(chan int64, 1)
	var once sync.Once
	a1.setHook(beforeCommit, func(r *gpuReplica, step int64) {
		once.Do(func() {
			ctl := r.c.current().group.ctl
			ctl.Abort(errors.New("injected control link failure"))
			bad <- step
		})
	})
	var at int64
	select {
	case at = <-bad:
	case <-time.After(60 * time.Second):
		t.Fatal("a1 never reached its Commit")
	}
	for _, r := range rs {
		r.waitCommits(2, 2, at)
	}
	j.stop(rs...)
	for _, r := range []*gpuReplica{a0, a1} {
		if i := slices.IndexFunc(r.results, func(s stepResult) bool { return s.step == at }); i < 0 || r.results[i].ok {
			t.Errorf("%s's commits %v: step %d, whose group vote failed, committed", r.id, r.results, at)
		}
	}
}

// A critical GPU fault reported by the backend's health watch (NVML, here
// the simulation's) takes the replica out: ft reports it Critical with the
// reason, which reaches the coordinator; the others go on without it.
func TestNCCLCriticalHealthEvent(t *testing.T) {
	j := newGPUJob(t, 3, 1)
	rs := j.startAll(gpuRank{"a", 0, 1, 0}, gpuRank{"b", 0, 1, 1}, gpuRank{"c", 0, 1, 2})
	a, b, c := rs[0], rs[1], rs[2]
	a.waitCommits(2, 3, 0)
	j.sim.InjectXid(c.dev, 79)
	c.waitFor("c to sit out", func() bool { return len(c.eventsOf(EventSatOut)) > 0 })
	if h, why := recordedHealth(j.coord, c.id); h != membership.Critical || !strings.Contains(why, "Xid 79") {
		t.Errorf("the coordinator has c as %v (%q), want critical with the Xid", h, why)
	}
	from := a.c.CommittedStep()
	a.waitCommits(3, 2, from)
	b.waitCommits(3, 2, from)
	if p := c.c.Participants(); p != 0 {
		t.Errorf("c takes part with a fallen GPU (%d participants)", p)
	}
	j.stop(a, b, c)
}

// After a critical fault, a later harmless Xid (13: an application's
// graphics exception) on the same GPU must not report the replica healthy
// again: the GPU that fell off the bus is no better for it.
func TestNCCLHarmlessXidAfterCritical(t *testing.T) {
	j := newGPUJob(t, 2, 1)
	rs := j.startAll(gpuRank{"a", 0, 1, 0}, gpuRank{"b", 0, 1, 1})
	a, b := rs[0], rs[1]
	a.waitCommits(2, 2, 0)
	j.sim.InjectXid(b.dev, 79)
	b.waitFor("b to sit out", func() bool { return len(b.eventsOf(EventSatOut)) > 0 })
	n := b.m.count()
	j.sim.InjectXid(b.dev, 13)
	// The watch delivers events in order: once the report of a later
	// critical Xid arrives, the harmless one has been handled.
	j.sim.InjectXid(b.dev, 48)
	if rep := b.m.waitReport(t, n); rep.h != membership.Critical || !strings.Contains(rep.reason, "Xid 48") {
		t.Errorf("after Xid 79 then Xid 13, ft reported %v (%q): the replica would rejoin on a fallen GPU", rep.h, rep.reason)
	}
	if h, _ := recordedHealth(j.coord, b.id); h != membership.Critical {
		t.Errorf("the coordinator has b as %v", h)
	}
	if p := b.c.Participants(); p != 0 {
		t.Errorf("b takes part (%d participants)", p)
	}
	j.stop(a, b)
}

// A replica that sits out closes the comms it leaves, with its part of
// the step's all-reduce still waiting on the GPU for a peer that never
// posts its own; their ncclCommAbort runs in the background (0.5 s on
// 2×H200, stalled here). Close must wait for it: once Close returns the
// process frees the device memory that all-reduce uses. (Close used to
// wait only for nothing, and the test harness for the current comms: a
// comm left at a sit-out under load still held its op, 1 run in 500.)
func TestNCCLCloseWaitsForCommsLeftAtSitOut(t *testing.T) {
	j := newGPUJob(t, 2, 1)
	rs := j.startAll(gpuRank{"a", 0, 1, 0}, gpuRank{"b", 0, 1, 1})
	a, b := rs[0], rs[1]
	a.waitCommits(2, 2, 0)
	// a stops before the collectives of a step, so b's all-reduce of
	// that step waits on b's GPU.
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	at := max(a.c.CommittedStep(), b.c.CommittedStep()) + 2
	a.setHook(afterStep, func(_ *gpuReplica, step int64) {
		if step >= at {
			once.Do(func() {
				close(held)
				<-release
			})
		}
	})
	released := false
	releaseA := func() {
		if !released {
			released = true
			close(release)
		}
	}
	defer releaseA()
	waitHeld(t, held)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := j.sim.AwaitQueued(ctx, b.dev); err != nil {
		t.Fatal(err)
	}
	j.sim.StallAborts(b.dev, true)
	defer j.sim.StallAborts(b.dev, false)
	j.sim.InjectXid(b.dev, 79)
	b.waitFor("b to sit out", func() bool { return len(b.eventsOf(EventSatOut)) > 0 })

	closed := make(chan error, 1)
	go func() { closed <- b.shutdown() }() // Close, then free the device memory
	select {
	case err := <-closed:
		t.Errorf("b's Close returned (%v) while the comm it left at the sit-out was still being aborted, its all-reduce queued on the GPU", err)
	case <-time.After(500 * time.Millisecond): // Close waits, as it should
		j.sim.StallAborts(b.dev, false)
		if err := <-closed; err != nil {
			t.Error(err)
		}
	}
	releaseA()
	j.stop(a)
}

func (m *healthMember) count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.reports)
}

// waitReport waits for report number n (from 0) and returns it.
func (m *healthMember) waitReport(t *testing.T, n int) healthReport {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		m.mu.Lock()
		if len(m.reports) > n {
			r := m.reports[n]
			m.mu.Unlock()
			return r
		}
		ch := m.changed
		m.mu.Unlock()
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("no health report number %d within 30 s", n+1)
		}
	}
}

// A replica joins while one peer has started its step in the old epoch
// (its Step saw no new quorum yet) and the other starts its next step in
// the new one: the first all-reduces on the old NCCL comm, the second
// grows it. Nothing tells the first that its op can never complete — no
// member left, so no quorum revokes the comm, and NCCL, unlike gloo, sees
// no mismatch between an all-reduce and a grow — so it waits out the op's
// Timeout, and the grow with it. The job should reach the new epoch well
// within the Timeout (here 2 minutes).
func TestNCCLGrowWhilePeerMidStep(t *testing.T) {
	j := newGPUJob(t, 3, 1)
	j.cfg.Timeout = 2 * time.Minute
	rs := j.startAll(gpuRank{"a", 0, 1, 0}, gpuRank{"b", 0, 1, 1})
	a, b := rs[0], rs[1]
	a.waitCommits(2, 2, 0)
	e0 := a.c.Epoch()
	needJoin, joined := make(chan struct{}), make(chan struct{})
	var once sync.Once
	b.setHook(beforeCommit, func(r *gpuReplica, step int64) {
		once.Do(func() {
			// a has finished step `step` (our all-reduce matched its) and
			// started the next in the old epoch: it now waits in that
			// step's all-reduce for b.
			if err := a.await(60*time.Second, "a's next step", a.startedPast(step)); err != nil {
				r.setErr(err)
				return
			}
			close(needJoin)
			<-joined
			if err := r.awaitQuorumAfter(e0, 3); err != nil {
				r.setErr(err)
			}
			// b commits and starts its next step in the new epoch.
		})
	})
	select {
	case <-needJoin:
	case <-time.After(60 * time.Second):
		t.Fatal("a and b never reached the arranged steps")
	}
	c := j.start("c", 0, 1, 2, false)
	close(joined)
	for _, r := range []*gpuReplica{a, b, c} {
		r.waitWithin(20*time.Second, "a commit with 3 participants (a's all-reduce in the old epoch and b's grow wait out the 2-minute Timeout)",
			func() bool { return r.commitsWith(3, 0) > 0 })
	}
	j.stop(a, b, c)
}

// HSDP: a rank of another replica group dies while the two ranks of group
// a are at different points: a1 has committed and not yet called Step for
// its next step, a0 has called it (no new epoch yet). a0 must not start
// the step alone: its group comm would wait for a1, which starts the step
// in the new epoch, until the op's Timeout (here 2 minutes; NCCL sees no
// peer leave), and the comms the group shares outside ft (FSDP's) would
// run different collectives at its two ranks. a0 waits at the group's gate
// instead, and when a1 steps, both go on in the new epoch at once.
func TestNCCLGroupCommStopsWithItsEpoch(t *testing.T) {
	j := newGPUJob(t, 4, 1)
	j.cfg.Timeout = 2 * time.Minute
	rs := j.startAll(gpuRank{"a", 0, 2, 0}, gpuRank{"a", 1, 2, 1}, gpuRank{"b", 0, 2, 2}, gpuRank{"b", 1, 2, 3})
	a0, a1, b0, b1 := rs[0], rs[1], rs[2], rs[3]
	a0.waitCommits(2, 2, 0)
	e0 := a0.c.Epoch()
	held, release := make(chan int64, 1), make(chan struct{})
	var once sync.Once
	a1.setHook(afterCommit, func(r *gpuReplica, step int64) {
		once.Do(func() {
			held <- step
			<-release
		})
	})
	var k int64
	select {
	case k = <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("a1 did not commit")
	}
	// a0 committed step k with a1 (their group vote) and calls Step for
	// k+1 in the old epoch: it waits at the gate for a1.
	a0.waitFor("a0 waiting at its group's gate", a0.atGate)
	j.kill(b1)
	a1.waitQuorumAfter(e0, 3)
	if a0.startedPast(k)() {
		t.Fatalf("a0 started step %d in epoch %d while a1 had not stepped", k+1, e0)
	}
	close(release)
	for _, r := range []*gpuReplica{a0, a1} {
		r.waitWithin(20*time.Second, "a commit of group a alone (a0's step in the old epoch waits out the 2-minute Timeout)",
			func() bool { return r.commitsWith(1, k) > 0 })
	}
	j.stop(a0, a1, b0)
}

// atGate reports whether r's Step waits for its group's agreement.
func (r *gpuReplica) atGate() bool {
	at := false
	r.c.onDriver(func(d *driver) { at = d.mach.task != 0 && d.mach.stage == stageAgree })
	return at
}

// endingT is the test as zaptest sees it, dropping what is logged once the
// test has ended: comms replaced or closed during a test release their
// NCCL comms in the background and log when done, possibly after the test
// (testing panics on a Log after the test completed).
type endingT struct {
	zaptest.TestingT
	mu    sync.Mutex
	ended bool
}

func (t *endingT) Logf(format string, args ...any) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.ended {
		t.TestingT.Logf(format, args...)
	}
}

func (t *endingT) end() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.ended = true
}

// HSDP: the group's vote on a step completes at one rank and fails at the
// other (simulated: a1 forgets the step it committed, as if its vote had
// failed after a0's completed), and the other group loses a rank, so no
// replica holds a1's shard at that step. The group's ranks would go on
// from different steps; Step reports it as a *GroupDivergedError at both
// ranks instead, and keeps reporting it.
func TestNCCLGroupStepsApartAreReported(t *testing.T) {
	j := newGPUJob(t, 4, 1)
	rs := j.startAll(gpuRank{"a", 0, 2, 0}, gpuRank{"a", 1, 2, 1}, gpuRank{"b", 0, 2, 2}, gpuRank{"b", 1, 2, 3})
	a0, a1, b0, b1 := rs[0], rs[1], rs[2], rs[3]
	a0.waitCommits(2, 2, 0)
	held, release := make(chan int64, 1), make(chan struct{})
	var once sync.Once
	a1.setHook(afterCommit, func(r *gpuReplica, step int64) {
		once.Do(func() {
			r.c.onDriver(func(d *driver) {
				d.mach.step--
				d.exec(setStep{step: d.mach.step})
			})
			held <- step
			<-release
		})
	})
	select {
	case <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("a1 did not commit")
	}
	j.kill(b1)
	close(release)
	for _, r := range []*gpuReplica{a0, a1} {
		r.waitFor("Step's report that the group's ranks diverged", func() bool {
			r.mu.Lock()
			defer r.mu.Unlock()
			return r.err != nil
		})
		var gd *GroupDivergedError
		if !errors.As(r.err, &gd) || gd.Max != gd.Min+1 {
			t.Errorf("%s: %v; want a *GroupDivergedError one step apart", r.id, r.err)
		}
		if err := r.c.Step(context.Background()); !errors.Is(err, ErrGroupDiverged) {
			t.Errorf("%s: the next Step returned %v; want ErrGroupDiverged again", r.id, err)
		}
		r.mu.Lock()
		r.err = nil // expected; stop checks the rest
		r.mu.Unlock()
	}
	j.stop(a0, a1, b0)
}

// A spare warms its data backend up while it waits: a one-rank NCCL comm
// made and closed (NCCL loads its kernels with a process's first comm),
// so that the grow that promotes it does not pay for that. The comm is
// released, nothing else of the job is touched, and Close waits for it.
func TestNCCLSpareWarmsUp(t *testing.T) {
	sim := ncclsim.New(1)
	coord := memcoord.New("toy", quick())
	t.Cleanup(coord.Close)
	reg := prometheus.NewRegistry()
	cfg := Config{Job: "toy", Group: "s", Backend: "nccl", ControlBackend: "gloo", Secret: []byte("k"), MinReplicas: 1,
		Timeout: 10 * time.Second, Spare: true, Registerer: reg, Logger: zaptest.NewLogger(t),
		BackendConfig: &nccl.Config{Library: simLibrary(t, sim), NVML: sim.NVML()}}
	cfg.Membership = coord.JoinSpare("s.0", "s", 1)
	c, err := New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	w := c.d.warm
	<-w.done
	if w.took <= 0 || w.comm == nil {
		t.Fatalf("the spare's warm-up did not make its comm (took %v)", w.took)
	}
	if n := sim.Calls("ncclCommInitRankConfig"); n != 1 {
		t.Errorf("%d NCCL comms made while the spare waited, want the warm-up's one", n)
	}
	if v := gaugeValue(t, reg, "ftcomm_ft_spare_warm_up_seconds", nil); v != w.took.Seconds() {
		t.Errorf("ftcomm_ft_spare_warm_up_seconds = %v after a warm-up of %v", v, w.took)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if n := sim.LiveComms(); n != 0 {
		t.Errorf("%d NCCL comms live after Close", n)
	}
	for _, f := range sim.Faults() {
		t.Errorf("simulated NCCL: %s", f)
	}
}
