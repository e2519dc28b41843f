package gloo

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/internal/silence"
)

func init() {
	comm.Register("gloo", factory)
}

func factory(ctx context.Context, o comm.Options) (comm.Backend, error) {
	cfg := DefaultConfig()
	if o.BackendConfig != nil {
		c, ok := o.BackendConfig.(*Config)
		if !ok {
			return nil, fmt.Errorf("%w: gloo: Options.BackendConfig is %T, want *gloo.Config", comm.ErrInvalidArgument, o.BackendConfig)
		}
		if c != nil {
			cp := *c
			cfg = &cp
		}
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", comm.ErrInvalidArgument, err)
	}
	if sharedMemoryDisabledByEnv() {
		cfg.SharedMemory = false
	}

	log := o.Logger
	if log == nil {
		log = zap.NewNop()
	}
	log = log.Named("gloo")
	if len(o.JobID) > maxJobLen || len(o.Prefix) > maxPrefixLen-64 {
		return nil, fmt.Errorf("%w: gloo: job id or prefix too long", comm.ErrInvalidArgument)
	}
	nd, err := newNode(cfg, log, o.JobID, o.Secret)
	if err != nil {
		return nil, err
	}
	b := newBackend(nd, o.Store, o.Prefix, o.Epoch, o.Rank, o.Size)
	if err := b.form(ctx, nil); err != nil {
		nd.release()
		return nil, err
	}
	b.start()
	return b, nil
}

// Backend is one rank of a gloo comm. See the package documentation.
type Backend struct {
	cfg    Config
	log    *zap.Logger
	node   *node
	store  comm.Store
	prefix string
	rank   int
	size   int
	epoch  uint64
	links  []*link // by rank; nil at this rank. Written once, under mu, by form.

	// op state, owned by the op goroutine (Comm runs one op at a time)
	collSeq uint64
	curColl atomic.Uint64 // sequence number of the collective in progress, 0 if none
	curOp   atomic.Uint32
	curD    desc
	curDMu  sync.Mutex
	active  atomic.Bool  // an op is pending (the liveness check runs only then)
	late    atomic.Bool  // the monitor runs late (this process is starved): silence proves nothing
	left    atomic.Int64 // 1 + a peer that closed its comm while an op no longer needed it; the op's end breaks b
	// departed: 1 + a peer that closed its comm while no op needed it, when
	// Config.KeepPointToPointAfterLeave kept b going; the next collective breaks b.
	departed atomic.Int64
	notify   chan struct{}
	exp      []rxMark // per link: what the entries posted so far will have delivered
	want     []int    // per link: entries planned for the op being set up
	scratch  [][]byte
	srcs     [][]byte
	flags    []bool
	one      oneShotWait // the wait of a one-shot all-reduce (kept here: no allocation per op)

	// lane helpers (lanes.go): the op goroutine starts them (laneHelpers
	// counts them and publishes their channels) and hands them work
	// through laneGo and laneDone
	laneHelpers   atomic.Int32
	laneGo        [shmMaxLanes]chan struct{}
	laneWake      [shmMaxLanes]chan struct{}
	laneDone      chan int
	laneJobs      [shmMaxLanes]laneJob
	laneRuns      [shmMaxLanes]laneRun
	laneDoneFlags [shmMaxLanes][]bool
	inLanes       bool // the op goroutine runs lane 0 of a lanes all-reduce: it spins for laneSpin
	crowded       bool // more ranks of this comm on this host than CPUs (see spin); set by start
	marks         []int64
	ints          []int
	members       uint64     // membership hash the resync frames of a Shrink or Grow carry
	left0         resyncNote // what else they say: the epoch left and the ranks a Shrink excluded
	ctxStop       func() bool

	// refusals (refuse.go): readers and the op goroutine; rmu is taken
	// after a link's mu, never before
	rmu          sync.Mutex
	refColl      []*collRefusal // refused collectives not forgotten yet (rmu)
	nRefColl     atomic.Int32   // len(refColl)
	opColl       atomic.Uint64  // number of the collective the op in progress runs, 0 if none
	halted       atomic.Bool    // haltErr is set
	haltErr      error          // a peer refused the collective in progress (rmu)
	haltRef      collRefusal    // which, and why (rmu)
	opRefusal    error          // a peer refused a send or receive of the op in progress (rmu)
	anyOpRefusal atomic.Bool    // opRefusal may be set
	strays       atomic.Int32   // stray refusals kept on the links

	// testDelivered, tests only (nil in a job): called by a link's
	// reader once it has completed an entry of collective or message
	// seq from peer and released the link.
	testDelivered atomic.Pointer[func(peer int, seq uint64)]

	mu     sync.Mutex
	fault  *faultInfo // the first failure
	revoke *faultInfo // a revocation (local or remote), if any
	broken chan struct{}
	closed bool
	formed bool
	// forming cancels the comm a Shrink, Grow or Split of b is forming:
	// aborting, revoking or closing b ends that formation at once.
	forming func(error)
	monWake chan struct{}
	quit    chan struct{}
	wg      sync.WaitGroup
}

