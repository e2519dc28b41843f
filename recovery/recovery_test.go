package recovery_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/recovery"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const job = "llama"

var secret = []byte("s3cret")

func randomBlobs(seed uint64, sizes ...int) []recovery.Blob {
	r := rand.New(rand.NewPCG(seed, 7))
	var bs []recovery.Blob
	for i, n := range sizes {
		d := make([]byte, n)
		for j := range d {
			d[j] = byte(r.Uint32())
		}
		bs = append(bs, recovery.Blob{Name: fmt.Sprintf("blob%d", i), Data: d})
	}
	return bs
}

func emptyLike(bs []recovery.Blob) []recovery.Blob {
	var out []recovery.Blob
	for _, b := range bs {
		out = append(out, recovery.Blob{Name: b.Name, Data: make([]byte, len(b.Data))})
	}
	return out
}

func servers(t *testing.T, n int, step int64, state []recovery.Blob) []*recovery.Server {
	t.Helper()
	var ss []*recovery.Server
	for range n {
		s, err := recovery.NewServer(recovery.ServerConfig{Job: job, Secret: secret})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		if state != nil {
			s.Offer(step, state)
		}
		ss = append(ss, s)
	}
	return ss
}

func addrs(ss []*recovery.Server) []string {
	var out []string
	for _, s := range ss {
		out = append(out, s.Addr())
	}
	return out
}

func fetchCfg() recovery.FetchConfig {
	c := recovery.DefaultFetchConfig(job, secret)
	c.ChunkSize = 64 << 10
	c.Streams = 2 // the same on every host (the default follows its CPUs)
	return c
}

func TestDefaultStreamsFollowCPUs(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, c := range []struct{ procs, want int }{{1, 2}, {2, 2}, {5, 2}, {6, 3}, {16, 8}, {128, 8}} {
		runtime.GOMAXPROCS(c.procs)
		if got := recovery.DefaultStreams(); got != c.want {
			t.Errorf("GOMAXPROCS %d: %d streams, want %d", c.procs, got, c.want)
		}
		if got := recovery.DefaultFetchConfig(job, secret).Streams; got != c.want {
			t.Errorf("GOMAXPROCS %d: DefaultFetchConfig has %d streams, want %d", c.procs, got, c.want)
		}
	}
}

func ctx10s(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func sameBlobs(t *testing.T, got, want []recovery.Blob) {
	t.Helper()
	for i := range want {
		if !bytes.Equal(got[i].Data, want[i].Data) {
			t.Fatalf("blob %s differs", want[i].Name)
		}
	}
}

func TestFetchStripesAcrossSources(t *testing.T) {
	state := randomBlobs(1, 1<<20+3, 0, 300<<10)
	ss := servers(t, 3, 42, state)
	dst := emptyLike(state)
	st, err := recovery.Fetch(ctx10s(t), fetchCfg(), 42, addrs(ss), dst)
	if err != nil {
		t.Fatal(err)
	}
	sameBlobs(t, dst, state)
	if st.Bytes != int64(1<<20+3+300<<10) {
		t.Fatalf("stats bytes %d", st.Bytes)
	}
	for _, s := range ss {
		if st.PerSource[s.Addr()] == 0 || s.Served() == 0 {
			t.Fatalf("source %s delivered nothing: %v", s.Addr(), st.PerSource)
		}
	}
}

// proxy forwards TCP to target and, after passing limit bytes back to the
// client, cuts every connection and stops accepting: a source dying mid-
// transfer, as seen from the healer.
type proxy struct {
	ln      net.Listener
	target  string
	limit   int64
	corrupt bool // flip one byte in the body instead of cutting
	sent    atomic.Int64
	mu      sync.Mutex
	conns   []net.Conn
	cut     chan struct{}
	once    sync.Once
	wg      sync.WaitGroup
	spoiled chan struct{} // closed at the first corrupted read
	spoil   sync.Once
}

func newProxy(t *testing.T, target string, limit int64, corrupt bool) *proxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, target: target, limit: limit, corrupt: corrupt, cut: make(chan struct{}), spoiled: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { defer p.wg.Done(); io.Copy(up, c); up.Close() }()
		go func() { defer p.wg.Done(); p.down(c, up); c.Close() }()
	}
}

