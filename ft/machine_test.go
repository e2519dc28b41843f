package ft

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

var rewrite = flag.Bool("rewrite", false, "rewrite the expected output of ft/testdata/machine scripts")

// machineScript drives the step machine with a small command language,
// in the manner of etcd-io/raft's interaction tests and
// membership/quorum_test.go. Lines starting with "> " are inputs; the
// lines after one are the actions it must produce, one per line (metrics
// and logs left out). "#" starts a comment; blank lines separate.
//
//	config id=a.0 size=1 min=1 [durable] [maxfail=N] [inc=N] [stall=F] [stallmin=D] [linger=D] [initial=S]  (first)
//	quorum E [base=B] [final=S] [from=addr,…] [runstep=S] [settings=V] [departed=id,…] ids…
//	                                publish quorum E (ids "g.r" or "g.r@inc")
//	revocation E                    epoch E revoked
//	step | cancel-step              the training loop calls Step / gives up
//	commit [silent=R,…] [err…] | cancel-commit   the training loop calls Commit (its ops' errors;
//	                                the FT ranks its backend hears nothing from)
//	finish                          the training loop calls Finish
//	fail-step [reason…]             the training loop calls FailStep
//	look [pending=D] [silent=R,…]   the machine's timer fires: an op of the epoch has been
//	                                running for D (none: no op runs)
//	close                           Close
//	formed ft|group [split] [err…]  the formation task answers
//	failed ft|group E data|ctl|both [silent=R,…] err…   a comm broke (Comm.Broken)
//	gathered S@E …                  the step records, in FT rank order
//	lastcommit S@E | none           the durable commit record (by c.0, now)
//	healed E:S,… | healed err…      the heal (the sources' history: epoch:from)
//	kept yes|no | kept err…         the group's vote on keeping its comms
//	agreed [known=E] [notready] [apart] | agreed err…
//	                                the group's agreement at Step (default: every
//	                                rank ready in this epoch, none knowing a newer)
//	checked LO HI | checked err…    the group's step check
//	voted yes|no | voted err…       the group's vote
//	recorded ok | recorded no WHY   the durable record
//	outcome ok|no | outcome err…    the group leader's word on its record
//	withdrawn [err…]                the served state withdrawn
//	task-error err…                 the task in flight fails (any kind)
//	reregistered INC | lost
//	state                           print the machine's state
//
// Errors: peer:R (rank R failed), closed:R (rank R closed its comm),
// timeout, revoked, unavailable, or any other word (a plain error).
type machineScript struct {
	t     *testing.T
	m     *machine
	now   time.Time
	task  int // the task in flight, as the last action that started one said
	kind  string
	agree agreeStep // the last group agreement asked for
	prep  int       // the background preparation's task in flight
	lastQ []string  // the participants of the last quorum fed (Quorum.Added is the change)
}

func (s *machineScript) parseErr(args []string) error {
	if len(args) == 0 {
		return nil
	}
	var errs []error
	for _, a := range args {
		a = strings.TrimPrefix(a, "err=")
		k, v, _ := strings.Cut(a, ":")
		switch k {
		case "peer":
			for _, r := range strings.Split(v, ",") {
				n, _ := strconv.Atoi(r)
				errs = append(errs, &comm.RankError{Rank: n, Err: fmt.Errorf("%w: EOF", comm.ErrPeerFailed)})
			}
		case "closed":
			n, _ := strconv.Atoi(v)
			errs = append(errs, &comm.RankError{Rank: n, Err: fmt.Errorf("%w: %w", comm.ErrPeerFailed, comm.ErrPeerClosed)})
		case "timeout":
			errs = append(errs, fmt.Errorf("%w: waited too long", comm.ErrTimeout))
		case "revoked":
			errs = append(errs, fmt.Errorf("%w by a peer", comm.ErrRevoked))
		case "unavailable":
			errs = append(errs, fmt.Errorf("%w: no library", comm.ErrBackendUnavailable))
		case "cancelled":
			errs = append(errs, context.Canceled)
		default:
			errs = append(errs, errors.New(a))
		}
	}
	return errors.Join(errs...)
}

func parseDim(a string) dim {
	if a == "group" {
		return dimGroup
	}
	return dimFT
}

