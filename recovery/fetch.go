package recovery

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"net/http"
	"net/url"
	"runtime"
	"strconv"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

// ErrStepGone: a source no longer serves the step asked for (it moved on).
var ErrStepGone = errors.New("recovery: step no longer served")

// FetchConfig configures Fetch.
type FetchConfig struct {
	Job       string
	Secret    []byte
	ChunkSize int // bytes per request; default 4 MiB
	Streams   int // concurrent requests per source; default DefaultStreams()
	// MaxFailures is how many failed chunks in a row drop a source; default 3.
	MaxFailures int
	// Retry is the backoff between attempts to reach a source that is not
	// serving yet or failed transiently; default: exponential from 5 ms,
	// capped at 200 ms, bounded by ctx.
	Retry func() backoff.BackOff
	// Progress, if set, lets a fetch of the same step and layout resume
	// where an earlier one stopped.
	Progress *Progress
	Logger   *zap.Logger
}

// DefaultFetchConfig returns the defaults for job and secret.
func DefaultFetchConfig(job string, secret []byte) FetchConfig {
	return FetchConfig{Job: job, Secret: secret, ChunkSize: 4 << 20, Streams: DefaultStreams(), MaxFailures: 3}
}

// DefaultStreams is the default number of concurrent requests per source:
// one per two of this process's CPUs (GOMAXPROCS), from 2 to 8. Each
// stream is a TCP connection and a chunk in flight, and on a 2-core host
// more than 2 only add contention; on a 16-core GPU host 8 streams healed
// device state 2–3× faster than 2 (README, "ft.Comm on GPUs").
func DefaultStreams() int {
	return min(max(runtime.GOMAXPROCS(0)/2, 2), 8)
}

// Validate reports what is wrong with c, or nil.
func (c *FetchConfig) Validate() error {
	switch {
	case c.Job == "":
		return fmt.Errorf("%w: recovery: fetch config: empty job", comm.ErrInvalidArgument)
	case len(c.Secret) == 0:
		return fmt.Errorf("%w: recovery: fetch config: empty secret", comm.ErrInvalidArgument)
	case c.ChunkSize < 0 || c.Streams < 0 || c.MaxFailures < 0:
		return fmt.Errorf("%w: recovery: fetch config: negative chunk size, streams or max failures", comm.ErrInvalidArgument)
	}
	return nil
}