var _ comm.Backend = (*Backend)(nil)

var (
	_ comm.Backend         = (*Backend)(nil)
	_ comm.Revoker         = (*Backend)(nil)
	_ comm.Shrinker        = (*Backend)(nil)
	_ comm.Grower          = (*Backend)(nil)
	_ comm.Splitter        = (*Backend)(nil)
	_ comm.CtxWatcher      = (*Backend)(nil)
	_ comm.FailureNotifier = (*Backend)(nil)
	_ comm.SilenceReporter = (*Backend)(nil)
	_ comm.Refuser         = (*Backend)(nil)
)

// WatchesCtx implements comm.CtxWatcher: every wait of an op selects on
// its ctx or polls it (shared memory), every frame sent looks at it, and
// a socket write arms a callback that aborts the backend (watchCtx), so
// an op returns within microseconds of its ctx's end and the Comm need
// not arm a callback of its own on every op.
func (b *Backend) WatchesCtx() bool { return true }

type rxMark struct{ bytes, done int64 }

// faultInfo is why a Backend stopped running collectives.
type faultInfo struct {
	nt    notice // what peers are told (nothing if nt.kind is 0)
	err   error  // what ops return
	quiet bool   // an orderly event (close, revoke): log at info level
}

func newBackend(nd *node, store comm.Store, prefix string, epoch uint64, rank, size int) *Backend {
	return &Backend{
		cfg: nd.cfg, node: nd, store: store, prefix: prefix, epoch: epoch, rank: rank, size: size,
		log:    nd.log.With(zap.String("prefix", prefix), zap.Int("rank", rank), zap.Int("size", size), zap.Uint64("epoch", epoch)),
		notify: make(chan struct{}, 1), exp: make([]rxMark, size), want: make([]int, size), laneDone: make(chan int, shmMaxLanes),
		broken: make(chan struct{}), monWake: make(chan struct{}, 1), quit: make(chan struct{}),
	}
}

// derive makes the Backend of a comm formed from b's (sharing b's node).
func (b *Backend) derive(prefix string, epoch uint64, rank, size int) *Backend {
	b.node.ref()
	return newBackend(b.node, b.store, prefix, epoch, rank, size)
}

func (b *Backend) start() {
	b.mu.Lock()
	b.formed = true
	links := b.links
	b.mu.Unlock()
	onHost := 1
	for _, l := range links {
		if l != nil && l.shm != nil {
			onHost++
		}
	}
	for p, l := range links {
		if l == nil {
			continue
		}
		if l.shm != nil {
			l.shm.crowded.Store(onHost > runtime.NumCPU())
			b.crowded = onHost > runtime.NumCPU()
		}
		// Nobody heartbeats a connection while its comm forms (a reused
		// one may have waited for a slow survivor): silence counts from now.
		l.heardAt.Mark(l.now())
		// A connection that broke while the mesh was forming was not reported.
		if l.isClosed() {
			l.mu.Lock()
			err := l.err
			l.mu.Unlock()
			b.linkFailed(l, p, err)
		}
	}
	b.wg.Add(1)
	go b.monitor()
}

// Name implements comm.Backend.
func (b *Backend) Name() string { return "gloo" }

// Rank implements comm.Backend.
func (b *Backend) Rank() int { return b.rank }

// Size implements comm.Backend.
func (b *Backend) Size() int { return b.size }

// Epoch implements comm.Backend.
func (b *Backend) Epoch() uint64 { return b.epoch }

