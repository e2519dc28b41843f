package ft

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/ftcomm/ftcomm/membership"
)

// planSim drives membership's real quorum machine through random deaths,
// restarts, commit failures and formations that succeed at some ranks and
// fail at others (superseded, cut short), with formed-reports that reach
// the coordinator late or never. At every published quorum each rank
// computes its plan from what it holds, as Comm does; the ranks of each FT
// comm must make compatible choices.
type planSim struct {
	t         *testing.T
	rng       *rand.Rand
	m         *quorum.Machine
	now       time.Time
	inc       int64
	groupSize int
	ranks     map[string]*simRank
	late      []membership.MemberRecord // formed-reports still on their way
	dead      []string
	log       []string
	choices   map[string]int // how → count
}

type simRank struct {
	id   string
	inc  int64
	held view // the view whose comms it holds
}

func newPlanSim(t *testing.T, seed uint64, groups, groupSize int) *planSim {
	s := &planSim{t: t, rng: rand.New(rand.NewPCG(seed, 1)), now: time.Unix(1000, 0), groupSize: groupSize,
		ranks: map[string]*simRank{}, choices: map[string]int{}}
	s.m = quorum.NewMachine("job", quorum.Config{MinReplicas: 1, JoinTimeout: time.Second}, nil)
	for g := range groups {
		for r := range groupSize {
			s.start(memberID(fmt.Sprintf("g%d", g), r))
		}
	}
	return s
}

func (s *planSim) start(id string) {
	s.inc++
	g, _, _ := parseMemberID(id)
	s.ranks[id] = &simRank{id: id, inc: s.inc, held: view{ftRank: -1}}
	s.m.Upsert(s.now, membership.MemberRecord{ID: id, Group: g, GroupSize: s.groupSize, Incarnation: s.inc, WantQuorum: true})
}

func (s *planSim) record(id string) (membership.MemberRecord, bool) { return s.m.Member(id) }

// deliver lets some late formed-reports reach the coordinator.
func (s *planSim) deliver(all bool) {
	kept := s.late[:0]
	for _, r := range s.late {
		cur, ok := s.record(r.ID)
		switch {
		case !ok || cur.Incarnation != r.Incarnation:
		case all || s.rng.IntN(2) == 0:
			cur.Formed = r.Formed
			s.m.Upsert(s.now, cur)
		default:
			kept = append(kept, r)
		}
	}
	s.late = kept
}

func (s *planSim) event() {
	ids := slices.Sorted(func(yield func(string) bool) {
		for id := range s.ranks {
			if !yield(id) {
				return
			}
		}
	})
	id := ids[s.rng.IntN(len(ids))]
	switch k := s.rng.IntN(10); {
	case k < 2 && len(s.dead) < len(ids)-1: // a SIGKILL; the process comes back later
		if !slices.Contains(s.dead, id) {
			s.m.Remove(s.now, id, s.ranks[id].inc, quorum.Removal{Cause: quorum.PortClosed})
			s.dead = append(s.dead, id)
			s.log = append(s.log, "kill "+id)
		}
	case k < 4 && len(s.dead) > 0: // a killed process restarts
		id := s.dead[0]
		s.dead = s.dead[1:]
		s.start(id)
		s.log = append(s.log, "restart "+id)
	case k < 5: // killed and restarted before the coordinator noticed
		if !slices.Contains(s.dead, id) {
			s.m.Remove(s.now, id, s.ranks[id].inc, quorum.Removal{Cause: quorum.PortClosed})
			s.start(id)
			s.log = append(s.log, "kill+restart "+id)
		}
	case k < 6: // a commit failure in the current epoch
		if q, ok := s.m.Current(); ok {
			if r, ok := s.record(id); ok {
				r.CommitFailed = q.Epoch
				s.m.Upsert(s.now, r)
				s.log = append(s.log, fmt.Sprintf("commitfail %s %d", id, q.Epoch))
			}
		}
	default:
		s.deliver(false)
	}
}

