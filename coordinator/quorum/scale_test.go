package quorum

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// The decisions of a job of 100,000 members while records arrive: the
// coordinator decides after every batch of records it reads, so a
// decision that only waits must cost what changed, not a walk over every
// member.

// formed100K returns a machine whose first quorum holds n members that
// all asked, published at now, with the default batching.
func formed100K(b *testing.B, n int, now time.Time) (*Machine, []membership.MemberRecord) {
	return formedGroups(b, n, 1, now)
}

// formedGroups is formed100K with the members in replica groups of size
// ranks (MemberRecord.GroupSize; 1: none).
func formedGroups(b *testing.B, n, size int, now time.Time) (*Machine, []membership.MemberRecord) {
	b.Helper()
	m := NewMachine("j", DefaultConfig(), nil)
	recs := make([]membership.MemberRecord, n)
	for i := range recs {
		recs[i] = membership.MemberRecord{ID: fmt.Sprintf("m%06d", i), Incarnation: int64(i + 1), WantQuorum: true}
		if size > 1 {
			recs[i].Group, recs[i].GroupSize = fmt.Sprintf("g%05d", i/size), size
			recs[i].ID = fmt.Sprintf("%s.%d", recs[i].Group, i%size)
		}
		m.Upsert(now, recs[i])
	}
	d := m.Advance(now.Add(time.Hour))
	if d.Quorum == nil || len(d.Quorum.Participants) != n {
		b.Fatal("no quorum of everyone")
	}
	m.Published(*d.Quorum)
	return m, recs
}

// A job growing while its members register: each decision admits no one
// yet (FormWindow: joins still arrive), one joiner more each time.
func BenchmarkQuorumFormingDecision100K(b *testing.B) { benchmarkFormingDecision(b, 1) }

// The same in replica groups of 8 (MemberRecord.GroupSize): the joiners'
// groups are incomplete until their eighth rank arrives.
func BenchmarkQuorumFormingDecisionGroups100K(b *testing.B) { benchmarkFormingDecision(b, 8) }

func benchmarkFormingDecision(b *testing.B, size int) {
	now := time.Unix(0, 0)
	m, _ := formedGroups(b, 100000, size, now)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		now = now.Add(time.Microsecond)
		r := membership.MemberRecord{ID: fmt.Sprintf("x%07d", i), Incarnation: int64(1000000 + i), WantQuorum: true}
		if size > 1 {
			r.Group, r.GroupSize = fmt.Sprintf("x%06d", i/size), size
			r.ID = fmt.Sprintf("%s.%d", r.Group, i%size)
		}
		m.Upsert(now, r)
		// A group missing ranks is not a joiner yet: nothing to wait for
		// until the first complete one.
		complete := size == 1 || i >= size-1
		if d := m.Advance(now); d.Quorum != nil || (d.Waiting == "") == complete {
			b.Fatalf("decided %v, waiting %q: want a wait for more joins once a group is complete", d.Quorum != nil, d.Waiting)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e3, "µs/decision")
}

// 1,000 of 100,000 members die a millisecond apart, a decision after
// every 10 (the coordinator decides after each batch of deletions or
// probes' verdicts it reads): the first is published at once, the others wait
// for the rest (LossWindow), then one epoch drops them; then they come
// back (one epoch). Reported per mass death.
func BenchmarkQuorumMassDeath100K(b *testing.B) {
	const n, dead = 100000, 1000
	now := time.Unix(0, 0)
	m, recs := formed100K(b, n, now)
	inc := int64(n)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		now = now.Add(time.Minute) // a quiet spell: the first loss is published at once
		epochs := 0
		for k := 0; k < dead; k++ {
			r := &recs[k*(n/dead)]
			m.Remove(now, r.ID, 0, Removal{Cause: PortClosed})
			if k%10 != 0 {
				now = now.Add(time.Millisecond)
				continue
			}
			if d := m.Advance(now); d.Quorum != nil {
				m.Published(*d.Quorum)
				epochs++
			}
			now = now.Add(time.Millisecond)
		}
		now = now.Add(time.Second) // past the window, mass failure or not
		d := m.Advance(now)
		if d.Quorum == nil || len(d.Quorum.Participants) != n-dead {
			b.Fatal("no quorum without the dead")
		}
		m.Published(*d.Quorum)
		if epochs++; epochs != 2 {
			b.Fatalf("%d epochs for the mass death, want 2", epochs)
		}
		for k := 0; k < dead; k++ {
			r := &recs[k*(n/dead)]
			inc++
			r.Incarnation = inc
			m.Upsert(now, *r)
		}
		now = now.Add(time.Hour)
		if d := m.Advance(now); d.Quorum == nil || len(d.Quorum.Participants) != n {
			b.Fatal("the dead did not come back")
		} else {
			m.Published(*d.Quorum)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e6, "ms/mass-death")
}

