package nccl

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
	"github.com/ftcomm/ftcomm/comm"
)

// The rendezvous record rank 0 publishes under <Prefix>/epoch/<e>/nccl-uid:
// "FTN1", the kind, the comm size (uint32, big endian), the 128-byte id.
const (
	recInit byte = 1 // join with ncclCommInitRankConfig
	recGrow byte = 2 // join with ncclCommGrow (the id came from ncclCommGetUniqueId)
	recLen       = 4 + 1 + 4 + len(libapi.UniqueID{})
)

func uidKey(epoch uint64) string { return fmt.Sprintf("epoch/%d/nccl-uid", epoch) }

func encodeRecord(kind byte, size int, id *libapi.UniqueID) []byte {
	out := make([]byte, 0, recLen)
	out = append(out, "FTN1"...)
	out = append(out, kind)
	out = binary.BigEndian.AppendUint32(out, uint32(size))
	return append(out, id[:]...)
}

func decodeRecord(v []byte) (kind byte, size int, id libapi.UniqueID, err error) {
	if len(v) != recLen || string(v[:4]) != "FTN1" || (v[4] != recInit && v[4] != recGrow) {
		return 0, 0, id, fmt.Errorf("nccl: %w: the rendezvous key does not hold an ftcomm NCCL id (%d bytes)", comm.ErrMismatch, len(v))
	}
	copy(id[:], v[9:])
	return v[4], int(binary.BigEndian.Uint32(v[5:9])), id, nil
}

// rendezvous creates the NCCL comm of (rank, size) at epoch: rank 0 makes a
// unique id and publishes it; the others read it and join, by init or, if
// the record says so, as joiners of a native Grow.
func (b *Backend) rendezvous(ctx context.Context, rank, size int, epoch uint64) (libapi.Comm, error) {
	t0 := time.Now()
	kind, id, err := b.exchangeID(ctx, uidKey(epoch), rank, size, epoch)
	if err != nil {
		return 0, err
	}
	if kind == recGrow {
		return b.joinGrow(ctx, rank, size, &id)
	}
	h, call, err := b.initRank(ctx, &id, rank, size, t0)
	if b.made.How == "" {
		b.made.How = "ncclCommInitRankConfig"
	}
	b.made.Call, b.made.Ready = call, time.Since(t0)-call
	return h, err
}

// exchangeID gives every rank the unique id of a new comm of size ranks:
// rank 0 makes it and publishes it at key (under the Store's prefix);
// the others wait for it there.
func (b *Backend) exchangeID(ctx context.Context, key string, rank, size int, epoch uint64) (kind byte, id libapi.UniqueID, err error) {
	if rank == 0 {
		if r := b.lib.GetUniqueID(&id); r != libapi.Success {
			return 0, id, b.ncclError(0, "ncclGetUniqueId", r)
		}
		if size > 1 {
			if b.store == nil {
				return 0, id, fmt.Errorf("nccl: %w: size %d needs a Store", comm.ErrInvalidArgument, size)
			}
			if err := b.store.Set(ctx, key, encodeRecord(recInit, size, &id)); err != nil {
				return 0, id, fmt.Errorf("nccl: publish unique id: %w", err)
			}
		}
		return recInit, id, nil
	}
	if b.store == nil {
		return 0, id, fmt.Errorf("nccl: %w: size %d needs a Store", comm.ErrInvalidArgument, size)
	}
	v, err := b.store.Get(ctx, key)
	if err != nil {
		return 0, id, fmt.Errorf("nccl: %w: wait for rank 0's unique id: %w", comm.ErrTimeout, err)
	}
	var n int
	if kind, n, id, err = decodeRecord(v); err != nil {
		return 0, id, err
	}
	if n != size {
		return 0, id, fmt.Errorf("nccl: %w: rank 0 created a comm of %d ranks at epoch %d, this rank expects %d", comm.ErrMismatch, n, epoch, size)
	}
	return kind, id, nil
}