// Memory implements comm.Backend.
func (b *Backend) Memory() comm.Memory { return comm.HostMemory }

// Addr is the address this rank's node listens on (shared by the comms
// derived from it).
func (b *Backend) Addr() string { return b.node.addr }

func (b *Backend) addrKey(prefix string, epoch uint64, rank int) string {
	return prefix + "/epoch/" + strconv.FormatUint(epoch, 10) + "/addr/" + strconv.Itoa(rank)
}

// ---- forming the mesh ----

// form connects b to every peer: links in reuse (by new rank) are
// resynchronised to b's epoch, the others are dialed (peers of lower rank)
// or accepted (higher rank) after a rendezvous through the Store. A reused
// link that breaks during the resync is replaced by a new connection.
func (b *Backend) form(ctx context.Context, reuse []*link) error {
	n, r := b.size, b.rank
	links := make([]*link, n)
	if n == 1 {
		b.setLinks(links)
		return nil
	}
	if b.store == nil {
		return fmt.Errorf("%w: gloo: size %d needs a Store", comm.ErrInvalidArgument, n)
	}
	ctx, cancel := context.WithTimeout(ctx, b.cfg.ConnectTimeout)
	defer cancel()
	reused := func(p int) *link {
		if reuse == nil {
			return nil
		}
		return reuse[p]
	}
	wantFrom, resyncFrom := make([]bool, n), make([]bool, n)
	accepts := 0
	for p := r + 1; p < n; p++ {
		if reused(p) == nil {
			wantFrom[p] = true
			accepts++
		} else {
			resyncFrom[p] = true
		}
	}
	reg, err := b.node.register(b.prefix, b.epoch, r, n, wantFrom, resyncFrom)
	if err != nil {
		return err
	}
	defer b.node.unregister(reg)
	if err := b.store.Set(ctx, b.addrKey(b.prefix, b.epoch, r), []byte(b.node.addr)); err != nil {
		return fmt.Errorf("gloo: publish address: %w", err)
	}

	type result struct {
		peer   int
		l      *link
		reused bool
		err    error
	}
	results := make(chan result, 2*n)
	var wg sync.WaitGroup
	members := uint64(0)
	if reuse != nil {
		members = b.members
	}
	dial := func(p int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			addr, err := b.store.Get(ctx, b.addrKey(b.prefix, b.epoch, p))
			if err != nil {
				results <- result{peer: p, err: fmt.Errorf("gloo: rendezvous with rank %d: %w", p, err)}
				return
			}
			c, id, seg, err := b.node.dial(ctx, string(addr), hello{job: b.node.job, prefix: b.prefix, epoch: b.epoch,
				from: int32(r), to: int32(p), size: int32(n)})
			if err != nil {
				results <- result{peer: p, err: err}
				return
			}
			results <- result{peer: p, l: newLink(c, b, p, id, seg)}
		}()
	}
	deadlinesSet := make(chan struct{})
	stopDeadlines := context.AfterFunc(ctx, func() {
		defer close(deadlinesSet)
		for _, l := range reuse {
			if l != nil {
				l.conn.SetWriteDeadline(aLongTimeAgo)
			}
		}
	})
	// stop returns false once the func has started: wait for it, so that no
	// deadline of this formation lands on a link after it returns (on the
	// comm it formed, or on the next Shrink or Grow's resync).
	stopped := false
	stopAndWait := func() bool {
		if !stopped {
			stopped = true
			if !stopDeadlines() {
				<-deadlinesSet
				return false
			}
		}
		return true
	}
	defer stopAndWait()
	pending := 0
	for p, l := range reuse {
		if l == nil {
			continue
		}
		pending++
		wg.Add(1)
		go func() {
			defer wg.Done()
			deadline, _ := ctx.Deadline()
			err := l.sendResync(resyncInfo{epoch: b.epoch, size: uint32(n), rank: uint32(r), members: members}, b.left0, deadline)
			if err != nil && ctx.Err() == nil {
				l.fail(err) // the connection is broken: reconnect below
			}
			if err == nil {
				select {
				case err = <-l.syncCh:
				case <-ctx.Done():
					err = context.Cause(ctx)
				}
			}
			results <- result{peer: p, l: l, reused: true, err: err}
		}()
	}
	for p := 0; p < r; p++ {
		if reused(p) == nil {
			pending++
			dial(p)
		}
	}
	var ferr error
	for pending+accepts > 0 && ferr == nil {
		select {
		case res := <-results:
			pending--
			switch {
			case res.err == nil:
				links[res.peer] = res.l
			case res.reused && !errors.Is(res.err, comm.ErrMismatch) && res.l.isClosed() && ctx.Err() == nil:
				// The reused connection broke: connect afresh.
				b.log.Info("gloo: reused connection broke during resync; reconnecting", zap.Int("peer", res.peer), zap.Error(res.err))
				if res.peer < r {
					pending++
					dial(res.peer)
				} else {
					b.node.expect(reg, res.peer)
					accepts++
				}
			default:
				ferr = res.err
			}
		case in := <-reg.ch:
			accepts--
			links[in.from] = newLink(in.conn, b, in.from, in.id, in.shm)
		case <-ctx.Done():
			ferr = fmt.Errorf("gloo: forming %s epoch %d rank %d/%d: %w (connected to %d of %d peers)",
				b.prefix, b.epoch, r, n, context.Cause(ctx), count(links), n-1)
			if errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
				// Past the deadline (not cancelled), the peers that never
				// came are named, for the layer above to blame.
				ferr = errors.Join(ferr, absent(links, r, b.epoch))
			}
		}
	}
	if ferr == nil {
		wg.Wait()
		// The ctx may have ended just as the last connection came in, and
		// its deadlines may have reached a connection after the handshake or
		// resync that cleared them: fail like any formation the ctx ended.
		if !stopAndWait() || ctx.Err() != nil {
			ferr = fmt.Errorf("forming %s epoch %d rank %d/%d: %w (connected to all %d peers)",
				b.prefix, b.epoch, r, n, context.Cause(ctx), n-1)
		}
	}
	if ferr != nil {
		cancel()
		stopAndWait()
		wg.Wait()
		close(results)
		for res := range results {
			if res.err == nil && !res.reused {
				res.l.fail(errLocal)
			}
		}
		for p, l := range links {
			if l != nil && (reuse == nil || reuse[p] != l) {
				l.fail(errLocal)
				<-l.readerDone
			}
		}
		if errors.Is(ferr, comm.ErrMismatch) {
			return ferr
		}
		return fmt.Errorf("gloo: %w", ferr)
	}
	b.setLinks(links)
	return nil
}

