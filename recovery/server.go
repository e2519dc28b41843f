package recovery

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

// Blob is a named region of a replica's state: what a source serves and a
// healer fills. Data is the caller's memory, never copied by the Server;
// state outside Go memory (a GPU's) is given as Mem instead, and moves
// through host staging buffers one chunk at a time.
type Blob struct {
	Name string
	Data []byte
	Mem  Memory // if set, the blob's bytes; Data is ignored
}

// Len is the blob's size in bytes.
func (b Blob) Len() int {
	if b.Mem != nil {
		return b.Mem.Len()
	}
	return len(b.Data)
}

// Memory is state that Go code cannot address directly, such as device
// memory, read and written through host buffers. Its methods are called
// concurrently (one call per chunk in flight).
type Memory interface {
	Len() int
	// Buffer returns a host buffer of at least n bytes suited to this
	// memory's copies (pinned, for a GPU) and the function that gives it
	// back; it may block until one is free, or until ctx ends.
	Buffer(ctx context.Context, n int) ([]byte, func(), error)
	// ReadAt copies len(p) bytes at offset off into p; WriteAt copies p to
	// offset off. Both return once the copy is complete.
	ReadAt(ctx context.Context, p []byte, off int) error
	WriteAt(ctx context.Context, p []byte, off int) error
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// The wire protocol: two authenticated GETs over HTTP.
const (
	manifestPath = "/v1/manifest"
	chunkPath    = "/v1/chunk"
	crcHeader    = "X-Ftcomm-Crc32c"
	stepHeader   = "X-Ftcomm-Step"
	authHeader   = "Authorization"
	authScheme   = "FTCOMM-HMAC-SHA256"
	clockSkew    = 2 * time.Minute
)

// manifest is what a source says it serves.
type manifest struct {
	Job   string         `json:"job"`
	Step  int64          `json:"step"`
	Blobs []manifestBlob `json:"blobs"`
	// Meta is the caller's description of the state (ft: its history).
	Meta []byte `json:"meta,omitempty"`
}

type manifestBlob struct {
	Name string `json:"name"`
	Size int    `json:"size"`
}

// sign returns the Authorization value for a request: an HMAC over job,
// method, the request URI and a timestamp, so a request cannot be forged
// without the job's secret and a captured one goes stale.
func sign(secret []byte, job, method, uri string, now time.Time) string {
	ts := strconv.FormatInt(now.Unix(), 10)
	return authScheme + " " + ts + ":" + hex.EncodeToString(mac(secret, job, method, uri, ts))
}

func mac(secret []byte, job, method, uri, ts string) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(job + "\n" + method + "\n" + uri + "\n" + ts))
	return m.Sum(nil)
}

// verify checks an Authorization value; it reports what is wrong, or nil.
func verify(secret []byte, job string, r *http.Request, now time.Time) error {
	v, ok := strings.CutPrefix(r.Header.Get(authHeader), authScheme+" ")
	if !ok {
		return errors.New("missing or malformed authorization")
	}
	ts, sig, ok := strings.Cut(v, ":")
	if !ok {
		return errors.New("malformed authorization")
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return errors.New("malformed authorization timestamp")
	}
	if d := now.Sub(time.Unix(sec, 0)); d > clockSkew || d < -clockSkew {
		return fmt.Errorf("authorization timestamp off by %s", d.Round(time.Second))
	}
	got, err := hex.DecodeString(sig)
	if err != nil || !hmac.Equal(got, mac(secret, job, r.Method, r.URL.RequestURI(), ts)) {
		return errors.New("bad signature (wrong job secret?)")
	}
	return nil
}

// ServerConfig configures a Server.
type ServerConfig struct {
	Job        string
	Secret     []byte // the job's secret; requests must be signed with it
	ListenAddr string // default "127.0.0.1:0"
	Logger     *zap.Logger
}

// Validate reports what is wrong with c, or nil.
func (c *ServerConfig) Validate() error {
	switch {
	case c.Job == "":
		return fmt.Errorf("%w: recovery: server config: empty job", comm.ErrInvalidArgument)
	case len(c.Secret) == 0:
		return fmt.Errorf("%w: recovery: server config: empty secret (the endpoint must be authenticated)", comm.ErrInvalidArgument)
	}
	return nil
}

