package ft

import (
	"bufio"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// childSamplerConfig is what the replica processes read (runChild with
// FTCOMM_FT_DATA): 997 samples (a prime, so the permutation walks its
// cycles), micro-batches of 3, 2 per step; the target is the quorum's
// (the most replica groups of the run).
func childSamplerConfig() SamplerConfig {
	return SamplerConfig{Size: 997, Seed: 44, Batch: 3, Accum: 2}
}

// dataRecord is a line of a replica process's data log: a committed
// step's plan (Kind ""), a step that did not commit ("failed"), or steps
// a heal rolled back ("rollback", From..To).
type dataRecord struct {
	Kind         string      `json:"kind,omitempty"`
	Step         int64       `json:"step,omitempty"`
	Position     int64       `json:"position,omitempty"`
	First        int64       `json:"first,omitempty"`
	Samples      int         `json:"samples,omitempty"`
	Participants int         `json:"participants,omitempty"`
	Target       int         `json:"target,omitempty"`
	Policy       BatchPolicy `json:"policy,omitempty"`
	Slot         int         `json:"slot,omitempty"`
	Indices      []int64     `json:"indices,omitempty"`
	From         int64       `json:"from,omitempty"`
	To           int64       `json:"to,omitempty"`
}

// childData is a replica process's Sampler and its data log,
// DIR/<member id>.<pid>.jsonl: one line per committed step, written (one
// write, appended) as soon as Commit returns true. A nil *childData
// records nothing.
type childData struct {
	s    *Sampler
	f    *os.File
	plan Plan
	err  error // why the step has no plan
	slot int
}

// openChildData makes c's sampler (position: SamplerConfig.Position, the
// one a replica restored from its own checkpoint would hold) and the log.
func openChildData(c *Comm, dir, id, position string) (*childData, error) {
	cfg := childSamplerConfig()
	if position != "" {
		var err error
		if cfg.Position, err = strconv.ParseInt(position, 10, 64); err != nil {
			return nil, fmt.Errorf("data position: %w", err)
		}
	}
	s, err := NewSampler(c, cfg)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(dir, fmt.Sprintf("%s.%d.jsonl", id, os.Getpid())), os.O_CREATE|os.O_EXCL|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	return &childData{s: s, f: f}, nil
}

// begin takes the plan of the step that started.
func (d *childData) begin(c *Comm) {
	if d == nil {
		return
	}
	d.plan, d.err = d.s.Plan()
	d.slot = c.Rank()*max(c.cfg.GroupSize, 1) + c.cfg.GroupRank
}

func (d *childData) write(r dataRecord) error {
	if d == nil {
		return nil
	}
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	_, err = d.f.Write(append(b, '\n'))
	return err
}

// committed records the step's plan: Commit returned true.
func (d *childData) committed() error {
	if d == nil {
		return nil
	}
	if d.err != nil {
		return fmt.Errorf("committed a step without a plan: %w", d.err)
	}
	p := d.plan
	return d.write(dataRecord{Step: p.Step, Position: p.Position, First: p.First, Samples: p.Samples,
		Participants: p.Participants, Target: p.Target, Policy: p.Policy, Slot: d.slot, Indices: p.Indices()})
}

// failed records a step that did not commit here (its plan, if any).
func (d *childData) failed() error {
	if d == nil || d.err != nil {
		return nil
	}
	p := d.plan
	return d.write(dataRecord{Kind: "failed", Step: p.Step, Position: p.Position, Samples: p.Samples,
		Participants: p.Participants, Policy: p.Policy})
}

func (d *childData) rolledBack(rb *RollbackError) error {
	return d.write(dataRecord{Kind: "rollback", From: rb.FromStep, To: rb.ToStep})
}

// dataLog is a replica process's data log as the test reads it back.
type dataLog struct {
	id     string
	pid    int
	inc    *incarnation // its committed steps, rollbacks taken out
	failed []dataRecord
}

// readDataLogs reads every data log in dir; the processes in killed
// (by pid) died with their last commit perhaps theirs alone.
func readDataLogs(t *testing.T, dir string, killed map[int]bool) []*dataLog {
	t.Helper()
	names, err := filepath.Glob(filepath.Join(dir, "*.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var logs []*dataLog
	for _, name := range names {
		base := strings.TrimSuffix(filepath.Base(name), ".jsonl")
		dot := strings.LastIndexByte(base, '.')
		pid, err := strconv.Atoi(base[dot+1:])
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		l := &dataLog{id: base[:dot], pid: pid, inc: &incarnation{who: base, killed: killed[pid]}}
		f, err := os.Open(name)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var r dataRecord
			if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
				t.Fatalf("%s: %q: %v", name, sc.Text(), err)
			}
			switch r.Kind {
			case "":
				if r.First < r.Position || r.First+int64(len(r.Indices)) > r.Position+int64(r.Samples) {
					t.Fatalf("%s: step %d: samples at %d..%d, outside the step's %d..%d", name, r.Step, r.First,
						r.First+int64(len(r.Indices)), r.Position, r.Position+int64(r.Samples))
				}
				l.inc.slices = append(l.inc.slices, committedSlice{step: r.Step, position: r.Position, samples: r.Samples,
					shape: stepShape{r.Participants, r.Target, 1, r.Policy}, slot: r.Slot, indices: r.Indices})
			case "failed":
				l.failed = append(l.failed, r)
			case "rollback":
				l.inc.rollback(r.From, r.To)
			}
		}
		f.Close()
		if err := sc.Err(); err != nil {
			t.Fatal(err)
		}
		logs = append(logs, l)
	}
	return logs
}

// pid is process id's pid.
func (j *procJob) pid(id string) int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.procs[id].Process.Pid
}