// publish advances the machine; for a new quorum every rank plans, forms
// (or fails to), and reports.
func (s *planSim) publish() {
	s.now = s.now.Add(2 * time.Second)
	d := s.m.Advance(s.now)
	if d.Quorum == nil {
		return
	}
	q := *d.Quorum
	s.m.Published(q)
	s.log = append(s.log, fmt.Sprintf("epoch %d base %d [%s]", q.Epoch, q.Base, strings.Join(participantIDs(q), " ")))
	ps := participantsOf(q)
	for gr := range s.groupSize {
		s.checkFTComm(q, ps, gr)
	}
	// Formation outcomes: each rank forms or fails on its own; a formed
	// rank reports at once, later, or never (the coordinator may be down).
	for _, r := range s.ranks {
		if !q.Includes(r.id, r.inc) {
			continue
		}
		g, gr, _ := parseMemberID(r.id)
		v, err := deriveView(q.Epoch, ps, g, gr, s.groupSize)
		if err != nil {
			s.t.Fatal(err)
		}
		if s.rng.IntN(8) == 0 { // cut short: holds nothing now
			r.held = view{epoch: q.Epoch, ftRank: -1}
			continue
		}
		if !v.complete || !v.includes(r.id, r.inc) {
			v = view{epoch: q.Epoch, ftRank: -1} // sits out: holds no comms
		}
		r.held = v
		rec, _ := s.record(r.id)
		rec.Formed = q.Epoch
		switch k := s.rng.IntN(6); {
		case k < 3:
			s.m.Upsert(s.now, rec)
		case k < 5:
			s.late = append(s.late, rec)
		}
	}
}

// checkFTComm verifies that the members of FT comm gr of quorum q choose
// compatibly: the ranks reusing an old comm agree on how and on the
// exclusions, they all hold that comm, and every other member creates.
func (s *planSim) checkFTComm(q membership.Quorum, ps []participant, gr int) {
	var ft []participant
	type choice struct {
		how     reconfig
		exclude string
	}
	var reusers []string
	choices := map[choice][]string{}
	for _, p := range ps {
		g, r, _ := parseMemberID(p.ID)
		if r != gr {
			continue
		}
		v, err := deriveView(q.Epoch, ps, g, r, s.groupSize)
		if err != nil {
			s.t.Fatal(err)
		}
		if !v.complete {
			continue
		}
		ft = v.ft
		rk := s.ranks[p.ID]
		how, exclude := planFor(q.Base, rk.held, v, p.ID, p.Incarnation)
		c := choice{how, fmt.Sprint(exclude)}
		choices[c] = append(choices[c], p.ID)
		if how != freshComm {
			reusers = append(reusers, p.ID)
			if rk.held.epoch != q.Base {
				s.fail(q, "%s reuses epoch %d's comm but holds epoch %d's", p.ID, q.Base, rk.held.epoch)
			}
		}
	}
	if len(ft) == 0 {
		return
	}
	var reuse []choice
	for c := range choices {
		if c.how != freshComm {
			reuse = append(reuse, c)
		}
	}
	if len(reuse) > 1 {
		s.fail(q, "FT comm %d: ranks chose differently: %v", gr, choices)
	}
	if q.Prepared {
		// A prepared epoch is a pure grow of Base: every rank holding
		// Base's comm would grow it (none shrinks it), the others are
		// joiners; every rank forms it anew and the survivors may do so
		// in the background (ft/prepare.go).
		if len(reuse) != 1 || reuse[0].how != growTo {
			s.fail(q, "FT comm %d: epoch %d is prepared, but its ranks would move from epoch %d by %v", gr, q.Epoch, q.Base, choices)
		}
		s.choices["prepared"]++
	}
	for c := range choices {
		s.choices[c.how.String()] += len(choices[c])
	}
	if len(reuse) == 1 && reuse[0].how == shrinkTo && len(reusers) != len(ft) {
		s.fail(q, "FT comm %d shrinks, but %v create a new comm", gr, choices[choice{how: freshComm, exclude: "[]"}])
	}
	if len(reuse) == 1 && reuse[0].how == growTo {
		// The reusers are the old comm; joiners follow them in rank order.
		for i, p := range ft {
			if slices.Contains(reusers, p.ID) != (i < len(reusers)) {
				s.fail(q, "FT comm %d grows, but rank %d (%s) is out of place: reusers %v", gr, i, p.ID, reusers)
			}
		}
	}
}