func (p *proxy) down(c, up net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := up.Read(buf)
		if n > 0 {
			total := p.sent.Add(int64(n))
			if total > p.limit {
				if !p.corrupt {
					p.kill()
					return
				}
				buf[n-1] ^= 0xff // once past the limit, corrupt the tail of every read
				p.spoil.Do(func() { close(p.spoiled) })
			}
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *proxy) kill() {
	p.once.Do(func() {
		close(p.cut)
		p.ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
	})
}

func (p *proxy) close() { p.kill(); p.wg.Wait() }

func TestSourceDiesMidTransfer(t *testing.T) {
	state := randomBlobs(2, 4<<20)
	ss := servers(t, 3, 7, state)
	// Cut during the first chunks it carries: its two streams ask at once.
	dying := newProxy(t, ss[0].Addr(), 64<<10, false)
	srcs := []string{dying.ln.Addr().String(), ss[1].Addr(), ss[2].Addr()}
	dst := emptyLike(state)
	st, err := recovery.Fetch(ctx10s(t), fetchCfg(), 7, srcs, dst)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-dying.cut:
	default:
		t.Fatal("the proxy never cut the source off")
	}
	sameBlobs(t, dst, state)
	if st.Retries == 0 || st.PerSource[srcs[0]] >= 4<<20 {
		t.Fatalf("expected the dying source's chunks to be fetched again elsewhere: %+v", st)
	}
}

func TestCorruptChunksAreRefetched(t *testing.T) {
	state := randomBlobs(3, 1<<20)
	ss := servers(t, 1, 1, state)
	bad := newProxy(t, ss[0].Addr(), 100<<10, true)
	// The good source offers the state only once the bad one has sent a
	// corrupted chunk, so that the healer always meets the corruption.
	good := servers(t, 1, 0, nil)[0]
	go func() {
		select {
		case <-bad.spoiled:
			good.Offer(1, state)
		case <-bad.cut:
		}
	}()
	srcs := []string{bad.ln.Addr().String(), good.Addr()}
	dst := emptyLike(state)
	st, err := recovery.Fetch(ctx10s(t), fetchCfg(), 1, srcs, dst)
	if err != nil {
		t.Fatal(err)
	}
	sameBlobs(t, dst, state)
	if st.Retries == 0 {
		t.Fatal("corruption went unnoticed")
	}
}

func TestEverySourceFails(t *testing.T) {
	state := randomBlobs(4, 1<<20)
	ss := servers(t, 1, 1, state)
	p := newProxy(t, ss[0].Addr(), 100<<10, false)
	_, err := recovery.Fetch(ctx10s(t), fetchCfg(), 1, []string{p.ln.Addr().String()}, emptyLike(state))
	if err == nil || !strings.Contains(err.Error(), "every source failed") {
		t.Fatalf("err = %v", err)
	}
}

func TestFetchWaitsForOffer(t *testing.T) {
	state := randomBlobs(5, 100<<10)
	ss := servers(t, 1, 0, nil) // not offering yet
	ss[0].Offer(3, state)       // an old step first: the healer keeps waiting for 4
	done := make(chan error)
	dst := emptyLike(state)
	go func() {
		_, err := recovery.Fetch(ctx10s(t), fetchCfg(), 4, addrs(ss), dst)
		done <- err
	}()
	ss[0].Offer(4, state)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	sameBlobs(t, dst, state)
}

