package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

func (d *demo) summarize() (*Summary, error) {
	s := &Summary{Date: time.Now().Format("2006-01-02 15:04"), Syncs: d.cfg.Syncs(),
		Settings: fmt.Sprintf("replicas=%d spares=%d backend=%s steps=%d batch=%d lr=%g H=%d F=%d tau=%d alpha=%g outer-lr=%g outer-momentum=%g quant=%s fail=%v model=%d/%d/%d (%d params)",
			d.cfg.Replicas, d.cfg.Spares, d.cfg.Backend, d.cfg.Steps, d.cfg.Batch, d.cfg.LR, d.cfg.H, d.cfg.F, d.cfg.Tau, d.cfg.Alpha, d.cfg.OuterLR, d.cfg.OuterMom,
			d.cfg.Quant, d.cfg.Failures, d.cfg.Model.Context, d.cfg.Model.Embed, d.cfg.Model.Hidden, d.cfg.Model.NumParams())}
	for _, j := range d.jobs {
		js := JobSummary{Name: j.name, Faulty: j.faulty, Committed: j.step, Wall: j.finished.Sub(j.started),
			FinalValLoss: j.finalLoss, Kills: j.kills, FailedSyncs: len(j.failedSyncs), Epochs: len(j.epochs),
			PeakPayloadBytes: j.peakPayload, Method: j.method, StatesAgree: len(j.finalHashes) == 1,
			Spares: j.spares(), Timeline: timeline(j.capacity), Data: d.coverage(j)}
		if !js.Data.ExactlyOnce() {
			j.errors = append(j.errors, "the committed syncs' data: "+js.Data.String())
		}
		if j.syncEvents > 0 {
			js.WirePerSync = float64(j.wire) / float64(j.syncEvents)
		}
		if j.trainMs > 0 {
			js.BlockedPct = 100 * j.blockedMs / (j.trainMs + j.blockedMs)
		}
		s.Jobs = append(s.Jobs, js)
		if len(j.errors) > 0 {
			return s, fmt.Errorf("%s: %s", j.name, strings.Join(j.errors, "; "))
		}
	}
	if len(s.Jobs) == 2 && s.Jobs[1].FinalValLoss > 0 {
		s.LossDiffPct = 100 * (s.Jobs[0].FinalValLoss - s.Jobs[1].FinalValLoss) / s.Jobs[1].FinalValLoss
		s.WithinTarget = math.Abs(s.LossDiffPct) <= 2
	}
	plot := filepath.Join(d.cfg.Report, "loss.png")
	if err := d.plot(plot); err != nil {
		return s, fmt.Errorf("plot: %w", err)
	}
	s.Plot = plot
	var b strings.Builder
	s.write(&b, d.cfg)
	fmt.Fprint(d.out, b.String())
	if err := os.WriteFile(filepath.Join(d.cfg.Report, "summary.txt"), []byte(b.String()), 0o644); err != nil {
		return s, err
	}
	js, _ := json.MarshalIndent(s, "", "  ")
	return s, os.WriteFile(filepath.Join(d.cfg.Report, "summary.json"), js, 0o644)
}

// coverage checks what j's committed syncs read, from its replicas' plans
// logs.
func (d *demo) coverage(j *jobState) Coverage {
	logs := map[string][]planRecord{}
	for _, path := range j.plansLogs {
		recs, err := readPlansLog(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue // the process ended before it opened its log
		}
		if err != nil {
			return Coverage{Problems: []string{err.Error()}}
		}
		logs[path] = recs
	}
	return checkCoverage(d.samples, j.step, logs, j.killedLogs)
}

// timeline writes participants per committed sync as runs of equal
// counts: "1-64: 4, 65: 3, 66-161: 4".
func timeline(capacity map[int64]int) string {
	steps := slices.Sorted(maps.Keys(capacity))
	var parts []string
	for i := 0; i < len(steps); {
		k := i
		for k+1 < len(steps) && steps[k+1] == steps[k]+1 && capacity[steps[k+1]] == capacity[steps[i]] {
			k++
		}
		span := fmt.Sprint(steps[i])
		if k > i {
			span = fmt.Sprintf("%d-%d", steps[i], steps[k])
		}
		parts = append(parts, fmt.Sprintf("%s: %d", span, capacity[steps[i]]))
		i = k + 1
	}
	return strings.Join(parts, ", ")
}

func kb(b float64) string {
	switch {
	case b >= 1<<20:
		return fmt.Sprintf("%.2f MiB", b/(1<<20))
	case b >= 1<<10:
		return fmt.Sprintf("%.1f KiB", b/(1<<10))
	}
	return fmt.Sprintf("%.0f B", b)
}