// absent names the ranks other than r with no link: a *comm.RankError
// wrapping comm.ErrPeerFailed each.
func absent(ls []*link, r int, epoch uint64) error {
	var errs []error
	for p, l := range ls {
		if l == nil && p != r {
			errs = append(errs, &comm.RankError{Rank: p, Op: comm.OpNone, Epoch: epoch,
				Err: fmt.Errorf("gloo: %w: rank %d did not connect before the deadline", comm.ErrPeerFailed, p)})
		}
	}
	return errors.Join(errs...)
}

func count(ls []*link) int {
	k := 0
	for _, l := range ls {
		if l != nil {
			k++
		}
	}
	return k
}

func (b *Backend) setLinks(ls []*link) {
	b.mu.Lock()
	b.links = ls
	b.mu.Unlock()
}

func (b *Backend) linkList() []*link {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.links
}

// ---- failure ----

func (b *Backend) isBroken() bool {
	select {
	case <-b.broken:
		return true
	default:
		return false
	}
}

// Broken implements comm.FailureNotifier: closed when b breaks, whether an
// op was running or a reader saw a peer fail (or a peer's notice arrived)
// while none was.
func (b *Backend) Broken() <-chan struct{} { return b.broken }

// Err implements comm.FailureNotifier: why b broke, nil before.
func (b *Backend) Err() error { return b.err() }

// err is the error ops fail with once b is broken. A revocation after a
// failure (ft revokes when a step fails) keeps the failure's kind beside
// its own: the op matches comm.ErrRevoked and, say, comm.ErrPeerFailed
// naming the dead rank.
func (b *Backend) err() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.revoke != nil && b.fault != nil:
		return errors.Join(b.revoke.err, b.fault.err)
	case b.revoke != nil:
		return b.revoke.err
	case b.fault != nil:
		return b.fault.err
	}
	return nil
}

