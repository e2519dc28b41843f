package main

import (
	"fmt"
	"slices"
	"sort"

	"github.com/ftcomm/ftcomm/ft"
)

// The job reads a dataset through an ft.Sampler (Config.Data). Each
// replica records what its sampler read in a step in the step's commit
// event (one write: a SIGKILL loses no read of a step whose commit it
// recorded), and its sampler's position with its start, commits, failed
// steps, heals and final state. The data invariant holds the job's
// history to ft's promise: across commits, shrinks, grows, heals and
// promotions the committed steps read every sample of every epoch exactly
// once. (The toy gradient does not depend on the samples: the replay
// invariant says nothing of them, this one does.)
const invData = "data" // no committed sample twice, none skipped

// DataRead is what a replica's sampler read in a step it committed
// (ft.Plan): where the step began, its global batch and shape, the
// replica's slot among the step's ranks (its FT rank: a replica of the
// chaos job is a group of one rank) and its samples.
type DataRead struct {
	Step    int64   `json:"step"`
	Pos     int64   `json:"pos"`
	Samples int     `json:"n"`
	Parts   int     `json:"parts"`
	Target  int     `json:"target"`
	Policy  string  `json:"policy"`
	Slot    int     `json:"slot"`
	Indices []int64 `json:"idx"`
}

// readOf records plan, read at slot.
func readOf(p ft.Plan, slot int) *DataRead {
	return &DataRead{Step: p.Step, Pos: p.Position, Samples: p.Samples, Parts: p.Participants, Target: p.Target,
		Policy: string(p.Policy), Slot: slot, Indices: p.Indices()}
}

// sameStep reports whether d and o describe one cut of one step (their
// slots may differ).
func (d *DataRead) sameStep(o *DataRead) bool {
	return d.Step == o.Step && d.Pos == o.Pos && d.Samples == o.Samples && d.Parts == o.Parts && d.Target == o.Target &&
		d.Policy == o.Policy
}

// share recomputes slot's samples of the step d describes.
func (d *DataRead) share(cfg ft.SamplerConfig, slot int) ([]int64, error) {
	p, err := ft.PlanFor(cfg, d.Step, d.Pos, d.Parts, d.Target, 1, ft.BatchPolicy(d.Policy), slot, 0)
	if err != nil {
		return nil, err
	}
	return p.Indices(), nil
}

func (d *DataRead) String() string {
	return fmt.Sprintf("step %d positions %d..%d (%d of %d participants, target %d, %s)", d.Step, d.Pos,
		d.Pos+int64(d.Samples)-1, d.Slot, d.Parts, d.Target, d.Policy)
}

// DataCoverage is what the job's committed history read.
type DataCoverage struct {
	// Checked: the history was followed to its end (false: no sampler,
	// or the final state's history is broken, which the replay invariant
	// reports).
	Checked bool  `json:"checked"`
	Steps   int64 `json:"steps"`
	// Samples: the position the history ends at; Epochs: the epochs it
	// read whole, each sample exactly once; InProgress: the samples it
	// read of the next one, none twice.
	Samples    int64 `json:"samples"`
	Epochs     int64 `json:"epochs"`
	InProgress int64 `json:"inProgress"`
}

// maxDataViolations: a sampler that goes wrong goes wrong at every step;
// the first ones say it, the rest are counted in one more.
const maxDataViolations = 20

// dataChecker checks the data invariant over a run's events.
type dataChecker struct {
	in  checkInput
	bad func(int64, string, string, ...any)
	n   int   // violations found
	t   int64 // the last one's time
}

func (dc *dataChecker) on() bool { return dc.in.Data.Size > 0 }

func (dc *dataChecker) violation(t int64, f string, args ...any) {
	if dc.n++; dc.n <= maxDataViolations {
		dc.bad(t, invData, f, args...)
	}
	dc.t = max(dc.t, t)
}

// finish adds one violation for those left out.
func (dc *dataChecker) finish(a *analysis) {
	if more := dc.n - maxDataViolations; more > 0 {
		a.Violations = append(a.Violations, Violation{T: dc.t, Invariant: invData,
			Detail: fmt.Sprintf("… and %d more violations of the data invariant", more)})
		sort.SliceStable(a.Violations, func(i, j int) bool { return a.Violations[i].T < a.Violations[j].T })
	}
}

