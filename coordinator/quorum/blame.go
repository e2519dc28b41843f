package quorum

import (
	"fmt"
	"math/bits"
	"slices"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// The Machine's rules on blame (see Machine): cuts between live members
// and silent members.

// blamePair is an unordered pair of member ids (a < b).
type blamePair struct{ a, b string }

func pairOf(x, y string) blamePair {
	if x > y {
		x, y = y, x
	}
	return blamePair{x, y}
}

// blameEdge records that two live members could not reach each other.
type blameEdge struct {
	until   time.Time // the blame keeps them apart until then
	at      time.Time // when it was last blamed
	epoch   uint64    // the epoch of the last blame
	strikes int       // how often the pair failed again after a hold ended
}

// maxBlameDoublings caps the hold at BlameHold × 2^4.
const maxBlameDoublings = 4

// addBlame records that member by, in epoch, failed to reach ids. Blame
// older than the previous epoch is ignored (it may name members that
// have since been replaced).
func (m *Machine) addBlame(now time.Time, epoch uint64, by string, ids []string) {
	if m.prev == nil || epoch+1 < m.prev.Epoch {
		return
	}
	if _, ok := m.members[by]; !ok {
		return
	}
	hold := m.cfg.blameHold()
	for _, id := range ids {
		if _, ok := m.members[id]; !ok || id == by {
			continue
		}
		m.blamedIn[id] = max(m.blamedIn[id], epoch)
		if hold <= 0 {
			continue
		}
		k := pairOf(by, id)
		e := m.blame[k]
		switch {
		case e == nil:
			e = &blameEdge{}
			m.blame[k] = e
		case !now.Before(e.until.Add(hold << min(e.strikes, maxBlameDoublings))):
			e.strikes = 0 // long after its hold: an old story
		case !now.Before(e.until):
			e.strikes++ // failed again once allowed back together
		}
		e.until = now.Add(hold << min(e.strikes, maxBlameDoublings))
		e.at, e.epoch = now, max(e.epoch, epoch)
	}
}

// reached records that member by connected again to id, which it had
// blamed in epoch (MemberRecord.Reached): the link between them works, so
// the pair's hold ends — at once, or when its floor (BlameMinHold, doubled
// like the hold with each repeat) has passed since the last blame, so
// that a pair that keeps failing still backs off. It returns when the
// hold now ends (zero: no hold to end).
func (m *Machine) reached(now time.Time, by, id string, epoch uint64) time.Time {
	e := m.blame[pairOf(by, id)]
	if e == nil || epoch < e.epoch || !now.Before(e.until) {
		return time.Time{}
	}
	floor := e.at.Add(m.cfg.blameMinHold() << min(e.strikes, maxBlameDoublings))
	e.until = now
	if floor.After(now) {
		e.until = floor
	}
	return e.until
}

// forgetBlame drops every blame involving id.
func (m *Machine) forgetBlame(id string) {
	for k := range m.blame {
		if k.a == id || k.b == id {
			delete(m.blame, k)
		}
	}
}

// formedTogether forgets the blame between id and every participant of
// the current epoch that, like id, formed its communicators: they reached
// each other.
func (m *Machine) formedTogether(id string) {
	e := m.prev.Epoch
	for k := range m.blame {
		other := k.a
		switch id {
		case k.a:
			other = k.b
		case k.b:
		default:
			continue
		}
		if r, ok := m.members[other]; ok && r.Formed == e && m.inPrev(other, r.Incarnation) {
			delete(m.blame, k)
		}
	}
}

// silentIn reports whether id was blamed in epoch and reported nothing in
// it.
func (m *Machine) silentIn(id string, epoch uint64) bool {
	return epoch > 0 && m.blamedIn[id] == epoch && m.active[id] < epoch
}

// silence leaves out the members blamed in SilentEpochs failed epochs in
// a row in which they reported nothing, counting the current epoch: the
// survivors, and the joiners (when admitting) silent before. Only members
// counted silent or blamed in the epoch can be: those are walked.
func (m *Machine) silence(admitting bool, out map[string]string) {
	n := m.cfg.silentEpochs()
	if n <= 0 || m.prev == nil {
		return
	}
	e := m.prev.Epoch
	consider := func(id string) {
		if _, o := out[id]; o {
			return
		}
		streak := m.silent[id]
		if m.survives(id) {
			if m.silentIn(id, e) {
				streak++
			}
		} else if _, j := m.agg.joining[id]; !j || !admitting {
			return
		}
		if streak >= n {
			out[id] = silentWhy(streak)
		}
	}
	for id := range m.silent {
		consider(id)
	}
	for id, be := range m.blamedIn {
		if be == e {
			consider(id)
		}
	}
}

func silentWhy(n int) string {
	return fmt.Sprintf("silent (blamed in %d failed epochs in a row, reported nothing)", n)
}

// blameBetween reports whether a blame in force (its hold not over) is
// between two candidates, neither of them silent in the current epoch:
// the cut rule has something to decide.
func (m *Machine) blameBetween(now time.Time, candidate func(string) bool) bool {
	var epoch uint64
	if m.prev != nil {
		epoch = m.prev.Epoch
	}
	for k, e := range m.blame {
		if now.Before(e.until) && candidate(k.a) && candidate(k.b) && !m.silentIn(k.a, epoch) && !m.silentIn(k.b, epoch) {
			return true
		}
	}
	return false
}

// maxExactCut is the most members in blame for which cut finds the best
// set by trying every one; above it, a greedy choice (exact for a clean
// cut, where the graph of blame is complete multipartite).
const maxExactCut = 16

// cut applies the cut rule to the candidates (survivors then admitted):
// it adds to out the members left out, and returns when the earliest
// blame among them ends (zero: none).
func (m *Machine) cut(now time.Time, survivors, admitted []membership.Participant, js jobStep, out map[string]string) time.Time {
	if len(m.blame) == 0 {
		return time.Time{}
	}
	pool := append(survivors[:len(survivors):len(survivors)], admitted...)
	idx := make(map[string]int, len(pool))
	for i, p := range pool {
		idx[p.ID] = i
	}
	var epoch uint64
	if m.prev != nil {
		epoch = m.prev.Epoch
	}
	adj := map[int][]int{}
	var wake time.Time
	for k, e := range m.blame {
		if !now.Before(e.until) {
			continue
		}
		i, ok := idx[k.a]
		j, ok2 := idx[k.b]
		// Blame against a member that was silent in the epoch says more
		// about its silence than about a link (the silence rule's case).
		if !ok || !ok2 || m.silentIn(k.a, epoch) || m.silentIn(k.b, epoch) {
			continue
		}
		adj[i], adj[j] = append(adj[i], j), append(adj[j], i)
		if wake.IsZero() || e.until.Before(wake) {
			wake = e.until
		}
	}
	if len(adj) == 0 {
		return time.Time{}
	}
	involved := make([]int, 0, len(adj))
	for i := range adj {
		involved = append(involved, i)
	}
	slices.Sort(involved)
	holderFixed := false // a member outside the blame holds the job's step
	for i, p := range pool {
		if _, in := adj[i]; !in && m.holds(p, js) {
			holderFixed = true
		}
	}
	side := cutSide{m: m, pool: pool, js: js, holderFixed: holderFixed}
	var kept []int
	if len(involved) <= maxExactCut {
		kept = side.exact(involved, adj)
	} else {
		kept = side.greedy(involved, adj)
	}
	keep := map[int]bool{}
	for _, i := range kept {
		keep[i] = true
	}
	for _, i := range involved {
		if keep[i] {
			continue
		}
		var from []string
		for _, j := range adj[i] {
			if keep[j] {
				from = append(from, pool[j].ID)
			}
		}
		slices.Sort(from)
		from = slices.Compact(from)
		out[pool[i].ID] = "cut off from " + strings.Join(from, ",") + " (blame)"
	}
	return wake
}

// cutSide ranks the sets of members the cut rule may keep.
type cutSide struct {
	m           *Machine
	pool        []membership.Participant
	js          jobStep
	holderFixed bool
}

// better reports whether set a (indices into pool) ranks above set b (nil:
// none yet): the set that holds the job's step, then the one with more
// survivors (a side that trains on is not interrupted for joiners), then
// the larger, then the one holding the highest step, then the one whose
// sorted ids come first.
func (s cutSide) better(a, b []int) bool {
	if b == nil {
		return true
	}
	ha, hb := s.holder(a), s.holder(b)
	if ha != hb {
		return ha
	}
	if sa, sb := s.survivors(a), s.survivors(b); sa != sb {
		return sa > sb
	}
	if len(a) != len(b) {
		return len(a) > len(b)
	}
	ta, tb := s.top(a), s.top(b)
	if ta != tb {
		return ta > tb
	}
	return slices.Compare(s.ids(a), s.ids(b)) < 0
}

func (s cutSide) holder(set []int) bool {
	if s.holderFixed {
		return true
	}
	for _, i := range set {
		if s.m.holds(s.pool[i], s.js) {
			return true
		}
	}
	return false
}

func (s cutSide) survivors(set []int) int {
	n := 0
	for _, i := range set {
		if s.m.survives(s.pool[i].ID) {
			n++
		}
	}
	return n
}

func (s cutSide) top(set []int) int64 {
	var t int64 = -1
	for _, i := range set {
		t = max(t, s.pool[i].Step)
	}
	return t
}

func (s cutSide) ids(set []int) []string {
	ids := make([]string, len(set))
	for k, i := range set {
		ids[k] = s.pool[i].ID
	}
	slices.Sort(ids)
	return ids
}

// exact tries every set of the involved members none of whom blames
// another and returns the best.
func (s cutSide) exact(involved []int, adj map[int][]int) []int {
	pos := map[int]int{}
	for k, i := range involved {
		pos[i] = k
	}
	nb := make([]uint32, len(involved))
	for k, i := range involved {
		for _, j := range adj[i] {
			nb[k] |= 1 << pos[j]
		}
	}
	var best []int
	set := make([]int, 0, len(involved))
	for mask := uint32(0); mask < 1<<len(involved); mask++ {
		ok := true
		for k := mask; k != 0; k &= k - 1 {
			if nb[bits.TrailingZeros32(k)]&mask != 0 {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		set = set[:0]
		for k := mask; k != 0; k &= k - 1 {
			set = append(set, involved[bits.TrailingZeros32(k)])
		}
		if s.better(set, best) {
			best = append(best[:0:0], set...)
		}
	}
	return best
}

// greedy keeps, one at a time, the member blamed by the fewest of those
// still undecided (ties: a survivor, then the highest step, then the
// first id), and drops the members it blames or is blamed by.
func (s cutSide) greedy(involved []int, adj map[int][]int) []int {
	left := map[int]bool{}
	for _, i := range involved {
		left[i] = true
	}
	degree := func(i int) int {
		n := 0
		for _, j := range adj[i] {
			if left[j] {
				n++
			}
		}
		return n
	}
	var kept []int
	for len(left) > 0 {
		pick := -1
		for _, i := range involved {
			if !left[i] {
				continue
			}
			if pick < 0 {
				pick = i
				continue
			}
			di, dp := degree(i), degree(pick)
			si, sp := s.m.survives(s.pool[i].ID), s.m.survives(s.pool[pick].ID)
			switch {
			case di != dp:
				if di < dp {
					pick = i
				}
			case si != sp:
				if si {
					pick = i
				}
			case s.pool[i].Step != s.pool[pick].Step:
				if s.pool[i].Step > s.pool[pick].Step {
					pick = i
				}
			case s.pool[i].ID < s.pool[pick].ID:
				pick = i
			}
		}
		kept = append(kept, pick)
		delete(left, pick)
		for _, j := range adj[pick] {
			delete(left, j)
		}
	}
	return kept
}