// breakWith records the first failure, wakes every waiter, interrupts
// blocked writes, and has the monitor tell the peers.
func (b *Backend) breakWith(f faultInfo) {
	b.mu.Lock()
	first := b.fault == nil && b.revoke == nil
	if f.nt.kind == noticeRevoke {
		if b.revoke != nil {
			b.mu.Unlock()
			return
		}
		b.revoke = &f
	} else {
		if b.fault != nil || b.revoke != nil && errors.Is(f.err, comm.ErrPeerClosed) {
			// A peer that closes its comm after the revocation (ft revokes,
			// moves to the new epoch's comms and closes this one) left in
			// order: the ops fail with the revocation alone, naming no
			// failed peer.
			b.mu.Unlock()
			return
		}
		b.fault = &f
	}
	if first {
		close(b.broken)
	}
	links := b.links
	closed := b.closed
	b.mu.Unlock()
	if first {
		for _, l := range links {
			if l != nil && l.ownedBy(b) {
				l.wdl.Store(true)
				l.conn.SetWriteDeadline(aLongTimeAgo)
				if l.shm != nil {
					l.interruptTx()
				}
			}
		}
	}
	if !closed {
		lvl := b.log.Warn
		if f.quiet {
			lvl = b.log.Info
		}
		lvl("gloo: comm stops running collectives", zap.Error(f.err))
	}
	select {
	case b.monWake <- struct{}{}:
	default:
	}
}

func (b *Backend) opType() comm.OpType { return comm.OpType(b.curOp.Load()) }

func (b *Backend) curOpDesc() desc {
	b.curDMu.Lock()
	defer b.curDMu.Unlock()
	return b.curD
}

// linkFailed is called when the connection to peer closed (reader error,
// write error, bye, or closed here).
func (b *Backend) linkFailed(l *link, peer int, err error) {
	b.mu.Lock()
	formed := b.formed
	b.mu.Unlock()
	if !formed || errors.Is(err, errLocal) {
		return
	}
	if errors.Is(err, errPeerBye) {
		b.peerClosed(l, peer)
		return
	}
	b.breakWith(faultInfo{
		nt:  notice{kind: noticePeerFailed, op: b.opType(), origin: int32(b.rank), subject: int32(peer), cause: err.Error()},
		err: &comm.RankError{Rank: peer, Op: b.opType(), Epoch: b.epoch, Err: fmt.Errorf("gloo: %w: %w", comm.ErrPeerFailed, err)},
	})
}

// peerClosed handles a peer's goodbye. Everything the peer sent before it
// has been delivered (the bye follows its data on the connection, and a
// shared-memory link's reader drains the ring first), so a peer that
// finished the op in progress and closed its comm at once — the usual end
// of a program — must not fail that op here. The op fails now (and the
// other ranks are told, as of any failed op) only if it still expects data
// from the peer; otherwise b breaks when the op ends, and a later receive
// from or send to the peer fails the op that tries. A break with no op in
// need of the peer tells nobody: the peer said goodbye to every rank.
func (b *Backend) peerClosed(l *link, peer int) {
	l.mu.Lock()
	l.departed.Store(true)
	needed := l.phead < len(l.posts) || l.planLeft > 0
	l.mu.Unlock()
	if needed {
		b.peerGone(peer, true)
		return
	}
	if b.cfg.KeepPointToPointAfterLeave {
		b.departed.CompareAndSwap(0, int64(peer)+1)
		return // a receive posted from it, or a send to it, fails that op (post, the closed link)
	}
	if b.active.Load() {
		b.left.Store(int64(peer) + 1)
		if b.active.Load() {
			return // end() breaks b (it stores active, then loads left)
		}
	}
	b.peerGone(peer, false)
}

