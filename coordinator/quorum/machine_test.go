package quorum

import (
	"flag"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output of coordinator/quorum/testdata scripts")

// quorumScript drives a Machine with a small command language, in the
// manner of etcd-io/raft's interaction tests. Lines starting with "> " are
// commands; the lines after a command, up to a blank line, a comment or the
// next command, are the output it must print. "#" starts a comment.
//
//	config min=N timeout=D settle=D grace=D hold=D silent=N form=D formmax=D
//	       loss=D lossmax=D mass=N masswindow=D massmax=D
//	       factor=F window=D probation=D
//	                            (starts a scenario: a new machine, clock
//	                            and incarnations; the last three: the
//	                            straggler policy; D "default": the default)
//	join a b … [group=N]        register members (not asking yet); group=N:
//	                            ids "g.r" are ranks of replica groups of N
//	ask a b … [shrink]          members ask to take part (shrink: ShrinkOnly)
//	unshrink a …                members drop ShrinkOnly
//	step a=5 b=7                members report steps
//	steptime a=50ms b=60ms      members report their step times
//	health a critical|degraded|healthy [why]
//	commitfail a E              a's commit failed in epoch E
//	blame a E b c …             a's commit failed in epoch E, blaming b, c …
//	formed a b … E              members report holding epoch E's comms
//	finish a S                  a's loop ended the run at step S
//	suspect a D                 a peer reported a dead; verdict due within D
//	unsuspect a                 the check found a alive
//	revoke E by [b c …]         member "by" revokes epoch E (blaming b, c …)
//	stall a E S waiting|idle [for=D]  a reports its step S of epoch E stalled:
//	                            waiting in its collectives, or not stepping
//	reached a b=E c=E …         a connected again to b, c … (blamed in epoch E)
//	settings V                  the job's settings document becomes version V
//	leave a …                   members leave gracefully (Left)
//	die a …                     members' ports refuse connections (PortClosed)
//	evict a …                   an operator evicts members (Evicted)
//	lapse a …                   members' leases expire (LeaseExpired: they
//	                            may come back)
//	restart a [step=S] [group=N] a new incarnation of a registers (asking)
//	spare a b … [group=N] [host=H] [wait]
//	                            register spares (asking, unless wait)
//	host a b … H                members run on host H (placement hint)
//	target N                    the job's setting ftcomm.target_replicas
//	run R                       members that register from now on belong to run R
//	reload [lost=a,b]           a new coordinator takes over: a machine made
//	                            from the last quorum and the live records,
//	                            less those that went while none watched
//	tick D                      advance the clock by D, then Advance: prints
//	                            the quorum (then published), "waiting: …"
//	                            or "-" (with "wake +D" when a timer is due)
type quorumScript struct {
	t     *testing.T
	m     *Machine
	cfg   Config
	now   time.Time
	inc   int64
	ids   []string // every id that ever registered
	runID string   // the run of the members that register
}

func (s *quorumScript) rec(id string) membership.MemberRecord {
	r, ok := s.m.Member(id)
	if !ok {
		s.t.Fatalf("no live member %q", id)
	}
	return r
}

func (s *quorumScript) run(line string) []string {
	f := strings.Fields(line)
	cmd, args := f[0], f[1:]
	switch cmd {
	case "config":
		cfg := DefaultConfig()
		cfg.FailureSettle = 0 // scripts that want it say settle=D
		cfg.FormWindow = -1   // and form=D
		cfg.LossWindow = -1   // and loss=D
		cfg.MassLoss = -1     // and mass=N
		for _, a := range args {
			k, v, _ := strings.Cut(a, "=")
			d, _ := time.ParseDuration(v) // "default": 0, the default
			switch k {
			case "min":
				cfg.MinReplicas, _ = strconv.Atoi(v)
			case "timeout":
				cfg.JoinTimeout = d
			case "settle":
				cfg.FailureSettle = d
			case "form":
				cfg.FormWindow = d
			case "formmax":
				cfg.FormMaxWait = d
			case "loss":
				cfg.LossWindow = d
			case "lossmax":
				cfg.LossMaxWait = d
			case "mass":
				cfg.MassLoss, _ = strconv.Atoi(v) // "default": 0
			case "masswindow":
				cfg.MassLossWindow = d
			case "massmax":
				cfg.MassLossMaxWait = d
			case "grace":
				cfg.HolderGrace = d
			case "hold":
				cfg.BlameHold = d
			case "silent":
				cfg.SilentEpochs, _ = strconv.Atoi(v)
			case "factor":
				cfg.Stragglers.Factor, _ = strconv.ParseFloat(v, 64)
			case "window":
				cfg.Stragglers.Window = d
			case "probation":
				cfg.Stragglers.Probation = d
			default:
				s.t.Fatalf("unknown config %q", a)
			}
		}
		if err := cfg.Validate(); err != nil {
			s.t.Fatal(err)
		}
		*s = quorumScript{t: s.t, cfg: cfg, now: time.Unix(1000, 0), m: NewMachine("job", cfg, nil)}
	case "join":
		size, ids := groupArg(args)
		for _, id := range ids {
			s.inc++
			s.ids = append(s.ids, id)
			s.m.Upsert(s.now, withGroup(membership.MemberRecord{Job: "job", ID: id, Addr: id + ":1", Incarnation: s.inc, Run: s.runID}, size))
		}
	case "restart":
		var size int
		size, args = groupArg(args)
		var step int64
		if len(args) > 1 {
			v, ok := strings.CutPrefix(args[1], "step=")
			if !ok {
				s.t.Fatalf("restart: %q", line)
			}
			step, _ = strconv.ParseInt(v, 10, 64)
		}
		s.inc++
		s.ids = append(s.ids, args[0])
		s.m.Upsert(s.now, withGroup(membership.MemberRecord{Job: "job", ID: args[0], Addr: args[0] + ":1", Incarnation: s.inc, WantQuorum: true, Step: step, Run: s.runID}, size))
	case "spare":
		size, ids := groupArg(args)
		host, ask := "", true
		var named []string
		for _, a := range ids {
			if v, ok := strings.CutPrefix(a, "host="); ok {
				host = v
			} else if a == "wait" {
				ask = false
			} else {
				named = append(named, a)
			}
		}
		for _, id := range named {
			s.inc++
			s.ids = append(s.ids, id)
			s.m.Upsert(s.now, withGroup(membership.MemberRecord{Job: "job", ID: id, Addr: id + ":1", Incarnation: s.inc, Run: s.runID,
				Spare: true, Host: host, WantQuorum: ask, Joined: s.now}, size))
		}
	case "host":
		for _, id := range args[:len(args)-1] {
			r := s.rec(id)
			r.Host = args[len(args)-1]
			s.m.Upsert(s.now, r)
		}
	case "target":
		n, _ := strconv.Atoi(args[0])
		s.m.SetTarget(n)
	case "prepared-grow":
		s.m.SetPreparedGrow(args[0] == "on")
	case "run":
		s.runID = args[0]
	case "reload":
		lost := map[string]bool{}
		if len(args) > 0 {
			v, _ := strings.CutPrefix(args[0], "lost=")
			for _, id := range strings.Split(v, ",") {
				lost[id] = true
			}
		}
		q, ok := s.m.Current()
		m := NewMachine("job", s.cfg, nil)
		if ok {
			m = NewMachine("job", s.cfg, &q)
		}
		for _, id := range s.ids {
			if r, live := s.m.Member(id); live && !lost[id] {
				m.Upsert(s.now, r)
			}
		}
		s.m = m
	case "ask":
		shrink := args[len(args)-1] == "shrink"
		if shrink {
			args = args[:len(args)-1]
		}
		for _, id := range args {
			r := s.rec(id)
			r.WantQuorum, r.ShrinkOnly = true, shrink
			s.m.Upsert(s.now, r)
		}
	case "unshrink":
		for _, id := range args {
			r := s.rec(id)
			r.ShrinkOnly = false
			s.m.Upsert(s.now, r)
		}
	case "step":
		for _, a := range args {
			id, v, _ := strings.Cut(a, "=")
			r := s.rec(id)
			r.Step, _ = strconv.ParseInt(v, 10, 64)
			s.m.Upsert(s.now, r)
		}
	case "health":
		r := s.rec(args[0])
		if err := r.Health.UnmarshalText([]byte(args[1])); err != nil {
			s.t.Fatal(err)
		}
		r.HealthReason = strings.Join(args[2:], " ")
		s.m.Upsert(s.now, r)
	case "steptime":
		for _, a := range args {
			id, v, _ := strings.Cut(a, "=")
			r := s.rec(id)
			r.StepTime, _ = time.ParseDuration(v)
			s.m.Upsert(s.now, r)
		}
	case "commitfail", "blame":
		r := s.rec(args[0])
		e, _ := strconv.ParseUint(args[1], 10, 64)
		r.CommitFailed, r.Blamed = e, args[2:]
		s.m.Upsert(s.now, r)
	case "finish":
		r := s.rec(args[0])
		r.Step, _ = strconv.ParseInt(args[1], 10, 64)
		r.Finished, r.WantQuorum = true, false
		s.m.Upsert(s.now, r)
	case "suspect":
		d, _ := time.ParseDuration(args[1])
		s.m.Suspect(s.now, args[0], s.rec(args[0]).Incarnation, s.now.Add(d))
	case "unsuspect":
		s.m.Unsuspect(args[0], s.rec(args[0]).Incarnation)
	case "formed":
		e, _ := strconv.ParseUint(args[len(args)-1], 10, 64)
		for _, id := range args[:len(args)-1] {
			r := s.rec(id)
			r.Formed = e
			s.m.Upsert(s.now, r)
		}
	case "stall":
		r := s.rec(args[0])
		e, _ := strconv.ParseUint(args[1], 10, 64)
		st, _ := strconv.ParseInt(args[2], 10, 64)
		rep := membership.StepStall{Epoch: e, Step: st, Waiting: args[3] == "waiting", For: time.Second, Bound: time.Second}
		if len(args) > 4 {
			v, _ := strings.CutPrefix(args[4], "for=")
			rep.For, _ = time.ParseDuration(v)
		}
		r.Stall = &rep
		s.m.Upsert(s.now, r)
	case "reached":
		r := s.rec(args[0])
		r.Reached = maps.Clone(r.Reached)
		if r.Reached == nil {
			r.Reached = map[string]uint64{}
		}
		for _, a := range args[1:] {
			id, v, _ := strings.Cut(a, "=")
			r.Reached[id], _ = strconv.ParseUint(v, 10, 64)
		}
		s.m.Upsert(s.now, r)
	case "settings":
		v, _ := strconv.ParseUint(args[0], 10, 64)
		s.m.SetSettings(membership.SettingsRef{Version: v, Digest: fmt.Sprintf("d%d", v)})
	case "revoke":
		e, _ := strconv.ParseUint(args[0], 10, 64)
		s.m.Revoke(s.now, membership.Revocation{Epoch: e, By: args[1], Reason: "peer failed", Failed: args[2:]})
	case "leave", "die", "evict", "lapse":
		cause := map[string]Cause{"leave": Left, "die": PortClosed, "evict": Evicted, "lapse": LeaseExpired}[cmd]
		for _, id := range args {
			s.m.Remove(s.now, id, 0, Removal{Cause: cause})
		}
	case "tick":
		d, err := time.ParseDuration(args[0])
		if err != nil {
			s.t.Fatal(err)
		}
		s.now = s.now.Add(d)
		dec := s.m.Advance(s.now)
		switch {
		case dec.Quorum != nil:
			q := dec.Quorum
			var ids []string
			for _, p := range q.Participants {
				ids = append(ids, fmt.Sprintf("%s#%d", p.ID, p.Incarnation))
			}
			head := fmt.Sprintf("epoch %d [%s] maxstep=%d", q.Epoch, strings.Join(ids, " "), q.MaxStep)
			if q.Base != 0 {
				head += fmt.Sprintf(" base=%d", q.Base)
			}
			if q.Prepared {
				head += " prepared"
			}
			if q.Final != 0 {
				head += fmt.Sprintf(" final=%d", q.Final)
			}
			if len(q.FinalFrom) > 0 {
				head += fmt.Sprintf(" from=%v", q.FinalFrom)
			}
			if q.RunStep > q.MaxStep {
				head += fmt.Sprintf(" runstep=%d", q.RunStep)
			}
			if q.Settings != nil {
				head += fmt.Sprintf(" settings=v%d", q.Settings.Version)
			}
			if len(q.Departed) > 0 {
				head += fmt.Sprintf(" departed=%v", q.Departed)
			}
			if len(q.Promoted) > 0 {
				head += fmt.Sprintf(" promoted=%v", q.Promoted)
			}
			if len(q.Replaced) > 0 {
				head += fmt.Sprintf(" replaced=%v", q.Replaced)
			}
			out := []string{head, "  reason: " + q.Reason}
			if r := dec.Revocation; r != nil {
				out = append(out, fmt.Sprintf("  revoke %d failed=%v", r.Epoch, r.Failed))
			}
			s.m.Published(*q)
			return out
		case dec.Waiting != "":
			w := "waiting: " + dec.Waiting
			if !dec.WakeAt.IsZero() {
				w += fmt.Sprintf(" (wake +%v)", dec.WakeAt.Sub(s.now))
			}
			out := []string{w}
			if r := dec.Revocation; r != nil {
				out = append(out, fmt.Sprintf("  revoke %d failed=%v: %s", r.Epoch, r.Failed, r.Reason))
				r.By = "coordinator"
				s.m.Revoke(s.now, *r)
			}
			return out
		case !dec.WakeAt.IsZero():
			return []string{fmt.Sprintf("- (wake +%v)", dec.WakeAt.Sub(s.now))}
		default:
			return []string{"-"}
		}
	default:
		s.t.Fatalf("unknown command %q", line)
	}
	return nil
}

// TestQuorumScripts runs every script in testdata: the rules of
// docs/quorum.md, one file per rule (lighthouse: torchft's; history: the
// lapsed holders; cut; silence; finish: the end of a run and departed
// members; stragglers; forming: batched joins). go test -run
// TestQuorumScripts ./coordinator/quorum -args -rewrite updates the expected
// output after a deliberate change; review the diff.
func TestQuorumScripts(t *testing.T) {
	testutil.RunScripts(t, "testdata/*.txt", *rewrite, func(t *testing.T) func(string) []string {
		s := &quorumScript{t: t, now: time.Unix(1000, 0)}
		return s.run
	})
}

func TestQuorumStaleRemoveAndUpsert(t *testing.T) {
	m := NewMachine("j", DefaultConfig(), nil)
	now := time.Unix(0, 0)
	m.Upsert(now, membership.MemberRecord{ID: "a", Incarnation: 5, WantQuorum: true})
	m.Upsert(now, membership.MemberRecord{ID: "a", Incarnation: 3, WantQuorum: true, Step: 99}) // older: ignored
	if r, _ := m.Member("a"); r.Incarnation != 5 || r.Step != 0 {
		t.Fatalf("stale upsert applied: %+v", r)
	}
	m.Remove(now, "a", 3, Removal{Cause: PortClosed})
	if _, ok := m.Member("a"); !ok {
		t.Fatal("removal of an older incarnation removed the newer")
	}
	m.Remove(now, "a", 5, Removal{Cause: PortClosed})
	if m.Len() != 0 {
		t.Fatal("not removed")
	}
}

// Many members: 1000 join over time; the quorum forms once when all have
// asked, then each death and each join is one epoch.
func TestQuorumManyMembers(t *testing.T) {
	m := NewMachine("j", Config{MinReplicas: 500, JoinTimeout: time.Minute}, nil)
	now := time.Unix(0, 0)
	const n = 1000
	for i := 0; i < n; i++ {
		m.Upsert(now, membership.MemberRecord{ID: fmt.Sprintf("m%04d", i), Incarnation: int64(i + 1), Step: int64(i % 7)})
	}
	for i := 0; i < n; i++ {
		r, _ := m.Member(fmt.Sprintf("m%04d", i))
		r.WantQuorum = true
		m.Upsert(now, r)
		if i < n-1 {
			if d := m.Advance(now); d.Quorum != nil || d.Waiting == "" {
				t.Fatalf("after %d askers: %+v", i+1, d)
			}
		}
	}
	d := m.Advance(now.Add(DefaultFormWindow)) // once joins are quiet
	if d.Quorum == nil || len(d.Quorum.Participants) != n || d.Quorum.MaxStep != 6 {
		t.Fatalf("decision %+v", d)
	}
	for i, p := range d.Quorum.Participants {
		if p.ID != fmt.Sprintf("m%04d", i) {
			t.Fatalf("rank %d is %s", i, p.ID)
		}
	}
	m.Published(*d.Quorum)
	for i := 0; i < 10; i++ {
		m.Remove(now, fmt.Sprintf("m%04d", i*100), 0, Removal{Cause: PortClosed})
	}
	d = m.Advance(now.Add(DefaultLossWindow)) // once losses are quiet: one epoch
	if d.Quorum == nil || d.Quorum.Epoch != 2 || len(d.Quorum.Participants) != n-10 || len(d.Revocation.Failed) != 10 {
		t.Fatalf("after deaths: %+v", d.Quorum)
	}
	// Survivors keep their order: rank 0 is now m0001.
	if d.Quorum.Participants[0].ID != "m0001" {
		t.Fatalf("rank 0 is %s", d.Quorum.Participants[0].ID)
	}
}

func BenchmarkQuorumAdvance10K(b *testing.B)  { benchmarkQuorumAdvance(b, 10000) }
func BenchmarkQuorumAdvance100K(b *testing.B) { benchmarkQuorumAdvance(b, 100000) }

func benchmarkQuorumAdvance(b *testing.B, n int) {
	now := time.Unix(0, 0)
	// No batching of joins or losses: each Advance decides.
	m := NewMachine("j", Config{MinReplicas: n / 2, JoinTimeout: time.Minute, FormWindow: -1, LossWindow: -1}, nil)
	for i := 0; i < n; i++ {
		m.Upsert(now, membership.MemberRecord{ID: fmt.Sprintf("member-%05d", i), Incarnation: int64(i + 1), WantQuorum: true})
	}
	d := m.Advance(now)
	if d.Quorum == nil {
		b.Fatal("no initial quorum")
	}
	m.Published(*d.Quorum)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		// One death and its replacement per round: each Advance forms a
		// new quorum over 10K members (the expensive path).
		id := fmt.Sprintf("member-%05d", i%n)
		r, _ := m.Member(id)
		m.Remove(now, id, 0, Removal{Cause: PortClosed})
		d := m.Advance(now)
		if d.Quorum == nil {
			b.Fatal("no quorum after a death")
		}
		m.Published(*d.Quorum)
		r.Incarnation += int64(n)
		m.Upsert(now, r)
		if d := m.Advance(now); d.Quorum == nil {
			b.Fatal("no quorum after a join")
		} else {
			m.Published(*d.Quorum)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(2*b.N)/1e6, "ms/decision")
}

// A record update (a heartbeat's step) of one of 100,000 participants:
// the coordinator observes every one while a job forms and trains. It
// asked the previous quorum whether the member took part by a scan of its
// participants: 100,000 updates were 10^10 comparisons (the device
// host's profile of a 100K job forming: 17 % of the coordinator's CPU).
func BenchmarkQuorumObserve100K(b *testing.B) {
	benchmarkQuorumUpdate(b, func(r *membership.MemberRecord) { r.Step++ })
}

// A heartbeat that carries a new step time, at 100,000 members: Upsert
// asked the job's straggler policy, which walked every member's record.
func BenchmarkQuorumStepTime100K(b *testing.B) {
	benchmarkQuorumUpdate(b, func(r *membership.MemberRecord) { r.StepTime += time.Millisecond })
}

// benchmarkQuorumUpdate upserts records changed by change, spread over the
// 100,000 participants of a published quorum.
func benchmarkQuorumUpdate(b *testing.B, change func(*membership.MemberRecord)) {
	const n = 100000
	now := time.Unix(0, 0)
	m := NewMachine("j", Config{MinReplicas: 1, JoinTimeout: time.Minute, FormWindow: -1}, nil)
	recs := make([]membership.MemberRecord, n)
	for i := range recs {
		recs[i] = membership.MemberRecord{ID: fmt.Sprintf("m%06d", i), Incarnation: int64(i + 1), WantQuorum: true}
		m.Upsert(now, recs[i])
	}
	d := m.Advance(now)
	if d.Quorum == nil {
		b.Fatal("no quorum")
	}
	m.Published(*d.Quorum)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r := &recs[(i*7919)%n] // spread over the list
		change(r)
		m.Upsert(now, *r)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e3, "µs/update")
}

