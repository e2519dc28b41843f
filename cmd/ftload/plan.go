package main

import (
	"fmt"
)

// shardPlan is what one child shard simulates.
type shardPlan struct {
	name  string
	ranks []int
}

// plan is how the ranks are spread over shards, and the victims.
type plan struct {
	shards []shardPlan
	single int // the member of the one-death phase
	leader int // the group leader that dies (-1: no such phase)
}

// planShards spreads job ranks over o.shards shards (whole groups
// together), with the victims apart: the one death (group 0's rank 1, not
// its leader), a group's leader (group 1's), and 1 % of the ranks of job
// 0 (every hundredth, leaders and not), each in a shard of its own.
func planShards(o options) plan {
	p := plan{single: 0, leader: -1}
	if o.shards == 0 {
		return p
	}
	n := o.jobs * o.members
	apart := map[int]string{}
	if o.groupSize > 1 {
		p.single = 1
	}
	apart[p.single] = "victim"
	if o.groupLease && o.groupSize > 1 && o.members >= 2*o.groupSize {
		p.leader = o.groupSize
		apart[p.leader] = "leader"
	}
	if o.massDeath > 0 && o.members >= 100 {
		every := int(1 / o.massDeath)
		for r := every - 4; r < o.members; r += every {
			if _, ok := apart[r]; !ok {
				apart[r] = "mass"
			}
		}
	}
	special := map[string][]int{}
	var rest []int
	for r := 0; r < n; r++ {
		if name, ok := apart[r]; ok {
			special[name] = append(special[name], r)
		} else {
			rest = append(rest, r)
		}
	}
	for _, name := range []string{"victim", "leader", "mass"} {
		if rs := special[name]; len(rs) > 0 {
			p.shards = append(p.shards, shardPlan{name, rs})
		}
	}
	for i := 0; i < o.shards; i++ {
		lo, hi := len(rest)*i/o.shards, len(rest)*(i+1)/o.shards
		if hi > lo {
			p.shards = append(p.shards, shardPlan{fmt.Sprintf("shard-%d", i), rest[lo:hi]})
		}
	}
	return p
}
