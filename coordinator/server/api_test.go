package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

func stringsReader(s string) io.Reader {
	if s == "" {
		return nil
	}
	return strings.NewReader(s)
}

func decode[T any](t *testing.T, resp *http.Response, wantStatus int) T {
	t.Helper()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != wantStatus {
		t.Fatalf("%s %s: status %d, want %d: %s", resp.Request.Method, resp.Request.URL.Path, resp.StatusCode, wantStatus, body)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Fatalf("content type %q", ct)
	}
	var v T
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatalf("decoding %s: %v", body, err)
	}
	return v
}

func TestAPI(t *testing.T) {
	lc := startLiveCoordinator(t, "", false)
	a, b := lc.join(t, "llama", "a"), lc.join(t, "llama", "b")
	ctx := testutil.Ctx(t, 20*time.Second)
	q, err := a.NextQuorum(ctx, 0)
	for err == nil && len(q.Participants) < 2 {
		q, err = a.NextQuorum(ctx, q.Epoch)
	}
	if err != nil {
		t.Fatal(err)
	}
	a.SetStep(17)
	if err := a.Heartbeat(ctx); err != nil {
		t.Fatal(err)
	}

	jobs := decode[[]coordinator.JobSummary](t, lc.request(t, "GET", "/api/v1/jobs", "", false), 200)
	if len(jobs) != 1 || jobs[0].Job != "llama" || jobs[0].Members != 2 || jobs[0].Epoch != q.Epoch {
		t.Fatalf("jobs %+v", jobs)
	}
	d := decode[JobDetail](t, lc.request(t, "GET", "/api/v1/jobs/llama", "", false), 200)
	if d.Leader != "coord-a" || d.Quorum == nil || d.Quorum.Epoch != q.Epoch || len(d.Members) != 2 || d.Step != 17 {
		t.Fatalf("job %+v", d)
	}
	var sawA bool
	for _, m := range d.Members {
		if m.ID == "a" {
			sawA = m.Step == 17 && m.Rank == q.Rank("a") && m.Group == "g-a"
		}
	}
	if !sawA {
		t.Fatalf("member a not shown right: %+v", d.Members)
	}
	ms := decode[[]coordinator.MemberView](t, lc.request(t, "GET", "/api/v1/jobs/llama/members", "", false), 200)
	if len(ms) != 2 {
		t.Fatalf("members %+v", ms)
	}
	// Lease ids pass 2^53; JSON carries them as strings.
	resp := lc.request(t, "GET", "/api/v1/jobs/llama/members", "", false)
	var raw []map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&raw); err != nil {
		t.Fatal(err)
	}
	if l, ok := raw[0]["lease"].(string); !ok || l != strconv.FormatInt(a.Record().Lease, 10) && l != strconv.FormatInt(b.Record().Lease, 10) {
		t.Fatalf("lease %#v (%T)", raw[0]["lease"], raw[0]["lease"])
	}
	gq := decode[membership.Quorum](t, lc.request(t, "GET", "/api/v1/jobs/llama/quorum", "", false), 200)
	if gq.Epoch != q.Epoch {
		t.Fatalf("quorum %+v", gq)
	}
	info := decode[CoordinatorInfo](t, lc.request(t, "GET", "/api/v1/coordinator", "", false), 200)
	if !info.IsLeader || info.Leader != "coord-a" {
		t.Fatalf("coordinator %+v", info)
	}

	// Evict b through the API: b learns it, the quorum goes on without it.
	evicted := time.Now()
	ev := decode[EvictAnswer](t, lc.request(t, "POST", "/api/v1/jobs/llama/members/b/evict", `{"by":"test","reason":"flaky nic"}`, false), 200)
	if ev.Evicted != "b" || ev.KeptOutUntil == nil || ev.KeptOutUntil.Before(evicted.Add(coordinator.DefaultEvictKeepOut)) {
		t.Fatalf("evict answer %+v", ev)
	}
	select {
	case <-b.Done():
	case <-ctx.Done():
		t.Fatal("b not evicted")
	}
	q2, err := a.NextQuorum(ctx, q.Epoch)
	if err != nil || len(q2.Participants) != 1 || q2.Reason != "b evicted by test (flaky nic)" {
		t.Fatalf("after evict %+v, %v", q2, err)
	}
	// An evicted member used to register again within
	// 50 ms. It is kept out, and told until when.
	var kept *membership.KeptOutError
	mc := membership.DefaultMemberConfig()
	mc.Client, mc.Job, mc.ID, mc.Addr = lc.cli, "llama", "b", "b:1"
	if _, err := membership.Join(ctx, mc); !errors.As(err, &kept) || !kept.Until.Equal(*ev.KeptOutUntil) || kept.By != "test (flaky nic)" {
		t.Fatalf("rejoin after eviction: %v", err)
	}
	h := decode[[]membership.Quorum](t, lc.request(t, "GET", "/api/v1/jobs/llama/history?limit=1", "", false), 200)
	if len(h) != 1 || h[0].Epoch != q2.Epoch {
		t.Fatalf("history %+v", h)
	}

	// Metrics and health.
	resp = lc.request(t, "GET", "/metrics", "", false)
	body, _ := io.ReadAll(resp.Body)
	// Not "job", which Prometheus renames exported_job.
	if resp.StatusCode != 200 || !bytes.Contains(body, []byte(`ftcomm_coordinator_epoch{ftcomm_job="llama"}`)) ||
		!bytes.Contains(body, []byte(`ftcomm_coordinator_removals_total{cause="evicted",ftcomm_job="llama"} 1`)) ||
		bytes.Contains(body, []byte(`{job=`)) {
		t.Fatalf("metrics %d:\n%s", resp.StatusCode, body)
	}
	hz := decode[map[string]any](t, lc.request(t, "GET", "/healthz", "", false), 200)
	if hz["ok"] != true {
		t.Fatalf("healthz %v", hz)
	}
	resp = lc.request(t, "GET", "/", "", false)
	page, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || !bytes.Contains(page, []byte("<title>ftcoord</title>")) {
		t.Fatalf("dashboard %d", resp.StatusCode)
	}
}

