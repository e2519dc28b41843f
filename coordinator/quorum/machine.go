package quorum

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// Machine is the quorum state machine of one job. It does no I/O and reads
// no clock: the caller feeds it inputs and the time, calls Advance, stores
// what Advance decided, and then calls Published. It is not safe for
// concurrent use.
//
// Rules (after torchft's lighthouse):
//   - A quorum is needed when there is none yet and someone asks to take
//     part, when the participants would change (a participant died, left,
//     was evicted, finished or turned Critical, or a rule below leaves it
//     out; a joiner asks in), or when the current epoch failed (a
//     participant reported a commit failure or revoked it).
//   - A participant that left (Cause.Orderly: Left) or finished the run went
//     after its last step: the quorum without it names it Departed and
//     does not revoke the epoch it leaves. Any other loss revokes it.
//   - Fast quorum: when every participant of the previous quorum is still
//     live and fit, the next quorum forms at once.
//   - Otherwise it needs at least MinReplicas candidates and a strict
//     majority of live fit members among those taking part (no split
//     brain), and waits up to JoinTimeout for live members that have not
//     asked yet.
//   - While a participant holds ShrinkOnly, joiners are not admitted.
//   - Replica groups (MemberRecord.GroupSize above 1) take part whole: the
//     ranks of a group with fewer ranks present (survivors and joiners)
//     than its size, or with a rank another rule leaves out, are left
//     out too. A group whose rank dies leaves with it, and the later death
//     of a group-mate (a launcher ending the rest of the group) is not a
//     participant's and breaks no epoch; a group rejoins once all its
//     ranks are back.
//   - Joins are batched: a quorum that would only admit joiners (no
//     participant lost, no failure) waits until no member registered or
//     asked for FormWindow, and at most FormMaxWait from when it was
//     first needed, doubled for each such quorum in a row that formed at
//     that bound (up to 8 times).
//   - Ranks: survivors keep their relative order, joiners follow sorted by
//     id. The epoch grows by one at every published quorum.
//   - Base: the previous epoch when every survivor reported holding its
//     communicators (MemberRecord.Formed), else 0 (see Quorum.Base).
//
// Rules for what torchft's lighthouse cannot see:
//   - The end of the run: a finished member (MemberRecord.Finished) is no
//     candidate and does not count among the live members; once one
//     finished, the next quorum is published at once, waiting for
//     nothing, and it and every later one of the run carry Final, the
//     highest step a member finished at. A quorum of a new run
//     (MemberRecord.Run, Quorum.Run) starts afresh: no Final, and no wait
//     for the last run's members (the history rule below).
//   - History: the job's last known step is the highest step the
//     previous quorum's participants reported, or its MaxStep. A
//     candidate holds it when it reported it, or when it is a caught-up
//     survivor (it reported a step at or above the MaxStep of a quorum it
//     took part in). A quorum in which no candidate holds it waits for the
//     previous participants that lapsed (Cause.Lapsed, or gone unseen before
//     this machine's first Advance) less than HolderGrace ago and held
//     more than the candidates: until each is back (a new incarnation of
//     it live, whatever its step) or its grace ends.
//   - Cuts: blame (MemberRecord.Blamed for a failed epoch, a member's
//     Revocation.Failed) says that two live members could not reach each
//     other. Among the candidates, those in no blame are kept; of the
//     others the largest set none of whom blames another stays and the
//     rest wait out the blame's hold, then join as joiners: until one of
//     the pair reports reaching the other again (MemberRecord.Reached) and
//     BlameMinHold has passed, or else BlameHold — both doubling each time
//     the pair fails again. The set that holds the
//     job's step wins, then the one with more survivors (a side that
//     trains on is not interrupted for joiners), then the larger, then
//     the one holding the highest reported step, then the one whose
//     sorted ids come first. A blame against a participant that reported nothing in
//     that epoch is not used here (the peer may be at fault, or it may be
//     silent: next rule).
//   - Silence: a participant blamed in SilentEpochs failed epochs in a row
//     in which it reported nothing (no commit failure, formed epoch,
//     revocation or step) is left out until it reports something.
//   - Stalls: a participant that reports its loop has not stepped
//     (MemberRecord.Stall, not Waiting) at the step a peer reports waiting
//     in (both past their own bounds, derived from the job's step times)
//     is left out at once, until it forms or sits out a later epoch (its
//     loop stepped again).
//   - Settings: every quorum carries the job's settings in force
//     (SetSettings); a new version forms an epoch at once, with the same
//     participants, revoking nothing.
//   - The run's step: every quorum carries the highest step the run is
//     known to have reached (RunStep), so that participants holding no
//     step of a run that reached one can refuse to restart its history.
//   - Stragglers (StragglerPolicy, off by default): a participant whose
//     reported step time stays above Factor times the median of the other
//     participants' for Window is left out — never so many that fewer than
//     MinReplicas or half the participants remain — and admitted again
//     when it reports keeping up, or after a probation (Probation,
//     doubling with each consecutive take-out) to be judged in the job.
type Machine struct {
	job     string
	cfg     Config
	members map[string]*membership.MemberRecord
	prev    *membership.Quorum

	pendingSince time.Time
	failedSince  time.Time              // when the current epoch's failure was first seen
	removed      map[string]departure   // previous participants gone since the last quorum
	suspects     map[string]suspicion   // reported dead by a peer, being verified
	revokedBy    *membership.Revocation // a revocation of the current epoch
	waited       bool                   // the last Advance decided to wait
	lastArrival  time.Time              // when a member last registered or asked to take part

	final    int64            // the highest step a member finished the run at
	finalRun string           // the run final belongs to
	caughtUp map[string]int64 // id → the incarnation that holds the job's step

	blame    map[blamePair]*blameEdge
	blamedIn map[string]uint64 // id → the newest epoch in which a peer blamed it
	active   map[string]uint64 // id → the newest epoch in which it reported anything
	silent   map[string]int    // id → failed epochs in a row it was blamed in and silent

	slow    map[string]*straggler // straggler policy state, by id
	stalled map[string]stallMark  // left out for a stall, until they show life

	settings *membership.SettingsRef // the job's settings (SetSettings)

	formBound  bool // the quorum Advance decided only admits joiners, at its bound while joins still arrive (formWait)
	formStreak int  // published quorums in a row like that (formWait)

	lossEpochAt time.Time // when the newest loss a published quorum dropped happened (lossWait)
	lossBurst   int       // how many the published quorums of the current burst of losses dropped (lossWait)

	agg aggregates // what decisions need of every member, kept as records change (aggregates.go)

	pol *membership.StragglerPolicy // the job's straggler policy, nil until policy computes it again

	// Spares (spares.go).
	target int // the job's setting (SetTarget); 0: natural
	// noPrepared: the job's settings turned prepared grows off (SetPreparedGrow).
	noPrepared bool
	natural    int                 // the most replica groups a quorum of the run had
	promoted   map[string]int64    // spares promoted for the next quorum: id → incarnation
	replaced   map[string]struct{} // groups whose new processes wait as spares
	vacant     []vacancy           // groups lost and not refilled, oldest first
}

