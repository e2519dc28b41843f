package membership

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

// What a member tells the coordinator: its record's changes (step,
// health, requests, failures, formed epochs, the end of its run), written
// at once or with the next heartbeat; revocations; durable commit records.

// recordDraft is the member's record as it will next be written, and its
// writes, in order.
type recordDraft struct {
	*memberEnv
	end *ending // a write that finds the registration gone ends it

	// writeM orders the writes of the record to etcd: held across each
	// write's transaction (write, Member.Leave, and the moves of the
	// registration to another lease), it is taken before any other lock
	// of the member's.
	writeM sync.Mutex

	mu         sync.Mutex // guards the fields below
	rec        MemberRecord
	dirty      bool          // rec changed since its last write
	stepTimes  time.Duration // the sum of the step times set since the last write
	stepTimesN int64
}

// get returns the record as it will next be written.
func (d *recordDraft) get() MemberRecord {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.rec
}

// update changes the record with f, which reports whether it changed
// what the coordinator reads; so does update. f runs under the draft's
// lock: it must not call into the member.
func (d *recordDraft) update(f func(r *MemberRecord) (changed bool)) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return f(&d.rec)
}

// updateLater is update for a change that travels with the next write
// (a heartbeat's, when nothing writes sooner).
func (d *recordDraft) updateLater(f func(r *MemberRecord) (changed bool)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if f(&d.rec) {
		d.dirty = true
	}
}

func (d *recordDraft) addStepTime(t time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.stepTimes += t
	d.stepTimesN++
	d.dirty = true
}

// setLease records the lease the registration is bound to, and the
// gossip address of the member that keeps it ("": none).
func (d *recordDraft) setLease(lease clientv3.LeaseID, gossip string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rec.Lease, d.rec.Gossip = int64(lease), gossip
}

// encode returns the record as stored and the lease it is bound to.
func (d *recordDraft) encode() ([]byte, clientv3.LeaseID) {
	d.mu.Lock()
	defer d.mu.Unlock()
	val, _ := json.Marshal(d.rec)
	return val, clientv3.LeaseID(d.rec.Lease)
}

// encodeWrite is encode for a write of the record's changes: it stamps
// the record and folds the step times in, and counts the record written
// (unwritten undoes that when the write fails).
func (d *recordDraft) encodeWrite() ([]byte, clientv3.LeaseID) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rec.Updated = time.Now()
	if d.stepTimesN > 0 {
		d.rec.StepTime = d.stepTimes / time.Duration(d.stepTimesN)
		d.stepTimes, d.stepTimesN = 0, 0
	}
	val, _ := json.Marshal(d.rec)
	d.dirty = false
	return val, clientv3.LeaseID(d.rec.Lease)
}

// unwritten marks the record's changes as still to write.
func (d *recordDraft) unwritten() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.dirty = true
}

// changed reports whether the record changed since its last write.
func (d *recordDraft) changed() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dirty
}

// lockWrites holds the writes of the record back until unlock.
func (d *recordDraft) lockWrites() (unlock func()) {
	d.writeM.Lock()
	return d.writeM.Unlock
}

// write stores the record if this incarnation still holds the key.
func (d *recordDraft) write(ctx context.Context, why string) error {
	if err := d.end.cause(); err != nil {
		return err
	}
	unlock := d.lockWrites()
	defer unlock()
	if err := d.end.cause(); err != nil {
		return err
	}
	val, lease := d.encodeWrite()
	tr, err := d.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(d.key), "=", d.inc)).
		Then(clientv3.OpPut(d.key, string(val), clientv3.WithLease(lease))).Commit()
	if err != nil {
		d.unwritten()
		return fmt.Errorf("membership: %s/%s %s: %w", d.cfg.Job, d.cfg.ID, why, ctxErr(ctx, err))
	}
	if !tr.Succeeded {
		d.end.lost(fmt.Errorf("%w: %s/%s: registration gone", ErrEvicted, d.cfg.Job, d.cfg.ID))
		return d.end.cause()
	}
	return nil
}

// tellReached records the peers reached and writes the record at once
// (reachProbe.run's tell).
func (d *recordDraft) tellReached(reached map[string]uint64) {
	d.update(func(r *MemberRecord) bool {
		if r.Reached == nil {
			r.Reached = map[string]uint64{}
		} else {
			r.Reached = maps.Clone(r.Reached) // the last write's map stays as written
		}
		for id, e := range reached {
			r.Reached[id] = e
		}
		return true
	})
	ctx, cancel := context.WithTimeout(d.life, 5*time.Second)
	defer cancel()
	if err := d.write(ctx, "reached"); err != nil && d.life.Err() == nil {
		d.lg.Info("reporting blamed peers reached again", zap.Error(err))
	}
	d.lg.Info("blamed peers reached again", zap.Any("peers", reached))
}