// Server serves a replica's last committed state to healing peers.
//
// Offer(step, blobs) starts serving the caller's memory as the committed
// state of step; Withdraw stops, waiting for reads in flight, before the
// caller changes that memory (the optimizer step after a commit). Between
// the two the caller must not modify the blobs: that is what makes the
// served state exactly the committed one, with no copy.
type Server struct {
	cfg ServerConfig
	log *zap.Logger
	ln  net.Listener
	srv *http.Server

	mu       sync.Mutex
	idle     *sync.Cond // signalled when inflight drops to 0
	offered  bool
	step     int64
	blobs    map[string]Blob
	meta     []byte
	order    []manifestBlob
	inflight int
	closed   bool  // no new read starts
	served   int64 // bytes, for metrics and tests
	watchers []servedWatcher
	done     chan struct{}
}

type servedWatcher struct {
	n  int64
	ch chan struct{}
}

// NewServer listens on cfg.ListenAddr and starts serving (nothing is offered
// until Offer). Its one accept goroutine and the per-connection goroutines
// of net/http exit in Close.
func NewServer(cfg ServerConfig) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.ListenAddr == "" {
		cfg.ListenAddr = "127.0.0.1:0"
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	ln, err := net.Listen("tcp", cfg.ListenAddr)
	if err != nil {
		return nil, fmt.Errorf("recovery: listen: %w", err)
	}
	s := &Server{cfg: cfg, log: cfg.Logger.With(zap.String("component", "recovery-server")), ln: ln, done: make(chan struct{})}
	s.idle = sync.NewCond(&s.mu)
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+manifestPath, s.handleManifest)
	mux.HandleFunc("GET "+chunkPath, s.handleChunk)
	s.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: zap.NewStdLog(s.log.WithOptions(zap.IncreaseLevel(zap.WarnLevel)))}
	go func() {
		defer close(s.done)
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("recovery server stopped", zap.Error(err))
		}
	}()
	return s, nil
}

// Addr is the host:port healers connect to.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Offer starts serving blobs as the committed state of step, replacing
// whatever was offered before (call Withdraw first if reads may be in flight).
func (s *Server) Offer(step int64, blobs []Blob) { s.OfferWithMeta(step, nil, blobs) }

// OfferWithMeta is Offer with a description of the state that healers
// receive with it (Stats.Meta); it is not copied.
func (s *Server) OfferWithMeta(step int64, meta []byte, blobs []Blob) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.offered, s.step, s.meta = true, step, meta
	if s.sameBlobsLocked(blobs) {
		return // the same memory as last time: a steady-state step costs no allocation
	}
	s.blobs = make(map[string]Blob, len(blobs))
	s.order = s.order[:0]
	for _, b := range blobs {
		s.blobs[b.Name] = b
		s.order = append(s.order, manifestBlob{Name: b.Name, Size: b.Len()})
	}
}

func (s *Server) sameBlobsLocked(blobs []Blob) bool {
	if len(blobs) != len(s.order) || s.blobs == nil {
		return false
	}
	for i, b := range blobs {
		cur, ok := s.blobs[b.Name]
		if !ok || s.order[i].Name != b.Name || cur.Mem != b.Mem || len(cur.Data) != len(b.Data) ||
			(len(b.Data) > 0 && &cur.Data[0] != &b.Data[0]) {
			return false
		}
	}
	return true
}

// Withdraw stops serving: new requests are refused at once, and Withdraw
// returns when the reads in flight have finished or ctx ends.
func (s *Server) Withdraw(ctx context.Context) error {
	s.mu.Lock()
	s.offered = false
	if s.inflight == 0 {
		s.mu.Unlock()
		return nil
	}
	stop := context.AfterFunc(ctx, func() {
		s.mu.Lock()
		s.idle.Broadcast()
		s.mu.Unlock()
	})
	defer stop()
	for s.inflight > 0 && ctx.Err() == nil {
		s.idle.Wait()
	}
	n := s.inflight
	s.mu.Unlock()
	if n > 0 {
		return fmt.Errorf("recovery: withdraw with %d reads in flight: %w", n, context.Cause(ctx))
	}
	return nil
}

// Served is the number of state bytes sent so far.
func (s *Server) Served() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.served
}

// ServedAtLeast returns a channel closed once the server has sent n bytes of
// state (for tests and tools that act at a point of a transfer).
func (s *Server) ServedAtLeast(n int64) <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch := make(chan struct{})
	if s.served >= n {
		close(ch)
		return ch
	}
	s.watchers = append(s.watchers, servedWatcher{n, ch})
	return ch
}