// setPrev makes q the previous quorum, with its index: the rules ask
// whether a member took part once per member, which a scan of 100,000
// participants made quadratic.
func (m *Machine) setPrev(q *membership.Quorum) {
	m.prev = q
	m.rebuild()
}

// departure is how a previous participant went.
type departure struct {
	why     string
	at      time.Time
	lapsed  bool  // its process may be alive and come back holding its state
	left    bool  // it went in an orderly way (Cause.Orderly), after its last step
	step    int64 // its last reported step
	unknown bool  // it went while no coordinator watched: its step is unknown
	host    string
}

type suspicion struct {
	inc   int64
	until time.Time
}

// NewMachine returns the machine of a job whose last published quorum is
// prev (nil: none yet). A participant of prev that is not live when
// Advance first runs counts as lapsed then: it may have gone while no
// coordinator watched.
func NewMachine(job string, cfg Config, prev *membership.Quorum) *Machine {
	m := &Machine{job: job, cfg: cfg, members: map[string]*membership.MemberRecord{}, removed: map[string]departure{},
		suspects: map[string]suspicion{}, caughtUp: map[string]int64{}, blame: map[blamePair]*blameEdge{},
		blamedIn: map[string]uint64{}, active: map[string]uint64{}, silent: map[string]int{}, slow: map[string]*straggler{},
		stalled: map[string]stallMark{}, agg: newAggregates()}
	if prev != nil {
		q := *prev
		m.setPrev(&q)
		m.final, m.finalRun = q.Final, q.Run
		m.settings = q.Settings
		m.natural = max(q.Target, replicasOf(q.Participants))
		if len(q.Replaced) > 0 {
			m.replaced = map[string]struct{}{}
			for _, g := range q.Replaced {
				m.replaced[g] = struct{}{}
			}
		}
	}
	return m
}

// SetSettings records the job's settings document in force from now (its
// version and digest): the next quorum carries it (Quorum.Settings), and
// a version the current epoch does not carry forms one at once, with the
// same participants when all are fit, without revoking the epoch (the
// step in flight commits; every participant takes the new settings from
// the next epoch's first step).
func (m *Machine) SetSettings(ref membership.SettingsRef) {
	if m.settings == nil || *m.settings != ref {
		r := ref
		m.settings = &r
	}
}

// Decision is what Advance decided.
type Decision struct {
	// Quorum to publish now; nil when none.
	Quorum *membership.Quorum
	// Revocation of the current epoch to store (with Quorum when there is
	// one, else alone: the epoch is broken and its successor must wait).
	// Advance offers it again until Revoke or Published reports it
	// stored.
	Revocation *membership.Revocation
	// Waiting says why a needed quorum has not formed ("" when none is
	// needed or one was decided).
	Waiting string
	// WakeAt is when Advance should run again even without new input
	// (zero: only on new input).
	WakeAt time.Time
}