// The first quorum of 10K members that all asked: one decision.
func BenchmarkQuorumForm10K(b *testing.B) {
	const n = 10000
	now := time.Unix(0, 0)
	recs := make([]membership.MemberRecord, n)
	for i := range recs {
		recs[i] = membership.MemberRecord{ID: fmt.Sprintf("member-%05d", i), Incarnation: int64(i + 1), WantQuorum: true, Step: int64(i)}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		m := NewMachine("j", Config{MinReplicas: n / 2, JoinTimeout: time.Minute, FormWindow: -1}, nil)
		for _, r := range recs {
			m.Upsert(now, r)
		}
		b.StartTimer()
		if d := m.Advance(now); d.Quorum == nil || len(d.Quorum.Participants) != n {
			b.Fatal("no quorum")
		}
	}
}

// Upsert says when a record may change the decision, so that the
// coordinator runs Advance for those only (not for every heartbeat).
func TestQuorumUpsertSaysWhatMatters(t *testing.T) {
	now := time.Unix(0, 0)
	m := NewMachine("j", DefaultConfig(), nil)
	base := membership.MemberRecord{ID: "a", Incarnation: 1, WantQuorum: true}
	if !m.Upsert(now, base) || !m.Upsert(now, membership.MemberRecord{ID: "b", Incarnation: 2, WantQuorum: true}) {
		t.Fatal("a new member does not matter")
	}
	d := m.Advance(now.Add(DefaultFormWindow)) // once joins are quiet
	m.Published(*d.Quorum)
	for _, c := range []struct {
		name string
		mut  func(*membership.MemberRecord)
		want bool
	}{
		{"step", func(r *membership.MemberRecord) { r.Step = 9 }, false},
		{"step time without a policy", func(r *membership.MemberRecord) { r.StepTime = time.Second }, false},
		{"formed", func(r *membership.MemberRecord) { r.Formed = 1 }, false},
		{"health", func(r *membership.MemberRecord) { r.Health = membership.Critical }, true},
		{"commit failure", func(r *membership.MemberRecord) { r.CommitFailed = 1 }, true},
		{"blame", func(r *membership.MemberRecord) { r.CommitFailed, r.Blamed = 1, []string{"b"} }, true},
		{"finished", func(r *membership.MemberRecord) { r.Finished = true }, true},
		{"a straggler policy", func(r *membership.MemberRecord) { r.Stragglers = &membership.StragglerPolicy{Factor: 2} }, true},
		{"new incarnation", func(r *membership.MemberRecord) { r.Incarnation = 3 }, true},
	} {
		r := base
		c.mut(&r)
		if got := m.Upsert(now, r); got != c.want {
			t.Errorf("%s: Upsert = %v, want %v", c.name, got, c.want)
		}
		m = NewMachine("j", DefaultConfig(), nil)
		m.Upsert(now, base)
		m.Upsert(now, membership.MemberRecord{ID: "b", Incarnation: 2, WantQuorum: true})
		d := m.Advance(now.Add(DefaultFormWindow))
		m.Published(*d.Quorum)
	}
	// A member left out for its stall shows life by forming (sitting out)
	// a later epoch: that report matters, though no blame is held.
	m = NewMachine("j", DefaultConfig(), nil)
	m.Upsert(now, membership.MemberRecord{ID: "a", Incarnation: 1, WantQuorum: true})
	m.Upsert(now, membership.MemberRecord{ID: "b", Incarnation: 2, WantQuorum: true})
	m.Published(*m.Advance(now.Add(DefaultFormWindow)).Quorum)
	ra, _ := m.Member("a")
	rb, _ := m.Member("b")
	ra.Stall = &membership.StepStall{Epoch: 1, Step: 3, Waiting: true}
	rb.Stall = &membership.StepStall{Epoch: 1, Step: 3}
	m.Upsert(now, ra)
	m.Upsert(now, rb)
	if d := m.Advance(now); d.Quorum == nil || len(d.Quorum.Participants) != 1 {
		t.Fatalf("the stalled member was not left out: %+v", d)
	} else {
		m.Published(*d.Quorum)
	}
	rb.Formed = 2
	if !m.Upsert(now, rb) {
		t.Error("a stalled member's sign of life does not matter")
	}
	if d := m.Advance(now.Add(DefaultFormWindow)); d.Quorum == nil || len(d.Quorum.Participants) != 2 {
		t.Fatalf("the stalled member, back, was not admitted: %+v", d)
	}
	m = NewMachine("j", DefaultConfig(), nil)
	m.Upsert(now, base)
	m.Upsert(now, membership.MemberRecord{ID: "b", Incarnation: 2, WantQuorum: true})
	m.Published(*m.Advance(now.Add(DefaultFormWindow)).Quorum)

	// With a policy, step times matter; while a quorum waits, steps do.
	m.Upsert(now, membership.MemberRecord{ID: "a", Incarnation: 1, WantQuorum: true, Stragglers: &membership.StragglerPolicy{Factor: 2}})
	if r, _ := m.Member("a"); !m.Upsert(now, func() membership.MemberRecord { r.StepTime = time.Second; return r }()) {
		t.Error("a step time under a straggler policy does not matter")
	}
	if r, _ := m.Member("a"); !m.Upsert(now, func() membership.MemberRecord { r.Step, r.StepTime = r.Step+1, 2*time.Second; return r }()) {
		t.Error("a step time that comes with a new step (every heartbeat) does not matter")
	}
	m.Upsert(now, membership.MemberRecord{ID: "c", Incarnation: 5, MinReplicas: 9})
	m.Remove(now, "b", 0, Removal{Cause: Left})
	if d := m.Advance(now); d.Waiting == "" {
		t.Fatalf("no wait: %+v", d)
	}
	if r, _ := m.Member("a"); !m.Upsert(now, func() membership.MemberRecord { r.Step = 4; return r }()) {
		t.Error("a step while the quorum waits does not matter")
	}
}

