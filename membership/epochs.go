package membership

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cenkalti/backoff/v4"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.uber.org/zap"
)

// What a member learns: the job's quorums and revocations, from a watch of
// the quorum view (a change of the previous epoch: a few bytes per
// participant that changed) and of the revocation records, or from its
// group's leader (groupquorum.go).

// epochs is the part of a member that learns the job's epochs: it watches
// them in etcd (or takes them from its group's leader), holds what it
// learned, wakes those who wait for it, and at a group's leader forwards
// it to the group's links (groupquorum.go).
type epochs struct {
	*memberEnv

	watching atomic.Int32 // watchEpochs runs (a group's follower does not watch)
	// readingFull: a read of the whole list for a forwarded view is under
	// way; readAgain: a view came that it may predate (groupquorum.go).
	readingFull atomic.Bool
	readAgain   atomic.Bool

	// mu guards the fields below. Held while a record is applied and
	// forwarded, it orders the forwards as the applies; under it the
	// member takes QuorumCache's lock and each groupLink's, and no other.
	mu          sync.Mutex
	quorum      *Quorum
	revocations map[uint64]Revocation
	settings    map[uint64]JobSettings   // by version: the documents views carried
	changed     chan struct{}            // closed at the next change (Changed)
	revokedCh   map[uint64]chan struct{} // closed when their epoch is revoked (Revoked)
	ended       bool                     // the membership ended: every Revoked channel is closed
	delivered   [vias]uint64             // the newest epoch of a quorum record received by each way (State)
	forwards    bool                     // a group's leader whose members take the quorum from it (groupquorum.go)
	fwdLog      [][]byte                 // what such a leader replays to a member that links
	outs        map[*groupLink]struct{}  // the links it forwards to
}

func newEpochs(env *memberEnv) *epochs {
	return &epochs{memberEnv: env, revocations: map[uint64]Revocation{}, changed: make(chan struct{}),
		revokedCh: map[uint64]chan struct{}{}, outs: map[*groupLink]struct{}{}}
}

// Quorum returns the latest published quorum of the job (no I/O), as a
// member sees it: its participants carry their ID, Group and Incarnation
// (not Addr or Step, which are in the members' own records:
// coordinator.Admin's Job fills them in), and its Reason may be shortened.
func (m *Member) Quorum() (Quorum, bool) {
	q, _ := m.epochs.latest()
	if q == nil {
		return Quorum{}, false
	}
	return *q, true
}

// Settings returns the job's settings document that ref names, if the
// member has it: every view that changes the settings, and every whole
// list, carries the document in force (covered by the view's signature).
func (m *Member) Settings(ref SettingsRef) (JobSettings, bool) { return m.epochs.settingsDoc(ref) }

// Changed returns a channel closed at the next change of the published
// quorum or of the revocations; call again for the one after.
func (m *Member) Changed() <-chan struct{} {
	_, ch := m.epochs.latest()
	return ch
}

// NextQuorum waits for a quorum with an epoch above after (after 0: any
// quorum) and returns it, or fails when ctx ends or the membership does.
func (m *Member) NextQuorum(ctx context.Context, after uint64) (Quorum, error) {
	for {
		q, ch := m.epochs.latest()
		if q != nil && q.Epoch > after {
			return *q, nil
		}
		select {
		case <-ch:
		case <-m.end.done:
			return Quorum{}, m.Err()
		case <-ctx.Done():
			return Quorum{}, fmt.Errorf("membership: waiting for a quorum after epoch %d: %w", after, context.Cause(ctx))
		}
	}
}

// Revoked returns a channel closed once the epoch is revoked (a
// revocation record exists or a later quorum was published) or the
// membership has ended.
func (m *Member) Revoked(epoch uint64) <-chan struct{} { return m.epochs.revoked(epoch) }

// Revocation returns the revocation record of an epoch, if one was seen.
func (m *Member) Revocation(epoch uint64) (Revocation, bool) { return m.epochs.revocation(epoch) }

// latest returns the quorum held (nil: none) and the channel closed at
// the next change.
func (e *epochs) latest() (*Quorum, <-chan struct{}) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.quorum, e.changed
}