// SetStep records the member's step locally (no I/O); it travels with the
// next heartbeat, RequestQuorum or SetHealth.
func (m *Member) SetStep(step int64) {
	m.rec.updateLater(func(r *MemberRecord) bool {
		if r.Step == step {
			return false
		}
		r.Step = step
		return true
	})
}

// SetStepTime records the member's own compute time of one step (no
// I/O): the mean of those set since the member's last write travels with
// its next heartbeat (MemberRecord.StepTime), for the straggler policy
// (MemberConfig.Stragglers). Measure what this replica alone spends on a
// step, not the collectives that wait for its peers: ft.Comm passes the
// time from Step's return to the loop's first collective (or to Commit).
func (m *Member) SetStepTime(d time.Duration) {
	if d <= 0 {
		return
	}
	m.rec.addStepTime(d)
}

// SetHealth reports the member's health at once when it changed. A
// Critical member is excluded from the next quorum (the current epoch is
// revoked) until it reports Healthy or Degraded again.
func (m *Member) SetHealth(ctx context.Context, h Health, reason string) error {
	if h < Healthy || h > Critical {
		return fmt.Errorf("%w: membership: health %d", comm.ErrInvalidArgument, int(h))
	}
	changed := m.rec.update(func(r *MemberRecord) bool {
		changed := r.Health != h || r.HealthReason != reason
		r.Health, r.HealthReason = h, reason
		return changed
	})
	if !changed {
		return nil
	}
	return m.rec.write(ctx, "health")
}

// Finish records that this member's training loop ended the run at step:
// the member takes part in no further quorum, and the coordinator publishes
// the run's end (Quorum.Final). Leave after it.
func (m *Member) Finish(ctx context.Context, step int64) error {
	m.rec.update(func(r *MemberRecord) bool {
		r.Step, r.Finished, r.WantQuorum = step, true, false
		return true
	})
	return m.rec.write(ctx, "finish")
}

// Heartbeat writes the member's step and health now.
func (m *Member) Heartbeat(ctx context.Context) error { return m.rec.write(ctx, "heartbeat") }

// RequestQuorum asks to take part in the next quorum (a joiner, or a
// member dropped from the last one). It returns once the request is
// stored; wait for the quorum with NextQuorum or Changed. shrinkOnly
// (from a participant) keeps joiners out of quorums until it calls
// RequestQuorum(ctx, false).
func (m *Member) RequestQuorum(ctx context.Context, shrinkOnly bool) error {
	m.rec.update(func(r *MemberRecord) bool {
		r.WantQuorum, r.ShrinkOnly = true, shrinkOnly
		return true
	})
	return m.rec.write(ctx, "request")
}

// ReportCommitFailure tells the coordinator that this member's commit of
// the given epoch failed: the next epoch follows (with the same
// participants when all are alive). blamed names the members whose
// connections failed in it (a reset: their process is likely gone); the
// coordinator checks them — a closed port is a death — before it forms the
// next epoch, so one death costs one epoch.
func (m *Member) ReportCommitFailure(ctx context.Context, epoch uint64, blamed ...string) error {
	changed := m.rec.update(func(r *MemberRecord) bool {
		if epoch < r.CommitFailed || epoch == r.CommitFailed && len(blamed) == 0 {
			return false
		}
		r.CommitFailed, r.Blamed = epoch, blamed
		return true
	})
	if !changed {
		return nil
	}
	m.reach.probe(epoch, blamed)
	return m.rec.write(ctx, "commit failure")
}

// ReportStall tells the coordinator at once that this member's step has
// not moved for longer than its stall bound (MemberRecord.Stall): waiting
// in a collective for its peers, or (s.Waiting false) not stepping. A
// report equal to the last one is not written again.
func (m *Member) ReportStall(ctx context.Context, s StepStall) error {
	changed := m.rec.update(func(r *MemberRecord) bool {
		if old := r.Stall; old != nil && old.Epoch == s.Epoch && old.Step == s.Step && old.Waiting == s.Waiting {
			return false
		}
		r.Stall = &s
		return true
	})
	if !changed {
		return nil
	}
	return m.rec.write(ctx, "stall")
}