// Three replica processes read a dataset through ft's Sampler and record
// what each committed step gave them. Through a SIGKILL and a restart, a
// step refused by one replica (so it fails wherever it ran, and no one
// commits it in its epoch), and the job's batch policy
// switched to "global" through the coordinator while it runs, then
// another SIGKILL, the job's committed history — steps 1, 2, … with no
// gap, each starting at the position where the one before ended — reads
// the epochs' permutations exactly once (checkCoverage, over every slot:
// a rank killed between its commit and its record leaves its slot
// unrecorded, and the slot's share is recomputed from the step's shape).
// The restarted replica, started at a position of its own (its
// checkpoint's), heals the job's and its first commit continues it; the
// failed step gives its samples back to the next; steps of 2 of 3
// replicas read 2/3 of the global batch under "replica" and all of it
// under "global".
func TestProcessDataFollowsTheQuorum(t *testing.T) {
	if testing.Short() {
		t.Skip("starts replica processes")
	}
	j := newProcJob(t)
	dir := t.TempDir()
	const params = 1 << 12
	spawn := func(g string, env ...string) {
		j.spawnCmd(childCmd(), g, 0, 1, params, append([]string{"FTCOMM_FT_DATA=" + dir}, env...)...)
	}
	// commitsAfter waits until each of ids has committed n steps with
	// participants replica groups, after t0 and in epoch from on.
	commitsAfter := func(what string, t0 time.Time, from uint64, participants, n int, ids ...string) {
		t.Helper()
		got := map[string]int{}
		j.await(what, func(ev childEvent) bool {
			if ev.Kind == "" && ev.Participants == participants && ev.Epoch >= from && time.Unix(0, ev.UnixNano).After(t0) {
				got[ev.ID]++
			}
			for _, id := range ids {
				if got[id] < n {
					return false
				}
			}
			return true
		})
	}
	for _, g := range []string{"a", "b", "c"} {
		spawn(g)
	}
	commitsAfter("three replicas committing together", time.Time{}, 0, 3, 3, "a.0", "b.0", "c.0")

	// c dies; a and b go on, reading 2/3 of the global batch.
	killed := map[int]bool{j.pid("c.0"): true}
	t0 := j.kill("c.0")
	commitsAfter("a and b committing without c", t0, 0, 2, 3, "a.0", "b.0")
	// c comes back at the position it holds itself (its last record's
	// end), which the job has moved past: it must take the job's.
	own := int64(0)
	for _, l := range readDataLogs(t, dir, killed) {
		if killed[l.pid] && len(l.inc.slices) > 0 {
			last := l.inc.slices[len(l.inc.slices)-1]
			own = last.position + int64(last.samples)
		}
	}
	spawn("c", "FTCOMM_FT_DATA_POSITION="+strconv.FormatInt(own, 10))
	restarted := j.pid("c.0")
	j.await("the restarted c's first commit", func(ev childEvent) bool {
		return ev.Kind == "" && ev.Pid == restarted
	})

	// A step fails wherever it ran: a refuses its all-reduce, so the
	// others' fails too (a replica that had not begun it when the epoch
	// was revoked begins it in the next). The job takes the step again in
	// a later epoch.
	j.send("a.0", "refuse")
	refused := j.await("a's refused step", func(ev childEvent) bool { return ev.Kind == "failed" && ev.ID == "a.0" })
	j.await("the refused step committed in a later epoch", func(ev childEvent) bool {
		return ev.Kind == "" && ev.Step == refused.Step && ev.Epoch > refused.Epoch
	})
	failedStep := refused.Step
	// The job's batch policy becomes "global" while it runs.
	changes, err := membership.ParseSettingChanges([]string{SettingBatchPolicy + "=global"})
	if err != nil {
		t.Fatal(err)
	}
	up, err := j.coord.SetSettings(testutil.Ctx(t, 30*time.Second), "proc", changes, "test")
	if err != nil || up.Epoch == 0 {
		t.Fatalf("ftcomm.batch_policy=global: %+v, %v", up, err)
	}
	commitsAfter("three replicas committing under the global policy", time.Time{}, up.Epoch, 3, 1, "a.0", "b.0", "c.0")
	killed[j.pid("b.0")] = true
	t1 := j.kill("b.0")
	commitsAfter("a and c committing without b", t1, up.Epoch, 2, 3, "a.0", "c.0")
	j.stopAll()
	j.check()

	// What the committed steps read.
	logs := readDataLogs(t, dir, killed)
	var incs []*incarnation
	for _, l := range logs {
		incs = append(incs, l.inc)
	}
	hist := jobHistory(t, "the job", incs)
	if len(hist) == 0 {
		t.Fatal("no committed step recorded")
	}
	cfg := childSamplerConfig()
	last := hist[len(hist)-1]
	checkCoverage(t, "the job", cfg, hist, last.position+int64(last.samples))
	steps := map[int64]committedSlice{}
	for _, s := range hist {
		steps[s.step] = s
	}

	// The restarted replica resumed at the job's position, not its own.
	i := slices.IndexFunc(logs, func(l *dataLog) bool { return l.pid == restarted })
	if i < 0 || len(logs[i].inc.slices) == 0 {
		t.Fatal("the restarted c recorded no commit")
	}
	first := logs[i].inc.slices[0]
	before, ok := steps[first.step-1]
	if !ok || first.position != before.position+int64(before.samples) || first.position == own {
		t.Fatalf("the restarted c's first commit, step %d, starts at position %d (its own was %d; the job's step %d ended at %d)",
			first.step, first.position, own, before.step, before.position+int64(before.samples))
	}

	// No replica committed the refused step in its epoch, and it gave its
	// samples back: the step of that number that committed starts where
	// the failed one did.
	failedAt := map[string]bool{}
	for _, ev := range j.all {
		if ev.Step == failedStep && ev.Epoch == refused.Epoch {
			switch ev.Kind {
			case "":
				t.Errorf("%s committed step %d in epoch %d, which a refused", ev.ID, ev.Step, ev.Epoch)
			case "failed":
				failedAt[ev.ID] = true
			}
		}
	}
	for _, l := range logs {
		for _, f := range l.failed {
			if f.Step == failedStep && steps[f.Step].position != f.Position {
				t.Errorf("%s's step %d failed at position %d; the job committed it from %d", l.inc.who, f.Step, f.Position,
					steps[f.Step].position)
			}
		}
	}

	// Steps of 2 of 3 replicas: 12 samples under "replica", the global
	// batch of 18 (3 micro-batches each) under "global".
	full := 3 * cfg.Accum * cfg.Batch
	want := map[BatchPolicy]int{KeepReplicaBatch: full * 2 / 3, KeepGlobalBatch: full}
	seen := map[BatchPolicy]int{}
	for _, s := range steps {
		if s.shape.participants == 2 && s.shape.target == 3 {
			seen[s.shape.policy]++
			if s.samples != want[s.shape.policy] {
				t.Errorf("step %d of 2 of 3 replicas under %q read %d samples, want %d", s.step, s.shape.policy, s.samples, want[s.shape.policy])
			}
		}
	}
	if seen[KeepReplicaBatch] == 0 || seen[KeepGlobalBatch] == 0 {
		t.Errorf("steps of 2 of 3 replicas by policy: %v, want some under each", seen)
	}
	t.Logf("%d committed steps, position %d (epoch %d); step %d failed at %v in epoch %d, taken again from position %d; "+
		"c restarted at its own position %d resumed at the job's %d (step %d); 2-of-3 steps by policy %v",
		last.step, last.position+int64(last.samples), (last.position+int64(last.samples))/cfg.Size, failedStep,
		slices.Sorted(maps.Keys(failedAt)), refused.Epoch, steps[failedStep].position, own, first.position, first.step, seen)
}