func (s *planSim) fail(q membership.Quorum, format string, args ...any) {
	s.t.Helper()
	tail := s.log[max(0, len(s.log)-12):]
	s.t.Fatalf("epoch %d: "+format+"\nlast events:\n  %s", append([]any{q.Epoch}, append(args, strings.Join(tail, "\n  "))...)...)
}

func participantIDs(q membership.Quorum) []string {
	var ids []string
	for _, p := range q.Participants {
		ids = append(ids, fmt.Sprintf("%s#%d", p.ID, p.Incarnation))
	}
	return ids
}

// TestPlanRandomHistories: no sequence of deaths, restarts, commit
// failures, partial formations and late reports makes the ranks of one FT
// comm choose differently.
func TestPlanRandomHistories(t *testing.T) {
	for _, tc := range []struct{ groups, groupSize int }{{4, 1}, {3, 2}, {6, 1}} {
		t.Run(fmt.Sprintf("%dx%d", tc.groups, tc.groupSize), func(t *testing.T) {
			total := map[string]int{}
			for seed := range uint64(200) {
				s := newPlanSim(t, seed, tc.groups, tc.groupSize)
				for range 60 {
					s.event()
					if s.rng.IntN(2) == 0 {
						s.deliver(true)
					}
					s.publish()
				}
				for k, v := range s.choices {
					total[k] += v
				}
			}
			// The simulation must exercise every kind of move, or it proves little.
			for _, how := range []string{"shrink", "grow", "fresh", "prepared"} {
				if total[how] == 0 {
					t.Errorf("no rank chose %s in any history: %v", how, total)
				}
			}
			t.Logf("choices over all histories: %v", total)
		})
	}
}

// The scenario of the CI failure: epoch 2 is superseded while forming; a
// formed it, b did not. Epoch 3 must not let a grow while b creates.
func TestPlanSupersededWhileForming(t *testing.T) {
	ps1 := []participant{{ID: "a.0", Incarnation: 1}}
	ps2 := append(slices.Clone(ps1), participant{ID: "b.0", Incarnation: 2})
	ps3 := append(slices.Clone(ps2), participant{ID: "c.0", Incarnation: 3})
	v := func(epoch uint64, ps []participant, g string) view {
		x, err := deriveView(epoch, ps, g, 0, 1)
		if err != nil {
			t.Fatal(err)
		}
		return x
	}
	heldA, heldB := v(2, ps2, "a"), v(1, ps1, "b") // b never formed epoch 2 (it holds nothing of it)
	heldB.ftRank, heldB.ft = -1, nil
	// b did not report forming epoch 2, so the coordinator publishes Base 0.
	for _, r := range []struct {
		id   string
		inc  int64
		held view
	}{{"a.0", 1, heldA}, {"b.0", 2, heldB}} {
		how, _ := planFor(0, r.held, v(3, ps3, strings.TrimSuffix(r.id, ".0")), r.id, r.inc)
		if how != freshComm {
			t.Errorf("%s: %v with Base 0", r.id, how)
		}
	}
	// Had both reported, Base 2: a and b grow, c joins.
	heldB = v(2, ps2, "b")
	for _, r := range []struct {
		id   string
		inc  int64
		held view
	}{{"a.0", 1, heldA}, {"b.0", 2, heldB}} {
		how, _ := planFor(2, r.held, v(3, ps3, strings.TrimSuffix(r.id, ".0")), r.id, r.inc)
		if how != growTo {
			t.Errorf("%s: %v with Base 2", r.id, how)
		}
	}
}

