package ft

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

func ps(spec string) []participant {
	// "a.0@1 a.1@1 b.0@2" → participants with incarnations
	var out []participant
	for _, f := range strings.Fields(spec) {
		id, inc, _ := strings.Cut(f, "@")
		var n int64 = 1
		if inc != "" {
			fmt.Sscan(inc, &n)
		}
		g, _, _ := parseMemberID(id)
		out = append(out, participant{ID: id, Group: g, Incarnation: n})
	}
	return out
}

func ids(p []participant) string {
	var s []string
	for _, x := range p {
		s = append(s, x.ID)
	}
	return strings.Join(s, " ")
}

func TestDeriveView(t *testing.T) {
	for _, tc := range []struct {
		quorum   string
		group    string
		rank     int
		size     int
		ft       string
		ftRank   int
		complete bool
		groups   int
	}{
		// one rank per group: the FT comm is the quorum
		{"b.0 a.0 c.0", "a", 0, 1, "b.0 a.0 c.0", 1, true, 3},
		// HSDP, groups of 2: rank 1's FT comm is rank 1 of each group, in quorum order
		{"a.0 a.1 b.0 b.1", "b", 1, 2, "a.1 b.1", 1, true, 2},
		// b.1 is missing: group b sits out of both FT comms
		{"a.0 a.1 b.0 c.1 c.0", "b", 0, 2, "a.0 c.0", -1, false, 2},
		{"a.0 a.1 b.0 c.1 c.0", "c", 1, 2, "a.1 c.1", 1, true, 2},
		// a rank not in the quorum at all (a joiner waiting)
		{"a.0", "z", 0, 1, "a.0", -1, false, 1},
	} {
		v, err := deriveView(7, ps(tc.quorum), tc.group, tc.rank, tc.size)
		if err != nil {
			t.Fatal(err)
		}
		if ids(v.ft) != tc.ft || v.ftRank != tc.ftRank || v.complete != tc.complete || v.groups != tc.groups {
			t.Errorf("%q as %s.%d: ft %q rank %d complete %v groups %d; want %q %d %v %d",
				tc.quorum, tc.group, tc.rank, ids(v.ft), v.ftRank, v.complete, v.groups, tc.ft, tc.ftRank, tc.complete, tc.groups)
		}
	}
	for _, bad := range []string{"a.0 a.0", "a.2", "nodot", "a.x"} {
		if _, err := deriveView(1, ps(bad), "a", 0, 2); err == nil {
			t.Errorf("quorum %q accepted", bad)
		}
	}
}

func TestPlan(t *testing.T) {
	for _, tc := range []struct {
		cur, next string
		how       reconfig
		exclude   []int
	}{
		{"", "a.0 b.0", freshComm, nil},
		{"a.0 b.0 c.0", "a.0 b.0 c.0", freshComm, nil}, // the epoch failed: start over
		{"a.0 b.0 c.0 d.0", "a.0 c.0", shrinkTo, []int{1, 3}},
		{"a.0 b.0 c.0", "b.0 c.0", shrinkTo, []int{0}},
		{"a.0 b.0", "a.0 b.0 c.0 d.0", growTo, nil},
		{"a.0 b.0 c.0", "a.0 c.0 d.0", freshComm, nil},     // shrink and grow at once
		{"a.0 b.0@1", "a.0 b.0@2", freshComm, nil},         // b restarted: a new incarnation
		{"a.0 b.0@1 c.0", "a.0 c.0 b.0@2", freshComm, nil}, // likewise, rejoining at the end
		{"a.0 b.0", "b.0 a.0", freshComm, nil},             // reordered (membership never does this)
		{"a.0 b.0", "c.0", freshComm, nil},                 // nobody survives
	} {
		var cur []participant
		if tc.cur != "" {
			cur = ps(tc.cur)
		}
		how, ex := plan(cur, ps(tc.next))
		if how != tc.how || !slices.Equal(ex, tc.exclude) {
			t.Errorf("%q → %q: %s %v, want %s %v", tc.cur, tc.next, how, ex, tc.how, tc.exclude)
		}
	}
}