func (s *machineScript) run(line string) []string {
	f := strings.Fields(line)
	cmd, args := f[0], f[1:]
	var in input
	switch cmd {
	case "config":
		cfg := machineConfig{id: "a.0", group: "a", groupSize: 1, minReplicas: 1, maxCommitFailures: 10}
		inc := int64(1)
		for _, a := range args {
			k, v, _ := strings.Cut(a, "=")
			n, _ := strconv.Atoi(v)
			switch k {
			case "id":
				cfg.id = v
				g, r, _ := parseMemberID(v)
				cfg.group, cfg.groupRank = g, r
			case "size":
				cfg.groupSize = n
			case "min":
				cfg.minReplicas = n
			case "durable":
				cfg.durable = true
			case "maxfail":
				cfg.maxCommitFailures = n
			case "inc":
				inc = int64(n)
			case "stall":
				cfg.stallFactor, _ = strconv.ParseFloat(v, 64)
				cfg.stallMin = time.Second
			case "stallmin":
				cfg.stallMin, _ = time.ParseDuration(v)
			case "linger":
				cfg.linger, _ = time.ParseDuration(v)
			case "initial":
				cfg.initialStep, _ = strconv.ParseInt(v, 10, 64)
			case "spare":
				cfg.spare = true
			}
		}
		s.m, s.lastQ = newMachine(cfg, inc), nil
		return nil
	case "quorum":
		e, _ := strconv.ParseUint(args[0], 10, 64)
		q := membership.Quorum{Job: "job", Epoch: e, Created: s.now}
		for _, a := range args[1:] {
			if b, ok := strings.CutPrefix(a, "base="); ok {
				q.Base, _ = strconv.ParseUint(b, 10, 64)
				continue
			}
			if a == "prepared" {
				q.Prepared = true
				continue
			}
			if ids, ok := strings.CutPrefix(a, "added="); ok {
				q.Added = strings.Split(ids, ",")
				continue
			}
			if f, ok := strings.CutPrefix(a, "final="); ok {
				q.Final, _ = strconv.ParseInt(f, 10, 64)
				continue
			}
			if d, ok := strings.CutPrefix(a, "departed="); ok {
				q.Departed = strings.Split(d, ",")
				continue
			}
			if f, ok := strings.CutPrefix(a, "from="); ok {
				q.FinalFrom = strings.Split(f, ",")
				continue
			}
			if r, ok := strings.CutPrefix(a, "runstep="); ok {
				q.RunStep, _ = strconv.ParseInt(r, 10, 64)
				continue
			}
			if p, ok := strings.CutPrefix(a, "promoted="); ok {
				q.Promoted = strings.Split(p, ",")
				continue
			}
			if r, ok := strings.CutPrefix(a, "replaced="); ok {
				q.Replaced = strings.Split(r, ",")
				continue
			}
			if v, ok := strings.CutPrefix(a, "settings="); ok {
				n, _ := strconv.ParseUint(v, 10, 64)
				q.Settings = &membership.SettingsRef{Version: n, Digest: "d" + v}
				continue
			}
			id, incs, _ := strings.Cut(a, "@")
			inc := int64(1)
			if incs != "" {
				inc, _ = strconv.ParseInt(incs, 10, 64)
			}
			g, _, _ := parseMemberID(id)
			q.Participants = append(q.Participants, membership.Participant{ID: id, Group: g, Incarnation: inc})
		}
		// Added: as given, else the change since the last quorum fed.
		given := q.Added != nil
		for _, p := range q.Participants {
			if !given && s.lastQ != nil && !slices.Contains(s.lastQ, p.ID) {
				q.Added = append(q.Added, p.ID)
			}
		}
		s.lastQ = s.lastQ[:0]
		for _, p := range q.Participants {
			s.lastQ = append(s.lastQ, p.ID)
		}
		in = quorumSeen{q}
	case "revocation":
		e, _ := strconv.ParseUint(args[0], 10, 64)
		in = revocationSeen{membership.Revocation{Epoch: e, By: "coordinator", Reason: "test"}}
	case "step":
		in = stepCalled{}
	case "cancel-step":
		in = stepCancelled{context.Canceled}
	case "commit":
		var errs []error
		silent, args := parseSilent(args)
		if err := s.parseErr(args); err != nil {
			errs = append(errs, err)
		}
		in = commitCalled{errs: errs, silent: silent}
	case "finish":
		in = finishCalled{}
	case "fail-step":
		err := ErrStepFailed
		if len(args) > 0 {
			err = fmt.Errorf("%w: %s", ErrStepFailed, strings.Join(args, " "))
		}
		in = stepFailed{err: err}
	case "look":
		t := tick{}
		t.silent, args = parseSilent(args)
		for _, a := range args {
			if v, ok := strings.CutPrefix(a, "pending="); ok {
				d, _ := time.ParseDuration(v)
				t.pending = s.now.Add(time.Millisecond - d) // the clock moves 1 ms as the input is fed
			}
		}
		in = t
	case "cancel-commit":
		in = commitCancelled{context.Canceled}
	case "close":
		in = closeCalled{}
	case "formed":
		d := parseDim(args[0])
		split := len(args) > 1 && args[1] == "split"
		rest := args[1:]
		if split {
			rest = args[2:]
		}
		in = commsFormed{task: s.task, dim: d, epoch: s.m.epoch, split: split, err: s.parseErr(rest)}
	case "prep-formed":
		// The background formation of the epoch being prepared answered.
		split := len(args) > 0 && args[0] == "split"
		if split {
			args = args[1:]
		}
		e := uint64(0)
		if s.m.prep != nil {
			e = s.m.prep.epoch
		}
		in = commsFormed{task: s.prep, dim: dimFT, epoch: e, split: split, err: s.parseErr(args)}
	case "prep-agreed", "switch-agreed":
		// prep-agreed AT | prep-agreed err…: the background agreement's
		// answer; switch-agreed: the one of a reconfiguration.
		t := s.task
		if cmd == "prep-agreed" {
			t = s.prep
		}
		if at, err := strconv.ParseInt(args[0], 10, 64); err == nil {
			in = switchAgreed{task: t, at: at}
		} else {
			in = switchAgreed{task: t, err: s.parseErr(args)}
		}
	case "failed":
		e, _ := strconv.ParseUint(args[1], 10, 64)
		p := map[string]part{"data": partData, "ctl": partCtl, "both": partBoth}[args[2]]
		silent, rest := parseSilent(args[3:])
		in = commFailed{dim: parseDim(args[0]), epoch: e, part: p, err: s.parseErr(rest), silent: silent}
	case "gathered":
		var recs []stepRecord
		for _, a := range args {
			st, ep, _ := strings.Cut(a, "@")
			n, _ := strconv.ParseInt(st, 10, 64)
			e, _ := strconv.ParseUint(ep, 10, 64)
			recs = append(recs, stepRecord{Step: n, Epoch: e, Addr: "r" + strconv.Itoa(len(recs))})
		}
		in = recordsGathered{task: s.task, recs: recs}
	case "lastcommit":
		r := lastCommitRead{task: s.task}
		if args[0] != "none" {
			st, ep, _ := strings.Cut(args[0], "@")
			r.rec.Step, _ = strconv.ParseInt(st, 10, 64)
			r.rec.Epoch, _ = strconv.ParseUint(ep, 10, 64)
			r.rec.By, r.rec.At = "c.0", s.now
			r.ok = true
		}
		in = r
	case "healed":
		var h history
		if len(args) > 0 && strings.Contains(args[0], ":") && !strings.HasPrefix(args[0], "err") {
			for _, seg := range strings.Split(args[0], ",") {
				e, from, _ := strings.Cut(seg, ":")
				ee, _ := strconv.ParseUint(e, 10, 64)
				ff, _ := strconv.ParseInt(from, 10, 64)
				h = append(h, segment{Epoch: ee, From: ff})
			}
			args = args[1:]
		}
		in = stateHealed{task: s.task, hist: h, bytes: 1 << 20, took: time.Millisecond, err: s.parseErr(args)}
	case "kept":
		switch args[0] {
		case "yes", "no":
			in = groupKept{task: s.task, ok: args[0] == "yes"}
		default:
			in = groupKept{task: s.task, err: s.parseErr(args)}
		}
	case "agreed":
		// agreed [known=E] [notready] [apart] | agreed err…
		// What this rank said, unless the others said more.
		ag := stepAgreed{task: s.task, known: s.agree.known, ready: s.agree.ready, same: true}
		var rest []string
		for _, a := range args {
			switch {
			case strings.HasPrefix(a, "known="):
				e, _ := strconv.ParseUint(strings.TrimPrefix(a, "known="), 10, 64)
				ag.known = e
			case a == "notready":
				ag.ready = false
			case a == "apart":
				ag.same = false
			default:
				rest = append(rest, a)
			}
		}
		ag.err = s.parseErr(rest)
		in = ag
	case "checked":
		if lo, err := strconv.ParseInt(args[0], 10, 64); err == nil {
			hi, _ := strconv.ParseInt(args[1], 10, 64)
			in = groupChecked{task: s.task, lo: lo, hi: hi}
		} else {
			in = groupChecked{task: s.task, err: s.parseErr(args)}
		}
	case "voted":
		switch args[0] {
		case "yes", "no":
			in = voted{task: s.task, yes: args[0] == "yes"}
		default:
			in = voted{task: s.task, err: s.parseErr(args)}
		}
	case "recorded":
		in = commitRecorded{task: s.task, ok: args[0] == "ok", reason: strings.Join(args[1:], " ")}
	case "outcome":
		switch args[0] {
		case "ok", "no":
			in = outcomeShared{task: s.task, ok: args[0] == "ok"}
		default:
			in = outcomeShared{task: s.task, err: s.parseErr(args)}
		}
	case "withdrawn":
		in = withdrawn{task: s.task, err: s.parseErr(args)}
	case "task-error":
		if in = s.taskError(s.parseErr(args)); in == nil {
			return []string{"(no task in flight)"}
		}
	case "reregistered":
		n, _ := strconv.ParseInt(args[0], 10, 64)
		in = reregistered{inc: n}
	case "lost":
		in = membershipLost{errors.New("lease lost")}
	case "tick":
		d, _ := time.ParseDuration(args[0])
		s.now = s.now.Add(d)
		return nil
	case "state":
		return []string{s.state()}
	default:
		s.t.Fatalf("unknown command %q", line)
	}
	s.now = s.now.Add(time.Millisecond)
	var out []string
	defer func() {
		if s.m.task != 0 && s.m.task == s.prep {
			s.task = s.prep // a reconfiguration took the preparation's task over
		}
	}()
	for _, a := range s.m.handle(s.now, in) {
		switch a := a.(type) {
		case formComms:
			if a.background {
				s.prep = a.task
			} else {
				s.task, s.kind = a.task, "form"
			}
		case agreeSwitch:
			if s.m.prep != nil && s.m.prep.task == a.task {
				s.prep = a.task
			} else {
				s.task, s.kind = a.task, "switch"
			}
		case agreeStep:
			s.task, s.kind, s.agree = a.task, "agree", a
		case gatherRecords, readLastCommit, fetchState, keepGroup, checkGroup, castVote, recordCommit, shareOutcome, withdrawState:
			s.task, s.kind = taskOf(a), fmt.Sprintf("%T", a)
		}
		if t, ok := a.(armTimer); ok && !t.at.IsZero() {
			out = append(out, fmt.Sprintf("timer +%v", t.at.Sub(s.now)))
			continue
		}
		if d := describe(a); d != "" {
			out = append(out, strings.ReplaceAll(d, "\n", "; ")) // errors.Join's lines
		}
	}
	return out
}