// The aggregates kept as records change equal those made anew from every
// member (rebuild), and the job's step equals a walk over the previous
// participants, after every step of a random history: joins, restarts,
// health, asking, ShrinkOnly, commit failures, MinReplicas, runs, stall
// reports, finishing, steps up and down, replica groups (ranks of groups
// of two, a size changed or dropped), removals and publications.
func TestAggregatesFollowRecords(t *testing.T) {
	rng := rand.New(rand.NewPCG(35, 100000))
	now := time.Unix(0, 0)
	cfg := DefaultConfig()
	cfg.FormWindow, cfg.LossWindow = -1, -1
	m := NewMachine("j", cfg, nil)
	ids := []string{"a.0", "a.1", "b.0", "b.1", "c.0", "c.1", "d", "e"}
	grouped := func(r membership.MemberRecord, size int) membership.MemberRecord {
		if g, _, ok := strings.Cut(r.ID, "."); ok {
			r.Group, r.GroupSize = g, size
		}
		return r
	}
	inc := int64(0)
	for i := 0; i < 5000; i++ {
		now = now.Add(time.Millisecond)
		id := ids[rng.IntN(len(ids))]
		r, live := m.Member(id)
		switch op := rng.IntN(10); {
		case op == 0 && live:
			m.Remove(now, id, 0, Removal{Cause: Cause(rng.IntN(int(Finished) + 1))})
		case op == 1 || !live:
			inc++
			m.Upsert(now, grouped(membership.MemberRecord{ID: id, Incarnation: inc, WantQuorum: rng.IntN(4) > 0, Step: int64(rng.IntN(5))}, 2))
		case op <= 3:
			if d := m.Advance(now); d.Quorum != nil {
				m.Published(*d.Quorum)
			}
		default:
			switch rng.IntN(10) {
			case 0:
				r.Health = membership.Health(rng.IntN(3))
			case 1:
				r.WantQuorum = !r.WantQuorum
			case 2:
				r.ShrinkOnly = !r.ShrinkOnly
			case 3:
				if q, ok := m.Current(); ok {
					r.CommitFailed = q.Epoch - uint64(rng.IntN(2))
				}
			case 4:
				r.MinReplicas = rng.IntN(4)
			case 5:
				r.Run = []string{"", "r1", "r2"}[rng.IntN(3)]
			case 6:
				if r.Stall == nil {
					r.Stall = &membership.StepStall{Step: r.Step, Waiting: rng.IntN(2) == 0}
				} else {
					r.Stall = nil
				}
			case 7:
				r.Finished = rng.IntN(8) == 0
			case 8:
				r = grouped(r, rng.IntN(4)) // sizes 0 and 1: no group rule
			default:
				r.Step += int64(rng.IntN(5)) - 1
			}
			m.Upsert(now, r)
		}
		kept := m.agg
		kept.prevPos, kept.lost, kept.joining, kept.failed, kept.minAsked, kept.stalling =
			maps.Clone(kept.prevPos), maps.Clone(kept.lost), maps.Clone(kept.joining), maps.Clone(kept.failed),
			maps.Clone(kept.minAsked), maps.Clone(kept.stalling)
		kept.short, kept.shortSurv, kept.groups = maps.Clone(kept.short), maps.Clone(kept.shortSurv), map[string]*groupTally{}
		for g, t := range m.agg.groups {
			kept.groups[g] = &groupTally{ids: maps.Clone(t.ids), sizes: maps.Clone(t.sizes), surv: t.surv, join: t.join}
		}
		step, unknown := m.lastStep()
		wantStep, wantUnknown := walkLastStep(m)
		if step != wantStep || unknown != wantUnknown {
			t.Fatalf("op %d: the job's step %d (unknown %v), a walk says %d (%v)", i, step, unknown, wantStep, wantUnknown)
		}
		m.rebuild()
		for _, c := range []struct {
			name      string
			got, want map[string]struct{}
		}{{"lost", kept.lost, m.agg.lost}, {"joining", kept.joining, m.agg.joining}, {"failed", kept.failed, m.agg.failed},
			{"stalling", kept.stalling, m.agg.stalling}, {"short groups", kept.short, m.agg.short},
			{"short groups with survivors", kept.shortSurv, m.agg.shortSurv}} {
			if !maps.Equal(c.got, c.want) {
				t.Fatalf("op %d: %s %v, made anew %v", i, c.name, slices.Sorted(maps.Keys(c.got)), slices.Sorted(maps.Keys(c.want)))
			}
		}
		if !maps.Equal(kept.minAsked, m.agg.minAsked) || kept.eligible != m.agg.eligible || kept.shrinking != m.agg.shrinking ||
			kept.withRun != m.agg.withRun {
			t.Fatalf("op %d: counts %+v, made anew %+v", i, kept, m.agg)
		}
		if kept.shortJoin != m.agg.shortJoin || len(kept.groups) != len(m.agg.groups) {
			t.Fatalf("op %d: %d groups, %d joiners in short ones; made anew %d, %d", i, len(kept.groups), kept.shortJoin,
				len(m.agg.groups), m.agg.shortJoin)
		}
		for g, k := range kept.groups {
			w := m.agg.groups[g]
			if w == nil || !maps.Equal(k.ids, w.ids) || !maps.Equal(k.sizes, w.sizes) || k.surv != w.surv || k.join != w.join {
				t.Fatalf("op %d: group %s %+v, made anew %+v", i, g, k, w)
			}
		}
		// What rebuild does not know (the departures' steps) stays.
		m.agg.stepSeen, m.agg.stepStale = kept.stepSeen, kept.stepStale
	}
}