// initRank joins the comm of id as rank of size with
// ncclCommInitRankConfig (blocking as the control comm is) and waits until
// it is ready; call is from t0 until the call returned.
func (b *Backend) initRank(ctx context.Context, id *libapi.UniqueID, rank, size int, t0 time.Time) (h libapi.Comm, call time.Duration, err error) {
	// The cell (handle and config) lives until init is over: NCCL 2.18+
	// fills and reads them before returning, older ones from their job.
	cell := b.lib.NewCell()
	r := b.lib.CommInitRank(b.dev, cell, size, id, rank, libapi.CommConfig{Blocking: b.ctlBlocking})
	call = time.Since(t0)
	h = b.lib.LoadCell(cell)
	if r != libapi.Success && r != libapi.InProgress {
		if h != 0 {
			b.lib.CommAbort(h)
		}
		b.lib.FreeCell(cell)
		return 0, call, b.ncclError(0, "ncclCommInitRankConfig", r)
	}
	if h == 0 {
		b.lib.FreeCell(cell)
		return 0, call, fmt.Errorf("nccl: %w: ncclCommInitRankConfig returned no comm", comm.ErrAborted)
	}
	h, err = b.awaitComm(ctx, h, "ncclCommInitRankConfig")
	b.lib.FreeCell(cell)
	return h, call, err
}

// awaitComm waits until a new comm has finished initialising. If it fails
// or ctx ends first, the comm is aborted.
func (b *Backend) awaitComm(ctx context.Context, h libapi.Comm, what string) (libapi.Comm, error) {
	st := b.pollAsync(ctx, h, nil)
	if st == libapi.Success {
		return h, nil
	}
	var err error
	if st == libapi.InProgress {
		err = ctxError(ctx, what+" did not finish")
	} else {
		err = b.ncclError(h, what, st)
	}
	b.lib.CommAbort(h)
	return 0, err
}

// awaitChild waits for a comm that NCCL creates from the parent h (Shrink,
// Grow, Split, the data comm): the new comm appears in cell only when the
// parent's job has finished, so the parent is polled first. Called with
// hmu held. If ctx ends (or the Backend is closed) while NCCL may still
// write the cell, the cell is leaked rather than freed under it, and the
// parent stays in progress until it is aborted (Close does that; the
// abort also stops the child's initialisation).
func (b *Backend) awaitChild(ctx context.Context, h libapi.Comm, cell libapi.Cell, what string, r libapi.Result) (libapi.Comm, error) {
	if r != libapi.Success && r != libapi.InProgress {
		b.lib.FreeCell(cell)
		return 0, b.ncclError(h, what, r)
	}
	switch st := b.pollAsync(ctx, h, b.closing); st {
	case libapi.Success:
	case libapi.InProgress:
		if ctx.Err() == nil {
			return 0, fmt.Errorf("nccl: %w: %s abandoned: the comm was closed", comm.ErrClosed, what)
		}
		return 0, ctxError(ctx, what+" did not finish")
	default:
		b.lib.FreeCell(cell)
		return 0, b.ncclError(h, what, st)
	}
	nh := b.lib.LoadCell(cell)
	b.lib.FreeCell(cell)
	if nh == 0 {
		return 0, nil
	}
	return b.awaitComm(ctx, nh, what)
}

// child makes the Backend of a comm created by Shrink, Grow or Split;
// mk is how it was made so far (a fresh init's phases are added here).
// With ordered (a Shrink's) the new comm's stream waits on the GPU for
// everything this comm's stream holds (orderAfter).
func (b *Backend) child(ctx context.Context, o comm.Options, rank, size int, epoch uint64, h libapi.Comm, mk Creation, ordered bool) (*Backend, error) {
	nb, err := newBackend(b.L, b.cfg, o, rank, size, epoch)
	if err == nil && ordered {
		if err = b.orderAfter(nb); err != nil {
			nb.discard()
		}
	}
	if err != nil {
		if h != 0 {
			b.lib.CommAbort(h)
		}
		return nil, err
	}
	nb.made = mk
	if h == 0 {
		if h, err = nb.rendezvous(ctx, rank, size, epoch); err != nil {
			nb.discard()
			return nil, err
		}
	}
	if err := nb.start(ctx, h); err != nil {
		nb.discard()
		return nil, err
	}
	return nb, nil
}

