package ft

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/recovery"
)

// driver is the one goroutine of a Comm: it feeds the step machine what
// happens and carries out what it decides. It owns every comm (comms), the
// registration, the recovery server and the metrics; starts one task at a
// time for the machine (forming comms, gathering records, healing,
// voting), watches each comm for failure, and sends the coordinator its
// reports in order (reporter). It meets the Comm only through their link.
// Only run's goroutine touches its fields, except where noted.
type driver struct {
	link    *link
	cfg     Config
	log     *zap.Logger
	id      string
	server  *recovery.Server
	metrics *metrics
	state   []registered // what the training loop registered (stepCalled)
	mach    *machine
	m       *member // the current registration
	own     bool    // m was made from Config.Coordinator: ft may register again
	changed <-chan struct{}
	ended   <-chan struct{} // m.Done(); nil while registering again

	comms   map[commKey]comms
	cancels map[int]context.CancelCauseFunc // of the task in flight
	later   []input                         // results of tasks done at once, fed next
	stopped bool
	reports *reporter
	rereg   sync.WaitGroup // a registration in flight
	warm    *warmer        // a spare's warm-up (nil: none): stopped and awaited at shutdown
	stopReg context.CancelFunc

	histBytes []byte  // the history offered with the state, encoded
	histOf    history // the history histBytes encodes
	health    context.CancelFunc

	// Written by the formation task, once, and read after its result.
	blobs      []recovery.Blob
	copier     comm.HostCopier
	staging    *stagingPool
	split      [2]bool // per dim: data and control are separate comms
	splitKnown [2]bool
	healed     recovery.Progress // a heal cut short keeps its progress

	snaps *peerSnapshots // Config.SnapshotEvery; nil: off

	relMu     sync.Mutex
	releasing []releaser // device comms whose release Close waits for

	hook func(action) // tests: called before each action is carried out

	timer   *time.Timer // the machine's tick (armTimer)
	timerOn bool
}

// expired is a ctx that has ended: a call under it does only what needs
// no waiting.
var expired = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

type commKey struct {
	dim   dim
	epoch uint64
}

// taskResult is a task's result, with the comms a formation handed over.
type taskResult struct {
	task   int
	in     input
	key    commKey
	formed comms
	oldKey commKey
	old    comms // given back by a failed Shrink or Grow
}

// memberSwap: a new registration replaced the one that ended.
type memberSwap struct{ m Membership }

// inspect runs f on the driver's goroutine: tests reach the driver's
// state through it.
type inspect struct {
	f    func(*driver)
	done chan struct{}
}

func (taskResult) isInput() {}
func (memberSwap) isInput() {}
func (inspect) isInput()    {}

// releaser is a backend that frees its device resources in the background
// after Close (nccl's Backend: ncclCommAbort took 0.5 s after a peer's
// death on 2×H200). Released is closed once the comm's GPU work has
// stopped and its resources are freed; ReleaseErr then says whether that
// went wrong (its GPU work may still run).
type releaser interface {
	Released() <-chan struct{}
	ReleaseErr() error
}

func newDriver(cfg Config, log *zap.Logger, id string, l *link, server *recovery.Server, met *metrics, m *member, own bool) *driver {
	mc := machineConfig{id: id, spare: cfg.Spare, group: cfg.Group, groupRank: cfg.GroupRank, groupSize: cfg.GroupSize,
		minReplicas: cfg.MinReplicas, durable: cfg.DurableCommit, snapshots: cfg.SnapshotEvery > 0, maxCommitFailures: cfg.MaxCommitFailures,
		stallFactor: cfg.StallFactor, stallMin: cfg.StallMin, linger: cfg.Timeout, initialStep: cfg.InitialStep}
	return &driver{link: l, cfg: cfg, log: log, id: id, server: server, metrics: met, mach: newMachine(mc, m.Incarnation()), m: m, own: own,
		comms: map[commKey]comms{}, cancels: map[int]context.CancelCauseFunc{}, reports: newReporter(log, cfg.Timeout)}
}

