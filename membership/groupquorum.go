package membership

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// A replica group's quorum from its leader (MemberConfig.GroupLease,
// unless GroupEachWatches). Only the group's leader watches the job's
// epochs in etcd; it forwards every record that changed what it knows —
// a view it applied, the record (whole list) it read, a revocation — on
// each member's group link, byte for byte as etcd stored it, in the order
// it applied them. A member applies a forwarded record as one read from
// etcd: it verifies the coordinator's signature itself (the leader cannot
// forge a quorum), takes no epoch at or below the one it holds (a late or
// replayed forward is refused), and reads the record from etcd itself
// when it cannot apply a view (it does not hold the epoch the view
// changes). A member that links (joining, or to a new leader) first gets
// what the leader holds: the last record it read and what it applied
// since. When the leader dies, the member that takes the lease over
// starts watching etcd (and reads the record once to seed its followers);
// the others link to it. etcd thus serves one watcher per group, not one
// per rank, and the whole list goes to one rank per group, not to every
// rank, at the first quorum.

// The frame that carries a record on a group link, leader to member:
// linkRecord, then the key, the mod revision and the value, each length
// (or value) as a uvarint.
const linkRecord byte = 'q'

// maxLinkRecord bounds a forwarded value (etcd's request limit bounds
// what a coordinator stores well below it).
const maxLinkRecord = 64 << 20

// forwardLog bounds what a leader replays to a member that links: the
// last record (whole list) and the changes since; past it, the oldest
// changes go and a member that cannot apply what is left reads the record
// from etcd.
const forwardLog = 64

// groupLink is the leader's end of one member's link: the frames to
// send on it.
type groupLink struct {
	mu    sync.Mutex    // guards queue; a leaf: nothing is locked under it
	queue [][]byte      // frames to send
	wake  chan struct{} // a frame was queued (capacity 1)
}

func newGroupLink() *groupLink { return &groupLink{wake: make(chan struct{}, 1)} }

// push queues frames f.
func (l *groupLink) push(f ...[]byte) {
	l.mu.Lock()
	l.queue = append(l.queue, f...)
	l.mu.Unlock()
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// take returns the frames queued and empties the queue.
func (l *groupLink) take() [][]byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := l.queue
	l.queue = nil
	return f
}

// lead makes this member forward the quorum to its group's links, when
// its group's members take the quorum from their leader: it leads the
// group from now on.
func (e *epochs) lead() {
	if !e.cfg.GroupLease || e.cfg.GroupEachWatches {
		return
	}
	e.mu.Lock()
	e.forwards = true
	e.mu.Unlock()
}

// attach adds a link this member serves as its group's leader: it gets
// what the leader holds (when it forwards), then every record forwarded
// until detach.
func (e *epochs) attach(l *groupLink) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.outs[l] = struct{}{}
	if e.forwards {
		l.push(e.fwdLog...) // what the leader holds, first
	}
}

func (e *epochs) detach(l *groupLink) {
	e.mu.Lock()
	delete(e.outs, l)
	e.mu.Unlock()
}

// forwardLocked queues kv, which changed what this leader knows, for
// every linked member and keeps it for members that link later. Called
// with mu held.
func (e *epochs) forwardLocked(kv *mvccpb.KeyValue) {
	if !e.forwards {
		return
	}
	f := encodeLinkRecord(kv)
	if string(kv.Key) == e.keys.Quorum(e.cfg.Job) {
		e.fwdLog = e.fwdLog[:0] // the whole list: what came before is in it
	}
	e.fwdLog = append(e.fwdLog, f)
	if len(e.fwdLog) > forwardLog {
		e.fwdLog = append(e.fwdLog[:0], e.fwdLog[len(e.fwdLog)-forwardLog/2:]...)
	}
	for l := range e.outs {
		l.push(f)
	}
}

// seedForward reads the job's quorum record and the revocations of its
// epoch and later, applies them, and makes them what this leader replays
// to members that link: a member that became leader by taking the lease
// over held only what the previous leader forwarded. One read of the
// whole list per new leader.
func (e *epochs) seedForward(ctx context.Context) (int64, error) {
	from := e.epoch()
	revs := e.keys.Revocations(e.cfg.Job)
	resp, err := e.cli.Txn(ctx).Then(
		clientv3.OpGet(e.keys.Quorum(e.cfg.Job)),
		clientv3.OpGet(e.keys.Revocation(e.cfg.Job, from), clientv3.WithRange(clientv3.GetPrefixRangeEnd(revs))),
	).Commit()
	if err != nil {
		return 0, fmt.Errorf("membership: read quorum of %s: %w", e.cfg.Job, ctxErr(ctx, err))
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.fwdLog = e.fwdLog[:0]
	changed := false
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			c, _ := e.applyKV(kv, viaRead)
			changed = changed || c
			e.fwdLog = append(e.fwdLog, encodeLinkRecord(kv))
		}
	}
	for l := range e.outs {
		l.push(e.fwdLog...)
	}
	if changed {
		e.notifyLocked()
	}
	return resp.Header.Revision, nil
}

