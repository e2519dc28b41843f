package coordinator

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/membership/gossip"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output of coordinator/testdata/machine scripts")

// machineScript drives the leader's machine with a small command language,
// in the manner of etcd-io/raft's interaction tests and ft's machine
// scripts, over a fake etcd that holds one job's keys (job "j") with
// revisions. Lines starting with "> " are inputs; the lines after one are
// the actions it must produce, one per line (metrics and info logs left
// out; warnings as "warn: …"). A write the machine asks for is carried out
// on the fake etcd at once and answered, its outcome printed indented.
// "#" starts a comment.
//
//	config [signed] [name=N] [min=N timeout=D settle=D grace=D hold=D form=D]
//	                          (starts a scenario: a leader that found nothing
//	                          in etcd; signed: it signs its quorums)
//	join a b … [idle]         members register (asking to take part, unless idle)
//	spare a b … [group=N] [idle]  spares register (ids "g.r" with group=N:
//	                          ranks of spare replica groups of N)
//	restart a [step=S]        a's key is deleted and a new incarnation registers
//	ask a … | step a=S …      members ask in / report steps
//	blame a E b …             a's commit failed in epoch E, blaming b …
//	waiting a S [why…]        a waits for a holder of committed step S (0: no more)
//	leave a | finish a S | evict a [by=W]   members go, as their records say
//	expire a                  a's lease expires: its key goes
//	revoke E by [b …]         member "by" revokes epoch E, blaming b …
//	gossip-dead a|a#I         gossip declares a's node dead (a#I: the node of
//	                          a's incarnation I)
//	probed a dead|alive       the verdict on a's port (the last probe of a)
//	claim a [inc=I]           a new process of a claims its id, held by a's
//	                          live incarnation (or incarnation I)
//	settings V k=v …          a coordinator writes version V of the job's settings
//	                          (forged: someone else does)
//	tick D                    advance the clock by D and decide
//	forge record E|deleted    someone else writes the quorum record (epoch E) or deletes it
//	forge view E|deleted      the same for the quorum view
//	echo                      the watch delivers the leader's own writes (late)
//	etcd down|up|lose         writes fail / succeed / are stored but their answer is lost
//	depose                    another instance leads: the fence refuses every
//	                          write, and the term ends at the first refusal
//	no-leader                 the term ends (the leader stopped): etcd changes
//	                          unwatched
//	lead [deaths=a,b]         a new term: a machine loaded from the fake etcd (and
//	                          the gossip deaths seen meanwhile)
type machineScript struct {
	t       *testing.T
	m       *machine
	cfg     machineConfig
	signer  *QuorumSigner
	now     time.Time
	rev     int64
	kv      map[string]*fakeKV // by key under the job: members/a, quorum, view, …
	etcd    string             // "up", "down" or "lose"
	deposed bool
	leading bool             // a term is running: inputs reach the machine
	echoes  []input          // the events of the leader's own writes, not delivered yet
	probed  map[string]int64 // id → the incarnation last probed
	out     []string
	spares  string // the spares line last printed (status)
}

type fakeKV struct {
	value       []byte
	create, mod int64
}

const scriptJob = "j"

func (s *machineScript) put(key string, value []byte) *fakeKV {
	s.rev++
	kv, ok := s.kv[key]
	if !ok {
		kv = &fakeKV{create: s.rev}
		s.kv[key] = kv
	}
	kv.value, kv.mod = value, s.rev
	return kv
}

func (s *machineScript) record(id string) (membership.MemberRecord, bool) {
	kv, ok := s.kv["members/"+id]
	if !ok {
		return membership.MemberRecord{}, false
	}
	var r membership.MemberRecord
	if err := json.Unmarshal(kv.value, &r); err != nil {
		s.t.Fatal(err)
	}
	r.Incarnation = kv.create
	return r, true
}

// putRecord writes a member's record and feeds the event.
func (s *machineScript) putRecord(r membership.MemberRecord) {
	r.Job, r.Addr = scriptJob, r.ID+":1"
	if r.Gossip == "" {
		r.Gossip = r.ID + ":2"
	}
	b, _ := json.Marshal(r)
	kv := s.put("members/"+r.ID, b)
	if r.Lease == 0 {
		// The lease is named after the incarnation: a new one per Join.
		r.Lease = 1000 + kv.create
		b, _ = json.Marshal(r)
		kv.value = b
	}
	r.Incarnation = kv.create
	s.feed(recordPut{scriptJob, r})
}

