package main

import (
	"math"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// End to end over the gloo backend: the launcher, two worker processes,
// embedded etcd, a tiny sweep with the raw baseline, and the -json output.
func TestEndToEndGlooJSON(t *testing.T) {
	l := startLauncher(t, 2, "-np", "2", "-b", "8", "-e", "64K", "-f", "8", "-w", "1", "-n", "3", "-json", "-timeout", "30s")
	if err := l.wait(t, 2*time.Minute); err != nil {
		t.Fatalf("ftbench failed: %v\nstdout:\n%s\nstderr:\n%s", err, l.outText(), l.errText())
	}
	meta, rows, sum := jsonLines(t, l.outText())
	if meta.Tool != "ftbench" || meta.Backend != "gloo" || meta.NP != 2 || meta.Cores != runtime.NumCPU() ||
		meta.GoVersion != runtime.Version() || meta.Commit == "" || meta.Host == "" {
		t.Errorf("meta = %+v", meta)
	}
	sizes := []int64{8, 64, 512, 4096, 32768}
	if len(rows) != 2*len(sizes) {
		t.Fatalf("%d rows, want %d (allreduce and raw baseline per size):\n%s", len(rows), 2*len(sizes), l.outText())
	}
	for i, r := range rows {
		wantOp := "allreduce"
		if i%2 == 1 {
			wantOp = rawOp
		}
		if r.Op != wantOp || r.Bytes != sizes[i/2] || r.NP != 2 || len(r.RankUsec) != 2 {
			t.Errorf("row %d = %+v, want %s of %d bytes over 2 ranks", i, r, wantOp, sizes[i/2])
		}
		if r.Wrong != 0 || r.Usec <= 0 || r.Usec != slices.Max(r.RankUsec) {
			t.Errorf("row %d: wrong %d, time %v (ranks %v)", i, r.Wrong, r.Usec, r.RankUsec)
		}
		// n = 2: busbw = algbw × 2(n-1)/n = algbw; algbw = bytes / time.
		if alg := float64(r.Bytes) / r.Usec / 1e3; math.Abs(r.AlgBW-alg) > 1e-9*alg || r.BusBW != r.AlgBW {
			t.Errorf("row %d: algbw %v busbw %v, want %v for both", i, r.AlgBW, r.BusBW, alg)
		}
	}
	if rows[0].Count != 2 || rows[0].DType != "float32" || rows[0].RedOp != "sum" || rows[0].Root != -1 {
		t.Errorf("first row %+v: want 2 float32 elements, sum, no root", rows[0])
	}
	if !sum.OK || sum.Rows != len(rows) || sum.Wrong != 0 || sum.AvgBusBW <= 0 {
		t.Errorf("summary %+v", sum)
	}
}

// Every collective, several dtypes and reductions, over three processes.
func TestEndToEndEveryCollectiveThreeRanks(t *testing.T) {
	l := startLauncher(t, 3, "-np", "3", "-op", "all", "-d", "float32,bfloat16,int32", "-o", "sum,max,avg",
		"-b", "64", "-e", "4K", "-f", "8", "-w", "1", "-n", "2", "-raw=false", "-json", "-timeout", "30s", "-r", "2")
	if err := l.wait(t, 3*time.Minute); err != nil {
		t.Fatalf("ftbench failed: %v\nstdout:\n%s\nstderr:\n%s", err, l.outText(), l.errText())
	}
	_, rows, sum := jsonLines(t, l.outText())
	seen := map[string]int{}
	for _, r := range rows {
		seen[r.Op]++
		if r.Wrong != 0 {
			t.Errorf("%s %s %s %d B: %d wrong", r.Op, r.DType, r.RedOp, r.Bytes, r.Wrong)
		}
		if (r.Op == "broadcast" || r.Op == "reduce") != (r.Root == 2) {
			t.Errorf("%s: root %d", r.Op, r.Root)
		}
	}
	for _, o := range opNames() {
		if seen[o] == 0 {
			t.Errorf("no %s rows", o)
		}
	}
	if !sum.OK {
		t.Errorf("summary %+v", sum)
	}
}

// -async issues each size's iterations back to back as async ops; every
// collective must still run to the end and check out.
func TestEndToEndAsync(t *testing.T) {
	l := startLauncher(t, 3, "-np", "3", "-op", "all", "-async", "-b", "64", "-e", "64K", "-f", "32", "-w", "2", "-n", "5",
		"-raw=false", "-json", "-timeout", "30s")
	if err := l.wait(t, 3*time.Minute); err != nil {
		t.Fatalf("ftbench -async failed: %v\nstdout:\n%s\nstderr:\n%s", err, l.outText(), l.errText())
	}
	meta, rows, sum := jsonLines(t, l.outText())
	if !sum.OK || len(rows) != len(opNames())*3 { // 64 B, 2 KiB, 64 KiB
		t.Fatalf("summary %+v, %d rows", sum, len(rows))
	}
	if !meta.Config.Async {
		t.Errorf("metadata does not record -async: %+v", meta.Config)
	}
}

// longRun is a sweep that runs for seconds after its first row.
var longRun = []string{"-b", "4K", "-e", "64M", "-f", "2", "-w", "0", "-n", "2000", "-raw=false", "-json", "-v"}

func firstRow(line string) bool { return strings.HasPrefix(line, `{"type":"row"`) }

func TestKilledRankFailsTheRunClearly(t *testing.T) {
	l := startLauncher(t, 2, append([]string{"-np", "2", "-timeout", "20s"}, longRun...)...)
	pids := l.workerPids(t, time.Minute)
	l.waitLine(t, time.Minute, firstRow)
	if err := syscall.Kill(pids[1], syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := l.wait(t, time.Minute)
	if code := exitCode(err); code != 1 {
		t.Errorf("exit code %d (%v), want 1", code, err)
	}
	stderr := l.errText()
	if !strings.Contains(stderr, "failed") || !strings.Contains(stderr, "rank 1") {
		t.Errorf("stderr does not name rank 1's failure:\n%s", stderr)
	}
	for _, p := range pids {
		waitGone(t, p, 10*time.Second)
	}
	_, _, sum := jsonLines(t, l.outText())
	if sum.OK || sum.Error == "" {
		t.Errorf("summary %+v: want a failure", sum)
	}
}

// A SIGSTOPped rank ends the run: gloo sees from /proc that its silent peer
// on this host is stopped and fails the op naming it (within PeerTimeout),
// or, if the check is late on a loaded machine, the 3 s deadline does.
func TestStoppedRankFailsTheRun(t *testing.T) {
	l := startLauncher(t, 2, append([]string{"-np", "2", "-timeout", "3s"}, longRun...)...)
	pids := l.workerPids(t, time.Minute)
	l.waitLine(t, time.Minute, firstRow)
	if err := syscall.Kill(pids[1], syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	err := l.wait(t, time.Minute)
	if code := exitCode(err); code != 1 {
		t.Errorf("exit code %d (%v), want 1", code, err)
	}
	stderr := l.errText()
	stopped := strings.Contains(stderr, "rank 1") && strings.Contains(stderr, "process is stopped")
	if !strings.Contains(stderr, "rank 0 failed") || !stopped && !strings.Contains(stderr, "timeout") {
		t.Errorf("stderr does not report that rank 0 failed on rank 1 being stopped or on its deadline:\n%s", stderr)
	}
	for _, p := range pids {
		waitGone(t, p, 10*time.Second) // the stopped worker was killed too
	}
}

func TestSIGTERMStopsEveryWorker(t *testing.T) {
	l := startLauncher(t, 2, append([]string{"-np", "2", "-timeout", "20s"}, longRun...)...)
	pids := l.workerPids(t, time.Minute)
	l.waitLine(t, time.Minute, firstRow)
	if err := l.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err := l.wait(t, time.Minute)
	if code := exitCode(err); code != 1 {
		t.Errorf("exit code %d (%v), want 1", code, err)
	}
	if stderr := l.errText(); !strings.Contains(stderr, "interrupted") {
		t.Errorf("stderr does not say the run was interrupted:\n%s", stderr)
	}
	for _, p := range pids {
		waitGone(t, p, 10*time.Second)
	}
}

func TestWorkersDieWithTheirLauncher(t *testing.T) {
	l := startLauncher(t, 2, append([]string{"-np", "2", "-timeout", "20s"}, longRun...)...)
	pids := l.workerPids(t, time.Minute)
	l.waitLine(t, time.Minute, firstRow)
	if err := l.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	l.wait(t, time.Minute)
	for _, p := range pids {
		waitGone(t, p, 20*time.Second)
	}
}