// walkLastStep is the job's last known step by a walk over the previous
// quorum's participants (what lastStep keeps as records change).
func walkLastStep(m *Machine) (step int64, unknown bool) {
	if m.prev == nil {
		return 0, false
	}
	step = m.prev.MaxStep
	for _, p := range m.prev.Participants {
		if r, ok := m.members[p.ID]; ok && r.Incarnation == p.Incarnation {
			step = max(step, r.Step)
		} else if d, ok := m.removed[p.ID]; ok {
			step, unknown = max(step, d.step), unknown || d.unknown
		}
	}
	return step, unknown
}

// A quorum that admits many joiners names the first few and counts the
// rest: its reason goes to the log and the record at every epoch of a
// growing job.
func TestQuorumReasonCountsManyJoiners(t *testing.T) {
	now := time.Unix(0, 0)
	cfg := DefaultConfig()
	cfg.FormWindow = -1
	m := NewMachine("j", cfg, nil)
	m.Upsert(now, membership.MemberRecord{ID: "a", Incarnation: 1, WantQuorum: true})
	m.Published(*m.Advance(now).Quorum)
	for i := 0; i < 40; i++ {
		m.Upsert(now, membership.MemberRecord{ID: fmt.Sprintf("b%02d", i), Incarnation: int64(2 + i), WantQuorum: true})
	}
	q := m.Advance(now).Quorum
	if q == nil || len(q.Added) != 40 {
		t.Fatalf("got %+v, want a quorum adding 40", q)
	}
	want := "joined b00,b01,b02,b03,b04,b05,b06,b07,b08,b09,b10,b11,b12,b13,b14,b15 and 24 more"
	if q.Reason != want {
		t.Fatalf("reason %q, want %q", q.Reason, want)
	}
}

// A quorum that loses many members at once names the first few and counts
// the rest, in its reason and its revocation's: a reason naming each of
// tens of thousands of members (leases lapsing on a starved etcd) once made
// a publication larger than etcd's request limit, which never went through.
func TestQuorumReasonCountsManyLosses(t *testing.T) {
	now := time.Unix(0, 0)
	cfg := DefaultConfig()
	cfg.FormWindow = -1
	const n, lost = 10000, 4000
	m := NewMachine("j", cfg, nil)
	for i := range n {
		m.Upsert(now, membership.MemberRecord{ID: fmt.Sprintf("m%05d", i), Incarnation: int64(1 + i), WantQuorum: true})
	}
	m.Published(*m.Advance(now).Quorum)
	for i := range lost {
		m.Remove(now, fmt.Sprintf("m%05d", 2*i+1), int64(2+2*i), Removal{Cause: LeaseExpired})
	}
	var d Decision
	for at := now; d.Quorum == nil && at.Before(now.Add(time.Minute)); at = at.Add(100 * time.Millisecond) {
		d = m.Advance(at)
	}
	q, rev := d.Quorum, d.Revocation
	if q == nil || len(q.Participants) != n-lost {
		t.Fatalf("got %+v, want a quorum of %d", q, n-lost)
	}
	if !strings.HasPrefix(q.Reason, "m00001 ") || !strings.Contains(q.Reason, fmt.Sprintf("and %d more lost", lost-maxLostNamed)) || len(q.Reason) > 2048 {
		t.Fatalf("reason (%d bytes) %.300q, want the first %d losses named and the rest counted", len(q.Reason), q.Reason, maxLostNamed)
	}
	if rev == nil || rev.Reason != q.Reason || len(rev.Failed) != lost {
		t.Fatalf("revocation %+.300v, want the quorum's reason and all %d failed", rev, lost)
	}
}