// Shrink implements comm.Shrinker. To one rank it makes no NCCL comm
// (shrinkToLocal, unless Config.DisableLocalOneRank). With ncclCommShrink
// (NCCL 2.27.3+) at every survivor and no survivor's NCCL comm aborted
// yet, the survivors shrink the NCCL comm itself, passing
// NCCL_SHRINK_ABORT when this comm has failed (it cancels the parent's
// outstanding GPU work); otherwise they initialise a fresh comm with a new
// unique id published under the new epoch. They agree without a vote
// (nativeShrinkUnlessRefused). In ModeBlockingData the native shrink's
// child is the survivors' blocking data comm, and their control comm is
// made in the background (dataChild). The new comm's stream waits on the
// GPU for everything this comm's stream holds, and after a failure this
// comm's NCCL comms are aborted meanwhile, so no work of the old comm
// runs beside the new one's. The new comm is warmed up before it is
// returned. The old one is released when closed.
func (b *Backend) Shrink(ctx context.Context, exclude []int, epoch uint64) (comm.Backend, error) {
	if len(exclude) == 0 || !slices.IsSorted(exclude) || exclude[0] < 0 || exclude[len(exclude)-1] >= b.size ||
		slices.Contains(exclude, b.rank) || len(slices.Compact(slices.Clone(exclude))) != len(exclude) {
		return nil, fmt.Errorf("nccl: %w: shrink: exclude %v (rank %d of %d)", comm.ErrInvalidArgument, exclude, b.rank, b.size)
	}
	newRank := b.rank
	for _, e := range exclude {
		if e < b.rank {
			newRank--
		}
	}
	newSize := b.size - len(exclude)
	t0 := time.Now()
	if newSize == 1 && !b.cfg.DisableLocalOneRank {
		nb, err := b.shrinkToLocal(epoch)
		if err != nil {
			return nil, fmt.Errorf("nccl: shrink to one rank: %w", err)
		}
		nb.made.Total = time.Since(t0)
		nb.logCreation("shrunk", zap.Ints("exclude", exclude), zap.Int("new_rank", 0), zap.Int("new_size", 1))
		return nb, nil
	}
	var h libapi.Comm
	mk := Creation{How: "fresh init"}
	if newSize > 1 && b.store == nil {
		return nil, fmt.Errorf("nccl: %w: %d ranks reconfiguring need a Store", comm.ErrInvalidArgument, newSize)
	}
	dataFirst := separateData(b.cfg.Mode, newSize) && !b.cfg.DisableShrinkToData
	if b.L.info.Features.Shrink && !b.cfg.DisableNativeShrink && b.holdsComm() {
		cfg := libapi.ChildConfig{Inherit: true}
		if dataFirst {
			cfg = libapi.ChildConfig{Blocking: true}
		}
		var err error
		h, mk.How, mk.Call, mk.Ready, err = b.nativeShrinkUnlessRefused(ctx, exclude, epoch, newSize, cfg)
		if err != nil {
			return nil, fmt.Errorf("nccl: shrink to %d ranks: %w", newSize, err)
		}
		if h == 0 {
			mk = Creation{How: "fresh init", Agree: time.Since(t0)}
		}
	} else if newSize == 1 {
		// Alone: nobody to tell.
	} else if err := b.store.Set(ctx, freshKey(epoch), []byte{'1'}); err != nil {
		return nil, fmt.Errorf("nccl: shrink to %d ranks: tell the others this rank cannot shrink natively: %w", newSize, err)
	}
	b.retireAfterFailure()
	var nb *Backend
	var err error
	if h != 0 && dataFirst {
		mk.How += " → data comm"
		nb, err = b.dataChild(ctx, newRank, newSize, epoch, h, mk)
	} else {
		nb, err = b.child(ctx, b.opts, newRank, newSize, epoch, h, mk, true)
	}
	if err != nil {
		return nil, fmt.Errorf("nccl: shrink to %d ranks (%s): %w", newSize, mk.How, err)
	}
	nb.made.Total = time.Since(t0)
	nb.logCreation("shrunk", zap.Ints("exclude", exclude), zap.Int("new_rank", newRank), zap.Int("new_size", newSize))
	return nb, nil
}

// retireAfterFailure hands this comm's NCCL comms to the watchdog to be
// aborted, if the comm has failed: the abort flag ends a kernel waiting
// for a dead peer, so the old stream drains and the shrunk comm's stream,
// ordered after it, can run. After a native shrink that is the shrunk
// parent, which its child does not need (it shares no resources with it,
// TestGPUNCCLAbortParentKeepsChild); NCCL_SHRINK_ABORT has ended the
// parent's own kernels already. A comm that has not failed keeps its
// NCCL comms until Close.
func (b *Backend) retireAfterFailure() {
	if b.failed.Load() {
		b.retire()
	}
}

// retire hands this comm's NCCL comms to the watchdog to be aborted.
func (b *Backend) retire() {
	b.hmu.Lock()
	hs := b.handles()
	b.ctl, b.data = 0, 0
	b.hmu.Unlock()
	for _, h := range hs { // at most two ever, and abortQ has room for two
		b.abortQ <- h
	}
}

