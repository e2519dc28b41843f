package quorum

import (
	"fmt"
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

	lossEpochAt time.Time   // when the newest loss a published quorum dropped happened (lossWait)
	lossTimes   []time.Time // when each loss the published quorums dropped happened, the last MassLossMaxWait of them (lossWait)

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
		why = namedFirst(why, maxLostNamed, "more lost")
		if len(failedBy) > 0 {
			why = append(why, fmt.Sprintf("commit failed in epoch %d (%s)", m.prev.Epoch, idList(failedBy, maxLostNamed)))
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