// epoch returns the epoch of the quorum held (0: none).
func (e *epochs) epoch() uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.quorum == nil {
		return 0
	}
	return e.quorum.Epoch
}

func (e *epochs) settingsDoc(ref SettingsRef) (JobSettings, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	s, ok := e.settings[ref.Version]
	if !ok || s.Ref() != ref {
		return JobSettings{}, false
	}
	return s, true
}

// keepSettingsDocs is how many versions of the settings a member keeps.
const keepSettingsDocs = 4

// keepSettings remembers a settings document (mu held).
func (e *epochs) keepSettings(s JobSettings) {
	if e.settings == nil {
		e.settings = map[uint64]JobSettings{}
	}
	e.settings[s.Version] = s
	for v := range e.settings {
		if v+keepSettingsDocs <= s.Version {
			delete(e.settings, v)
		}
	}
}

func (e *epochs) revoked(epoch uint64) <-chan struct{} {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.ended || e.revokedLocked(epoch) {
		ch := make(chan struct{})
		close(ch)
		return ch
	}
	ch, ok := e.revokedCh[epoch]
	if !ok {
		ch = make(chan struct{})
		e.revokedCh[epoch] = ch
	}
	return ch
}

func (e *epochs) revocation(epoch uint64) (Revocation, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	r, ok := e.revocations[epoch]
	return r, ok
}

// end closes every Revoked channel, now and from now on: the membership
// ended.
func (e *epochs) end() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.ended = true
	for ep, ch := range e.revokedCh {
		close(ch)
		delete(e.revokedCh, ep)
	}
}

// state fills in what s says of the member's epochs.
func (e *epochs) state(s *MemberState) {
	e.mu.Lock()
	defer e.mu.Unlock()
	s.Watched, s.Forwarded, s.Read = e.delivered[viaWatch], e.delivered[viaLink], e.delivered[viaRead]
	s.Watching = e.watching.Load() > 0
	if q := e.quorum; q != nil {
		s.Epoch, s.Participants = q.Epoch, len(q.Participants)
		s.InQuorum = slices.ContainsFunc(q.Participants, func(p Participant) bool { return p.ID == e.cfg.ID })
	}
}

func (e *epochs) revokedLocked(epoch uint64) bool {
	if _, ok := e.revocations[epoch]; ok {
		return true
	}
	return e.quorum != nil && e.quorum.Epoch > epoch
}

// notifyLocked wakes Changed waiters and closes the Revoked channels of
// revoked epochs.
func (e *epochs) notifyLocked() {
	close(e.changed)
	e.changed = make(chan struct{})
	for ep, ch := range e.revokedCh {
		if e.revokedLocked(ep) {
			close(ch)
			delete(e.revokedCh, ep)
		}
	}
	// Keep the last 64 revocations.
	if e.quorum != nil {
		for ep := range e.revocations {
			if ep+64 < e.quorum.Epoch {
				delete(e.revocations, ep)
			}
		}
	}
}

// via is how a record reached the member: its own watch of etcd, its
// group's leader over the link, or a read of etcd (MemberState).
type via int

const (
	viaWatch via = iota
	viaLink
	viaRead
	vias
)

// applyLocked takes a quorum view, the quorum record (the whole list) or a
// revocation record, from etcd or from the group's leader (how: v). needFull: a
// view the member could not apply (a change of an epoch it does not
// hold); read the record (readFull). A group's leader forwards what
// changed its state to the group (groupquorum.go). Called with mu held.
func (e *epochs) applyLocked(kv *mvccpb.KeyValue, v via) (changed, needFull bool) {
	changed, needFull = e.applyKV(kv, v)
	if changed {
		e.forwardLocked(kv)
	}
	return changed, needFull
}

