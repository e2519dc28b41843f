package main

import (
	"fmt"
	"math/bits"
	"sort"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/ft"
)

// The invariants, checked over a run's timeline (pure: the same events
// give the same verdict; check_test.go drives it with made-up histories).
const (
	invDeadline   = "deadline"    // no collective (or Commit) blocks past Timeout + margin
	invMonotonic  = "monotonic"   // committed steps strictly increase on every replica process
	invAgreement  = "agreement"   // one epoch's participants hold one state at each step
	invUncommit   = "uncommitted" // no replica loads or continues from state that was never committed
	invSplitBrain = "split-brain" // a step committed twice: only if every loser was told (default mode), never with DurableCommit
	invReplay     = "replay"      // the final state is a fault-free replay of the committed steps
	invReconfig   = "reconfig"    // every rank of an epoch made the same choice (shrink, grow, fresh)
	invErrKind    = "error-kind"  // errors carry their kind and name the right peer
	invFalseDeath = "false-death" // the coordinator removes only replicas a fault touched
	invLiveness   = "liveness"    // replicas do not give up; the job reaches its target
	invFencing    = "fencing"     // a zombie (stopped past its lease) commits nothing more in its old epoch
	invRollback   = "rollback"    // a rollback names only steps the job's history has from another epoch
	invSettings   = "settings"    // the replicas of an epoch take its settings version from one step
	// invSpare, invCapacity and invTarget: the spare pool's (spares.go);
	// invData: the data the job read (data.go).
)

// invariants are every invariant's name, in the order reports list them.
var invariants = []string{invDeadline, invMonotonic, invAgreement, invUncommit, invSplitBrain, invReplay, invReconfig,
	invErrKind, invFalseDeath, invLiveness, invFencing, invRollback, invSettings, invSpare, invCapacity, invTarget, invData}

// Violation is one broken invariant.
type Violation struct {
	T         int64  `json:"t"`
	Invariant string `json:"invariant"`
	Detail    string `json:"detail"`
}

func (v Violation) key() string { return v.Invariant + "|" + v.Detail }

// checkInput is what the checker needs besides the events.
type checkInput struct {
	Events  []Event // ordered by time
	Faults  []*Fault
	Durable bool
	Timeout time.Duration // ft.Config.Timeout
	Margin  time.Duration // scheduling margin on top of it
	Linger  time.Duration // how long a fault's effects may be seen after it was undone
	Params  int
	Index   map[string]int // replica → slot
	// EndAt: when the harness began stopping the job (peers leaving then
	// are expected); zero while running.
	EndAt int64
	// Final: the run is over; check the history, the replay and the end.
	Final bool
	// StrictDeaths makes a false death (the coordinator removing a replica
	// that no fault touched: a stall mistaken for a death) a violation;
	// otherwise it is counted.
	StrictDeaths bool
	// Target is the job's size in replica groups (Config.Replicas), where
	// its quorums do not say; SpareBound bounds a loss to full size again
	// with a spare ready (the capacity invariant; 0: not checked).
	Target     int
	SpareBound time.Duration
	// Data is the replicas' sampler (Config.Data; Size 0: none, the data
	// invariant unchecked).
	Data ft.SamplerConfig
}

// analysis is the checker's verdict and what the report needs from it.
type analysis struct {
	Violations  []Violation
	Attempts    int // Commit calls that returned (committed or not)
	Commits     int // commits reported
	Lost        int // commits not in the job's history (rolled back or lost with their holder)
	Rollbacks   int
	RolledBack  int // steps the rollbacks discarded
	MaxRollback int64
	Redone      int   // steps committed by two epochs with different states
	FinalStep   int64 // the job's final committed step
	// Forks: epochs that committed a step the job had already committed
	// in another epoch (a minority's step redone, or replicas behind the
	// job starting over from their own state); ForkDepth: how far behind
	// the job's newest step the deepest one started.
	Forks     int
	ForkDepth int64
	FinalHash uint64
	// FalseDeaths: removals of replicas that no fault touched;
	// OutageRemovals: those during a coordinator or etcd outage.
	FalseDeaths    []Violation
	OutageRemovals int
	// Peer deaths (SIGKILL) and how the survivors' pending ops failed.
	KillErrors map[string]int // error kind (peer-failed naming the victim: "peer-failed(victim)")
	Unmapped   int            // peer-failed errors whose ranks could not be mapped to replicas
	// Data: what the job's history read (the final check's).
	Data DataCoverage
}

