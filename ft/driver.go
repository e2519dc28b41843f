package ft

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.uber.org/zap"

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
//
// Its parts: the loop here; the executor of the machine's actions
// (exec.go); the tasks it spawns (tasks.go, form.go, snapshot.go's
// group check); the reports (reports.go); what Close releases
// (release.go); the registration's capabilities (membership.go).
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