// Close stops the server and its goroutines, and returns once no read of
// the offered state is in flight, so the caller may then free it (and the
// staging buffers of device memory). Reads in flight end soon: closing
// their connections cancels their contexts. Safe to call twice.
func (s *Server) Close() error {
	err := s.srv.Close() // does not wait for handlers
	<-s.done
	s.mu.Lock()
	s.closed = true
	for s.inflight > 0 {
		s.idle.Wait()
	}
	s.mu.Unlock()
	return err
}

func httpError(w http.ResponseWriter, code int, format string, args ...any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]string{"error": fmt.Sprintf(format, args...)})
}

func (s *Server) authorize(w http.ResponseWriter, r *http.Request) bool {
	if err := verify(s.cfg.Secret, s.cfg.Job, r, time.Now()); err != nil {
		s.log.Warn("refused an unauthenticated request", zap.String("remote", r.RemoteAddr), zap.String("uri", r.URL.RequestURI()), zap.Error(err))
		httpError(w, http.StatusUnauthorized, "recovery: %v", err)
		return false
	}
	return true
}

func (s *Server) handleManifest(w http.ResponseWriter, r *http.Request) {
	if !s.authorize(w, r) {
		return
	}
	s.mu.Lock()
	if !s.offered {
		s.mu.Unlock()
		httpError(w, http.StatusConflict, "recovery: no committed state offered now")
		return
	}
	m := manifest{Job: s.cfg.Job, Step: s.step, Blobs: append([]manifestBlob(nil), s.order...), Meta: s.meta}
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(m)
}

func (s *Server) handleChunk(w http.ResponseWriter, r *http.Request) {
	if !s.authorize(w, r) {
		return
	}
	q := r.URL.Query()
	step, err1 := strconv.ParseInt(q.Get("step"), 10, 64)
	off, err2 := strconv.Atoi(q.Get("off"))
	n, err3 := strconv.Atoi(q.Get("len"))
	name := q.Get("blob")
	if err := errors.Join(err1, err2, err3); err != nil || name == "" || off < 0 || n < 0 {
		httpError(w, http.StatusBadRequest, "recovery: chunk request needs step, blob, off >= 0 and len >= 0")
		return
	}
	s.mu.Lock()
	blob, ok := s.blobs[name]
	switch {
	case s.closed:
		s.mu.Unlock()
		httpError(w, http.StatusServiceUnavailable, "recovery: server closed")
		return
	case !s.offered:
		s.mu.Unlock()
		httpError(w, http.StatusConflict, "recovery: no committed state offered now")
		return
	case step != s.step:
		cur := s.step
		s.mu.Unlock()
		httpError(w, http.StatusGone, "recovery: step %d is not served; this replica serves step %d", step, cur)
		return
	case !ok:
		s.mu.Unlock()
		httpError(w, http.StatusNotFound, "recovery: no blob %q", name)
		return
	case off+n > blob.Len():
		s.mu.Unlock()
		httpError(w, http.StatusBadRequest, "recovery: range [%d, %d) outside blob %q of %d bytes", off, off+n, name, blob.Len())
		return
	}
	s.inflight++
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.inflight--
		if s.inflight == 0 {
			s.idle.Broadcast()
		}
		s.mu.Unlock()
	}()
	var part []byte
	if blob.Mem == nil {
		part = blob.Data[off : off+n]
	} else {
		// Stage the chunk from the live state on demand: a copy per chunk
		// requested, never a copy per step.
		buf, put, err := blob.Mem.Buffer(r.Context(), n)
		if err != nil {
			httpError(w, http.StatusServiceUnavailable, "recovery: no staging buffer: %v", err)
			return
		}
		defer put()
		part = buf[:n]
		if err := blob.Mem.ReadAt(r.Context(), part, off); err != nil {
			httpError(w, http.StatusInternalServerError, "recovery: stage %q[%d:%d]: %v", name, off, off+n, err)
			return
		}
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Length", strconv.Itoa(n))
	h.Set(crcHeader, strconv.FormatUint(uint64(crc32.Checksum(part, castagnoli)), 10))
	h.Set(stepHeader, strconv.FormatInt(step, 10))
	if _, err := w.Write(part); err != nil {
		s.log.Debug("chunk write failed", zap.Error(err))
		return
	}
	s.mu.Lock()
	s.served += int64(n)
	kept := s.watchers[:0]
	for _, w := range s.watchers {
		if s.served >= w.n {
			close(w.ch)
		} else {
			kept = append(kept, w)
		}
	}
	s.watchers = kept
	s.mu.Unlock()
}