// events checks what each replica process read against what its sampler
// held, step by step: a commit reads its slot's share of the step it
// records (ft.PlanFor), from the position the process held (its last
// commit's end, heal or start), as a step of the comm's participants, and
// moves the position past the step; a step that fails moves nothing; the
// ranks of an epoch that commit a step record one cut of it, each its own
// slot.
func (dc *dataChecker) events() {
	if !dc.on() {
		return
	}
	cfg := dc.in.Data
	type held struct {
		pos   int64
		known bool
	}
	procs := map[string]*held{}
	first := map[stepEpoch]Event{}
	slots := map[stepEpoch]map[int]string{}
	split := map[uint64]bool{} // epochs whose ranks read apart, said once
	for _, e := range dc.in.Events {
		p := procs[e.who()]
		if p == nil {
			p = &held{}
			procs[e.who()] = p
		}
		switch e.Kind {
		case evStart, evHeal:
			if e.Pos != nil {
				p.pos, p.known = *e.Pos, true
			}
		case evFail, evFinal:
			if e.Pos != nil && p.known && *e.Pos != p.pos {
				what := "a step that did not commit (" + fmt.Sprint(e.Step+1) + ")"
				if e.Kind == evFinal {
					what = "its final state"
				}
				dc.violation(e.T, "%s: its sampler holds position %d after %s, but %d before it", e.who(), *e.Pos, what, p.pos)
			}
			if e.Pos != nil {
				p.pos, p.known = *e.Pos, true
			}
		case evCommit:
			d := e.Data
			if d == nil {
				dc.violation(e.T, "%s committed step %d (epoch %d) with no plan from its sampler: %s", e.who(), e.Step, e.Epoch, e.Err)
				if e.Pos != nil {
					p.pos, p.known = *e.Pos, true
				}
				continue
			}
			switch own, err := d.share(cfg, d.Slot); {
			case d.Step != e.Step:
				dc.violation(e.T, "%s committed step %d with the plan of step %d", e.who(), e.Step, d.Step)
			case d.Parts != e.N:
				dc.violation(e.T, "%s committed step %d of %d participants with a plan cut for %d", e.who(), e.Step, e.N, d.Parts)
			case err != nil:
				dc.violation(e.T, "%s committed %s, which no sampler can plan: %v", e.who(), d, err)
			case !slices.Equal(own, d.Indices):
				dc.violation(e.T, "%s committed %s reading %s; the slot's share is %s", e.who(), d, indices(d.Indices), indices(own))
			}
			if p.known && d.Pos != p.pos {
				dc.violation(e.T, "%s committed step %d reading from position %d, but its sampler held %d (its last commit, heal or start)",
					e.who(), e.Step, d.Pos, p.pos)
			}
			end := d.Pos + int64(d.Samples)
			if e.Pos != nil && *e.Pos != end {
				dc.violation(e.T, "%s committed %s, and its sampler holds position %d after it, not %d", e.who(), d, *e.Pos, end)
				end = *e.Pos
			}
			p.pos, p.known = end, true
			k := stepEpoch{e.Step, e.Epoch}
			if f, ok := first[k]; !ok {
				first[k], slots[k] = e, map[int]string{}
			} else if !f.Data.sameStep(d) && f.who() != e.who() && !split[e.Epoch] { // one process twice: the monotonic invariant's
				split[e.Epoch] = true
				dc.violation(e.T, "epoch %d committed step %d as %s at %s and as %s at %s", e.Epoch, e.Step, f.Data, f.who(), d, e.who())
			}
			if o, dup := slots[k][d.Slot]; dup && o != e.who() {
				dc.violation(e.T, "%s and %s both read slot %d of step %d in epoch %d", o, e.who(), d.Slot, e.Step, e.Epoch)
			}
			slots[k][d.Slot] = e.who()
		}
	}
}