// run is the driver's loop. It ends when the machine has closed every
// comm after Close; then it releases the rest (shutdown) and closes the
// link's released.
func (d *driver) run() {
	defer func() {
		close(d.link.done)
		d.link.closeErr = d.shutdown()
		close(d.link.released)
	}()
	d.changed, d.ended = d.m.Changed(), d.m.Done()
	d.timer = time.NewTimer(time.Hour)
	d.timer.Stop()
	defer d.timer.Stop()
	d.readMembership()
	for !d.stopped {
		var tc <-chan time.Time
		if d.timerOn {
			tc = d.timer.C
		}
		select {
		case <-tc:
			d.timerOn = false
			d.feed(d.tick())
		case in := <-d.link.in:
			d.receive(in)
		case <-d.changed:
			d.changed = d.m.Changed() // before reading, so no change is missed
			d.readMembership()
		case <-d.ended:
			d.ended = nil
			d.registrationEnded()
		}
	}
}

func (d *driver) readMembership() {
	if q, ok := d.m.Quorum(); ok {
		d.feed(quorumSeen{q})
	}
	if r, ok := d.m.Revocation(d.mach.epoch); ok {
		d.feed(revocationSeen{r})
	}
}

func (d *driver) receive(in input) {
	switch in := in.(type) {
	case taskResult:
		delete(d.cancels, in.task)
		if in.old.ok() {
			d.comms[in.oldKey] = in.old
		}
		if in.formed.ok() {
			d.adopt(in.key, in.formed)
		}
		d.feed(in.in)
	case inspect:
		in.f(d)
		close(in.done)
	case stepCalled:
		d.state = in.state
		d.feed(in)
	case memberSwap:
		d.m = bindMember(in.m)
		d.link.mem.Store(d.m)
		d.changed, d.ended = d.m.Changed(), d.m.Done()
		d.feed(reregistered{inc: d.m.Incarnation()})
		d.readMembership()
	case commFailed:
		if in.dim == dimFT {
			in.silent = d.silentFT(in.epoch)
		}
		d.feed(in)
	case commitCalled:
		in.silent = d.silentFT(d.mach.epoch)
		// A comm that broke just before Commit fails the step, whether or
		// not its watcher has told the machine yet.
		for key, x := range d.comms {
			if key.epoch != d.mach.commsEpoch(key.dim) {
				continue
			}
			for _, p := range []part{partData, partCtl} {
				if c := x.part(p); c != nil && c.Err() != nil {
					if x.ctl == x.data {
						p = partBoth
					}
					d.feed(commFailed{dim: key.dim, epoch: key.epoch, part: p, err: c.Err()})
				}
			}
		}
		d.feed(in)
	default:
		d.feed(in)
	}
}

// feed gives the machine one input and carries out its actions, then the
// inputs those actions produced at once (a task that did not need to wait).
func (d *driver) feed(in input) {
	for {
		for _, a := range d.mach.handle(time.Now(), in) {
			d.exec(a)
		}
		if len(d.later) == 0 {
			break
		}
		in = d.later[0]
		d.later = d.later[1:]
	}
	d.publish()
}

