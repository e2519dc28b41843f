package quorum

import (
	"cmp"
	"slices"

	"github.com/ftcomm/ftcomm/membership"
)

// What a decision needs to know of every member, kept as records change
// rather than found by a walk over all of them at each decision: at
// 100,000 members a walk costs tens of milliseconds, and a job forming
// or losing a rack decides many times while its records arrive. A
// record's change costs a few map operations (track); the previous
// quorum's publication rebuilds the aggregates once (rebuild), as it
// rebuilds the index of its participants. Advance then costs what
// changed since the last publication (the lost, the joiners, the
// members in a rule) until it publishes a quorum, whose list is the
// whole job anyway.
type aggregates struct {
	prevPos   map[string]int      // prev's participants: id → index in prev.Participants
	lost      map[string]struct{} // prev's participants that do not survive (survives)
	joining   map[string]struct{} // eligible members asking to take part that do not survive
	eligible  int                 // live eligible members
	shrinking int                 // survivors asking ShrinkOnly
	failed    map[string]struct{} // survivors whose commit failed in prev's epoch
	minAsked  map[int]int         // MinReplicas above 1 a member asks for → how many ask it
	stalling  map[string]struct{} // members with a stall report
	withRun   int                 // members that name their run
	// stepSeen is the highest step a participant of prev reported in the
	// incarnation that took part, live or removed since (lastStep); stale
	// when a report at that step was withdrawn (a step that went back, an
	// incarnation replaced without a removal): lastStep then walks once.
	stepSeen  int64
	stepStale bool
	// Replica groups of more than one rank (MemberRecord.GroupSize), by
	// name: short are those with fewer ranks present (survivors and
	// joiners) than their size, shortJoin the joiners of short groups, and
	// shortSurv the short groups that hold survivors.
	groups    map[string]*groupTally
	short     map[string]struct{}
	shortJoin int
	shortSurv map[string]struct{}
	// Spares (spares.go): spares are the waiting spares, ready those of
	// them that ask to take part, prevReplicas the replica groups of
	// prev, prevSizes how many of them have each size (ranks), formed how
	// many survivors reported holding prev's epoch.
	spares       map[string]struct{}
	ready        map[string]struct{}
	prevReplicas int
	prevSizes    map[int]int
	formed       int
}

// groupTally is one replica group's members and how many take part.
type groupTally struct {
	ids   map[string]struct{} // members naming the group
	sizes map[int]int         // GroupSize → how many of them report it
	surv  int                 // of them, survivors
	join  int                 // of them, joiners
}

// size is the group's size: the largest its members report (they agree,
// unless a tool wrote otherwise).
func (g *groupTally) size() int {
	n := 0
	for k := range g.sizes {
		n = max(n, k)
	}
	return n
}

func (g *groupTally) short() bool { return g.surv+g.join < g.size() }

func newAggregates() aggregates {
	return aggregates{prevPos: map[string]int{}, lost: map[string]struct{}{}, joining: map[string]struct{}{},
		failed: map[string]struct{}{}, minAsked: map[int]int{}, stalling: map[string]struct{}{},
		groups: map[string]*groupTally{}, short: map[string]struct{}{}, shortSurv: map[string]struct{}{},
		spares: map[string]struct{}{}, ready: map[string]struct{}{}, prevSizes: map[int]int{}}
}

// inPrev reports whether that incarnation of member id took part in the
// previous quorum (Quorum.Includes, indexed).
func (m *Machine) inPrev(id string, incarnation int64) bool {
	i, ok := m.agg.prevPos[id]
	return ok && m.prev.Participants[i].Incarnation == incarnation
}

// survives reports whether member id is a survivor: the incarnation that
// took part in the previous quorum, live and eligible.
func (m *Machine) survives(id string) bool {
	r, ok := m.members[id]
	return ok && survivor(m, r)
}

func survivor(m *Machine, r *membership.MemberRecord) bool {
	return eligible(r) && m.inPrev(r.ID, r.Incarnation)
}

