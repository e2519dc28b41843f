package comm_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// streamFake is a fake with a device-queue: AllReduce can be started
// without waiting, and completes when the test releases it (in order).
type streamFake struct {
	*fake
	smu      sync.Mutex
	started  []uint64 // start order, by tensor length (tests give each op a distinct length)
	gates    map[int]chan struct{}
	startedC chan int
}

type streamCompletion struct {
	f    *streamFake
	gate chan struct{}
}

func newStreamFake() *streamFake {
	return &streamFake{fake: newFake(0, 2), gates: map[int]chan struct{}{}, startedC: make(chan int, 100)}
}

func (s *streamFake) CanStart(kind comm.OpType) bool { return kind == comm.OpAllReduce }

func (s *streamFake) Start(ctx context.Context, op comm.Op) (comm.Completion, error) {
	n := op.Out.Count()
	s.smu.Lock()
	s.started = append(s.started, uint64(n))
	g, ok := s.gates[n]
	if !ok {
		g = make(chan struct{})
		s.gates[n] = g
	}
	s.smu.Unlock()
	s.startedC <- n
	return streamCompletion{s, g}, nil
}

func (c streamCompletion) Wait(ctx context.Context) error {
	select {
	case <-c.gate:
		return nil
	case <-c.f.abort:
		return c.f.abortErr
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *streamFake) release(n int) {
	s.smu.Lock()
	g, ok := s.gates[n]
	if !ok {
		g = make(chan struct{})
		s.gates[n] = g
	}
	s.smu.Unlock()
	close(g)
}

// Async ops on an Enqueuer are all started before the first completes, and
// complete in issue order.
func TestEnqueuerPipelinesAsyncOps(t *testing.T) {
	s := newStreamFake()
	c := newComm(t, s, comm.Options{Timeout: time.Hour})
	ctx := context.Background()
	var ws []*comm.Work
	for n := 1; n <= 5; n++ {
		ws = append(ws, c.AllReduceAsync(ctx, comm.Float32s(make([]float32, n)), comm.Sum))
	}
	for n := 1; n <= 5; n++ {
		if got := <-s.startedC; got != n {
			t.Fatalf("started op of length %d, want %d", got, n)
		}
	}
	for _, w := range ws {
		select {
		case <-w.Done():
			t.Fatal("an op completed before it was released")
		default:
		}
	}
	// A Barrier cannot be started: it waits for the pipeline to drain, then
	// runs on the blocking path.
	bw := c.BarrierAsync(ctx)
	for n := 1; n <= 5; n++ {
		s.release(n)
		if err := waitDone(t, ws[n-1]); err != nil {
			t.Fatal(err)
		}
	}
	if err := waitDone(t, bw); err != nil {
		t.Fatal(err)
	}
	if ops := s.ops(); len(ops) != 1 || ops[0] != comm.OpBarrier {
		t.Fatalf("blocking path saw %v, want only the barrier", ops)
	}
	// A sync op on an idle comm takes the blocking path.
	if err := c.AllReduce(ctx, comm.Float32s(make([]float32, 9)), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if ops := s.ops(); len(ops) != 2 || ops[1] != comm.OpAllReduce {
		t.Fatalf("idle sync op: blocking path saw %v", ops)
	}
	recs := c.FlightRecord().Ops
	for i, e := range recs {
		if e.State != comm.OpDone || e.Seq != uint64(i+1) {
			t.Fatalf("flight record %d: %+v", i, e)
		}
	}
}

// A started op past its deadline times out and aborts the comm; the ops
// started behind it fail, and the comm refuses further ops.
func TestEnqueuerDeadline(t *testing.T) {
	s := newStreamFake()
	c := newComm(t, s, comm.Options{Timeout: 50 * time.Millisecond})
	ctx := context.Background()
	w1 := c.AllReduceAsync(ctx, comm.Float32s(make([]float32, 1)), comm.Sum)
	w2 := c.AllReduceAsync(ctx, comm.Float32s(make([]float32, 2)), comm.Sum)
	if err := waitDone(t, w1); !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("first: %v", err)
	}
	if err := waitDone(t, w2); !errors.Is(err, comm.ErrAborted) {
		t.Fatalf("second: %v", err)
	}
	if err := c.Barrier(ctx); !errors.Is(err, comm.ErrAborted) || !errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("after: %v", err)
	}
}

func TestEnqueuerRevokeAndClose(t *testing.T) {
	s := newStreamFake()
	c, err := comm.Wrap(s, comm.Options{Timeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	w1 := c.AllReduceAsync(ctx, comm.Float32s(make([]float32, 1)), comm.Sum)
	<-s.startedC
	c.Revoke(errors.New("new epoch"))
	if err := waitDone(t, w1); !errors.Is(err, comm.ErrRevoked) {
		t.Fatalf("revoked pending op: %v", err)
	}
	s2 := newStreamFake()
	c2, err := comm.Wrap(s2, comm.Options{Timeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	w2 := c2.AllReduceAsync(ctx, comm.Float32s(make([]float32, 1)), comm.Sum)
	<-s2.startedC
	if err := c2.Close(); err != nil {
		t.Fatal(err)
	}
	if err := waitDone(t, w2); !errors.Is(err, comm.ErrClosed) {
		t.Fatalf("pending op at Close: %v", err)
	}
	c.Close()
}

// A started op that fails in the backend fails with the backend's error
// (a peer's failure), not as a timeout.
func TestEnqueuerBackendFailure(t *testing.T) {
	s := newStreamFake()
	c := newComm(t, s, comm.Options{Timeout: time.Hour})
	w := c.AllReduceAsync(context.Background(), comm.Float32s(make([]float32, 1)), comm.Sum)
	<-s.startedC
	s.Abort(&comm.RankError{Rank: 1, Op: comm.OpAllReduce, Err: comm.ErrPeerFailed})
	err := waitDone(t, w)
	if !errors.Is(err, comm.ErrPeerFailed) || errors.Is(err, comm.ErrTimeout) {
		t.Fatalf("err = %v, want ErrPeerFailed and not ErrTimeout", err)
	}
	if got := comm.FailedRanks(c.Err()); len(got) != 1 || got[0] != 1 {
		t.Fatalf("FailedRanks(c.Err()) = %v", got)
	}
}
