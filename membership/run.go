package membership

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

// A run is one training of a job from its first step: the job's name
// stays, its runs come and go. The job's current run is recorded at
// <root>/<job>/run; the first member to join a job with no record names its run
// (newRunID). Every member belongs to the run that was current when it
// joined (MemberRecord.Run), and the job's commit records (RecordCommit)
// are the current run's: starting a run (StartRun, or a member's
// MemberConfig.Run) clears them. A run starts only while the job has no
// live member, so two runs never share a quorum, and a member of an ended
// run can neither register again in the job nor record a commit.

// Errors callers branch on with errors.Is.
var (
	// ErrRunEnded: the run a member asked for, or belonged to, is not the
	// job's current run any more; found inside a *RunEndedError.
	ErrRunEnded = errors.New("membership: the run ended")
	// ErrRunBusy: a run cannot start while the job has live members;
	// found inside a *RunBusyError.
	ErrRunBusy = errors.New("membership: the job's current run has live members")
)

// RunRecord is a job's current run, at <root>/<job>/run.
type RunRecord struct {
	ID      string    `json:"id"`
	Started time.Time `json:"started"`
	By      string    `json:"by"` // who started it: a member id, or an operator
	// Ended names the job's earlier runs, newest first (at most
	// maxEndedRuns): their ids cannot be used again.
	Ended []string `json:"ended,omitempty"`
}

// maxEndedRuns bounds RunRecord.Ended.
const maxEndedRuns = 32

// RunEndedError says that a run is not the job's current run: it ended
// when Current started.
type RunEndedError struct {
	Job, Run string
	Current  RunRecord
}

func (e *RunEndedError) Error() string {
	return fmt.Sprintf("membership: run %s of job %q ended: the job runs %s, started %s by %s; a replica of an ended run cannot take part (its state is not the current run's)",
		runName(e.Run), e.Job, runName(e.Current.ID), e.Current.Started.Format(time.RFC3339), e.Current.By)
}

func (e *RunEndedError) Unwrap() error { return ErrRunEnded }

// RunBusyError says that run Run could not start: the job's current run
// has live members.
type RunBusyError struct {
	Job, Run string
	Current  string   // the job's current run
	Members  []string // its live members (some of them)
}

func (e *RunBusyError) Error() string {
	return fmt.Sprintf("membership: run %s of job %q cannot start while run %s has live members (%s): stop or evict them first",
		runName(e.Run), e.Job, runName(e.Current), strings.Join(e.Members, ", "))
}

func (e *RunBusyError) Unwrap() error { return ErrRunBusy }

func runName(id string) string {
	if id == "" {
		return `"" (the default run)`
	}
	return fmt.Sprintf("%q", id)
}

// newRunID returns a fresh run id: the time (UTC) and a random suffix.
func newRunID() string {
	var b [3]byte
	rand.Read(b[:])
	return time.Now().UTC().Format("20060102-150405") + "-" + hex.EncodeToString(b[:])
}

// currentRun reads the job's run record: the record and its mod revision
// (0: none, the default run).
func currentRun(ctx context.Context, cli *clientv3.Client, layout etcdkeys.Layout, job string) (RunRecord, int64, error) {
	resp, err := cli.Get(ctx, layout.Run(job))
	if err != nil {
		return RunRecord{}, 0, fmt.Errorf("membership: read the run of job %s: %w", job, ctxErr(ctx, err))
	}
	return decodeRun(resp.Kvs)
}

func decodeRun(kvs []*mvccpb.KeyValue) (RunRecord, int64, error) {
	if len(kvs) == 0 {
		return RunRecord{}, 0, nil
	}
	var r RunRecord
	if err := json.Unmarshal(kvs[0].Value, &r); err != nil {
		return RunRecord{}, 0, fmt.Errorf("membership: run record %s: %w", kvs[0].Key, err)
	}
	return r, kvs[0].ModRevision, nil
}

// StartRun makes id the job's current run (a fresh id from newRunID when
// id is empty) and clears the job's commit records, in one transaction,
// if the job has no live member; by says who starts it. It fails with a
// *RunBusyError while members are registered, and with a *RunEndedError
// when id is the current run or one of the job's ended runs (an id is
// used once). Members that join the job with no run of their own join
// it (MemberConfig.Run). The root "" is DefaultRoot.
func StartRun(ctx context.Context, cli *clientv3.Client, root, job, id, by string) (RunRecord, error) {
	if err := checkName("job", job); err != nil {
		return RunRecord{}, err
	}
	if id == "" {
		id = newRunID()
	}
	if err := checkName("run", id); err != nil {
		return RunRecord{}, err
	}
	layout := etcdkeys.Layout{Root: root}
	for {
		cur, rev, err := currentRun(ctx, cli, layout, job)
		if err != nil {
			return RunRecord{}, err
		}
		if id == cur.ID && rev != 0 || slices.Contains(cur.Ended, id) {
			return RunRecord{}, &RunEndedError{Job: job, Run: id, Current: cur}
		}
		r, _, ok, err := startRun(ctx, cli, layout, job, id, by, cur, rev)
		if err != nil || ok {
			return r, err
		}
	}
}

