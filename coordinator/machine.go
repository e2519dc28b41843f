package coordinator

import (
	"bytes"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/membership/gossip"
)

// This file is the leading coordinator's decisions as a state machine with
// no goroutines, clock or I/O (the models: ft's step machine, etcd-io/raft's
// Ready). Its inputs say what the leader learnt — a member's record seen, a
// key deleted, a revocation stored, someone else's write of a quorum key, a
// gossip death, a probe's verdict, the answer to its own write — each with
// the time; handle returns the actions that follow: publish an epoch,
// probe a blamed member's port, delete a dead member's registration,
// repair a quorum key someone else wrote, and what to log and count. The
// quorum rules of each job are quorum.Machine's; this machine decides
// around them: what a record or a deletion means for the quorum (a
// quorum.Cause), whom to probe, whose registration goes, and how to undo a
// foreign write. The leadership (leadership.go) feeds it from etcd and
// gossip and carries its actions out.
//
// Decisions are made in passes (tick): every job with news or a timer due,
// in name order. A pass makes at most one write at a time: an action that
// writes (publish, restoreRecord, deleteRecord, deleteView) is answered by
// a written input before the pass goes on, since what a job decides next
// depends on what was stored (a repair republishes an epoch; the quorum
// rules then decide from it). The driver feeds that answer before anything
// else.

// ---- inputs ----

type input interface{ isInput() }

type (
	// loaded: the leader read every job's keys (when its term began, and
	// after its watch broke). deaths are the gossip nodes seen dead
	// before, while it did not lead or did not watch.
	loaded struct {
		jobs   map[string]*jobSnapshot
		deaths []string
	}
	// recordPut: a member's record was written; rec.Incarnation is the
	// key's create revision.
	recordPut struct {
		job string
		rec membership.MemberRecord
	}
	// recordDeleted: a member's key went: its lease expired, or someone
	// deleted it. inc is the deleted record's incarnation (0: unknown).
	recordDeleted struct {
		job, id string
		inc     int64
	}
	// revocationPut: a revocation of one of the job's epochs was stored.
	revocationPut struct {
		job string
		rev membership.Revocation
	}
	// quorumWritten: the job's quorum record was written (or deleted) at
	// mod revision rev.
	quorumWritten struct {
		job     string
		rev     int64
		value   []byte
		deleted bool
	}
	// viewWritten: the job's quorum view was written (or deleted) at mod
	// revision rev.
	viewWritten struct {
		job     string
		rev     int64
		value   []byte
		deleted bool
	}
	// gossipDied: gossip declared a node dead.
	gossipDied struct{ node string }
	// probed: the verdict on a blamed member's port (see probe): dead when
	// it refused a connection; err is the last dial's (nil: it connected).
	probed struct {
		job, id string
		inc     int64
		dead    bool
		err     error
	}
	// claimed: a new incarnation of member id found its id held and asks
	// for the holder (claim.Incarnation) to be confirmed dead; rev is the
	// claim key's mod revision.
	claimed struct {
		job, id string
		claim   membership.Claim
		rev     int64
	}
	// settingsPut: the job's settings document was written (raw, as
	// stored).
	settingsPut struct {
		job string
		raw []byte
	}
	// tick: decide now, for every job with news or a timer due.
	tick struct{}
	// written: the answer to the write in flight. ok: the fenced write
	// passed (false with err nil: the fence refused it). rev is the
	// revision it was stored at, value the quorum record it wrote
	// (publish), err what went wrong when there was no answer (the write
	// may have been stored all the same).
	written struct {
		ok    bool
		rev   int64
		value []byte
		err   error
	}
)

func (loaded) isInput()        {}
func (recordPut) isInput()     {}
func (recordDeleted) isInput() {}
func (revocationPut) isInput() {}
func (quorumWritten) isInput() {}
func (viewWritten) isInput()   {}
func (gossipDied) isInput()    {}
func (probed) isInput()        {}
func (claimed) isInput()       {}
func (settingsPut) isInput()   {}
func (tick) isInput()          {}
func (written) isInput()       {}

// jobSnapshot is what the leader read of one job.
type jobSnapshot struct {
	members     []membership.MemberRecord
	quorum      *storedValue  // the quorum record (nil: no key)
	history     []storedValue // the history entries, oldest epoch first
	revocations []membership.Revocation
	settings    []byte    // the settings document (nil: none)
	claims      []claimed // claims not yet answered
}