// peerGone breaks b because peer closed its comm: a member has left. The
// other ranks are told if the op in progress failed for it (notify).
//
// Either way the error matches comm.ErrPeerClosed beside ErrPeerFailed: the
// peer is alive (it said goodbye), which callers may tell from a crash.
func (b *Backend) peerGone(peer int, notify bool) {
	cause := fmt.Errorf("gloo: %w: %w", comm.ErrPeerFailed, comm.ErrPeerClosed)
	f := faultInfo{
		err:   &comm.RankError{Rank: peer, Op: b.opType(), Epoch: b.epoch, Err: cause},
		quiet: true, // an orderly exit: logged at info level
	}
	if notify {
		f.nt = notice{kind: noticePeerFailed, op: b.opType(), flags: noticePeerClosed, origin: int32(b.rank), subject: int32(peer),
			cause: fmt.Sprintf("rank %d closed its communicator", peer)}
	}
	b.breakWith(f)
}

// peerLeft fails b because peer resynchronised its connection to a later
// epoch: it has left this comm, so ops that need it cannot complete. If
// the peer shrank this comm, the ranks it excluded (note) are why: the
// error names each (a *comm.RankError wrapping comm.ErrPeerFailed, joined
// if several), as their death would have — the peer learned of it first.
// Otherwise (it grew) the error wraps comm.ErrAborted.
func (b *Backend) peerLeft(peer int, epoch uint64, note *resyncNote) {
	op := b.opType()
	var errs []error
	first := -1
	if note.from == b.epoch {
		for _, x := range note.excluded {
			if x < 0 || x >= b.size || x == b.rank || x == peer {
				continue
			}
			if first < 0 {
				first = x
			}
			errs = append(errs, &comm.RankError{Rank: x, Op: op, Epoch: b.epoch,
				Err: fmt.Errorf("gloo: %w: rank %d shrank the comm to epoch %d without it", comm.ErrPeerFailed, peer, epoch)})
		}
	}
	if first < 0 {
		why := fmt.Sprintf("rank %d moved on to epoch %d", peer, epoch)
		b.breakWith(faultInfo{
			nt:  notice{kind: noticeAbort, op: op, origin: int32(b.rank), subject: int32(peer), cause: why},
			err: fmt.Errorf("gloo: %w: %s", comm.ErrAborted, why),
		})
		return
	}
	why := fmt.Sprintf("rank %d shrank the comm to epoch %d without rank %d", peer, epoch, first)
	if more := note.nexcl - 1; more > 0 {
		why += fmt.Sprintf(" (and %d more)", more)
	}
	b.breakWith(faultInfo{
		nt:  notice{kind: noticePeerFailed, op: op, origin: int32(b.rank), subject: int32(first), cause: why},
		err: errors.Join(errs...),
	})
}

// mismatch fails b because peer runs a different op than this rank.
func (b *Backend) mismatch(peer int, epoch uint64, why error) {
	if epoch != b.epoch {
		return
	}
	b.breakWith(faultInfo{
		nt:  notice{kind: noticeMismatch, op: b.opType(), origin: int32(b.rank), subject: int32(peer), cause: why.Error()},
		err: &comm.RankError{Rank: peer, Op: b.opType(), Epoch: b.epoch, Err: fmt.Errorf("gloo: %w: %w", comm.ErrMismatch, why)},
	})
}

// remoteFault handles a notice from peer.
func (b *Backend) remoteFault(peer int, nt notice) {
	op := b.opType()
	var err error
	switch nt.kind {
	case noticeRevoke:
		err = fmt.Errorf("gloo: %w by rank %d: %s", comm.ErrRevoked, nt.origin, nt.cause)
	case noticeAbort:
		if nt.flags&noticeTimedOut != 0 {
			// As at the origin, the error matches both ErrAborted and ErrTimeout.
			cause := strings.TrimPrefix(nt.cause, comm.ErrTimeout.Error()+": ")
			err = fmt.Errorf("gloo: %w: rank %d timed out: %w: %s", comm.ErrAborted, nt.origin, comm.ErrTimeout, cause)
		} else {
			err = fmt.Errorf("gloo: %w: rank %d aborted: %s", comm.ErrAborted, nt.origin, nt.cause)
		}
	case noticePeerFailed:
		cause := fmt.Errorf("gloo: %w (reported by rank %d): %s", comm.ErrPeerFailed, nt.origin, nt.cause)
		if nt.flags&noticePeerClosed != 0 {
			cause = fmt.Errorf("gloo: %w (reported by rank %d): %w", comm.ErrPeerFailed, nt.origin, comm.ErrPeerClosed)
		}
		err = &comm.RankError{Rank: int(nt.subject), Op: op, Epoch: b.epoch, Err: cause}
	case noticeMismatch:
		err = &comm.RankError{Rank: int(nt.subject), Op: op, Epoch: b.epoch,
			Err: fmt.Errorf("gloo: %w (reported by rank %d): %s", comm.ErrMismatch, nt.origin, nt.cause)}
	default:
		return
	}
	b.breakWith(faultInfo{nt: nt, err: err})
}

