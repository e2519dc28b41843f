package comm_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/comm"
	_ "github.com/ftcomm/ftcomm/comm/inproc"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newComm wraps b with test options; the comm is closed at cleanup.
func newComm(t *testing.T, b comm.Backend, opts comm.Options) *comm.Comm {
	t.Helper()
	c, err := comm.Wrap(b, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func waitDone(t *testing.T, w *comm.Work) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := w.Wait(ctx); errors.Is(err, context.DeadlineExceeded) && w.Err() == nil {
		t.Fatalf("op #%d did not complete", w.Seq())
	}
	return w.Err()
}

func TestOpsRunInIssueOrder(t *testing.T) {
	f := newFake(0, 2)
	f.gate = make(chan struct{})
	f.started = make(chan comm.OpType, 100)
	c := newComm(t, f, comm.Options{})
	ctx := context.Background()
	x := comm.Float32s(make([]float32, 4))
	out := comm.Float32s(make([]float32, 8))

	// The first op blocks in the backend; the rest queue behind it.
	w1 := c.AllReduceAsync(ctx, x, comm.Sum)
	if op := <-f.started; op != comm.OpAllReduce {
		t.Fatalf("first op started = %s", op)
	}
	w2 := c.BroadcastAsync(ctx, x, 1)
	w3 := c.AllGatherAsync(ctx, out, x)
	syncDone := make(chan error)
	go func() { syncDone <- c.Barrier(ctx) }() // a sync op queues too while busy
	// wait until the barrier is queued: its seq is 4, visible in the flight record
	deadline := time.Now().Add(10 * time.Second)
	for !hasSeq(c, 4) {
		if time.Now().After(deadline) {
			t.Fatal("the sync op was never queued")
		}
		select {
		case <-f.started:
			t.Fatal("an op started while the first was still running")
		case <-time.After(time.Millisecond):
		}
	}
	close(f.gate)
	for _, w := range []*comm.Work{w1, w2, w3} {
		if err := waitDone(t, w); err != nil {
			t.Fatal(err)
		}
	}
	if err := <-syncDone; err != nil {
		t.Fatal(err)
	}
	want := []comm.OpType{comm.OpAllReduce, comm.OpBroadcast, comm.OpAllGather, comm.OpBarrier}
	if got := f.ops(); !equalOps(got, want) {
		t.Fatalf("execution order %v, want %v", got, want)
	}
	if w1.Seq() != 1 || w2.Seq() != 2 || w3.Seq() != 3 {
		t.Fatalf("seqs %d %d %d", w1.Seq(), w2.Seq(), w3.Seq())
	}
}

func hasSeq(c *comm.Comm, seq uint64) bool {
	for _, e := range c.FlightRecord().Ops {
		if e.Seq == seq {
			return true
		}
	}
	return false
}

func TestConcurrentIssuersKeepSeqOrder(t *testing.T) {
	f := newFake(0, 2)
	c := newComm(t, f, comm.Options{FlightRecorder: 1024})
	ctx := context.Background()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x := comm.Int32s(make([]int32, 1))
			for i := range 50 {
				var err error
				if (g+i)%2 == 0 {
					err = c.AllReduce(ctx, x, comm.Max)
				} else {
					err = c.AllReduceAsync(ctx, x, comm.Min).Wait(ctx)
				}
				if err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	ops := c.FlightRecord().Ops
	if len(ops) != 400 {
		t.Fatalf("%d ops recorded", len(ops))
	}
	var last time.Time
	for i, e := range ops {
		if e.Seq != uint64(i+1) || e.State != comm.OpDone {
			t.Fatalf("entry %d: %+v", i, e)
		}
		if e.Started.Before(last) {
			t.Fatalf("op #%d started before op #%d finished", e.Seq, e.Seq-1)
		}
		last = e.Finished
	}
}

func TestTimeoutAbortsAndRefuses(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	f := newFake(0, 2)
	f.gate = make(chan struct{}) // never released: the peer never posts its op
	c := newComm(t, f, comm.Options{Timeout: 50 * time.Millisecond, Logger: zap.New(core)})
	x := comm.Float32s(make([]float32, 3))

	err := c.AllReduce(context.Background(), x, comm.Sum)
	if !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("err = %v, want ErrTimeout", err)
	}
	if !strings.Contains(err.Error(), "allreduce #1") {
		t.Errorf("error does not name the op: %v", err)
	}
	if cerr := c.Err(); !errors.Is(cerr, comm.ErrAborted) || !errors.Is(cerr, comm.ErrTimeout) {
		t.Fatalf("c.Err() = %v", cerr)
	}
	// Refused without reaching the backend.
	err = c.Broadcast(context.Background(), x, 0)
	if !errors.Is(err, comm.ErrAborted) {
		t.Fatalf("op after timeout: %v", err)
	}
	if n := len(f.ops()); n != 1 {
		t.Fatalf("backend saw %d ops, want 1", n)
	}
	// The flight recorder was written to the log at the timeout.
	var dumped bool
	for _, e := range logs.All() {
		if fr, ok := e.ContextMap()["flight_recorder"].(string); ok && strings.Contains(fr, `"op":"allreduce"`) {
			dumped = true
		}
	}
	if !dumped {
		t.Fatalf("no flight recorder dump in the log: %v", logs.All())
	}
	fr := c.FlightRecord()
	if fr.State != "failed" || fr.Ops[0].State != comm.OpFailed || fr.Ops[1].State != comm.OpFailed {
		t.Fatalf("flight record: %+v", fr)
	}
}

func TestCallerDeadlineTightensTimeout(t *testing.T) {
	f := newFake(0, 2)
	f.gate = make(chan struct{})
	c := newComm(t, f, comm.Options{Timeout: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	err := c.Barrier(ctx)
	if !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("err = %v, want ErrTimeout", err)
	}
}

// The deadline timer is left armed between ops (see deadlineTimer): an
// op that hangs must still get its own Timeout, counted from its start, not
// the deadline of an earlier op the timer was armed for.
func TestTimeoutCountsFromEachOpsStart(t *testing.T) {
	f := newFake(0, 2)
	const timeout = 100 * time.Millisecond
	c := newComm(t, f, comm.Options{Timeout: timeout, FlightRecorder: 1 << 16})
	x := comm.Float32s(make([]float32, 3))
	ctx := context.Background()
	// Ops that complete at once, for most of a Timeout: the timer is armed
	// for the first one's deadline.
	for t0 := time.Now(); time.Since(t0) < timeout*3/4; {
		if err := c.AllReduce(ctx, x, comm.Sum); err != nil {
			t.Fatal(err)
		}
	}
	f.mu.Lock()
	f.gate = make(chan struct{}) // the next op hangs
	f.mu.Unlock()
	if err := c.AllReduce(ctx, x, comm.Sum); !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("err = %v, want ErrTimeout", err)
	}
	ops := c.FlightRecord().Ops
	last := ops[len(ops)-1]
	if last.State != comm.OpFailed {
		t.Fatalf("last op: %+v", last)
	}
	if ran := last.Finished.Sub(last.Started); ran < timeout {
		t.Fatalf("the hanging op was aborted after %s, before its Timeout %s", ran, timeout)
	}
}

// A caller's deadline earlier than the one the timer is armed for (an
// earlier op's start plus a long Timeout) still ends the op.
func TestCallerDeadlineAfterAnOpWithALongTimeout(t *testing.T) {
	f := newFake(0, 2)
	c := newComm(t, f, comm.Options{Timeout: time.Hour})
	if err := c.Barrier(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	f.gate = make(chan struct{})
	f.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if err := c.Barrier(ctx); !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("err = %v, want ErrTimeout", err)
	}
}

func TestCallerCancelAbortsRunningOp(t *testing.T) {
	f := newFake(0, 2)
	f.gate = make(chan struct{})
	f.started = make(chan comm.OpType, 1)
	c := newComm(t, f, comm.Options{Timeout: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	w := c.BarrierAsync(ctx)
	<-f.started
	cancel()
	err := waitDone(t, w)
	if !errors.Is(err, comm.ErrAborted) || !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want ErrAborted wrapping context.Canceled", err)
	}
	if !errors.Is(c.Err(), comm.ErrAborted) {
		t.Fatalf("comm still active after an abandoned op: %v", c.Err())
	}
}

// On a backend that watches the ctx itself, Comm arms nothing on it, and
// an op whose ctx ends still breaks the comm and aborts the backend.
func TestCallerCancelAbortsRunningOpOnCtxWatcher(t *testing.T) {
	f := newFake(0, 2)
	f.gate = make(chan struct{})
	f.started = make(chan comm.OpType, 1)
	c := newComm(t, watcher{f}, comm.Options{Timeout: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	w := c.BarrierAsync(ctx)
	<-f.started
	cancel()
	err := waitDone(t, w)
	if !errors.Is(err, comm.ErrAborted) || !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want ErrAborted wrapping context.Canceled", err)
	}
	if !errors.Is(c.Err(), comm.ErrAborted) {
		t.Fatalf("comm still active after an abandoned op: %v", c.Err())
	}
	select {
	case <-f.abort:
	default:
		t.Fatal("backend not aborted")
	}
}

func TestQueuedOpGivesUpWithoutAbortingTheComm(t *testing.T) {
	f := newFake(0, 2)
	f.gate = make(chan struct{})
	f.started = make(chan comm.OpType, 4)
	c := newComm(t, f, comm.Options{Timeout: time.Hour})
	w1 := c.BarrierAsync(context.Background())
	<-f.started
	ctx, cancel := context.WithCancel(context.Background())
	w2 := c.BarrierAsync(ctx)
	cancel() // w2 gives up before it starts: nothing was sent, the comm is fine
	close(f.gate)
	if err := waitDone(t, w1); err != nil {
		t.Fatal(err)
	}
	if err := waitDone(t, w2); !errors.Is(err, context.Canceled) || errors.Is(err, comm.ErrAborted) {
		t.Fatalf("queued op: %v", err)
	}
	if err := c.Err(); err != nil {
		t.Fatalf("comm broken: %v", err)
	}
	if err := c.Barrier(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestWorkWaitReturnsEarlyButOpContinues(t *testing.T) {
	f := newFake(0, 2)
	f.gate = make(chan struct{})
	f.started = make(chan comm.OpType, 1)
	c := newComm(t, f, comm.Options{Timeout: time.Hour})
	w := c.BarrierAsync(context.Background())
	<-f.started
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := w.Wait(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Wait = %v", err)
	}
	select {
	case <-w.Done():
		t.Fatal("op finished although it was still gated")
	default:
	}
	if w.Err() != nil {
		t.Fatal("Err before Done must be nil")
	}
	close(f.gate)
	if err := waitDone(t, w); err != nil {
		t.Fatal(err)
	}
}

func TestRevokeFailsPendingAndFutureOps(t *testing.T) {
	f := newFake(0, 4)
	f.gate = make(chan struct{})
	f.started = make(chan comm.OpType, 1)
	c := newComm(t, revoker{f}, comm.Options{Timeout: time.Hour})
	ctx := context.Background()
	w1 := c.BarrierAsync(ctx)
	<-f.started
	w2 := c.BarrierAsync(ctx) // queued behind w1
	c.Revoke(errors.New("epoch 7 superseded"))
	c.Revoke(errors.New("again")) // harmless
	for _, w := range []*comm.Work{w1, w2} {
		if err := waitDone(t, w); !errors.Is(err, comm.ErrRevoked) {
			t.Fatalf("op #%d: %v, want ErrRevoked", w.Seq(), err)
		}
	}
	if err := c.Barrier(ctx); !errors.Is(err, comm.ErrRevoked) || !strings.Contains(err.Error(), "epoch 7 superseded") {
		t.Fatalf("future op: %v", err)
	}
	if f.revoked != 1 {
		t.Fatalf("backend revoked %d times, want 1", f.revoked)
	}
	if n := len(f.ops()); n != 1 {
		t.Fatalf("backend saw %d ops, want 1", n)
	}
}

func TestRevokeWithoutRevokerAborts(t *testing.T) {
	f := newFake(0, 2)
	c := newComm(t, f, comm.Options{})
	c.Revoke(nil)
	select {
	case <-f.abort:
	default:
		t.Fatal("backend not aborted")
	}
	if err := c.Barrier(context.Background()); !errors.Is(err, comm.ErrRevoked) {
		t.Fatal(err)
	}
}

// Revoke racing many in-flight ops: every op either succeeds (it ran before
// the revocation) or fails with ErrRevoked; none after Revoke returns succeeds.
func TestRevokeRacesInflightOps(t *testing.T) {
	for iter := range 20 {
		f := newFake(0, 2)
		f.after, f.reached = 10*(iter%4+1), make(chan struct{})
		c := newComm(t, revoker{f}, comm.Options{})
		ctx := context.Background()
		var wg sync.WaitGroup
		revoked := make(chan struct{})
		for g := range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				x := comm.Float64s(make([]float64, 2))
				for i := 0; ; i++ {
					var err error
					after := false
					select {
					case <-revoked:
						after = true
					default:
					}
					if (g+i)%2 == 0 {
						err = c.AllReduce(ctx, x, comm.Sum)
					} else {
						err = c.AllReduceAsync(ctx, x, comm.Sum).Wait(ctx)
					}
					if err != nil && !errors.Is(err, comm.ErrRevoked) {
						t.Errorf("iter %d: %v", iter, err)
					}
					if after && err == nil {
						t.Errorf("iter %d: op issued after Revoke returned succeeded", iter)
					}
					if err != nil {
						return
					}
				}
			}()
		}
		<-f.reached // revoke once some ops have run
		c.Revoke(errors.New("race"))
		close(revoked)
		wg.Wait()
	}
}

func TestAbortThenShrink(t *testing.T) {
	f := newFake(2, 4)
	f.epoch = 3
	c := newComm(t, shrinker{f}, comm.Options{Name: "dp"})
	c.Abort(errors.New("peer 1 is gone"))
	if err := c.Barrier(context.Background()); !errors.Is(err, comm.ErrAborted) {
		t.Fatal(err)
	}
	// Validation comes first and leaves the comm as it was.
	for _, bad := range []struct {
		exclude []int
		epoch   uint64
		want    string
	}{
		{nil, 4, "exclude is empty"},
		{[]int{3, 1}, 4, "not sorted"},
		{[]int{1, 1}, 4, "twice"},
		{[]int{4}, 4, "outside"},
		{[]int{2}, 4, "this rank"},
		{[]int{1}, 3, "not after"},
		{[]int{0, 1, 3}, 4, ""}, // valid: leaves rank 2 alone
	} {
		nc, err := c.Shrink(context.Background(), bad.exclude, bad.epoch)
		if bad.want == "" {
			if err != nil {
				t.Fatalf("shrink %v: %v", bad.exclude, err)
			}
			if nc.Rank() != 0 || nc.Size() != 1 || nc.Epoch() != 4 || nc.Name() != "dp" {
				t.Fatalf("new comm rank %d size %d epoch %d", nc.Rank(), nc.Size(), nc.Epoch())
			}
			if err := nc.Barrier(context.Background()); err != nil {
				t.Fatal(err)
			}
			nc.Close()
			continue
		}
		if !errors.Is(err, comm.ErrInvalidArgument) || !strings.Contains(err.Error(), bad.want) {
			t.Fatalf("shrink %v epoch %d: %v, want %q", bad.exclude, bad.epoch, err, bad.want)
		}
	}
	// The old comm was closed by the successful shrink.
	if err := c.Barrier(context.Background()); !errors.Is(err, comm.ErrClosed) {
		t.Fatalf("old comm after shrink: %v", err)
	}
	if f.closed != 1 {
		t.Fatalf("old backend closed %d times", f.closed)
	}
}

func TestMissingCapability(t *testing.T) {
	c := newComm(t, newFake(0, 2), comm.Options{})
	if _, err := c.Shrink(context.Background(), []int{1}, 1); !errors.Is(err, comm.ErrBackendUnavailable) {
		t.Fatalf("shrink: %v", err)
	}
	if _, err := c.Grow(context.Background(), 3, 1); !errors.Is(err, comm.ErrBackendUnavailable) {
		t.Fatalf("grow: %v", err)
	}
	if _, err := c.Split(context.Background(), 0, 0); !errors.Is(err, comm.ErrBackendUnavailable) {
		t.Fatalf("split: %v", err)
	}
}

func TestCloseFailsQueuedOpsAndIsIdempotent(t *testing.T) {
	f := newFake(0, 2)
	f.gate = make(chan struct{})
	f.started = make(chan comm.OpType, 1)
	c, err := comm.Wrap(f, comm.Options{Timeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	w1 := c.BarrierAsync(ctx)
	<-f.started
	w2 := c.BarrierAsync(ctx)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	for _, w := range []*comm.Work{w1, w2} {
		if err := waitDone(t, w); !errors.Is(err, comm.ErrClosed) {
			t.Fatalf("op #%d: %v", w.Seq(), err)
		}
	}
	if err := c.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if err := c.Barrier(ctx); !errors.Is(err, comm.ErrClosed) {
		t.Fatal(err)
	}
	if err := c.BarrierAsync(ctx).Wait(ctx); !errors.Is(err, comm.ErrClosed) {
		t.Fatal(err)
	}
	if f.closed != 1 {
		t.Fatalf("backend closed %d times", f.closed)
	}
}

func TestBackendErrorBreaksComm(t *testing.T) {
	f := newFake(0, 3)
	c := newComm(t, f, comm.Options{})
	f.failNext = &comm.RankError{Rank: 2, Op: comm.OpAllReduce, Err: comm.ErrPeerFailed}
	err := c.AllReduce(context.Background(), comm.Int64s([]int64{1}), comm.Sum)
	var re *comm.RankError
	if !errors.As(err, &re) || re.Rank != 2 || !errors.Is(err, comm.ErrPeerFailed) {
		t.Fatalf("err = %v", err)
	}
	if got := comm.FailedRanks(c.Err()); len(got) != 1 || got[0] != 2 {
		t.Fatalf("FailedRanks(c.Err()) = %v (%v)", got, c.Err())
	}
	if err := c.Barrier(context.Background()); !errors.Is(err, comm.ErrAborted) || !errors.Is(err, comm.ErrPeerFailed) {
		t.Fatalf("next op: %v", err)
	}
	// An in-band revocation seen by the backend revokes the comm.
	f2 := newFake(0, 2)
	c2 := newComm(t, f2, comm.Options{})
	f2.failNext = comm.ErrRevoked
	if err := c2.Barrier(context.Background()); !errors.Is(err, comm.ErrRevoked) {
		t.Fatal(err)
	}
	if !errors.Is(c2.Err(), comm.ErrRevoked) {
		t.Fatal(c2.Err())
	}
}

func TestFlightRecorder(t *testing.T) {
	f := newFake(1, 4)
	c := newComm(t, f, comm.Options{FlightRecorder: 4, Name: "fr"})
	ctx := context.Background()
	x := comm.BFloat16s(make([]comm.BF16, 6))
	_ = c.Broadcast(ctx, x, 3)
	_ = c.Send(ctx, x, 2)
	_ = c.AllReduce(ctx, x, comm.Max)
	_ = c.AllReduce(ctx, comm.Tensor{}, comm.Max) // invalid: never recorded
	_ = c.Recv(ctx, x, 0)
	f.failNext = errors.New("boom")
	_ = c.Barrier(ctx)

	var d comm.FlightDump
	if err := json.Unmarshal(c.Dump(), &d); err != nil {
		t.Fatal(err)
	}
	if d.Comm != "fr" || d.Rank != 1 || d.Size != 4 || d.State != "failed" || len(d.Ops) != 4 {
		t.Fatalf("dump: %+v", d)
	}
	want := []struct {
		seq   uint64
		op    string
		root  int
		peer  int
		state comm.OpState
	}{
		{2, "send", -1, 2, comm.OpDone},
		{3, "allreduce", -1, -1, comm.OpDone},
		{4, "recv", -1, 0, comm.OpDone},
		{5, "barrier", -1, -1, comm.OpFailed},
	}
	for i, w := range want {
		e := d.Ops[i]
		if e.Seq != w.seq || e.Op != w.op || e.Root != w.root || e.Peer != w.peer || e.State != w.state {
			t.Errorf("entry %d = %+v, want %+v", i, e, w)
		}
		if e.Enqueued.IsZero() || e.Started.IsZero() || e.Finished.Before(e.Started) {
			t.Errorf("entry %d timestamps: %+v", i, e)
		}
	}
	if d.Ops[1].DType != "bfloat16" || d.Ops[1].Count != 6 || d.Ops[1].ReduceOp != "max" {
		t.Errorf("allreduce entry: %+v", d.Ops[1])
	}
	if !strings.Contains(d.Ops[3].Error, "boom") {
		t.Errorf("failed entry error: %q", d.Ops[3].Error)
	}
	raw := string(c.Dump())
	if !strings.Contains(raw, `"state":"failed"`) {
		t.Errorf("states are not names in JSON: %s", raw)
	}
}

type recMetrics struct {
	mu  sync.Mutex
	ops []string
	n   int
}

func (m *recMetrics) ObserveOp(c string, op comm.OpType, bytes int, d time.Duration, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.ops = append(m.ops, op.String())
	m.n += bytes
}

func TestMetricsHook(t *testing.T) {
	m := &recMetrics{}
	c := newComm(t, newFake(0, 2), comm.Options{Metrics: m})
	_ = c.AllReduce(context.Background(), comm.Float32s(make([]float32, 10)), comm.Sum)
	_ = c.Send(context.Background(), comm.Int8s(make([]int8, 3)), 1)
	if strings.Join(m.ops, ",") != "allreduce,send" || m.n != 43 {
		t.Fatalf("metrics saw %v, %d bytes", m.ops, m.n)
	}
}

func TestSyncOpAllocatesNothing(t *testing.T) {
	c := newComm(t, newFake(0, 2), comm.Options{})
	ctx := context.Background()
	x := comm.Float32s(make([]float32, 16))
	allocs := testing.AllocsPerRun(1000, func() {
		if err := c.AllReduce(ctx, x, comm.Sum); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("sync AllReduce allocates %.1f times per op", allocs)
	}
}

// A cancelable ctx costs nothing per op on a backend that watches it.
func TestSyncOpWithCancelableCtxAllocatesNothingOnCtxWatcher(t *testing.T) {
	c := newComm(t, watcher{newFake(0, 2)}, comm.Options{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	x := comm.Float32s(make([]float32, 16))
	allocs := testing.AllocsPerRun(1000, func() {
		if err := c.AllReduce(ctx, x, comm.Sum); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("sync AllReduce with a cancelable ctx allocates %.1f times per op", allocs)
	}
}

func TestUnknownBackendListsRegistered(t *testing.T) {
	_, err := comm.New(context.Background(), "mpi", comm.Options{Size: 1})
	if !errors.Is(err, comm.ErrBackendUnavailable) || !strings.Contains(err.Error(), "inproc") {
		t.Fatalf("err = %v", err)
	}
	if _, err := comm.New(context.Background(), "inproc", comm.Options{Rank: 2, Size: 2}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("bad options: %v", err)
	}
}

func equalOps(a, b []comm.OpType) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