// startRun replaces the run record read at rev (cur) with a record of
// run id, clearing the commit records, if the job has no live member; it
// returns the new record and its revision. ok false: the run record
// changed meanwhile (read it again).
func startRun(ctx context.Context, cli *clientv3.Client, layout etcdkeys.Layout, job, id, by string, cur RunRecord, rev int64) (_ RunRecord, newRev int64, ok bool, _ error) {
	ended := cur.Ended
	if rev != 0 || cur.ID != "" {
		ended = append([]string{cur.ID}, ended...)
	}
	r := RunRecord{ID: id, Started: time.Now(), By: by, Ended: ended[:min(len(ended), maxEndedRuns)]}
	val, _ := json.Marshal(r)
	rk, members := layout.Run(job), layout.Members(job)
	tr, err := cli.Txn(ctx).If(
		clientv3.Compare(clientv3.ModRevision(rk), "=", rev),
		clientv3.Compare(clientv3.CreateRevision(members), "=", 0).WithPrefix(),
	).Then(
		clientv3.OpPut(rk, string(val)),
		clientv3.OpDelete(layout.Commits(job), clientv3.WithPrefix()),
	).Else(
		clientv3.OpGet(rk),
		clientv3.OpGet(members, clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithLimit(8)),
	).Commit()
	if err != nil {
		return RunRecord{}, 0, false, fmt.Errorf("membership: start run %s of job %s: %w", id, job, ctxErr(ctx, err))
	}
	if tr.Succeeded {
		return r, tr.Header.Revision, true, nil
	}
	if _, now, _ := decodeRun(tr.Responses[0].GetResponseRange().Kvs); now != rev {
		return RunRecord{}, 0, false, nil
	}
	busy := &RunBusyError{Job: job, Run: id, Current: cur.ID}
	for _, kv := range tr.Responses[1].GetResponseRange().Kvs {
		busy.Members = append(busy.Members, strings.TrimPrefix(string(kv.Key), members))
	}
	return RunRecord{}, 0, false, busy
}

// nameFirstRun records a job's first run, with a fresh id, if the job has
// no run record (ok false: it has one now). Unlike startRun it keeps the
// commit records: they are this run's.
func nameFirstRun(ctx context.Context, cli *clientv3.Client, layout etcdkeys.Layout, job, by string) (_ RunRecord, rev int64, ok bool, _ error) {
	r := RunRecord{ID: newRunID(), Started: time.Now(), By: by}
	val, _ := json.Marshal(r)
	rk := layout.Run(job)
	tr, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(rk), "=", 0)).Then(clientv3.OpPut(rk, string(val))).Commit()
	if err != nil {
		return RunRecord{}, 0, false, fmt.Errorf("membership: name the run of job %s: %w", job, ctxErr(ctx, err))
	}
	if !tr.Succeeded {
		return RunRecord{}, 0, false, nil
	}
	return r, tr.Header.Revision, true, nil
}

// enterRun decides the run this member joins (MemberConfig.Run and
// StartRun) and returns it with the revision of its record, which
// registration and commit records are fenced on.
func (e *memberEnv) enterRun(ctx context.Context) (RunRecord, int64, error) {
	for {
		cur, rev, err := currentRun(ctx, e.cli, e.keys, e.cfg.Job)
		if err != nil {
			return RunRecord{}, 0, err
		}
		want := e.cfg.Run
		switch {
		case want == "" && rev == 0:
			// The job's first run: name it, so that a member can later
			// ask for exactly this run (registering again after a loss).
			r, newRev, ok, err := nameFirstRun(ctx, e.cli, e.keys, e.cfg.Job, e.cfg.ID)
			if err != nil || ok {
				return r, newRev, err
			}
			continue
		case want == "" || want == cur.ID:
			return cur, rev, nil
		case !e.cfg.StartRun || slices.Contains(cur.Ended, want):
			return RunRecord{}, 0, &RunEndedError{Job: e.cfg.Job, Run: want, Current: cur}
		}
		r, newRev, ok, err := startRun(ctx, e.cli, e.keys, e.cfg.Job, want, e.cfg.ID, cur, rev)
		if err != nil {
			return RunRecord{}, 0, err
		}
		if ok {
			e.lg.Info("started a new run of the job; its commit records were cleared", zap.String("run", want), zap.String("ended", cur.ID))
			return r, newRev, nil
		}
	}
}

// checkRun returns a *RunEndedError when the job's run record, as read in
// kvs, is not the one this member joined.
func (e *memberEnv) checkRun(kvs []*mvccpb.KeyValue) error {
	cur, rev, err := decodeRun(kvs)
	if err != nil {
		return err
	}
	if rev != e.runRev {
		return &RunEndedError{Job: e.cfg.Job, Run: e.run, Current: cur}
	}
	return nil
}

// Run returns the run this member belongs to ("" : the default run).
func (m *Member) Run() string { return m.run }

// SetWaiting reports at once that the member waits, and for what: step
// is the job's committed step it waits for a holder of, reason says why
// for people (shown by the coordinator's API, dashboard and metrics).
// step 0 reports that it no longer waits.
func (m *Member) SetWaiting(ctx context.Context, step int64, reason string) error {
	if step == 0 {
		reason = ""
	}
	changed := m.rec.update(func(r *MemberRecord) bool {
		changed := r.WaitingFor != step || r.Waiting != reason
		r.WaitingFor, r.Waiting = step, reason
		return changed
	})
	if !changed {
		return nil
	}
	return m.rec.write(ctx, "waiting")
}

// checkRunName says what is wrong with a run id ("" is the default run).
func checkRunName(id string) error {
	if id == "" {
		return nil
	}
	if !ValidName(id) {
		return fmt.Errorf("%w: membership: run %q: want 1–128 of [A-Za-z0-9._-], starting with a letter or digit", comm.ErrInvalidArgument, id)
	}
	return nil
}