// Upsert records a member's registration or any change of its record: a
// join, a heartbeat (step, health, step time), a quorum request
// (WantQuorum, ShrinkOnly), a commit failure (CommitFailed, Blamed), a
// formed epoch or the end of its run (Finished). A record with a new
// incarnation replaces the old one, which thereby has died. It reports
// whether the change may alter Advance's decision (a heartbeat that only
// moves the step usually cannot).
func (m *Machine) Upsert(now time.Time, rec membership.MemberRecord) bool {
	old, had := m.members[rec.ID]
	if had && old.Incarnation > rec.Incarnation {
		return false // a stale record of an older incarnation
	}
	r := rec
	m.members[rec.ID] = &r
	m.track(r.ID, old, &r) // old: nil when it had no record
	if !had && r.Stragglers != nil || had && !samePolicy(old.Stragglers, r.Stragglers) {
		m.pol = nil // the job's straggler policy may change (policy)
	}
	if s, ok := m.suspects[rec.ID]; ok && s.inc != rec.Incarnation {
		delete(m.suspects, rec.ID)
	}
	if r.Finished {
		if r.Run != "" && r.Run != m.finalRun {
			m.final, m.finalRun = r.Step, r.Run
		} else {
			m.final = max(m.final, r.Step)
		}
	}
	if !had || old.Incarnation != r.Incarnation {
		m.forget(r.ID) // a new incarnation starts afresh
		delete(m.promoted, r.ID)
		m.observe(now, nil, &r)
		if !m.waitingSpare(&r) { // a spare's arrival batches nothing
			m.lastArrival = now
		}
		return true
	}
	if r.WantQuorum && !old.WantQuorum && !m.waitingSpare(&r) {
		m.lastArrival = now
	}
	wasSilent := m.silent[r.ID] > 0
	_, wasStalled := m.stalled[r.ID]
	m.observe(now, old, &r)
	switch {
	case old.Health != r.Health, old.WantQuorum != r.WantQuorum, old.ShrinkOnly != r.ShrinkOnly,
		old.CommitFailed != r.CommitFailed, !slices.Equal(old.Blamed, r.Blamed), old.MinReplicas != r.MinReplicas,
		old.Finished != r.Finished, !samePolicy(old.Stragglers, r.Stragglers), !sameStall(old.Stall, r.Stall),
		!maps.Equal(old.Reached, r.Reached):
		return true
	case old.Formed != r.Formed && (len(m.blame) > 0 || wasSilent || wasStalled || len(m.agg.ready) > 0):
		// It may clear a blame, be a silent or stalled member's sign of
		// life, or the last survivor holding the epoch a spare waits for
		// (promote); otherwise it only sets the next quorum's Base.
		return true
	case old.Step != r.Step && (m.waited || wasSilent):
		// The step matters to a quorum waiting for the job's step, and
		// as a sign of life from a member left out for its silence.
		return true
	case old.StepTime != r.StepTime && policyOn(m.policy()):
		return true
	}
	return false
}

// observe learns from a member's new record (old is nil for a new
// incarnation): whether it holds the job's step, signs of life, blame,
// and epochs formed together.
func (m *Machine) observe(now time.Time, old, r *membership.MemberRecord) {
	var epoch uint64
	inPrev := false
	if m.prev != nil {
		epoch = m.prev.Epoch
		inPrev = m.inPrev(r.ID, r.Incarnation)
	}
	if inPrev && r.Step >= m.prev.MaxStep {
		m.caughtUp[r.ID] = r.Incarnation
	}
	if old == nil {
		return
	}
	if r.Formed != old.Formed || r.CommitFailed != old.CommitFailed || r.Step > old.Step {
		m.active[r.ID] = max(m.active[r.ID], epoch)
		delete(m.silent, r.ID)
	}
	if s := r.Stall; s != nil && s.Waiting && !sameStall(old.Stall, s) {
		// A member waiting in its step's collectives is in the step: a
		// sign of life, whoever it waits for.
		m.active[r.ID] = max(m.active[r.ID], s.Epoch)
		delete(m.silent, r.ID)
	}
	m.stallEnded(r)
	if r.CommitFailed != 0 && len(r.Blamed) > 0 && (r.CommitFailed != old.CommitFailed || !slices.Equal(r.Blamed, old.Blamed)) {
		m.addBlame(now, r.CommitFailed, r.ID, r.Blamed)
	}
	for id, e := range r.Reached {
		if old.Reached[id] != e {
			m.reached(now, r.ID, id, e)
		}
	}
	if inPrev && r.Formed == epoch && old.Formed != epoch {
		m.formedTogether(r.ID)
	}
}

// forget drops what the machine learnt about an incarnation of id.
func (m *Machine) forget(id string) {
	delete(m.caughtUp, id)
	delete(m.active, id)
	delete(m.silent, id)
	delete(m.blamedIn, id)
	delete(m.slow, id)
	delete(m.stalled, id)
	m.forgetBlame(id)
}

func sameStall(a, b *membership.StepStall) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}

// Remove records the end of incarnation inc of member id (0 matches any;
// an older incarnation's end is ignored) and why: the rules follow its
// cause (see Cause), and the next quorum's Reason names it.
func (m *Machine) Remove(now time.Time, id string, inc int64, r Removal) {
	m.remove(now, id, inc, departure{why: r.String(), lapsed: r.Cause.Lapsed(), left: r.Cause.Orderly()})
}

// remove ends a member's registration; a participant of the previous
// quorum is recorded as departed (d, with its time and last step).
func (m *Machine) remove(now time.Time, id string, incarnation int64, d departure) {
	old, ok := m.members[id]
	if !ok || incarnation != 0 && old.Incarnation != incarnation {
		return
	}
	delete(m.members, id)
	if old.Stragglers != nil {
		m.pol = nil
	}
	delete(m.suspects, id)
	m.forget(id)
	if _, inPrev := m.agg.prevPos[id]; inPrev {
		if _, seen := m.removed[id]; !seen {
			d.at, d.step, d.host = now, old.Step, old.Host
			m.removed[id] = d
		}
	}
	m.track(id, old, nil)
	delete(m.promoted, id)
}

// Suspect records that a peer reported incarnation inc of member id dead
// and the coordinator is checking (until at the latest): a quorum that
// would keep it waits for the verdict rather than form an epoch that the
// verdict may end at once — one epoch per death instead of two.
func (m *Machine) Suspect(now time.Time, id string, inc int64, until time.Time) {
	if r, ok := m.members[id]; ok && r.Incarnation == inc {
		m.suspects[id] = suspicion{inc, until}
	}
}

// Unsuspect records that the check of id found it alive (or could not
// tell): quorums may keep it again.
func (m *Machine) Unsuspect(id string, inc int64) {
	if s, ok := m.suspects[id]; ok && s.inc == inc {
		delete(m.suspects, id)
	}
}