func TestHistory(t *testing.T) {
	var h history
	for s := int64(1); s <= 10; s++ {
		e := uint64(1)
		if s > 4 {
			e = 3
		}
		if s > 7 {
			e = 6
		}
		h = h.commit(s, e)
	}
	if len(h) != 3 {
		t.Fatalf("segments %v", h)
	}
	for _, tc := range []struct {
		step  int64
		epoch uint64
		ok    bool
	}{{0, 0, true}, {1, 1, true}, {4, 1, true}, {5, 3, true}, {7, 3, true}, {8, 6, true}, {99, 6, true}, {-1, 0, false}} {
		if e, ok := h.epochOf(tc.step); e != tc.epoch || ok != tc.ok {
			t.Errorf("epochOf(%d) = %d, %v; want %d, %v", tc.step, e, ok, tc.epoch, tc.ok)
		}
	}
	got, err := decodeHistory(h.encode())
	if err != nil || !slices.Equal(got, h) {
		t.Fatalf("round trip %v → %v, %v", h, got, err)
	}
	for _, bad := range [][]byte{make([]byte, 15), append(h.encode(), h.encode()...)} {
		if _, err := decodeHistory(bad); err == nil {
			t.Errorf("decodeHistory accepted %d bytes", len(bad))
		}
	}
	// Bounded: the first segment stays, the oldest after it become a gap.
	var long history
	for e := range uint64(maxSegments + 10) {
		long = long.commit(int64(10*e+1), e+1)
	}
	if len(long) != maxSegments {
		t.Fatalf("%d segments kept", len(long))
	}
	if e, ok := long.epochOf(5); !ok || e != 1 {
		t.Errorf("epochOf(5) = %d, %v: the first segment must stay", e, ok)
	}
	if _, ok := long.epochOf(15); ok {
		t.Error("a step in the gap has an epoch")
	}
	if e, ok := long.epochOf(10*(maxSegments+9) + 1); !ok || e != maxSegments+10 {
		t.Errorf("the newest step: epoch %d, %v", e, ok)
	}
	if got, err := decodeHistory(long.encode()); err != nil || !slices.Equal(got, long) {
		t.Fatalf("round trip of a history with a gap: %v", err)
	}
	// Truncating again keeps one gap, from the first dropped step.
	again := long.commit(10*(maxSegments+10)+1, maxSegments+11)
	if len(again) != maxSegments || again[1].Epoch != 0 || again[1].From != long[1].From || again[2] == long[2] {
		t.Fatalf("second truncation: %v", again[:4])
	}
}

// commit must leave its receiver as it was: Comm compares the two to see
// whether the history changed (and the history it serves to healers with
// it). Appending in place and shifting out the oldest segment made a full
// history (64 epochs in which the replica committed) look unchanged, so
// the served history stopped at that point and healers reported steps of
// the job's history as rolled back (test/chaos's soak: 1,588 steps that
// all four replicas had committed together).
func TestHistoryCommitLeavesItsReceiver(t *testing.T) {
	full := make(history, maxSegments, maxSegments+1) // room to append in place
	for i := range full {
		full[i] = segment{Epoch: uint64(i + 1), From: int64(10 * (i + 1))}
	}
	before := slices.Clone(full)
	next := full.commit(10*(maxSegments+1), maxSegments+1)
	if !slices.Equal(full, before) {
		t.Fatalf("commit changed its receiver: %v", full[len(full)-3:])
	}
	if len(next) != maxSegments || next.last() != maxSegments+1 || next[0] != before[0] || next[1].Epoch != 0 {
		t.Fatalf("commit returned %d segments, last epoch %d, first %v", len(next), next.last(), next[0])
	}
	if next.last() == full.last() {
		t.Fatal("the new history and the old one end in the same epoch: Comm would keep serving the old one")
	}
	grow := make(history, 2, 8)
	grow[0], grow[1] = segment{Epoch: 1, From: 1}, segment{Epoch: 2, From: 5}
	if g := grow.commit(9, 3); len(grow) != 2 || len(g) != 3 || g.last() != 3 {
		t.Fatalf("growing: receiver %v, result %v", grow, g)
	}
}

