package coordinator

import (
	"bytes"
	"encoding/json"
	"slices"
	"sort"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/internal/gossip"
	"github.com/ftcomm/ftcomm/membership"
)

// The machine's inputs from etcd and gossip: what each means for a job.

// load starts afresh from a read of every job: a job's quorum comes from
// its record when the leader trusts it (else from its history, and the
// record is repaired at the first decision); the live records, the stored
// revocations and the gossip deaths seen meanwhile follow; every job is
// decided at the next pass.
func (m *machine) load(now time.Time, in loaded) {
	m.jobs = map[string]*jobState{}
	m.byNode = map[string]memberRef{}
	m.pass, m.write = nil, nil
	names := make([]string, 0, len(in.jobs))
	for name := range in.jobs {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if s := in.jobs[name]; s.quorum != nil || len(s.history) > 0 {
			m.jobs[name] = m.loadQuorum(name, s.quorum, s.history)
		}
	}
	for _, name := range names {
		for _, r := range in.jobs[name].members {
			m.upsert(now, name, r)
		}
	}
	for _, name := range names {
		for _, r := range in.jobs[name].revocations {
			m.job(name).m.Revoke(now, r)
		}
	}
	for _, j := range m.jobs {
		j.dirty = true
	}
	for _, n := range in.deaths {
		m.gossipDeath(now, n)
	}
}

// loadQuorum makes a job's state from its quorum record (nil: none) and
// its history (oldest first). A record the leader cannot trust — not
// signed by its key, or (without a signer) not the newest history entry —
// is foreign: the job starts from the newest trusted history entry, and
// the record is repaired at the first decision.
func (m *machine) loadQuorum(job string, rec *storedValue, history []storedValue) *jobState {
	newMachine := func(q *membership.Quorum) *quorum.Machine { return quorum.NewMachine(job, m.cfg.quorum, q) }
	// The newest trusted history entry, and the highest epoch seen at all.
	var real *storedValue
	var realQ membership.Quorum
	var floor uint64
	for i := len(history) - 1; i >= 0; i-- {
		var q membership.Quorum
		if json.Unmarshal(history[i].value, &q) == nil {
			floor = max(floor, q.Epoch)
		}
		if real == nil {
			if q, ok := m.cfg.trust(job, history[i].value); ok {
				real, realQ = &history[i], q
			}
		}
	}
	if rec != nil {
		q, ok := m.cfg.trust(job, rec.value)
		if ok && !m.cfg.signed && real != nil {
			// Unsigned: only the record the history agrees with is ours.
			ok = bytes.Equal(rec.value, real.value)
		}
		if ok {
			return &jobState{m: newMachine(&q), quorumRev: rec.rev, lastValue: rec.value}
		}
		f := &foreignWrite{rev: rec.rev}
		var fq membership.Quorum
		if json.Unmarshal(rec.value, &fq) == nil {
			f.epoch = fq.Epoch
			floor = max(floor, fq.Epoch)
		}
		m.log(true, "quorum record not written by a coordinator; restoring the last trusted one",
			field{"job", job}, field{"revision", rec.rev}, field{"claimed epoch", f.epoch})
		j := &jobState{quorumRev: rec.rev, foreign: f}
		switch {
		case real != nil:
			j.m, j.lastValue = newMachine(&realQ), real.value
		case floor > 0:
			// Nothing trusted to restore; never go back below an epoch
			// members may have seen.
			j.m = newMachine(&membership.Quorum{Job: job, Epoch: floor})
		default:
			j.m = newMachine(nil)
		}
		return j
	}
	if real == nil {
		return &jobState{m: newMachine(nil)}
	}
	m.log(true, "quorum record deleted by someone else; restoring it", field{"job", job}, field{"epoch", realQ.Epoch})
	return &jobState{m: newMachine(&realQ), lastValue: real.value, foreign: &foreignWrite{deleted: true, epoch: realQ.Epoch}}
}