// Revoke records a stored revocation (a member's, or one Advance offered).
// A revoked epoch can never be used again, so revoking the current epoch
// forces the next one (like a commit failure); older epochs are over. A
// member's revocation is also a sign of its life and carries its blame.
func (m *Machine) Revoke(now time.Time, r membership.Revocation) {
	if m.prev != nil && r.Epoch == m.prev.Epoch && m.revokedBy == nil {
		rr := r
		m.revokedBy = &rr
	}
	if _, member := m.members[r.By]; member && m.prev != nil && r.Epoch == m.prev.Epoch {
		m.active[r.By] = max(m.active[r.By], r.Epoch)
		delete(m.silent, r.By)
		m.addBlame(now, r.Epoch, r.By, r.Failed)
	}
}

// Revocation returns the stored revocation of the current epoch, if one
// was recorded (Revoke).
func (m *Machine) Revocation() (membership.Revocation, bool) {
	if m.revokedBy == nil {
		return membership.Revocation{}, false
	}
	return *m.revokedBy, true
}

// Member returns the record of member id, if live.
func (m *Machine) Member(id string) (membership.MemberRecord, bool) {
	r, ok := m.members[id]
	if !ok {
		return membership.MemberRecord{}, false
	}
	return *r, true
}

// Len returns the number of live members.
func (m *Machine) Len() int { return len(m.members) }

// Current returns the last published quorum.
func (m *Machine) Current() (membership.Quorum, bool) {
	if m.prev == nil {
		return membership.Quorum{}, false
	}
	return *m.prev, true
}

// Published tells the machine that q was stored: it becomes the previous
// quorum of the next decision.
func (m *Machine) Published(q membership.Quorum) {
	if old := m.prev; old != nil {
		// Silence is counted per epoch that ended. The blame that named a
		// silent member said it was silent, not that a link failed: it
		// must not keep the member out once it shows life. (Only members
		// blamed or silent can count: those are walked, not every
		// participant.)
		e := old.Epoch
		silentNow := func(id string) bool { return m.blamedIn[id] == e && m.active[id] < e }
		for id := range m.silent {
			if _, in := m.agg.prevPos[id]; in && !silentNow(id) {
				delete(m.silent, id)
			}
		}
		for id := range m.blamedIn {
			if i, in := m.agg.prevPos[id]; in && silentNow(id) {
				if r, ok := m.members[id]; ok && r.Incarnation == old.Participants[i].Incarnation {
					m.silent[id]++
					m.forgetBlame(id)
				}
			}
		}
		m.stragglersPublished(*old, q)
	}
	if m.formBound {
		m.formStreak++
	} else {
		m.formStreak = 0
	}
	m.formBound = false
	m.vacant, _ = m.sparesNext(m.prev, &q)
	m.replaced = nil
	if len(q.Replaced) > 0 {
		m.replaced = map[string]struct{}{}
		for _, g := range q.Replaced {
			m.replaced[g] = struct{}{}
		}
	}
	if m.prev != nil && q.Run != "" && m.prev.Run != "" && q.Run != m.prev.Run {
		m.natural = 0 // a new run: its own size
	}
	m.natural = max(m.natural, q.Target, replicasOf(q.Participants))
	qq := q
	m.setPrev(&qq)
	for id, inc := range m.promoted {
		if m.inPrev(id, inc) {
			delete(m.promoted, id)
		}
	}
	// When the newest loss this quorum drops happened, and how many the
	// burst it belongs to dropped (lossWait): the departures recorded are
	// the old quorum's participants'.
	var first, newest time.Time
	dropped := 0
	for id, d := range m.removed {
		if _, kept := m.agg.prevPos[id]; !kept && !d.at.IsZero() {
			dropped++
			if first.IsZero() || d.at.Before(first) {
				first = d.at
			}
			newest = maxTime(newest, d.at)
		}
	}
	if dropped > 0 {
		if _, bound := m.lossBounds(m.lossBurst + dropped); m.lossEpochAt.IsZero() || first.Sub(m.lossEpochAt) > bound {
			m.lossBurst = 0 // a new burst
		}
		m.lossBurst += dropped
		m.lossEpochAt = maxTime(m.lossEpochAt, newest)
	}
	if q.Run != "" && q.Run != m.finalRun {
		m.final, m.finalRun = q.Final, q.Run // a new run
	} else {
		m.final = max(m.final, q.Final)
	}
	for _, p := range q.Participants {
		if r, ok := m.members[p.ID]; ok && r.Incarnation == p.Incarnation && r.Step >= q.MaxStep && m.caughtUp[p.ID] != p.Incarnation {
			m.caughtUp[p.ID] = p.Incarnation
		}
	}
	m.pendingSince, m.failedSince = time.Time{}, time.Time{}
	clear(m.removed)
	m.revokedBy = nil
}

func fit(r *membership.MemberRecord) bool { return r.Health != membership.Critical }

// eligible: a member that may take part (fit, and its run not finished).
func eligible(r *membership.MemberRecord) bool { return fit(r) && !r.Finished }

// Advance decides whether a new quorum forms now.
func (m *Machine) Advance(now time.Time) Decision {
	d := m.advance(now)
	m.waited = d.Quorum == nil && d.Waiting != ""
	return d
}