// ctlKey, under <Prefix>/epoch/<e>/, holds the unique id of the control
// comm that a shrink's data comm gets in the background (dataChild).
func ctlKey(epoch uint64) string { return fmt.Sprintf("epoch/%d/nccl-ctl-uid", epoch) }

// dataChild makes the Backend of a native shrink whose child h is the
// blocking data comm (ncclCommShrink of the nonblocking control comm with
// a config that says blocking = 1; the call itself stays nonblocking, as
// it follows the parent). Its collectives run at once: the shrink
// connected every algorithm while it made the child (eager connection).
// What only the control comm does (point-to-point ops, the next Shrink,
// Split) waits for it: a fresh nonblocking init among the survivors,
// with a unique id rank 0 publishes at ctlKey, made in the background
// (makeControl). So a shrink makes one comm on the survivors' way where
// it made two, one after the other (the data comm was split off the
// shrunk control comm), and each connected every algorithm.
func (b *Backend) dataChild(ctx context.Context, rank, size int, epoch uint64, h libapi.Comm, mk Creation) (*Backend, error) {
	nb, err := newBackend(b.L, b.cfg, b.opts, rank, size, epoch)
	if err == nil {
		if err = b.orderAfter(nb); err != nil {
			nb.discard()
		}
	}
	if err != nil {
		b.lib.CommAbort(h)
		return nil, err
	}
	nb.made = mk
	nb.data = h
	nb.ctlDone = make(chan struct{})
	nb.started = true
	go nb.watchdog()
	go nb.makeControl()
	t1 := time.Now()
	if !nb.cfg.NoWarmUp {
		if err := nb.allReduceScratch(ctx); err != nil {
			nb.discard()
			return nil, fmt.Errorf("warm-up: %w", err)
		}
	}
	nb.made.WarmUp = time.Since(t1)
	return nb, nil
}

// makeControl makes the control comm of a comm that a shrink made with
// its data comm only (dataChild), and closes ctlDone. It gives up when
// the comm fails or is closed meanwhile (a second failure during the
// recovery: the next Shrink then initialises fresh, since this rank holds
// no control comm). If it cannot make the comm otherwise, the comm fails
// with the reason: it could not run point-to-point ops or reconfigure.
func (b *Backend) makeControl() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-b.closing:
		case <-b.wake:
		case <-ctx.Done():
		}
		cancel()
	}()
	t0 := time.Now()
	h, err := b.initControl(ctx)
	b.hmu.Lock()
	if err == nil {
		if b.failed.Load() {
			err = b.failure()
		} else {
			b.ctl, h = h, 0
		}
	}
	b.hmu.Unlock()
	if h != 0 {
		b.lib.CommAbort(h)
	}
	b.ctlErr, b.ctlTook = err, time.Since(t0)
	close(b.ctlDone)
	switch {
	case err == nil:
		b.log.Info("control comm ready", zap.Duration("took", b.ctlTook))
	case b.failed.Load():
		b.log.Info("control comm abandoned: the comm failed or was closed", zap.Error(err), zap.Duration("after", b.ctlTook))
	default:
		err = fmt.Errorf("nccl: the control comm could not be made: %w", err)
		if b.fail(err) {
			b.log.Warn("control comm failed", zap.Error(err))
		}
	}
}

// initControl is makeControl's init: a comm of this comm's ranks through
// the unique id at ctlKey.
func (b *Backend) initControl(ctx context.Context) (libapi.Comm, error) {
	if hold := b.cfg.holdControl; hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return 0, ctxError(ctx, "control comm held by a test")
		}
	}
	_, id, err := b.exchangeID(ctx, ctlKey(b.epoch), b.rank, b.size, b.epoch)
	if err != nil {
		return 0, err
	}
	h, _, err := b.initRank(ctx, &id, b.rank, b.size, time.Now())
	return h, err
}

// awaitControl waits until a control comm being made in the background
// (dataChild) is there; it returns at once on any other comm.
func (b *Backend) awaitControl(ctx context.Context) error {
	select {
	case <-b.ctlDone:
		return nil
	default:
	}
	select {
	case <-b.ctlDone:
		return nil
	case <-b.wake:
		return b.failure()
	case <-ctx.Done():
		return ctxError(ctx, "the control comm is still being made")
	}
}

// localHow is Creation.How of a local one-rank comm.
const localHow = "one rank: device copies, no NCCL comm"