func (s *machineScript) update(id string, f func(*membership.MemberRecord)) {
	r, ok := s.record(id)
	if !ok {
		s.t.Fatalf("no member %s", id)
	}
	f(&r)
	s.putRecord(r)
}

func (s *machineScript) deleteKey(key string) (*fakeKV, bool) {
	kv, ok := s.kv[key]
	if ok {
		s.rev++
		delete(s.kv, key)
	}
	return kv, ok
}

// feed hands the machine an input and carries out its actions; between
// terms the fake etcd changes and no one watches.
func (s *machineScript) feed(in input) {
	if !s.leading {
		return
	}
	acts := slices.Clone(s.m.handle(s.now, in))
	for i := 0; i < len(acts); i++ {
		var answer *written
		switch a := acts[i].(type) {
		case publish:
			answer = s.publish(a)
		case restoreRecord:
			s.say("restore record e%d", s.epochOf(a.value))
			answer = s.write(a.ifRev, func() { s.echo(s.put("quorum", a.value), "quorum") })
		case deleteRecord:
			s.say("delete foreign record")
			answer = s.write(a.ifRev, func() { s.deleteQuorum("quorum") })
		case deleteView:
			s.say("delete foreign view")
			answer = s.write(-1, func() { s.deleteQuorum("view") })
		case probe:
			s.say("probe %s#%d at %s", a.id, a.inc, a.addr)
			s.probed[a.id] = a.inc
		case deleteClaim:
			s.say("delete claim %s", a.id)
		case deleteRegistration:
			s.say("delete registration %s#%d", a.rec.ID, a.rec.Incarnation)
			if kv, ok := s.kv["members/"+a.rec.ID]; ok && kv.create == a.rec.Incarnation && !s.deposed {
				s.deleteKey("members/" + a.rec.ID)
				s.echoes = append(s.echoes, recordDeleted{scriptJob, a.rec.ID, kv.create})
			}
		case removed:
			s.say("removed %s (%s): %s", a.id, a.removal.Cause, a.removal)
		case status:
			if a.waiting != "" {
				w := "waiting: " + a.waiting
				if !a.wakeAt.IsZero() {
					w += fmt.Sprintf(" (wake +%v)", a.wakeAt.Sub(s.now))
				}
				s.say("%s", w)
			}
			// The job's spares and target, when it has spares or had.
			if len(a.spares) > 0 || s.spares != "" {
				line := fmt.Sprintf("spares %v ready %v target %d", a.spares, a.ready, a.target)
				for _, u := range a.unusable {
					line += fmt.Sprintf("; unusable %s: %s", u.Group, u.Reason)
				}
				if line != s.spares {
					s.say("%s", line)
					s.spares = line
				}
			}
		case logLine:
			if a.warn {
				s.say("warn: %s", a.msg)
			}
		case notLeader:
			s.say("not leader: %s", a.what)
			s.leading = false
		case observe:
		default:
			s.t.Fatalf("unknown action %T", a)
		}
		if answer != nil {
			acts = append(acts, s.m.handle(s.now, *answer)...)
		}
	}
}

func (s *machineScript) say(format string, args ...any) {
	s.out = append(s.out, fmt.Sprintf(format, args...))
}

func (s *machineScript) epochOf(raw []byte) uint64 {
	e, _ := membership.QuorumRecordEpoch(raw)
	return e
}

// write carries out a fenced write (ifRev: the quorum record's mod
// revision it is fenced on, 0: absent; -1: none) and answers it.
func (s *machineScript) write(ifRev int64, apply func()) *written {
	switch {
	case s.deposed:
		s.say("  refused by the fence")
		return &written{}
	case s.etcd == "down":
		s.say("  failed: etcd down")
		return &written{err: errors.New("etcd down")}
	}
	if ifRev >= 0 {
		var cur int64
		if kv, ok := s.kv["quorum"]; ok {
			cur = kv.mod
		}
		if cur != ifRev {
			s.say("  refused: the record is at revision %d, not %d", cur, ifRev)
			return &written{}
		}
	}
	apply()
	if s.etcd == "lose" {
		s.etcd = "up"
		s.say("  stored; the answer is lost")
		return &written{err: errors.New("answer lost")}
	}
	return &written{ok: true, rev: s.rev}
}