// upsert applies a member's record: an eviction, a leave or the end of its
// run ends its registration; anything else goes to the quorum rules, and
// the members it blames for a failed commit are probed.
func (m *machine) upsert(now time.Time, job string, r membership.MemberRecord) {
	j := m.job(job)
	m.noteStalled(job, j, r)
	switch {
	case r.Evicted != "":
		m.remove(now, job, r.ID, r.Incarnation, quorum.Removal{Cause: quorum.Evicted, By: r.Evicted})
		return
	case r.Leaving && r.Finished:
		// Where the run ended outlives the member (a coordinator that
		// loads only the leaving record learns it here).
		if old, ok := j.m.Member(r.ID); ok && old.Incarnation == r.Incarnation {
			j.m.Upsert(now, r)
		}
		m.remove(now, job, r.ID, r.Incarnation, quorum.Removal{Cause: quorum.Finished, Step: r.Step})
		return
	case r.Leaving:
		m.remove(now, job, r.ID, r.Incarnation, quorum.Removal{Cause: quorum.Left})
		return
	}
	old, ok := j.m.Member(r.ID)
	newInc := !ok || old.Incarnation != r.Incarnation
	if newInc {
		if ok {
			delete(m.byNode, gossip.NodeName(job, old.ID, old.Lease))
		}
		m.do(observe{what: metricJoin, job: job, value: 1})
	}
	if r.Gossip != "" {
		m.byNode[gossip.NodeName(job, r.ID, r.Lease)] = memberRef{job, r.ID, r.Incarnation}
	}
	if j.m.Upsert(now, r) {
		j.dirty = true
	}
	if len(r.Blamed) > 0 && (newInc || old.CommitFailed != r.CommitFailed || !slices.Equal(old.Blamed, r.Blamed)) {
		m.probeBlamed(now, job, membership.Revocation{Epoch: r.CommitFailed, Failed: r.Blamed})
	}
}

// remove ends incarnation inc of member id (0: whichever is live) for r's
// cause.
func (m *machine) remove(now time.Time, job, id string, inc int64, r quorum.Removal) {
	j := m.job(job)
	old, ok := j.m.Member(id)
	if !ok || inc != 0 && old.Incarnation != inc {
		return
	}
	delete(m.byNode, gossip.NodeName(job, id, old.Lease))
	m.noteStalled(job, j, membership.MemberRecord{ID: id})
	j.m.Remove(now, id, old.Incarnation, r)
	j.dirty = true
	m.do(removed{job: job, id: id, removal: r})
}

// gossipDeath ends the registration of the member behind a dead gossip
// node; its key is deleted at the end of the pass (fenced), so that a
// restarted process may register at once.
func (m *machine) gossipDeath(now time.Time, node string) {
	ref, ok := m.byNode[node]
	if !ok {
		return
	}
	rec, ok := m.job(ref.job).m.Member(ref.id)
	if !ok || rec.Incarnation != ref.inc {
		return
	}
	m.remove(now, ref.job, ref.id, ref.inc, quorum.Removal{Cause: quorum.GossipDeath})
	m.doomed = append(m.doomed, doomedMember{ref.job, rec})
}

// probeBlamed has the members r blames probed (a peer saw its connection to
// them fail): a member whose address refuses a TCP connection has no
// process listening there any more and goes at once, instead of after
// gossip's suspicion or its lease. The next quorum that would keep it
// waits for the verdict, at most probeWait: one death costs one epoch,
// not two.
func (m *machine) probeBlamed(now time.Time, job string, r membership.Revocation) {
	j := m.job(job)
	for _, id := range r.Failed {
		rec, ok := j.m.Member(id)
		if !ok || rec.Addr == "" {
			continue
		}
		j.m.Suspect(now, id, rec.Incarnation, now.Add(m.cfg.probeWait))
		m.do(probe{job: job, id: id, inc: rec.Incarnation, addr: rec.Addr})
	}
}

