package ft

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/recovery"
)

// The driver's tasks: the work of an action that waits on peers or etcd.
// The action's method, on the driver's goroutine, hands a …Task value the
// comms and values it needs, and spawn runs its run method on a goroutine
// of its own; a task that is one exchange over the replica group's
// control comm is its action's exchange method (spawnOnGroup). The result
// comes back as the machine's next input. A task reads nothing of the
// driver but what it was handed, except the formation (form.go), which
// the machine never runs beside another task.

// spawn runs a task of the machine on its own goroutine, cancellable
// through cancelTask; its result comes back to run. The goroutine exits
// once run has received the result (run receives until every task has
// answered).
func (d *driver) spawn(task int, run func(ctx context.Context) taskResult) {
	ctx, cancel := context.WithCancelCause(context.Background())
	d.cancels[task] = cancel
	go d.runTask(ctx, cancel, task, run)
}

func (d *driver) runTask(ctx context.Context, cancel context.CancelCauseFunc, task int, run func(ctx context.Context) taskResult) {
	r := run(ctx)
	r.task = task
	cancel(nil)
	d.link.in <- r
}

func (d *driver) cancelTask(a cancelTask) {
	if cancel := d.cancels[a.task]; cancel != nil {
		cancel(a.cause)
	}
}

// groupCtl is the replica group's control comm of epoch.
func (d *driver) groupCtl(epoch uint64) *comm.Comm { return d.comms[commKey{dimGroup, epoch}].ctl }

// spawnOnGroup spawns a task that is one exchange over the replica
// group's control comm of epoch. The exchanges are methods of their
// actions (agreeStep, checkGroup, castVote, shareOutcome).
func (d *driver) spawnOnGroup(task int, epoch uint64, exchange func(context.Context, *comm.Comm) taskResult) {
	d.spawn(task, groupExchange{d.groupCtl(epoch), exchange}.run)
}

type groupExchange struct {
	ctl      *comm.Comm
	exchange func(context.Context, *comm.Comm) taskResult
}

func (g groupExchange) run(ctx context.Context) taskResult { return g.exchange(ctx, g.ctl) }

// keepGroup runs the replica group's vote on keeping the group comms of
// a.epoch into a.into: a rank votes yes while both its group comms are
// healthy. The vote is an all-reduce on the group's control comm, shaped
// unlike the step's own messages there (a mismatch fails it at every
// rank); a rank that formed new comms instead closed these, which fails
// the vote at the others, so every rank ends up forming new ones.
func (d *driver) keepGroup(a keepGroup) {
	d.spawn(a.task, keepTask{a, d.comms[commKey{dimGroup, a.epoch}], d.cfg.Timeout}.run)
}

type keepTask struct {
	keepGroup
	x       comms
	timeout time.Duration
}

func (t keepTask) run(ctx context.Context) taskResult {
	if !t.x.ok() || t.x.ctl.Err() != nil {
		return taskResult{in: groupKept{task: t.task}}
	}
	yes := int64(0)
	if t.x.data.Err() == nil {
		yes = 1
	}
	tctx, cancel := context.WithTimeout(ctx, t.timeout)
	defer cancel()
	v := []int64{yes, int64(t.into), -int64(t.into)}
	err := t.x.ctl.AllReduce(tctx, comm.Int64s(v), comm.Min)
	return taskResult{in: groupKept{task: t.task, ok: err == nil && v[0] == 1 && v[1] == -v[2], err: err}}
}

// agreeSwitch runs a prepared epoch's agreement on when to move to it:
// the first op on its new control comm at every rank, an all-reduce of
// max over the committed step (read as it is posted: a survivor steps on
// meanwhile), the slowest recent step and the epoch (both ways, so that a
// rank of another epoch fails it). The joiners wait in it until every
// survivor formed the comms in the background.
func (d *driver) agreeSwitch(a agreeSwitch) {
	d.spawn(a.task, switchTask{a, d.comms[commKey{dimFT, a.epoch}].ctl, &d.link.step, d.cfg.Timeout}.run)
}

type switchTask struct {
	agreeSwitch
	ctl       *comm.Comm
	committed *atomic.Int64 // the committed step, as the driver publishes it
	timeout   time.Duration
}

func (t switchTask) run(ctx context.Context) taskResult {
	if t.ctl == nil {
		return taskResult{in: switchAgreed{task: t.task, err: fmt.Errorf("%w: ft: no control comm of epoch %d", comm.ErrClosed, t.epoch)}}
	}
	v := []int64{max(t.step, t.committed.Load()), int64(t.slowest), int64(t.epoch), -int64(t.epoch)}
	err := t.ctl.AllReduce(ctx, comm.Int64s(v), comm.Max)
	if err == nil && v[2] != -v[3] {
		err = fmt.Errorf("%w: ft: ranks of epochs %d to %d agreeing when to move to epoch %d", comm.ErrMismatch, -v[3], v[2], t.epoch)
	}
	return taskResult{in: switchAgreed{task: t.task, at: switchStep(v[0], time.Duration(v[1]), t.timeout, t.survivors, t.joiners), err: err}}
}