// shrinkToLocal makes the comm that a shrink leaves a lone survivor
// without NCCL (Backend.local): a new stream that waits, on the GPU, for
// everything this comm's stream holds, and ops that are device copies on
// it. After a failure this comm's NCCL comms go to the watchdog to be
// aborted: the abort flag ends a kernel waiting for a dead peer, the old
// stream then drains, and only then does the new stream run, so no work
// of the old comm can touch a buffer after the survivor's next op begins.
// Nothing on the survivor's way waits for NCCL: no ncclCommShrink (with
// NCCL_SHRINK_ABORT it synchronises the old stream on the host, then
// initialises a child: 50–230 ms on an H100 or H200) and no vote.
// Without a failure the old comms stay as they are until Close.
func (b *Backend) shrinkToLocal(epoch uint64) (*Backend, error) {
	nb, err := b.localChild(b.opts, epoch)
	if err != nil {
		return nil, err
	}
	b.retireAfterFailure()
	return nb, nil
}

// localChild makes a local one-rank comm (Backend.local) with options o
// at epoch, its stream ordered after this comm's, its watchdog running.
func (b *Backend) localChild(o comm.Options, epoch uint64) (*Backend, error) {
	nb, err := newBackend(b.L, b.cfg, o, 0, 1, epoch)
	if err != nil {
		return nil, err
	}
	nb.local = true
	if err := b.orderAfter(nb); err != nil {
		nb.discard()
		return nil, err
	}
	nb.made = Creation{How: localHow}
	nb.started = true
	go nb.watchdog()
	return nb, nil
}

// orderAfter makes nb's stream wait, on the GPU, for the work this
// comm's stream holds now.
func (b *Backend) orderAfter(nb *Backend) error {
	ev, err := b.lib.EventCreate(b.dev, false)
	if err != nil {
		return fmt.Errorf("nccl: %w: %w", comm.ErrBackendUnavailable, err)
	}
	defer b.lib.EventDestroy(b.dev, ev) // CUDA releases it once the wait is over
	if err := b.lib.EventRecord(b.dev, ev, b.stream); err != nil {
		return fmt.Errorf("nccl: %w: %w", comm.ErrAborted, err)
	}
	if err := b.lib.StreamWaitEvent(nb.dev, nb.stream, ev); err != nil {
		return fmt.Errorf("nccl: %w: %w", comm.ErrAborted, err)
	}
	return nil
}

// freshKey, under <Prefix>/epoch/<e>/, is set by a survivor that cannot
// shrink natively (its NCCL has no ncclCommShrink, its configuration
// forbids it, or its comm was aborted): every survivor then initialises
// a fresh comm.
func freshKey(epoch uint64) string { return fmt.Sprintf("epoch/%d/nccl-fresh", epoch) }

// errShrinkRefused ends a native shrink that another survivor cannot join.
var errShrinkRefused = errors.New("a survivor cannot shrink natively")

// nativeShrinkUnlessRefused shrinks natively at once, with no vote: a
// survivor that cannot says so at freshKey, and this rank, watching that
// key while it waits for the shrink, abandons it (abortComms: the abort
// of the parent ends the child's initialisation) and returns h = 0 for a
// fresh init. The shrink cannot have completed at any survivor by then:
// NCCL's child comm forms only once every new rank has called
// ncclCommShrink, and the refusing one never does. So the survivors agree
// without a Store round trip where all of them can (the vote of
// agreeNative cost 53–101 ms at 3 and 4 ranks on 4× H200), and
// initialise a fresh comm together where one cannot.
func (b *Backend) nativeShrinkUnlessRefused(ctx context.Context, exclude []int, epoch uint64, size int, cfg libapi.ChildConfig) (h libapi.Comm, how string, call, ready time.Duration, err error) {
	if size == 1 {
		return b.nativeShrink(ctx, exclude, cfg)
	}
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	refused := make(chan struct{})
	go func() {
		if _, err := b.store.Get(sctx, freshKey(epoch)); err == nil {
			close(refused)
			cancel(errShrinkRefused)
		}
	}()
	h, how, call, ready, err = b.nativeShrink(sctx, exclude, cfg)
	if err != nil && isClosed(refused) { // a failed nativeShrink returns no comm
		// The abort of the parent (the watchdog's) ends the child's
		// initialisation.
		b.log.Info("a survivor cannot shrink natively: the survivors initialise a fresh comm")
		b.retire()
		return 0, how, call, ready, nil
	}
	return h, how, call, ready, err
}

