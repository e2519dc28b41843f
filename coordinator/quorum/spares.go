package quorum

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// Spares: warm standby replicas (MemberRecord.Spare) that wait, counted
// neither among the live members nor among the joiners, until the job
// runs below its target size; then the machine promotes as many ready
// spare groups as it lacks, and they take part from the next quorum like
// any joiner (they heal from their peers). See docs/spares.md.
//
// When. A loss is published first, without the spares: the survivors
// shrink the comms they hold (connections reused, about 0.1 s) and
// commit, while a quorum that also admitted a new member would make every
// survivor set up connections to it first (a new NCCL comm: about a
// second). The spares are promoted in the quorum after that, once every
// survivor reported holding the shrunk epoch (so the grow builds on it)
// or FormMaxWait after it was published, whichever comes first. A spare
// is promoted with a loss only when the survivors alone are fewer than
// min replicas: then no quorum forms without one.
//
// Which. Whole groups only: a spare replica group is ready when all its
// GroupSize ranks ask to take part. Spares on the host of a replica the
// job lost come first (the GPU its death freed), then the longest
// waiting, then by name.
//
// Restarts. The groups whose places spares took are Replaced (the list
// travels in every quorum): a new process of such a group waits as a
// spare, so a launcher or Kubernetes that restarts the dead refills the
// pool instead of growing the job past its target. A spare is no spare
// any more once its incarnation took part in a quorum.

// group is a member's replica group: its Group, or its ID without one.
func groupKey(id, group string) string {
	if group != "" {
		return group
	}
	return id
}

// replicasOf counts the replica groups among ps.
func replicasOf(ps []membership.Participant) int {
	seen := make(map[string]struct{}, len(ps))
	for _, p := range ps {
		seen[groupKey(p.ID, p.Group)] = struct{}{}
	}
	return len(seen)
}

// groupSizes counts the ranks of each replica group among ps.
func groupSizes(ps []membership.Participant) map[string]int {
	n := make(map[string]int, len(ps))
	for _, p := range ps {
		n[groupKey(p.ID, p.Group)]++
	}
	return n
}

// vacancy is a replica group a quorum lost: what a spare may replace.
type vacancy struct {
	group string
	host  string
}

// maxVacancies bounds the vacancies remembered (the oldest go first).
const maxVacancies = 1024

// waitingSpare reports whether r waits as a spare: a spare (or a new
// process of a replaced group) whose incarnation neither took part in the
// previous quorum nor was promoted.
func (m *Machine) waitingSpare(r *membership.MemberRecord) bool {
	if !r.Spare && !m.isReplaced(r) {
		return false
	}
	if m.promoted[r.ID] == r.Incarnation {
		return false
	}
	return m.prev == nil || !m.inPrev(r.ID, r.Incarnation)
}

func (m *Machine) isReplaced(r *membership.MemberRecord) bool {
	if len(m.replaced) == 0 {
		return false
	}
	_, ok := m.replaced[groupKey(r.ID, r.Group)]
	return ok
}

// recount changes something waitingSpare reads for member id's record
// (f) and keeps the aggregates right: its part is taken away before and
// added after.
func (m *Machine) recount(id string, f func()) {
	r, ok := m.members[id]
	if ok {
		m.count(r, -1)
	}
	f()
	if ok {
		m.count(r, 1)
	}
}

// SetTarget sets the job's target size in replica groups, which spares
// refill it to (the job setting SettingTargetReplicas); 0: the most
// replica groups a quorum of the run had.
func (m *Machine) SetTarget(n int) { m.target = max(n, 0) }

// SetPreparedGrow sets whether grows are marked prepared (the job setting
// SettingPreparedGrow; on when unset).
func (m *Machine) SetPreparedGrow(on bool) { m.noPrepared = !on }

// Target is the job's target size in replica groups (0: none yet).
func (m *Machine) Target() int {
	if m.target > 0 {
		return m.target
	}
	return m.natural
}

// Spares lists the waiting spares' ids, and of them those ready (asking
// to take part), sorted. It costs what the spares are (kept as records
// change), not what the job is.
func (m *Machine) Spares() (all, ready []string) {
	return maps2list(m.agg.spares), maps2list(m.agg.ready)
}