// parseSilent takes a "silent=R,…" argument out of args.
func parseSilent(args []string) ([]int, []string) {
	var silent []int
	var rest []string
	for _, a := range args {
		v, ok := strings.CutPrefix(a, "silent=")
		if !ok {
			rest = append(rest, a)
			continue
		}
		for _, r := range strings.Split(v, ",") {
			n, _ := strconv.Atoi(r)
			silent = append(silent, n)
		}
	}
	return silent, rest
}

// taskError is the result of the task in flight failing with err.
func (s *machineScript) taskError(err error) input {
	t := s.task
	switch s.m.stage {
	case stageFormGroup:
		return commsFormed{task: t, dim: dimGroup, epoch: s.m.epoch, err: err}
	case stageFormFT:
		return commsFormed{task: t, dim: dimFT, epoch: s.m.epoch, err: err}
	case stageSwitch:
		return switchAgreed{task: t, err: err}
	case stageGather:
		return recordsGathered{task: t, err: err}
	case stageLastCommit:
		return lastCommitRead{task: t, err: err}
	case stageHeal, stageFinalHeal:
		return stateHealed{task: t, err: err}
	case stageCheckGroup:
		return groupChecked{task: t, err: err}
	case stageVote:
		return voted{task: t, err: err}
	case stageRecord:
		return commitRecorded{task: t, reason: err.Error()}
	case stageOutcome:
		return outcomeShared{task: t, err: err}
	case stageWithdraw:
		return withdrawn{task: t, err: err}
	}
	return nil
}

