package ft

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/ftcomm/ftcomm/membership"
)

// participant is what ft needs of one quorum participant.
type participant struct {
	ID          string
	Group       string
	GroupRank   int
	Incarnation int64
}

// memberID is the membership id of rank groupRank of a replica group.
func memberID(group string, groupRank int) string {
	return group + "." + strconv.Itoa(groupRank)
}

// parseMemberID splits "<group>.<rank>".
func parseMemberID(id string) (group string, rank int, ok bool) {
	i := strings.LastIndexByte(id, '.')
	if i <= 0 {
		return "", 0, false
	}
	r, err := strconv.Atoi(id[i+1:])
	if err != nil || r < 0 {
		return "", 0, false
	}
	return id[:i], r, true
}

// view is what one rank derives from a quorum: which replica groups are
// complete (every one of their groupSize ranks takes part), the members of
// its fault-tolerant comm (rank groupRank of every complete group, in
// quorum order), and its own place. Every rank derives the same view from
// the same quorum, so no further agreement is needed.
type view struct {
	epoch     uint64
	ft        []participant // the FT comm for this group rank, in rank order
	ftRank    int           // this rank's place in ft, -1 when sitting out
	group     []participant // this rank's group, by group rank (complete or not)
	complete  bool          // this rank's group is complete
	groups    int           // complete groups in the quorum
	maxReport int64         // the quorum's MaxStep (reported, may lag)
}

// deriveView computes the view of rank (group, groupRank) of a quorum.
// Participants whose id is not "<group>.<rank>" with rank < groupSize, or
// whose Group disagrees with their id, make the quorum malformed: ft never
// registers such members, so another job's tool wrote them.
func deriveView(epoch uint64, ps []participant, group string, groupRank, groupSize int) (view, error) {
	v := view{epoch: epoch, ftRank: -1}
	byGroup := map[string][]participant{}
	var order []string // groups in the order their first member appears
	for _, p := range ps {
		g, r, ok := parseMemberID(p.ID)
		if !ok || r >= groupSize || (p.Group != "" && p.Group != g) {
			return view{}, fmt.Errorf("ft: quorum %d holds member %q (group %q), which is not <group>.<rank> with rank < %d",
				epoch, p.ID, p.Group, groupSize)
		}
		p.Group, p.GroupRank = g, r
		if _, seen := byGroup[g]; !seen {
			order = append(order, g)
			byGroup[g] = make([]participant, groupSize)
		}
		if byGroup[g][r].ID != "" {
			return view{}, fmt.Errorf("ft: quorum %d lists %s twice", epoch, p.ID)
		}
		byGroup[g][r] = p
	}
	completeGroup := func(g string) bool {
		return !slices.ContainsFunc(byGroup[g], func(p participant) bool { return p.ID == "" })
	}
	// FT comm order: the quorum's order of the rank-groupRank members, which
	// keeps survivors' relative order and puts joiners last, as Shrink and
	// Grow need.
	for _, p := range ps {
		g, r, _ := parseMemberID(p.ID)
		if r != groupRank || !completeGroup(g) {
			continue
		}
		if g == group {
			v.ftRank = len(v.ft)
		}
		v.ft = append(v.ft, byGroup[g][r])
	}
	for _, g := range order {
		if completeGroup(g) {
			v.groups++
		}
	}
	v.group = byGroup[group]
	v.complete = v.group != nil && completeGroup(group)
	return v, nil
}

// includes reports whether this incarnation of id takes part in the view's FT comm.
func (v view) includes(id string, incarnation int64) bool {
	return slices.ContainsFunc(v.ft, func(p participant) bool { return p.ID == id && p.Incarnation == incarnation })
}

// reconfig is how to get from the current FT comm to the next.
type reconfig int

const (
	shrinkTo  reconfig = iota // drop the excluded ranks
	growTo                    // existing ranks keep theirs; joiners follow
	freshComm                 // everyone creates a new comm
	// preparedGrow: a grow (membership.Quorum.Prepared) whose comms every
	// rank makes anew, the survivors in the background of their steps,
	// and whose ranks then agree on the step at which they move to them.
	preparedGrow
)

func (r reconfig) String() string {
	return [...]string{"shrink", "grow", "fresh", "prepared"}[r]
}

// fresh says whether r makes new comms (nothing is taken from the old).
func (r reconfig) fresh() bool { return r == freshComm || r == preparedGrow }

// plan decides how to move from the members of the current comm (nil if
// there is none) to next. It depends only on what every rank knows alike —
// the two member lists — never on local state such as whether this rank's
// comm still works, so all ranks choose the same. Shrink and Grow work on a
// broken comm too; unchanged members at a new epoch mean the old epoch
// failed, so they get a fresh comm. For shrinkTo, exclude lists the current
// ranks to drop.
func plan(cur, next []participant) (how reconfig, exclude []int) {
	if cur == nil || slices.EqualFunc(cur, next, same) {
		return freshComm, nil
	}
	// Shrink: next is cur minus some ranks, in the same relative order.
	j := 0
	for i, p := range cur {
		if j < len(next) && same(p, next[j]) {
			j++
			continue
		}
		exclude = append(exclude, i)
	}
	if j == len(next) && len(next) > 0 {
		return shrinkTo, exclude
	}
	// Grow: cur is a prefix of next.
	if len(next) > len(cur) && slices.EqualFunc(cur, next[:len(cur)], same) {
		return growTo, nil
	}
	return freshComm, nil
}

// same reports whether a and b are one incarnation of one member.
func same(a, b participant) bool { return a.ID == b.ID && a.Incarnation == b.Incarnation }

// sameParticipants reports whether a and b hold the same incarnations in
// the same places (a group comm's ranks, say).
func sameParticipants(a, b []participant) bool {
	return len(a) > 0 && slices.EqualFunc(a, b, same)
}

func participantsOf(q membership.Quorum) []participant {
	ps := make([]participant, len(q.Participants))
	for i, p := range q.Participants {
		ps[i] = participant{ID: p.ID, Group: p.Group, Incarnation: p.Incarnation}
	}
	return ps
}