func (m *Machine) advance(now time.Time) Decision {
	m.formBound = false
	// What changed since the previous quorum comes from the aggregates
	// (aggregates.go); the whole list is walked only to publish a quorum
	// or where a rule needs it (stragglers on, a blame between
	// candidates, a loss that waits for a holder of the job's step).
	lost := m.lostInOrder() // previous participants not surviving
	spareAt := m.promote(now, lost, m.prev != nil && (len(m.agg.failed) > 0 || m.revokedBy != nil))
	var (
		departed  []string // those of lost that left or finished in an orderly way
		finishing bool     // one of them finished the run
		nSurv     int      // survivors: previous participants still live and eligible
	)
	if m.prev != nil {
		nSurv = len(m.prev.Participants) - len(lost)
		for _, id := range lost {
			p := m.prev.Participants[m.agg.prevPos[id]]
			r, ok := m.members[id]
			finished := ok && r.Incarnation == p.Incarnation && r.Finished
			finishing = finishing || finished
			if d, gone := m.removed[id]; finished || gone && d.left {
				departed = append(departed, id)
			}
			if !ok {
				if _, seen := m.removed[id]; !seen {
					// Gone before this machine knew it: while no
					// coordinator watched.
					m.removed[id] = departure{why: "gone", at: now, lapsed: true, step: max(p.Step, m.prev.MaxStep), unknown: true}
				}
			}
		}
	}
	admitting := m.agg.shrinking == 0 // while a survivor holds ShrinkOnly, joiners wait
	asking := nSurv + len(m.agg.joining)
	fitLive := m.agg.eligible
	epochFailed := false
	var failedBy []string
	if m.prev != nil {
		for id := range m.agg.failed {
			failedBy = append(failedBy, id)
		}
		slices.Sort(failedBy)
		epochFailed = len(failedBy) > 0 || m.revokedBy != nil
	}

	// The lists of survivors (in the previous quorum's order) and
	// joiners (by id), made when needed.
	var survivors, joiners []membership.Participant
	listed := false
	lists := func() ([]membership.Participant, []membership.Participant) {
		if !listed {
			survivors, joiners, listed = m.survivorList(), nil, true
			if admitting {
				joiners = m.joinerList()
			}
		}
		return survivors, joiners
	}

	// Who is left out, and why: stragglers, silent members, cut-off sides.
	var wakeAt time.Time
	wake := func(t time.Time) {
		if !t.IsZero() && (wakeAt.IsZero() || t.Before(wakeAt)) {
			wakeAt = t
		}
	}
	wake(spareAt)
	out := map[string]string{}
	// candidate: a survivor or an admitted joiner, not left out, whose
	// replica group is all present.
	candidate := func(id string) bool {
		if _, o := out[id]; o || m.inShortGroup(id) {
			return false
		}
		if m.survives(id) {
			return true
		}
		_, j := m.agg.joining[id]
		return admitting && j
	}
	// Once the run ended nobody takes another step: every live member is
	// told, whatever rule kept it out (a replica behind heals to the end).
	ended := false
	if m.final > 0 {
		runAll := m.runOfCandidates(candidate)
		ended = runAll == "" || m.finalRun == "" || runAll == m.finalRun
	}
	if !ended {
		if m.prev != nil && policyOn(m.policy()) {
			s, j := lists()
			wake(m.stragglers(now, s, j, out))
		}
		m.silence(admitting, out)
		m.stalls(candidate, out)
	}
	keep := func(ps []membership.Participant) []membership.Participant {
		if len(out) == 0 && len(m.agg.short) == 0 {
			return ps
		}
		var k []membership.Participant
		for _, p := range ps {
			if _, o := out[p.ID]; !o && !m.inShortGroup(p.ID) {
				k = append(k, p)
			}
		}
		return k
	}
	var js jobStep
	js.step, js.unknown = m.lastStep()
	if !ended && m.blameBetween(now, candidate) {
		s, j := lists()
		wake(m.cut(now, keep(s), keep(j), js, out))
	}
	m.wholeGroups(out)
	var dropped []string // survivors left out
	nAdmitted := 0
	if admitting {
		nAdmitted = len(m.agg.joining) - m.agg.shortJoin
	}
	for id := range out {
		if m.survives(id) {
			dropped = append(dropped, id)
		} else if _, j := m.agg.joining[id]; j && admitting && !m.inShortGroup(id) {
			nAdmitted--
		}
	}
	m.sortByRank(dropped)
	nCandidates := nSurv - len(dropped) + nAdmitted

	// A new run (its members never share a quorum with the last run's)
	// starts afresh: no Final, no wait for the last run's members.
	runKnown, run := false, ""
	runOf := func() string {
		if !runKnown {
			runKnown, run = true, m.runOfCandidates(candidate)
			if run == "" && m.prev != nil {
				run = m.prev.Run // no candidate says (none left, say): the run goes on
			}
		}
		return run
	}
	newRun := m.prev != nil && m.prev.Run != "" && runOf() != m.prev.Run
	final := m.final
	if final > 0 && m.finalRun != "" && runOf() != "" && runOf() != m.finalRun {
		final = 0
	}
	finalNew := final > 0 && (m.prev == nil || newRun || final > m.prev.Final)
	var finalFrom []string
	if final > 0 {
		finalFrom = m.finalSources(final, runOf())
	}
	settingsNew := m.settings != nil && (m.prev == nil || m.prev.Settings == nil || *m.prev.Settings != *m.settings)
	needed := false
	switch {
	case m.prev == nil:
		needed = nAdmitted > 0 || finalNew
	default:
		needed = len(lost) > 0 || len(dropped) > 0 || nAdmitted > 0 || epochFailed || finalNew || settingsNew ||
			final > 0 && !slices.Equal(finalFrom, m.prev.FinalFrom) && nCandidates > 0
	}
	if !needed {
		m.pendingSince = time.Time{}
		return Decision{WakeAt: wakeAt}
	}
	if m.pendingSince.IsZero() {
		m.pendingSince = now
	}
	fast := m.prev != nil && len(lost) == 0 && len(dropped) == 0

	// Why the current epoch ends, for people and for the revocation.
	reasons := func() []string {
		var why []string
		if m.prev == nil {
			return append(why, "initial quorum")
		}
		for _, id := range lost {
			reason, ok := m.removed[id]
			if ok {
				why = append(why, fmt.Sprintf("%s %s", id, reason.why))
				continue
			}
			r, live := m.members[id]
			switch {
			case live && r.Finished:
				why = append(why, fmt.Sprintf("%s finished at step %d", id, r.Step))
			case live && !fit(r):
				w := id + " critical"
				if r.HealthReason != "" {
					w += ": " + r.HealthReason
				}
				why = append(why, w)
			case live:
				why = append(why, id+" restarted")
			default:
				why = append(why, id+" gone")
			}
		}
		for _, id := range dropped {
			why = append(why, id+" "+out[id])
		}
		if len(failedBy) > 0 {
			why = append(why, fmt.Sprintf("commit failed in epoch %d (%s)", m.prev.Epoch, strings.Join(failedBy, ",")))
		}
		if m.revokedBy != nil && len(why) == 0 {
			why = append(why, fmt.Sprintf("epoch %d revoked by %s: %s", m.prev.Epoch, m.revokedBy.By, m.revokedBy.Reason))
		}
		return why
	}
	ending := func(why []string) []string {
		if finalNew {
			why = append(why, fmt.Sprintf("the run ended at step %d", final))
		}
		if settingsNew && m.prev != nil {
			why = append(why, fmt.Sprintf("settings version %d", m.settings.Version))
		}
		return why
	}
	// Revoke a broken epoch at once, even when its successor must wait:
	// members stop their collectives instead of waiting out a timeout. An
	// epoch that only gains joiners is not broken: its step in flight may
	// finish, and members grow at their next step.
	// Members that left or finished after their last step break nothing:
	// a peer still ending that step must not have it revoked under it.
	gone := append(lost[:len(lost):len(lost)], dropped...)
	var failed []string
	for _, id := range gone {
		if !slices.Contains(departed, id) {
			failed = append(failed, id)
		}
	}
	var rev *membership.Revocation
	if m.prev != nil && m.revokedBy == nil && len(failed)+len(failedBy) > 0 {
		rev = &membership.Revocation{Epoch: m.prev.Epoch, Reason: strings.Join(ending(reasons()), "; "), Failed: failed, At: now}
	}
	wait := func(w string, at time.Time) Decision {
		wake(at)
		return Decision{Waiting: w, WakeAt: wakeAt, Revocation: rev}
	}

	if !finalNew && !finishing { // the end of the run waits for nothing
		// A failure with everyone alive: more reports (a blame) may follow,
		// also while a joiner asks in (a member left out by blame asks on:
		// deciding on the first report would admit it again).
		if epochFailed && len(lost) == 0 && m.cfg.FailureSettle > 0 {
			if m.failedSince.IsZero() {
				m.failedSince = now
			}
			if settled := m.failedSince.Add(m.cfg.FailureSettle); now.Before(settled) {
				return wait(fmt.Sprintf("epoch %d failed; waiting %v for more reports", m.prev.Epoch, settled.Sub(now).Round(time.Millisecond)), settled)
			}
			// A participant that a peer blamed and that has not reported
			// yet: its own report (whom it could not reach) completes the
			// picture of a cut. A silent one never sends it.
			if until := m.failedSince.Add(blamedReportWait * m.cfg.FailureSettle); now.Before(until) {
				var unheard []string
				for id := range m.blamedIn {
					if m.survives(id) && m.silentIn(id, m.prev.Epoch) {
						unheard = append(unheard, id)
					}
				}
				if len(unheard) > 0 {
					slices.Sort(unheard)
					return wait(fmt.Sprintf("epoch %d failed; waiting up to %v for a report from %s, blamed by a peer",
						m.prev.Epoch, until.Sub(now).Round(time.Millisecond), strings.Join(unheard, ",")), until)
				}
			}
		}
		// Losses still arriving: wait for the rest (bounded), so that many
		// deaths at once cost one epoch or two.
		if w, at := m.lossWait(now, lost); w != "" {
			return wait(w, at)
		}
		// A survivor a peer reported dead is being checked: wait for the
		// verdict (bounded) instead of forming an epoch it may end at once.
		var checkAt time.Time
		var checking []string
		for id, s := range m.suspects {
			if _, o := out[id]; o || !m.survives(id) || m.members[id].Incarnation != s.inc || !now.Before(s.until) {
				continue
			}
			checking = append(checking, id)
			if checkAt.IsZero() || s.until.Before(checkAt) {
				checkAt = s.until
			}
		}
		if len(checking) > 0 {
			slices.Sort(checking)
			return wait("verifying the reported death of "+strings.Join(checking, ","), checkAt)
		}
		if !fast {
			s, j := lists()
			if w, at := m.awaitHolders(now, append(keep(s), keep(j)...), js); w != "" && !newRun {
				return wait(w, at)
			}
			if minN := m.minReplicas(); nCandidates < minN {
				return wait(fmt.Sprintf("%d of %d replicas needed (min_replicas)", nCandidates, minN), time.Time{})
			}
			if asking*2 <= fitLive {
				return wait(fmt.Sprintf("%d of %d live members take part: not a strict majority", asking, fitLive), time.Time{})
			}
			if asking < fitLive {
				if deadline := m.pendingSince.Add(m.cfg.JoinTimeout); now.Before(deadline) {
					return wait(fmt.Sprintf("waiting up to %v for %d straggler(s)", deadline.Sub(now).Round(time.Millisecond), fitLive-asking), deadline)
				}
			}
		}
		if nAdmitted > 0 && len(gone) == 0 && !epochFailed {
			if w, at := m.formWait(now); w != "" {
				return wait(w, at)
			}
		}
	}

	s, j := lists()
	survivors, admitted := keep(s), keep(j)
	candidates := append(survivors[:len(survivors):len(survivors)], admitted...)
	q := &membership.Quorum{Job: m.job, Epoch: 1, Participants: candidates, Created: now, Removed: gone, Departed: departed, Final: final,
		FinalFrom: finalFrom, Run: runOf(), Settings: m.settings}
	if m.prev != nil {
		q.Epoch = m.prev.Epoch + 1
		if !newRun {
			q.RunStep = max(m.prev.RunStep, js.step)
		}
	}
	for _, p := range candidates {
		q.MaxStep = max(q.MaxStep, p.Step)
	}
	for _, p := range admitted {
		q.Added = append(q.Added, p.ID)
	}
	q.Promoted = m.promotedIn(q)
	q.Target = replicasOf(candidates)
	if !newRun {
		q.Target = max(q.Target, m.natural)
	}
	_, q.Replaced = m.sparesNext(m.prev, q)
	if m.prev != nil && len(survivors) > 0 && !slices.ContainsFunc(survivors, func(p membership.Participant) bool {
		return m.members[p.ID].Formed != m.prev.Epoch
	}) {
		q.Base = m.prev.Epoch
	}
	q.Prepared = m.prepared(q, survivors, admitted, len(gone) > 0 || len(departed) > 0 || epochFailed || finalNew || settingsNew || newRun)
	why := ending(reasons())
	if joined := q.Added; len(joined) > len(q.Promoted) && m.prev != nil {
		if len(q.Promoted) > 0 {
			joined = slices.DeleteFunc(slices.Clone(joined), func(id string) bool { return slices.Contains(q.Promoted, id) })
		}
		why = append(why, joinedWhy(joined))
	}
	if len(q.Promoted) > 0 {
		why = append(why, spareWhy(q.Promoted, slices.DeleteFunc(slices.Clone(q.Replaced), func(g string) bool { return slices.Contains(m.prev.Replaced, g) })))
	}
	q.Reason = strings.Join(why, "; ")
	if rev != nil {
		rev.Reason = q.Reason
	}
	// A quorum that only admits joiners while they still arrive formed at
	// its bound: the next such one may wait longer (formWait).
	m.formBound = nAdmitted > 0 && len(gone) == 0 && !epochFailed && !finalNew && !settingsNew &&
		m.cfg.formWindow() > 0 && now.Before(m.lastArrival.Add(m.cfg.formWindow()))
	return Decision{Quorum: q, Revocation: rev, WakeAt: wakeAt}
}

