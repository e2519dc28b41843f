package ft

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/recovery"
)

// Peer snapshots (Config.SnapshotEvery): fault tolerance for a replica
// group whose shards have no live copy elsewhere — an FSDP job whose one
// group spans every GPU. See the package doc, "Peer snapshots", and
// docs/snapshots.md.
//
// Every K committed steps (at the start of the step after a committed step
// s with s % K == 0, while the registered state is the committed state of s
// and nobody writes it) each rank copies its registered state into a host
// buffer of its own (in the background; Commit waits for the copy before
// the optimizer may write), serves it, and pulls its source rank's copy of
// the same step into a second host buffer: rank b is the buddy of source r
// (buddies), on another host where the group spans hosts. A snapshot is
// complete once every rank holds its source's copy: the group learns it in
// its commit vote (one more int64 in the same all-reduce, a min). Each rank
// keeps at most two copies of each kind — the newest complete one and the
// one being taken — so snapshot memory is at most twice the rank's state
// plus twice its source's.
//
// At every reconfiguration of the group (in place of the group's step
// check) the ranks all-gather what they hold (snapInventory). When their
// steps agree, nothing is restored. When they differ — a restarted process
// or a spare holds nothing, or the group's vote completed at some ranks
// only — decideRestore picks the newest snapshot, up to the newest known
// complete, of which every slot has a copy (its own, or its buddy's of a rank that holds nothing),
// and every rank writes that copy into its registered state before the
// step starts: the replacement restores the dead rank's shard, the others
// roll back to the same step. No copy, no restore: a *SnapshotLostError at
// every rank, before anything was written.

// snapshotBlob is the one blob a snapshot server serves: a rank's
// registered state, concatenated in registration order.
const snapshotBlob = "ftcomm.snapshot"

// snapCopy is one copy of a rank's registered state at a snapshot step.
type snapCopy struct {
	step   int64
	slot   int    // the group rank whose state it is
	meta   []byte // layout fingerprint (8 bytes) + encoded history
	buf    []byte
	done   bool // every byte in place
	served bool // offered by a server (withdraw before reuse)
}

// peerSnapshots is a rank's peer-snapshot store. Its fields are guarded by mu;
// the driver calls it from its goroutine and from tasks.
type peerSnapshots struct {
	every int64
	rank  int // this rank's slot (group rank)
	host  string
	log   *zap.Logger
	fc    recovery.FetchConfig
	met   *metrics

	ownSrv  *recovery.Server // serves this rank's newest own copy (for its buddy)
	heldSrv *recovery.Server // serves a held copy during a restore

	ctx    context.Context // ends at close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu       sync.Mutex
	own      []*snapCopy // at most 2: complete and pending
	held     []*snapCopy // at most 2, of source's slot
	complete int64       // newest step known complete; -1: none
	source   int         // the slot whose copies this rank pulls; -1: unknown
	srcAddr  string
	copying  chan struct{} // closed when the own copy in flight is in place
	fetching context.CancelFunc
	free     map[*[]*snapCopy]*snapCopy // per list, a buffer for the next copy
	latest   int64                      // the newest snapshot step taken (-1: none); pending while > complete
	dirty    bool                       // a restore wrote the registered state and did not complete
	skipping bool                       // logged that snapshot steps are skipped
	testHook func(phase string)         // tests: called at points of a restore; nil in a job
}