// onProbed applies a probe's verdict: a refused port ends the member (its
// key goes at the end of the pass); an answer, or a host that cannot be
// reached, leaves it to gossip and its lease.
func (m *machine) onProbed(now time.Time, v probed) {
	j := m.job(v.job)
	rec, ok := j.m.Member(v.id)
	if !ok || rec.Incarnation != v.inc {
		return
	}
	if !v.dead {
		m.log(false, "a member reported dead did not refuse a connection; left to gossip and its lease",
			field{"job", v.job}, field{"member", v.id}, field{"addr", rec.Addr}, field{"dial", v.err})
		j.m.Unsuspect(v.id, v.inc)
		j.dirty = true
		return
	}
	m.remove(now, v.job, v.id, v.inc, quorum.Removal{Cause: quorum.PortClosed})
	m.doomed = append(m.doomed, doomedMember{v.job, rec})
}

// onQuorumWritten tells the leader's own writes of a quorum record, seen
// in the watch (late, possibly after a newer one), from anyone else's,
// which it repairs at the next pass. Only a leader passes the fence, so
// another writer is not a coordinator: an operator, or an intruder.
func (m *machine) onQuorumWritten(w quorumWritten) {
	j := m.job(w.job)
	if w.rev <= max(j.quorumRev, j.ownRev) {
		return // ours, or older than ours
	}
	if !w.deleted && j.unanswered != nil && bytes.Equal(w.value, j.unanswered) {
		// Ours after all: a write whose answer was lost.
		j.quorumRev, j.ownRev, j.lastValue, j.unanswered = w.rev, w.rev, j.unanswered, nil
		j.m.Published(j.unansweredQ)
		return
	}
	f := &foreignWrite{rev: w.rev, deleted: w.deleted}
	if f.deleted {
		f.rev = 0
	} else {
		var q membership.Quorum
		if json.Unmarshal(w.value, &q) == nil {
			f.epoch = q.Epoch
		}
	}
	m.log(true, "quorum record written by someone else; restoring the leader's", field{"job", w.job},
		field{"revision", w.rev}, field{"deleted", f.deleted}, field{"claimed epoch", f.epoch})
	j.foreign, j.dirty = f, true
	m.do(observe{what: metricForeign, job: w.job, value: 1})
}

// onViewWritten tells a foreign write of a job's quorum view (what
// members act on) from the leader's own, which it writes in the same
// transaction as the record and so with the record's revision.
func (m *machine) onViewWritten(w viewWritten) {
	j := m.job(w.job)
	if w.rev <= max(j.quorumRev, j.ownRev) {
		return
	}
	f := &foreignWrite{rev: j.quorumRev, view: true, deleted: w.deleted}
	if !f.deleted {
		var h struct {
			Epoch uint64 `json:"epoch"`
		}
		if i := bytes.IndexByte(w.value, '\n'); i > 0 && json.Unmarshal(w.value[:i], &h) == nil {
			f.epoch = h.Epoch
		}
	}
	m.log(true, "quorum view written by someone else; republishing the leader's", field{"job", w.job},
		field{"revision", w.rev}, field{"deleted", f.deleted}, field{"claimed epoch", f.epoch})
	j.foreign, j.dirty = f, true
	m.do(observe{what: metricForeign, job: w.job, value: 1})
}

// noteStalled keeps the set of a job's members that wait for a holder of
// a step the job committed (MemberRecord.WaitingFor), for the metric
// ftcomm_coordinator_waiting_members and the log; r is the member's new
// record (one with no WaitingFor when it left).
func (m *machine) noteStalled(job string, j *jobState, r membership.MemberRecord) {
	waits := r.WaitingFor > 0 && r.Evicted == "" && !r.Leaving
	if waits == j.stalled[r.ID] {
		return
	}
	if waits {
		if j.stalled == nil {
			j.stalled = map[string]bool{}
		}
		j.stalled[r.ID] = true
		m.log(true, "member waits for a holder of a committed step", field{"job", job}, field{"member", r.ID},
			field{"step", r.WaitingFor}, field{"why", r.Waiting})
	} else {
		delete(j.stalled, r.ID)
	}
	m.do(observe{what: metricStalled, job: job, value: float64(len(j.stalled))})
}