// joiner: an eligible member asking to take part that is no survivor
// and no waiting spare.
func joiner(m *Machine, r *membership.MemberRecord) bool {
	return eligible(r) && r.WantQuorum && !m.inPrev(r.ID, r.Incarnation) && !m.waitingSpare(r)
}

// track updates the aggregates for member id, whose record changed from
// old to r (nil: none, before or after).
func (m *Machine) track(id string, old, r *membership.MemberRecord) {
	a := &m.agg
	if old != nil {
		m.count(old, -1)
	}
	if r != nil {
		m.count(r, 1)
	}
	if _, ok := a.prevPos[id]; ok {
		if r != nil && survivor(m, r) {
			delete(a.lost, id)
		} else {
			a.lost[id] = struct{}{}
		}
	}
	// The job's step: a step a participant reported counts until the
	// next publication, unless withdrawn (removal keeps it: the
	// departure holds it).
	if r != nil && m.inPrev(id, r.Incarnation) {
		a.stepSeen = max(a.stepSeen, r.Step)
	}
	if old != nil && m.inPrev(id, old.Incarnation) && old.Step == a.stepSeen &&
		(r == nil && !m.departed(id) || r != nil && (r.Incarnation != old.Incarnation || r.Step < old.Step)) {
		a.stepStale = true
	}
}

// departed reports whether a departure of id is recorded.
func (m *Machine) departed(id string) bool {
	_, ok := m.removed[id]
	return ok
}

// count adds (n = 1) or takes away (n = -1) r's part of the aggregates.
func (m *Machine) count(r *membership.MemberRecord, n int) {
	a := &m.agg
	set := func(s map[string]struct{}, in bool) {
		switch {
		case !in:
		case n > 0:
			s[r.ID] = struct{}{}
		default:
			delete(s, r.ID)
		}
	}
	surv := survivor(m, r)
	spare := m.waitingSpare(r)
	if eligible(r) && !spare {
		a.eligible += n
	}
	set(a.spares, spare)
	set(a.ready, spare && eligible(r) && r.WantQuorum)
	if surv && r.Formed == m.prev.Epoch {
		a.formed += n
	}
	if surv && r.ShrinkOnly {
		a.shrinking += n
	}
	set(a.failed, surv && r.CommitFailed != 0 && r.CommitFailed == m.prev.Epoch)
	set(a.joining, joiner(m, r))
	set(a.stalling, r.Stall != nil)
	if r.MinReplicas > 1 {
		if a.minAsked[r.MinReplicas] += n; a.minAsked[r.MinReplicas] == 0 {
			delete(a.minAsked, r.MinReplicas)
		}
	}
	if r.Run != "" {
		a.withRun += n
	}
	if grouped(r) && !spare {
		a.tally(r, n, surv, joiner(m, r))
	}
}

// grouped reports whether r is a rank of a replica group of more than one.
func grouped(r *membership.MemberRecord) bool { return r.GroupSize > 1 && r.Group != "" }

// tally adds (n = 1) or takes away (n = -1) r's part of its group's
// tally, keeping short, shortJoin and shortSurv.
func (a *aggregates) tally(r *membership.MemberRecord, n int, surv, join bool) {
	g := a.groups[r.Group]
	if g == nil {
		g = &groupTally{ids: map[string]struct{}{}, sizes: map[int]int{}}
		a.groups[r.Group] = g
	}
	if g.short() {
		a.shortJoin -= g.join
	}
	if n > 0 {
		g.ids[r.ID] = struct{}{}
	} else {
		delete(g.ids, r.ID)
	}
	if g.sizes[r.GroupSize] += n; g.sizes[r.GroupSize] == 0 {
		delete(g.sizes, r.GroupSize)
	}
	if surv {
		g.surv += n
	}
	if join {
		g.join += n
	}
	switch {
	case len(g.ids) == 0:
		delete(a.groups, r.Group)
		delete(a.short, r.Group)
		delete(a.shortSurv, r.Group)
	case g.short():
		a.short[r.Group] = struct{}{}
		a.shortJoin += g.join
		if g.surv > 0 {
			a.shortSurv[r.Group] = struct{}{}
		} else {
			delete(a.shortSurv, r.Group)
		}
	default:
		delete(a.short, r.Group)
		delete(a.shortSurv, r.Group)
	}
}

