package server

import (
	"context"
	"crypto/subtle"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership"
)

//go:embed dashboard/index.html
var dashboardHTML []byte

// api serves the JSON API, the dashboard, /metrics and /healthz of one
// coordinator instance. Any instance answers from etcd; the leader adds
// its live view (why a quorum waits).
type api struct {
	admin    *coordinator.Admin
	coord    *coordinator.Coordinator
	cli      *clientv3.Client
	token    string
	gatherer prometheus.Gatherer
	lg       *zap.Logger
	keepOut  time.Duration // of an eviction, unless the request says
	url      string        // this instance's API, as others reach it (set before serving)
	version  string
	// healthKey is read by /healthz: a key under the root, where the
	// coordinator's etcd role may read when etcd's authentication is on.
	healthKey string
}

// APIError is the body of every error answer.
type APIError struct {
	Error string `json:"error"`
}

func (a *api) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", a.dashboard)
	mux.HandleFunc("GET /healthz", a.healthz)
	mux.Handle("GET /metrics", a.auth(promhttp.HandlerFor(a.gatherer, promhttp.HandlerOpts{})))
	mux.Handle("GET /api/v1/coordinator", a.auth(http.HandlerFunc(a.coordinator)))
	mux.Handle("GET /api/v1/jobs", a.auth(http.HandlerFunc(a.jobs)))
	mux.Handle("GET /api/v1/jobs/{job}", a.auth(http.HandlerFunc(a.job)))
	mux.Handle("GET /api/v1/jobs/{job}/members", a.auth(http.HandlerFunc(a.members)))
	mux.Handle("GET /api/v1/jobs/{job}/quorum", a.auth(http.HandlerFunc(a.quorum)))
	mux.Handle("GET /api/v1/jobs/{job}/history", a.auth(http.HandlerFunc(a.history)))
	mux.Handle("POST /api/v1/jobs/{job}/members/{id}/evict", a.auth(http.HandlerFunc(a.evict)))
	mux.Handle("POST /api/v1/jobs/{job}/runs", a.auth(http.HandlerFunc(a.newRun)))
	mux.Handle("GET /api/v1/jobs/{job}/settings", a.auth(http.HandlerFunc(a.settings)))
	mux.Handle("POST /api/v1/jobs/{job}/settings", a.auth(http.HandlerFunc(a.setSettings)))
	mux.Handle("/api/", a.auth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if allow := allowed(mux, r); len(allow) > 0 {
			w.Header().Set("Allow", strings.Join(allow, ", "))
			writeError(w, http.StatusMethodNotAllowed, fmt.Errorf("%s %s: method not allowed (allowed: %s)", r.Method, r.URL.Path, strings.Join(allow, ", ")))
			return
		}
		writeError(w, http.StatusNotFound, fmt.Errorf("no API endpoint %s %s", r.Method, r.URL.Path))
	})))
	return mux
}

// allowed returns the methods an API path answers to, other than r's.
func allowed(mux *http.ServeMux, r *http.Request) []string {
	var out []string
	for _, m := range []string{http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete} {
		if m == r.Method {
			continue
		}
		r2 := r.Clone(r.Context())
		r2.Method = m
		if _, pattern := mux.Handler(r2); pattern != "" && pattern != "/api/" {
			out = append(out, m)
		}
	}
	return out
}

// maxBody bounds request bodies; a larger one is refused with 413.
const maxBody = 64 << 10