// nativeShrink runs ncclCommShrink on this comm. call is how long the
// call itself took: with NCCL_SHRINK_ABORT it raises the comm's abort
// flags and synchronises its device stream before it starts the child's
// initialisation as the comm's job (ncclCommShrink, src/init.cc).
func (b *Backend) nativeShrink(ctx context.Context, exclude []int, cfg libapi.ChildConfig) (h libapi.Comm, mode string, call, ready time.Duration, err error) {
	b.hmu.Lock()
	defer b.hmu.Unlock()
	h = b.ctl
	if h == 0 {
		// Aborted since this rank said it could shrink natively: the
		// others' shrink fails with the comm's Timeout, as for any rank
		// lost during one.
		return 0, "ncclCommShrink", 0, 0, b.failure()
	}
	flags := libapi.ShrinkDefault
	mode = "ncclCommShrink"
	ownKernels := b.data == h // no separate data comm: the abort below ends every kernel of this Backend
	if b.failed.Load() && !b.quiescent {
		flags, mode = libapi.ShrinkAbort, "ncclCommShrink(NCCL_SHRINK_ABORT)"
		// NCCL_SHRINK_ABORT stops the control comm's kernels; a separate
		// data comm's are its own: the watchdog aborts it meanwhile.
		if d := b.data; d != 0 && d != h {
			b.data = 0
			b.abortQ <- d // room for one, and there is at most one data comm
		}
	}
	ex := make([]int32, len(exclude))
	for i, e := range exclude {
		ex[i] = int32(e)
	}
	cell := b.lib.NewCell()
	t0 := time.Now()
	r := b.lib.CommShrink(h, ex, cell, cfg, flags)
	call = time.Since(t0)
	nh, err := b.awaitChild(ctx, h, cell, mode, r)
	ready = time.Since(t0) - call
	if err != nil {
		return 0, mode, call, ready, err
	}
	if nh == 0 {
		return 0, mode, call, ready, fmt.Errorf("nccl: %w: %s finished without a new comm", comm.ErrAborted, mode)
	}
	if flags == libapi.ShrinkAbort && ownKernels {
		b.dirty.Store(false) // the parent's kernels were terminated
	}
	return nh, mode, call, ready, nil
}

// Grow implements comm.Grower. With ncclCommGrow (NCCL 2.29.2+) and a
// healthy comm at every existing rank (they agree on it through the Store
// first, see agreeNative), rank 0 publishes an id from ncclCommGetUniqueId and every
// rank grows the NCCL comm; otherwise rank 0 publishes a fresh unique id
// and existing ranks and joiners initialise a new comm together. Joiners
// call New with their rank, the new size and epoch; they learn which way
// from the published record.
func (b *Backend) Grow(ctx context.Context, size int, epoch uint64) (comm.Backend, error) {
	if size <= b.size {
		return nil, fmt.Errorf("nccl: %w: grow to %d ranks from %d", comm.ErrInvalidArgument, size, b.size)
	}
	t0 := time.Now()
	var h libapi.Comm
	mk := Creation{How: "fresh init"}
	native := false
	if b.L.info.Features.Grow {
		// Without ncclCommGrow in this rank's NCCL, no rank has it (the
		// ranks of a comm run one NCCL version: NCCL refuses to initialise
		// otherwise), so every one initialises fresh and there is nothing
		// to vote on.
		var err error
		native, err = b.agreeNative(ctx, epoch, b.rank, b.size,
			!b.cfg.DisableNativeGrow && !b.failed.Load() && b.holdsComm())
		if err != nil {
			return nil, fmt.Errorf("nccl: grow to %d ranks: %w", size, err)
		}
	}
	mk.Agree = time.Since(t0)
	if native {
		mk.How = "ncclCommGrow"
		t1 := time.Now()
		var err error
		if h, err = b.nativeGrow(ctx, size, epoch); err != nil {
			return nil, fmt.Errorf("nccl: grow to %d ranks: %w", size, err)
		}
		mk.Ready = time.Since(t1)
	}
	nb, err := b.child(ctx, b.opts, b.rank, size, epoch, h, mk, false)
	if err != nil {
		return nil, fmt.Errorf("nccl: grow to %d ranks (%s): %w", size, mk.How, err)
	}
	nb.made.Total = time.Since(t0)
	nb.logCreation("grown")
	return nb, nil
}

// holdsComm says whether this rank still has its NCCL comm (not aborted).
func (b *Backend) holdsComm() bool {
	b.hmu.Lock()
	defer b.hmu.Unlock()
	return b.ctl != 0
}