// exchange is agreeStep's task, the replica group's gate at Step
// (machine.gate), shaped unlike the group's other messages (a mismatch
// fails it everywhere): the newest epoch known, whether any rank cannot
// start, and the ranks' current epochs (max and -min).
func (a agreeStep) exchange(ctx context.Context, ctl *comm.Comm) taskResult {
	notReady := int64(1)
	if a.ready {
		notReady = 0
	}
	v := []int64{int64(a.known), notReady, int64(a.now), -int64(a.now)}
	err := ctl.AllReduce(ctx, comm.Int64s(v), comm.Max)
	return taskResult{in: stepAgreed{task: a.task, known: uint64(v[0]), ready: v[1] == 0, same: v[2] == -v[3], err: err}}
}

// gatherRecords all-gathers the ranks' step records (committed step, the
// epoch that committed it, where the rank serves its state) over the FT
// control comm.
func (d *driver) gatherRecords(a gatherRecords) {
	mine := stepRecord{Step: a.step, Epoch: a.last, Addr: d.server.Addr()}
	d.spawn(a.task, gatherTask{a, d.comms[commKey{dimFT, a.epoch}].ctl, mine}.run)
}

type gatherTask struct {
	gatherRecords
	ctl  *comm.Comm
	mine stepRecord
}

func (t gatherTask) run(ctx context.Context) taskResult {
	recs, err := gatherStepRecords(ctx, t.ctl, t.mine)
	return taskResult{in: recordsGathered{task: t.task, recs: recs, err: err}}
}

func gatherStepRecords(ctx context.Context, ctl *comm.Comm, mine stepRecord) ([]stepRecord, error) {
	b := make([]byte, stepRecordSize)
	if err := mine.encode(b); err != nil {
		return nil, err
	}
	all := make([]byte, stepRecordSize*ctl.Size())
	if err := ctl.AllGather(ctx, comm.Uint8s(all), comm.Uint8s(b)); err != nil {
		return nil, err
	}
	recs := make([]stepRecord, ctl.Size())
	for r := range recs {
		var err error
		if recs[r], err = decodeStepRecord(all[r*stepRecordSize:]); err != nil {
			return nil, fmt.Errorf("rank %d: %w", r, err)
		}
	}
	return recs, nil
}

// readLastCommit reads the job's last commit record (DurableCommit).
func (d *driver) readLastCommit(a readLastCommit) {
	d.spawn(a.task, lastCommitTask{a, d.m.records}.run)
}

type lastCommitTask struct {
	readLastCommit
	records durableCommitter
}

func (t lastCommitTask) run(ctx context.Context) taskResult {
	rec, ok, err := t.records.LastCommit(ctx)
	return taskResult{in: lastCommitRead{task: t.task, rec: rec, ok: ok, err: err}}
}

// fetchState heals: it fetches the agreed step's state from every rank
// that holds it (package recovery). A heal cut short keeps its progress,
// and the next epoch's heal of the same step fetches only the rest.
func (d *driver) fetchState(a fetchState) {
	if d.blobs == nil {
		// No comm formed yet (a replica that heals to the run's final
		// state right after it started): host state needs none.
		if err := d.prepareState(nil); err != nil {
			d.later = append(d.later, stateHealed{task: a.task, err: err})
			return
		}
	}
	fc := d.cfg.fetchConfig()
	fc.Progress = &d.healed
	d.spawn(a.task, healTask{a, fc, d.blobs, d.metrics}.run)
}

type healTask struct {
	fetchState
	fc    recovery.FetchConfig
	blobs []recovery.Blob
	mt    *metrics
}

func (t healTask) run(ctx context.Context) taskResult {
	st, err := recovery.Fetch(ctx, t.fc, t.Step, t.Sources, t.blobs)
	t.mt.healedBytes.Add(float64(st.Bytes))
	var theirs history
	if err == nil {
		if theirs, err = decodeHistory(st.Meta); err != nil {
			err = fmt.Errorf("the sources' history: %w", err)
		}
	}
	if err == nil {
		t.mt.healSeconds.Observe(st.Duration.Seconds())
		t.mt.healThroughput.Set(st.Throughput())
	}
	return taskResult{in: stateHealed{task: t.task, hist: theirs, bytes: st.Bytes, took: st.Duration, err: err}}
}

// checkGroup compares the steps of the replica group's ranks (lowest and
// highest); with peer snapshots, the group's snapshot agreement does
// instead (snapshot.go).
func (d *driver) checkGroup(a checkGroup) {
	if d.snaps != nil {
		d.checkSnapshots(a, d.groupCtl(a.epoch))
		return
	}
	d.spawnOnGroup(a.task, a.epoch, a.exchange)
}