func (e *epochs) applyKV(kv *mvccpb.KeyValue, v via) (changed, needFull bool) {
	k := string(kv.Key)
	record := k == e.keys.Quorum(e.cfg.Job)
	switch {
	case k == e.keys.QuorumView(e.cfg.Job) || record && !legacyRecord(kv.Value):
		h, added, err := e.cfg.Quorums.decode(kv, e.cfg.QuorumVerifier)
		if err == nil && h.Job != e.cfg.Job {
			err = fmt.Errorf("%w: the record is of job %q", ErrForgedQuorum, h.Job)
		}
		if err != nil {
			e.lg.Warn("ignored a quorum record", zap.Int64("revision", kv.ModRevision), zap.Error(err))
			return false, false
		}
		e.delivered[v] = max(e.delivered[v], h.Epoch)
		if e.quorum != nil && h.Epoch <= e.quorum.Epoch {
			return false, false
		}
		if r := h.Revocation; r != nil {
			if _, ok := e.revocations[r.Epoch]; !ok {
				e.revocations[r.Epoch] = *r
			}
		}
		if d := h.SettingsDoc; d != nil && h.Settings != nil && d.Ref() == *h.Settings {
			e.keepSettings(*d)
		}
		q, ok := e.cfg.Quorums.apply(kv, h, added, e.quorum)
		if !ok {
			return false, true
		}
		e.quorum = q
		return true, false
	case record: // the old encoding, restored by a coordinator that loaded it
		q, err := e.readQuorum(kv.Value)
		if err != nil {
			e.lg.Warn("ignored a quorum record", zap.Int64("revision", kv.ModRevision), zap.Error(err))
			return false, false
		}
		e.delivered[v] = max(e.delivered[v], q.Epoch)
		if e.quorum == nil || q.Epoch > e.quorum.Epoch {
			q = compact(q)
			e.quorum = &q
			return true, false
		}
		return false, false
	}
	if !strings.HasPrefix(k, e.keys.Revocations(e.cfg.Job)) {
		return false, false // not a key of the member's job's epochs (a leader's bad forward)
	}
	var r Revocation
	if err := json.Unmarshal(kv.Value, &r); err != nil {
		e.lg.Warn("unreadable revocation record", zap.String("key", k), zap.Error(err))
		return false, false
	}
	if _, ok := e.revocations[r.Epoch]; ok {
		return false, false
	}
	e.revocations[r.Epoch] = r
	return true, false
}

// readFull reads the quorum record (the whole list) as of rev (0: the
// latest), for a view the member could not apply, and takes it in.
func (e *epochs) readFull(ctx context.Context, rev int64) error {
	var opts []clientv3.OpOption
	if rev > 0 {
		opts = append(opts, clientv3.WithRev(rev))
	}
	resp, err := e.cli.Get(ctx, e.keys.Quorum(e.cfg.Job), opts...)
	if err != nil {
		return fmt.Errorf("membership: read quorum of %s: %w", e.cfg.Job, ctxErr(ctx, err))
	}
	e.applyAll(resp.Kvs)
	return nil
}

// readQuorum decodes a quorum record of the old encoding of the member's
// job, verifying its signature when the member has a verifier.
func (e *epochs) readQuorum(raw []byte) (Quorum, error) {
	q, err := DecodeQuorumRecord(raw, e.cfg.QuorumVerifier)
	if err != nil {
		return Quorum{}, err
	}
	if q.Job != e.cfg.Job {
		return Quorum{}, fmt.Errorf("%w: the record is of job %q", ErrForgedQuorum, q.Job)
	}
	return q, nil
}

// loadEpochs reads the quorum (its view; the record when the view is
// a change of an epoch the member does not hold) and revocations and
// returns the revision read at.
func (e *epochs) loadEpochs(ctx context.Context) (int64, error) {
	resp, err := e.cli.Txn(ctx).Then(
		clientv3.OpGet(e.keys.QuorumView(e.cfg.Job)),
		clientv3.OpGet(e.keys.Revocations(e.cfg.Job), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return 0, fmt.Errorf("membership: read quorum of %s: %w", e.cfg.Job, ctxErr(ctx, err))
	}
	rev := resp.Header.Revision
	e.mu.Lock()
	changed, needFull := false, false
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			c, f := e.applyLocked(kv, viaRead)
			changed, needFull = changed || c, needFull || f
		}
	}
	if changed {
		e.notifyLocked()
	}
	e.mu.Unlock()
	if needFull {
		// The whole list of the same revision: views and record are
		// written together.
		if err := e.readFull(ctx, rev); err != nil {
			return 0, err
		}
	}
	return rev, nil
}