func TestStaleStepAndLayoutMismatch(t *testing.T) {
	state := randomBlobs(6, 1000, 2000)
	ss := servers(t, 1, 9, state)
	_, err := recovery.Fetch(ctx10s(t), fetchCfg(), 8, addrs(ss), emptyLike(state))
	if !errors.Is(err, recovery.ErrStepGone) {
		t.Fatalf("asking for an older step: %v", err)
	}
	wrong := emptyLike(state)
	wrong[1].Data = make([]byte, 1999)
	_, err = recovery.Fetch(ctx10s(t), fetchCfg(), 9, addrs(ss), wrong)
	if !errors.Is(err, comm.ErrMismatch) || !strings.Contains(err.Error(), `"blob1" of 2000 bytes, want "blob1" of 1999`) {
		t.Fatalf("layout mismatch: %v", err)
	}
}

func TestAuthentication(t *testing.T) {
	state := randomBlobs(7, 1000)
	ss := servers(t, 1, 1, state)
	cfg := fetchCfg()
	cfg.Secret = []byte("wrong")
	_, err := recovery.Fetch(ctx10s(t), cfg, 1, addrs(ss), emptyLike(state))
	if err == nil || !strings.Contains(err.Error(), "401") || !strings.Contains(err.Error(), "bad signature") {
		t.Fatalf("wrong secret: %v", err)
	}
	for _, path := range []string{"/v1/manifest", "/v1/chunk?step=1&blob=blob0&off=0&len=10"} {
		resp, err := http.Get("http://" + ss[0].Addr() + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(body), `"error"`) {
			t.Fatalf("unsigned %s: %d %s", path, resp.StatusCode, body)
		}
	}
	if ss[0].Served() != 0 {
		t.Fatal("state leaked to an unauthenticated client")
	}
}

func TestWithdrawStopsServing(t *testing.T) {
	state := randomBlobs(8, 1000)
	ss := servers(t, 1, 1, state)
	if err := ss[0].Withdraw(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The fetch waits for an offer that never comes, and its error says
	// what the source answered. On a loaded machine (under -race) the
	// source may not answer within a try's second at all: such a try
	// says nothing either way, and another is made.
	for try := 1; ; try++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := recovery.Fetch(ctx, fetchCfg(), 1, addrs(ss), emptyLike(state))
		cancel()
		if errors.Is(err, context.DeadlineExceeded) && strings.Contains(err.Error(), "no committed state offered") {
			return
		}
		if err == nil || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "last answer: Get") || try == 10 {
			t.Fatalf("fetch from a withdrawn source (try %d): %v", try, err)
		}
	}
}

func TestConfigValidation(t *testing.T) {
	if _, err := recovery.NewServer(recovery.ServerConfig{Job: job}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("server without secret: %v", err)
	}
	if _, err := recovery.Fetch(context.Background(), recovery.FetchConfig{Job: job, Secret: secret, Streams: -1}, 1, []string{"x"}, nil); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("negative streams: %v", err)
	}
	if _, err := recovery.Fetch(context.Background(), fetchCfg(), 1, nil, nil); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("no sources: %v", err)
	}
}

