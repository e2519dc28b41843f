package nccl

import (
	"encoding/binary"
	"errors"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
)

// GPU tests of the NCCL behaviours the shrink path relies on (package
// doc, "Facts relied on"), called on libnccl directly with two ranks in
// this process, one per GPU. Each says which NCCL versions it was seen
// on; run them with each library (FTCOMM_NCCL_LIB).

// factRank is one rank of a two-rank NCCL comm made by these tests.
type factRank struct {
	lib libapi.Library
	dev int
	h   libapi.Comm
	s   libapi.Stream
	buf uintptr // factCount float32s
}

const factCount = 1 << 16

// factComm makes a two-rank NCCL comm on GPUs 0 and 1 with cfg, a stream
// and a buffer per rank, and aborts and frees them at the end of the test
// (comms the test aborted itself are zeroed in the returned ranks).
func factComm(t *testing.T, L *Library, cfg libapi.CommConfig) []*factRank {
	t.Helper()
	lib := L.lib
	var id libapi.UniqueID
	if r := lib.GetUniqueID(&id); r != libapi.Success {
		t.Fatalf("ncclGetUniqueId: %s", r)
	}
	ranks := make([]*factRank, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Go(func() {
			fr := &factRank{lib: lib, dev: r}
			ranks[r] = fr
			var err error
			if fr.s, err = lib.StreamCreate(r); err != nil {
				errs[r] = err
				return
			}
			if fr.buf, err = lib.Malloc(r, 4*factCount); err != nil {
				errs[r] = err
				return
			}
			cell := lib.NewCell()
			res := lib.CommInitRank(r, cell, 2, &id, r, cfg)
			if res != libapi.Success && res != libapi.InProgress {
				errs[r] = factErr("ncclCommInitRankConfig", res)
				return
			}
			fr.h = lib.LoadCell(cell)
			if st := factAwait(lib, fr.h); st != libapi.Success {
				errs[r] = factErr("ncclCommInitRankConfig (async)", st)
			}
			lib.FreeCell(cell)
		})
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, fr := range ranks {
			if fr.h != 0 {
				lib.CommAbort(fr.h)
			}
			_ = lib.StreamDestroy(fr.dev, fr.s)
			_ = lib.Free(fr.dev, fr.buf)
		}
	})
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	return ranks
}

type factError struct {
	what string
	r    libapi.Result
}

func (e factError) Error() string { return e.what + ": " + e.r.String() }

func factErr(what string, r libapi.Result) error { return factError{what, r} }

// factAwait polls a comm's async state until it leaves ncclInProgress (30
// s at most).
func factAwait(lib libapi.Library, h libapi.Comm) libapi.Result {
	deadline := time.Now().Add(30 * time.Second)
	for {
		a, r := lib.CommGetAsyncError(h)
		if r != libapi.Success {
			return r
		}
		if a != libapi.InProgress || time.Now().After(deadline) {
			return a
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// factChild waits for the child NCCL writes into cell once its parent's
// job is done.
func factChild(t *testing.T, lib libapi.Library, parent libapi.Comm, cell libapi.Cell, what string) libapi.Comm {
	t.Helper()
	if st := factAwait(lib, parent); st != libapi.Success {
		t.Fatalf("%s: the parent's job ended %s", what, st)
	}
	h := lib.LoadCell(cell)
	lib.FreeCell(cell)
	if h == 0 {
		t.Fatalf("%s made no comm", what)
	}
	if st := factAwait(lib, h); st != libapi.Success {
		t.Fatalf("%s: the child ended %s", what, st)
	}
	return h
}

// factStreamDone waits until s has no work left (within limit) and
// reports how long that took.
func factStreamDone(lib libapi.Library, dev int, s libapi.Stream, limit time.Duration) (time.Duration, bool) {
	t0 := time.Now()
	for time.Since(t0) < limit {
		if idle, err := lib.StreamQuery(dev, s); err == nil && idle {
			return time.Since(t0), true
		}
		time.Sleep(50 * time.Microsecond)
	}
	return time.Since(t0), false
}

// factSet fills a rank's buffer with v.
func factSet(t *testing.T, fr *factRank, v float32) {
	t.Helper()
	b := make([]byte, 4*factCount)
	for i := range factCount {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(v))
	}
	if err := fr.lib.CopyHtoD(fr.dev, fr.buf, b, fr.s); err != nil {
		t.Fatal(err)
	}
}

// factCheck waits for the rank's stream and checks every element is want.
func factCheck(t *testing.T, fr *factRank, want float32) {
	t.Helper()
	if _, ok := factStreamDone(fr.lib, fr.dev, fr.s, 30*time.Second); !ok {
		t.Fatalf("rank %d: stream not done after 30 s", fr.dev)
	}
	b := make([]byte, 4*factCount)
	if err := fr.lib.CopyDtoH(fr.dev, b, fr.buf, fr.s); err != nil {
		t.Fatal(err)
	}
	for i := range factCount {
		if got := math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])); got != want {
			t.Fatalf("rank %d: element %d is %v, want %v", fr.dev, i, got, want)
		}
	}
}