func (d *driver) exec(a action) {
	if d.hook != nil {
		d.hook(a)
	}
	switch a := a.(type) {
	case formComms:
		d.form(a)
	case closeComms:
		key := commKey{a.dim, a.epoch}
		x := d.comms[key]
		delete(d.comms, key)
		x.close()
	case revokeComms:
		x := d.comms[commKey{a.dim, a.epoch}]
		cause := errors.New(a.cause)
		if a.part&partData != 0 && x.data != nil {
			x.data.Revoke(cause)
		}
		if a.part&partCtl != 0 && x.ctl != nil {
			x.ctl.Revoke(cause)
		}
	case cancelTask:
		if cancel := d.cancels[a.task]; cancel != nil {
			cancel(a.cause)
		}
	case gatherRecords:
		d.gather(a)
	case readLastCommit:
		dc := d.m.records
		d.spawn(a.task, func(ctx context.Context) taskResult {
			rec, ok, err := dc.LastCommit(ctx)
			return taskResult{in: lastCommitRead{task: a.task, rec: rec, ok: ok, err: err}}
		})
	case fetchState:
		d.fetch(a)
	case keepGroup:
		d.keepGroup(a)
	case agreeStep:
		ctl := d.comms[commKey{dimGroup, a.epoch}].ctl
		d.spawn(a.task, func(ctx context.Context) taskResult {
			// Shaped unlike the group's other messages (a mismatch fails
			// it everywhere): the newest epoch known, whether any rank
			// cannot start, and the ranks' current epochs (max and -min).
			notReady := int64(1)
			if a.ready {
				notReady = 0
			}
			v := []int64{int64(a.known), notReady, int64(a.now), -int64(a.now)}
			err := ctl.AllReduce(ctx, comm.Int64s(v), comm.Max)
			return taskResult{in: stepAgreed{task: a.task, known: uint64(v[0]), ready: v[1] == 0, same: v[2] == -v[3], err: err}}
		})
	case agreeSwitch:
		d.agreeSwitch(a)
	case checkGroup:
		ctl := d.comms[commKey{dimGroup, a.epoch}].ctl
		if d.snaps != nil {
			d.checkSnapshots(a, ctl)
			return
		}
		d.spawn(a.task, func(ctx context.Context) taskResult {
			v := []int64{a.step, -a.step}
			err := ctl.AllReduce(ctx, comm.Int64s(v), comm.Max)
			return taskResult{in: groupChecked{task: a.task, lo: -v[1], hi: v[0], err: err}}
		})
	case castVote:
		ctl := d.comms[commKey{dimGroup, a.epoch}].ctl
		if d.snaps != nil {
			// The vote also says the newest snapshot every rank holds its
			// source's copy of: that snapshot is complete.
			snaps := d.snaps
			d.spawn(a.task, func(ctx context.Context) taskResult {
				v := []int64{0, snaps.heldStep()}
				if a.yes {
					v[0] = 1
				}
				err := ctl.AllReduce(ctx, comm.Int64s(v), comm.Min)
				if err == nil && v[1] >= 0 {
					snaps.learned(v[1])
				}
				return taskResult{in: voted{task: a.task, yes: v[0] == 1, err: err}}
			})
			return
		}
		d.spawn(a.task, func(ctx context.Context) taskResult {
			v := []int32{0}
			if a.yes {
				v[0] = 1
			}
			err := ctl.AllReduce(ctx, comm.Int32s(v), comm.Min)
			return taskResult{in: voted{task: a.task, yes: v[0] == 1, err: err}}
		})
	case recordCommit:
		d.record(a)
	case shareOutcome:
		ctl := d.comms[commKey{dimGroup, a.epoch}].ctl
		d.spawn(a.task, func(ctx context.Context) taskResult {
			v := []int32{0}
			if a.ok {
				v[0] = 1
			}
			err := ctl.Broadcast(ctx, comm.Int32s(v), 0)
			return taskResult{in: outcomeShared{task: a.task, ok: v[0] == 1, err: err}}
		})
	case withdrawState:
		// Without reads in flight (every step but one that serves a
		// healer) the withdrawal is done at once: no task.
		if (d.snaps == nil || !d.snaps.copyInFlight()) && d.server.Withdraw(expired) == nil {
			d.later = append(d.later, withdrawn{task: a.task})
			return
		}
		snaps := d.snaps
		d.spawn(a.task, func(ctx context.Context) taskResult {
			if snaps != nil {
				// The snapshot's copy of the state must be in place before
				// the optimizer writes it. Its own failure fails no step.
				if err := snaps.waitCopied(ctx); err != nil {
					return taskResult{in: withdrawn{task: a.task, err: err}}
				}
			}
			return taskResult{in: withdrawn{task: a.task, err: d.server.Withdraw(ctx)}}
		})
	case offerState:
		if d.histBytes == nil || len(a.hist) != len(d.histOf) || a.hist.last() != d.histOf.last() {
			d.histBytes, d.histOf = a.hist.encode(), a.hist
		}
		d.server.OfferWithMeta(a.step, d.histBytes, d.blobs)
		if d.snaps != nil && d.blobs != nil && d.snaps.due(a.step) {
			d.snaps.take(a.step, d.histBytes, d.blobs)
		}
	case reportFormed:
		d.report("reporting the formed epoch", func(ctx context.Context, m *member) error { return m.ReportFormed(ctx, a.epoch) })
	case reportFailure:
		d.report("reporting the failed epoch", func(ctx context.Context, m *member) error {
			return m.ReportCommitFailure(ctx, a.epoch, a.blamed...)
		})
	case revokeEpoch:
		d.log.Info("blaming failed peers", zap.Uint64("epoch", a.epoch), zap.Strings("blamed", a.blamed), zap.String("reason", a.reason))
		d.report("reporting failed peers", func(ctx context.Context, m *member) error {
			return m.Revoke(ctx, a.epoch, a.reason, a.blamed...)
		})
	case reportHeartbeat:
		d.report("reporting the healed step", func(ctx context.Context, m *member) error {
			return m.beat.Heartbeat(ctx)
		})
	case reportWaiting:
		d.report("reporting the wait", func(ctx context.Context, m *member) error {
			return m.waits.SetWaiting(ctx, a.step, a.reason)
		})
	case forgetRendezvous:
		prefix := d.prefix(a.dim)
		d.report("deleting old rendezvous keys", func(ctx context.Context, m *member) error {
			var errs []error
			for _, p := range []string{prefix, prefix + "-ctl"} {
				errs = append(errs, m.Store().DeletePrefix(ctx, fmt.Sprintf("%s/epoch/%d/", p, a.epoch)))
			}
			return errors.Join(errs...)
		})
	case setStep:
		d.m.SetStep(a.step)
		d.metrics.step.Set(float64(a.step))
	case emit:
		if a.ev.Kind == EventPromoted {
			d.cfg.Spare = false // a replica now: a new registration is not a spare's
			d.metrics.spare.Set(0)
		}
		if d.cfg.OnEvent != nil {
			a.ev.Time = time.Now()
			d.publish() // the hook may read Rank, Epoch…
			d.link.queueEvent(a.ev)
		}
	case observe:
		d.observe(a)
	case logLine:
		if a.warn {
			d.log.Warn(a.msg)
		} else {
			d.log.Info(a.msg)
		}
	case stepDone:
		d.answer(reply{err: a.err, comms: d.stepComms(), target: d.mach.stepTarget()})
	case commitDone:
		d.answer(reply{ok: a.ok, err: a.err})
	case stopped:
		d.stopped = true
	case armTimer:
		if d.timerOn && !d.timer.Stop() {
			<-d.timer.C
		}
		d.timerOn = !a.at.IsZero()
		if d.timerOn {
			d.timer.Reset(max(time.Until(a.at), 0))
		}
	case reportStall:
		d.report("reporting a stalled step", func(ctx context.Context, m *member) error {
			return m.stalls.ReportStall(ctx, a.s)
		})
	case reportFinish:
		d.report("reporting the run's end", func(ctx context.Context, m *member) error { return m.Finish(ctx, a.step) })
	case finishDone:
		d.answer(reply{err: a.err})
	case failStepDone:
		d.answer(reply{err: a.err})
	case applySettings:
		d.applySettings(a)
	}
}