func (s *machineScript) echo(kv *fakeKV, key string) {
	switch key {
	case "quorum":
		s.echoes = append(s.echoes, quorumWritten{scriptJob, kv.mod, kv.value, false})
	case "view":
		s.echoes = append(s.echoes, viewWritten{scriptJob, kv.mod, kv.value, false})
	}
}

func (s *machineScript) deleteQuorum(key string) {
	if _, ok := s.deleteKey(key); ok {
		if key == "quorum" {
			s.echoes = append(s.echoes, quorumWritten{scriptJob, s.rev, nil, true})
		} else {
			s.echoes = append(s.echoes, viewWritten{scriptJob, s.rev, nil, true})
		}
	}
}

func ids(ps []membership.Participant) string {
	var b []string
	for _, p := range ps {
		b = append(b, fmt.Sprintf("%s#%d", p.ID, p.Incarnation))
	}
	return "[" + strings.Join(b, " ") + "]"
}

func (s *machineScript) publish(a publish) *written {
	var val []byte
	if q := a.quorum; q != nil {
		head := fmt.Sprintf("publish e%d %s", q.Epoch, ids(q.Participants))
		if q.Base != 0 {
			head += fmt.Sprintf(" base=%d", q.Base)
		}
		if q.Final != 0 {
			head += fmt.Sprintf(" final=%d", q.Final)
		}
		if len(q.Departed) > 0 {
			head += fmt.Sprintf(" departed=%v", q.Departed)
		}
		if q.Settings != nil {
			head += fmt.Sprintf(" settings=v%d", q.Settings.Version)
			if a.settings != nil {
				head += " (" + a.settings.Summary() + ")"
			}
		}
		if len(q.Promoted) > 0 {
			head += fmt.Sprintf(" promoted=%v", q.Promoted)
		}
		if len(q.Replaced) > 0 {
			head += fmt.Sprintf(" replaced=%v", q.Replaced)
		}
		s.say("%s", head)
		s.say("  reason: %s", q.Reason)
		if r := a.revocation; r != nil {
			s.say("  revoke e%d failed=%v", r.Epoch, r.Failed)
		}
		var err error
		if val, err = membership.EncodeQuorumRecord(*q, a.viewRev, a.settings, s.sign()); err != nil {
			s.t.Fatal(err)
		}
	} else {
		r := a.revocation
		s.say("revoke e%d failed=%v: %s", r.Epoch, r.Failed, r.Reason)
	}
	w := s.write(a.ifRev, func() {
		s.rev++
		at := func(key string, v []byte) *fakeKV {
			kv, ok := s.kv[key]
			if !ok {
				kv = &fakeKV{create: s.rev}
				s.kv[key] = kv
			}
			kv.value, kv.mod = v, s.rev
			return kv
		}
		if r := a.revocation; r != nil {
			key := fmt.Sprintf("revoked/%d", r.Epoch)
			if _, ok := s.kv[key]; !ok {
				b, _ := json.Marshal(r)
				at(key, b)
				s.echoes = append(s.echoes, revocationPut{scriptJob, *r})
			}
		}
		if q := a.quorum; q != nil {
			s.echo(at("quorum", val), "quorum")
			view := val
			if a.prev != nil {
				var err error
				if view, err = membership.EncodeQuorumViewWith(a.prev, *q, a.viewRev, a.settings, s.sign()); err != nil {
					s.t.Fatal(err)
				}
			}
			s.echo(at("view", view), "view")
			at(fmt.Sprintf("history/%020d", q.Epoch), val)
		}
	})
	w.value = val
	return w
}

func (s *machineScript) sign() func([]byte) *membership.QuorumSignature {
	if s.signer == nil {
		return nil
	}
	return s.signer.Sign
}

func (s *machineScript) trustSettings(job string, raw []byte) (membership.JobSettings, bool) {
	var doc membership.JobSettings
	if s.signer != nil {
		doc, err := s.signer.Verifier().VerifySettings(raw)
		return doc, err == nil && doc.Job == job
	}
	return doc, json.Unmarshal(raw, &doc) == nil && doc.Job == job
}

