package main

import (
	"slices"
	"strings"
	"testing"
	"time"
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

func TestSeenSpread(t *testing.T) {
	t0 := time.Unix(100, 0)
	at := func(s float64) int64 { return t0.Add(time.Duration(s * float64(time.Second))).UnixNano() }
	var seen []int64
	for i := range 100 {
		seen = append(seen, at(float64(i+1)/100)) // 0.01 s .. 1.00 s
	}
	rs := []shardResp{
		{SeenAt: seen[:60], Slowest: []slowMember{{ID: "m000059", Seen: at(0.60), Leader: "m000056", Forwarded: 8, Epoch: 8}}},
		{SeenAt: seen[60:], Slowest: []slowMember{{ID: "m000099", Seen: at(1.00), Leads: true, Watched: 8, Epoch: 8}}},
	}
	got := seenSpread(rs, t0)
	for _, want := range []string{"100 members saw it", "p50 0.510 s", "p90 0.910 s", "p99 1.000 s", "max 1.000 s",
		"the last: m000099 1.000 s (leads; epoch 8: watched 8, forwarded 0, read 0); m000059 0.600 s (follows m000056"} {
		if !strings.Contains(got, want) {
			t.Errorf("seenSpread: %q lacks %q", got, want)
		}
	}
	if got := seenSpread(nil, t0); got != "no member waited for" {
		t.Errorf("seenSpread(nil) = %q", got)
	}
}