func taskOf(a action) int {
	switch a := a.(type) {
	case gatherRecords:
		return a.task
	case readLastCommit:
		return a.task
	case fetchState:
		return a.task
	case keepGroup:
		return a.task
	case agreeStep:
		return a.task
	case checkGroup:
		return a.task
	case castVote:
		return a.task
	case recordCommit:
		return a.task
	case shareOutcome:
		return a.task
	case withdrawState:
		return a.task
	}
	return 0
}

func (s *machineScript) state() string {
	m := s.m
	var b strings.Builder
	fmt.Fprintf(&b, "epoch %d step %d", m.epoch, m.step)
	if m.holds(dimFT) {
		fmt.Fprintf(&b, " rank %d/%d", m.view.ftRank, len(m.view.ft))
	}
	if m.held.epoch != 0 && m.held.ftRank >= 0 {
		fmt.Fprintf(&b, " holds ft e%d", m.held.epoch)
	}
	if m.group != 0 {
		fmt.Fprintf(&b, " group e%d", m.group)
	}
	for _, f := range []struct {
		on   bool
		name string
	}{{m.comms == commsReady, "ready"}, {m.comms == commsBroken, "broken"}, {m.phase == phaseInStep, "in-step"},
		{m.phase == phaseStepping, "step-waiting"}, {m.phase == phaseCommitting, "commit-waiting"}, {m.life == closed, "closed"},
		{m.task != 0, "task"}, {m.fatal != nil, "fatal"}} {
		if f.on {
			b.WriteString(" " + f.name)
		}
	}
	if len(m.hist) > 0 {
		var segs []string
		for _, sg := range m.hist {
			segs = append(segs, fmt.Sprintf("%d:%d", sg.Epoch, sg.From))
		}
		b.WriteString(" hist " + strings.Join(segs, ","))
	}
	return b.String()
}