func TestAPIBadInput(t *testing.T) {
	lc := startLiveCoordinator(t, "", false)
	lc.join(t, "llama", "a")
	for _, c := range []struct {
		method, path, body string
		status             int
		want               string
	}{
		{"GET", "/api/v1/jobs/no-such-job", "", 404, "not found"},
		{"GET", "/api/v1/jobs/bad%20name", "", 400, "invalid argument"},
		{"GET", "/api/v1/jobs/llama/history?limit=abc", "", 400, "limit"},
		{"GET", "/api/v1/jobs/llama/history?limit=0", "", 400, "limit"},
		{"GET", "/api/v1/jobs/no-quorum-yet/quorum", "", 404, "no quorum"},
		{"POST", "/api/v1/jobs/llama/members/zz/evict", "", 404, "not found"},
		{"POST", "/api/v1/jobs/llama/members/a/evict", "{not json", 400, "body"},
		{"POST", "/api/v1/jobs/llama/members/a/evict", `{"by":"x","extra":1}`, 400, "unknown field"},
		{"POST", "/api/v1/jobs/llama/members/..%2F..%2Fx/evict", "", 400, "invalid argument"},
		{"DELETE", "/api/v1/jobs", "", 405, "not allowed"},
		{"GET", "/api/v1/jobs/llama/members/a/evict", "", 405, "not allowed"},
		{"POST", "/api/v1/jobs/llama/members/a/evict", strings.Repeat("x", 10<<20), 413, "larger than"},
		{"POST", "/api/v1/jobs/llama/members/a/evict", `{"keepOut":"soon"}`, 400, "keepOut"},
		{"DELETE", "/api/v1/nothing", "", 404, "no API endpoint"},
		{"GET", "/api/v2/nothing", "", 404, "no API endpoint"},
	} {
		resp := lc.request(t, c.method, c.path, c.body, false)
		e := decode[APIError](t, resp, c.status)
		if !strings.Contains(e.Error, c.want) {
			t.Errorf("%s %s: error %q, want it to mention %q", c.method, c.path, e.Error, c.want)
		}
		if c.status == 405 && resp.Header.Get("Allow") == "" {
			t.Errorf("%s %s: 405 without Allow", c.method, c.path)
		}
	}
	// Nothing was evicted by the bad requests.
	ms := decode[[]coordinator.MemberView](t, lc.request(t, "GET", "/api/v1/jobs/llama/members", "", false), 200)
	if len(ms) != 1 {
		t.Fatalf("members %+v", ms)
	}
}

func TestAPIToken(t *testing.T) {
	lc := startLiveCoordinator(t, "s3cret", false)
	lc.join(t, "llama", "a")
	for _, p := range []string{"/api/v1/jobs", "/api/v1/jobs/llama", "/metrics", "/api/v1/nothing"} {
		resp := lc.request(t, "GET", p, "", false)
		e := decode[APIError](t, resp, http.StatusUnauthorized)
		if !strings.Contains(e.Error, "token") || resp.Header.Get("WWW-Authenticate") == "" {
			t.Errorf("%s without token: %+v", p, e)
		}
	}
	req, _ := http.NewRequest("GET", lc.srv.URL+"/api/v1/jobs", nil)
	req.Header.Set("Authorization", "Bearer wrong")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Fatalf("wrong token: %d", resp.StatusCode)
	}
	resp = lc.request(t, "POST", "/api/v1/jobs/llama/members/a/evict", "", false)
	decode[APIError](t, resp, 401)
	decode[[]coordinator.JobSummary](t, lc.request(t, "GET", "/api/v1/jobs", "", true), 200)
	// The page and the health check stay open (the page asks for the token).
	for _, p := range []string{"/", "/healthz"} {
		if resp := lc.request(t, "GET", p, "", false); resp.StatusCode != 200 {
			t.Errorf("%s: %d", p, resp.StatusCode)
		}
	}
}

