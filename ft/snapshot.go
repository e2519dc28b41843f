package ft

import (
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"runtime"
	"slices"
	"sort"
	"strings"
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

// prefaulted returns n bytes of new memory, each page touched by several
// goroutines at once: a fresh buffer's first copy page-faults once per
// page, which one thread does at about 1.3 GB/s (an H200 host: a 4 GiB
// snapshot took 3.3 s against 0.32 s into mapped memory).
func prefaulted(n int) []byte {
	b := make([]byte, n)
	const page = 4096
	workers := min(runtime.GOMAXPROCS(0), 8)
	per := (n/workers + page - 1) / page * page
	var wg sync.WaitGroup
	for w := range workers {
		lo, hi := min(w*per, n), min((w+1)*per, n)
		wg.Go(func() {
			for i := lo; i < hi; i += page {
				b[i] = 0
			}
		})
	}
	wg.Wait()
	return b
}

// snapChunk bounds one device copy of a snapshot.
const snapChunk = 64 << 20

func copyFromMemory(ctx context.Context, dst []byte, m recovery.Memory) error {
	for off := 0; off < len(dst); off += snapChunk {
		if err := m.ReadAt(ctx, dst[off:min(off+snapChunk, len(dst))], off); err != nil {
			return err
		}
	}
	return nil
}

func copyToMemory(ctx context.Context, m recovery.Memory, src []byte) error {
	for off := 0; off < len(src); off += snapChunk {
		if err := m.WriteAt(ctx, src[off:min(off+snapChunk, len(src))], off); err != nil {
			return err
		}
	}
	return nil
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

// snapInventory is what one rank of a group holds, all-gathered at every
// reconfiguration of the group.
type snapInventory struct {
	Rank     int     `json:"r"`
	Step     int64   `json:"s"` // the committed step it holds
	Host     string  `json:"h"`
	Own      []int64 `json:"o,omitempty"` // steps of its complete own copies
	HeldSlot int     `json:"hs"`          // whose copies Held are (-1: none)
	Held     []int64 `json:"hd,omitempty"`
	Complete int64   `json:"c"` // newest step it knows complete (-1: none)
	OwnAddr  string  `json:"oa"`
	HeldAddr string  `json:"ha"`
}

// inventoryRecordSize bounds an encoded inventory (two addresses, a host
// name of up to 253 bytes and four steps fit well within it).
const inventoryRecordSize = 2048

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

func gatherInventories(ctx context.Context, ctl *comm.Comm, mine snapInventory) ([]snapInventory, error) {
	b, err := json.Marshal(mine)
	if err != nil {
		return nil, err
	}
	if len(b)+4 > inventoryRecordSize {
		return nil, fmt.Errorf("%w: ft: snapshot inventory of %d bytes (host name too long?)", comm.ErrInvalidArgument, len(b))
	}
	rec := make([]byte, inventoryRecordSize)
	binary.LittleEndian.PutUint32(rec, uint32(len(b)))
	copy(rec[4:], b)
	all := make([]byte, inventoryRecordSize*ctl.Size())
	if err := ctl.AllGather(ctx, comm.Uint8s(all), comm.Uint8s(rec)); err != nil {
		return nil, err
	}
	invs := make([]snapInventory, ctl.Size())
	for r := range invs {
		x := all[r*inventoryRecordSize : (r+1)*inventoryRecordSize]
		n := int(binary.LittleEndian.Uint32(x))
		if n > inventoryRecordSize-4 {
			return nil, fmt.Errorf("%w: ft: rank %d's snapshot inventory is malformed", comm.ErrMismatch, r)
		}
		if err := json.Unmarshal(x[4:4+n], &invs[r]); err != nil {
			return nil, fmt.Errorf("%w: ft: rank %d's snapshot inventory: %v", comm.ErrMismatch, r, err)
		}
		if invs[r].Rank != r {
			return nil, fmt.Errorf("%w: ft: the group's rank %d says it is slot %d", comm.ErrMismatch, r, invs[r].Rank)
		}
	}
	return invs, nil
}

// buddies maps each slot of a group to its buddy, the slot that holds a
// copy of its snapshots: a permutation, so every rank holds one copy.
// Slots are ordered by host (then slot) and each is sent as many places on
// as the largest host has ranks, so a layout of equal hosts puts every
// copy on the next host; one host alone pairs each slot with the next.
func buddies(hosts []string) []int {
	n := len(hosts)
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(hosts[a], hosts[b]) })
	per := map[string]int{}
	most := 0
	for _, h := range hosts {
		per[h]++
		most = max(most, per[h])
	}
	shift := most
	if shift >= n {
		shift = 1
	}
	out := make([]int, n)
	for i, slot := range order {
		out[slot] = order[(i+shift)%n]
	}
	return out
}