// prepared says whether q only adds whole replica groups to the previous
// epoch, every participant of which continues with the comms it formed
// (Quorum.Prepared): its survivors may form q's comms in the background
// and move to them at a step they agree on, instead of stopping for the
// joiners. changed says that something else moved at q (a loss, a
// failed epoch, the run's end, new settings, a new run): those take
// effect at q's first step.
func (m *Machine) prepared(q *membership.Quorum, survivors, admitted []membership.Participant, changed bool) bool {
	if changed || m.noPrepared || m.prev == nil || q.Base != m.prev.Epoch || len(admitted) == 0 ||
		!slices.EqualFunc(survivors, m.prev.Participants, func(a, b membership.Participant) bool {
			return a.ID == b.ID && a.Incarnation == b.Incarnation
		}) {
		return false
	}
	// A joiner beside a survivor of its own group changes that group's
	// comms: not a grow of the others'. And a joiner whose group is not
	// complete sits out: unless some group comes in whole, no FT comm
	// grows.
	whole := false
	for _, j := range admitted {
		if j.Group != "" && slices.ContainsFunc(survivors, func(s membership.Participant) bool { return s.Group == j.Group }) {
			return false
		}
		r := m.members[j.ID]
		whole = whole || r == nil || !grouped(r) ||
			r.GroupSize == countFunc(admitted, func(o membership.Participant) bool { return o.Group == r.Group })
	}
	return whole
}

