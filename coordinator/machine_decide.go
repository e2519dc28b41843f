package coordinator

import (
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
)

// The machine's passes: repair, decide, publish, report, one write at a
// time.

// startPass begins a pass over the jobs with news or a timer due.
func (m *machine) startPass(now time.Time) {
	p := &pass{now: now}
	for name, j := range m.jobs {
		if j.dirty || !j.wakeAt.IsZero() && !now.Before(j.wakeAt) {
			p.jobs = append(p.jobs, name)
		}
	}
	sort.Strings(p.jobs)
	m.pass = p
}

// run carries the pass on until it ends or waits for a write's answer.
func (m *machine) run() {
	for m.pass != nil && m.write == nil {
		p := m.pass
		if p.next == len(p.jobs) {
			m.pass = nil
			// Deleted after the pass's publications, off the critical path.
			for _, d := range m.doomed {
				m.do(deleteRegistration{job: d.job, rec: d.rec})
			}
			m.doomed = m.doomed[:0]
			return
		}
		name := p.jobs[p.next]
		j := m.jobs[name]
		switch p.stage {
		case stageRepair:
			j.dirty = false
			p.stage = stageDecide
			if j.foreign != nil {
				m.repair(p.now, name, j)
			}
		case stageDecide:
			p.stage = stageReport
			d := j.m.Advance(p.now)
			j.wakeAt, j.waiting = d.WakeAt, d.Waiting
			if d.Quorum != nil || d.Revocation != nil {
				m.publish(name, j, d)
			}
		case stageReport:
			st := status{job: name, members: j.m.Len(), waiting: j.waiting, wakeAt: j.wakeAt, stalled: len(j.stalled), at: p.now}
			if q, ok := j.m.Current(); ok {
				st.quorum = &q
			}
			m.do(st)
			p.next, p.stage = p.next+1, stageRepair
		}
	}
}

// publish starts the write of decision d.
func (m *machine) publish(job string, j *jobState, d quorum.Decision) {
	a := publish{job: job, quorum: d.Quorum, revocation: d.Revocation, ifRev: j.quorumRev}
	if r := d.Revocation; r != nil {
		r.By = "coordinator " + m.cfg.name
	}
	if q := d.Quorum; q != nil {
		q.PublishedBy = m.cfg.name
		if cur, ok := j.m.Current(); ok {
			a.prev = &cur
		}
		a.viewRev = d.Revocation
		if r, ok := j.m.Revocation(); ok && a.viewRev == nil {
			a.viewRev = &r
		}
	}
	m.write = &inflight{job: job, publish: &d}
	m.do(a)
}

// repair undoes a foreign write of a job's quorum key: it restores the
// leader's record; without one, it deletes the foreign record. Without a
// signer, members cannot tell a foreign record from the leader's and may
// have obeyed it, so a foreign epoch at or above the leader's is answered
// with the leader's participants republished above it. A foreign view is
// answered the same way (members may have taken it, unsigned, or ignored
// it, signed: a new epoch above it is right either way), or deleted when
// the leader has no quorum.
func (m *machine) repair(now time.Time, job string, j *jobState) {
	f := j.foreign
	j.foreign = nil
	cur, have := j.m.Current()
	republish := func(reason string) {
		q := cur
		q.Epoch, q.Created, q.Base, q.Removed, q.Added = cur.Epoch+1, now, 0, nil, nil
		if f.epoch >= cur.Epoch && f.epoch < math.MaxUint64-1 {
			q.Epoch = f.epoch + 1
		}
		q.Reason = reason
		m.publish(job, j, quorum.Decision{Quorum: &q})
		m.write.foreign = f
	}
	switch {
	case f.view && !have:
		m.write = &inflight{job: job, foreign: f}
		m.do(deleteView{job: job})
	case f.view:
		republish("the quorum view was overwritten by someone else; republished")
	case !m.cfg.signed && have && !f.deleted && f.epoch >= cur.Epoch && f.epoch < math.MaxUint64-1:
		j.quorumRev = f.rev // fenced on the foreign write
		republish("the quorum record was overwritten by someone else; republished")
	case j.lastValue != nil:
		m.write = &inflight{job: job, foreign: f, what: "restored the quorum record"}
		m.do(restoreRecord{job: job, value: j.lastValue, ifRev: f.rev})
	default:
		m.write = &inflight{job: job, foreign: f, what: "deleted the foreign quorum record"}
		m.do(deleteRecord{job: job, ifRev: f.rev})
	}
}

// onWritten takes the answer to the write in flight.
func (m *machine) onWritten(now time.Time, w written) {
	wr := m.write
	if wr == nil {
		return
	}
	m.write = nil
	j := m.job(wr.job)
	switch {
	case wr.publish != nil:
		m.onPublished(now, wr, j, w)
	case wr.what == "": // the view's deletion: only a failure matters
		if w.err != nil {
			j.foreign, j.dirty = wr.foreign, true // try again at the next pass
		}
	case w.err != nil:
		j.foreign, j.dirty = wr.foreign, true
		m.log(true, "quorum repair failed", field{"job", wr.job}, field{"error", w.err})
	case !w.ok:
		m.refused(fmt.Sprintf("fenced repair of job %s refused", wr.job))
	default: // the record restored or deleted
		j.quorumRev, j.ownRev = w.rev, w.rev
		if j.lastValue == nil {
			j.quorumRev = 0 // deleted: the next publication creates the key
		}
		cur, _ := j.m.Current()
		m.log(false, wr.what, field{"job", wr.job}, field{"epoch", cur.Epoch})
	}
}

func (m *machine) onPublished(now time.Time, wr *inflight, j *jobState, w written) {
	d := wr.publish
	switch {
	case w.err != nil:
		if d.Quorum != nil {
			j.unanswered, j.unansweredQ = w.value, *d.Quorum
		}
		j.dirty = true // try again at the next pass
		m.log(true, "publish failed", field{"job", wr.job}, field{"error", w.err})
	case !w.ok:
		j.unanswered = nil
		m.refused(fmt.Sprintf("fenced write of job %s refused", wr.job))
	case d.Quorum != nil:
		j.quorumRev, j.ownRev, j.lastValue, j.unanswered = w.rev, w.rev, w.value, nil
		j.m.Published(*d.Quorum)
		m.do(observe{what: metricQuorum, job: wr.job, value: 1})
		m.log(false, "quorum published", field{"job", wr.job}, field{"epoch", d.Quorum.Epoch},
			field{"participants", len(d.Quorum.Participants)}, field{"reason", d.Quorum.Reason})
	default:
		j.m.Revoke(now, *d.Revocation)
		m.log(false, "epoch revoked", field{"job", wr.job}, field{"epoch", d.Revocation.Epoch}, field{"reason", d.Revocation.Reason})
	}
}

// refused ends the pass: another instance leads.
func (m *machine) refused(what string) {
	m.pass = nil
	m.do(notLeader{what: what})
}
