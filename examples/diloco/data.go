package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"github.com/ftcomm/ftcomm/examples/diloco/charlm"
	"github.com/ftcomm/ftcomm/ft"
)

// What the replicas read: ft's Sampler over the training text's
// positions, a sync's plan read by the inner steps from its commit to the
// next (doc.go, "Data").

// samplerConfig is the job's sampler over train: the positions
// Context…len(train)-1 (sample i is position Context+i), a micro-batch of
// Batch per inner step, H/F of them per sync at the job's size.
func samplerConfig(cfg Config, train []uint8) ft.SamplerConfig {
	return ft.SamplerConfig{Name: "train", Size: int64(len(train) - cfg.Model.Context), Seed: cfg.Seed,
		Batch: cfg.Batch, Accum: cfg.H / cfg.F, Replicas: cfg.Replicas}
}

// plannedComm is the replica's ft.Comm as DiLoCo drives it: DiLoCo calls
// Step and Commit inside Tick, and the sampler's plan is readable only
// between them, so Step keeps it (and a rollback it reported) for the
// training loop. AllToAll and the rest are the Comm's.
type plannedComm struct {
	*ft.Comm
	s        *ft.Sampler
	plans    [2]ft.Plan        // the two latest syncs' plans, newest last
	rollback *ft.RollbackError // reported by the latest Step; the loop takes it
}

func (p *plannedComm) Step(ctx context.Context) error {
	err := p.Comm.Step(ctx)
	var rb *ft.RollbackError
	if errors.As(err, &rb) {
		p.rollback = rb
	}
	if plan, perr := p.s.Plan(); perr == nil {
		p.plans[0], p.plans[1] = p.plans[1], plan
	}
	return err
}

// plan returns the plan of step, a sync that just committed: the newest
// (a sync that failed is taken again under the same step, with the
// quorum's new shape).
func (p *plannedComm) plan(step int64) (ft.Plan, bool) {
	for i := len(p.plans) - 1; i >= 0; i-- {
		if x := p.plans[i]; x.Step == step && x.Micro != nil {
			return x, true
		}
	}
	return ft.Plan{}, false
}

// window is what the inner steps read from a committed sync to the next
// commit: its plan's micro-batches spread over the window's inner steps
// (H/F: one each when the plan has H/F, as at the job's size under the
// replica policy; more when the survivors keep the global batch).
type window struct {
	plan  ft.Plan
	steps int // inner steps from the commit to the next
	taken int
}

// next returns the micro-batches of the window's next inner step: k·i/n
// to k·(i+1)/n of the plan's k over n inner steps (none once the window
// is spent, or when the last sync did not commit here).
func (w *window) next() []ft.MicroBatch {
	k, n, i := len(w.plan.Micro), w.steps, w.taken
	if i >= n {
		return nil
	}
	w.taken++
	return w.plan.Micro[k*i/n : k*(i+1)/n]
}

// innerTrainer runs an inner step on micro-batches: one is a batch; more
// are one step on the mean of their gradients, weighted by their sizes.
type innerTrainer struct {
	tr      *charlm.Trainer
	context int
	pos     []int
	acc     []float32
}

func newInnerTrainer(m *charlm.Model, batch int) *innerTrainer {
	return &innerTrainer{tr: charlm.NewTrainer(m, batch), context: m.Context, acc: make([]float32, len(m.Params))}
}

// grads computes the mean loss of mbs and its gradient (a slice valid
// until the next call); n is the samples it read.
func (t *innerTrainer) grads(train []uint8, mbs []ft.MicroBatch) (loss float64, grads []float32, n int) {
	for _, mb := range mbs {
		n += len(mb.Indices)
	}
	if n == 0 {
		return 0, nil, 0
	}
	if len(mbs) > 1 {
		clear(t.acc)
	}
	for _, mb := range mbs {
		if len(mb.Indices) == 0 {
			continue
		}
		t.pos = t.pos[:0]
		for _, x := range mb.Indices {
			t.pos = append(t.pos, t.context+int(x))
		}
		l := float64(t.tr.Step(train, t.pos))
		w := float64(len(mb.Indices)) / float64(n)
		loss += l * w
		if len(mbs) == 1 {
			return loss, t.tr.Grads, n
		}
		for i, g := range t.tr.Grads {
			t.acc[i] += float32(w) * g
		}
	}
	return loss, t.acc, n
}

// planRecord is a line of a replica's plans log: the plan a committed sync
// gave it (read by its inner steps up to the next commit), or steps a heal
// rolled back (Kind "rollback", From…To).
type planRecord struct {
	Kind         string  `json:"kind,omitempty"`
	Step         int64   `json:"step,omitempty"`
	Position     int64   `json:"position,omitempty"`
	First        int64   `json:"first,omitempty"`
	Samples      int     `json:"samples,omitempty"`
	Participants int     `json:"participants,omitempty"`
	Target       int     `json:"target,omitempty"`
	Policy       string  `json:"policy,omitempty"`
	Indices      []int64 `json:"indices,omitempty"`
	From         int64   `json:"from,omitempty"`
	To           int64   `json:"to,omitempty"`
}

func recordOf(p ft.Plan) planRecord {
	return planRecord{Step: p.Step, Position: p.Position, First: p.First, Samples: p.Samples, Participants: p.Participants,
		Target: p.Target, Policy: string(p.Policy), Indices: p.Indices()}
}

// plansLog is the file of a replica process's plans log.
func plansLog(dir, job, replica string, restart int) string {
	return filepath.Join(dir, fmt.Sprintf("%s-%s-%d.jsonl", job, replica, restart))
}

