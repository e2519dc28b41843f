package ft

import (
	"errors"
	"time"

	"go.uber.org/zap"
)

// exec carries out one action of the machine. Each kind of action has one
// line here, the driver's method that carries it out: done here, on the
// driver's goroutine; a task, whose work runs on a goroutine of its own
// (tasks.go, form.go); or a report to the coordinator, queued in order
// (reports.go).
func (d *driver) exec(a action) {
	if d.hook != nil {
		d.hook(a)
	}
	switch a := a.(type) {
	// Done here, on the driver's goroutine.
	case closeComms:
		d.closeComms(a)
	case revokeComms:
		d.revokeComms(a)
	case observe:
		d.observe(a)
	case logLine:
		d.logLine(a)
	case armTimer:
		d.armTimer(a)
	case stopped:
		d.stopped = true
	case stepDone:
		d.stepDone(a)
	case commitDone:
		d.answer(reply{ok: a.ok, err: a.err})
	case finishDone:
		d.answer(reply{err: a.err})
	case failStepDone:
		d.answer(reply{err: a.err})
	case emit:
		d.emit(a)
	case setStep:
		d.setStep(a)
	case applySettings:
		d.applySettings(a)
	case offerState:
		d.offerState(a)

	// Comms and their rendezvous (form.go).
	case forgetRendezvous:
		d.forgetRendezvous(a)
	case formComms:
		d.form(a)

	// Tasks (tasks.go).
	case cancelTask:
		d.cancelTask(a)
	case keepGroup:
		d.keepGroup(a)
	case agreeSwitch:
		d.agreeSwitch(a)
	case agreeStep:
		d.spawnOnGroup(a.task, a.epoch, a.exchange)
	case gatherRecords:
		d.gatherRecords(a)
	case readLastCommit:
		d.readLastCommit(a)
	case fetchState:
		d.fetchState(a)
	case castVote:
		d.castVote(a)
	case recordCommit:
		d.recordCommit(a)
	case shareOutcome:
		d.spawnOnGroup(a.task, a.epoch, a.exchange)
	case withdrawState:
		d.withdrawState(a)
	case checkGroup:
		d.checkGroup(a)

	// Reports to the coordinator (reports.go).
	case reportFormed:
		d.report(a)
	case reportFailure:
		d.report(a)
	case reportHeartbeat:
		d.report(a)
	case reportWaiting:
		d.report(a)
	case reportStall:
		d.report(a)
	case reportFinish:
		d.report(a)
	case revokeEpoch:
		d.revokeEpoch(a)
	}
}

func (d *driver) closeComms(a closeComms) {
	key := commKey{a.dim, a.epoch}
	x := d.comms[key]
	delete(d.comms, key)
	x.close()
}

func (d *driver) revokeComms(a revokeComms) {
	x := d.comms[commKey{a.dim, a.epoch}]
	cause := errors.New(a.cause)
	if a.part&partData != 0 && x.data != nil {
		x.data.Revoke(cause)
	}
	if a.part&partCtl != 0 && x.ctl != nil {
		x.ctl.Revoke(cause)
	}
}

// offerState serves the committed step's state to healers, with the
// history that led to it, and takes the step's peer snapshot when one is
// due.
func (d *driver) offerState(a offerState) {
	if d.histBytes == nil || len(a.hist) != len(d.histOf) || a.hist.last() != d.histOf.last() {
		d.histBytes, d.histOf = a.hist.encode(), a.hist
	}
	d.server.OfferWithMeta(a.step, d.histBytes, d.blobs)
	if d.snaps != nil && d.blobs != nil && d.snaps.due(a.step) {
		d.snaps.take(a.step, d.histBytes, d.blobs)
	}
}

func (d *driver) setStep(a setStep) {
	d.m.SetStep(a.step)
	d.metrics.step.Set(float64(a.step))
}

func (d *driver) emit(a emit) {
	if a.ev.Kind == EventPromoted {
		d.cfg.Spare = false // a replica now: a new registration is not a spare's
		d.metrics.spare.Set(0)
	}
	if d.cfg.OnEvent != nil {
		a.ev.Time = time.Now()
		d.publish() // the hook may read Rank, Epoch…
		d.link.queueEvent(a.ev)
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

func (d *driver) logLine(a logLine) {
	if a.warn {
		d.log.Warn(a.msg)
	} else {
		d.log.Info(a.msg)
	}
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

// stepDone answers Step, with the comms of the step that starts.
func (d *driver) stepDone(a stepDone) {
	d.answer(reply{err: a.err, comms: d.stepComms(), target: d.mach.stepTarget()})
}

func (d *driver) answer(r reply) {
	d.publish() // the caller reads CommittedStep, Epoch… next
	select {
	case d.link.replies <- r:
	default:
		d.log.Error("ft: no caller waits for the driver's answer (a bug)")
	}
}

// armTimer sets the machine's tick (zero: none).
func (d *driver) armTimer(a armTimer) {
	if d.timerOn && !d.timer.Stop() {
		<-d.timer.C
	}
	d.timerOn = !a.at.IsZero()
	if d.timerOn {
		d.timer.Reset(max(time.Until(a.at), 0))
	}
}