// restorePlan is the group's decision at a reconfiguration.
type restorePlan struct {
	Restore bool
	Step    int64 // the snapshot step every rank restores
	// From[r] is the rank whose held copy slot r restores from; -1: its
	// own copy.
	From []int
}

// ErrSnapshotLost is matched by a *SnapshotLostError.
var ErrSnapshotLost = errors.New("ft: the peer snapshots of a shard are lost")

// SnapshotLostError is returned by Step at every rank of a replica group
// whose ranks hold different steps when no complete peer snapshot has a
// copy of every shard (Config.SnapshotEvery): both copies of a shard were
// lost (the rank and its buddy died), or no snapshot was complete yet.
// Nothing was restored; restore the job from your own checkpoint. Step
// keeps returning it.
type SnapshotLostError struct {
	Group string
	Slots []int // the group ranks whose shard has no copy
	Steps []int64
	// Newest is the newest snapshot step known complete (-1: none).
	Newest int64
}

func (e *SnapshotLostError) Error() string {
	what := fmt.Sprintf("no copy of the shards of ranks %v at snapshot step %d (a rank and its buddy both lost)", e.Slots, e.Newest)
	if e.Newest < 0 {
		what = fmt.Sprintf("no peer snapshot was complete yet (ranks %v hold nothing)", e.Slots)
	}
	return fmt.Sprintf("ft: group %s: its ranks stand at steps %v and %s; nothing was restored: restore the job from your checkpoint",
		e.Group, e.Steps, what)
}

func (e *SnapshotLostError) Unwrap() error { return ErrSnapshotLost }

