package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/coordinator/server"
	"github.com/ftcomm/ftcomm/membership"
)

// fakeAPI answers the status command's requests with d as the job.
func fakeAPI(t *testing.T, d server.JobDetail) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /api/v1/coordinator", func(w http.ResponseWriter, r *http.Request) {
		json.NewEncoder(w).Encode(server.CoordinatorInfo{Name: "c", Leader: "c", IsLeader: true})
	})
	mux.HandleFunc("GET /api/v1/jobs/{job}", func(w http.ResponseWriter, r *http.Request) {
		json.NewEncoder(w).Encode(d)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

// statusOf runs `ftcoord status -job demo` against url and returns what
// it printed.
func statusOf(t *testing.T, url string) string {
	t.Helper()
	var out, errb bytes.Buffer
	if code := run([]string{"status", "-addr", url, "-job", "demo"}, func(string) string { return "" }, &out, &errb); code != 0 {
		t.Fatalf("status: %d %s", code, errb.String())
	}
	return out.String()
}

// The header of a job's status says nothing the members contradict: the
// quorum's MaxStep is the participants' reports when it formed (0 for a
// job's first epoch), so the step shown is the highest the members
// report now.
func TestStatusJobStepIsTheMembers(t *testing.T) {
	q := &membership.Quorum{Job: "demo", Epoch: 3, MaxStep: 0, Created: time.Now(), Reason: "initial quorum",
		Participants: []membership.Participant{{ID: "a.0"}, {ID: "b.0"}}}
	member := func(id string, rank int, step int64) coordinator.MemberView {
		return coordinator.MemberView{MemberRecord: membership.MemberRecord{ID: id, Step: step}, Rank: rank}
	}
	out := statusOf(t, fakeAPI(t, server.JobDetail{JobView: coordinator.JobView{Job: "demo", Quorum: q, Step: 98,
		Members: []coordinator.MemberView{member("a.0", 0, 98), member("b.0", 1, 97)}}}))
	if strings.Contains(out, "step 0") || !regexp.MustCompile(`(?m)^step\s+98 \(the highest a member reported`).MatchString(out) {
		t.Fatalf("status:\n%s", out)
	}
}

// A member that waits for a holder of a committed step shows as waiting,
// with why; the job's run is named.
func TestStatusJobShowsWaitsAndRun(t *testing.T) {
	q := &membership.Quorum{Job: "demo", Epoch: 4, Created: time.Now(), Participants: []membership.Participant{{ID: "a.0"}}}
	w := coordinator.MemberView{MemberRecord: membership.MemberRecord{ID: "a.0", Step: 5, WaitingFor: 7,
		Waiting: "step 7 was committed by epoch 2; no participant holds it (the participants hold 5)"}}
	run := &membership.RunRecord{ID: "r2", Started: time.Now(), By: "ops"}
	out := statusOf(t, fakeAPI(t, server.JobDetail{JobView: coordinator.JobView{Job: "demo", Quorum: q, Step: 5, Run: run,
		Members: []coordinator.MemberView{w}, WaitingMembers: []string{"a.0"}}}))
	for _, re := range []string{`(?m)^run\s+r2, started .* by ops$`, `(?m)^a\.0 waits\s+for a holder of step 7: step 7 was committed by epoch 2`, `(?m)^a\.0\s+0\s+waiting\s`} {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("status lacks %s:\n%s", re, out)
		}
	}
}

// A job's status shows its target and its spares, waiting and ready, and
// says why a spare group can never be promoted.
func TestStatusJobShowsSpares(t *testing.T) {
	q := &membership.Quorum{Job: "demo", Epoch: 2, Created: time.Now(), Participants: []membership.Participant{{ID: "a"}, {ID: "b"}}}
	member := func(id string, rank int, spare, ask bool) coordinator.MemberView {
		return coordinator.MemberView{MemberRecord: membership.MemberRecord{ID: id, Spare: spare, WantQuorum: ask}, Rank: rank}
	}
	out := statusOf(t, fakeAPI(t, server.JobDetail{JobView: coordinator.JobView{Job: "demo", Quorum: q,
		Members: []coordinator.MemberView{member("a", 0, false, true), member("b", 1, false, true), member("s", -1, true, true),
			member("t", -1, true, false), member("x.0", -1, true, true)}},
		Target: 3, Spares: []string{"s", "t", "x.0"}, ReadySpares: []string{"s", "x.0"},
		UnusableSpares: []quorum.UnusableSpare{{Group: "x", Members: []string{"x.0"}, Reason: "a replica group of 2 rank(s); the job's replica groups have 1"}}}))
	for _, re := range []string{`(?m)^target\s+3 replica group\(s\)`, `(?m)^spares\s+3 waiting, 2 ready: s t x\.0$`,
		`(?m)^spare group x\s+cannot be promoted \(x\.0\): a replica group of 2 rank\(s\); the job's replica groups have 1$`,
		`(?m)^s\s+-\s+spare \(ready\)\s`, `(?m)^t\s+-\s+spare\s`, `(?m)^a\s+0\s+participant\s`} {
		if !regexp.MustCompile(re).MatchString(out) {
			t.Errorf("status lacks %s:\n%s", re, out)
		}
	}
}