// Keys of agreeNative under <Prefix>/epoch/<e>/: each holder's "can" and
// rank 0's decision, one byte each ('1' native, '0' fresh init).
func nativeVoteKey(epoch uint64, rank int) string {
	return fmt.Sprintf("epoch/%d/nccl-native/%d", epoch, rank)
}
func nativeKey(epoch uint64) string { return fmt.Sprintf("epoch/%d/nccl-native", epoch) }

// agreeNative decides, together with the other ranks that hold this comm
// into the new one (new ranks 0 to holders-1), between NCCL's native
// shrink or grow and a fresh init: every holder says whether it can (the
// NCCL version has the call, the configuration allows it, its comm is
// alive and, for grow, healthy); new rank 0 decides native only if all
// can, and publishes it; all follow. A rank that chose alone could call
// ncclCommGrow while its peers initialise a fresh comm, each waiting for
// the other until the Timeout.
func (b *Backend) agreeNative(ctx context.Context, epoch uint64, rank, holders int, can bool) (bool, error) {
	if holders == 1 {
		return can, nil
	}
	if b.store == nil {
		return false, fmt.Errorf("nccl: %w: %d ranks reconfiguring need a Store", comm.ErrInvalidArgument, holders)
	}
	vote := func(yes bool) []byte {
		if yes {
			return []byte{'1'}
		}
		return []byte{'0'}
	}
	parse := func(v []byte, what string) (bool, error) {
		if len(v) != 1 || (v[0] != '0' && v[0] != '1') {
			return false, fmt.Errorf("nccl: %w: %s is not an ftcomm vote (%d bytes)", comm.ErrMismatch, what, len(v))
		}
		return v[0] == '1', nil
	}
	if rank != 0 {
		if err := b.store.Set(ctx, nativeVoteKey(epoch, rank), vote(can)); err != nil {
			return false, fmt.Errorf("nccl: publish whether rank %d can reconfigure natively: %w", rank, err)
		}
		v, err := b.store.Get(ctx, nativeKey(epoch))
		if err != nil {
			return false, fmt.Errorf("nccl: %w: wait for rank 0's choice of native or fresh: %w", comm.ErrTimeout, err)
		}
		return parse(v, "rank 0's choice")
	}
	all := can
	if all {
		// Read the votes in parallel: n-1 round trips to the Store would
		// add up on a large comm.
		sem := make(chan struct{}, 32)
		errs := make([]error, holders)
		yes := make([]bool, holders)
		var wg sync.WaitGroup
		for r := 1; r < holders; r++ {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				v, err := b.store.Get(ctx, nativeVoteKey(epoch, r))
				if err != nil {
					errs[r] = fmt.Errorf("nccl: %w: wait for rank %d's vote on native or fresh: %w", comm.ErrTimeout, r, err)
					return
				}
				yes[r], errs[r] = parse(v, fmt.Sprintf("rank %d's vote", r))
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return false, err
		}
		for r := 1; r < holders; r++ {
			all = all && yes[r]
		}
	}
	if err := b.store.Set(ctx, nativeKey(epoch), vote(all)); err != nil {
		return false, fmt.Errorf("nccl: publish the choice of native or fresh: %w", err)
	}
	return all, nil
}

func (b *Backend) nativeGrow(ctx context.Context, size int, epoch uint64) (libapi.Comm, error) {
	b.hmu.Lock()
	defer b.hmu.Unlock()
	h := b.ctl
	if h == 0 {
		return 0, b.failure()
	}
	var idp *libapi.UniqueID
	if b.rank == 0 {
		var id libapi.UniqueID
		r := b.lib.CommGetUniqueID(h, &id)
		if r == libapi.Success || r == libapi.InProgress {
			r = b.pollAsync(ctx, h, nil)
		}
		if r != libapi.Success {
			return 0, b.ncclError(h, "ncclCommGetUniqueId", r)
		}
		if b.store == nil {
			return 0, fmt.Errorf("nccl: %w: grow needs a Store", comm.ErrInvalidArgument)
		}
		if err := b.store.Set(ctx, uidKey(epoch), encodeRecord(recGrow, size, &id)); err != nil {
			return 0, fmt.Errorf("nccl: publish grow id: %w", err)
		}
		idp = &id
	}
	cell := b.lib.NewCell()
	r := b.lib.CommGrow(b.dev, h, size, idp, -1, cell, libapi.CommConfig{})
	nh, err := b.awaitChild(ctx, h, cell, "ncclCommGrow", r)
	if err == nil && nh == 0 {
		err = fmt.Errorf("nccl: %w: ncclCommGrow finished without a new comm", comm.ErrAborted)
	}
	return nh, err
}