// tick is the machine's tick, with what it looks at: the oldest op still
// running on the current epoch's comms, and the FT peers its backend
// hears nothing from.
func (d *driver) tick() tick {
	t := tick{silent: d.silentFT(d.mach.epoch)}
	for key, x := range d.comms {
		if key.epoch != d.mach.epoch {
			continue
		}
		for _, c := range x.all() {
			if p := oldestPending(c); !p.IsZero() && (t.pending.IsZero() || p.Before(t.pending)) {
				t.pending = p
			}
		}
	}
	return t
}

// oldestPending is when the oldest op of c that has not completed was
// issued (zero: none), from its flight recorder.
func oldestPending(c *comm.Comm) time.Time {
	for _, op := range c.FlightRecord().Ops {
		if op.State == comm.OpEnqueued || op.State == comm.OpStarted {
			return op.Enqueued
		}
	}
	return time.Time{}
}

// silentFT returns the ranks of epoch's FT control comm that its backend
// hears nothing from (comm.SilenceReporter), if it can tell.
func (d *driver) silentFT(epoch uint64) []int {
	x, ok := d.comms[commKey{dimFT, epoch}]
	if !ok || x.ctl == nil || x.ctl.Err() != nil && !errors.Is(x.ctl.Err(), comm.ErrRevoked) {
		return nil
	}
	if sr, ok := x.ctl.Backend().(comm.SilenceReporter); ok {
		return sr.SilentPeers()
	}
	return nil
}