// SpareCount counts the waiting spares and, of them, those ready; a
// few map lengths.
func (m *Machine) SpareCount() (waiting, ready int) {
	return len(m.agg.spares), len(m.agg.ready)
}

// UnusableSpare is a spare replica group that the machine never promotes,
// and why (spareGroup.misfit): a group of another size than the job's
// replica groups would leave the job's groups unequal, which its
// collectives do not support.
type UnusableSpare struct {
	Group   string   `json:"group"`
	Members []string `json:"members"` // its waiting ranks, sorted
	Reason  string   `json:"reason"`
}

// UnusableSpares lists the waiting spare groups that can never be
// promoted into this job, by group. It walks the waiting spares only.
func (m *Machine) UnusableSpares() []UnusableSpare {
	if len(m.agg.spares) == 0 {
		return nil
	}
	var out []UnusableSpare
	for _, g := range m.spareGroups(m.agg.spares) {
		if why := m.misfit(g); why != "" {
			slices.Sort(g.ids)
			out = append(out, UnusableSpare{Group: g.key, Members: g.ids, Reason: why})
		}
	}
	slices.SortFunc(out, func(a, b UnusableSpare) int { return cmp.Compare(a.Group, b.Group) })
	return out
}

// spareGroup is a spare replica group: those of its ranks among a set of
// waiting spares.
type spareGroup struct {
	key    string
	ids    []string
	host   string
	joined time.Time   // its longest waiting rank's
	size   int         // the size its ranks report (at least 1)
	sizes  map[int]int // when they disagree: each size reported → how many
}

// spareGroups groups the waiting spares ids by replica group.
func (m *Machine) spareGroups(ids map[string]struct{}) map[string]*spareGroup {
	byGroup := map[string]*spareGroup{}
	for id := range ids {
		r := m.members[id]
		k, size := groupKey(id, r.Group), max(r.GroupSize, 1)
		g := byGroup[k]
		if g == nil {
			g = &spareGroup{key: k, host: r.Host, joined: r.Joined, size: size}
			byGroup[k] = g
		}
		g.ids = append(g.ids, id)
		if r.Joined.Before(g.joined) {
			g.joined = r.Joined
		}
		if size != g.size || g.sizes != nil {
			if g.sizes == nil {
				g.sizes = map[int]int{g.size: len(g.ids) - 1}
			}
			g.sizes[size]++
		}
	}
	return byGroup
}

// misfit says why spare group g can never take a replica group's place
// in this job ("" when it can): its ranks must agree on its size, and
// that must be the size of the job's replica groups (the previous
// quorum's; any size before the first quorum, when no spare is promoted).
func (m *Machine) misfit(g *spareGroup) string {
	if len(g.sizes) > 1 {
		return fmt.Sprintf("its ranks report different group sizes (%s)", sizeList(g.sizes))
	}
	if len(m.agg.prevSizes) == 0 || m.agg.prevSizes[g.size] > 0 {
		return ""
	}
	return fmt.Sprintf("a replica group of %d rank(s); the job's replica groups have %s", g.size, sizeList(m.agg.prevSizes))
}