// decideRestore is the group's decision from every rank's inventory (in
// slot order): a pure function, so every rank decides alike. Ranks whose
// steps agree restore nothing. Otherwise the newest snapshot step up to
// the newest known complete (by any rank: it learned that every rank held
// its source's copy; a newer one may be half taken) of which every slot
// has a copy — its own, or, for a rank that lacks it, one held by another
// rank — is restored everywhere.
func decideRestore(group string, invs []snapInventory) (restorePlan, error) {
	steps := make([]int64, len(invs))
	same := true
	for i, in := range invs {
		steps[i] = in.Step
		same = same && in.Step == invs[0].Step
	}
	if same {
		return restorePlan{}, nil
	}
	newest := int64(-1)
	for _, in := range invs {
		newest = max(newest, in.Complete)
	}
	// Candidates: the steps of the copies the ranks hold, up to the
	// newest known complete (a newer one may be half taken).
	var cands []int64
	for _, in := range invs {
		for _, st := range slices.Concat(in.Own, in.Held) {
			if st <= newest && !slices.Contains(cands, st) {
				cands = append(cands, st)
			}
		}
	}
	slices.Sort(cands)
	slices.Reverse(cands)
	var lacking []int
	for _, step := range cands {
		from := make([]int, len(invs))
		lacking = lacking[:0]
		for r, in := range invs {
			if slices.Contains(in.Own, step) && in.Step >= step {
				from[r] = -1
				continue
			}
			h := slices.IndexFunc(invs, func(x snapInventory) bool { return x.HeldSlot == r && slices.Contains(x.Held, step) })
			if h < 0 {
				lacking = append(lacking, r)
			}
			from[r] = h
		}
		if len(lacking) == 0 {
			return restorePlan{Restore: true, Step: step, From: from}, nil
		}
	}
	if len(cands) == 0 {
		for r, in := range invs {
			if in.Step < slices.Max(steps) {
				lacking = append(lacking, r)
			}
		}
	}
	return restorePlan{}, &SnapshotLostError{Group: group, Slots: slices.Clone(lacking), Steps: steps, Newest: newest}
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

// concatMemory shows blobs (host or device memory) as one recovery.Memory,
// in order, for a fetch of a snapshot's one blob into them.
type concatMemory struct {
	blobs []recovery.Blob
	offs  []int // offs[i]: where blob i starts
	n     int
	host  sync.Pool // chunk buffers when no blob is device memory
}

func newConcatMemory(blobs []recovery.Blob) *concatMemory {
	m := &concatMemory{blobs: blobs}
	for _, b := range blobs {
		m.offs = append(m.offs, m.n)
		m.n += b.Len()
	}
	return m
}

func (m *concatMemory) Len() int { return m.n }

func (m *concatMemory) Buffer(ctx context.Context, n int) ([]byte, func(), error) {
	for _, b := range m.blobs {
		if b.Mem != nil {
			return b.Mem.Buffer(ctx, n) // pinned staging, for device copies
		}
	}
	if p, ok := m.host.Get().(*[]byte); ok && len(*p) >= n {
		return (*p)[:n], func() { m.host.Put(p) }, nil
	}
	p := make([]byte, n)
	return p, func() { m.host.Put(&p) }, nil
}

// span calls f for each piece of [off, off+len(p)) within one blob.
func (m *concatMemory) span(p []byte, off int, f func(b recovery.Blob, q []byte, boff int) error) error {
	i := max(sort.SearchInts(m.offs, off+1)-1, 0)
	for len(p) > 0 && i < len(m.blobs) {
		boff := off - m.offs[i]
		k := min(len(p), m.blobs[i].Len()-boff)
		if k > 0 {
			if err := f(m.blobs[i], p[:k], boff); err != nil {
				return err
			}
			p, off = p[k:], off+k
		}
		i++
	}
	if len(p) > 0 {
		return fmt.Errorf("%w: ft: %d bytes past the registered state's end", comm.ErrInvalidArgument, len(p))
	}
	return nil
}

func (m *concatMemory) ReadAt(ctx context.Context, p []byte, off int) error {
	return m.span(p, off, func(b recovery.Blob, q []byte, boff int) error {
		if b.Mem == nil {
			copy(q, b.Data[boff:])
			return nil
		}
		return b.Mem.ReadAt(ctx, q, boff)
	})
}

func (m *concatMemory) WriteAt(ctx context.Context, p []byte, off int) error {
	return m.span(p, off, func(b recovery.Blob, q []byte, boff int) error {
		if b.Mem == nil {
			copy(b.Data[boff:], q)
			return nil
		}
		return b.Mem.WriteAt(ctx, q, boff)
	})
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

// describePlan is the restore's log line.
func describePlan(p restorePlan, invs []snapInventory) string {
	var parts []string
	for r, h := range p.From {
		if h >= 0 {
			parts = append(parts, fmt.Sprintf("rank %d from rank %d's copy", r, h))
		}
	}
	steps := make([]string, len(invs))
	for i, in := range invs {
		steps[i] = fmt.Sprint(in.Step)
	}
	return fmt.Sprintf("restoring snapshot step %d (ranks at steps %s; %s)", p.Step, strings.Join(steps, ","), strings.Join(parts, ", "))
}

// checkSnapshots runs, in place of the group's step check, the group's
// snapshot agreement: the ranks all-gather their inventories, follow their
// sources, and restore when their steps differ (decideRestore).
func (d *driver) checkSnapshots(a checkGroup, ctl *comm.Comm) {
	snaps, server, blobs, log, met, group := d.snaps, d.server, d.blobs, d.log, d.metrics, d.cfg.Group
	d.spawn(a.task, func(ctx context.Context) taskResult {
		invs, err := gatherInventories(ctx, ctl, snaps.inventory(a.step))
		if err != nil {
			return taskResult{in: groupChecked{task: a.task, err: err}}
		}
		snaps.follow(invs)
		plan, err := decideRestore(group, invs)
		switch {
		case err != nil:
			return taskResult{in: groupChecked{task: a.task, lo: a.step, hi: a.step, lost: err}}
		case !plan.Restore:
			if err := snaps.waitCopied(ctx); err != nil {
				return taskResult{in: groupChecked{task: a.task, err: err}}
			}
			snaps.settle(invs)
			return taskResult{in: groupChecked{task: a.task, lo: a.step, hi: a.step}}
		case blobs == nil:
			return taskResult{in: groupChecked{task: a.task, err: errors.New("ft: no registered state to restore into")}}
		}
		log.Info("peer snapshot: "+describePlan(plan, invs), zap.Int64("held", a.step))
		res, err := snaps.restore(ctx, ctl, server, plan, invs, a.step, blobs)
		if errors.Is(err, errRestoreBroken) {
			return taskResult{in: groupChecked{task: a.task, lo: a.step, hi: a.step, lost: err}}
		}
		if err != nil {
			return taskResult{in: groupChecked{task: a.task, err: fmt.Errorf("ft: peer snapshot restore of step %d: %w", plan.Step, err)}}
		}
		met.restores.Inc()
		met.restoreSeconds.Observe(res.took.Seconds())
		if res.bytes > 0 {
			met.healedBytes.Add(float64(res.bytes))
		}
		return taskResult{in: groupChecked{task: a.task, lo: res.step, hi: res.step, restored: &res}}
	})
}