// The job's straggler policy, kept between records, follows every change
// of a member's policy: a member that asks for one, changes it, drops it,
// or goes.
func TestStragglerPolicyFollowsRecords(t *testing.T) {
	now := time.Unix(0, 0)
	m := NewMachine("j", DefaultConfig(), nil)
	on := func(f float64) *membership.StragglerPolicy { return &membership.StragglerPolicy{Factor: f} }
	check := func(what string, want float64) {
		t.Helper()
		if got := m.policy().Factor; got != want {
			t.Errorf("%s: policy factor %v, want %v", what, got, want)
		}
	}
	m.Upsert(now, membership.MemberRecord{ID: "a", Incarnation: 1})
	check("no member asks", m.cfg.Stragglers.Factor)
	m.Upsert(now, membership.MemberRecord{ID: "b", Incarnation: 2, Stragglers: on(2)})
	check("b asks", 2)
	m.Upsert(now, membership.MemberRecord{ID: "a", Incarnation: 1, Stragglers: on(3)})
	check("a asks for a larger factor", 3)
	m.Upsert(now, membership.MemberRecord{ID: "a", Incarnation: 1, StepTime: time.Second, Stragglers: on(3)})
	check("a's step time changes", 3)
	m.Upsert(now, membership.MemberRecord{ID: "a", Incarnation: 1})
	check("a drops its policy", 2)
	m.Remove(now, "b", 2, Removal{Cause: PortClosed})
	check("b goes", m.cfg.Stragglers.Factor)
	m.Upsert(now, membership.MemberRecord{ID: "b", Incarnation: 3, Stragglers: on(4)})
	check("b is back, asking", 4)
}

// groupArg takes a "group=N" argument out of args: the members named are
// ranks "<group>.<rank>" of replica groups of N ranks.
func groupArg(args []string) (int, []string) {
	var rest []string
	size := 0
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "group="); ok {
			size, _ = strconv.Atoi(v)
			continue
		}
		rest = append(rest, a)
	}
	return size, rest
}

// withGroup makes r a rank of its replica group (named by r.ID up to its
// last '.') of size ranks, when size is above 0.
func withGroup(r membership.MemberRecord, size int) membership.MemberRecord {
	if size > 0 {
		if i := strings.LastIndexByte(r.ID, '.'); i > 0 {
			r.Group, r.GroupSize = r.ID[:i], size
		}
	}
	return r
}