func (c FetchConfig) withDefaults() FetchConfig {
	d := DefaultFetchConfig(c.Job, c.Secret)
	if c.ChunkSize == 0 {
		c.ChunkSize = d.ChunkSize
	}
	if c.Streams == 0 {
		c.Streams = d.Streams
	}
	if c.MaxFailures == 0 {
		c.MaxFailures = d.MaxFailures
	}
	if c.Retry == nil {
		c.Retry = func() backoff.BackOff {
			b := backoff.NewExponentialBackOff()
			b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 5*time.Millisecond, 200*time.Millisecond, 0
			return b
		}
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// Stats describes a finished fetch.
type Stats struct {
	Bytes     int64
	Duration  time.Duration
	PerSource map[string]int64 // bytes delivered by each source address
	Retries   int              // chunks fetched again after a failure
	Dropped   []string         // sources that failed and were dropped
	Meta      []byte           // the sources' description of the state (Server.OfferWithMeta)
}

// Throughput is Bytes per second.
func (s Stats) Throughput() float64 {
	if s.Duration <= 0 {
		return 0
	}
	return float64(s.Bytes) / s.Duration.Seconds()
}

// Fetch fills dst with the committed state of step served by sources
// (host:port of their Servers), striping chunks across every source in
// parallel, checking each chunk's CRC-32C, and moving a failed source's
// chunks to the others. It waits (with backoff) for sources that have not
// offered the state yet, and returns when every byte is in place, when every
// source has failed, or when ctx ends. dst names must match what the
// sources serve, with the same sizes (else comm.ErrMismatch).
//
// On error dst may hold a mix of old and new bytes: heal again before use.
func Fetch(ctx context.Context, cfg FetchConfig, step int64, sources []string, dst []Blob) (Stats, error) {
	if err := cfg.Validate(); err != nil {
		return Stats{}, err
	}
	if len(sources) == 0 {
		return Stats{}, fmt.Errorf("%w: recovery: fetch with no sources", comm.ErrInvalidArgument)
	}
	cfg = cfg.withDefaults()
	f := &fetcher{cfg: cfg, step: step, sources: sources, dst: dst, start: time.Now(),
		stats: Stats{PerSource: map[string]int64{}}}
	transport := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost: cfg.Streams,
		MaxConnsPerHost:     cfg.Streams,
		ReadBufferSize:      256 << 10,
		WriteBufferSize:     4 << 10,
		DisableCompression:  true,
	}
	defer transport.CloseIdleConnections()
	f.client = &http.Client{Transport: transport}

	sizes := make([]int, len(dst))
	for i, b := range dst {
		sizes[i] = b.Len()
	}
	f.chunks = plan(sizes, cfg.ChunkSize)
	var held []bool
	if f.progress = cfg.Progress; f.progress != nil {
		f.progress.reset(step, sizes, cfg.ChunkSize, len(f.chunks))
		held = f.progress.done
	}
	f.sched = newSchedule(len(f.chunks), len(sources), cfg.MaxFailures, held)
	f.cond = sync.NewCond(&f.mu)

	// Each source is checked on its own and starts serving chunks as soon as
	// it offers the step with our layout; a dead or wrong source is dropped
	// without holding up the others. fctx ends the stragglers once done.
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(fctx, func() {
		f.mu.Lock()
		f.cond.Broadcast()
		f.mu.Unlock()
	})
	defer stop()
	var wg sync.WaitGroup
	for src := range sources {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f.checkManifest(fctx, src); err != nil {
				f.mu.Lock()
				if fctx.Err() == nil || !f.sched.finished() {
					f.dropLocked(src, err)
				}
				f.cond.Broadcast()
				f.mu.Unlock()
				return
			}
			var sw sync.WaitGroup
			for range cfg.Streams {
				sw.Add(1)
				go func() { defer sw.Done(); f.worker(fctx, src) }()
			}
			sw.Wait()
		}()
	}
	// Wait until every chunk is in, every source is gone, or ctx ends.
	f.mu.Lock()
	for !f.sched.finished() && f.sched.stuck() == nil && ctx.Err() == nil {
		f.cond.Wait()
	}
	f.mu.Unlock()
	cancel()
	wg.Wait()
	f.stats.Duration = time.Since(f.start)
	if f.sched.finished() {
		return f.stats, nil
	}
	if err := ctx.Err(); err != nil {
		return f.stats, fmt.Errorf("recovery: fetch step %d: %w (last error: %v)", step, context.Cause(ctx), f.lastErr)
	}
	if errors.Is(f.lastErr, comm.ErrMismatch) { // our layout disagrees with the sources': a bug, not a flake
		return f.stats, f.lastErr
	}
	return f.stats, fmt.Errorf("recovery: fetch step %d: %w (last error: %w)", step, f.sched.stuck(), f.lastErr)
}

type fetcher struct {
	cfg      FetchConfig
	client   *http.Client
	step     int64
	sources  []string
	dst      []Blob
	chunks   []chunk
	start    time.Time
	progress *Progress

	mu      sync.Mutex
	cond    *sync.Cond
	sched   *schedule
	stats   Stats
	lastErr error
}

func (f *fetcher) dropLocked(src int, err error) {
	if f.sched.dropped[src] {
		return
	}
	f.sched.drop(src)
	f.lastErr = err
	f.stats.Dropped = append(f.stats.Dropped, f.sources[src])
	f.cfg.Logger.Warn("healing source dropped", zap.String("source", f.sources[src]), zap.Error(err))
}