// applySettings makes the settings document a.ref names the one
// Comm.Settings returns, from step a.from.
func (d *driver) applySettings(a applySettings) {
	doc, ok := d.m.settings.Settings(*a.ref)
	if !ok {
		d.log.Warn("the epoch names job settings this member does not hold; keeping the previous ones",
			zap.Uint64("epoch", a.epoch), zap.Uint64("version", a.ref.Version))
		return
	}
	d.link.settings.Store(&Settings{JobSettings: doc, Epoch: a.epoch, FromStep: a.from})
	d.log.Info("job settings in force", zap.Uint64("version", doc.Version), zap.Int64("from_step", a.from), zap.String("settings", doc.Summary()))
}

func (d *driver) answer(r reply) {
	d.publish() // the caller reads CommittedStep, Epoch… next
	select {
	case d.link.replies <- r:
	default:
		d.log.Error("ft: no caller waits for the driver's answer (a bug)")
	}
}

// stepComms are the comms of the step that starts: the current epoch's.
func (d *driver) stepComms() stepComms {
	var s stepComms
	if d.mach.holds(dimFT) {
		s.ft = d.comms[commKey{dimFT, d.mach.epoch}]
	}
	if d.mach.holds(dimGroup) {
		s.group = d.comms[commKey{dimGroup, d.mach.group}]
	}
	return s
}

// publish updates what readers on other goroutines see.
func (d *driver) publish() {
	epoch, rank, n := d.mach.status()
	d.link.step.Store(d.mach.step)
	s := snapshot{epoch: epoch, rank: rank, participants: n, spare: d.mach.spare}
	if d.mach.holds(dimGroup) {
		s.group = d.comms[commKey{dimGroup, d.mach.group}].data
	}
	if *d.link.snap.Load() != s {
		d.link.snap.Store(&s)
	}
}

func (d *driver) observe(a observe) {
	mt := d.metrics
	switch a.what {
	case metricEpochSeen:
		mt.epochSeen.Set(a.value)
	case metricDetect:
		mt.detectSeconds.Observe(a.value)
	case metricReconfig:
		mt.reconfigSeconds.Observe(a.value)
	case metricReconfigs:
		mt.reconfigs.WithLabelValues(a.label).Inc()
	case metricCommit:
		mt.commits.WithLabelValues(a.label).Inc()
	case metricFailureToCommit:
		mt.recoverySeconds.Observe(a.value)
	case metricStepSeconds:
		mt.stepSeconds.Observe(a.value)
	case metricRollback:
		mt.rollbacks.Inc()
		mt.rolledBackSteps.Add(a.value)
	}
}

// spawn runs a task of the machine on its own goroutine, cancellable
// through cancelTask; its result comes back to run.
func (d *driver) spawn(task int, fn func(ctx context.Context) taskResult) {
	ctx, cancel := context.WithCancelCause(context.Background())
	d.cancels[task] = cancel
	go func() {
		r := fn(ctx)
		r.task = task
		cancel(nil)
		d.link.in <- r // run receives until every task has answered
	}()
}

// adopt takes a formed dimension's comms: watched for failure from now on.
func (d *driver) adopt(key commKey, x comms) {
	d.comms[key] = x
	watch := func(c *comm.Comm, p part) {
		go func() {
			select {
			case <-c.Broken():
			case <-d.link.done:
				return
			}
			select {
			case d.link.in <- commFailed{dim: key.dim, epoch: key.epoch, part: p, err: c.Err()}:
			case <-d.link.done:
			}
		}()
	}
	if x.data == x.ctl {
		watch(x.ctl, partBoth)
	} else {
		watch(x.data, partData)
		watch(x.ctl, partCtl)
	}
	if key.dim == dimFT {
		d.watchHealth(x.data)
	}
}

func (d *driver) prefix(dm dim) string {
	if dm == dimGroup {
		return "group-" + d.cfg.Group
	}
	return "ft-" + strconv.Itoa(d.cfg.GroupRank)
}