func (s *machineScript) trust(job string, raw []byte) (membership.Quorum, bool) {
	var v *membership.QuorumVerifier
	if s.signer != nil {
		v = s.signer.Verifier()
	}
	q, err := membership.DecodeQuorumRecord(raw, v)
	return q, err == nil && q.Job == job
}

// snapshot is the fake etcd as a leader that begins its term reads it.
func (s *machineScript) snapshot() loaded {
	snap := &jobSnapshot{}
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range s.kv {
			if !yield(k) {
				return
			}
		}
	})
	for _, k := range keys {
		kv := s.kv[k]
		switch {
		case strings.HasPrefix(k, "members/"):
			r, _ := s.record(strings.TrimPrefix(k, "members/"))
			snap.members = append(snap.members, r)
		case k == "quorum":
			snap.quorum = &storedValue{kv.value, kv.mod}
		case strings.HasPrefix(k, "history/"):
			snap.history = append(snap.history, storedValue{kv.value, kv.mod})
		case strings.HasPrefix(k, "revoked/"):
			var r membership.Revocation
			json.Unmarshal(kv.value, &r)
			snap.revocations = append(snap.revocations, r)
		case k == "settings":
			snap.settings = kv.value
		}
	}
	return loaded{jobs: map[string]*jobSnapshot{scriptJob: snap}}
}