type stepEpoch struct {
	step  int64
	epoch uint64
}

type stepHash struct {
	step int64
	hash uint64
}

func check(in checkInput) *analysis {
	a := &analysis{KillErrors: map[string]int{}}
	bad := func(t int64, inv, f string, args ...any) {
		a.Violations = append(a.Violations, Violation{T: t, Invariant: inv, Detail: fmt.Sprintf(f, args...)})
	}
	initHash := func() uint64 {
		s := make([]float32, in.Params)
		initState(s)
		return stateHash(s)
	}()

	// Settings: the replicas of an epoch that took a settings version all
	// took it from the same step (the epoch's agreed first step).
	type settingsFrom struct {
		step int64
		who  string
	}
	tookAt := map[[2]uint64]settingsFrom{}
	for _, e := range in.Events {
		if e.Kind != evSettings {
			continue
		}
		k := [2]uint64{e.Epoch, e.Version}
		if f, ok := tookAt[k]; !ok {
			tookAt[k] = settingsFrom{e.From, e.Replica}
		} else if f.step != e.From {
			bad(e.T, invSettings, "epoch %d: %s took settings version %d from step %d, %s from step %d", e.Epoch, f.who, e.Version, f.step, e.Replica, e.From)
		}
	}

	// Who held which rank in each epoch: from the quorums, and from what
	// the commits' slots say.
	rankOf := map[uint64]map[int]string{}
	setRank := func(epoch uint64, rank int, r string) {
		if rankOf[epoch] == nil {
			rankOf[epoch] = map[int]string{}
		}
		rankOf[epoch][rank] = r
	}
	names := map[int]string{}
	for r, i := range in.Index {
		names[i] = r
	}
	// When each epoch ended: the first sign of a newer one (its quorum,
	// a reconfiguration into it, a commit in it).
	endedAt := map[uint64]int64{}
	var newest uint64
	for _, e := range in.Events {
		if (e.Kind == evQuorum || e.Kind == evReconf || e.Kind == evCommit) && e.Epoch > newest {
			for ep := newest; ep < e.Epoch; ep++ {
				endedAt[ep] = e.T
			}
			newest = e.Epoch
		}
	}
	for _, e := range in.Events {
		switch e.Kind {
		case evQuorum:
			for i, m := range e.Members {
				setRank(e.Epoch, i, replicaOfMember(m))
			}
		case evCommit:
			for k, rk := range e.Ranks {
				if rk >= 0 && names[k] != "" {
					setRank(e.Epoch, rk, names[k])
				}
			}
		}
	}

	// False deaths first: a replica the coordinator removed counts as
	// faulted around its removal (its peers rightly see it go).
	falselyDead := map[string][]int64{}
	touched := func(r string, t int64) bool {
		if in.EndAt != 0 && t >= in.EndAt {
			return true // leaving at the end
		}
		for _, f := range in.Faults {
			if f.covers(r, t, in.Linger) {
				return true
			}
		}
		return false
	}
	// A coordinator or etcd outage longer than the lease TTL makes the
	// members' etcd clients give their leases up: they register again,
	// which removes the old registration. Counted, not false deaths.
	outage := func(t int64) bool {
		for _, f := range in.Faults {
			switch f.Kind {
			case FaultCoordAll, FaultEtcd, FaultCoordKill, FaultCoordTerm:
				if f.overlaps(t-int64(in.Linger), t, 0) {
					return true
				}
			}
		}
		return false
	}
	for _, e := range in.Events {
		if e.Kind != evQuorum {
			continue
		}
		for _, m := range e.Removed {
			r := replicaOfMember(m)
			if touched(r, e.T) {
				continue
			}
			if outage(e.T) {
				a.OutageRemovals++
				falselyDead[r] = append(falselyDead[r], e.T)
				continue
			}
			v := Violation{T: e.T, Invariant: invFalseDeath,
				Detail: fmt.Sprintf("epoch %d removed %s, which no fault touched (%s)", e.Epoch, m, e.Reason)}
			a.FalseDeaths = append(a.FalseDeaths, v)
			if in.StrictDeaths {
				a.Violations = append(a.Violations, v)
			}
			falselyDead[r] = append(falselyDead[r], e.T)
		}
	}

	stoppedDuring := func(r string, from, to int64) bool {
		for _, f := range in.Faults {
			if f.Kind == FaultStop && len(f.Targets) == 1 && f.Targets[0] == r && f.overlaps(from, to, 0) {
				return true
			}
		}
		return false
	}
	faulted := func(r string, t int64) bool {
		if touched(r, t) {
			return true
		}
		for _, d := range falselyDead[r] {
			if t >= d-int64(in.Linger) && t <= d+int64(in.Linger) {
				return true
			}
		}
		return false
	}
	silence := func(from, to int64) bool {
		for _, f := range in.Faults {
			if f.Silent && f.overlaps(from, to, in.Linger) {
				return true
			}
		}
		return false
	}

	type procState struct {
		hash    uint64
		known   bool
		step    int64
		commits []Event
		settled int64 // time of its latest heal or final state
	}
	procs := map[string]*procState{}
	state := func(e Event) *procState {
		p := procs[e.who()]
		if p == nil {
			p = &procState{}
			procs[e.who()] = p
		}
		return p
	}
	agreed := map[stepEpoch]Event{}
	epochRanks := map[uint64]map[string]int{}
	type reconf struct {
		who     string
		how     string
		rank, n int
		t       int64
	}
	reconfs := map[uint64][]reconf{}
	committed := map[stepHash]bool{{0, initHash}: true}
	parent := map[stepHash]uint64{}
	var rollbacks = map[string][]Event{}
	var finals []Event

	var jobMax int64
	firstEpoch := map[int64]uint64{} // step → the epoch that first committed it
	forked := map[uint64]bool{}
	for _, e := range in.Events {
		if e.Kind == evCommit {
			if first, ok := firstEpoch[e.Step]; ok && first != e.Epoch && !forked[e.Epoch] && e.Epoch > first {
				forked[e.Epoch] = true
				a.Forks++
				a.ForkDepth = max(a.ForkDepth, jobMax-e.Step+1)
			}
			if _, ok := firstEpoch[e.Step]; !ok {
				firstEpoch[e.Step] = e.Epoch
			}
			jobMax = max(jobMax, e.Step)
		}
	}

	for _, e := range in.Events {
		switch e.Kind {
		case evStart:
			p := state(e)
			p.hash, p.known, p.step = e.Hash, true, 0
			if e.Hash != initHash {
				bad(e.T, invUncommit, "%s started from state %016x, not the initial %016x", e.who(), e.Hash, initHash)
			}
		case evCommit:
			a.Commits++
			a.Attempts++
			p := state(e)
			if p.known && e.Prev != p.hash {
				bad(e.T, invUncommit, "%s committed step %d on state %016x, but its last committed or healed state was %016x (step %d)",
					e.who(), e.Step, e.Prev, p.hash, p.step)
			}
			if len(p.commits) > 0 && e.Step <= p.commits[len(p.commits)-1].Step {
				bad(e.T, invMonotonic, "%s committed step %d after step %d", e.who(), e.Step, p.commits[len(p.commits)-1].Step)
			} else if p.known && e.Step != p.step+1 {
				bad(e.T, invMonotonic, "%s committed step %d from step %d", e.who(), e.Step, p.step)
			}
			p.hash, p.known, p.step = e.Hash, true, e.Step
			p.commits = append(p.commits, e)
			if n := bits.OnesCount32(e.Mask); n != e.N {
				bad(e.T, invAgreement, "%s committed step %d in epoch %d with %d participants, but %d replicas contributed (mask %b)",
					e.who(), e.Step, e.Epoch, e.N, n, e.Mask)
			}
			k := stepEpoch{e.Step, e.Epoch}
			if o, ok := agreed[k]; !ok {
				agreed[k] = e
			} else if o.Hash != e.Hash || o.Mask != e.Mask {
				bad(e.T, invAgreement, "step %d of epoch %d committed with state %016x (mask %b) at %s and %016x (mask %b) at %s",
					e.Step, e.Epoch, e.Hash, e.Mask, e.who(), o.Hash, o.Mask, o.who())
			}
			if epochRanks[e.Epoch] == nil {
				epochRanks[e.Epoch] = map[string]int{}
			}
			for slot, rk := range e.Ranks {
				r := names[slot]
				if rk < 0 || r == "" {
					continue
				}
				if old, ok := epochRanks[e.Epoch][r]; ok && old != rk {
					bad(e.T, invAgreement, "%s had rank %d and rank %d in epoch %d", r, old, rk, e.Epoch)
				}
				epochRanks[e.Epoch][r] = rk
			}
			sh := stepHash{e.Step, e.Hash}
			committed[sh] = true
			if pp, ok := parent[sh]; ok && pp != e.Prev {
				bad(e.T, invAgreement, "step %d state %016x reached from two states (%016x, %016x)", e.Step, e.Hash, pp, e.Prev)
			}
			parent[sh] = e.Prev
		case evFail:
			a.Attempts++
		case evHeal:
			p := state(e)
			if p.known && e.Step < p.step {
				bad(e.T, invMonotonic, "%s healed back to step %d from step %d", e.who(), e.Step, p.step)
			}
			p.hash, p.known, p.step, p.settled = e.Hash, true, e.Step, e.T
		case evRollback:
			a.Rollbacks++
			a.RolledBack += int(e.To - e.From + 1)
			a.MaxRollback = max(a.MaxRollback, e.To-e.From+1)
			rollbacks[e.who()] = append(rollbacks[e.who()], e)
			if in.Durable {
				bad(e.T, invSplitBrain, "DurableCommit: %s rolled back committed steps %d..%d", e.who(), e.From, e.To)
			}
		case evReconf:
			reconfs[e.Epoch] = append(reconfs[e.Epoch], reconf{e.who(), e.How, e.Rank, e.N, e.T})
		case evOp, evCommitD:
			// An all-reduce ends by its deadline. Commit's etcd work (the
			// durable record, reporting a failure) is bounded by the
			// timeout too.
			what, bound := "an all-reduce", in.Timeout+in.Margin
			if e.Kind == evCommitD {
				what, bound = "Commit", 2*in.Timeout+in.Margin
			}
			if time.Duration(e.Dur) > bound && !stoppedDuring(e.Replica, e.T-e.Dur, e.T) {
				bad(e.T, invDeadline, "%s: %s in epoch %d took %v (bound %v: timeout %v, margin %v)", e.who(), what, e.Epoch,
					time.Duration(e.Dur).Round(time.Millisecond), bound, in.Timeout, in.Margin)
			}
			if e.Kind == evOp {
				checkErr(in, e, rankOf, endedAt, faulted, silence, a, bad)
			}
		case evFatal:
			bad(e.T, invLiveness, "%s gave up: %s", e.who(), e.Err)
		case evExit:
			if !strings.HasPrefix(e.Reason, "expected") {
				bad(e.T, invLiveness, "%s exited on its own: %s", e.who(), e.Reason)
			}
		case evFinal:
			p := state(e)
			if p.known && e.Hash != p.hash {
				bad(e.T, invUncommit, "%s ended with state %016x, not its last committed or healed %016x", e.who(), e.Hash, p.hash)
			}
			p.settled = e.T
			finals = append(finals, e)
		}
	}

	// One reconfiguration choice per epoch.
	for epoch, rs := range reconfs {
		hows := map[string][]reconf{}
		ranks := map[int]string{}
		for _, r := range rs {
			hows[r.how] = append(hows[r.how], r)
			if o, dup := ranks[r.rank]; dup && r.rank >= 0 {
				bad(r.t, invReconfig, "epoch %d: %s and %s both took rank %d", epoch, o, r.who, r.rank)
			}
			ranks[r.rank] = r.who
			if r.n != rs[0].n {
				bad(r.t, invReconfig, "epoch %d: %s counts %d participants, %s %d", epoch, r.who, r.n, rs[0].who, rs[0].n)
			}
		}
		desc := func() string {
			var parts []string
			for _, r := range rs {
				parts = append(parts, fmt.Sprintf("%s %s rank %d", r.who, r.how, r.rank))
			}
			return strings.Join(parts, ", ")
		}
		switch {
		case len(hows["shrink"]) > 0 && len(hows) > 1:
			bad(rs[0].t, invReconfig, "epoch %d: some ranks shrank, others did not: %s", epoch, desc())
		case len(hows["prepared"]) > 0 && len(hows) > 1:
			// A prepared grow's comms are made alike by every rank.
			bad(rs[0].t, invReconfig, "epoch %d: some ranks moved to a prepared grow, others did not: %s", epoch, desc())
		case len(hows["grow"]) > 0:
			// Joiners (fresh) must come after every rank that grew.
			maxGrow, minFresh := -1, 1<<30
			for _, r := range hows["grow"] {
				maxGrow = max(maxGrow, r.rank)
			}
			for _, r := range hows["fresh"] {
				minFresh = min(minFresh, r.rank)
			}
			if minFresh < maxGrow || len(hows) > 2 {
				bad(rs[0].t, invReconfig, "epoch %d: a grow whose joiners are not the last ranks: %s", epoch, desc())
			}
		}
	}

	// Zombies: a replica stopped past its lease may finish the step it was
	// stopped in (its all-reduce may have completed), but its old epoch's
	// comms must refuse anything more.
	for _, f := range in.Faults {
		if f.Kind != FaultStop || f.End.IsZero() || len(f.Targets) != 1 {
			continue
		}
		var who string
		var old uint64
		for _, p := range procs {
			for _, c := range p.commits {
				if c.Replica == f.Targets[0] && c.T < f.Start.UnixNano() && c.Epoch >= old {
					who, old = c.who(), c.Epoch
				}
			}
		}
		if who == "" {
			continue
		}
		n := 0
		for _, c := range procs[who].commits {
			if c.T > f.End.UnixNano() && c.Epoch <= old {
				if n++; n == 2 {
					bad(c.T, invFencing, "%s, stopped in epoch %d past its lease and continued, committed step %d in that epoch",
						who, old, c.Step)
				}
			}
		}
	}

	checkSpares(in, touched, bad)
	dc := &dataChecker{in: in, bad: bad}
	defer dc.finish(a)
	dc.events()

	if !in.Final {
		return a
	}
	end := int64(0)
	if n := len(in.Events); n > 0 {
		end = in.Events[n-1].T
	}
	// Loading only committed state: every heal's state was committed by
	// someone at that step.
	for _, e := range in.Events {
		if e.Kind == evHeal && !committed[stepHash{e.Step, e.Hash}] {
			bad(e.T, invUncommit, "%s healed to step %d with state %016x, which nobody committed at that step", e.who(), e.Step, e.Hash)
		}
	}
	// The end: every replica with one state, at one step.
	if len(finals) == 0 {
		bad(end, invLiveness, "no replica reached the target step")
		return a
	}
	fin := finals[0]
	for _, f := range finals[1:] {
		if f.Hash != fin.Hash || f.Step != fin.Step {
			bad(f.T, invReplay, "replicas ended apart: %s at step %d with %016x, %s at step %d with %016x",
				f.who(), f.Step, f.Hash, fin.who(), fin.Step, fin.Hash)
		}
	}
	a.FinalStep, a.FinalHash = fin.Step, fin.Hash
	// The job's history: the final state's chain of commits back to the
	// initial state.
	masks := map[stepHash]uint32{}
	for k, e := range agreed {
		masks[stepHash{k.step, e.Hash}] = e.Mask
	}
	chain := make([]stepHash, fin.Step+1)
	h := fin.Hash
	for s := fin.Step; s > 0; s-- {
		chain[s] = stepHash{s, h}
		p, ok := parent[chain[s]]
		if !ok {
			bad(end, invReplay, "the final state's history is broken: nobody reported committing step %d with state %016x", s, h)
			return a
		}
		h = p
	}
	if h != initHash {
		bad(end, invReplay, "the final state's history starts from %016x, not the initial state %016x", h, initHash)
		return a
	}
	chain[0] = stepHash{0, initHash}
	inputs := make([]stepInput, 0, fin.Step)
	for s := int64(1); s <= fin.Step; s++ {
		inputs = append(inputs, stepInput{Step: s, Mask: masks[chain[s]]})
	}
	replay(in.Params, inputs, func(s int64, got uint64) bool {
		if got != chain[s].hash {
			bad(end, invReplay, "a fault-free replay of the committed steps gives state %016x at step %d; the job committed %016x",
				got, s, chain[s].hash)
			return false
		}
		return true
	})
	a.Data = dc.history(chain, finals)
	// Steps committed outside that history: a minority's commit that a
	// newer epoch redid. Every holder must have been told (a rollback
	// covering it) unless it died holding it; with DurableCommit it must
	// never happen.
	redone := map[int64]bool{}
	for who, p := range procs {
		for _, c := range p.commits {
			if c.Step <= fin.Step && chain[c.Step].hash == c.Hash {
				// In the history (a rollback of it may still be right:
				// another epoch can reach the same state, and ft tells
				// epochs apart, not contents).
				continue
			}
			a.Lost++
			redone[c.Step] = true
			if in.Durable {
				bad(c.T, invSplitBrain, "DurableCommit: %s committed step %d (epoch %d, state %016x) outside the job's history",
					who, c.Step, c.Epoch, c.Hash)
				continue
			}
			told := false
			for _, rb := range rollbacks[who] {
				told = told || (rb.From <= c.Step && c.Step <= rb.To && rb.T > c.T)
			}
			died := p.settled < c.T // it never healed or ended after it: it died holding it
			if !told && !died {
				bad(c.T, invSplitBrain, "%s committed step %d (epoch %d, state %016x) outside the job's history and was never told",
					who, c.Step, c.Epoch, c.Hash)
			}
		}
	}
	a.Redone = len(redone)
	// A rollback tells the loop that its steps From..To are not the
	// job's: wrong for a step this replica committed in the only epoch
	// that committed it, with the state the job's history has (ft tells
	// epochs apart, so a step redone by another epoch, even to the same
	// state, is rightly rolled back).
	epochsOf := map[int64]map[uint64]bool{}
	for k := range agreed {
		if epochsOf[k.step] == nil {
			epochsOf[k.step] = map[uint64]bool{}
		}
		epochsOf[k.step][k.epoch] = true
	}
	for who, rbs := range rollbacks {
		for _, rb := range rbs {
			for _, c := range procs[who].commits {
				if c.T > rb.T || c.Step < rb.From || c.Step > rb.To || c.Step > fin.Step || chain[c.Step].hash != c.Hash ||
					len(epochsOf[c.Step]) != 1 {
					continue
				}
				bad(rb.T, invRollback, "%s was told steps %d..%d were rolled back, but step %d is the job's, committed by epoch %d alone",
					who, rb.From, rb.To, c.Step, c.Epoch)
				break
			}
		}
	}
	sort.SliceStable(a.Violations, func(i, j int) bool { return a.Violations[i].T < a.Violations[j].T })
	return a
}