// storedValue is a key's value with its mod revision.
type storedValue struct {
	value []byte
	rev   int64
}

// ---- actions ----

type action interface{ isAction() }

type (
	// publish writes a decision of the job's quorum rules in one
	// transaction, fenced by the leader key and by the quorum key's mod
	// revision (ifRev; 0: the key must not exist): the revocation, if
	// any, unless one of its epoch is stored; and the quorum, if any, as
	// its record, its view (a change of prev, carrying viewRev), the
	// whole view and a history entry. Answered by written.
	publish struct {
		job        string
		quorum     *membership.Quorum
		revocation *membership.Revocation
		prev       *membership.Quorum
		viewRev    *membership.Revocation
		ifRev      int64
		// settings is the document quorum.Settings names, for the view
		// to carry (nil: none, or not known to this leader).
		settings *membership.JobSettings
	}
	// restoreRecord writes value back as the job's quorum record, fenced
	// by the leader key and the foreign write's revision (ifRev).
	// Answered by written.
	restoreRecord struct {
		job   string
		value []byte
		ifRev int64
	}
	// deleteRecord deletes a foreign quorum record (ifRev as for
	// restoreRecord). Answered by written.
	deleteRecord struct {
		job   string
		ifRev int64
	}
	// deleteView deletes a foreign quorum view, fenced by the leader key.
	// Answered by written.
	deleteView struct{ job string }
	// probe dials a member that a peer blamed, at its address, and feeds
	// back probed.
	probe struct {
		job, id string
		inc     int64
		addr    string
	}
	// deleteClaim deletes an answered claim (if still at rev). Not
	// answered.
	deleteClaim struct {
		job, id string
		rev     int64
	}
	// deleteRegistration deletes a dead member's key, fenced by the
	// leader key and its incarnation, and revokes its lease unless the
	// lease is its group's; a restarted process may then register at
	// once. Not answered.
	deleteRegistration struct {
		job string
		rec membership.MemberRecord
	}
	// removed: a member's registration ended (log and count it).
	removed struct {
		job, id string
		removal quorum.Removal
	}
	// status is the leader's view of a job after a decision.
	status struct {
		job     string
		members int
		quorum  *membership.Quorum
		waiting string
		wakeAt  time.Time
		stalled int
		at      time.Time
		// target is the job's target size in replica groups; spares the
		// waiting spares, ready those of them asking to take part,
		// unusable the spare groups never promoted (all nil without
		// spares).
		target        int
		spares, ready []string
		unusable      []quorum.UnusableSpare
	}
	// observe: a metric of the job changed (counted: value 1).
	observe struct {
		what  metric
		job   string
		value float64
	}
	logLine struct {
		warn   bool
		msg    string
		fields []field
	}
	// notLeader: the fence refused a write: another instance leads.
	notLeader struct{ what string }
)

func (publish) isAction()            {}
func (restoreRecord) isAction()      {}
func (deleteRecord) isAction()       {}
func (deleteView) isAction()         {}
func (probe) isAction()              {}
func (deleteClaim) isAction()        {}
func (deleteRegistration) isAction() {}
func (removed) isAction()            {}
func (status) isAction()             {}
func (observe) isAction()            {}
func (logLine) isAction()            {}
func (notLeader) isAction()          {}

// metric names what an observe action measures.
type metric uint8

const (
	metricJoin    metric = iota // a new member incarnation (counted)
	metricForeign               // a foreign write of a quorum key (counted)
	metricQuorum                // a quorum published (counted)
	metricStalled               // members waiting for a holder of a committed step (gauge)
)

// field is one key and value of a log line.
type field struct {
	key   string
	value any
}

// machineConfig is what the machine needs of Config.
type machineConfig struct {
	name   string        // the instance's, for PublishedBy and a revocation's By
	quorum quorum.Config // the rules of every job
	// signed: quorums carry the leader's signature, so a member takes no
	// foreign record (see repair).
	signed bool
	// trust returns the quorum a record holds when the leader can trust
	// it: signed by its key (signed), or at least well-formed; always of
	// job.
	trust func(job string, raw []byte) (membership.Quorum, bool)
	// trustSettings returns the settings document raw holds when it is
	// the job's and a coordinator wrote it (signed by a trusted key, when
	// the leader signs).
	trustSettings func(job string, raw []byte) (membership.JobSettings, bool)
	// probeWait is how long a quorum waits for a probe's verdict.
	probeWait time.Duration
}