// BenchmarkHeal compares healing 256 MiB from 1 and from 3 sources in the
// same run (go test -bench Heal ./recovery/).
func BenchmarkHeal(b *testing.B) {
	state := []recovery.Blob{{Name: "params", Data: make([]byte, 256<<20)}}
	for i := range state[0].Data {
		state[0].Data[i] = byte(i * 7)
	}
	dst := emptyLike(state)
	for _, c := range []struct{ sources, streams int }{{1, 1}, {3, 1}, {1, 2}, {3, 2}, {1, 8}, {3, 8}} {
		n := c.sources
		b.Run(fmt.Sprintf("sources=%d/streams=%d", n, c.streams), func(b *testing.B) {
			var ss []string
			for range n {
				s, err := recovery.NewServer(recovery.ServerConfig{Job: job, Secret: secret})
				if err != nil {
					b.Fatal(err)
				}
				defer s.Close()
				s.Offer(1, state)
				ss = append(ss, s.Addr())
			}
			cfg := recovery.DefaultFetchConfig(job, secret)
			cfg.Streams = c.streams
			b.SetBytes(int64(len(state[0].Data)))
			for b.Loop() {
				if _, err := recovery.Fetch(context.Background(), cfg, 1, ss, dst); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// A dead source (nothing listening) and one that never offers the step do
// not hold up the fetch: the good source serves everything.
func TestDeadAndSilentSourcesDoNotBlock(t *testing.T) {
	state := randomBlobs(9, 512<<10)
	good := servers(t, 1, 5, state)
	silent := servers(t, 1, 0, nil) // alive, never offers
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close() // connections to it are refused
	dst := emptyLike(state)
	st, err := recovery.Fetch(ctx10s(t), fetchCfg(), 5, []string{dead, silent[0].Addr(), good[0].Addr()}, dst)
	if err != nil {
		t.Fatal(err)
	}
	sameBlobs(t, dst, state)
	if st.PerSource[good[0].Addr()] != int64(len(state[0].Data)) {
		t.Fatalf("stats: %+v", st)
	}
}

// A fetch whose only source dies part-way leaves its progress behind; the
// next fetch of the same step, from another source, fetches only the rest.
func TestFetchResumesWithProgress(t *testing.T) {
	state := randomBlobs(10, 1<<20)
	ss := servers(t, 2, 3, state)
	dying := newProxy(t, ss[0].Addr(), 400<<10, false)
	cfg := fetchCfg()
	cfg.Progress = &recovery.Progress{}
	dst := emptyLike(state)
	if _, err := recovery.Fetch(ctx10s(t), cfg, 3, []string{dying.ln.Addr().String()}, dst); err == nil {
		t.Fatal("fetch from a dying source succeeded")
	}
	held := cfg.Progress.Done([]int{1 << 20})
	if held == 0 || held >= 1<<20 {
		t.Fatalf("progress after the cut: %d bytes", held)
	}
	st, err := recovery.Fetch(ctx10s(t), cfg, 3, []string{ss[1].Addr()}, dst)
	if err != nil {
		t.Fatal(err)
	}
	sameBlobs(t, dst, state)
	if st.Bytes != 1<<20-held {
		t.Fatalf("resumed fetch moved %d bytes, want the %d missing", st.Bytes, 1<<20-held)
	}
}

// staged is a Memory whose bytes Go code "cannot address": every access goes
// through ReadAt/WriteAt and a bounded pool of staging buffers, as device
// memory does.
type staged struct {
	mu     sync.Mutex
	data   []byte
	pool   chan []byte
	reads  atomic.Int64
	writes atomic.Int64
	failAt int // WriteAt at this offset fails once (-1: never)
	failed atomic.Bool
}

func newStaged(data []byte, buffers, size int) *staged {
	s := &staged{data: data, pool: make(chan []byte, buffers), failAt: -1}
	for range buffers {
		s.pool <- make([]byte, size)
	}
	return s
}

func (s *staged) Len() int { return len(s.data) }

func (s *staged) Buffer(ctx context.Context, n int) ([]byte, func(), error) {
	select {
	case b := <-s.pool:
		if len(b) < n {
			b = make([]byte, n)
		}
		return b, func() { s.pool <- b }, nil
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
}

func (s *staged) ReadAt(ctx context.Context, p []byte, off int) error {
	s.reads.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	copy(p, s.data[off:off+len(p)])
	return nil
}

func (s *staged) WriteAt(ctx context.Context, p []byte, off int) error {
	if off == s.failAt && !s.failed.Swap(true) {
		return errors.New("copy engine hiccup")
	}
	s.writes.Add(1)
	s.mu.Lock()
	defer s.mu.Unlock()
	copy(s.data[off:], p)
	return nil
}

// State in "device memory" heals chunk by chunk through staging buffers on
// both sides, with the description of the state delivered alongside, and a
// failed copy into the target retried.
func TestFetchThroughStagedMemory(t *testing.T) {
	state := randomBlobs(5, 1<<20+17, 200<<10)
	var src []recovery.Blob
	for _, b := range state {
		src = append(src, recovery.Blob{Name: b.Name, Mem: newStaged(bytes.Clone(b.Data), 2, 64<<10)})
	}
	ss := servers(t, 3, 9, nil)
	for _, s := range ss {
		s.OfferWithMeta(9, []byte("history"), src)
	}
	targets := []*staged{newStaged(make([]byte, len(state[0].Data)), 4, 64<<10), newStaged(make([]byte, len(state[1].Data)), 4, 64<<10)}
	targets[0].failAt = 128 << 10
	dst := []recovery.Blob{{Name: state[0].Name, Mem: targets[0]}, {Name: state[1].Name, Mem: targets[1]}}
	st, err := recovery.Fetch(ctx10s(t), fetchCfg(), 9, addrs(ss), dst)
	if err != nil {
		t.Fatal(err)
	}
	for i, tg := range targets {
		if !bytes.Equal(tg.data, state[i].Data) {
			t.Fatalf("blob %d differs after healing through staging buffers", i)
		}
	}
	if string(st.Meta) != "history" {
		t.Fatalf("meta %q", st.Meta)
	}
	if !targets[0].failed.Load() {
		t.Fatal("the injected copy failure never happened")
	}
	wantChunks := int64((len(state[0].Data)+(64<<10)-1)/(64<<10) + (len(state[1].Data)+(64<<10)-1)/(64<<10))
	if got := targets[0].writes.Load() + targets[1].writes.Load(); got != wantChunks {
		t.Fatalf("%d chunk copies into the target, want %d", got, wantChunks)
	}
}

// blockingMem stands for device memory whose copies wait on a busy GPU:
// a read returns only when its ctx ends. Its staging buffers come back
// through put.
type blockingMem struct {
	once    sync.Once
	entered chan struct{}
	putBack atomic.Bool
}

func (m *blockingMem) Len() int { return 1 << 20 }

func (m *blockingMem) Buffer(ctx context.Context, n int) ([]byte, func(), error) {
	return make([]byte, n), func() { m.putBack.Store(true) }, nil
}

func (m *blockingMem) ReadAt(ctx context.Context, p []byte, off int) error {
	m.once.Do(func() { close(m.entered) })
	<-ctx.Done()
	return ctx.Err()
}

func (m *blockingMem) WriteAt(ctx context.Context, p []byte, off int) error {
	return errors.New("blockingMem is only served")
}

// Close returns only after the reads in flight gave their staging buffers
// back: the caller frees the offered state and (with device memory) the
// pinned buffers right after. Before, http.Server.Close returned without
// waiting for handlers, and a read could stage into freed memory.
func TestCloseWaitsForReadsInFlight(t *testing.T) {
	m := &blockingMem{entered: make(chan struct{})}
	s, err := recovery.NewServer(recovery.ServerConfig{Job: job, Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	s.Offer(1, []recovery.Blob{{Name: "params", Mem: m}})
	ctx := ctx10s(t)
	cfg := fetchCfg()
	cfg.Streams, cfg.ChunkSize = 1, m.Len()
	fetched := make(chan error, 1)
	go func() {
		_, err := recovery.Fetch(ctx, cfg, 1, []string{s.Addr()}, []recovery.Blob{{Name: "params", Data: make([]byte, m.Len())}})
		fetched <- err
	}()
	select {
	case <-m.entered:
	case <-ctx.Done():
		t.Fatal("the chunk was never requested")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if !m.putBack.Load() {
		t.Fatal("Close returned while a read still held its staging buffer")
	}
	if err := <-fetched; err == nil {
		t.Fatal("the fetch succeeded from a server closed mid-chunk")
	}
}