// checkErr checks one failed op's error: a known kind, naming a peer that a
// fault touched, a timeout only where someone was silent.
func checkErr(in checkInput, e Event, rankOf map[uint64]map[int]string, endedAt map[uint64]int64,
	faulted func(string, int64) bool, silence func(int64, int64) bool, a *analysis, bad func(int64, string, string, ...any)) {
	// A kill: how the victim's peers learned of it, in the ops of its
	// epoch that were pending when it died. Each must fail with
	// ErrPeerFailed naming it (an op issued later may be refused by the
	// revocation that followed: its kind is then ErrRevoked, rightly). An
	// epoch that had already ended (a zombie's, say, just continued) ends
	// its ops for its own reasons.
	for _, f := range in.Faults {
		kill := f.Start.UnixNano()
		if f.Kind != FaultKill || len(f.Targets) != 1 || f.Targets[0] == e.Replica || e.T-e.Dur > kill || e.T < kill ||
			e.ErrKind == "not-participating" {
			continue
		}
		if end, ok := endedAt[e.Epoch]; ok && end <= kill {
			continue // not the newest epoch when the victim died
		}
		victim := f.Targets[0]
		if _, was := epochRanksOf(rankOf, e.Epoch)[victim]; !was {
			continue // not the victim's epoch
		}
		k := e.ErrKind
		if k == "peer-failed" {
			named := false
			for _, rk := range e.Failed {
				named = named || rankOf[e.Epoch][rk] == victim
			}
			if named {
				k += "(victim)"
			} else {
				k += "(other)"
			}
		}
		a.KillErrors[k]++
		if k != "peer-failed(victim)" {
			bad(e.T, invErrKind, "%s: the death of %s (SIGKILL) reached its pending op in epoch %d as %s, not ErrPeerFailed naming it: %s",
				e.who(), victim, e.Epoch, e.ErrKind, e.Err)
		}
	}
	switch e.ErrKind {
	case "", "revoked", "aborted", "not-participating", "closed", "peer-closed":
	case "peer-failed":
		if faulted(e.Replica, e.T) {
			return // its own links were cut or slowed: anyone may look failed
		}
		for _, rk := range e.Failed {
			r, ok := rankOf[e.Epoch][rk]
			if !ok {
				a.Unmapped++
				continue
			}
			if !faulted(r, e.T) {
				bad(e.T, invErrKind, "%s: ErrPeerFailed names rank %d (%s) of epoch %d, which no fault touched: %s",
					e.who(), rk, r, e.Epoch, e.Err)
			}
		}
		if len(e.Failed) == 0 {
			bad(e.T, invErrKind, "%s: ErrPeerFailed without a *comm.RankError naming the peer: %s", e.who(), e.Err)
		}
	case "timeout":
		if !silence(e.T-e.Dur, e.T) {
			bad(e.T, invErrKind, "%s: ErrTimeout in epoch %d while no peer was stopped, cut off or slowed: %s", e.who(), e.Epoch, e.Err)
		}
	default:
		bad(e.T, invErrKind, "%s: an op failed with an error of kind %q: %s", e.who(), e.ErrKind, e.Err)
	}
}

// replicaOfMember maps a member id "<group>.<rank>" to the replica (group).
func replicaOfMember(id string) string {
	if i := strings.LastIndexByte(id, '.'); i > 0 {
		return id[:i]
	}
	return id
}

// epochRanksOf inverts an epoch's rank map: replica → rank.
func epochRanksOf(rankOf map[uint64]map[int]string, epoch uint64) map[string]int {
	out := map[string]int{}
	for rk, r := range rankOf[epoch] {
		out[r] = rk
	}
	return out
}