// Abort implements comm.Backend: every blocked op fails at once with
// comm.ErrAborted; the peers are told, so their pending ops fail too.
// Connections stay open for Shrink.
func (b *Backend) Abort(cause error) {
	if cause == nil {
		cause = errors.New("abort requested")
	}
	b.stopForming(fmt.Errorf("%w: %w", comm.ErrAborted, cause))
	b.breakWith(faultInfo{
		nt:  abortNotice(b.opType(), b.rank, cause),
		err: fmt.Errorf("gloo: %w: %w", comm.ErrAborted, cause),
	})
}

// Revoke implements comm.Revoker: pending and later ops fail with
// comm.ErrRevoked here and, once the revoke frame reaches them, at every
// peer (each forwards it). Connections stay open for Shrink.
func (b *Backend) Revoke(cause error) {
	if cause == nil {
		cause = errors.New("revoke requested")
	}
	b.stopForming(fmt.Errorf("%w: %w", comm.ErrRevoked, cause))
	b.breakWith(faultInfo{
		nt:    notice{kind: noticeRevoke, op: b.opType(), origin: int32(b.rank), subject: -1, cause: cause.Error()},
		err:   fmt.Errorf("gloo: %w: %w", comm.ErrRevoked, cause),
		quiet: true,
	})
}

// stopForming ends the formation of a comm from b that is in flight, if any.
func (b *Backend) stopForming(cause error) {
	b.mu.Lock()
	cancel := b.forming
	b.mu.Unlock()
	if cancel != nil {
		cancel(cause)
	}
}

// formFrom forms nb, a comm made from b by Shrink, Grow or Split, so that
// aborting, revoking or closing b meanwhile ends the formation (comm.Comm
// aborts b at the op's deadline and on Close). A b closed already forms
// nothing.
func (b *Backend) formFrom(ctx context.Context, nb *Backend, reuse []*link) error {
	fctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return fmt.Errorf("gloo: %w", comm.ErrClosed)
	}
	b.forming = cancel
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.forming = nil
		b.mu.Unlock()
	}()
	return nb.form(fctx, reuse)
}

// Close implements comm.Backend: it fails a pending op, says goodbye to the
// peers on the connections it still owns (not those a comm formed by Shrink
// or Grow took over), closes them and waits for its goroutines.
func (b *Backend) Close() error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return nil
	}
	b.closed = true
	b.mu.Unlock()
	b.stopForming(comm.ErrClosed)
	b.breakWith(faultInfo{err: fmt.Errorf("gloo: %w", comm.ErrClosed), quiet: true}) // peers learn from the bye
	close(b.quit)
	b.wg.Wait()
	var mine []*link
	for _, l := range b.linkList() {
		if l != nil && l.ownedBy(b) {
			mine = append(mine, l)
		}
	}
	for _, l := range mine {
		l.closeGraceful(b.cfg.HeartbeatInterval)
	}
	for _, l := range mine {
		<-l.readerDone
	}
	b.node.release()
	return nil
}

// silentAfter is how long a connected peer may send nothing before
// SilentPeers names it: a few heartbeats, or half the peer timeout.
func (b *Backend) silentAfter() time.Duration {
	return max(3*b.cfg.HeartbeatInterval, b.cfg.PeerTimeout/2)
}

// SilentPeers returns the ranks from which nothing has arrived for longer
// than a few heartbeat intervals (max(3 × HeartbeatInterval, PeerTimeout /
// 2)), or nil while this process's monitor runs late (see
// comm.SilenceReporter). A closed link is not silent: its end is a
// failure of its own, told as such.
func (b *Backend) SilentPeers() []int {
	if b.late.Load() {
		return nil
	}
	b.mu.Lock()
	links := b.links
	b.mu.Unlock()
	limit := b.silentAfter()
	var out []int
	for p, l := range links {
		// As the liveness check: only a reader blocked on the socket with
		// nothing queued hears nothing; one busy with a frame, or held
		// until this rank posts its op, has data from the peer.
		if l == nil || l.isClosed() || l.byeSeen() || !l.ownedBy(b) || l.rstate.Load() != rsReading ||
			l.inq() > 0 || l.shm != nil && l.shmPending() {
			continue
		}
		if l.heardAt.Silent(l.now()) > limit {
			out = append(out, p)
		}
	}
	return out
}

