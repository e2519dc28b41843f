package gloo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

const testEpoch = 5

// formingRank starts rank 0 of a 2-rank comm at testEpoch and returns its
// address once it is waiting for rank 1, plus a func that waits for New.
func formingRank(t *testing.T, store *memstore.Store, log *zap.Logger) (string, func() (*comm.Comm, error)) {
	t.Helper()
	var c *comm.Comm
	var err error
	done := make(chan struct{})
	go func() {
		defer close(done)
		cfg := testConfig()
		cfg.HandshakeTimeout = 300 * time.Millisecond // the silent stranger is dropped after this
		o := testOptions(store, cfg, log)
		o.Rank, o.Size, o.Epoch = 0, 2, testEpoch
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c, err = comm.New(ctx, "gloo", o)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	addr, gerr := store.Get(ctx, "jobs/job1/comm/epoch/5/addr/0")
	if gerr != nil {
		t.Fatal(gerr)
	}
	return string(addr), func() (*comm.Comm, error) { <-done; return c, err }
}

func goodHello() hello {
	return hello{job: "job1", prefix: "jobs/job1/comm", epoch: testEpoch, from: 1, to: 0, size: 2}
}

// attack dials addr and runs a client handshake with h and secret.
func attack(addr string, h hello, secret string) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = clientHandshake(c, []byte(secret), h, 5*time.Second)
	return err
}

// forgeProof is a dialer that does not check the listener's proof and
// answers the challenge with a MAC under the wrong secret.
func forgeProof(addr string, h hello) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	h.version = protocolVersion
	raw := h.encode()
	c.Write(raw)
	if err := readStatus(c); err != nil {
		return err
	}
	var ch [nonceLen + identityLen + macLen]byte
	if _, err := io.ReadFull(c, ch[:]); err != nil {
		return err
	}
	c.Write(handshakeMAC([]byte("guess"), clientLabel, raw, ch[:nonceLen], ch[nonceLen:nonceLen+identityLen]))
	return readStatus(c)
}

// strangerBytes sends non-protocol bytes and returns what the listener
// said before closing.
func strangerBytes(t *testing.T, addr string, payload []byte) []byte {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write(payload)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset") {
		t.Errorf("stranger: listener did not close the connection: %v", err)
	}
	return b
}

func wantRefused(t *testing.T, what string, err error, code refusal) {
	t.Helper()
	var r *errRefused
	if !errors.As(err, &r) || r.code != code {
		t.Errorf("%s: got %v, want refusal %q", what, err, code)
	}
}