// inShortGroup reports whether member id belongs to a replica group with
// fewer ranks present than its size.
func (m *Machine) inShortGroup(id string) bool {
	r, ok := m.members[id]
	if !ok || !grouped(r) {
		return false
	}
	_, s := m.agg.short[r.Group]
	return s
}

// rebuild makes the aggregates anew for a new previous quorum (setPrev):
// one pass over the members, and one over the participants only when
// some of them do not survive (after a publication, usually all do).
func (m *Machine) rebuild() {
	a := &m.agg
	clear(a.prevPos)
	clear(a.lost)
	clear(a.joining)
	clear(a.failed)
	clear(a.minAsked)
	clear(a.stalling)
	clear(a.groups)
	clear(a.short)
	clear(a.shortSurv)
	clear(a.spares)
	clear(a.ready)
	clear(a.prevSizes)
	a.eligible, a.shrinking, a.withRun, a.stepSeen, a.stepStale, a.shortJoin = 0, 0, 0, 0, false, 0
	a.prevReplicas, a.formed = 0, 0
	var epoch uint64
	if m.prev != nil {
		for i, p := range m.prev.Participants {
			a.prevPos[p.ID] = i
		}
		for _, n := range groupSizes(m.prev.Participants) {
			a.prevSizes[n]++
			a.prevReplicas++
		}
		a.stepSeen, epoch = m.prev.MaxStep, m.prev.Epoch
	}
	survivors := 0
	for id, r := range m.members {
		i, in := a.prevPos[id]
		took := in && m.prev.Participants[i].Incarnation == r.Incarnation // the incarnation that took part
		el := eligible(r)
		spare := !took && m.waitingSpare(r)
		if spare {
			a.spares[id] = struct{}{}
		}
		switch {
		case el && took:
			survivors++
			if r.Formed == epoch {
				a.formed++
			}
			if r.ShrinkOnly {
				a.shrinking++
			}
			if r.CommitFailed != 0 && r.CommitFailed == epoch {
				a.failed[id] = struct{}{}
			}
		case el && r.WantQuorum && spare:
			a.ready[id] = struct{}{}
		case el && r.WantQuorum:
			a.joining[id] = struct{}{}
		}
		if el && !spare {
			a.eligible++
		}
		if took {
			a.stepSeen = max(a.stepSeen, r.Step)
		}
		if r.Stall != nil {
			a.stalling[id] = struct{}{}
		}
		if r.MinReplicas > 1 {
			a.minAsked[r.MinReplicas]++
		}
		if r.Run != "" {
			a.withRun++
		}
		if grouped(r) && !spare {
			a.tally(r, 1, el && took, el && r.WantQuorum && !took)
		}
	}
	if m.prev != nil && survivors < len(m.prev.Participants) {
		for _, p := range m.prev.Participants {
			if !m.survives(p.ID) {
				a.lost[p.ID] = struct{}{}
			}
		}
	}
}

// lostInOrder are the previous participants that do not survive, in the
// previous quorum's order.
func (m *Machine) lostInOrder() []string {
	if len(m.agg.lost) == 0 {
		return nil
	}
	out := make([]string, 0, len(m.agg.lost))
	for id := range m.agg.lost {
		out = append(out, id)
	}
	m.sortByRank(out)
	return out
}

// sortByRank sorts ids of the previous quorum's participants by their
// rank in it.
func (m *Machine) sortByRank(ids []string) {
	slices.SortFunc(ids, func(x, y string) int { return cmp.Compare(m.agg.prevPos[x], m.agg.prevPos[y]) })
}

// joinersSorted are the joiners by id.
func (m *Machine) joinersSorted() []string {
	out := make([]string, 0, len(m.agg.joining))
	for id := range m.agg.joining {
		out = append(out, id)
	}
	slices.Sort(out)
	return out
}

// minReplicas is the most replicas asked for: the job's configuration or
// a member's.
func (m *Machine) minReplicas() int {
	n := max(m.cfg.MinReplicas, 1)
	for k := range m.agg.minAsked {
		n = max(n, k)
	}
	return n
}