// TestMachineScripts runs every script in testdata/machine: the step
// protocol's scenarios (superseded while forming, a partition, a zombie,
// a late joiner, a group that diverged, Close at every stage of a
// reconfiguration, a control comm failing while the data op hangs…).
// go test -run TestMachineScripts ./ft -args -rewrite updates the expected
// output after a deliberate change; review the diff.
func TestMachineScripts(t *testing.T) {
	testutil.RunScripts(t, "testdata/machine/*.txt", *rewrite, func(t *testing.T) func(string) []string {
		s := &machineScript{t: t, now: time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)}
		s.run("config")
		return s.run
	})
}

// TestSwitchStep: the step a prepared grow's ranks move after leaves a
// margin of two steps (more where steps are shorter than the slack), and
// falls back to at once where the steps are not known, would keep the
// joiners waiting near the op timeout, or where the survivors are at most
// three times the joiners (each loses half a step on average; the joiners
// would idle through one and a half).
func TestSwitchStep(t *testing.T) {
	const s = 30 * time.Second
	for _, tc := range []struct {
		max                int64
		slowest, timeout   time.Duration
		survivors, joiners int
		want               int64
	}{
		{100, 0, s, 4, 1, 0},                       // not known
		{100, time.Millisecond, 0, 4, 1, 0},        // no timeout
		{100, time.Millisecond, s, 4, 1, 126},      // 2 + the rest of 25 ms of 1 ms steps
		{100, 10 * time.Millisecond, s, 4, 1, 104}, // 2 + 2
		{100, 25 * time.Millisecond, s, 4, 1, 102},
		{100, 50 * time.Millisecond, s, 4, 1, 102},
		{100, 4 * time.Second, s, 4, 1, 102},     // 3 steps of 4 s: 12 s
		{100, 6 * time.Second, s, 4, 1, 0},       // 18 s: past half the timeout
		{100, 50 * time.Millisecond, s, 1, 1, 0}, // one survivor, one joiner
		{100, 50 * time.Millisecond, s, 3, 1, 0}, // three: still at once
		{100, 50 * time.Millisecond, s, 6, 2, 0},
		{100, 50 * time.Millisecond, s, 7, 2, 102},
	} {
		if got := switchStep(tc.max, tc.slowest, tc.timeout, tc.survivors, tc.joiners); got != tc.want {
			t.Errorf("switchStep(%d, %v, %v, %d, %d) = %d, want %d", tc.max, tc.slowest, tc.timeout, tc.survivors, tc.joiners, got, tc.want)
		}
	}
}