// factAllReduce runs an in-place sum all-reduce of the ranks' buffers (set
// to rank+1) on the comms hs and checks it (3 everywhere). A nonblocking
// comm's async state is polled until the enqueue is done.
func factAllReduce(t *testing.T, ranks []*factRank, hs []libapi.Comm) {
	t.Helper()
	for i, fr := range ranks {
		factSet(t, fr, float32(i+1))
	}
	res := make([]libapi.Result, len(ranks))
	var wg sync.WaitGroup
	for i, fr := range ranks {
		wg.Go(func() {
			a := libapi.CollArgs{Kind: libapi.AllReduce, Type: libapi.Float32, Op: libapi.Sum, Send: fr.buf, Recv: fr.buf, Count: factCount}
			res[i] = fr.lib.Enqueue(fr.dev, hs[i], fr.s, &a)
			if res[i] == libapi.Success || res[i] == libapi.InProgress {
				res[i] = factAwait(fr.lib, hs[i]) // a blocking comm's state is ncclSuccess at once
			}
		})
	}
	wg.Wait()
	for i, r := range res {
		if r != libapi.Success {
			t.Fatalf("rank %d: ncclAllReduce: %s", i, r)
		}
	}
	for _, fr := range ranks {
		factCheck(t, fr, 3)
	}
}

// selfSendRecv enqueues a grouped send to self and receive from self on
// a one-rank comm (a group NCCL launches as any other, unlike a one-rank
// collective) and returns the call's result and the comm's async state
// right after it.
func selfSendRecv(fr *factRank, h libapi.Comm, dst uintptr) (call, async libapi.Result) {
	ops := []libapi.CollArgs{
		{Kind: libapi.Send, Type: libapi.Float32, Peer: 0, Send: fr.buf, Count: 1024},
		{Kind: libapi.Recv, Type: libapi.Float32, Peer: 0, Recv: dst, Count: 1024},
	}
	call = fr.lib.Group(fr.dev, h, fr.s, ops)
	async, _ = fr.lib.CommGetAsyncError(h)
	return call, async
}

// A child whose config says blocking = 1, of a nonblocking parent: the
// split or shrink call itself is nonblocking (it returns at once, with
// ncclSuccess: ncclCommSplit and ncclCommShrink return their own result,
// not the group's ncclInProgress; the parent's async state is
// ncclInProgress until the child is there), and the
// child is blocking (a group on it returns ncclSuccess, with no async
// state left in progress). ModeBlockingData's data comm and the shrink's
// data comm (dataChild) rest on it. Seen with NCCL 2.28.3 and 2.28.9.
func TestGPUNCCLBlockingChild(t *testing.T) {
	L := gpuLib(t, 2)
	lib := L.lib
	if !L.info.Features.Split || !L.info.Features.Shrink {
		t.Skipf("NCCL %s has no ncclCommSplit or ncclCommShrink", L.info.NCCL)
	}
	ranks := factComm(t, L, libapi.CommConfig{})
	// ncclCommSplit, both ranks.
	kids := make([]libapi.Comm, 2)
	var wg sync.WaitGroup
	calls := make([]libapi.Result, 2)
	states := make([]libapi.Result, 2)
	for i, fr := range ranks {
		wg.Go(func() {
			cell := lib.NewCell()
			calls[i] = lib.CommSplit(fr.h, 0, i, cell, libapi.ChildConfig{Blocking: true})
			states[i], _ = lib.CommGetAsyncError(fr.h)
			kids[i] = factChildNoT(lib, fr.h, cell)
		})
	}
	wg.Wait()
	for i := range calls {
		if (calls[i] != libapi.Success && calls[i] != libapi.InProgress) || states[i] != libapi.InProgress || kids[i] == 0 {
			t.Fatalf("rank %d: ncclCommSplit of a nonblocking parent with a blocking config returned %s, the parent's state %s after it (child %#x); want the call to return with the parent in progress",
				i, calls[i], states[i], kids[i])
		}
	}
	defer func() {
		for _, h := range kids {
			lib.CommAbort(h)
		}
	}()
	factAllReduce(t, ranks, kids)

	// ncclCommShrink, rank 0 alone (rank 1 excluded).
	fr := ranks[0]
	cell := lib.NewCell()
	r := lib.CommShrink(fr.h, []int32{1}, cell, libapi.ChildConfig{Blocking: true}, libapi.ShrinkDefault)
	if st, _ := lib.CommGetAsyncError(fr.h); (r != libapi.Success && r != libapi.InProgress) || st != libapi.InProgress {
		t.Fatalf("ncclCommShrink of a nonblocking parent with a blocking config returned %s, the parent's state %s after it; want the call to return with the parent in progress", r, st)
	}
	t.Logf("NCCL %s: ncclCommSplit returned %s, ncclCommShrink %s, each with the parent in progress", L.info.NCCL, calls[0], r)
	one := factChild(t, lib, fr.h, cell, "ncclCommShrink")
	defer lib.CommAbort(one)
	dst, err := lib.Malloc(0, 4*1024)
	if err != nil {
		t.Fatal(err)
	}
	defer lib.Free(0, dst)
	call, async := selfSendRecv(fr, one, dst)
	if call != libapi.Success || async != libapi.Success {
		t.Fatalf("a group on the shrink's blocking child: call %s, async state %s; want ncclSuccess, ncclSuccess", call, async)
	}
	t.Logf("NCCL %s: a group on the blocking child returned ncclSuccess with no async state in progress", L.info.NCCL)
}