func countFunc[T any](s []T, f func(T) bool) int {
	n := 0
	for _, v := range s {
		if f(v) {
			n++
		}
	}
	return n
}

// wholeGroups leaves out the survivors of a replica group that lost a rank
// (or is still missing one), and the survivors and joiners of a group one
// of whose ranks another rule left out: a group takes part whole. The
// joiners of a group not all present are passed over where they are
// counted (shortJoin, inShortGroup), not listed here: a forming job has
// many such groups at once.
func (m *Machine) wholeGroups(out map[string]string) {
	if len(m.agg.shortSurv) == 0 && len(out) == 0 {
		return
	}
	why := map[string]string{} // group → why its ranks are left out
	for g := range m.agg.shortSurv {
		t := m.agg.groups[g]
		why[g] = fmt.Sprintf("group %s incomplete (%d of its %d ranks)", g, t.surv+t.join, t.size())
	}
	for id := range out {
		if r := m.members[id]; r != nil && grouped(r) {
			if _, seen := why[r.Group]; !seen {
				why[r.Group] = fmt.Sprintf("group %s incomplete (%s left out)", r.Group, id)
			}
		}
	}
	for g, w := range why {
		for id := range m.agg.groups[g].ids {
			if _, o := out[id]; o {
				continue
			}
			if _, j := m.agg.joining[id]; j || m.survives(id) {
				out[id] = w
			}
		}
	}
}

// maxJoinedNamed is how many joiners a quorum's Reason names: the rest
// are counted (a job growing by 50,000 ranks named every one, 400 KB of
// reason per epoch in the coordinator's log; Quorum.Added lists them all).
const maxJoinedNamed = 16

// joinedWhy is the reason's part for the joiners added.
func joinedWhy(added []string) string {
	if len(added) <= maxJoinedNamed {
		return "joined " + strings.Join(added, ",")
	}
	return fmt.Sprintf("joined %s and %d more", strings.Join(added[:maxJoinedNamed], ","), len(added)-maxJoinedNamed)
}