// joinGrow is a joiner's side of a native Grow.
func (b *Backend) joinGrow(ctx context.Context, rank, size int, id *libapi.UniqueID) (libapi.Comm, error) {
	cell := b.lib.NewCell()
	r := b.lib.CommGrow(b.dev, 0, size, id, rank, cell, libapi.CommConfig{Blocking: b.ctlBlocking})
	if r != libapi.Success && r != libapi.InProgress {
		b.lib.FreeCell(cell)
		return 0, b.ncclError(0, "ncclCommGrow (joiner)", r)
	}
	var h libapi.Comm
	err := pollDone(ctx, nil, func() (bool, error) {
		h = b.lib.LoadCell(cell)
		return h != 0, nil
	})
	if err != nil {
		return 0, ctxError(ctx, "ncclCommGrow (joiner) produced no comm") // the cell is leaked: NCCL may still write it
	}
	b.lib.FreeCell(cell)
	return b.awaitComm(ctx, h, "ncclCommGrow (joiner)")
}

// Split implements comm.Splitter with ncclCommSplit. The new comms keep
// this comm's epoch; their Store keys live under Prefix/split<n>-<color>.
func (b *Backend) Split(ctx context.Context, color, key int) (comm.Backend, error) {
	if !b.L.info.Features.Split {
		return nil, fmt.Errorf("nccl: %w: NCCL %s has no ncclCommSplit", comm.ErrBackendUnavailable, b.L.info.NCCL)
	}
	if color < comm.NoColor {
		return nil, fmt.Errorf("nccl: %w: split color %d", comm.ErrInvalidArgument, color)
	}
	if err := b.usable(); err != nil {
		return nil, err
	}
	t0 := time.Now()
	if b.local {
		return b.splitLocal(color, t0)
	}
	if err := b.awaitControl(ctx); err != nil {
		return nil, err
	}
	nh, n, err := b.split(ctx, color, key)
	if err != nil || nh == 0 {
		return nil, err
	}
	cnt, r := b.lib.CommCount(nh)
	rank, r2 := b.lib.CommUserRank(nh)
	if r != libapi.Success || r2 != libapi.Success {
		b.lib.CommAbort(nh)
		return nil, fmt.Errorf("nccl: %w: split: ncclCommCount %s, ncclCommUserRank %s", comm.ErrAborted, r, r2)
	}
	o := b.opts
	o.Prefix = fmt.Sprintf("%s/split%d-%d", b.opts.Prefix, n, color)
	nb, err := b.child(ctx, o, rank, cnt, b.epoch, nh, Creation{How: "ncclCommSplit", Ready: time.Since(t0)}, false)
	if err == nil {
		nb.made.Total = time.Since(t0)
	}
	return nb, err
}

func (b *Backend) split(ctx context.Context, color, key int) (libapi.Comm, int, error) {
	b.hmu.Lock()
	defer b.hmu.Unlock()
	h := b.ctl
	if h == 0 {
		return 0, 0, b.failure()
	}
	b.splits++
	cell := b.lib.NewCell()
	r := b.lib.CommSplit(h, color, key, cell, libapi.ChildConfig{Inherit: true})
	nh, err := b.awaitChild(ctx, h, cell, "ncclCommSplit", r)
	if err != nil {
		err = fmt.Errorf("nccl: split (color %d): %w", color, err)
		if errors.Is(err, comm.ErrTimeout) || b.failed.Load() {
			b.fail(err)
		}
		return 0, 0, err
	}
	if color == comm.NoColor && nh != 0 {
		b.lib.CommAbort(nh)
		nh = 0
	}
	return nh, b.splits, nil
}

// splitLocal splits a local one-rank comm: NoColor leaves it out (nil),
// any color gives a local one-rank comm ordered after this one's stream.
func (b *Backend) splitLocal(color int, t0 time.Time) (comm.Backend, error) {
	b.hmu.Lock()
	b.splits++
	b.hmu.Unlock()
	if color == comm.NoColor {
		return nil, nil
	}
	o := b.opts
	o.Prefix = fmt.Sprintf("%s/split%d-%d", b.opts.Prefix, b.splits, color)
	nb, err := b.localChild(o, b.epoch)
	if err != nil {
		return nil, err
	}
	nb.made.Total = time.Since(t0)
	return nb, nil
}