// auth demands the bearer token when one is configured.
func (a *api) auth(h http.Handler) http.Handler {
	if a.token == "" {
		return h
	}
	want := []byte("Bearer " + a.token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := []byte(r.Header.Get("Authorization"))
		if subtle.ConstantTimeCompare(got, want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="ftcoord"`)
			writeError(w, http.StatusUnauthorized, errors.New("missing or wrong bearer token"))
			return
		}
		h.ServeHTTP(w, r)
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

func writeError(w http.ResponseWriter, status int, err error) {
	writeJSON(w, status, APIError{Error: err.Error()})
}

// fail maps membership errors to HTTP statuses.
func (a *api) fail(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, comm.ErrInvalidArgument):
		writeError(w, http.StatusBadRequest, err)
	case errors.Is(err, coordinator.ErrNotFound), errors.Is(err, coordinator.ErrNoQuorum):
		writeError(w, http.StatusNotFound, err)
	case errors.Is(err, membership.ErrRunBusy), errors.Is(err, membership.ErrRunEnded):
		writeError(w, http.StatusConflict, err)
	case errors.Is(err, context.DeadlineExceeded):
		writeError(w, http.StatusGatewayTimeout, err)
	default:
		a.lg.Warn("api", zap.Error(err))
		writeError(w, http.StatusServiceUnavailable, err)
	}
}

func reqCtx(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), 5*time.Second)
}

func (a *api) dashboard(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Write(dashboardHTML)
}

func (a *api) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	if _, err := a.cli.Get(ctx, a.healthKey, clientv3.WithCountOnly()); err != nil {
		writeError(w, http.StatusServiceUnavailable, fmt.Errorf("etcd: %v", err))
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"ok": true, "leader": a.coord.IsLeader()})
}

// CoordinatorInfo is GET /api/v1/coordinator.
type CoordinatorInfo struct {
	Name string `json:"name"`
	// URL is this instance's API as others reach it (Config.Advertise).
	URL string `json:"url,omitempty"`
	// Version is the running ftcoord's (Config.Version).
	Version    string   `json:"version,omitempty"`
	Leader     string   `json:"leader"`
	IsLeader   bool     `json:"isLeader"`
	GossipAddr string   `json:"gossipAddr,omitempty"`
	Etcd       []string `json:"etcd"`
}

func (a *api) coordinator(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := reqCtx(r)
	defer cancel()
	leader, err := a.admin.Leader(ctx)
	if err != nil && !errors.Is(err, coordinator.ErrNotFound) {
		a.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, CoordinatorInfo{Name: a.coord.Name(), URL: a.url, Version: a.version, Leader: leader, IsLeader: a.coord.IsLeader(),
		GossipAddr: a.coord.GossipAddr(), Etcd: a.cli.Endpoints()})
}

func (a *api) jobs(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := reqCtx(r)
	defer cancel()
	jobs, err := a.admin.Jobs(ctx)
	if err != nil {
		a.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, jobs)
}

// JobDetail is GET /api/v1/jobs/{job}.
type JobDetail struct {
	coordinator.JobView
	// Waiting is why no quorum forms (leader only; "" elsewhere or when
	// none is needed).
	Waiting string `json:"waiting,omitempty"`
	Leader  string `json:"leader,omitempty"`
	// Target, Spares, ReadySpares and UnusableSpares are the leader's
	// (coordinator.JobStatus): the job's target size in replica groups,
	// the members waiting as spares, those of them ready, and the spare
	// groups that can never be promoted, with why. Leader only.
	Target         int                    `json:"target,omitempty"`
	Spares         []string               `json:"spares,omitempty"`
	ReadySpares    []string               `json:"readySpares,omitempty"`
	UnusableSpares []quorum.UnusableSpare `json:"unusableSpares,omitempty"`
}

func (a *api) job(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := reqCtx(r)
	defer cancel()
	v, err := a.admin.Job(ctx, r.PathValue("job"))
	if err != nil {
		a.fail(w, err)
		return
	}
	d := JobDetail{JobView: v}
	if st, ok := a.coord.Status(v.Job); ok {
		d.Waiting = st.Waiting
		d.Target, d.Spares, d.ReadySpares, d.UnusableSpares = st.Target, st.Spares, st.ReadySpares, st.UnusableSpares
	}
	d.Leader, _ = a.admin.Leader(ctx)
	writeJSON(w, http.StatusOK, d)
}

func (a *api) members(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := reqCtx(r)
	defer cancel()
	v, err := a.admin.Job(ctx, r.PathValue("job"))
	if err != nil {
		a.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, v.Members)
}

func (a *api) quorum(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := reqCtx(r)
	defer cancel()
	q, err := a.admin.Quorum(ctx, r.PathValue("job"))
	if err != nil {
		a.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, q)
}

func (a *api) history(w http.ResponseWriter, r *http.Request) {
	limit := 50
	if s := r.URL.Query().Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > 10000 {
			writeError(w, http.StatusBadRequest, fmt.Errorf("limit %q: want an integer from 1 to 10000", s))
			return
		}
		limit = n
	}
	ctx, cancel := reqCtx(r)
	defer cancel()
	h, err := a.admin.History(ctx, r.PathValue("job"), limit)
	if err != nil {
		a.fail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, h)
}

type newRunRequest struct {
	// Run is the new run's id (default: a fresh one).
	Run string `json:"run"`
	By  string `json:"by"`
}

// readBody decodes an optional JSON body into v, answering 400 or 413
// itself (ok false) when it cannot.
func readBody(w http.ResponseWriter, r *http.Request, v any, want string) bool {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Errorf("body larger than %d bytes", tooBig.Limit))
			return false
		}
		writeError(w, http.StatusBadRequest, fmt.Errorf("reading body: %v", err))
		return false
	}
	if len(strings.TrimSpace(string(body))) > 0 {
		dec := json.NewDecoder(strings.NewReader(string(body)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(v); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("body: want %s: %v", want, err))
			return false
		}
	}
	return true
}

// newRun starts a new run of a job (coordinator.Admin.NewRun): 200 with
// the run record, 409 while the job has live members or for a used id.
func (a *api) newRun(w http.ResponseWriter, r *http.Request) {
	var req newRunRequest
	if !readBody(w, r, &req, `{"run": …, "by": …}`) {
		return
	}
	by := "api"
	if req.By != "" {
		by = req.By
	}
	job := r.PathValue("job")
	ctx, cancel := reqCtx(r)
	defer cancel()
	run, err := a.admin.NewRun(ctx, job, req.Run, by)
	if err != nil {
		a.fail(w, err)
		return
	}
	a.lg.Info("new run", zap.String("job", job), zap.String("run", run.ID), zap.String("by", by), zap.Strings("ended", run.Ended[:min(len(run.Ended), 1)]))
	writeJSON(w, http.StatusOK, run)
}

// settings answers a job's settings document (version 0 when none was
// set).
func (a *api) settings(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := reqCtx(r)
	defer cancel()
	doc, err := a.admin.Settings(ctx, r.PathValue("job"))
	if err != nil {
		a.fail(w, err)
		return
	}
	doc.Signature = nil
	writeJSON(w, http.StatusOK, doc)
}

// SettingsRequest changes a job's settings: each change is "key=value",
// "key:type=value" (type: string, int, float, bool or duration) or "-key"
// (unset), all applied or none.
type SettingsRequest struct {
	Changes []string `json:"changes"`
	By      string   `json:"by,omitempty"`
}

// setSettings changes a job's settings (coordinator.SetSettings): 200
// with the new version and the epoch it is in force from, 400 with what
// is wrong when any change is malformed (nothing is stored).
func (a *api) setSettings(w http.ResponseWriter, r *http.Request) {
	var req SettingsRequest
	if !readBody(w, r, &req, `{"changes": ["lr=0.1", "sync_every:int=50", "-old"], "by": …}`) {
		return
	}
	changes, err := membership.ParseSettingChanges(req.Changes)
	if err != nil {
		a.fail(w, err)
		return
	}
	by := "api"
	if req.By != "" {
		by = req.By
	}
	job := r.PathValue("job")
	ctx, cancel := reqCtx(r)
	defer cancel()
	up, err := a.coord.SetSettings(ctx, job, changes, by)
	if err != nil {
		a.fail(w, err)
		return
	}
	up.Settings.Signature = nil
	writeJSON(w, http.StatusOK, up)
}

type evictRequest struct {
	By     string `json:"by"`
	Reason string `json:"reason"`
	// KeepOut is how long the member may not register again, as a Go
	// duration ("90s", "10m"; "0s": not at all); default the
	// coordinator's (-evict-keep-out).
	KeepOut string `json:"keepOut"`
}

// EvictAnswer is the answer to an eviction.
type EvictAnswer struct {
	Evicted string `json:"evicted"`
	Job     string `json:"job"`
	// KeptOutUntil is when the member may register again (absent: at
	// once).
	KeptOutUntil *time.Time `json:"keptOutUntil,omitempty"`
}

func (a *api) evict(w http.ResponseWriter, r *http.Request) {
	var req evictRequest
	if !readBody(w, r, &req, `{"by": …, "reason": …, "keepOut": "10m"}`) {
		return
	}
	keepOut := a.keepOut
	var err error
	if req.KeepOut != "" {
		if keepOut, err = time.ParseDuration(req.KeepOut); err != nil || keepOut < 0 {
			writeError(w, http.StatusBadRequest, fmt.Errorf("keepOut %q: want a duration such as \"10m\" (\"0s\": none)", req.KeepOut))
			return
		}
	}
	by := "api"
	if req.By != "" {
		by = req.By
	}
	if req.Reason != "" {
		by += " (" + req.Reason + ")"
	}
	job, id := r.PathValue("job"), r.PathValue("id")
	ctx, cancel := reqCtx(r)
	defer cancel()
	until, err := a.coord.EvictFor(ctx, job, id, by, keepOut)
	if err != nil {
		a.fail(w, err)
		return
	}
	ans := EvictAnswer{Evicted: id, Job: job}
	if !until.IsZero() {
		ans.KeptOutUntil = &until
	}
	a.lg.Info("evicted", zap.String("job", job), zap.String("member", id), zap.String("by", by), zap.Time("kept out until", until))
	writeJSON(w, http.StatusOK, ans)
}