// factChildNoT is factChild for a goroutine: 0 if the child is not there.
func factChildNoT(lib libapi.Library, parent libapi.Comm, cell libapi.Cell) libapi.Comm {
	if factAwait(lib, parent) != libapi.Success {
		return 0
	}
	h := lib.LoadCell(cell)
	lib.FreeCell(cell)
	if h == 0 || factAwait(lib, h) != libapi.Success {
		return 0
	}
	return h
}

// factSplitBlocking splits every rank's comm into one child whose config
// says blocking = 1, and aborts the children at the end of the test.
func factSplitBlocking(t *testing.T, ranks []*factRank) []libapi.Comm {
	t.Helper()
	kids := make([]libapi.Comm, len(ranks))
	var wg sync.WaitGroup
	for i, fr := range ranks {
		wg.Go(func() {
			cell := fr.lib.NewCell()
			if r := fr.lib.CommSplit(fr.h, 0, i, cell, libapi.ChildConfig{Blocking: true}); r == libapi.Success || r == libapi.InProgress {
				kids[i] = factChildNoT(fr.lib, fr.h, cell)
			}
		})
	}
	wg.Wait()
	t.Cleanup(func() {
		for i, h := range kids {
			if h != 0 {
				ranks[i].lib.CommAbort(h)
			}
		}
	})
	if slices.Contains(kids, 0) {
		t.Fatalf("split children %v", kids)
	}
	return kids
}

// factAbortParents aborts every rank's comm (at once, as ranks do).
func factAbortParents(ranks []*factRank) {
	var wg sync.WaitGroup
	for _, fr := range ranks {
		wg.Go(func() { fr.lib.CommAbort(fr.h) })
	}
	wg.Wait()
	for _, fr := range ranks {
		fr.h = 0
	}
}

// Aborting a parent leaves a child that shares no resources with it
// (splitShare and shrinkShare 0, the default) working: its collectives
// still run and are right. The backend aborts the old control comm right
// after a shrink after a failure (retireAfterFailure) while the shrink's
// child carries on. Seen with NCCL 2.28.3 and 2.28.9.
func TestGPUNCCLAbortParentKeepsChild(t *testing.T) {
	L := gpuLib(t, 2)
	if !L.info.Features.Split || !L.info.Features.Shrink {
		t.Skipf("NCCL %s has no ncclCommSplit or ncclCommShrink", L.info.NCCL)
	}
	ranks := factComm(t, L, libapi.CommConfig{})
	kids := factSplitBlocking(t, ranks)
	factAbortParents(ranks)
	factAllReduce(t, ranks, kids)
	t.Logf("NCCL %s: the split child's all-reduce is right after both parents were aborted", L.info.NCCL)
}