func (a checkGroup) exchange(ctx context.Context, ctl *comm.Comm) taskResult {
	v := []int64{a.step, -a.step}
	err := ctl.AllReduce(ctx, comm.Int64s(v), comm.Max)
	if err == nil && -v[1] != v[0] {
		// Steps that differ may end the loop at every rank alike
		// (GroupDivergedError), and a process often exits at once: a
		// barrier first, so none leaves before every other holds the
		// answer (see snapshotCheckTask). Its own failure changes nothing.
		_ = ctl.Barrier(ctx)
	}
	return taskResult{in: groupChecked{task: a.task, lo: -v[1], hi: v[0], err: err}}
}

// castVote runs the replica group's vote on the step: yes only if every
// rank votes yes.
func (d *driver) castVote(a castVote) {
	if d.snaps != nil {
		d.spawn(a.task, snapshotVoteTask{a, d.groupCtl(a.epoch), d.snaps}.run)
		return
	}
	d.spawnOnGroup(a.task, a.epoch, a.exchange)
}

func (a castVote) exchange(ctx context.Context, ctl *comm.Comm) taskResult {
	v := bit(a.yes)
	err := ctl.AllReduce(ctx, comm.Int32s(v), comm.Min)
	return taskResult{in: voted{task: a.task, yes: v[0] == 1, err: err}}
}

// snapshotVoteTask is the vote with peer snapshots: it also says the
// newest snapshot every rank holds its source's copy of: that snapshot is
// complete.
type snapshotVoteTask struct {
	castVote
	ctl   *comm.Comm
	snaps *peerSnapshots
}

func (t snapshotVoteTask) run(ctx context.Context) taskResult {
	v := []int64{0, t.snaps.heldStep()}
	if t.yes {
		v[0] = 1
	}
	err := t.ctl.AllReduce(ctx, comm.Int64s(v), comm.Min)
	if err == nil && v[1] >= 0 {
		t.snaps.learned(v[1])
	}
	return taskResult{in: voted{task: t.task, yes: v[0] == 1, err: err}}
}

// recordCommit makes the commit of a step durable (DurableCommit): the
// epoch owns the step only if its record is the first. A transient etcd
// error is retried within the op timeout; only "another epoch owns it" is
// final.
func (d *driver) recordCommit(a recordCommit) {
	d.spawn(a.task, recordTask{a, d.m.records, d.cfg.Timeout}.run)
}

type recordTask struct {
	recordCommit
	records durableCommitter
	timeout time.Duration
}

func (t recordTask) run(ctx context.Context) taskResult {
	rctx, cancel := context.WithTimeout(ctx, t.timeout)
	defer cancel()
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval = 10*time.Millisecond, time.Second
	var rec membership.CommitRecord
	var ok bool
	err := backoff.Retry(func() error {
		var err error
		rec, ok, err = t.records.RecordCommit(rctx, t.step, t.epoch)
		return err
	}, backoff.WithContext(b, rctx))
	res := commitRecorded{task: t.task, ok: err == nil && ok}
	switch {
	case err != nil:
		res.reason = fmt.Sprintf("recording the commit of step %d: %v", t.step, err)
	case !ok:
		res.reason = fmt.Sprintf("step %d was committed first by epoch %d (%s)", t.step, rec.Epoch, rec.By)
	}
	return taskResult{in: res}
}

// exchange is shareOutcome's task: the group's leader tells its ranks
// whether it recorded the commit.
func (a shareOutcome) exchange(ctx context.Context, ctl *comm.Comm) taskResult {
	v := bit(a.ok)
	err := ctl.Broadcast(ctx, comm.Int32s(v), 0)
	return taskResult{in: outcomeShared{task: a.task, ok: v[0] == 1, err: err}}
}

// bit is b as the one int32 a vote or an outcome sends.
func bit(b bool) []int32 {
	if b {
		return []int32{1}
	}
	return []int32{0}
}

// withdrawState stops serving the state before the optimizer writes it.
// Without reads in flight (every step but one that serves a healer) the
// withdrawal is done at once: no task.
func (d *driver) withdrawState(a withdrawState) {
	if (d.snaps == nil || !d.snaps.copyInFlight()) && d.server.Withdraw(expired) == nil {
		d.later = append(d.later, withdrawn{task: a.task})
		return
	}
	d.spawn(a.task, withdrawTask{a, d.snaps, d.server}.run)
}

type withdrawTask struct {
	withdrawState
	snaps  *peerSnapshots // nil: off
	server *recovery.Server
}

func (t withdrawTask) run(ctx context.Context) taskResult {
	if t.snaps != nil {
		// The snapshot's copy of the state must be in place before the
		// optimizer writes it. Its own failure fails no step.
		if err := t.snaps.waitCopied(ctx); err != nil {
			return taskResult{in: withdrawn{task: t.task, err: err}}
		}
	}
	return taskResult{in: withdrawn{task: t.task, err: t.server.Withdraw(ctx)}}
}
