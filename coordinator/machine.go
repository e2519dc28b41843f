package coordinator

import (
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership"
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
func (tick) isInput()          {}
func (written) isInput()       {}

// jobSnapshot is what the leader read of one job.
type jobSnapshot struct {
	members     []membership.MemberRecord
	quorum      *storedValue  // the quorum record (nil: no key)
	history     []storedValue // the history entries, oldest epoch first
	revocations []membership.Revocation
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
	// stalled are the members that wait for a holder of a committed step
	// (MemberRecord.WaitingFor), by id.
	stalled map[string]bool
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
		if !j.wakeAt.IsZero() && (next.IsZero() || j.wakeAt.Before(next)) {
			next = j.wakeAt
		}
	}
	return next
}