// history follows the job's history (chain[s]: the state of its step s)
// through what its steps read: from position 0 each step starts where
// the one before ended, every slot of it — recorded by a replica that
// committed it, else recomputed from the step's cut — reads its share,
// and within each epoch no sample is read twice, so that every finished
// epoch was read whole. A step committed outside that history is not the
// job's (the split-brain invariant's business, not this one's). finals
// and heals hold the position of the state they end at or load.
func (dc *dataChecker) history(chain []stepHash, finals []Event) DataCoverage {
	if !dc.on() {
		return DataCoverage{}
	}
	cfg := dc.in.Data
	byState := map[stepHash][]Event{}
	for _, e := range dc.in.Events {
		if e.Kind == evCommit && e.Data != nil {
			k := stepHash{e.Step, e.Hash}
			byState[k] = append(byState[k], e)
		}
	}
	// A heal loads a committed state's position with it.
	for _, e := range dc.in.Events {
		if e.Kind != evHeal || e.Pos == nil {
			continue
		}
		want := int64(0)
		if e.Step > 0 {
			recs := byState[stepHash{e.Step, e.Hash}]
			if len(recs) == 0 {
				continue // a state nobody committed: the uncommitted invariant's
			}
			want = recs[0].Data.Pos + int64(recs[0].Data.Samples)
		}
		if *e.Pos != want {
			dc.violation(e.T, "%s healed to step %d (state %016x) at position %d; that state was committed at position %d",
				e.who(), e.Step, e.Hash, *e.Pos, want)
		}
	}
	var pos int64
	seen := make([]int64, cfg.Size) // the position+1 that read each sample of the current epoch
	epoch := int64(0)
	for s := 1; s < len(chain); s++ {
		recs := byState[chain[s]]
		i := slices.IndexFunc(recs, func(e Event) bool { return e.Data.Pos == pos })
		if i < 0 {
			if len(recs) == 0 {
				dc.violation(dc.end(), "the job's step %d (state %016x) has no record of what it read", s, chain[s].hash)
			} else {
				dc.violation(recs[0].T, "the job's step %d read %s; its steps before ended at position %d", s, recs[0].Data, pos)
			}
			return DataCoverage{Steps: int64(s - 1), Samples: pos, Epochs: pos / cfg.Size, InProgress: pos % cfg.Size}
		}
		d := recs[i].Data
		own := map[int][]int64{}
		for _, o := range recs {
			// Ranks of one epoch that read apart are said by events.
			if (o.Data.Pos != d.Pos || o.Data.Samples != d.Samples) && o.Epoch != recs[i].Epoch {
				dc.violation(o.T, "the job's step %d (state %016x) was committed reading %s at %s and %s at %s",
					s, chain[s].hash, d, recs[i].who(), o.Data, o.who())
			}
			if o.Data.sameStep(d) {
				own[o.Data.Slot] = o.Data.Indices
			}
		}
		n := 0
		for slot := range d.Parts {
			idx, ok := own[slot]
			if !ok {
				var err error
				if idx, err = d.share(cfg, slot); err != nil {
					dc.violation(recs[i].T, "the job's step %d: slot %d of %s: %v", s, slot, d, err)
				}
			}
			for _, x := range idx {
				at := pos + int64(n)
				n++
				if e := at / cfg.Size; e != epoch {
					dc.skipped(recs[i].T, epoch, seen)
					epoch = e
					clear(seen)
				}
				switch {
				case x < 0 || x >= cfg.Size:
					dc.violation(recs[i].T, "the job's step %d read sample %d at position %d (slot %d), outside the dataset's %d", s, x, at, slot, cfg.Size)
				case seen[x] != 0:
					dc.violation(recs[i].T, "the job read sample %d of epoch %d twice: at positions %d and %d (step %d, slot %d)",
						x, epoch, seen[x]-1, at, s, slot)
				default:
					seen[x] = at + 1
				}
			}
		}
		if n != d.Samples {
			dc.violation(recs[i].T, "the job's step %d: its %d slots read %d samples, the step has %d", s, d.Parts, n, d.Samples)
		}
		pos += int64(d.Samples)
	}
	for _, f := range finals {
		if f.Pos != nil && *f.Pos != pos {
			dc.violation(f.T, "%s ended at position %d; the job's history at %d", f.who(), *f.Pos, pos)
		}
	}
	return DataCoverage{Checked: true, Steps: int64(len(chain) - 1), Samples: pos, Epochs: pos / cfg.Size, InProgress: pos % cfg.Size}
}

// skipped reports the samples a finished epoch did not read (each
// missing sample goes with one read twice, already said).
func (dc *dataChecker) skipped(t int64, epoch int64, seen []int64) {
	var missing []int64
	for x, at := range seen {
		if at == 0 {
			missing = append(missing, int64(x))
		}
	}
	if len(missing) > 0 {
		dc.violation(t, "the job's epoch %d ended with %d samples never read: %s", epoch, len(missing), indices(missing))
	}
}

// end is the time of the run's last event.
func (dc *dataChecker) end() int64 {
	if n := len(dc.in.Events); n > 0 {
		return dc.in.Events[n-1].T
	}
	return 0
}

// indices prints a few samples.
func indices(x []int64) string {
	if len(x) > 12 {
		return fmt.Sprintf("%v… (%d)", x[:12], len(x))
	}
	return fmt.Sprint(x)
}