func (s *Summary) write(w io.Writer, cfg Config) {
	fmt.Fprintf(w, "\nSummary (%s)\n", s.Date)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(name string, f func(j JobSummary) string) {
		fmt.Fprintf(tw, "  %s", name)
		for _, j := range s.Jobs {
			fmt.Fprintf(tw, "\t%s", f(j))
		}
		fmt.Fprintln(tw)
	}
	row("", func(j JobSummary) string { return j.Name })
	row("syncs committed", func(j JobSummary) string { return fmt.Sprintf("%d of %d", j.Committed, s.Syncs) })
	row("wall time", func(j JobSummary) string { return j.Wall.Round(100 * time.Millisecond).String() })
	row("final validation loss", func(j JobSummary) string { return fmt.Sprintf("%.4f nats/char", j.FinalValLoss) })
	row("samples the committed syncs read", func(j JobSummary) string { return j.Data.String() })
	row("replicas killed", func(j JobSummary) string { return fmt.Sprint(len(j.Kills)) })
	row("spares", func(j JobSummary) string { return fmt.Sprint(j.Spares) })
	row("syncs that failed somewhere", func(j JobSummary) string { return fmt.Sprint(j.FailedSyncs) })
	row("epochs", func(j JobSummary) string { return fmt.Sprint(j.Epochs) })
	row("peak payload per sync", func(j JobSummary) string { return kb(float64(j.PeakPayloadBytes)) })
	row("sent per sync per replica", func(j JobSummary) string { return kb(j.WirePerSync) + " (" + j.Method + ")" })
	row("training loop blocked on syncs", func(j JobSummary) string { return fmt.Sprintf("%.1f %% of its time", j.BlockedPct) })
	row("replicas' final state", func(j JobSummary) string {
		if j.StatesAgree {
			return "identical"
		}
		return "DIFFERENT"
	})
	tw.Flush()
	for _, j := range s.Jobs {
		for _, k := range j.Kills {
			fmt.Fprintf(w, "  failure: SIGKILL r%d at sync %d → the survivors committed without it %v later (their inner steps up to the next sync included)", k.Replica, k.KilledStep, k.SurvivorsCommit.Round(time.Millisecond))
			if k.CapacityBack > 0 {
				fmt.Fprintf(w, "; capacity back (a sync committed at full size) %v after the kill", k.CapacityBack.Round(time.Millisecond))
			}
			if k.Promoted != "" {
				how := ""
				if k.HealedBytes > 0 {
					how = fmt.Sprintf(", healed %s from its peers in %v", kb(float64(k.HealedBytes)), k.HealTook.Round(time.Millisecond))
				}
				fmt.Fprintf(w, "; spare %s promoted in its place%s, first commit at sync %d", k.Promoted, how, k.PromotedStep)
			}
			switch {
			case k.Promoted != "" && k.Rejoined == 0 && k.Restarted:
				fmt.Fprintf(w, "; restarted %v after the kill, r%d waited as the next spare\n", k.RestartAt.Sub(k.KilledAt).Round(100*time.Millisecond), k.Replica)
			case k.Promoted != "" && !k.Restarted:
				fmt.Fprintln(w)
			case k.Rejoined > 0:
				how := "joined"
				if k.Healed {
					how = "healed from its peers and rejoined"
					if k.HealedBytes > 0 {
						how = fmt.Sprintf("healed from its peers (%s in %v) and rejoined", kb(float64(k.HealedBytes)), k.HealTook.Round(time.Millisecond))
					}
				}
				fmt.Fprintf(w, "; restarted %v after the kill, it %s at sync %d, %v after its restart\n",
					k.RestartAt.Sub(k.KilledAt).Round(100*time.Millisecond), how, k.RejoinedStep, k.Rejoined.Round(time.Millisecond))
			case k.Down < 0:
				fmt.Fprintln(w, "; not restarted")
			case !k.Restarted:
				fmt.Fprintln(w, "; the run ended before its restart")
			default:
				fmt.Fprintln(w, "; restarted, but it did not commit before the end")
			}
		}
	}
	for _, j := range s.Jobs {
		fmt.Fprintf(w, "  capacity timeline of %s (committed sync: replicas): %s\n", j.Name, j.Timeline)
	}
	if len(s.Jobs) == 2 {
		verdict := "within 2 %"
		if !s.WithinTarget {
			verdict = "NOT within 2 %"
		}
		fmt.Fprintf(w, "  final validation loss with failures vs without: %+.2f %% (%s); both runs committed the same number of syncs (%d), on the same seeds and data\n",
			s.LossDiffPct, verdict, s.Syncs)
	}
	fmt.Fprintf(w, "  settings: %s\n", s.Settings)
	fmt.Fprintf(w, "  report: %s (loss curves), %s, logs/\n", s.Plot, filepath.Join(cfg.Report, "summary.txt"))
}