func newSnapshots(cfg Config, log *zap.Logger, met *metrics) (*peerSnapshots, error) {
	sc := recovery.ServerConfig{Job: cfg.Job, Secret: cfg.Secret, ListenAddr: cfg.RecoveryAddr, Logger: log}
	own, err := recovery.NewServer(sc)
	if err != nil {
		return nil, fmt.Errorf("ft: snapshot server: %w", err)
	}
	held, err := recovery.NewServer(sc)
	if err != nil {
		own.Close()
		return nil, fmt.Errorf("ft: snapshot server: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	close(done)
	p := &peerSnapshots{every: int64(cfg.SnapshotEvery), rank: cfg.GroupRank, host: cfg.Host, log: log, fc: cfg.fetchConfig(),
		met: met, ownSrv: own, heldSrv: held, ctx: ctx, cancel: cancel, complete: -1, latest: -1, source: -1, copying: done}
	p.free = map[*[]*snapCopy]*snapCopy{}
	return p, nil
}

// close stops the transfers and the servers.
func (s *peerSnapshots) close() error {
	s.cancel()
	s.mu.Lock()
	if s.fetching != nil {
		s.fetching()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return errors.Join(s.ownSrv.Close(), s.heldSrv.Close())
}

// layoutOf fingerprints the registered state's layout (names and sizes),
// so a copy is never written into state of another shape.
func layoutOf(blobs []recovery.Blob) uint64 {
	h := fnv.New64a()
	var b [8]byte
	for _, x := range blobs {
		h.Write([]byte(x.Name))
		binary.LittleEndian.PutUint64(b[:], uint64(x.Len()))
		h.Write(b[:])
	}
	return h.Sum64()
}

func stateBytes(blobs []recovery.Blob) int {
	n := 0
	for _, b := range blobs {
		n += b.Len()
	}
	return n
}

// due says whether committed step step is a snapshot step to take now:
// one at a time — while the previous snapshot is not known complete (its
// copies still travel) the group skips snapshot steps. Every rank learns
// completeness from the same votes, so the ranks skip alike.
func (s *peerSnapshots) due(step int64) bool {
	if step%s.every != 0 {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if step <= s.latest {
		return false
	}
	if s.latest > s.complete {
		if !s.skipping {
			s.skipping = true
			s.log.Info("peer snapshot: skipping snapshot steps until the pending one is complete", zap.Int64("step", step),
				zap.Int64("pending", s.latest), zap.Int64("complete", s.complete))
		}
		s.met.snapshotSkipped.Inc()
		return false
	}
	s.skipping = false
	return true
}

// take starts the snapshot of committed step step (due said so): the own
// copy in the background (waitCopied waits for it), then the pull of the
// source's copy of the same step.
func (s *peerSnapshots) take(step int64, hist []byte, blobs []recovery.Blob) {
	s.mu.Lock()
	if s.fetching != nil {
		s.fetching() // the pending pull of an older step: it will not complete now
		s.fetching = nil
	}
	copied := make(chan struct{})
	s.copying = copied
	s.latest = max(s.latest, step)
	s.mu.Unlock()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		start := time.Now()
		c, err := s.copyOwn(step, hist, blobs)
		close(copied)
		if err != nil {
			s.log.Warn("peer snapshot: copying the state failed; this snapshot will not complete", zap.Int64("step", step), zap.Error(err))
			return
		}
		s.met.snapshotSeconds.Observe(time.Since(start).Seconds())
		s.log.Debug("peer snapshot: own copy in place", zap.Int64("step", step), zap.Int("bytes", len(c.buf)), zap.Duration("took", time.Since(start)))
		s.ownSrv.OfferWithMeta(step, c.meta, []recovery.Blob{{Name: snapshotBlob, Data: c.buf}})
		s.mu.Lock()
		c.served = true
		s.mu.Unlock()
		s.pull(step)
	}()
}

// slotFor returns a copy to fill for step: the buffer of a copy that is
// not the newest complete one (withdrawn first) when one is free, else
// new memory. list is where the copy goes; the newest complete copy is
// always kept.
func (s *peerSnapshots) slotFor(list *[]*snapCopy, srv *recovery.Server, step int64, slot, size int) *snapCopy {
	s.mu.Lock()
	s.retireLocked(list, func(c *snapCopy) bool { return c.step == s.complete && c.done && c.slot == slot })
	var reuse *snapCopy
	if f := s.free[list]; f != nil && len(f.buf) == size {
		reuse, s.free[list] = f, nil
	}
	served := reuse != nil && reuse.served
	s.mu.Unlock()
	if served {
		// A reader may still be in the old copy; the new one may reuse
		// its buffer only after it left.
		srv.Withdraw(s.ctx)
	}
	c := &snapCopy{step: step, slot: slot}
	if reuse != nil {
		c.buf = reuse.buf
	} else {
		c.buf = prefaulted(size)
	}
	s.mu.Lock()
	*list = append(*list, c)
	s.updateGaugesLocked()
	s.mu.Unlock()
	return c
}

func (s *peerSnapshots) copyOwn(step int64, hist []byte, blobs []recovery.Blob) (*snapCopy, error) {
	c := s.slotFor(&s.own, s.ownSrv, step, s.rank, stateBytes(blobs))
	meta := binary.LittleEndian.AppendUint64(nil, layoutOf(blobs))
	c.meta = append(meta, hist...)
	off := 0
	for _, b := range blobs {
		n := b.Len()
		if b.Mem == nil {
			copy(c.buf[off:off+n], b.Data)
		} else if err := copyFromMemory(s.ctx, c.buf[off:off+n], b.Mem); err != nil {
			s.drop(&s.own, c)
			return nil, fmt.Errorf("%q: %w", b.Name, err)
		}
		off += n
	}
	s.mu.Lock()
	c.done = true
	s.updateGaugesLocked()
	s.mu.Unlock()
	return c, nil
}

func (s *peerSnapshots) drop(list *[]*snapCopy, c *snapCopy) {
	s.mu.Lock()
	s.retireLocked(list, func(x *snapCopy) bool { return x != c })
	s.updateGaugesLocked()
	s.mu.Unlock()
}

// retireLocked removes from list the copies keep refuses. One buffer of
// each list is kept for the next copy (memory already mapped: a fresh
// buffer costs a page fault per page on its first copy), so a rank holds
// at most two buffers of each kind.
func (s *peerSnapshots) retireLocked(list *[]*snapCopy, keep func(*snapCopy) bool) {
	*list = slices.DeleteFunc(*list, func(c *snapCopy) bool {
		if keep(c) {
			return false
		}
		if f := s.free[list]; f == nil || len(f.buf) < len(c.buf) {
			s.free[list] = c
		}
		return true
	})
}

// pull fetches the source's copy of step into a held buffer, in the
// background; a newer snapshot or a reconfiguration cancels it.
func (s *peerSnapshots) pull(step int64) {
	s.mu.Lock()
	src, addr := s.source, s.srcAddr
	if src < 0 || addr == "" || s.ctx.Err() != nil || step < s.latest {
		s.mu.Unlock()
		return
	}
	if slices.ContainsFunc(s.held, func(c *snapCopy) bool { return c.step == step && c.slot == src && c.done }) {
		s.mu.Unlock()
		return
	}
	ctx, cancel := context.WithCancel(s.ctx)
	s.fetching = cancel
	s.mu.Unlock()
	defer cancel()
	s.log.Debug("peer snapshot: pulling", zap.Int("source", src), zap.Int64("step", step))
	size, err := s.sourceSize(ctx, step, addr)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("peer snapshot: the source's copy is not available", zap.Int("source", src), zap.Int64("step", step), zap.Error(err))
		}
		return
	}
	c := s.slotFor(&s.held, s.heldSrv, step, src, size)
	st, err := recovery.Fetch(ctx, s.fc, step, []string{addr}, []recovery.Blob{{Name: snapshotBlob, Data: c.buf}})
	if err != nil {
		s.drop(&s.held, c)
		if ctx.Err() == nil {
			s.log.Warn("peer snapshot: pulling the source's copy failed", zap.Int("source", src), zap.Int64("step", step), zap.Error(err))
		}
		return
	}
	s.mu.Lock()
	c.meta, c.done = st.Meta, true
	s.updateGaugesLocked()
	s.mu.Unlock()
	s.met.snapshotPulled.Add(float64(st.Bytes))
}

// sourceSize asks addr for the size of its copy of step (the source's
// shard may be of another size than this rank's).
func (s *peerSnapshots) sourceSize(ctx context.Context, step int64, addr string) (int, error) {
	m, err := recovery.Describe(ctx, s.fc, step, addr)
	if err != nil {
		return 0, err
	}
	if len(m) != 1 || m[0].Name != snapshotBlob {
		return 0, fmt.Errorf("%w: %s serves no snapshot", comm.ErrMismatch, addr)
	}
	return m[0].Size, nil
}

// waitCopied waits until the own copy in flight is in place: the
// registered state may change after that.
func (s *peerSnapshots) waitCopied(ctx context.Context) error {
	s.mu.Lock()
	ch := s.copying
	s.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

func (s *peerSnapshots) copyInFlight() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case <-s.copying:
		return false
	default:
		return true
	}
}

