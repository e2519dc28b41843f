package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The test binary doubles as the demo's replica processes (the demo
// re-executes os.Executable), so TestMain dispatches the replica role.
func TestMain(m *testing.M) {
	if spec := os.Getenv(replicaEnv); spec != "" {
		var s replicaSpec
		if err := json.Unmarshal([]byte(spec), &s); err != nil {
			os.Exit(2)
		}
		os.Exit(runReplica(s))
	}
	os.Exit(m.Run())
}

// The demo in a small configuration, as `go run ./examples/diloco` runs
// it: coordinator, replica processes and a spare, a SIGKILL and a restart,
// the run without failures beside it; it must end with a summary in which
// the spare was promoted in the dead replica's place and healed, the job
// was back at full size, the final states identical, and a plot.
func TestDemoSmall(t *testing.T) {
	if testing.Short() {
		t.Skip("starts replica processes")
	}
	dir := t.TempDir()
	var out bytes.Buffer
	// Long enough after the kill (at 10 % of the run) for the restarted
	// process (a -race binary on a loaded machine) to register, ask at its
	// first step, heal and rejoin before the end.
	args := []string{"-replicas", "3", "-steps", "1200", "-H", "40", "-F", "2", "-tau", "1", "-batch", "16",
		"-context", "8", "-embed", "8", "-hidden", "64", "-eval", "256", "-final-eval", "2048", "-fail", "1@10%:0s", "-report", dir, "-progress", "lines", "-timeout", "4m"}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	err := run(ctx, args, &out, &out)
	t.Log(out.String())
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	var s Summary
	if err := json.Unmarshal(b, &s); err != nil {
		t.Fatal(err)
	}
	if len(s.Jobs) != 2 {
		t.Fatalf("jobs: %+v", s.Jobs)
	}
	faulty, base := s.Jobs[0], s.Jobs[1]
	for _, j := range s.Jobs {
		if j.Committed != s.Syncs || !j.StatesAgree || j.FinalValLoss <= 0 || j.FinalValLoss > 4.6 {
			t.Errorf("%s: %+v", j.Name, j)
		}
		// The committed syncs read each sample they handed out once: a
		// full sync 3 × 20 micro-batches of 16, fewer while one is down.
		if d := j.Data; !d.ExactlyOnce() || d.Syncs != s.Syncs || d.Samples < (s.Syncs-10)*3*20*16 || d.Recorded < d.Samples-3*20*16 {
			t.Errorf("%s's data: %+v", j.Name, d)
		}
	}
	if len(faulty.Kills) != 1 || len(base.Kills) != 0 {
		t.Fatalf("kills: %+v / %+v", faulty.Kills, base.Kills)
	}
	k := faulty.Kills[0]
	if k.SurvivorsCommit <= 0 || k.Promoted != "s0" || !k.Healed || k.PromotedStep <= k.KilledStep || k.CapacityBack <= 0 {
		t.Fatalf("the spare did not take the killed replica's place: %+v", k)
	}
	if !k.Restarted || k.Rejoined != 0 {
		t.Fatalf("the killed replica's restart should wait as a spare: %+v", k)
	}
	if faulty.Spares != 1 || !strings.Contains(faulty.Timeline, fmt.Sprintf("%d: %d", s.Syncs, 3)) {
		t.Errorf("capacity timeline %q (spares %d): want the job at full size at its end", faulty.Timeline, faulty.Spares)
	}
	if k.CapacityBack < k.SurvivorsCommit {
		t.Errorf("capacity back %v, before the survivors' commit %v: a commit of the victim's epoch counted as full size again", k.CapacityBack, k.SurvivorsCommit)
	}
	t.Logf("capacity back %v (survivors' commit %v)", k.CapacityBack, k.SurvivorsCommit)
	for _, want := range []string{"Summary", "spare s0 promoted", "capacity back", "capacity timeline", "same number of syncs", "each once"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
	f, err := os.Open(filepath.Join(dir, "loss.png"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	if b := img.Bounds(); b.Dx() < 400 || b.Dy() < 200 {
		t.Fatalf("plot is %v", b)
	}
	if _, err := os.Stat(filepath.Join(dir, "summary.txt")); err != nil {
		t.Fatal(err)
	}
}

func TestParseFailures(t *testing.T) {
	fs, err := parseFailures("2@40%:3s, r1@70", 4)
	if err != nil || len(fs) != 2 || fs[0] != (Failure{2, 0.4, 3 * time.Second}) || fs[1] != (Failure{1, 0.7, -1}) {
		t.Fatalf("%v %v", fs, err)
	}
	for _, bad := range []string{"4@40%", "2", "2@0%", "2@100", "2@40%:x", "x@4"} {
		if _, err := parseFailures(bad, 4); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	if fs, err := parseFailures("none", 4); err != nil || fs != nil {
		t.Fatal(fs, err)
	}
}

func TestBadSettingsAreRefused(t *testing.T) {
	for _, args := range [][]string{{"-H", "10", "-F", "4"}, {"-tau", "25"}, {"-alpha", "2"}, {"-quant", "int3"}, {"-fail", "9@50%"}, {"-backend", "nccl"}} {
		err := run(context.Background(), append(args, "-report", t.TempDir()), &bytes.Buffer{}, &bytes.Buffer{})
		if err == nil {
			t.Errorf("%v accepted", args)
		}
	}
}