// machine is the leader's decisions for every job under its root. Not safe
// for concurrent use.
type machine struct {
	cfg    machineConfig
	jobs   map[string]*jobState
	byNode map[string]memberRef // gossip node name → member
	doomed []doomedMember       // registrations to delete at the end of the pass
	pass   *pass
	write  *inflight // the write awaiting its answer (nil: none)
	out    []action
}

type memberRef struct {
	job, id string
	inc     int64
}

type doomedMember struct {
	job string
	rec membership.MemberRecord
}

// jobState is what the leader knows of one job.
type jobState struct {
	m         *quorum.Machine
	quorumRev int64  // mod revision of the quorum key we last wrote or read (0: no key)
	ownRev    int64  // revision of our last write of the key, a deletion included
	lastValue []byte // the record we last wrote (or loaded and trusted)
	// unanswered is a record whose write failed without an answer:
	// seeing it in the watch means it was stored after all.
	unanswered  []byte
	unansweredQ membership.Quorum
	// foreign is a write of the quorum key by someone else, to repair.
	foreign *foreignWrite
	dirty   bool
	wakeAt  time.Time
	waiting string
	// holdUntil: a write of the job failed; it is tried again from then
	// (retry's next interval), not at the next pass: passes follow every
	// watch response, and under load (etcd answering "too many
	// requests") retrying a large record at once made the load worse.
	holdUntil time.Time
	retry     *backoff.ExponentialBackOff
	// stalled are the members that wait for a holder of a committed step
	// (MemberRecord.WaitingFor), by id.
	stalled map[string]bool
	// settings is the job's settings document in force (nil: none).
	settings *membership.JobSettings
	// unusable are the spare groups logged as never to be promoted,
	// group → why (noteUnusable).
	unusable map[string]string
}

// foreignWrite is a write of a job's quorum key that no leader made.
type foreignWrite struct {
	rev     int64  // its mod revision (0: the key was deleted); of the record when view
	epoch   uint64 // the epoch it claims, if readable
	deleted bool
	view    bool // a write of the view, not the record
}

// pass is one round of decisions: the jobs due when it began, in name
// order, each repaired, then decided, then reported.
type pass struct {
	now   time.Time
	jobs  []string
	next  int // the job being decided
	stage stage
}

// stage is where a pass is in the job it decides.
type stage uint8

const (
	stageRepair stage = iota // undo a foreign write of its quorum key
	stageDecide              // the quorum rules decide; publish
	stageReport              // report the job's status
)

// inflight is a write awaiting its answer.
type inflight struct {
	job     string
	publish *quorum.Decision // a publication
	foreign *foreignWrite    // a repair of this foreign write (with publish: by republishing)
	what    string           // a repair's log line on success
}

func newMachine(cfg machineConfig) *machine {
	return &machine{cfg: cfg, jobs: map[string]*jobState{}, byNode: map[string]memberRef{}}
}

// handle feeds one input to the machine and returns the actions to carry
// out, in order. The slice is reused by the next call.
func (m *machine) handle(now time.Time, in input) []action {
	m.out = m.out[:0]
	switch in := in.(type) {
	case loaded:
		m.load(now, in)
	case recordPut:
		m.upsert(now, in.job, in.rec)
	case recordDeleted:
		m.remove(now, in.job, in.id, in.inc, quorum.Removal{Cause: quorum.LeaseExpired})
	case revocationPut:
		j := m.job(in.job)
		j.m.Revoke(now, in.rev)
		j.dirty = true
		m.probeBlamed(now, in.job, in.rev)
	case quorumWritten:
		m.onQuorumWritten(in)
	case viewWritten:
		m.onViewWritten(in)
	case gossipDied:
		m.gossipDeath(now, in.node)
	case probed:
		m.onProbed(now, in)
	case claimed:
		m.onClaim(now, in)
	case settingsPut:
		m.onSettings(in)
	case tick:
		if m.pass == nil {
			m.startPass(now)
		}
	case written:
		m.onWritten(now, in)
	}
	m.run()
	return m.out
}

func (m *machine) do(a action) { m.out = append(m.out, a) }

