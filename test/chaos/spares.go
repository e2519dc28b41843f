package main

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// The spare pool (Config.Spares) as the timeline shows it, and the two
// invariants about it.
const (
	// invSpare: a spare contributes to no step before its promotion: it
	// commits none in an epoch before the one it was promoted into (nor
	// before it learned of the promotion), and no commit of an epoch
	// between its start and that one counts it among the contributors.
	invSpare = "spare"
	// invCapacity: after a loss that left the job below its target size
	// while a spare was ready, the job commits at full size again (or as
	// near it as the ready spares allow) within Config.SpareBound, unless
	// another fault, or another loss, overlaps.
	invCapacity = "capacity"
	// invTarget: no quorum has more replica groups than the job's target
	// (Config.Replicas): spares refill the job, they do not grow it (nor,
	// then, the target the coordinator derives from the largest quorum).
	invTarget = "target"
)

// spareLaunch is one launch of a process that waited as a spare: started
// as one (Config.Spares), started again in the place of a replica group a
// spare replaced (the coordinator makes it wait as a spare), or, seen by
// its promotion alone, a replica that was removed and came back while its
// group was replaced (a zombie after a stop).
type spareLaunch struct {
	who, name string
	spawned   bool   // started as a spare (its spawn: newest the epoch then)
	newest    uint64 // the newest epoch when it started
	ready     int64  // its start event (registered, about to ask to take part); 0: none
	promoted  int64  // its promotion's event; 0: never
	epoch     uint64 // the epoch it was promoted into
	exited    int64  // 0: alive at the end
	lastEpoch uint64 // the newest epoch when it exited (MaxUint64: alive)
	// missed: the first quorum that promoted it while it lived (its time
	// and epoch). A spare cut off when it is promoted never forms that
	// epoch: ft reports its EventPromoted only in the first epoch it
	// takes part in, later (removed and back, it joins as the replica
	// it now is); the promotion counts from the coordinator's record.
	missed      int64
	missedEpoch uint64
}

// waiting reports whether l waited, ready, at t: started as a spare,
// neither promoted nor gone yet.
func (l *spareLaunch) waiting(t int64) bool {
	return l.spawned && l.ready != 0 && l.ready < t && (l.promoted == 0 || l.promoted > t) && (l.exited == 0 || l.exited > t)
}

// spareLaunches reconstructs the pool's launches from a run's events
// (ordered by time).
func spareLaunches(evs []Event) []*spareLaunch {
	var out []*spareLaunch
	byWho := map[string]*spareLaunch{}
	var newest uint64
	replaced := map[string]bool{} // the newest quorum's
	for _, e := range evs {
		switch e.Kind {
		case evQuorum, evReconf, evCommit:
			newest = max(newest, e.Epoch)
		}
		switch e.Kind {
		case evQuorum:
			clear(replaced)
			for _, g := range e.Replaced {
				replaced[g] = true
			}
			for _, m := range e.Promoted {
				for _, l := range out {
					if l.name == replicaOfMember(m) && l.ready != 0 && l.ready < e.T && l.exited == 0 && l.missed == 0 {
						l.missed, l.missedEpoch = e.T, e.Epoch
					}
				}
			}
		case evSpawn:
			if e.Reason == "spare" || replaced[e.Replica] {
				l := &spareLaunch{who: e.who(), name: e.Replica, spawned: true, newest: newest, lastEpoch: math.MaxUint64}
				byWho[l.who] = l
				out = append(out, l)
			}
		case evStart:
			if l := byWho[e.who()]; l != nil && l.ready == 0 {
				l.ready = e.T
			}
		case evPromoted:
			l := byWho[e.who()]
			if l == nil {
				l = &spareLaunch{who: e.who(), name: e.Replica, lastEpoch: math.MaxUint64}
				byWho[l.who] = l
				out = append(out, l)
			}
			if l.promoted == 0 {
				l.promoted, l.epoch = e.T, e.Epoch
			}
		case evExit:
			if l := byWho[e.who()]; l != nil {
				l.exited, l.lastEpoch = e.T, newest
			}
		}
	}
	// A promotion it missed (it took no part in that epoch) counts from
	// the coordinator's record; one it took part in, from when it learned
	// of it (its EventPromoted).
	for _, e := range evs {
		if e.Kind == evCommit || e.Kind == evReconf || e.Kind == evPromoted {
			if l := byWho[e.who()]; l != nil && l.missed != 0 && e.Epoch == l.missedEpoch {
				l.missed = 0 // it took part: not missed
			}
		}
	}
	for _, l := range out {
		if l.missed != 0 && (l.promoted == 0 || l.missedEpoch < l.epoch) {
			l.promoted, l.epoch = l.missed, l.missedEpoch
		}
	}
	return out
}

// readySpares names the spares waiting, ready, at t that no fault touches
// then (touched), but for the process named except.
func readySpares(pool []*spareLaunch, t int64, except string, touched func(string, int64) bool) []string {
	var out []string
	for _, l := range pool {
		if l.waiting(t) && l.name != except && !touched(l.name, t) && !slices.Contains(out, l.name) {
			out = append(out, l.name)
		}
	}
	return out
}

// replicaGroups counts the replica groups among a quorum's members.
func replicaGroups(members []string) int {
	seen := map[string]bool{}
	for _, m := range members {
		seen[replicaOfMember(m)] = true
	}
	return len(seen)
}

