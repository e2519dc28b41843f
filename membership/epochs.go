package membership

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/cenkalti/backoff/v4"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.uber.org/zap"
)

// What a member learns: the job's quorums and revocations, from a watch of
// the quorum view (a change of the previous epoch: a few bytes per
// participant that changed) and of the revocation records.

// Quorum returns the latest published quorum of the job (no I/O), as a
// member sees it: its participants carry their ID, Group and Incarnation
// (not Addr or Step, which are in the members' own records:
// coordinator.Admin's Job fills them in), and its Reason may be shortened.
func (m *Member) Quorum() (Quorum, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.quorum == nil {
		return Quorum{}, false
	}
	return *m.quorum, true
}

// Settings returns the job's settings document that ref names, if the
// member has it: every view that changes the settings, and every whole
// list, carries the document in force (covered by the view's signature).
func (m *Member) Settings(ref SettingsRef) (JobSettings, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, ok := m.settings[ref.Version]
	if !ok || s.Ref() != ref {
		return JobSettings{}, false
	}
	return s, true
}

// keepSettingsDocs is how many versions of the settings a member keeps.
const keepSettingsDocs = 4

// keepSettings remembers a settings document (mu held).
func (m *Member) keepSettings(s JobSettings) {
	if m.settings == nil {
		m.settings = map[uint64]JobSettings{}
	}
	m.settings[s.Version] = s
	for v := range m.settings {
		if v+keepSettingsDocs <= s.Version {
			delete(m.settings, v)
		}
	}
}

// Changed returns a channel closed at the next change of the published
// quorum or of the revocations; call again for the one after.
func (m *Member) Changed() <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.changed
}

// NextQuorum waits for a quorum with an epoch above after (after 0: any
// quorum) and returns it, or fails when ctx ends or the membership does.
func (m *Member) NextQuorum(ctx context.Context, after uint64) (Quorum, error) {
	for {
		m.mu.Lock()
		q, ch := m.quorum, m.changed
		m.mu.Unlock()
		if q != nil && q.Epoch > after {
			return *q, nil
		}
		select {
		case <-ch:
		case <-m.done:
			return Quorum{}, m.Err()
		case <-ctx.Done():
			return Quorum{}, fmt.Errorf("membership: waiting for a quorum after epoch %d: %w", after, context.Cause(ctx))
		}
	}
}

// Revoked returns a channel closed once the epoch is revoked (a
// revocation record exists or a later quorum was published) or the
// membership has ended.
func (m *Member) Revoked(epoch uint64) <-chan struct{} {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.err != nil || m.revokedLocked(epoch) {
		ch := make(chan struct{})
		close(ch)
		return ch
	}
	ch, ok := m.revokedCh[epoch]
	if !ok {
		ch = make(chan struct{})
		m.revokedCh[epoch] = ch
	}
	return ch
}

// Revocation returns the revocation record of an epoch, if one was seen.
func (m *Member) Revocation(epoch uint64) (Revocation, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.revocations[epoch]
	return r, ok
}

func (m *Member) revokedLocked(epoch uint64) bool {
	if _, ok := m.revocations[epoch]; ok {
		return true
	}
	return m.quorum != nil && m.quorum.Epoch > epoch
}