// TestHandshakeRefusals attacks a forming rank (strangers, another job, a
// wrong secret, stale and future epochs, bad ranks, another protocol
// version), then lets the real peer in: the comm forms and runs, and keeps
// running while strangers knock again. Every refusal is logged.
func TestHandshakeRefusals(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	log := zap.New(core)
	store := memstore.New()
	defer store.Close()
	addr, wait := formingRank(t, store, log)

	if b := strangerBytes(t, addr, []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n")); len(b) == 0 || b[0] != byte(refuseVersion) {
		t.Errorf("stranger: got reply %q, want a version refusal", b)
	}
	strangerBytes(t, addr, nil) // connects and says nothing: dropped after HandshakeTimeout
	h := goodHello()
	h.job = "job2"
	wantRefused(t, "wrong job", attack(addr, h, "s3cret"), refuseJob)
	wantRefused(t, "wrong secret", attack(addr, goodHello(), "guess"), refuseAuth)
	wantRefused(t, "forged proof", forgeProof(addr, goodHello()), refuseAuth)
	h = goodHello()
	h.epoch = testEpoch - 1
	wantRefused(t, "stale epoch", attack(addr, h, "s3cret"), refuseEpoch)
	h.epoch = testEpoch + 1
	wantRefused(t, "future epoch", attack(addr, h, "s3cret"), refuseEpoch)
	h = goodHello()
	h.prefix = "jobs/job1/other"
	wantRefused(t, "other comm", attack(addr, h, "s3cret"), refuseEpoch)
	h = goodHello()
	h.from = 7
	wantRefused(t, "rank out of range", attack(addr, h, "s3cret"), refuseRank)
	h = goodHello()
	h.from, h.to = 0, 0
	wantRefused(t, "rank not above", attack(addr, h, "s3cret"), refuseRank)
	h = goodHello()
	h.size = 3
	wantRefused(t, "wrong size", attack(addr, h, "s3cret"), refuseRank)
	raw := goodHello()
	raw.version = protocolVersion
	bad := raw.encode()
	bad[8] = 99 // version
	if b := strangerBytes(t, addr, bad); len(b) == 0 || b[0] != byte(refuseVersion) {
		t.Errorf("old protocol: got %q, want a version refusal", b)
	}

	// The real rank 1 joins; the comm forms and works.
	o := testOptions(store, testConfig(), log)
	o.Rank, o.Size, o.Epoch = 1, 2, testEpoch
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c1, err := comm.New(ctx, "gloo", o)
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close()
	c0, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	defer c0.Close()
	refusedBefore := backendOf(c0).node.refused.Load()

	// Knock while the job runs collectives.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var loopErr [2]error
	ops := [2]int{}
	for r, c := range []*comm.Comm{c0, c1} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x := make([]float32, 4096)
			for {
				select {
				case <-stop:
					// one more, so both ranks stop after the same op
				default:
				}
				for i := range x {
					x[i] = 1
				}
				if err := c.AllReduce(ctx, comm.Float32s(x), comm.Sum); err != nil {
					loopErr[r] = err
					return
				}
				if x[0] != 2 {
					loopErr[r] = errors.New("wrong sum")
					return
				}
				ops[r]++
				if ops[r] >= 200 {
					return
				}
			}
		}()
	}
	strangerBytes(t, addr, bytes.Repeat([]byte{0xF7}, 300))
	wantRefused(t, "hello to a formed comm", attack(addr, goodHello(), "s3cret"), refuseEpoch)
	h = goodHello()
	h.epoch = testEpoch - 1
	wantRefused(t, "stale epoch while running", attack(addr, h, "s3cret"), refuseEpoch)
	h = goodHello()
	h.job = "job2"
	wantRefused(t, "wrong job while running", attack(addr, h, "s3cret"), refuseJob)
	// No comm is forming now, so a wrong secret is refused before the
	// challenge (the forming phase above tested the proof check itself).
	if err := forgeProof(addr, goodHello()); err == nil {
		t.Error("forged proof while running: accepted")
	}
	close(stop)
	wg.Wait()
	for r, err := range loopErr {
		if err != nil {
			t.Errorf("rank %d stopped: %v", r, err)
		}
	}
	if got := backendOf(c0).node.refused.Load() - refusedBefore; got != 5 {
		t.Errorf("%d refusals while running, want 5", got)
	}
	refusals := logs.FilterMessage("gloo: refused inbound connection").All()
	if len(refusals) < 14 {
		t.Errorf("%d refusals logged, want at least 14", len(refusals))
	}
	var reasons []string
	for _, e := range refusals {
		m := e.ContextMap()
		reasons = append(reasons, fmt.Sprint(m["reason"], " ", m["error"]))
	}
	for _, want := range []string{"job2", "stale epoch 4", "epoch 6 is not forming", "bad proof", "bad magic"} {
		if !strings.Contains(strings.Join(reasons, "|"), want) {
			t.Errorf("no refusal logged mentioning %q; got %q", want, reasons)
		}
	}
}