func (m *machine) log(warn bool, msg string, fields ...field) {
	m.do(logLine{warn: warn, msg: msg, fields: fields})
}

func (m *machine) job(name string) *jobState {
	j, ok := m.jobs[name]
	if !ok {
		j = &jobState{m: quorum.NewMachine(name, m.cfg.quorum, nil)}
		m.jobs[name] = j
	}
	return j
}

// wake returns when a job's rules want to decide again without news (zero:
// never).
func (m *machine) wake() time.Time {
	var next time.Time
	for _, j := range m.jobs {
		at := j.wakeAt
		if j.holdUntil.After(at) && (j.dirty || !at.IsZero()) {
			at = j.holdUntil
		}
		if !at.IsZero() && (next.IsZero() || at.Before(next)) {
			next = at
		}
	}
	return next
}

// ---- what the leader learns ----

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

// onClaim answers a new incarnation's claim on its member id: the holder
// the claim names is probed like a blamed member, and a refused port ends
// its registration at once (onProbed), for a lease of its own as for its
// group's, so the new process registers without waiting for the lease.
// A claim on another incarnation (the holder went, or is newer) is only
// deleted.
func (m *machine) onClaim(now time.Time, c claimed) {
	m.do(deleteClaim{job: c.job, id: c.id, rev: c.rev})
	j := m.job(c.job)
	rec, ok := j.m.Member(c.id)
	if !ok || rec.Incarnation != c.claim.Incarnation || rec.Addr == "" {
		return
	}
	m.log(false, "a new process claims a member id; probing the holder", field{"job", c.job}, field{"member", c.id},
		field{"holder", rec.Incarnation}, field{"addr", rec.Addr}, field{"claimant", c.claim.By})
	j.m.Suspect(now, c.id, rec.Incarnation, now.Add(m.cfg.probeWait))
	m.do(probe{job: c.job, id: c.id, inc: rec.Incarnation, addr: rec.Addr})
}

// onSettings takes a job's settings document: one a coordinator wrote
// becomes the settings in force, and the job's next quorum carries it; any
// other is ignored (members verify the quorum that names it).
func (m *machine) onSettings(in settingsPut) {
	doc, ok := m.cfg.trustSettings(in.job, in.raw)
	if !ok {
		m.log(true, "settings document not written by a coordinator; ignored", field{"job", in.job})
		return
	}
	j := m.job(in.job)
	if j.settings != nil && j.settings.Version >= doc.Version {
		return
	}
	j.settings = &doc
	j.m.SetSettings(doc.Ref())
	j.m.SetTarget(targetReplicas(doc))
	on, set := doc.Bool(membership.SettingPreparedGrow)
	j.m.SetPreparedGrow(on || !set)
	j.dirty = true
	m.log(false, "job settings changed", field{"job", in.job}, field{"version", doc.Version}, field{"settings", doc.Summary()})
}

// targetReplicas is the job's target size in replica groups that its
// settings name (membership.SettingTargetReplicas; 0: unset, and the
// quorum rules use the most replica groups a quorum of the run had).
// Stored values are validated (JobSettings.Apply); one out of range all
// the same counts as unset.
func targetReplicas(doc membership.JobSettings) int {
	n, ok := doc.Int(membership.SettingTargetReplicas)
	if !ok || n < 1 || n > math.MaxInt32 {
		return 0
	}
	return int(n)
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
		f.epoch, _ = membership.QuorumRecordEpoch(w.value)
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
		f.epoch, _ = membership.QuorumRecordEpoch(w.value)
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

// noteUnusable logs each spare group that can never be promoted into the
// job (quorum.UnusableSpare) once, when it is first seen so or its reason
// changes; one that went or became usable is forgotten.
func (m *machine) noteUnusable(job string, j *jobState, us []quorum.UnusableSpare) {
	if len(us) == 0 && len(j.unusable) == 0 {
		return
	}
	seen := make(map[string]string, len(us))
	for _, u := range us {
		seen[u.Group] = u.Reason
		if why, ok := j.unusable[u.Group]; ok && why == u.Reason {
			continue
		}
		m.log(true, "spare group cannot be promoted into the job; it waits in vain", field{"job", job},
			field{"group", u.Group}, field{"members", u.Members}, field{"why", u.Reason})
	}
	j.unusable = seen
}

// ---- deciding: passes ----

// startPass begins a pass over the jobs with news or a timer due.
func (m *machine) startPass(now time.Time) {
	p := &pass{now: now}
	for name, j := range m.jobs {
		if now.Before(j.holdUntil) {
			continue // its write failed a moment ago: wake() brings it back
		}
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
			if d.Waiting != "" && waitKind(d.Waiting) != waitKind(j.waiting) && (d.WakeAt.IsZero() || !d.WakeAt.Before(p.now.Add(time.Second))) {
				m.log(false, "quorum waits", field{"job", name}, field{"why", d.Waiting})
			}
			j.wakeAt, j.waiting = d.WakeAt, d.Waiting
			if d.Quorum != nil || d.Revocation != nil {
				m.publish(name, j, d)
			}
		case stageReport:
			st := status{job: name, members: j.m.Len(), waiting: j.waiting, wakeAt: j.wakeAt, stalled: len(j.stalled), at: p.now,
				target: j.m.Target()}
			if q, ok := j.m.Current(); ok {
				st.quorum = &q
			}
			if n, _ := j.m.SpareCount(); n > 0 { // the lists cost what the spares are
				st.spares, st.ready = j.m.Spares()
				st.unusable = j.m.UnusableSpares()
			}
			m.noteUnusable(name, j, st.unusable)
			m.do(st)
			p.next, p.stage = p.next+1, stageRepair
		}
	}
}