// participant is what a quorum holds of a member.
func participant(r *membership.MemberRecord) membership.Participant {
	return membership.Participant{ID: r.ID, Addr: r.Addr, Group: r.Group, Step: r.Step, Incarnation: r.Incarnation}
}

// survivorList is the survivors, in the previous quorum's order.
func (m *Machine) survivorList() []membership.Participant {
	if m.prev == nil {
		return nil
	}
	out := make([]membership.Participant, 0, len(m.prev.Participants)-len(m.agg.lost))
	for _, p := range m.prev.Participants {
		if _, l := m.agg.lost[p.ID]; !l {
			out = append(out, participant(m.members[p.ID]))
		}
	}
	return out
}

// joinerList is the joiners, by id.
func (m *Machine) joinerList() []membership.Participant {
	ids := m.joinersSorted()
	out := make([]membership.Participant, 0, len(ids))
	for _, id := range ids {
		out = append(out, participant(m.members[id]))
	}
	return out
}

// runOfCandidates is the run of the first candidate (survivors in the
// previous quorum's order, then joiners by id) that names one ("" when
// none does).
func (m *Machine) runOfCandidates(candidate func(string) bool) string {
	if m.agg.withRun == 0 {
		return ""
	}
	if m.prev != nil {
		for _, p := range m.prev.Participants {
			if r, ok := m.members[p.ID]; ok && r.Run != "" && candidate(p.ID) && m.survives(p.ID) {
				return r.Run
			}
		}
	}
	for _, id := range m.joinersSorted() {
		if r := m.members[id]; r.Run != "" && candidate(id) {
			return r.Run
		}
	}
	return ""
}

// finalSources are the addresses of the members of run that finished it
// at step final and are still registered: they serve the final state to
// replicas behind it.
func (m *Machine) finalSources(final int64, run string) []string {
	var out []string
	for _, r := range m.members {
		if r.Finished && r.Step == final && r.Addr != "" && (run == "" || r.Run == "" || r.Run == run) {
			out = append(out, r.Addr)
		}
	}
	slices.Sort(out)
	return out
}

// maxFormDoublings bounds how often FormMaxWait doubles while joins keep
// coming (8×: 16 s at the default).
const maxFormDoublings = 3

// formWait applies the batching of joins: it says what a quorum that
// only admits joiners waits for, and until when ("" when it need not).
// Each such quorum in a row that formed at its bound, joins still
// arriving, doubles the next one's bound (formStreak): a mass join of
// 100,000 ranks over half a minute is a few epochs, not one per
// FormMaxWait, and its last joiners are admitted a FormWindow after they
// stop all the same.
func (m *Machine) formWait(now time.Time) (string, time.Time) {
	window := m.cfg.formWindow()
	if window <= 0 {
		return "", time.Time{}
	}
	quiet, limit := m.lastArrival.Add(window), m.pendingSince.Add(m.cfg.formMaxWait()<<min(m.formStreak, maxFormDoublings))
	at := quiet
	if limit.Before(at) {
		at = limit
	}
	if !now.Before(at) {
		return "", time.Time{}
	}
	return fmt.Sprintf("forming: admitting joiners once none arrived for %v (at most %v more)",
		window, limit.Sub(now).Round(time.Millisecond)), at
}

// lossWait applies the batching of losses: while participants of the
// previous epoch are still being lost (the last loss less than LossWindow
// ago, the first less than LossMaxWait ago), it says what the quorum
// waits for and until when ("" when it need not). Only losses whose time
// the machine saw count (a removal), not a member that turned unfit.
//
// The first loss after a quiet spell is not held: a single death (the
// common case, and the one a training job waits on) is published at once.
// Losses that follow a published loss within LossMaxWait are the rest of
// a mass failure (a rack: links resetting, group leases taken over, each
// seen a few milliseconds apart), and those are batched: one epoch for
// the first, one for the rest. A burst of MassLoss ranks or more waits
// longer (lossBounds): leases that lapse together come in etcd's ticks.
func (m *Machine) lossWait(now time.Time, lost []string) (string, time.Time) {
	if m.cfg.lossWindow() <= 0 || len(lost) == 0 {
		return "", time.Time{}
	}
	var first, last time.Time
	pending := 0
	for _, id := range lost {
		d, ok := m.removed[id]
		if !ok || d.at.IsZero() {
			continue
		}
		pending++
		if first.IsZero() || d.at.Before(first) {
			first = d.at
		}
		if d.at.After(last) {
			last = d.at
		}
	}
	window, bound := m.lossBounds(m.lossBurst + pending)
	if first.IsZero() || m.lossEpochAt.IsZero() || first.Sub(m.lossEpochAt) > bound {
		return "", time.Time{}
	}
	at := last.Add(window)
	if limit := first.Add(bound); limit.Before(at) {
		at = limit
	}
	if !now.Before(at) {
		return "", time.Time{}
	}
	return fmt.Sprintf("%d lost: publishing once none was lost for %v", len(lost), window), at
}

// lossBounds are the quiet a burst of n lost ranks waits for, and the
// most it waits: LossWindow and LossMaxWait, or for a mass failure
// (MassLoss ranks or more) at least MassLossWindow and MassLossMaxWait.
func (m *Machine) lossBounds(n int) (window, bound time.Duration) {
	window, bound = m.cfg.lossWindow(), m.cfg.lossMaxWait()
	if mass := m.cfg.massLoss(); mass > 0 && n >= mass {
		window, bound = max(window, m.cfg.massLossWindow()), max(bound, m.cfg.massLossMaxWait())
	}
	return window, bound
}

// maxTime is the later of a and b.
func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
