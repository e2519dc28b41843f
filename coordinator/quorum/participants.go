package quorum

import (
	"fmt"
	"slices"
	"strings"

	"github.com/ftcomm/ftcomm/membership"
)

// The participants of the quorum Advance decides: the survivors and
// joiners in rank order, whole replica groups, and what the quorum says
// of them (the joiners its Reason names, the run, who serves the final
// state, whether it is a prepared grow).

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

// maxLostNamed bounds the losses (and the commit failures) a reason names
// one by one; the rest are counted. A reason is text for people, stored in
// the quorum record, its history entry and the revocation of one
// publication: a burst that took tens of thousands of members at once
// (their leases lapsing on a starved etcd, ftload at 100,000 ranks) made
// one of megabytes, which no publication could carry past etcd's request
// limit, so the coordinator retried it for good and the job never moved on.
const maxLostNamed = 16

// namedFirst keeps the first n of phrases and counts the rest ("and 84
// more lost").
func namedFirst(phrases []string, n int, more string) []string {
	if len(phrases) <= n {
		return phrases
	}
	return append(phrases[:n:n], fmt.Sprintf("and %d %s", len(phrases)-n, more))
}

// idList is ids joined by commas, the first n of them named and the rest
// counted ("a,b,c and 7 more").
func idList(ids []string, n int) string {
	if len(ids) <= n {
		return strings.Join(ids, ",")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(ids[:n], ","), len(ids)-n)
}

// joinedWhy is the reason's part for the joiners added.
func joinedWhy(added []string) string {
	return "joined " + idList(added, maxJoinedNamed)
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