func (s *machineScript) run(line string) []string {
	s.out = nil
	f := strings.Fields(line)
	cmd, args := f[0], f[1:]
	switch cmd {
	case "config":
		qc := quorum.DefaultConfig()
		qc.FailureSettle, qc.FormWindow, qc.LossWindow = 0, -1, -1 // scripts that want them say settle=D, form=D
		cfg := machineConfig{name: "c0", probeWait: probeWait}
		var signer *QuorumSigner
		for _, a := range args {
			k, v, _ := strings.Cut(a, "=")
			d, _ := time.ParseDuration(v)
			n, _ := strconv.Atoi(v)
			switch k {
			case "signed":
				var err error
				if signer, err = NewQuorumSigner(make([]byte, 32)); err != nil {
					s.t.Fatal(err)
				}
			case "name":
				cfg.name = v
			case "min":
				qc.MinReplicas = n
			case "timeout":
				qc.JoinTimeout = d
			case "settle":
				qc.FailureSettle = d
			case "grace":
				qc.HolderGrace = d
			case "hold":
				qc.BlameHold = d
			case "form":
				qc.FormWindow = d
			default:
				s.t.Fatalf("unknown config %q", a)
			}
		}
		cfg.quorum, cfg.signed = qc, signer != nil
		*s = machineScript{t: s.t, cfg: cfg, signer: signer, now: time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC),
			kv: map[string]*fakeKV{}, etcd: "up", probed: map[string]int64{}, leading: true}
		s.cfg.trust, s.cfg.trustSettings = s.trust, s.trustSettings
		s.m = newMachine(s.cfg)
	case "join":
		ask := args[len(args)-1] != "idle"
		if !ask {
			args = args[:len(args)-1]
		}
		for _, id := range args {
			s.putRecord(membership.MemberRecord{ID: id, WantQuorum: ask})
		}
	case "spare":
		ask := args[len(args)-1] != "idle"
		if !ask {
			args = args[:len(args)-1]
		}
		size := 0
		for _, id := range args {
			if v, ok := strings.CutPrefix(id, "group="); ok {
				size, _ = strconv.Atoi(v)
			}
		}
		for _, id := range args {
			if strings.HasPrefix(id, "group=") {
				continue
			}
			r := membership.MemberRecord{ID: id, WantQuorum: ask, Spare: true}
			if i := strings.LastIndexByte(id, '.'); size > 0 && i > 0 {
				r.Group, r.GroupSize = id[:i], size
			}
			s.putRecord(r)
		}
	case "restart":
		id := args[0]
		if kv, ok := s.deleteKey("members/" + id); ok {
			s.feed(recordDeleted{scriptJob, id, kv.create})
		}
		r := membership.MemberRecord{ID: id, WantQuorum: true}
		if len(args) > 1 {
			v, _ := strings.CutPrefix(args[1], "step=")
			r.Step, _ = strconv.ParseInt(v, 10, 64)
		}
		s.putRecord(r)
	case "ask":
		for _, id := range args {
			s.update(id, func(r *membership.MemberRecord) { r.WantQuorum = true })
		}
	case "step":
		for _, a := range args {
			id, v, _ := strings.Cut(a, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			s.update(id, func(r *membership.MemberRecord) { r.Step = n })
		}
	case "blame":
		e, _ := strconv.ParseUint(args[1], 10, 64)
		s.update(args[0], func(r *membership.MemberRecord) { r.CommitFailed, r.Blamed = e, args[2:] })
	case "waiting":
		n, _ := strconv.ParseInt(args[1], 10, 64)
		s.update(args[0], func(r *membership.MemberRecord) { r.WaitingFor, r.Waiting = n, strings.Join(args[2:], " ") })
	case "leave":
		s.update(args[0], func(r *membership.MemberRecord) { r.Leaving = true })
	case "finish":
		n, _ := strconv.ParseInt(args[1], 10, 64)
		s.update(args[0], func(r *membership.MemberRecord) { r.Step, r.Finished, r.Leaving = n, true, true })
	case "evict":
		by := "admin"
		if len(args) > 1 {
			by = strings.TrimPrefix(args[1], "by=")
		}
		s.update(args[0], func(r *membership.MemberRecord) { r.Evicted = by })
	case "expire":
		for _, id := range args {
			if kv, ok := s.deleteKey("members/" + id); ok {
				s.feed(recordDeleted{scriptJob, id, kv.create})
			}
		}
	case "revoke":
		e, _ := strconv.ParseUint(args[0], 10, 64)
		r := membership.Revocation{Epoch: e, By: args[1], Reason: "peer failed", Failed: args[2:], At: s.now}
		key := fmt.Sprintf("revoked/%d", e)
		if _, ok := s.kv[key]; ok {
			return []string{"(epoch already revoked)"}
		}
		b, _ := json.Marshal(r)
		s.put(key, b)
		s.feed(revocationPut{scriptJob, r})
	case "gossip-dead":
		id, inc, old := strings.Cut(args[0], "#")
		r, ok := s.record(id)
		lease := int64(1)
		switch {
		case old:
			n, _ := strconv.ParseInt(inc, 10, 64)
			lease = 1000 + n
		case ok:
			lease = r.Lease
		}
		s.feed(gossipDied{gossip.NodeName(scriptJob, id, lease)})
	case "probed":
		inc, ok := s.probed[args[0]]
		if !ok {
			s.t.Fatalf("%s was not probed", args[0])
		}
		s.feed(probed{job: scriptJob, id: args[0], inc: inc, dead: args[1] == "dead"})
	case "claim":
		r, ok := s.record(args[0])
		inc := r.Incarnation
		if len(args) > 1 {
			v, _ := strings.CutPrefix(args[1], "inc=")
			inc, _ = strconv.ParseInt(v, 10, 64)
		} else if !ok {
			s.t.Fatalf("no member %s", args[0])
		}
		c := membership.Claim{Incarnation: inc, Addr: args[0] + ":1", By: args[0] + ":9", At: s.now}
		b, _ := json.Marshal(c)
		kv := s.put("claims/"+args[0], b)
		s.feed(claimed{job: scriptJob, id: args[0], claim: c, rev: kv.mod})
	case "settings":
		v, _ := strconv.ParseUint(args[0], 10, 64)
		doc := membership.JobSettings{Job: scriptJob, Version: v - 1, Values: map[string]membership.Setting{}}
		forged := false
		var changes []string
		for _, a := range args[1:] {
			if a == "forged" {
				forged = true
				continue
			}
			changes = append(changes, a)
		}
		cs, err := membership.ParseSettingChanges(changes)
		if err != nil {
			s.t.Fatal(err)
		}
		if doc, err = doc.Apply(cs); err != nil {
			s.t.Fatal(err)
		}
		raw, _ := json.Marshal(doc)
		if s.signer != nil && !forged {
			msg, _, _ := membership.CanonicalSettings(raw)
			doc.Signature = s.signer.Sign(msg)
			raw, _ = json.Marshal(doc)
		}
		s.put("settings", raw)
		s.feed(settingsPut{scriptJob, raw})
	case "tick":
		d, err := time.ParseDuration(args[0])
		if err != nil {
			s.t.Fatal(err)
		}
		s.now = s.now.Add(d)
		s.feed(tick{})
	case "forge":
		key := map[string]string{"record": "quorum", "view": "view"}[args[0]]
		if args[1] == "deleted" {
			if _, ok := s.deleteKey(key); !ok {
				s.t.Fatalf("no %s to delete", key)
			}
			if key == "quorum" {
				s.feed(quorumWritten{scriptJob, s.rev, nil, true})
			} else {
				s.feed(viewWritten{scriptJob, s.rev, nil, true})
			}
			break
		}
		e, _ := strconv.ParseUint(args[1], 10, 64)
		var raw []byte
		if key == "quorum" {
			raw, _ = json.Marshal(membership.Quorum{Job: scriptJob, Epoch: e, Reason: "forged"})
		} else {
			raw = fmt.Appendf(nil, "{\"epoch\":%d}\n", e)
		}
		kv := s.put(key, raw)
		if key == "quorum" {
			s.feed(quorumWritten{scriptJob, kv.mod, raw, false})
		} else {
			s.feed(viewWritten{scriptJob, kv.mod, raw, false})
		}
	case "downgrade":
		// The record and history as a coordinator of the old encoding
		// wrote them: JSON, signed over membership.CanonicalQuorum.
		for k, kv := range s.kv {
			if k != "quorum" && !strings.HasPrefix(k, "history/") {
				continue
			}
			q, err := membership.DecodeQuorumRecord(kv.value, nil)
			if err != nil {
				s.t.Fatal(err)
			}
			if s.signer != nil {
				kv.value, err = s.signer.Marshal(q)
			} else {
				kv.value, err = json.Marshal(q)
			}
			if err != nil {
				s.t.Fatal(err)
			}
		}
	case "echo":
		echoes := s.echoes
		s.echoes = nil
		for _, in := range echoes {
			s.feed(in)
		}
	case "etcd":
		s.etcd = args[0]
	case "depose":
		s.deposed = true
	case "lead":
		in := s.snapshot()
		if len(args) > 0 {
			v, _ := strings.CutPrefix(args[0], "deaths=")
			for _, id := range strings.Split(v, ",") {
				if r, ok := s.record(id); ok {
					in.deaths = append(in.deaths, gossip.NodeName(scriptJob, r.ID, r.Lease))
				}
			}
		}
		s.m, s.deposed, s.echoes, s.leading = newMachine(s.cfg), false, nil, true
		s.feed(in)
	case "no-leader":
		s.leading = false
	default:
		s.t.Fatalf("unknown command %q", line)
	}
	return s.out
}