// heldStep is this rank's part of the group's vote: the newest step of
// which it holds its source's complete copy (-1: none).
func (s *peerSnapshots) heldStep() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	best := int64(-1)
	for _, c := range s.held {
		if c.done && c.slot == s.source && c.step > best {
			best = c.step
		}
	}
	return best
}

// learned takes the vote's minimum: every rank holds its source's copy of
// step (a rank holds at most the complete snapshot and the pending one,
// and each reports its newest), so that snapshot is complete and older
// copies can go.
func (s *peerSnapshots) learned(step int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if step <= s.complete {
		return
	}
	s.complete = step
	current := func(c *snapCopy) bool { return c.step >= step }
	s.retireLocked(&s.own, current)
	s.retireLocked(&s.held, current)
	s.met.snapshotStep.Set(float64(step))
	s.updateGaugesLocked()
}

func (s *peerSnapshots) updateGaugesLocked() {
	var own, held int
	for _, c := range s.own {
		own += len(c.buf)
	}
	for _, c := range s.held {
		held += len(c.buf)
	}
	if f := s.free[&s.own]; f != nil {
		own += len(f.buf)
	}
	if f := s.free[&s.held]; f != nil {
		held += len(f.buf)
	}
	s.met.snapshotBytes.WithLabelValues("own").Set(float64(own))
	s.met.snapshotBytes.WithLabelValues("held").Set(float64(held))
}