func TestDiverged(t *testing.T) {
	hist := func(pairs ...int64) history { // step, epoch, step, epoch, …
		var h history
		for i := 0; i < len(pairs); i += 2 {
			h = append(h, segment{From: pairs[i], Epoch: uint64(pairs[i+1])})
		}
		return h
	}
	for _, tc := range []struct {
		name     string
		mine     history
		own      int64
		theirs   history
		from, to int64
		ok       bool
	}{
		{"behind on the same history", hist(1, 1), 5, hist(1, 1, 9, 4), 0, 0, false},
		{"nothing committed", nil, 0, hist(1, 1), 0, 0, false},
		// A partition: a and b committed step 6 in
		// epoch 2 with 4 participants; c and d redid it in epoch 3.
		{"same step, another epoch", hist(1, 1, 4, 2), 6, hist(1, 1, 4, 2, 6, 3), 6, 6, true},
		{"redone and gone further", hist(1, 1, 4, 2), 6, hist(1, 1, 4, 2, 6, 3), 6, 6, true},
		{"two steps lost", hist(1, 1, 5, 2), 6, hist(1, 1, 5, 3), 5, 6, true},
		{"older than both histories", hist(100, 7), 50, hist(200, 9), 0, 0, false},
		// test/chaos's soak: a replica restarted from the initial state was
		// alone in epoch 117 and committed steps 1–3 there, then healed to
		// the job's step 14,269, whose history dropped its middle (a gap)
		// but keeps its first segment.
		{"a run restarted alone", hist(1, 117), 3, hist(1, 1, 400, 0, 14000, 160), 1, 3, true},
		{"differs in the gap: unknown", hist(1, 1, 500, 117), 600, hist(1, 1, 400, 0, 14000, 160), 0, 0, false},
	} {
		from, to, ok := diverged(tc.mine, tc.own, tc.theirs)
		if from != tc.from || to != tc.to || ok != tc.ok {
			t.Errorf("%s: diverged = %d..%d %v; want %d..%d %v", tc.name, from, to, ok, tc.from, tc.to, tc.ok)
		}
	}
}

func TestAgree(t *testing.T) {
	for _, tc := range []struct {
		name string
		recs []stepRecord
		want agreement
	}{
		{"all equal", []stepRecord{{5, 2, "a"}, {5, 2, "b"}}, agreement{5, 2, []string{"a", "b"}}},
		{"one behind", []stepRecord{{3, 1, "a"}, {5, 2, "b"}, {5, 2, "c"}}, agreement{5, 2, []string{"b", "c"}}},
		{"fresh job", []stepRecord{{0, 0, "a"}, {0, 0, "b"}}, agreement{0, 0, []string{"a", "b"}}},
		// A step committed by a newer epoch wins over the same step
		// committed by an older one (the partition case).
		{"tie broken by the newer epoch", []stepRecord{{6, 2, "a"}, {6, 2, "b"}, {6, 3, "c"}, {6, 3, "d"}}, agreement{6, 3, []string{"c", "d"}}},
		// A minority's step that nobody redid stands: the others heal forward.
		{"a minority's commit stands", []stepRecord{{6, 2, "a"}, {5, 3, "c"}}, agreement{6, 2, []string{"a"}}},
	} {
		got := agree(tc.recs)
		if got.Step != tc.want.Step || got.Epoch != tc.want.Epoch || !slices.Equal(got.Sources, tc.want.Sources) {
			t.Errorf("%s: agree = %+v; want %+v", tc.name, got, tc.want)
		}
	}
}

func TestStepRecordRoundTrip(t *testing.T) {
	b := make([]byte, stepRecordSize)
	r := stepRecord{Step: 1 << 40, Epoch: 77, Addr: "10.0.0.1:31337"}
	if err := r.encode(b); err != nil {
		t.Fatal(err)
	}
	got, err := decodeStepRecord(b)
	if err != nil || got != r {
		t.Fatalf("%+v → %+v, %v", r, got, err)
	}
	if err := (stepRecord{Addr: strings.Repeat("x", maxAddrLen+1)}).encode(b); err == nil {
		t.Error("an over-long address was encoded")
	}
	b[16] = 200
	if _, err := decodeStepRecord(b); err == nil {
		t.Error("a record with a bad address length was decoded")
	}
}