// TestMachineScripts runs every script in testdata/machine: the leader's
// decisions around the quorum rules — what a record, a deletion or a
// gossip death means (probe.txt, gossip.txt, departures.txt), the death
// probe, the repair of foreign writes (forged.txt), a new term
// (leader.txt), and writes that fail (etcd.txt). The quorum rules
// themselves have their scripts in coordinator/quorum/testdata.
// go test -run TestMachineScripts ./coordinator -args -rewrite updates the
// expected output after a deliberate change; review the diff.
func TestMachineScripts(t *testing.T) {
	testutil.RunScripts(t, "testdata/machine/*.txt", *rewrite, func(t *testing.T) func(string) []string {
		s := &machineScript{t: t}
		return func(cmd string) []string {
			if s.m == nil && !strings.HasPrefix(cmd, "config") {
				t.Fatalf("the first command must be config, not %q", cmd)
			}
			return s.run(cmd)
		}
	})
}

// The leader logs what a job's quorum waits for when the wait begins and
// when what it waits for changes, not at every pass of its countdown.
func TestWaitKind(t *testing.T) {
	for _, c := range []struct {
		a, b string
		same bool
	}{
		{"waiting up to 15s for b,c,d to come back", "waiting up to 14.2s for b,c,d to come back", true},
		{"waiting up to 1.5s for b,c,d to come back", "waiting up to 900ms for b,c,d to come back", true},
		{"waiting up to 14s for b,c,d to come back", "waiting up to 14s for d to come back", false},
		{"verifying the reported death of d.0", "waiting up to 14s for d.0 to come back", false},
		{"", "verifying the reported death of d.0", false},
	} {
		if got := waitKind(c.a) == waitKind(c.b); got != c.same {
			t.Errorf("%q and %q the same wait: %v", c.a, c.b, got)
		}
	}
}