// sizeList names the sizes of a size → count map: "2", "2 or 4".
func sizeList(sizes map[int]int) string {
	ks := make([]int, 0, len(sizes))
	for k := range sizes {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	parts := make([]string, len(ks))
	for i, k := range ks {
		parts[i] = fmt.Sprint(k)
	}
	return strings.Join(parts, " or ")
}

// promote decides whether ready spares take part in the next quorum (see
// the comment at the top), marks them promoted, and returns when to look
// again if it waits (zero: no wait). lost are the previous participants
// that do not survive; failed says the current epoch failed.
func (m *Machine) promote(now time.Time, lost []string, failed bool) (wakeAt time.Time) {
	// Decided afresh at each decision: a promotion not published yet is
	// taken back first, so that a replica that comes back (or a joiner
	// that arrives) while the quorum waits is counted, and the job never
	// grows past its target by both.
	for id, inc := range m.promoted {
		if r, ok := m.members[id]; ok && r.Incarnation == inc && (m.prev == nil || !m.inPrev(id, inc)) {
			m.recount(id, func() { delete(m.promoted, id) })
		} else if !ok || r.Incarnation != inc {
			delete(m.promoted, id)
		}
	}
	if m.prev == nil || len(m.agg.ready) == 0 || m.final > 0 || m.agg.shrinking > 0 {
		return time.Time{}
	}
	target := m.Target()
	lostGroups := map[string]struct{}{}
	for _, id := range lost {
		p := m.prev.Participants[m.agg.prevPos[id]]
		lostGroups[groupKey(p.ID, p.Group)] = struct{}{}
	}
	have := m.agg.prevReplicas - len(lostGroups)
	if have >= target && len(lost) == 0 {
		return time.Time{}
	}
	// Joiners that are no spares come anyway (a replica restarted before
	// any spare took its place): count their complete groups.
	joining := map[string]struct{}{}
	for id := range m.agg.joining {
		if r := m.members[id]; !m.inShortGroup(id) {
			joining[groupKey(id, r.Group)] = struct{}{}
		}
	}
	need := target - have - len(joining)
	if need <= 0 {
		return time.Time{}
	}
	switch {
	case len(lost) > 0 || failed:
		// The loss goes first, unless no quorum forms without a spare
		// (min replicas counts ranks).
		ranks := len(m.prev.Participants) - len(lost) + len(m.agg.joining) - m.agg.shortJoin
		if len(lost) == 0 || ranks >= m.minReplicas() {
			return time.Time{}
		}
	case m.agg.formed < len(m.prev.Participants):
		// The survivors still shrink: promote once they hold it.
		if at := m.prev.Created.Add(m.cfg.formMaxWait()); now.Before(at) {
			return at
		}
	}
	picked := m.pickSpares(need)
	if len(picked) == 0 {
		return time.Time{}
	}
	if m.promoted == nil {
		m.promoted = map[string]int64{}
	}
	for _, id := range picked {
		m.recount(id, func() { m.promoted[id] = m.members[id].Incarnation })
	}
	return time.Time{}
}

// pickSpares chooses up to need complete ready spare groups and returns
// their members' ids. A group that does not fit the job (misfit) is never
// chosen.
func (m *Machine) pickSpares(need int) []string {
	freed := map[string]int{} // hosts of the vacancies
	for _, v := range m.vacant {
		if v.host != "" {
			freed[v.host]++
		}
	}
	var cands []*spareGroup
	for _, c := range m.spareGroups(m.agg.ready) {
		if len(c.ids) == c.size && m.misfit(c) == "" {
			cands = append(cands, c)
		}
	}
	onFreed := func(c *spareGroup) int {
		if freed[c.host] > 0 {
			return 0
		}
		return 1
	}
	slices.SortFunc(cands, func(a, b *spareGroup) int {
		return cmp.Or(cmp.Compare(onFreed(a), onFreed(b)), a.joined.Compare(b.joined), cmp.Compare(a.key, b.key))
	})
	var ids []string
	for _, c := range cands {
		if need == 0 {
			break
		}
		if freed[c.host] > 0 {
			freed[c.host]--
		}
		need--
		ids = append(ids, c.ids...)
	}
	return ids
}

// promotedIn are the members of q promoted from spares, in q's order.
func (m *Machine) promotedIn(q *membership.Quorum) []string {
	if len(m.promoted) == 0 {
		return nil
	}
	var out []string
	for _, id := range q.Added {
		if r, ok := m.members[id]; ok && m.promoted[id] == r.Incarnation {
			out = append(out, id)
		}
	}
	return out
}

// sparesNext says what quorum q, following old, leaves of the spares'
// bookkeeping: the vacancies (old's groups q removed, less those q fills)
// and the replaced groups (those whose places q's promoted spares take,
// and those still replaced). It changes nothing.
func (m *Machine) sparesNext(old *membership.Quorum, q *membership.Quorum) ([]vacancy, []string) {
	vacant := slices.Clone(m.vacant)
	replaced := maps2list(m.replaced)
	if old != nil && q.Run != "" && old.Run != "" && old.Run != q.Run {
		vacant, replaced = nil, nil // a new run starts afresh
	}
	if old != nil && len(q.Removed) > 0 {
		seen := map[string]struct{}{}
		for _, id := range q.Removed {
			i, ok := m.agg.prevPos[id] // old is the previous quorum
			if ok && (i >= len(old.Participants) || old.Participants[i].ID != id) {
				ok = false
			}
			if !ok || m.departedFinished(id) {
				continue
			}
			p := old.Participants[i]
			g := groupKey(p.ID, p.Group)
			if _, dup := seen[g]; dup {
				continue
			}
			seen[g] = struct{}{}
			host := ""
			if r, ok := m.members[id]; ok && r.Incarnation == p.Incarnation {
				host = r.Host
			} else if d, ok := m.removed[id]; ok {
				host = d.host
			}
			vacant = append(vacant, vacancy{group: g, host: host})
		}
		if len(vacant) > maxVacancies {
			vacant = vacant[len(vacant)-maxVacancies:]
		}
	}
	// A group back in the job fills its own vacancy and is no longer
	// replaced; each promoted spare group fills one.
	back := map[string]struct{}{}
	promotedHosts := map[string]string{} // group → host
	for _, id := range q.Added {
		if r, ok := m.members[id]; ok {
			back[groupKey(id, r.Group)] = struct{}{}
		}
	}
	for _, id := range q.Promoted {
		if r, ok := m.members[id]; ok {
			promotedHosts[groupKey(id, r.Group)] = r.Host
		}
	}
	inBack := func(g string) bool { _, b := back[g]; return b }
	vacant = slices.DeleteFunc(vacant, func(v vacancy) bool { return inBack(v.group) })
	replaced = slices.DeleteFunc(replaced, inBack)
	for _, host := range sortedValues(promotedHosts) {
		if len(vacant) == 0 {
			break
		}
		// The vacancy on the spare's host, else the oldest.
		i := max(slices.IndexFunc(vacant, func(v vacancy) bool { return host != "" && v.host == host }), 0)
		replaced = append(replaced, vacant[i].group)
		vacant = slices.Delete(vacant, i, i+1)
	}
	slices.Sort(replaced)
	return vacant, slices.Compact(replaced)
}

// setReplaced makes gs the replaced groups, recounting the live members
// whose status as a spare changes.
func (m *Machine) setReplaced(gs []string) {
	next := map[string]struct{}{}
	for _, g := range gs {
		next[g] = struct{}{}
	}
	changed := map[string]struct{}{}
	for g := range m.replaced {
		if _, ok := next[g]; !ok {
			changed[g] = struct{}{}
		}
	}
	for g := range next {
		if _, ok := m.replaced[g]; !ok {
			changed[g] = struct{}{}
		}
	}
	if len(changed) == 0 {
		return
	}
	var ids []string
	for id, r := range m.members {
		if _, c := changed[groupKey(id, r.Group)]; c {
			ids = append(ids, id)
		}
	}
	for _, id := range ids {
		r := m.members[id]
		m.count(r, -1)
	}
	m.replaced = next
	for _, id := range ids {
		m.count(m.members[id], 1)
	}
}

// departedFinished reports whether a departed member finished the run
// (no place to refill: the run ends).
func (m *Machine) departedFinished(id string) bool {
	r, ok := m.members[id]
	return ok && r.Finished
}

// spareWhy is the reason's part for the promoted spares.
func spareWhy(promoted, replaced []string) string {
	w := "promoted spare " + strings.Join(promoted, ",")
	if len(promoted) > maxJoinedNamed {
		w = fmt.Sprintf("promoted spares %s and %d more", strings.Join(promoted[:maxJoinedNamed], ","), len(promoted)-maxJoinedNamed)
	}
	if len(replaced) > 0 {
		w += " (replacing " + strings.Join(replaced, ",") + ")"
	}
	return w
}

func maps2list(s map[string]struct{}) []string {
	out := make([]string, 0, len(s))
	for k := range s {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func sortedValues(m map[string]string) []string {
	keys := maps2list(func() map[string]struct{} {
		k := map[string]struct{}{}
		for g := range m {
			k[g] = struct{}{}
		}
		return k
	}())
	out := make([]string, 0, len(keys))
	for _, k := range keys {
		out = append(out, m[k])
	}
	return out
}
