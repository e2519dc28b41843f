package main

import (
	"slices"
	"testing"
)

// A shard's ranks cross the command line as ranges and come back the same;
// a malformed list is an error.
func TestRanksRoundTrip(t *testing.T) {
	in := []int{0, 1, 2, 3, 7, 9, 10, 11, 100}
	s := formatRanks(in)
	if s != "0-3,7,9-11,100" {
		t.Fatalf("formatted %q", s)
	}
	out, err := parseRanks(s)
	if err != nil || !slices.Equal(out, in) {
		t.Fatalf("parsed %v, %v", out, err)
	}
	for _, bad := range []string{"x", "3-1", "1-", "-2"} {
		if _, err := parseRanks(bad); err == nil {
			t.Fatalf("%q parsed", bad)
		}
	}
}

// The plan puts every rank in exactly one shard, the victims apart: the
// one death not a group's leader, a leader of another group, and 1 % of
// the ranks, leaders and others.
func TestPlanShards(t *testing.T) {
	o := options{jobs: 1, members: 10000, groupSize: 8, groupLease: true, shards: 4, massDeath: 0.01}
	p := planShards(o)
	seen := map[int]string{}
	for _, sp := range p.shards {
		for _, r := range sp.ranks {
			if prev, ok := seen[r]; ok {
				t.Fatalf("rank %d in %s and %s", r, prev, sp.name)
			}
			seen[r] = sp.name
		}
	}
	if len(seen) != o.members {
		t.Fatalf("%d ranks planned, want %d", len(seen), o.members)
	}
	if seen[p.single] != "victim" || p.single%o.groupSize == 0 {
		t.Fatalf("the one death is rank %d in %s", p.single, seen[p.single])
	}
	if seen[p.leader] != "leader" || p.leader%o.groupSize != 0 || p.leader/o.groupSize == p.single/o.groupSize {
		t.Fatalf("the leader's death is rank %d in %s", p.leader, seen[p.leader])
	}
	mass, leaders := 0, 0
	for r, name := range seen {
		if name == "mass" {
			mass++
			if r%o.groupSize == 0 {
				leaders++
			}
		}
	}
	if mass != 100 || leaders == 0 || leaders == mass {
		t.Fatalf("the mass death: %d ranks, %d of them leaders", mass, leaders)
	}
	if n := len(p.shards); n != 3+o.shards {
		t.Fatalf("%d shards, want %d", n, 3+o.shards)
	}
}