// ReportFormed tells the coordinator at once that this member formed, and
// holds, the communicators of epoch: when every continuing participant
// has, the next quorum's Base lets them shrink or grow those instead of
// forming new ones.
func (m *Member) ReportFormed(ctx context.Context, epoch uint64) error {
	changed := m.rec.update(func(r *MemberRecord) bool {
		if r.Formed == epoch {
			return false
		}
		r.Formed = epoch
		return true
	})
	if !changed {
		return nil
	}
	return m.rec.write(ctx, "formed")
}

// CommitRecord is a durable commit record: the epoch whose participants
// committed a step. One exists per step; the first writer wins.
type CommitRecord struct {
	Step  int64     `json:"step"`
	Epoch uint64    `json:"epoch"`
	By    string    `json:"by"`
	At    time.Time `json:"at"`
}

// keptCommitRecords is how many recent commit records a job keeps; each
// RecordCommit that creates one deletes the one this many steps older.
const keptCommitRecords = 1024

// RecordCommit makes this member's commit of step in epoch durable: it
// creates the step's commit record of the member's run, or finds one. ok
// is true when the record names epoch (this member's epoch owns the
// step); false when another epoch committed the step first (rec says
// which), and this member must not apply it. A *RunEndedError: the
// member's run is over (it records nothing).
func (m *Member) RecordCommit(ctx context.Context, step int64, epoch uint64) (rec CommitRecord, ok bool, err error) {
	k, runKey := m.keys.Commit(m.cfg.Job, step), m.keys.Run(m.cfg.Job)
	mine := CommitRecord{Step: step, Epoch: epoch, By: m.cfg.ID, At: time.Now()}
	val, _ := json.Marshal(mine)
	then := []clientv3.Op{clientv3.OpPut(k, string(val))}
	if step >= keptCommitRecords {
		then = append(then, clientv3.OpDelete(m.keys.Commit(m.cfg.Job, step-keptCommitRecords)))
	}
	tr, err := m.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0), clientv3.Compare(clientv3.ModRevision(runKey), "=", m.runRev)).
		Then(then...).Else(clientv3.OpGet(k), clientv3.OpGet(runKey)).Commit()
	if err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: record commit of step %d: %w", step, ctxErr(ctx, err))
	}
	if tr.Succeeded {
		return mine, true, nil
	}
	if err := m.checkRun(tr.Responses[1].GetResponseRange().Kvs); err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: record commit of step %d: %w", step, err)
	}
	kvs := tr.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 { // deleted in between: only records far behind are
		return CommitRecord{}, false, fmt.Errorf("membership: commit record of step %d vanished", step)
	}
	if err := json.Unmarshal(kvs[0].Value, &rec); err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: commit record of step %d: %w", step, err)
	}
	return rec, rec.Epoch == epoch, nil
}

// LastCommit returns the newest durable commit record of the member's
// run (ok false when there is none; a *RunEndedError when the run is
// over).
func (m *Member) LastCommit(ctx context.Context) (rec CommitRecord, ok bool, err error) {
	tr, err := m.cli.Txn(ctx).Then(
		clientv3.OpGet(m.keys.Commits(m.cfg.Job), clientv3.WithPrefix(),
			clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(1)),
		clientv3.OpGet(m.keys.Run(m.cfg.Job)),
	).Commit()
	if err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: read commit records: %w", ctxErr(ctx, err))
	}
	if err := m.checkRun(tr.Responses[1].GetResponseRange().Kvs); err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: read commit records: %w", err)
	}
	kvs := tr.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return CommitRecord{}, false, nil
	}
	if err := json.Unmarshal(kvs[0].Value, &rec); err != nil {
		return CommitRecord{}, false, fmt.Errorf("membership: commit record %s: %w", kvs[0].Key, err)
	}
	return rec, true, nil
}

// Revoke records that an epoch must stop (e.g. a peer failed in a
// collective), so every member's Revoked(epoch) fires. The first record of
// an epoch wins; revoking again is a no-op. The coordinator then forms the
// next epoch.
func (m *Member) Revoke(ctx context.Context, epoch uint64, reason string, failed ...string) error {
	m.reach.probe(epoch, failed)
	r := Revocation{Epoch: epoch, Reason: reason, Failed: failed, By: m.cfg.ID, At: time.Now()}
	val, _ := json.Marshal(r)
	k := m.keys.Revocation(m.cfg.Job, epoch)
	_, err := m.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(k), "=", 0)).
		Then(clientv3.OpPut(k, string(val))).Commit()
	if err != nil {
		return fmt.Errorf("membership: revoke epoch %d: %w", epoch, ctxErr(ctx, err))
	}
	return nil
}