// notifyLocked wakes Changed waiters and closes the Revoked channels of
// revoked epochs.
func (m *Member) notifyLocked() {
	close(m.changed)
	m.changed = make(chan struct{})
	for e, ch := range m.revokedCh {
		if m.revokedLocked(e) {
			close(ch)
			delete(m.revokedCh, e)
		}
	}
	// Keep the last 64 revocations.
	if m.quorum != nil {
		for e := range m.revocations {
			if e+64 < m.quorum.Epoch {
				delete(m.revocations, e)
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
func (m *Member) applyLocked(kv *mvccpb.KeyValue, v via) (changed, needFull bool) {
	changed, needFull = m.applyKV(kv, v)
	if changed {
		m.forwardLocked(kv)
	}
	return changed, needFull
}

func (m *Member) applyKV(kv *mvccpb.KeyValue, v via) (changed, needFull bool) {
	k := string(kv.Key)
	record := k == m.keys.Quorum(m.cfg.Job)
	switch {
	case k == m.keys.QuorumView(m.cfg.Job) || record && !legacyRecord(kv.Value):
		h, added, err := m.cfg.Quorums.decode(kv, m.cfg.QuorumVerifier)
		if err == nil && h.Job != m.cfg.Job {
			err = fmt.Errorf("%w: the record is of job %q", ErrForgedQuorum, h.Job)
		}
		if err != nil {
			m.lg.Warn("ignored a quorum record", zap.Int64("revision", kv.ModRevision), zap.Error(err))
			return false, false
		}
		m.delivered[v] = max(m.delivered[v], h.Epoch)
		if m.quorum != nil && h.Epoch <= m.quorum.Epoch {
			return false, false
		}
		if r := h.Revocation; r != nil {
			if _, ok := m.revocations[r.Epoch]; !ok {
				m.revocations[r.Epoch] = *r
			}
		}
		if d := h.SettingsDoc; d != nil && h.Settings != nil && d.Ref() == *h.Settings {
			m.keepSettings(*d)
		}
		q, ok := m.cfg.Quorums.apply(kv, h, added, m.quorum)
		if !ok {
			return false, true
		}
		m.quorum = q
		return true, false
	case record: // the old encoding, restored by a coordinator that loaded it
		q, err := m.readQuorum(kv.Value)
		if err != nil {
			m.lg.Warn("ignored a quorum record", zap.Int64("revision", kv.ModRevision), zap.Error(err))
			return false, false
		}
		m.delivered[v] = max(m.delivered[v], q.Epoch)
		if m.quorum == nil || q.Epoch > m.quorum.Epoch {
			q = compact(q)
			m.quorum = &q
			return true, false
		}
		return false, false
	}
	if !strings.HasPrefix(k, m.keys.Revocations(m.cfg.Job)) {
		return false, false // not a key of the member's job's epochs (a leader's bad forward)
	}
	var r Revocation
	if err := json.Unmarshal(kv.Value, &r); err != nil {
		m.lg.Warn("unreadable revocation record", zap.String("key", k), zap.Error(err))
		return false, false
	}
	if _, ok := m.revocations[r.Epoch]; ok {
		return false, false
	}
	m.revocations[r.Epoch] = r
	return true, false
}

// readFull reads the quorum record (the whole list) as of rev (0: the
// latest), for a view the member could not apply, and takes it in.
func (m *Member) readFull(ctx context.Context, rev int64) error {
	var opts []clientv3.OpOption
	if rev > 0 {
		opts = append(opts, clientv3.WithRev(rev))
	}
	resp, err := m.cli.Get(ctx, m.keys.Quorum(m.cfg.Job), opts...)
	if err != nil {
		return fmt.Errorf("membership: read quorum of %s: %w", m.cfg.Job, ctxErr(ctx, err))
	}
	m.applyAll(resp.Kvs)
	return nil
}

// readQuorum decodes a quorum record of the old encoding of the member's
// job, verifying its signature when the member has a verifier.
func (m *Member) readQuorum(raw []byte) (Quorum, error) {
	q, err := DecodeQuorumRecord(raw, m.cfg.QuorumVerifier)
	if err != nil {
		return Quorum{}, err
	}
	if q.Job != m.cfg.Job {
		return Quorum{}, fmt.Errorf("%w: the record is of job %q", ErrForgedQuorum, q.Job)
	}
	return q, nil
}

// loadEpochs reads the quorum (its view; the record when the view is
// a change of an epoch the member does not hold) and revocations and
// returns the revision read at.
func (m *Member) loadEpochs(ctx context.Context) (int64, error) {
	resp, err := m.cli.Txn(ctx).Then(
		clientv3.OpGet(m.keys.QuorumView(m.cfg.Job)),
		clientv3.OpGet(m.keys.Revocations(m.cfg.Job), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return 0, fmt.Errorf("membership: read quorum of %s: %w", m.cfg.Job, ctxErr(ctx, err))
	}
	rev := resp.Header.Revision
	m.mu.Lock()
	changed, needFull := false, false
	for _, r := range resp.Responses {
		for _, kv := range r.GetResponseRange().Kvs {
			c, f := m.applyLocked(kv, viaRead)
			changed, needFull = changed || c, needFull || f
		}
	}
	if changed {
		m.notifyLocked()
	}
	m.mu.Unlock()
	if needFull {
		// The whole list of the same revision: views and record are
		// written together.
		if err := m.readFull(ctx, rev); err != nil {
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
func (m *Member) watchEpochs(rev int64) {
	m.watching.Add(1)
	defer m.watching.Add(-1)
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, 2*time.Second, 0
	for m.life.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(m.life))
		quorum := m.cli.Watch(wctx, m.keys.QuorumView(m.cfg.Job), clientv3.WithRev(rev+1))
		revoked := m.cli.Watch(wctx, m.keys.Revocations(m.cfg.Job), clientv3.WithPrefix(), clientv3.WithRev(rev+1))
		for {
			var wr clientv3.WatchResponse
			var ok, isQuorum bool
			select {
			case wr, ok = <-quorum:
				isQuorum = true
			case wr, ok = <-revoked:
			}
			if !ok || wr.Err() != nil {
				if m.life.Err() == nil {
					m.lg.Info("quorum watch broke; reading again", zap.Error(wr.Err()))
				}
				break
			}
			bo.Reset()
			if isQuorum && m.needsCatchUp(wr.Events) {
				// The two watches are not ordered with each other: read
				// the revocations a new quorum may have overtaken, so
				// that Revoked never fires before Revocation has its
				// record.
				m.catchUpRevocations(wctx, wr.Header.Revision)
			}
			m.mu.Lock()
			changed, needFull := false, false
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.PUT {
					c, f := m.applyLocked(ev.Kv, viaWatch)
					changed, needFull = changed || c, needFull || f
				}
			}
			if changed {
				m.notifyLocked()
			}
			m.mu.Unlock()
			if needFull {
				if err := m.readFull(wctx, 0); err != nil && m.life.Err() == nil {
					m.lg.Info("reading the quorum record failed; reading again", zap.Error(err))
					break
				}
			}
		}
		cancel()
		if m.life.Err() != nil {
			return
		}
		for m.life.Err() == nil {
			r, err := m.loadEpochs(m.life)
			if err == nil {
				rev = r
				break
			}
			select {
			case <-time.After(bo.NextBackOff()):
			case <-m.life.Done():
			}
		}
	}
}

// needsCatchUp reports whether a new view may have overtaken a
// revocation record: not when the member had no quorum (nothing of its
// to revoke) nor when the view carries the revocation of the epoch it
// ends. Reading them costs etcd a range request per member per epoch.
func (m *Member) needsCatchUp(evs []*clientv3.Event) bool {
	m.mu.Lock()
	none := m.quorum == nil
	m.mu.Unlock()
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
func (m *Member) catchUpRevocations(ctx context.Context, rev int64) {
	m.mu.Lock()
	var from uint64
	if m.quorum != nil {
		from = m.quorum.Epoch
	}
	m.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := m.cli.Get(ctx, m.keys.Revocation(m.cfg.Job, from),
		clientv3.WithRange(clientv3.GetPrefixRangeEnd(m.keys.Revocations(m.cfg.Job))), clientv3.WithRev(rev))
	if err != nil {
		return // the watch delivers them anyway, later
	}
	m.applyAll(resp.Kvs)
}

// applyAll applies records read from etcd and wakes the waiters if any
// changed what the member knows; it reports whether one did.
func (m *Member) applyAll(kvs []*mvccpb.KeyValue) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	changed := false
	for _, kv := range kvs {
		c, _ := m.applyLocked(kv, viaRead)
		changed = changed || c
	}
	if changed {
		m.notifyLocked()
	}
	return changed
}