// POST /api/v1/jobs/{job}/runs starts a new run of a job: refused (409,
// naming them) while the job has live members, then 200 with the run; an
// id used before is refused; the job's view shows the run and its
// members' waits.
func TestAPINewRun(t *testing.T) {
	lc := startLiveCoordinator(t, "", false)
	a := lc.join(t, "llama", "a")
	ctx := testutil.Ctx(t, 20*time.Second)
	first := a.Run()
	e := decode[APIError](t, lc.request(t, "POST", "/api/v1/jobs/llama/runs", `{"run":"r2"}`, false), http.StatusConflict)
	if !strings.Contains(e.Error, "live members (a)") {
		t.Fatalf("a new run beside a live member: %q", e.Error)
	}
	if err := a.SetWaiting(ctx, 12, "step 12 was committed by epoch 3; no participant holds it"); err != nil {
		t.Fatal(err)
	}
	d := decode[JobDetail](t, lc.request(t, "GET", "/api/v1/jobs/llama", "", false), 200)
	if d.Run == nil || d.Run.ID != first || len(d.WaitingMembers) != 1 || d.Members[0].WaitingFor != 12 {
		t.Fatalf("job %+v", d.JobView)
	}
	if err := a.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	run := decode[membership.RunRecord](t, lc.request(t, "POST", "/api/v1/jobs/llama/runs", `{"run":"r2","by":"ops"}`, false), 200)
	if run.ID != "r2" || run.By != "ops" || len(run.Ended) != 1 || run.Ended[0] != first {
		t.Fatalf("run %+v", run)
	}
	fresh := decode[membership.RunRecord](t, lc.request(t, "POST", "/api/v1/jobs/llama/runs", "", false), 200)
	if fresh.ID == "" || fresh.By != "api" || fresh.Ended[0] != "r2" {
		t.Fatalf("a run with a fresh id: %+v", fresh)
	}
	if e := decode[APIError](t, lc.request(t, "POST", "/api/v1/jobs/llama/runs", `{"run":"r2"}`, false), http.StatusConflict); !strings.Contains(e.Error, "ended") {
		t.Fatalf("a used run id: %q", e.Error)
	}
	decode[APIError](t, lc.request(t, "POST", "/api/v1/jobs/llama/runs", `{"run":"no good"}`, false), http.StatusBadRequest)
	if d := decode[JobDetail](t, lc.request(t, "GET", "/api/v1/jobs/llama", "", false), 200); d.Run == nil || d.Run.ID != fresh.ID {
		t.Fatalf("job after the new runs: %+v", d.JobView)
	}
}

// Settings: a change is stored whole or not at all (a value that does not
// parse as its key's type is refused, saying why), versioned, and in
// force from the quorum that carries it, whose members hold the document.
func TestAPISettings(t *testing.T) {
	lc := startLiveCoordinator(t, "", false)
	a, _ := lc.join(t, "llama", "a"), lc.join(t, "llama", "b")
	ctx := testutil.Ctx(t, 20*time.Second)
	q, err := a.NextQuorum(ctx, 0)
	for err == nil && len(q.Participants) < 2 {
		q, err = a.NextQuorum(ctx, q.Epoch)
	}
	if err != nil {
		t.Fatal(err)
	}
	up := decode[coordinator.SettingsUpdate](t, lc.request(t, "POST", "/api/v1/jobs/llama/settings",
		`{"changes": ["lr=0.1", "sync_every=50", "warmup=2s"], "by": "test"}`, false), 200)
	if up.Settings.Version != 1 || up.Epoch <= q.Epoch || up.Settings.Values["sync_every"].Type != membership.SettingInt {
		t.Fatalf("update %+v", up)
	}
	for q.Epoch < up.Epoch && err == nil {
		q, err = a.NextQuorum(ctx, q.Epoch)
	}
	if err != nil || q.Settings == nil || q.Settings.Version != 1 {
		t.Fatalf("quorum %+v: %v", q, err)
	}
	doc, ok := a.Settings(*q.Settings)
	if lr, _ := doc.Float("lr"); !ok || lr != 0.1 {
		t.Fatalf("member's settings %+v (%v)", doc, ok)
	}
	for _, bad := range []struct{ body, says string }{
		{`{"changes": ["lr=abc"]}`, "lr is a setting of type float"},
		{`{"changes": ["lr=0.2", "sync_every=2.5"]}`, "sync_every is a setting of type int"},
		{`{"changes": ["-nosuch"]}`, "no such setting"},
		{`{"changes": ["9lives=1"]}`, "not a setting key"},
	} {
		e := decode[APIError](t, lc.request(t, "POST", "/api/v1/jobs/llama/settings", bad.body, false), 400)
		if !strings.Contains(e.Error, bad.says) {
			t.Errorf("%s: %q, want it to say %q", bad.body, e.Error, bad.says)
		}
	}
	got := decode[membership.JobSettings](t, lc.request(t, "GET", "/api/v1/jobs/llama/settings", "", false), 200)
	if got.Version != 1 || got.Values["lr"].Value != "0.1" {
		t.Fatalf("after refused changes: %+v (nothing may be half-applied)", got)
	}
	d := decode[JobDetail](t, lc.request(t, "GET", "/api/v1/jobs/llama", "", false), 200)
	if d.Settings == nil || d.Settings.Version != 1 {
		t.Fatalf("job detail settings %+v", d.Settings)
	}
}