// monitor sends heartbeats on idle connections, declares silent peers
// failed while an op is pending (see liveness.go), and tells peers about a
// failure. It exits when b is closed.
func (b *Backend) monitor() {
	defer b.wg.Done()
	iv := b.cfg.HeartbeatInterval
	t := time.NewTicker(iv)
	defer t.Stop()
	last := time.Now()
	var sentFault, sentRevoke, starved []bool
	var blockedSince []time.Time
	var health silence.Health
	for {
		woken := false
		select {
		case <-t.C:
		case <-b.monWake:
			woken = true
		case <-b.quit:
			return
		}
		now := time.Now()
		// If this goroutine itself was starved, silence proves nothing.
		healthy := now.Sub(last) < 3*iv
		if !woken {
			health.Tick(now.Sub(last)-iv, iv)
		}
		b.late.Store(!healthy || health.Score() > 0)
		last = now
		b.mu.Lock()
		fault, revoke, links := b.fault, b.revoke, b.links
		b.mu.Unlock()
		if sentFault == nil {
			sentFault, sentRevoke, starved = make([]bool, len(links)), make([]bool, len(links)), make([]bool, len(links))
			blockedSince = make([]time.Time, len(links))
		}
		for p, l := range links {
			if l == nil || l.isClosed() {
				continue
			}
			// The fault first: a revocation that follows a failure (ft
			// revokes when a step fails) must not hide it from the peers,
			// whose pending op fails with the first notice they read.
			if fault != nil && !sentFault[p] {
				sentFault[p] = fault.nt.kind == 0 || l.sendNotice(b, &fault.nt, iv)
			}
			if revoke != nil && !sentRevoke[p] && (fault == nil || sentFault[p]) {
				sentRevoke[p] = l.sendNotice(b, &revoke.nt, iv)
			}
			l.heartbeat(b, iv)
			if !woken {
				l.heardAt.Decay() // once per heartbeat interval: half-life about 44 of them
			}
			if !healthy {
				blockedSince[p] = time.Time{} // looks were missed: start over
			}
			if fault == nil && revoke == nil && healthy && b.active.Load() && l.rstate.Load() == rsReading {
				silent := l.heardAt.Silent(l.now())
				if silent <= b.cfg.PeerTimeout {
					starved[p], blockedSince[p] = false, time.Time{}
					continue
				}
				if l.inq() > 0 || l.shm != nil && l.shmPending() || !l.ownedBy(b) {
					continue
				}
				proc := silence.Look(b.node.self.Identity, l.peerID.Identity)
				var blocked time.Duration
				if proc != silence.Blocked {
					blockedSince[p] = time.Time{}
				} else if blockedSince[p].IsZero() {
					blockedSince[p] = now
				} else {
					blocked = now.Sub(blockedSince[p])
				}
				dead, cause := silence.Verdict(silence.Silence{Silent: silent, Base: b.cfg.PeerTimeout, Gap: l.heardAt.Gap(),
					Health: health.Score(), State: proc, Blocked: blocked})
				if !dead {
					if proc == silence.Runnable && !starved[p] {
						starved[p] = true
						b.log.Debug("gloo: peer silent, but its process is runnable: starved, not failed",
							zap.Int("peer", p), zap.Duration("silent", silent))
					}
					continue
				}
				why := errors.New(cause)
				b.breakWith(faultInfo{
					nt:  notice{kind: noticePeerFailed, op: b.opType(), origin: int32(b.rank), subject: int32(p), cause: why.Error()},
					err: &comm.RankError{Rank: p, Op: b.opType(), Epoch: b.epoch, Err: fmt.Errorf("gloo: %w: %w", comm.ErrPeerFailed, why)},
				})
				l.fail(fmt.Errorf("declared failed: %w", why))
			}
		}
	}
}