func (s *peerSnapshots) inventory(step int64) snapInventory {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dirty {
		step = -1 // a restore wrote the state and did not complete: it is no step's
	}
	inv := snapInventory{Rank: s.rank, Step: step, Host: s.host, HeldSlot: -1, Complete: s.complete,
		OwnAddr: s.ownSrv.Addr(), HeldAddr: s.heldSrv.Addr()}
	for _, c := range s.own {
		if c.done {
			inv.Own = append(inv.Own, c.step)
		}
	}
	for _, c := range s.held {
		if c.done && (inv.HeldSlot < 0 || inv.HeldSlot == c.slot) {
			inv.HeldSlot = c.slot
			inv.Held = append(inv.Held, c.step)
		}
	}
	return inv
}

// settle makes the group's ranks agree again after a reconfiguration in
// which they restore nothing: a vote that completed at some ranks only
// left them knowing different complete snapshots. The newest any knows
// is held everywhere (a rank learns it only when every rank held it, and
// no rank drops a copy newer than the complete one it knows); a pending
// snapshot is dropped, and the next snapshot step starts a new one.
func (s *peerSnapshots) settle(invs []snapInventory) {
	newest := int64(-1)
	for _, in := range invs {
		newest = max(newest, in.Complete)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fetching != nil {
		s.fetching()
		s.fetching = nil
	}
	if newest > s.complete {
		s.met.snapshotStep.Set(float64(newest))
	}
	s.complete, s.latest = newest, newest
	s.retireLocked(&s.own, func(c *snapCopy) bool { return c.step == newest })
	s.retireLocked(&s.held, func(c *snapCopy) bool { return c.step == newest && c.slot == s.source })
	s.updateGaugesLocked()
}

// follow points the pulls at this rank's source under the group's current
// hosts (from an agreement's inventories).
func (s *peerSnapshots) follow(invs []snapInventory) {
	hosts := make([]string, len(invs))
	for i, in := range invs {
		hosts[i] = in.Host
	}
	bud := buddies(hosts)
	src := slices.Index(bud, s.rank)
	s.mu.Lock()
	defer s.mu.Unlock()
	if src < 0 || src >= len(invs) {
		s.source, s.srcAddr = -1, ""
		return
	}
	if s.source != src {
		if s.source >= 0 {
			s.log.Info("peer snapshot: new source", zap.Int("source", src), zap.String("host", hosts[src]))
		}
		if hosts[src] == s.host && len(slices.Compact(slices.Sorted(slices.Values(hosts)))) > 1 {
			s.log.Warn("peer snapshot: this rank's source shares its host (uneven hosts): one host's loss takes both copies",
				zap.Int("source", src), zap.String("host", s.host))
		}
	}
	s.source, s.srcAddr = src, invs[src].OwnAddr
}

// restored says what a restore did at this rank.
type restored struct {
	step  int64
	hist  history
	from  int64 // the step this rank held before
	bytes int64 // received from a buddy (0: its own copy)
	took  time.Duration
}

// restore carries out plan at this rank: it serves its held copy where a
// slot restores from it and obtains its own copy of the plan's step (from
// its buddy when it has none); once every rank of the group has its copy
// (an all-reduce on the group's control comm — a rank or holder that dies
// now fails it everywhere, and nothing has been written), it writes the
// copy into the registered state.
func (s *peerSnapshots) restore(ctx context.Context, ctl *comm.Comm, server *recovery.Server, plan restorePlan, invs []snapInventory,
	step int64, blobs []recovery.Blob) (restored, error) {
	start := time.Now()
	// The copies must hold still: no own copy in flight, no pull.
	if err := s.waitCopied(ctx); err != nil {
		return restored{}, err
	}
	s.mu.Lock()
	if s.fetching != nil {
		s.fetching()
		s.fetching = nil
	}
	var serve *snapCopy
	for r, h := range plan.From {
		if h == s.rank {
			serve = findCopy(s.held, plan.Step, r)
		}
	}
	mine := findCopy(s.own, plan.Step, s.rank)
	s.mu.Unlock()
	if serve != nil {
		s.heldSrv.OfferWithMeta(plan.Step, serve.meta, []recovery.Blob{{Name: snapshotBlob, Data: serve.buf}})
		s.mu.Lock()
		serve.served = true
		s.mu.Unlock()
	}
	res := restored{step: plan.Step, from: step}
	var hist history
	fetched := false
	err := func() error {
		meta := []byte(nil)
		if h := plan.From[s.rank]; h >= 0 {
			// This rank holds nothing of the group's run (its state has
			// no value to lose): its copy goes straight into the
			// registered state, memory already mapped (a fresh host
			// buffer would cost a page fault per page), through pinned
			// staging buffers for device state.
			if err := server.Withdraw(ctx); err != nil { // nobody reads what is written
				return err
			}
			s.mu.Lock()
			s.dirty = true // written before the barrier: worth nothing until a restore completes
			s.mu.Unlock()
			st, err := s.fetchInto(ctx, plan.Step, invs[h].HeldAddr, blobs)
			if err != nil {
				return fmt.Errorf("fetching this rank's copy of step %d from rank %d: %w", plan.Step, h, err)
			}
			res.bytes, meta, fetched = st.Bytes, st.Meta, true
			if s.testHook != nil {
				s.testHook("fetched") // tests: a death between the fetch and the barrier
			}
		} else if mine != nil {
			if len(mine.buf) != stateBytes(blobs) {
				return fmt.Errorf("%w: ft: the snapshot of slot %d (%d bytes) does not match the state registered here (%d bytes): register the same tensors on every incarnation of a slot",
					comm.ErrInvalidArgument, s.rank, len(mine.buf), stateBytes(blobs))
			}
			meta = mine.meta
		} else {
			return fmt.Errorf("ft: this rank's copy of step %d is gone", plan.Step)
		}
		if len(meta) < 8 || binary.LittleEndian.Uint64(meta) != layoutOf(blobs) {
			return fmt.Errorf("%w: ft: the snapshot of slot %d does not match the state registered here (names and sizes): register the same tensors on every incarnation of a slot",
				comm.ErrInvalidArgument, s.rank)
		}
		var err error
		if hist, err = decodeHistory(meta[8:]); err != nil {
			return fmt.Errorf("the snapshot's history: %w", err)
		}
		return nil
	}()
	// Every rank waits for every other to hold its copy: a holder keeps
	// serving until the rank restoring from it is done, and no rank
	// writes its state unless the whole group can.
	v := []int64{1}
	if err != nil {
		v[0] = 0
	}
	aerr := ctl.AllReduce(ctx, comm.Int64s(v), comm.Min)
	if serve != nil {
		s.heldSrv.Withdraw(ctx)
	}
	switch {
	case err != nil:
		return restored{}, err
	case aerr != nil:
		return restored{}, fmt.Errorf("ft: the group's restore barrier: %w", aerr)
	case v[0] == 0:
		return restored{}, errors.New("ft: another rank of the group could not obtain its copy of the snapshot")
	}
	if !fetched {
		// Nobody may read the registered state while it is written.
		if err := server.Withdraw(ctx); err != nil {
			return restored{}, err
		}
		off := 0
		for _, b := range blobs {
			n := b.Len()
			if b.Mem == nil {
				copy(b.Data, mine.buf[off:off+n])
			} else if err := copyToMemory(ctx, b.Mem, mine.buf[off:off+n]); err != nil {
				// The state is half written: this rank cannot go on.
				return restored{}, fmt.Errorf("%w: ft: writing the snapshot into %q: %v", errRestoreBroken, b.Name, err)
			}
			off += n
		}
	}
	res.hist = hist
	// The restored step is the group's newest complete snapshot now;
	// copies of other steps are of another history (newer ones) or of
	// no use (older ones).
	s.mu.Lock()
	s.complete, s.latest = plan.Step, plan.Step
	restoredStep := func(c *snapCopy) bool { return c.step == plan.Step }
	s.retireLocked(&s.own, restoredStep)
	s.retireLocked(&s.held, restoredStep)
	s.dirty = false
	s.met.snapshotStep.Set(float64(plan.Step))
	s.updateGaugesLocked()
	s.mu.Unlock()
	res.took = time.Since(start)
	if fetched {
		// Its own copy of the step, for a later rollback and for its
		// buddy, is taken like any snapshot: in the background, the
		// next Commit waiting for it. The buddy pulls it then.
		s.mu.Lock()
		s.latest = plan.Step - 1 // take it, though the step is complete
		s.mu.Unlock()
		return res, nil
	}
	// Its buddy may lack this rank's copy (the group's hosts changed):
	// serve it, and pull the source's.
	s.mu.Lock()
	mine.served = true
	s.mu.Unlock()
	s.ownSrv.OfferWithMeta(plan.Step, mine.meta, []recovery.Blob{{Name: snapshotBlob, Data: mine.buf}})
	s.wg.Add(1)
	go func() { defer s.wg.Done(); s.pull(plan.Step) }()
	return res, nil
}

// fetchInto fetches the copy of step served at addr straight into blobs
// (the registered state), seen as the one concatenated blob a snapshot
// server serves.
func (s *peerSnapshots) fetchInto(ctx context.Context, step int64, addr string, blobs []recovery.Blob) (recovery.Stats, error) {
	return recovery.Fetch(ctx, s.fc, step, []string{addr}, []recovery.Blob{{Name: snapshotBlob, Mem: newConcatMemory(blobs)}})
}

// errRestoreBroken: a restore failed while writing the registered state
// (a device copy failed): the rank's state is neither its step's nor the
// snapshot's.
var errRestoreBroken = errors.New("ft: the state is half restored")

func findCopy(list []*snapCopy, step int64, slot int) *snapCopy {
	for _, c := range list {
		if c.done && c.step == step && c.slot == slot {
			return c
		}
	}
	return nil
}

// checkSnapshots runs, in place of the group's step check, the group's
// snapshot agreement: the ranks all-gather their inventories, follow their
// sources, and restore when their steps differ (decideRestore).
func (d *driver) checkSnapshots(a checkGroup, ctl *comm.Comm) {
	d.spawn(a.task, snapshotCheckTask{checkGroup: a, ctl: ctl, snaps: d.snaps, server: d.server, blobs: d.blobs,
		log: d.log, met: d.metrics, group: d.cfg.Group}.run)
}

type snapshotCheckTask struct {
	checkGroup
	ctl    *comm.Comm
	snaps  *peerSnapshots
	server *recovery.Server
	blobs  []recovery.Blob
	log    *zap.Logger
	met    *metrics
	group  string
}

func (t snapshotCheckTask) run(ctx context.Context) taskResult {
	snaps, a := t.snaps, t.checkGroup
	invs, err := gatherInventories(ctx, t.ctl, snaps.inventory(a.step))
	if err != nil {
		return taskResult{in: groupChecked{task: a.task, err: err}}
	}
	snaps.follow(invs)
	plan, err := decideRestore(t.group, invs)
	switch {
	case err != nil:
		// Every rank decides this alike from the inventories, and a loop
		// ends on it (its process often exits at once). A barrier first:
		// no rank leaves before every other holds the inventories too, or
		// a peer still receiving its part would see the exchange fail
		// instead of reaching the same decision, and wait for an epoch
		// that never comes. Its own failure changes nothing.
		_ = t.ctl.Barrier(ctx)
		return taskResult{in: groupChecked{task: a.task, lo: a.step, hi: a.step, lost: err}}
	case !plan.Restore:
		if err := snaps.waitCopied(ctx); err != nil {
			return taskResult{in: groupChecked{task: a.task, err: err}}
		}
		snaps.settle(invs)
		return taskResult{in: groupChecked{task: a.task, lo: a.step, hi: a.step}}
	case t.blobs == nil:
		return taskResult{in: groupChecked{task: a.task, err: errors.New("ft: no registered state to restore into")}}
	}
	t.log.Info("peer snapshot: "+describePlan(plan, invs), zap.Int64("held", a.step))
	res, err := snaps.restore(ctx, t.ctl, t.server, plan, invs, a.step, t.blobs)
	if errors.Is(err, errRestoreBroken) {
		return taskResult{in: groupChecked{task: a.task, lo: a.step, hi: a.step, lost: err}}
	}
	if err != nil {
		return taskResult{in: groupChecked{task: a.task, err: fmt.Errorf("ft: peer snapshot restore of step %d: %w", plan.Step, err)}}
	}
	t.met.restores.Inc()
	t.met.restoreSeconds.Observe(res.took.Seconds())
	if res.bytes > 0 {
		t.met.healedBytes.Add(float64(res.bytes))
	}
	return taskResult{in: groupChecked{task: a.task, lo: res.step, hi: res.step, restored: &res}}
}