// appendRecord appends r to f in one write: a SIGKILL leaves a log whole
// up to its last line.
func appendRecord(f *os.File, r planRecord) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	_, err = f.Write(append(b, '\n'))
	return err
}

// Coverage is what a job's committed syncs read, checked from the plans
// the replicas recorded.
type Coverage struct {
	Size    int64 // samples in the training set (an epoch)
	Syncs   int64 // committed syncs, 1…Syncs, each recorded by a replica
	Samples int64 // positions the committed syncs handed out: the job's position at the end
	// Recorded is how many of them the replicas recorded. The rest were
	// handed to replicas that did not see their sync commit — killed
	// before they recorded it, or whose commit failed where the others'
	// succeeded — and never read them.
	Recorded int64
	Twice    int64 // samples recorded more than once in an epoch (want 0)
	// Lone is the commits of killed replicas that completed there alone
	// (their peers failed the sync and took it again without them): not
	// the job's, left out.
	Lone     int
	Problems []string // what breaks exactly-once (want none)
}

// ExactlyOnce reports whether the committed syncs read every sample of
// the epochs they covered once, and nothing twice.
func (c Coverage) ExactlyOnce() bool { return len(c.Problems) == 0 && c.Twice == 0 }

func (c Coverage) String() string {
	if c.Samples == 0 && c.ExactlyOnce() {
		return "–"
	}
	s := fmt.Sprintf("%d of %d (%.1f %% of an epoch)", c.Samples, c.Size, 100*float64(c.Samples)/float64(c.Size))
	switch {
	case !c.ExactlyOnce():
		s += fmt.Sprintf(", NOT each once: %d twice; %v", c.Twice, c.Problems)
	default:
		s += ", each once"
	}
	if u := c.Samples - c.Recorded; u > 0 {
		s += fmt.Sprintf(" (%d unread: the shares of replicas that did not see their sync commit)", u)
	}
	return s
}

// readPlansLog reads a plans log, in order, its rollbacks applied.
func readPlansLog(path string) ([]planRecord, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []planRecord
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<16), 64<<20)
	for sc.Scan() {
		var r planRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if r.Kind == "rollback" {
			out = slices.DeleteFunc(out, func(x planRecord) bool { return r.From <= x.Step && x.Step <= r.To })
			continue
		}
		out = append(out, r)
	}
	return out, sc.Err()
}

// checkCoverage checks the plans logs of a job whose replicas committed
// syncs 1…syncs, the logs of killed processes in killed: every committed
// sync recorded, each starting where the one before ended, its records
// agreeing on it and reading disjoint positions inside it; no sample
// recorded twice in an epoch. A killed process's last record may be a
// commit that was its alone (left out, counted in Lone).
func checkCoverage(size, syncs int64, logs map[string][]planRecord, killed map[string]bool) Coverage {
	cv := Coverage{Size: size, Syncs: syncs}
	bad := func(f string, a ...any) { cv.Problems = append(cv.Problems, fmt.Sprintf(f, a...)) }
	type version struct {
		position               int64
		samples, parts, target int
		policy                 string
	}
	of := func(r planRecord) version {
		return version{r.Position, r.Samples, r.Participants, r.Target, r.Policy}
	}
	lone := func(name string, i int) bool { return killed[name] && i == len(logs[name])-1 }
	names := slices.Sorted(maps.Keys(logs))
	job := map[int64]version{}
	for _, n := range names {
		for i, r := range logs[n] {
			if lone(n, i) {
				continue
			}
			if v, ok := job[r.Step]; ok && v != of(r) {
				bad("sync %d recorded as %+v and as %+v (%s)", r.Step, v, of(r), n)
			}
			job[r.Step] = of(r)
		}
	}
	bySync := map[int64][]planRecord{}
	for _, n := range names {
		for i, r := range logs[n] {
			if v, ok := job[r.Step]; ok && v != of(r) && lone(n, i) {
				cv.Lone++
				continue
			} else if !ok {
				job[r.Step] = of(r) // only a killed replica recorded it
			}
			bySync[r.Step] = append(bySync[r.Step], r)
		}
	}
	seen := map[int64][]uint64{} // epoch → a bit per sample
	var pos int64
	for step := int64(1); step <= syncs; step++ {
		rs := bySync[step]
		if len(rs) == 0 {
			bad("no replica recorded committed sync %d", step)
			return cv
		}
		v := job[step]
		if v.position != pos {
			bad("sync %d starts at position %d, the sync before ended at %d", step, v.position, pos)
			return cv
		}
		slices.SortFunc(rs, func(a, b planRecord) int { return cmp.Compare(a.First, b.First) })
		end := v.position
		for _, r := range rs {
			if r.First < end || r.First+int64(len(r.Indices)) > v.position+int64(v.samples) {
				bad("sync %d: a replica read positions %d…%d, overlapping another's or outside the sync's %d…%d",
					step, r.First, r.First+int64(len(r.Indices))-1, v.position, v.position+int64(v.samples)-1)
			}
			end = max(end, r.First+int64(len(r.Indices)))
			for i, x := range r.Indices {
				e := (r.First + int64(i)) / size
				if x < 0 || x >= size {
					bad("sync %d: sample %d is not in the training set", step, x)
					continue
				}
				if seen[e] == nil {
					seen[e] = make([]uint64, (size+63)/64)
				}
				if seen[e][x/64]&(1<<(x%64)) != 0 {
					cv.Twice++
				}
				seen[e][x/64] |= 1 << (x % 64)
				cv.Recorded++
			}
		}
		pos += int64(v.samples)
	}
	cv.Samples = pos
	if len(bySync) > int(syncs) {
		bad("replicas recorded %d syncs, the job committed %d", len(bySync), syncs)
	}
	return cv
}