// waitKind is what a quorum waits for, without its numbers (times left,
// steps): the log says when a job begins to wait and when what it waits
// for changes, not at every pass of a countdown — and not for the waits
// of less than a second that batch joins, losses and reports.
func waitKind(why string) string {
	return strings.Map(func(r rune) rune {
		if r >= '0' && r <= '9' || r == '.' {
			return -1
		}
		return r
	}, strings.NewReplacer("ms", "s", "µs", "s", "ns", "s").Replace(why))
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
		if st := j.settings; st != nil && q.Settings != nil && st.Ref() == *q.Settings {
			a.settings = st
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
			j.foreign, j.dirty = wr.foreign, true // try again after a pause
			j.hold(now)
		}
	case w.err != nil:
		j.foreign, j.dirty = wr.foreign, true
		j.hold(now)
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
		j.dirty = true // try again after a pause
		j.hold(now)
		m.log(true, "publish failed", field{"job", wr.job}, field{"error", w.err}, field{"retry_in", j.holdUntil.Sub(now)})
	case !w.ok:
		j.unanswered = nil
		m.refused(fmt.Sprintf("fenced write of job %s refused", wr.job))
	case d.Quorum != nil:
		j.released()
		j.quorumRev, j.ownRev, j.lastValue, j.unanswered = w.rev, w.rev, w.value, nil
		j.m.Published(*d.Quorum)
		if _, ready := j.m.SpareCount(); ready > 0 {
			// Spares are promoted in a quorum after a loss's own, once
			// the survivors hold it or FormMaxWait after it: only a
			// decision on the published quorum sets that timer, and
			// survivors that never report would leave none to set it.
			j.dirty = true
		}
		m.do(observe{what: metricQuorum, job: wr.job, value: 1})
		m.log(false, "quorum published", field{"job", wr.job}, field{"epoch", d.Quorum.Epoch},
			field{"participants", len(d.Quorum.Participants)}, field{"reason", d.Quorum.Reason})
	default:
		j.released()
		j.m.Revoke(now, *d.Revocation)
		m.log(false, "epoch revoked", field{"job", wr.job}, field{"epoch", d.Revocation.Epoch}, field{"reason", d.Revocation.Reason})
	}
}

// hold pauses the job's writes after a failed one: 50 ms, doubling up to
// 2 s while they keep failing.
func (j *jobState) hold(now time.Time) {
	if j.retry == nil {
		j.retry = &backoff.ExponentialBackOff{InitialInterval: 50 * time.Millisecond, Multiplier: 2,
			MaxInterval: 2 * time.Second, Clock: backoff.SystemClock}
		j.retry.Reset()
	}
	j.holdUntil = now.Add(j.retry.NextBackOff())
}

// released ends the pause: a write went through.
func (j *jobState) released() {
	j.holdUntil = time.Time{}
	if j.retry != nil {
		j.retry.Reset()
	}
}

// refused ends the pass: another instance leads.
func (m *machine) refused(what string) {
	m.pass = nil
	m.do(notLeader{what: what})
}