// applyForwarded takes a record the group's leader forwarded, as one read
// from etcd (applyLocked): verified, never older than what the member
// holds. A view it cannot apply makes it read the record from etcd, again
// and again (backoff) until etcd answers or the membership ends: the
// leader forwards each view once, so a read given up would leave the
// member on the older epoch until the next one (a burst's last epoch has
// none). A view that comes while a read is under way makes it read once
// more after it: the read under way may predate that view's epoch.
func (e *epochs) applyForwarded(kv *mvccpb.KeyValue) {
	e.mu.Lock()
	changed, needFull := e.applyLocked(kv, viaLink)
	if changed {
		e.notifyLocked()
	}
	e.mu.Unlock()
	if !needFull {
		return
	}
	e.readAgain.Store(true)
	if !e.readingFull.CompareAndSwap(false, true) {
		return // the read under way reads again
	}
	e.spawn(e.readForForwards)
}

// readForForwards reads the whole record for the forwarded views that
// asked for it (readAgain) until none is left, each read retried until
// etcd answers; it exits then, or when the membership ends. It runs while
// readingFull is held, at most once at a time.
func (e *epochs) readForForwards() {
	read := func() error {
		ctx, cancel := context.WithTimeout(e.life, e.cfg.LeaseTTL)
		defer cancel()
		return e.readFull(ctx, 0)
	}
	retried := func(err error, next time.Duration) {
		e.lg.Info("reading the quorum record for a forwarded view failed; trying again", zap.Error(err), zap.Duration("in", next))
	}
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, 2*time.Second, 0
	for {
		for e.readAgain.Swap(false) {
			bo.Reset()
			if backoff.RetryNotify(read, backoff.WithContext(bo, e.life), retried) != nil {
				e.readingFull.Store(false)
				return // the membership ended
			}
		}
		e.readingFull.Store(false)
		// A view that came between the last Swap and the Store found the
		// read under way: read for it here.
		if !e.readAgain.Load() || !e.readingFull.CompareAndSwap(false, true) {
			return
		}
	}
}

// leadEpochs is what a member that now leads its group does for the
// quorum, until the membership ends: seed what it forwards, then watch
// etcd (watchEpochs).
func (e *epochs) leadEpochs() {
	if e.cfg.GroupEachWatches {
		return // it watched all along
	}
	var rev int64
	for {
		ctx, cancel := context.WithTimeout(e.life, e.cfg.LeaseTTL)
		var err error
		rev, err = e.seedForward(ctx)
		cancel()
		if err == nil {
			break
		}
		if e.life.Err() != nil {
			return
		}
		e.lg.Info("reading the quorum to lead the group failed; trying again", zap.Error(err))
		select {
		case <-time.After(100 * time.Millisecond):
		case <-e.life.Done():
			return
		}
	}
	e.watchEpochs(rev)
}

func encodeLinkRecord(kv *mvccpb.KeyValue) []byte {
	f := make([]byte, 0, 1+3*binary.MaxVarintLen64+len(kv.Key)+len(kv.Value))
	f = append(f, linkRecord)
	f = binary.AppendUvarint(f, uint64(len(kv.Key)))
	f = append(f, kv.Key...)
	f = binary.AppendUvarint(f, uint64(kv.ModRevision))
	f = binary.AppendUvarint(f, uint64(len(kv.Value)))
	return append(f, kv.Value...)
}

var errBadLinkRecord = errors.New("membership: malformed record on a group link")

// readLinkRecord reads a frame's body (after its linkRecord byte).
func readLinkRecord(r *bufio.Reader) (*mvccpb.KeyValue, error) {
	field := func(limit uint64) ([]byte, error) {
		n, err := binary.ReadUvarint(r)
		if err != nil {
			return nil, err
		}
		if n > limit {
			return nil, fmt.Errorf("%w: %d bytes", errBadLinkRecord, n)
		}
		b := make([]byte, n)
		_, err = io.ReadFull(r, b)
		return b, err
	}
	key, err := field(4096)
	if err != nil {
		return nil, err
	}
	rev, err := binary.ReadUvarint(r)
	if err != nil {
		return nil, err
	}
	val, err := field(maxLinkRecord)
	if err != nil {
		return nil, err
	}
	return &mvccpb.KeyValue{Key: key, ModRevision: int64(rev), Value: val}, nil
}
