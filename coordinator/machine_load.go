package coordinator

import (
	"bytes"
	"sort"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership"
)

// A new term: the machine starts afresh from a read of every job.

// load starts afresh from a read of every job: a job's quorum comes from
// its record when the leader trusts it (else from its history, and the
// record is repaired at the first decision); the live records, the stored
// revocations (the members one of the current epoch blames are probed)
// and the gossip deaths seen meanwhile follow; every job is decided at
// the next pass.
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
		if raw := in.jobs[name].settings; raw != nil {
			m.onSettings(settingsPut{job: name, raw: raw})
		}
	}
	for _, name := range names {
		j := m.job(name)
		for _, r := range in.jobs[name].revocations {
			j.m.Revoke(now, r)
			// The members a revocation of the current epoch blames are
			// probed as when one is seen live: a revocation stored while
			// no coordinator led (a replica that died during an outage
			// of every coordinator) names the dead at once, and its
			// lease, which a restart of etcd renews, is not waited for.
			if q, ok := j.m.Current(); ok && r.Epoch == q.Epoch {
				m.probeBlamed(now, name, r)
			}
		}
	}
	for _, name := range names {
		for _, c := range in.jobs[name].claims {
			m.onClaim(now, c)
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
		if e, ok := membership.QuorumRecordEpoch(history[i].value); ok {
			floor = max(floor, e)
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
		if e, ok := membership.QuorumRecordEpoch(rec.value); ok {
			f.epoch = e
			floor = max(floor, e)
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
