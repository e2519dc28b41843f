package membership

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
)

// quorumScript drives a Machine with a small command language, in the
// manner of etcd-io/raft's interaction tests. Lines starting with "> " are
// commands; the lines after a command are the output it must print.
//
//	config min=N timeout=D settle=D grace=D hold=D silent=N form=D formmax=D
//	       factor=F window=D probation=D     (before anything else; the
//	                            last three: the straggler policy)
//	join a b …                  register members (not asking yet)
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
//	leave|die|evict a …         members go for good (reason printed in the quorum)
//	lapse a …                   members' leases expire (they may come back)
//	restart a [step=S]          a new incarnation of a registers (asking)
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
	cfg   QuorumConfig
	now   time.Time
	inc   int64
	ids   []string // every id that ever registered
	runID string   // the run of the members that register
}

func (s *quorumScript) rec(id string) MemberRecord {
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
		cfg := DefaultQuorumConfig()
		cfg.FailureSettle = 0 // scripts that want it say settle=D
		cfg.FormWindow = -1   // and form=D
		for _, a := range args {
			k, v, _ := strings.Cut(a, "=")
			d, _ := time.ParseDuration(v)
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
		s.cfg = cfg
		s.m = NewMachine("job", cfg, nil)
	case "join":
		for _, id := range args {
			s.inc++
			s.ids = append(s.ids, id)
			s.m.Upsert(s.now, MemberRecord{Job: "job", ID: id, Addr: id + ":1", Incarnation: s.inc, Run: s.runID})
		}
	case "restart":
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
		s.m.Upsert(s.now, MemberRecord{Job: "job", ID: args[0], Addr: args[0] + ":1", Incarnation: s.inc, WantQuorum: true, Step: step, Run: s.runID})
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
	case "revoke":
		e, _ := strconv.ParseUint(args[0], 10, 64)
		s.m.Revoke(s.now, Revocation{Epoch: e, By: args[1], Reason: "peer failed", Failed: args[2:]})
	case "leave":
		for _, id := range args {
			s.m.Left(s.now, id, 0, "left")
		}
	case "die", "evict":
		why := map[string]string{"die": "died (gossip)", "evict": "evicted"}[cmd]
		for _, id := range args {
			s.m.Remove(s.now, id, 0, why)
		}
	case "lapse":
		for _, id := range args {
			s.m.Lapsed(s.now, id, 0, "lease expired")
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
			if q.Final != 0 {
				head += fmt.Sprintf(" final=%d", q.Final)
			}
			if len(q.Departed) > 0 {
				head += fmt.Sprintf(" departed=%v", q.Departed)
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

func runQuorumScript(t *testing.T, script string) {
	t.Helper()
	s := &quorumScript{t: t, now: time.Unix(1000, 0)}
	var got, want []string
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(script), "\n") {
		l = strings.TrimRight(strings.TrimLeft(l, "\t"), " ")
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		lines = append(lines, l)
	}
	for _, l := range lines {
		if cmd, ok := strings.CutPrefix(l, "> "); ok {
			got = append(got, l)
			want = append(want, l)
			got = append(got, s.run(cmd)...)
		} else {
			want = append(want, l)
		}
	}
	if g, w := strings.Join(got, "\n"), strings.Join(want, "\n"); g != w {
		t.Errorf("script output differs\n--- got\n%s\n--- want\n%s", g, w)
	}
}

func TestQuorumScripts(t *testing.T) {
	for name, script := range map[string]string{
		"a failure with everyone alive waits for more reports": `
		> config min=1 settle=100ms
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		# b's commit fails first (its comm was revoked); a's report, blaming
		# c, follows 30 ms later and the coordinator checks c
		> commitfail b 1
		> tick 0s
		waiting: epoch 1 failed; waiting 100ms for more reports (wake +100ms)
		  revoke 1 failed=[]: commit failed in epoch 1 (b)
		> tick 30ms
		waiting: epoch 1 failed; waiting 70ms for more reports (wake +70ms)
		> suspect c 600ms
		> tick 70ms
		waiting: verifying the reported death of c (wake +530ms)
		> die c
		> tick 5ms
		epoch 2 [a#1 b#2] maxstep=0
		  reason: c died (gossip); commit failed in epoch 1 (b)
		# a plain commit failure forms the next epoch after the settle time
		> commitfail a 2
		> tick 0s
		waiting: epoch 2 failed; waiting 100ms for more reports (wake +100ms)
		  revoke 2 failed=[]: commit failed in epoch 2 (a)
		> tick 100ms
		epoch 3 [a#1 b#2] maxstep=0
		  reason: commit failed in epoch 2 (a)
		`,
		"a reported death is verified before the next epoch forms": `
		> config min=1
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		# b blames c; the coordinator dials c, and the revocation would force
		# an epoch with c at once: it waits for the verdict instead
		> suspect c 600ms
		> revoke 1 b
		> tick 0s
		waiting: verifying the reported death of c (wake +600ms)
		> die c
		> tick 100ms
		epoch 2 [a#1 b#2] maxstep=0
		  reason: c died (gossip)
		# alive after all: the epoch forms without waiting out the deadline
		> suspect a 600ms
		> revoke 2 b
		> tick 0s
		waiting: verifying the reported death of a (wake +600ms)
		> unsuspect a
		> tick 10ms
		epoch 3 [a#1 b#2] maxstep=0
		  reason: epoch 2 revoked by b: peer failed
		# no verdict in time: the epoch forms anyway
		> suspect b 600ms
		> revoke 3 a
		> tick 700ms
		epoch 4 [a#1 b#2] maxstep=0
		  reason: epoch 3 revoked by a: peer failed
		`,
		"base: the previous epoch only when every survivor formed it": `
		> config min=1
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> formed a b c 1
		> die c
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=0 base=1
		  reason: c died (gossip)
		  revoke 1 failed=[c]
		# b formed epoch 2, a did not (its shrink was cut short): everyone forms anew
		> formed b 2
		> restart c
		> tick 0s
		epoch 3 [a#1 b#2 c#4] maxstep=0
		  reason: joined c
		# a stale report of an older epoch never counts
		> formed a b 3
		> formed c 2
		> restart d
		> tick 0s
		epoch 4 [a#1 b#2 c#4 d#5] maxstep=0
		  reason: joined d
		# joiners need not have formed anything
		> formed a b c d 4
		> restart e
		> tick 0s
		epoch 5 [a#1 b#2 c#4 d#5 e#6] maxstep=0 base=4
		  reason: joined e
		`,
		"initial quorum waits for stragglers, then forms": `
		> config min=2 timeout=10s
		> join a b c
		> ask a b
		> tick 0s
		waiting: waiting up to 10s for 1 straggler(s) (wake +10s)
		> tick 4s
		waiting: waiting up to 6s for 1 straggler(s) (wake +6s)
		> tick 6s
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		`,
		"all ask: no wait": `
		> config min=2
		> join a b c
		> ask c a b
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> tick 1h
		-
		`,
		"min replicas": `
		> config min=3 timeout=1s
		> join a b
		> ask a b
		> tick 5s
		waiting: 2 of 3 replicas needed (min_replicas)
		> join c
		> tick 0s
		waiting: 2 of 3 replicas needed (min_replicas)
		> ask c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		# after a death, min replicas binds again: 2 survivors are too few.
		> die b
		> tick 0s
		waiting: 2 of 3 replicas needed (min_replicas)
		  revoke 1 failed=[b]: b died (gossip)
		> join d
		> ask d
		> tick 0s
		epoch 2 [a#1 c#3 d#4] maxstep=0
		  reason: b died (gossip); joined d
		`,
		"fast quorum when all previous members return, after a commit failure": `
		> config min=2
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> step a=10 b=10 c=9
		> commitfail b 1
		> tick 0s
		epoch 2 [a#1 b#2 c#3] maxstep=10
		  reason: commit failed in epoch 1 (b)
		  revoke 1 failed=[]
		# a stale report (epoch 1) does not bump epoch 2.
		> commitfail c 1
		> tick 0s
		-
		> commitfail a 2
		> commitfail c 2
		> tick 0s
		epoch 3 [a#1 b#2 c#3] maxstep=10
		  reason: commit failed in epoch 2 (a,c)
		  revoke 2 failed=[]
		`,
		"a revocation of the current epoch forces the next": `
		> config
		> join a b
		> ask a b
		> tick 0s
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		> revoke 0 a
		> tick 0s
		-
		> revoke 1 a
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=0
		  reason: epoch 1 revoked by a: peer failed
		`,
		"strict majority guards against split brain": `
		> config min=1 timeout=1s
		> join a b c d
		> ask a b
		> tick 10s
		waiting: 2 of 4 live members take part: not a strict majority
		> ask c
		> tick 0s
		waiting: waiting up to 1s for 1 straggler(s) (wake +1s)
		> tick 1s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		# Two participants die: one survivor beside an idle live member is
		# not a majority, though min replicas would allow it.
		> die a b
		> tick 10s
		waiting: 1 of 2 live members take part: not a strict majority
		  revoke 1 failed=[a b]: a died (gossip); b died (gossip)
		> ask d
		> tick 0s
		epoch 2 [c#3 d#4] maxstep=0
		  reason: a died (gossip); b died (gossip); joined d
		`,
		"join timeout for stragglers after a death": `
		> config min=1 timeout=2s
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> join d
		> die c
		> tick 0s
		waiting: waiting up to 2s for 1 straggler(s) (wake +2s)
		  revoke 1 failed=[c]: c died (gossip)
		> tick 2s
		epoch 2 [a#1 b#2] maxstep=0
		  reason: c died (gossip)
		`,
		"shrink only keeps joiners out until released": `
		> config min=2
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> ask a shrink
		> join d
		> ask d
		> tick 0s
		-
		> die b
		> tick 0s
		epoch 2 [a#1 c#3] maxstep=0
		  reason: b died (gossip)
		  revoke 1 failed=[b]
		> unshrink a
		> tick 0s
		epoch 3 [a#1 c#3 d#4] maxstep=0
		  reason: joined d
		`,
		"late joiner gets in by fast quorum with the step to heal to": `
		> config min=2
		> join a b
		> ask a b
		> tick 0s
		epoch 1 [a#1 b#2] maxstep=0
		  reason: initial quorum
		> step a=500 b=500
		> tick 1m
		-
		> join c
		> tick 0s
		-
		> ask c
		> tick 0s
		epoch 2 [a#1 b#2 c#3] maxstep=500
		  reason: joined c
		`,
		"member restart is a new incarnation": `
		> config min=2
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		# b restarts before its old lease is gone: the old incarnation is out,
		# the new one joins in the same epoch.
		> restart b
		> tick 0s
		epoch 2 [a#1 c#3 b#4] maxstep=0
		  reason: b restarted; joined b
		  revoke 1 failed=[b]
		# a stale removal of the old incarnation changes nothing.
		> tick 0s
		-
		`,
		"critical health excludes a member until it recovers": `
		> config min=1
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> health c degraded ecc
		> tick 0s
		-
		> health c critical xid 79
		> tick 0s
		epoch 2 [a#1 b#2] maxstep=0
		  reason: c critical: xid 79
		  revoke 1 failed=[c]
		> health c healthy
		> tick 0s
		epoch 3 [a#1 b#2 c#3] maxstep=0
		  reason: joined c
		`,
		"leave and evict": `
		> config min=1
		> join a b c
		> ask a b c
		> tick 0s
		epoch 1 [a#1 b#2 c#3] maxstep=0
		  reason: initial quorum
		> leave a
		> evict c
		> tick 0s
		epoch 2 [b#2] maxstep=0 departed=[a]
		  reason: a left; c evicted
		  revoke 1 failed=[c]
		> die b
		> tick 0s
		waiting: 0 of 1 replicas needed (min_replicas)
		  revoke 2 failed=[b]: b died (gossip)
		# offered once: the script stored it.
		> tick 1s
		waiting: 0 of 1 replicas needed (min_replicas)
		`,
	} {
		t.Run(name, func(t *testing.T) { runQuorumScript(t, script) })
	}
}

func TestQuorumStaleRemoveAndUpsert(t *testing.T) {
	m := NewMachine("j", DefaultQuorumConfig(), nil)
	now := time.Unix(0, 0)
	m.Upsert(now, MemberRecord{ID: "a", Incarnation: 5, WantQuorum: true})
	m.Upsert(now, MemberRecord{ID: "a", Incarnation: 3, WantQuorum: true, Step: 99}) // older: ignored
	if r, _ := m.Member("a"); r.Incarnation != 5 || r.Step != 0 {
		t.Fatalf("stale upsert applied: %+v", r)
	}
	m.Remove(now, "a", 3, "died")
	if _, ok := m.Member("a"); !ok {
		t.Fatal("removal of an older incarnation removed the newer")
	}
	m.Remove(now, "a", 5, "died")
	if m.Len() != 0 {
		t.Fatal("not removed")
	}
}

// Many members: 1000 join over time; the quorum forms once when all have
// asked, then each death and each join is one epoch.
func TestQuorumManyMembers(t *testing.T) {
	m := NewMachine("j", QuorumConfig{MinReplicas: 500, JoinTimeout: time.Minute}, nil)
	now := time.Unix(0, 0)
	const n = 1000
	for i := 0; i < n; i++ {
		m.Upsert(now, MemberRecord{ID: fmt.Sprintf("m%04d", i), Incarnation: int64(i + 1), Step: int64(i % 7)})
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
		m.Remove(now, fmt.Sprintf("m%04d", i*100), 0, "died")
	}
	d = m.Advance(now)
	if d.Quorum == nil || d.Quorum.Epoch != 2 || len(d.Quorum.Participants) != n-10 || len(d.Revocation.Failed) != 10 {
		t.Fatalf("after deaths: %+v", d.Quorum)
	}
	// Survivors keep their order: rank 0 is now m0001.
	if d.Quorum.Participants[0].ID != "m0001" {
		t.Fatalf("rank 0 is %s", d.Quorum.Participants[0].ID)
	}
}

func BenchmarkQuorumAdvance10K(b *testing.B) {
	const n = 10000
	now := time.Unix(0, 0)
	m := NewMachine("j", QuorumConfig{MinReplicas: n / 2, JoinTimeout: time.Minute}, nil)
	for i := 0; i < n; i++ {
		m.Upsert(now, MemberRecord{ID: fmt.Sprintf("member-%05d", i), Incarnation: int64(i + 1), WantQuorum: true})
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
		m.Remove(now, id, 0, "died")
		d := m.Advance(now)
		if d.Quorum == nil {
			b.Fatal("no quorum after a death")
		}
		m.Published(*d.Quorum)
		r.Incarnation += n
		m.Upsert(now, r)
		if d := m.Advance(now); d.Quorum == nil {
			b.Fatal("no quorum after a join")
		} else {
			m.Published(*d.Quorum)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(2*b.N)/1e6, "ms/decision")
}

// The first quorum of 10K members that all asked: one decision.
func BenchmarkQuorumForm10K(b *testing.B) {
	const n = 10000
	now := time.Unix(0, 0)
	recs := make([]MemberRecord, n)
	for i := range recs {
		recs[i] = MemberRecord{ID: fmt.Sprintf("member-%05d", i), Incarnation: int64(i + 1), WantQuorum: true, Step: int64(i)}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		m := NewMachine("j", QuorumConfig{MinReplicas: n / 2, JoinTimeout: time.Minute}, nil)
		for _, r := range recs {
			m.Upsert(now, r)
		}
		b.StartTimer()
		if d := m.Advance(now); d.Quorum == nil || len(d.Quorum.Participants) != n {
			b.Fatal("no quorum")
		}
	}
}
