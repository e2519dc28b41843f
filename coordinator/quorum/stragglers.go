package quorum

import (
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// The straggler policy (membership.StragglerPolicy) as the Machine applies
// it.

// maxProbationDoublings caps a probation at Probation × 2^3.
const maxProbationDoublings = 3

func policyOn(p membership.StragglerPolicy) bool { return p.Factor > 0 }

func policyWindow(p membership.StragglerPolicy) time.Duration {
	if p.Window == 0 {
		return membership.DefaultStragglerWindow
	}
	return p.Window
}

func policyProbation(p membership.StragglerPolicy) time.Duration {
	if p.Probation == 0 {
		return membership.DefaultStragglerProbation
	}
	return p.Probation
}

func samePolicy(p, o *membership.StragglerPolicy) bool {
	if p == nil || o == nil {
		return p == o
	}
	return *p == *o
}

// policy is the job's straggler policy: the members' when any asks for
// one (the most lenient of theirs: the largest factor, the longest
// window, the shortest probation), else the coordinator's.
func (m *Machine) policy() membership.StragglerPolicy {
	if m.pol == nil {
		pol := m.computePolicy()
		m.pol = &pol
	}
	return *m.pol
}

// computePolicy is policy, from every member's record: a walk Upsert made
// for every record whose step time changed (every heartbeat of an ft
// replica), until the result was kept.
func (m *Machine) computePolicy() membership.StragglerPolicy {
	var pol membership.StragglerPolicy
	for _, r := range m.members {
		s := r.Stragglers
		if s == nil || !policyOn(*s) {
			continue
		}
		if !policyOn(pol) {
			pol = membership.StragglerPolicy{Factor: s.Factor, Window: policyWindow(*s), Probation: policyProbation(*s)}
			continue
		}
		pol.Factor, pol.Window, pol.Probation = max(pol.Factor, s.Factor), max(pol.Window, policyWindow(*s)), min(pol.Probation, policyProbation(*s))
	}
	if !policyOn(pol) {
		return m.cfg.Stragglers
	}
	return pol
}

// straggler is the policy's state of one member incarnation.
type straggler struct {
	inc     int64
	since   time.Time     // slow since (zero: keeping up)
	out     bool          // taken out
	until   time.Time     // out: when its probation ends
	outTime time.Duration // out: its step time when taken out
	strikes int           // take-outs in a row
	back    time.Time     // let back in at (zero: not since its last take-out)
}

func (m *Machine) stragglerOf(p membership.Participant) *straggler {
	s := m.slow[p.ID]
	if s == nil || s.inc != p.Incarnation {
		s = &straggler{inc: p.Incarnation}
		m.slow[p.ID] = s
	}
	return s
}

func medianOf(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// stragglers applies the policy: it adds to out the survivors to take out
// and the joiners still out, and returns when a verdict may change
// without new input (zero: not before new input).
func (m *Machine) stragglers(now time.Time, survivors, admitted []membership.Participant, out map[string]string) time.Time {
	pol := m.policy()
	if !policyOn(pol) || m.prev == nil {
		return time.Time{}
	}
	var wake time.Time
	soon := func(t time.Time) {
		if wake.IsZero() || t.Before(wake) {
			wake = t
		}
	}
	stepTime := func(p membership.Participant) time.Duration { return m.members[p.ID].StepTime }
	var ref []time.Duration // the survivors' step times
	for _, p := range survivors {
		if st := stepTime(p); st > 0 {
			ref = append(ref, st)
		}
	}
	type slowOne struct {
		id    string
		st    time.Duration
		med   time.Duration
		since time.Time
	}
	var slow []slowOne
	for _, p := range survivors {
		s := m.stragglerOf(p)
		st := stepTime(p)
		if st <= 0 || len(ref) < 2 || !s.back.IsZero() && st == s.outTime {
			// No step time, no one to compare with, or only the one it
			// was taken out with: judged once it reports a new one.
			s.since = time.Time{}
			continue
		}
		others := slices.Clone(ref)
		others = slices.Delete(others, slices.Index(others, st), slices.Index(others, st)+1)
		med := medianOf(others)
		if float64(st) <= pol.Factor*float64(med) {
			s.since = time.Time{}
			if !s.back.IsZero() && !now.Before(s.back.Add(policyWindow(pol))) {
				s.strikes, s.back = 0, time.Time{}
			}
			continue
		}
		if s.since.IsZero() {
			s.since = now
		}
		if end := s.since.Add(policyWindow(pol)); now.Before(end) {
			soon(end)
			continue
		}
		slow = append(slow, slowOne{p.ID, st, med, s.since})
	}
	sort.Slice(slow, func(i, j int) bool {
		ri, rj := float64(slow[i].st)/float64(slow[i].med), float64(slow[j].st)/float64(slow[j].med)
		if ri != rj {
			return ri > rj
		}
		return slow[i].id < slow[j].id
	})
	limit := min(len(survivors)-m.minReplicas(), (len(survivors)-1)/2)
	for i, s := range slow {
		if i >= limit {
			break
		}
		if _, o := out[s.id]; !o {
			out[s.id] = fmt.Sprintf("straggling (step time %v, %.1f× the others' median %v, since %v)",
				s.st.Round(time.Millisecond), float64(s.st)/float64(s.med), s.med.Round(time.Millisecond), now.Sub(s.since).Round(time.Second))
		}
	}
	for _, p := range admitted {
		s := m.slow[p.ID]
		if s == nil || !s.out || s.inc != p.Incarnation {
			continue
		}
		st := stepTime(p)
		keepsUp := st > 0 && st != s.outTime && len(ref) > 0 && float64(st) <= pol.Factor*float64(medianOf(ref))
		if keepsUp || !now.Before(s.until) {
			continue
		}
		if _, o := out[p.ID]; !o {
			out[p.ID] = fmt.Sprintf("straggling, out until %v", s.until.Sub(now).Round(time.Second))
		}
		soon(s.until)
	}
	return wake
}

// stragglersPublished records the take-outs and returns of q, the quorum
// that follows old.
func (m *Machine) stragglersPublished(old, q membership.Quorum) {
	pol := m.policy()
	if !policyOn(pol) {
		return
	}
	for _, p := range old.Participants {
		s := m.slow[p.ID]
		if s == nil || s.inc != p.Incarnation || s.since.IsZero() || q.Includes(p.ID, p.Incarnation) || q.Created.Sub(s.since) < policyWindow(pol) {
			continue
		}
		s.out, s.since, s.back = true, time.Time{}, time.Time{}
		s.strikes++
		s.until = q.Created.Add(policyProbation(pol) << min(s.strikes-1, maxProbationDoublings))
		if r, ok := m.members[p.ID]; ok {
			s.outTime = r.StepTime
		}
	}
	for _, p := range q.Participants {
		if s := m.slow[p.ID]; s != nil && s.out && s.inc == p.Incarnation {
			s.out, s.since, s.back = false, time.Time{}, q.Created
		}
	}
}