func (f *fetcher) get(ctx context.Context, src int, path string, q url.Values) (*http.Response, error) {
	u := url.URL{Scheme: "http", Host: f.sources[src], Path: path, RawQuery: q.Encode()}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set(authHeader, sign(f.cfg.Secret, f.cfg.Job, http.MethodGet, req.URL.RequestURI(), time.Now()))
	resp, err := f.client.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode == http.StatusOK {
		return resp, nil
	}
	defer resp.Body.Close()
	var body struct {
		Error string `json:"error"`
	}
	json.NewDecoder(io.LimitReader(resp.Body, 4096)).Decode(&body)
	err = &httpStatusError{fmt.Sprintf("recovery: %s answered %d: %s", f.sources[src], resp.StatusCode, body.Error)}
	switch resp.StatusCode {
	case http.StatusConflict: // not offering yet: worth waiting for
		return nil, err
	case http.StatusGone:
		return nil, backoff.Permanent(fmt.Errorf("%w: %w", ErrStepGone, err))
	}
	return nil, backoff.Permanent(err)
}

// httpStatusError is an error answer from a source (as opposed to no answer).
type httpStatusError struct{ msg string }

func (e *httpStatusError) Error() string { return e.msg }

// BlobInfo is a blob as a source describes it.
type BlobInfo struct {
	Name string
	Size int
}

// Describe waits until source serves step (as Fetch does) and returns the
// layout it serves: for a caller that sizes its buffers to the source's.
func Describe(ctx context.Context, cfg FetchConfig, step int64, source string) ([]BlobInfo, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	transport := &http.Transport{DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext, DisableCompression: true}
	defer transport.CloseIdleConnections()
	f := &fetcher{cfg: cfg, step: step, sources: []string{source}, client: &http.Client{Transport: transport}}
	m, err := f.waitManifest(ctx, 0)
	if err != nil {
		return nil, err
	}
	if m.Job != cfg.Job {
		return nil, fmt.Errorf("%w: recovery: %s serves job %q, not %q", comm.ErrMismatch, source, m.Job, cfg.Job)
	}
	out := make([]BlobInfo, len(m.Blobs))
	for i, b := range m.Blobs {
		out[i] = BlobInfo{Name: b.Name, Size: b.Size}
	}
	return out, nil
}

// checkManifest waits until source src serves step and checks its layout.
func (f *fetcher) checkManifest(ctx context.Context, src int) error {
	m, err := f.waitManifest(ctx, src)
	if err != nil {
		return err
	}
	return f.layoutCheck(m, src)
}

// waitManifest waits until source src serves step and returns what it says.
func (f *fetcher) waitManifest(ctx context.Context, src int) (manifest, error) {
	var m manifest
	var last error
	unreachable := 0
	err := backoff.Retry(func() error {
		resp, err := f.get(ctx, src, manifestPath, nil)
		var he *httpStatusError
		if err != nil && !errors.As(err, &he) && ctx.Err() == nil {
			// Not answering at all (refused, reset): a dead source. Give up
			// on it after MaxFailures tries; one that answers "not yet" is
			// waited for as long as ctx allows.
			if unreachable++; unreachable >= f.cfg.MaxFailures {
				return backoff.Permanent(err)
			}
		}
		if err != nil {
			last = err
			return err
		}
		defer resp.Body.Close()
		if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&m); err != nil {
			return backoff.Permanent(fmt.Errorf("recovery: manifest from %s: %w", f.sources[src], err))
		}
		if m.Step != f.step {
			if m.Step < f.step {
				last = fmt.Errorf("recovery: %s serves step %d, waiting for %d", f.sources[src], m.Step, f.step)
				return last
			}
			return backoff.Permanent(fmt.Errorf("%w: %s serves step %d, not %d", ErrStepGone, f.sources[src], m.Step, f.step))
		}
		return nil
	}, backoff.WithContext(f.cfg.Retry(), ctx))
	if err != nil && ctx.Err() != nil && last != nil {
		return manifest{}, fmt.Errorf("%w (last answer: %v)", err, last)
	}
	if err != nil {
		return manifest{}, err
	}
	return m, nil
}