// registrationEnded replaces a registration that ended (evicted, or its
// lease lost in a long pause) with a new incarnation, which the
// coordinator admits like a restarted replica; a Membership from Config
// is not re-created.
func (d *driver) registrationEnded() {
	old := d.m
	cause := old.Err()
	em := old.etcd
	if !d.own || em == nil {
		d.log.Error("membership ended", zap.Error(cause))
		d.feed(membershipLost{err: cause})
		return
	}
	d.log.Warn("registration lost; registering again", zap.Error(cause))
	ctx, cancel := context.WithCancel(context.Background())
	d.stopReg = cancel
	d.rereg.Add(1)
	go func() {
		defer d.rereg.Done()
		b := backoff.NewExponentialBackOff()
		b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 100*time.Millisecond, 5*time.Second, 0
		var nm *etcdMember
		err := backoff.Retry(func() error {
			var err error
			nm, err = em.registerAgain(ctx, d.cfg, d.id, d.server.Addr())
			if errors.Is(err, membership.ErrRunEnded) {
				return backoff.Permanent(err) // its state is of a run that is over
			}
			if err != nil {
				d.log.Warn("registering again", zap.Error(err))
			}
			return err
		}, backoff.WithContext(b, ctx))
		if errors.Is(err, membership.ErrRunEnded) {
			d.log.Error("cannot register again", zap.Error(err))
			select {
			case d.link.in <- membershipLost{err: err}:
			case <-d.link.done:
			}
			return
		}
		if err != nil {
			return // closing
		}
		nm.cli, em.cli = em.cli, nil // the client moves to the new registration
		em.Close()
		d.log.Info("registered again", zap.Int64("incarnation", nm.Incarnation()))
		select {
		case d.link.in <- memberSwap{nm}:
		case <-d.link.done:
			nm.Close()
		}
	}()
}

// shutdown releases what the driver held once its loop has ended (Close):
// the registration, the recovery server, the metrics, and — with device
// comms — waits until their GPU work stopped, Config.Timeout at most.
func (d *driver) shutdown() error {
	if d.health != nil {
		d.health()
	}
	if d.stopReg != nil {
		d.stopReg()
	}
	d.rereg.Wait()
	d.warm.stop()
	if d.warm != nil && d.warm.comm != nil {
		d.track(d.warm.comm) // its device release is awaited below
	}
	d.reports.stop()
	defer d.metrics.unregister()
	m := d.link.member()
	lctx, cancel := context.WithTimeout(context.Background(), leaveTimeout)
	defer cancel()
	var serr error
	if d.snaps != nil {
		serr = d.snaps.close() // before the device comms go: its copies use them
	}
	err := errors.Join(m.Leave(lctx), m.Close(), d.server.Close(), serr)
	deadline := time.Now().Add(d.cfg.Timeout)
	if d.staging != nil {
		// After the server: no chunk is staged any more.
		err = errors.Join(err, d.staging.close(deadline))
	}
	return errors.Join(err, d.awaitReleased(deadline))
}

// awaitReleased waits, until deadline at most, until every device comm
// this Comm formed has released its resources, so that no GPU op of it
// still uses the caller's device memory.
func (d *driver) awaitReleased(deadline time.Time) error {
	d.relMu.Lock()
	rs := d.releasing
	d.releasing = nil
	d.relMu.Unlock()
	timeout := time.NewTimer(time.Until(deadline))
	defer timeout.Stop()
	var errs []error
	for i, r := range rs {
		select {
		case <-r.Released():
			if err := r.ReleaseErr(); err != nil {
				errs = append(errs, fmt.Errorf("ft: releasing a device comm: %w (its GPU work may still use device memory)", err))
			}
		case <-timeout.C:
			return errors.Join(append(errs, fmt.Errorf("ft: %d device comms not released within %v of Close: their GPU work may still use device memory",
				len(rs)-i, d.cfg.Timeout))...)
		}
	}
	return errors.Join(errs...)
}

// track remembers a newly formed comm whose backend releases its device
// resources after Close, for Close to wait for. Every comm ft forms passes
// here, so the comms it closes along the way are waited for too; those
// already released are forgotten. Called from formation tasks.
func (d *driver) track(x *comm.Comm) {
	r, ok := x.Backend().(releaser)
	if !ok {
		return
	}
	d.relMu.Lock()
	defer d.relMu.Unlock()
	d.releasing = slices.DeleteFunc(d.releasing, func(r releaser) bool {
		select {
		case <-r.Released():
			return true
		default:
			return false
		}
	})
	d.releasing = append(d.releasing, r)
}

