package quorum

import (
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// A spare group that cannot take a replica group's place — another size
// than the job's groups, or ranks that disagree on the size — is listed
// as unusable with why, and is never promoted, whatever the target.
func TestUnusableSparesAreListedNotPromoted(t *testing.T) {
	s := &quorumScript{t: t, now: time.Unix(1000, 0)}
	for _, line := range []string{"config min=1", "join a b", "spare x.0 x.1 group=2", "spare s", "ask a b"} {
		s.run(line)
	}
	if u := s.m.UnusableSpares(); len(u) != 0 {
		t.Fatalf("before the first quorum (no size to compare): %+v", u)
	}
	s.run("tick 0s")
	// y's ranks disagree on their group's size.
	s.inc++
	s.m.Upsert(s.now, membership.MemberRecord{Job: "job", ID: "y.0", Incarnation: s.inc, Spare: true, WantQuorum: true, Group: "y", GroupSize: 2})
	s.inc++
	s.m.Upsert(s.now, membership.MemberRecord{Job: "job", ID: "y.1", Incarnation: s.inc, Spare: true, WantQuorum: true, Group: "y", GroupSize: 3})
	want := []UnusableSpare{
		{Group: "x", Members: []string{"x.0", "x.1"}, Reason: "a replica group of 2 rank(s); the job's replica groups have 1"},
		{Group: "y", Members: []string{"y.0", "y.1"}, Reason: "its ranks report different group sizes (2 or 3)"},
	}
	if got := s.m.UnusableSpares(); !slices.EqualFunc(got, want, func(a, b UnusableSpare) bool {
		return a.Group == b.Group && a.Reason == b.Reason && slices.Equal(a.Members, b.Members)
	}) {
		t.Fatalf("unusable spares:\n got %+v\nwant %+v", got, want)
	}
	all, ready := s.m.Spares()
	if w, r := s.m.SpareCount(); !slices.Equal(all, []string{"s", "x.0", "x.1", "y.0", "y.1"}) || !slices.Equal(ready, all) || w != 5 || r != 5 {
		t.Fatalf("spares %v ready %v (count %d, %d)", all, ready, w, r)
	}
	s.m.SetTarget(5) // room for every spare: only s fits
	s.run("formed a b 1")
	dec := s.m.Advance(s.now.Add(10 * time.Second))
	if dec.Quorum == nil || !slices.Equal(dec.Quorum.Promoted, []string{"s"}) {
		t.Fatalf("decision %+v", dec)
	}
}

// The waiting spares and the previous quorum's group sizes, kept as
// records change, equal those made anew from every member (rebuild),
// after every command of the spares script.
func TestSpareAggregatesMatchRebuild(t *testing.T) {
	data, err := os.ReadFile("testdata/spares.txt")
	if err != nil {
		t.Fatal(err)
	}
	s := &quorumScript{t: t, now: time.Unix(1000, 0)}
	for i, line := range strings.Split(string(data), "\n") {
		cmd, ok := strings.CutPrefix(line, "> ")
		if !ok {
			continue
		}
		s.run(cmd)
		kept, keptSizes, keptReady := maps.Clone(s.m.agg.spares), maps.Clone(s.m.agg.prevSizes), maps.Clone(s.m.agg.ready)
		s.m.rebuild()
		if !maps.Equal(kept, s.m.agg.spares) || !maps.Equal(keptSizes, s.m.agg.prevSizes) || !maps.Equal(keptReady, s.m.agg.ready) {
			t.Fatalf("line %d (%s): spares %v ready %v sizes %v, made anew %v %v %v", i+1, cmd, kept, keptReady, keptSizes,
				s.m.agg.spares, s.m.agg.ready, s.m.agg.prevSizes)
		}
	}
}