// TestHandshakeReplay records a successful handshake and replays the
// dialer's bytes on a new connection: the fresh server nonce makes it fail.
func TestHandshakeReplay(t *testing.T) {
	secret := []byte("s3cret")
	serve := func(c net.Conn) error {
		_, raw, _, err := readHello(c)
		if err != nil {
			return err
		}
		if err := serverChallenge(c, secret, raw, identity{}); err != nil {
			return err
		}
		_, err = c.Write([]byte{0})
		return err
	}
	// Session 1: legitimate, recording what the dialer sends.
	cli, srv := net.Pipe()
	var rec bytes.Buffer
	errc := make(chan error, 1)
	go func() { errc <- serve(srv) }()
	if _, err := clientHandshake(teeConn{cli, &rec}, secret, goodHello(), 5*time.Second); err != nil {
		t.Fatalf("legitimate handshake: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("server: %v", err)
	}
	cli.Close()
	srv.Close()
	// Session 2: replay.
	cli, srv = net.Pipe()
	defer cli.Close()
	defer srv.Close()
	go func() { errc <- serve(srv) }()
	go io.Copy(io.Discard, cli)
	cli.Write(rec.Bytes())
	if err := <-errc; err == nil || !strings.Contains(err.Error(), "bad proof") {
		t.Fatalf("replayed handshake: server returned %v, want a bad proof", err)
	}
}

type teeConn struct {
	net.Conn
	w io.Writer
}

func (c teeConn) Write(b []byte) (int, error) {
	c.w.Write(b)
	return c.Conn.Write(b)
}

// TestHandshakeFinishingAfterFormationGaveUp: rank 1's handshake with rank
// 0 completes just as rank 0 gives up forming (its ctx ends, as when ft
// abandons a superseded epoch). Rank 0 must close that connection then,
// not leave it queued on the dropped registration, where nothing would
// take or close it until a GC finalizer did, at some random later moment:
// rank 1 learns at once that rank 0 is gone.
func TestHandshakeFinishingAfterFormationGaveUp(t *testing.T) {
	store := memstore.New()
	defer store.Close()
	cfg := testConfig()
	nd, err := newNode(cfg, zap.NewNop(), "job1", []byte("s3cret"))
	if err != nil {
		t.Fatal(err)
	}
	defer nd.release()
	handing := make(chan *net.TCPConn, 1)
	release := make(chan struct{})
	nd.beforeHandoff = func(c *net.TCPConn) { handing <- c; <-release }
	b0 := newBackend(nd, store, "jobs/job1/comm", 0, 0, 2)
	ctx0, cancel0 := context.WithCancel(context.Background())
	defer cancel0()
	formed := make(chan error, 1)
	go func() { formed <- b0.form(ctx0, nil) }()

	var c1 *comm.Comm
	var err1 error
	joined := make(chan struct{})
	go func() {
		defer close(joined)
		o := testOptions(store, cfg, nil)
		o.Rank, o.Size = 1, 2
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		c1, err1 = comm.New(ctx, "gloo", o)
	}()
	conn := <-handing // rank 1 has been told it is connected
	cancel0()
	if err := <-formed; !errors.Is(err, context.Canceled) {
		t.Fatalf("rank 0's formation: got %v, want it cancelled", err)
	}
	close(release)
	waitFor(t, "rank 0 to close the connection that came too late", func() bool {
		return conn.SetReadDeadline(time.Time{}) != nil // fails once closed
	})
	if n := nd.late.Load(); n != 1 {
		t.Errorf("%d late connections counted, want 1", n)
	}
	<-joined
	if err1 != nil {
		t.Fatalf("rank 1: %v", err1)
	}
	defer c1.Close()
	b1 := backendOf(c1)
	waitFor(t, "rank 1 to learn that rank 0 is gone", b1.isBroken)
	if err := b1.err(); !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != 0 {
		t.Errorf("rank 1: got %v, want ErrPeerFailed naming rank 0", err)
	}
}

// A rank whose connection of the comm before broke at its end first dials
// while the listener still resynchronises its own end of it (Shrink reuses
// the survivors' connections, and each end learns of a break from its own
// reader): the listener refuses the dial for now and lets it in once its
// end breaks too. Before, the refusal ("already connected") was final: the
// dialer's Shrink failed at once and the listener's waited out its
// deadline (TestShrinkReconnectsBrokenLink, 1 run in 300 beside a CPU hog).
func TestDialWhileOldConnectionResyncs(t *testing.T) {
	cfg := testConfig()
	listener, err := newNode(cfg, zap.NewNop(), "job1", []byte("s3cret"))
	if err != nil {
		t.Fatal(err)
	}
	defer listener.release()
	dialer, err := newNode(cfg, zap.NewNop(), "job1", []byte("s3cret"))
	if err != nil {
		t.Fatal(err)
	}
	defer dialer.release()
	// Rank 0 of epoch 1 resynchronises its connection to rank 1.
	reg, err := listener.register("jobs/job1/comm", 1, 0, 2, []bool{false, false}, []bool{false, true})
	if err != nil {
		t.Fatal(err)
	}
	defer listener.unregister(reg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type dialed struct {
		c   *net.TCPConn
		seg *shmSeg
		err error
	}
	done := make(chan dialed, 1)
	go func() {
		c, _, seg, err := dialer.dial(ctx, listener.addr, hello{job: "job1", prefix: "jobs/job1/comm", epoch: 1, from: 1, to: 0, size: 2})
		done <- dialed{c, seg, err}
	}()
	waitFor(t, "rank 1's dial refused while the old connection resyncs", func() bool { return listener.refused.Load() > 0 })
	listener.expect(reg, 1) // rank 0's end of the old connection broke
	d := <-done
	if d.err != nil {
		t.Fatalf("rank 1's dial after rank 0 saw its old connection break: %v", d.err)
	}
	defer d.c.Close()
	defer d.seg.unmap()
	select {
	case in := <-reg.ch:
		in.conn.Close()
		in.shm.unmap()
	case <-ctx.Done():
		t.Fatal("rank 0 was not handed the new connection")
	}
}