// watchHealth starts watching the GPU of a device data backend, once: a
// critical fault takes the replica out of the next quorum.
func (d *driver) watchHealth(data *comm.Comm) {
	if d.health != nil || d.cfg.DisableHealthWatch || data.Backend().Memory() != comm.DeviceMemory {
		return
	}
	hw, ok := data.Backend().(comm.HealthWatcher)
	if !ok {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	d.health = cancel
	err := hw.WatchHealth(ctx, func(e comm.HealthEvent) {
		if !e.Critical {
			// A fault that leaves the device usable (an application's Xid)
			// is no news of its health, and must not report a GPU that
			// had a critical fault healthy again.
			d.log.Info("device event", zap.Int("device", e.Device), zap.String("reason", e.Reason))
			return
		}
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := reportHealth(rctx, d.link.member(), d.log, membership.Critical, e.Reason); err != nil {
			d.log.Error("reporting device health", zap.Int("device", e.Device), zap.String("reason", e.Reason), zap.Error(err))
		}
	})
	if err != nil {
		d.log.Warn("cannot watch the GPU's health; set Config.DisableHealthWatch to silence this", zap.Error(err))
	}
}

// report queues a best-effort report to the coordinator.
func (d *driver) report(what string, f func(context.Context, *member) error) {
	m := d.m
	d.reports.add(what, func(ctx context.Context) error { return f(ctx, m) })
}

// reporter sends the coordinator its reports in order, on a goroutine of
// its own, each try bounded by the op timeout: a replica cut off from
// etcd never blocks the driver on them, and the coordinator learns of
// failures from leases and gossip meanwhile. A report that etcd did not
// take — no answer within the timeout, no leader, load shed — is tried
// again (after 50 ms, doubling to 1 s) until it is taken or fails for
// another reason (the registration it was made under ended), the later
// ones waiting behind it: what a replica reports, a failed epoch and the
// peers it blames above all, is what the coordinator decides on, and an
// outage of the coordinator's etcd used to lose it (the survivors of a
// death inside the outage then waited for the dead replica's lease).
// Every report is idempotent: one taken twice is one.
type reporter struct {
	log     *zap.Logger
	timeout time.Duration
	mu      sync.Mutex
	queue   []report
	wake    chan struct{}
	ctx     context.Context
	cancel  context.CancelFunc
	done    chan struct{}
}

// report is one report: what it is, for the log, and how to make it.
type report struct {
	what string
	f    func(context.Context) error
}

func newReporter(log *zap.Logger, timeout time.Duration) *reporter {
	ctx, cancel := context.WithCancel(context.Background())
	r := &reporter{log: log, timeout: timeout, wake: make(chan struct{}, 1), ctx: ctx, cancel: cancel, done: make(chan struct{})}
	go r.run()
	return r
}

func (r *reporter) add(what string, f func(context.Context) error) {
	r.mu.Lock()
	r.queue = append(r.queue, report{what, f})
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// run exits when stop is called.
func (r *reporter) run() {
	defer close(r.done)
	for {
		r.mu.Lock()
		q := r.queue
		r.queue = nil
		r.mu.Unlock()
		for _, rep := range q {
			r.send(rep)
		}
		select {
		case <-r.wake:
		case <-r.ctx.Done():
			return
		}
	}
}

// send makes one report, trying again while etcd does not take it.
func (r *reporter) send(rep report) {
	pause := 50 * time.Millisecond
	for tries := 1; ; tries++ {
		ctx, cancel := context.WithTimeout(r.ctx, r.timeout)
		err := rep.f(ctx)
		cancel()
		switch {
		case err == nil:
			if tries > 1 {
				r.log.Info(rep.what+": taken", zap.Int("tries", tries))
			}
			return
		case r.ctx.Err() != nil:
			return
		case !notTaken(err):
			r.log.Warn(rep.what, zap.Error(err))
			return
		case tries == 1:
			r.log.Warn(rep.what+": not taken; trying again until etcd takes it", zap.Error(err))
		}
		select {
		case <-r.ctx.Done():
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, time.Second)
	}
}

// notTaken says whether err means that etcd did not take a request that
// may simply be made again: no answer in time (etcd down or cut off), no
// leader, load shed.
func notTaken(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, rpctypes.ErrNoLeader) ||
		errors.Is(err, rpctypes.ErrTooManyRequests) || status.Code(err) == codes.Unavailable
}

func (r *reporter) stop() {
	r.cancel()
	<-r.done
}