func (f *fetcher) layoutCheck(m manifest, src int) error {
	if m.Job != f.cfg.Job || len(m.Blobs) != len(f.dst) {
		return fmt.Errorf("%w: recovery: %s serves %d blobs of job %q, want %d of %q", comm.ErrMismatch, f.sources[src], len(m.Blobs), m.Job, len(f.dst), f.cfg.Job)
	}
	for i, b := range m.Blobs {
		if b.Name != f.dst[i].Name || b.Size != f.dst[i].Len() {
			return fmt.Errorf("%w: recovery: %s serves blob %d as %q of %d bytes, want %q of %d",
				comm.ErrMismatch, f.sources[src], i, b.Name, b.Size, f.dst[i].Name, f.dst[i].Len())
		}
	}
	f.mu.Lock()
	if f.stats.Meta == nil {
		f.stats.Meta = m.Meta
	}
	f.mu.Unlock()
	return nil
}

// worker fetches chunks from one source until none are left for it.
func (f *fetcher) worker(ctx context.Context, src int) {
	for {
		f.mu.Lock()
		var c int
		for {
			if f.sched.finished() || f.sched.dropped[src] || ctx.Err() != nil || f.sched.stuck() != nil {
				f.cond.Broadcast()
				f.mu.Unlock()
				return
			}
			var ok bool
			if c, ok = f.sched.next(src); ok {
				break
			}
			f.cond.Wait() // chunks are in flight elsewhere; one may come back
		}
		f.mu.Unlock()

		err := backoff.Retry(func() error { return f.fetchChunk(ctx, src, f.chunks[c]) },
			backoff.WithContext(backoff.WithMaxRetries(f.cfg.Retry(), 2), ctx))

		f.mu.Lock()
		if err == nil {
			f.sched.succeeded(src, c)
			if f.progress != nil {
				f.progress.done[c] = true
			}
			f.stats.Bytes += int64(f.chunks[c].len)
			f.stats.PerSource[f.sources[src]] += int64(f.chunks[c].len)
		} else {
			f.lastErr = err
			f.stats.Retries++
			if f.sched.failed(src, c) {
				f.dropLocked(src, err)
			}
		}
		f.cond.Broadcast()
		f.mu.Unlock()
	}
}

func (f *fetcher) fetchChunk(ctx context.Context, src int, c chunk) error {
	q := url.Values{}
	q.Set("step", strconv.FormatInt(f.step, 10))
	q.Set("blob", f.dst[c.blob].Name)
	q.Set("off", strconv.Itoa(c.off))
	q.Set("len", strconv.Itoa(c.len))
	resp, err := f.get(ctx, src, chunkPath, q)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	want, err := strconv.ParseUint(resp.Header.Get(crcHeader), 10, 32)
	if err != nil {
		return backoff.Permanent(fmt.Errorf("recovery: chunk from %s without a checksum", f.sources[src]))
	}
	dst := f.dst[c.blob]
	var buf []byte
	if dst.Mem == nil {
		buf = dst.Data[c.off : c.off+c.len]
	} else {
		b, put, err := dst.Mem.Buffer(ctx, c.len)
		if err != nil {
			return fmt.Errorf("recovery: staging buffer: %w", err)
		}
		defer put()
		buf = b[:c.len]
	}
	if _, err := io.ReadFull(resp.Body, buf); err != nil {
		return fmt.Errorf("recovery: read chunk from %s: %w", f.sources[src], err)
	}
	if got := crc32.Checksum(buf, castagnoli); got != uint32(want) {
		return fmt.Errorf("recovery: chunk %s[%d:%d] from %s: crc32c %08x, want %08x",
			dst.Name, c.off, c.off+c.len, f.sources[src], got, want)
	}
	if dst.Mem != nil {
		if err := dst.Mem.WriteAt(ctx, buf, c.off); err != nil {
			return fmt.Errorf("recovery: write chunk %s[%d:%d]: %w", dst.Name, c.off, c.off+c.len, err)
		}
	}
	return nil
}