// checkSpares checks the spare invariants over in's events.
func checkSpares(in checkInput, touched func(string, int64) bool, bad func(int64, string, string, ...any)) {
	pool := spareLaunches(in.Events)
	if len(pool) == 0 {
		return
	}
	// A spare contributes to no step before its promotion.
	for _, l := range pool {
		promo := uint64(math.MaxUint64)
		if l.promoted != 0 {
			promo = l.epoch
		}
		lo := l.newest + 1 // epochs formed after it started
		if !l.spawned {
			// Seen by its promotion alone: from the epoch that removed it.
			lo = 0
			for _, e := range in.Events {
				if e.Kind == evQuorum && e.Epoch < promo && slices.ContainsFunc(e.Removed, func(m string) bool { return replicaOfMember(m) == l.name }) {
					lo = max(lo, e.Epoch)
				}
			}
			if lo == 0 {
				continue
			}
		}
		slot, hasSlot := in.Index[l.name]
		own, other := false, false
		for _, e := range in.Events {
			if e.Kind != evCommit {
				continue
			}
			if e.who() == l.who && !own {
				// Started as a spare: nothing before its promotion; else
				// nothing from its removal to its promotion.
				early := e.Epoch >= lo && e.Epoch < promo
				if l.spawned {
					early = e.Epoch < promo || e.T < l.promoted
				}
				if early {
					own = true
					bad(e.T, invSpare, "spare %s committed step %d in epoch %d before its promotion (%s)", l.who, e.Step, e.Epoch, promotion(l))
				}
			}
			if e.Replica != l.name && hasSlot && e.Mask&(1<<slot) != 0 && e.Epoch >= lo && e.Epoch < promo && e.Epoch <= l.lastEpoch && !other {
				other = true
				bad(e.T, invSpare, "%s committed step %d of epoch %d counting spare %s among its contributors (mask %b) before its promotion (%s)",
					e.who(), e.Step, e.Epoch, l.who, e.Mask, promotion(l))
			}
		}
	}

	// Spares refill the job, they do not grow it.
	for _, q := range in.Events {
		if n := replicaGroups(q.Members); q.Kind == evQuorum && in.Target > 0 && n > in.Target {
			bad(q.T, invTarget, "epoch %d has %d replica groups %v, above the job's target %d (promoted %v, replaced %v, its target %d: %s)",
				q.Epoch, n, q.Members, in.Target, q.Promoted, q.Replaced, q.Target, q.Reason)
			break // the first says it; the target the coordinator keeps has grown with it
		}
	}

	// The pool refills the job: after a loss that left it below its
	// target while spares were ready, it commits at full size again, or
	// with as many more participants as spares were ready, within the
	// bound.
	if in.SpareBound <= 0 {
		return
	}
	var end int64
	if n := len(in.Events); n > 0 {
		end = in.Events[n-1].T
	}
	for i, q := range in.Events {
		if q.Kind != evQuorum || len(q.Removed) == 0 || (in.EndAt != 0 && q.T >= in.EndAt) {
			continue
		}
		target := in.Target // the configured size (the quorum's grows with a violation of invTarget)
		if target == 0 {
			target = q.Target
		}
		size := replicaGroups(q.Members)
		if size >= target {
			continue
		}
		deadline := q.T + int64(in.SpareBound)
		if deadline > end {
			continue // not over yet
		}
		// The spares ready at the loss; a removed replica is none.
		var ready []string
		for _, n := range readySpares(pool, q.T, "", touched) {
			if !slices.ContainsFunc(q.Removed, func(m string) bool { return replicaOfMember(m) == n }) {
				ready = append(ready, n)
			}
		}
		if len(ready) == 0 {
			continue
		}
		want := size + min(target-size, len(ready))
		best, reached := 0, int64(0)
		for _, e := range in.Events[i+1:] {
			if e.T > deadline {
				break
			}
			if e.Kind == evCommit && e.Epoch >= q.Epoch && e.N > best {
				best = e.N
				if best >= want {
					reached = e.T
					break
				}
			}
		}
		if reached != 0 {
			continue
		}
		// What caused the loss, and whether another fault overlaps it.
		from := q.T
		var causes []*Fault
		for _, f := range in.Faults {
			for _, m := range q.Removed {
				if f.Kind != FaultSettings && f.covers(replicaOfMember(m), q.T, in.Linger) && !slices.Contains(causes, f) {
					causes = append(causes, f)
					from = min(from, f.Start.UnixNano())
				}
			}
		}
		overlapped := false
		for _, g := range in.Faults {
			if g.Kind != FaultSettings && !slices.Contains(causes, g) && g.overlaps(from, deadline, in.Linger) {
				overlapped = true
			}
		}
		// Another loss before the bound (false deaths under load, a
		// member registering again) disturbs the job anew: that one is
		// checked in its turn.
		for _, e := range in.Events[i+1:] {
			if e.T > deadline {
				break
			}
			overlapped = overlapped || e.Kind == evQuorum && len(e.Removed) > 0
		}
		if overlapped {
			continue
		}
		after := "never"
		for _, e := range in.Events[i+1:] {
			if e.Kind == evCommit && e.Epoch > q.Epoch && e.N >= want {
				after = time.Duration(e.T-q.T).Round(time.Millisecond).String() + " later"
				break
			}
		}
		bad(q.T, invCapacity, "epoch %d removed %v, leaving %d of the target %d replica groups, while spares %v were ready; within %v the job committed with %d participants at most (want %d; reached: %s)",
			q.Epoch, q.Removed, size, target, ready, in.SpareBound, best, want, after)
	}
}

// promotion says when l was promoted, for a violation's text.
func promotion(l *spareLaunch) string {
	if l.promoted == 0 {
		return "never promoted"
	}
	return fmt.Sprintf("promoted into epoch %d", l.epoch)
}