// NCCL_SHRINK_ABORT ends the shrunk parent's kernels, and only those: a
// kernel of another comm on the same stream (the data comm of
// ModeBlockingData) waits for the dead peer until that comm is aborted.
// So a shrink after a failure aborts the data comm itself, and the shrunk
// comm's stream is ordered after the old stream (orderAfter). Seen with
// NCCL 2.28.3 and 2.28.9.
func TestGPUNCCLShrinkAbortEndsTheParentsKernels(t *testing.T) {
	L := gpuLib(t, 2)
	lib := L.lib
	if !L.info.Features.Split || !L.info.Features.Shrink {
		t.Skipf("NCCL %s has no ncclCommSplit or ncclCommShrink", L.info.NCCL)
	}
	for _, tc := range []struct {
		name      string
		onData    bool // the stuck all-reduce runs on a split-off data comm
		wantEnded bool
	}{{"the parent's own kernel", false, true}, {"another comm's kernel", true, false}} {
		t.Run(tc.name, func(t *testing.T) {
			ranks := factComm(t, L, libapi.CommConfig{})
			fr := ranks[0]
			h := fr.h
			var kids []libapi.Comm
			if tc.onData {
				kids = factSplitBlocking(t, ranks) // rank 1's child never posts
				h = kids[0]
			}
			// Rank 1 never posts: rank 0's all-reduce waits for it.
			a := libapi.CollArgs{Kind: libapi.AllReduce, Type: libapi.Float32, Op: libapi.Sum, Send: fr.buf, Recv: fr.buf, Count: factCount}
			if r := lib.Enqueue(fr.dev, h, fr.s, &a); r != libapi.Success && r != libapi.InProgress {
				t.Fatalf("ncclAllReduce: %s", r)
			} else if st := factAwait(lib, h); st != libapi.Success {
				t.Fatalf("ncclAllReduce (async): %s", st)
			}
			if idle, _ := lib.StreamQuery(fr.dev, fr.s); idle {
				t.Fatal("the all-reduce completed without rank 1")
			}
			cell := lib.NewCell()
			t0 := time.Now()
			r := lib.CommShrink(fr.h, []int32{1}, cell, libapi.ChildConfig{Blocking: true}, libapi.ShrinkAbort)
			call := time.Since(t0)
			if r != libapi.InProgress && r != libapi.Success {
				t.Fatalf("ncclCommShrink(NCCL_SHRINK_ABORT): %s", r)
			}
			child := factChild(t, lib, fr.h, cell, "ncclCommShrink(NCCL_SHRINK_ABORT)")
			defer lib.CommAbort(child)
			took, ended := factStreamDone(lib, fr.dev, fr.s, 2*time.Second)
			t.Logf("NCCL %s: the call took %s; the stuck kernel ended %v (%s after the child was ready)", L.info.NCCL, call, ended, took)
			if ended != tc.wantEnded {
				t.Fatalf("after ncclCommShrink(NCCL_SHRINK_ABORT) the stuck kernel of %s ended: %v, want %v", tc.name, ended, tc.wantEnded)
			}
			if !ended {
				t0 := time.Now()
				lib.CommAbort(h)
				kids[0] = 0 // aborted: not again at the cleanup
				if _, ended := factStreamDone(lib, fr.dev, fr.s, 5*time.Second); !ended {
					t.Fatal("the data comm's kernel still runs 5 s after its ncclCommAbort")
				}
				t.Logf("its own ncclCommAbort ended it: done %s after the call began", time.Since(t0))
			}
		})
	}
}

// A child of a revoked parent never shares the parent's resources, even
// when the parent says splitShare = 1: after ncclCommRevoke, a split's
// child keeps working when the parent is aborted. NCCL 2.28.7+
// (ncclCommRevoke); seen with 2.28.9.
func TestGPUNCCLRevokedParentDoesNotShare(t *testing.T) {
	L := gpuLib(t, 2)
	lib := L.lib
	if !L.info.Features.Revoke || !L.info.Features.Split {
		t.Skipf("NCCL %s has no ncclCommRevoke (2.28.7+)", L.info.NCCL)
	}
	ranks := factComm(t, L, libapi.CommConfig{SplitShare: true})
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i, fr := range ranks {
		wg.Go(func() {
			if r := lib.CommRevoke(fr.h); r != libapi.Success && r != libapi.InProgress {
				errs[i] = factErr("ncclCommRevoke", r)
			} else if st := factAwait(lib, fr.h); st != libapi.Success {
				errs[i] = factErr("ncclCommRevoke (async)", st)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	kids := factSplitBlocking(t, ranks)
	factAbortParents(ranks)
	factAllReduce(t, ranks, kids)
	t.Logf("NCCL %s: the revoked parent (splitShare 1) aborted, its split child's all-reduce is right", L.info.NCCL)
}