// watchEpochs follows the quorum view and the revocations (two watches:
// only coordinators write the one, members the others) from rev+1 until
// the membership ends, re-reading both after a compaction or a broken
// watch. It does not watch the full quorum record, nor any member's
// record: per epoch a member receives the view, a few bytes per
// participant that changed.
func (e *epochs) watchEpochs(rev int64) {
	e.watching.Add(1)
	defer e.watching.Add(-1)
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, 2*time.Second, 0
	for e.life.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(e.life))
		quorum := e.cli.Watch(wctx, e.keys.QuorumView(e.cfg.Job), clientv3.WithRev(rev+1))
		revoked := e.cli.Watch(wctx, e.keys.Revocations(e.cfg.Job), clientv3.WithPrefix(), clientv3.WithRev(rev+1))
		for {
			var wr clientv3.WatchResponse
			var ok, isQuorum bool
			select {
			case wr, ok = <-quorum:
				isQuorum = true
			case wr, ok = <-revoked:
			}
			if !ok || wr.Err() != nil {
				if e.life.Err() == nil {
					e.lg.Info("quorum watch broke; reading again", zap.Error(wr.Err()))
				}
				break
			}
			bo.Reset()
			if isQuorum && e.needsCatchUp(wr.Events) {
				// The two watches are not ordered with each other: read
				// the revocations a new quorum may have overtaken, so
				// that Revoked never fires before Revocation has its
				// record.
				e.catchUpRevocations(wctx, wr.Header.Revision)
			}
			e.mu.Lock()
			changed, needFull := false, false
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.PUT {
					c, f := e.applyLocked(ev.Kv, viaWatch)
					changed, needFull = changed || c, needFull || f
				}
			}
			if changed {
				e.notifyLocked()
			}
			e.mu.Unlock()
			if needFull {
				if err := e.readFull(wctx, 0); err != nil && e.life.Err() == nil {
					e.lg.Info("reading the quorum record failed; reading again", zap.Error(err))
					break
				}
			}
		}
		cancel()
		if e.life.Err() != nil {
			return
		}
		for e.life.Err() == nil {
			r, err := e.loadEpochs(e.life)
			if err == nil {
				rev = r
				break
			}
			select {
			case <-time.After(bo.NextBackOff()):
			case <-e.life.Done():
			}
		}
	}
}

// needsCatchUp reports whether a new view may have overtaken a
// revocation record: not when the member had no quorum (nothing of its
// to revoke) nor when the view carries the revocation of the epoch it
// ends. Reading them costs etcd a range request per member per epoch.
func (e *epochs) needsCatchUp(evs []*clientv3.Event) bool {
	e.mu.Lock()
	none := e.quorum == nil
	e.mu.Unlock()
	if none {
		return false
	}
	for _, ev := range evs {
		if h, ok := viewHeader(ev.Kv.Value); !ok || h.Revocation == nil {
			return true
		}
	}
	return false
}

// catchUpRevocations reads the revocation records of the current epoch
// and later ones, as of revision rev, and takes them in.
func (e *epochs) catchUpRevocations(ctx context.Context, rev int64) {
	from := e.epoch()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := e.cli.Get(ctx, e.keys.Revocation(e.cfg.Job, from),
		clientv3.WithRange(clientv3.GetPrefixRangeEnd(e.keys.Revocations(e.cfg.Job))), clientv3.WithRev(rev))
	if err != nil {
		return // the watch delivers them anyway, later
	}
	e.applyAll(resp.Kvs)
}

// applyAll applies records read from etcd and wakes the waiters if any
// changed what the member knows; it reports whether one did.
func (e *epochs) applyAll(kvs []*mvccpb.KeyValue) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	changed := false
	for _, kv := range kvs {
		c, _ := e.applyLocked(kv, viaRead)
		changed = changed || c
	}
	if changed {
		e.notifyLocked()
	}
	return changed
}
