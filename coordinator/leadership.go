package coordinator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/membership/gossip"
)

// leadership is one term of leading: the machine's driver. It reads every
// job (load), follows one watch on the root, the gossip deaths and the
// probes' verdicts, feeds each to the machine (machine.go), and carries out
// what it decides: fenced etcd writes, dials, the status and metrics. Only
// run's goroutine touches it; a probe's dial runs on its own goroutine and
// answers through verified.
type leadership struct {
	c        *Coordinator
	sess     *concurrency.Session
	fenceKey string // the leader key: every write is fenced on its create revision
	fenceRev int64
	m        *machine
	verified chan probed
	ctx      context.Context // the leadership's, for the probes' dials
}

func newLeadership(c *Coordinator, sess *concurrency.Session, fenceKey string, fenceRev int64) *leadership {
	cfg := machineConfig{name: c.cfg.Name, quorum: c.cfg.Quorum, signed: c.cfg.QuorumSigner != nil, trust: c.trust,
		trustSettings: c.trustSettings, probeWait: probeWait}
	return &leadership{c: c, sess: sess, fenceKey: fenceKey, fenceRev: fenceRev, m: newMachine(cfg), verified: make(chan probed, 64)}
}

// trust returns the quorum a record of job holds when the leader can trust
// it: signed by its key, or (without a signer) well-formed; in either
// encoding (membership.DecodeQuorumRecord), so that a coordinator started
// on a data directory written before the compact records loads it.
func (c *Coordinator) trust(job string, raw []byte) (membership.Quorum, bool) {
	var v *membership.QuorumVerifier
	if s := c.cfg.QuorumSigner; s != nil {
		v = s.Verifier()
	}
	q, err := membership.DecodeQuorumRecord(raw, v)
	return q, err == nil && q.Job == job
}

// trustSettings returns the settings document of job that raw holds when
// a coordinator wrote it: signed by its key (with a signer), or at least
// well-formed.
func (c *Coordinator) trustSettings(job string, raw []byte) (membership.JobSettings, bool) {
	var doc membership.JobSettings
	if s := c.cfg.QuorumSigner; s != nil {
		var err error
		doc, err = s.Verifier().VerifySettings(raw)
		return doc, err == nil && doc.Job == job
	}
	return doc, json.Unmarshal(raw, &doc) == nil && doc.Job == job
}

// sign is the leader's signature of a record's canonical bytes (nil: it
// does not sign).
func (c *Coordinator) sign() func([]byte) *membership.QuorumSignature {
	if s := c.cfg.QuorumSigner; s != nil {
		return s.Sign
	}
	return nil
}

func (l *leadership) run(ctx context.Context, gossipEvents <-chan gossip.Event) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	l.ctx = ctx
	defer func() {
		l.c.mu.Lock()
		clear(l.c.status)
		l.c.mu.Unlock()
	}()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		rev, err := l.load(ctx)
		if err != nil {
			return err
		}
		if err := l.follow(ctx, rev, timer, gossipEvents); err != nil {
			return err
		}
		// The watch broke (compaction, lost etcd leader): rebuild from a
		// fresh read.
	}
}

// load reads every job, feeds it to the machine with the gossip deaths
// seen meanwhile, decides, and returns the revision read at.
func (l *leadership) load(ctx context.Context) (int64, error) {
	keys := l.c.keys
	resp, err := l.c.cli.Get(ctx, keys.Prefix(), clientv3.WithPrefix())
	if err != nil {
		return 0, fmt.Errorf("coordinator: load state: %w", err)
	}
	in := loaded{jobs: map[string]*jobSnapshot{}}
	snap := func(job string) *jobSnapshot {
		s, ok := in.jobs[job]
		if !ok {
			s = &jobSnapshot{}
			in.jobs[job] = s
		}
		return s
	}
	for _, kv := range resp.Kvs {
		job, kind, rest, ok := keys.Parse(string(kv.Key))
		if !ok {
			continue
		}
		switch {
		case kind == "members":
			var r membership.MemberRecord
			if json.Unmarshal(kv.Value, &r) != nil {
				continue
			}
			r.Incarnation = kv.CreateRevision
			snap(job).members = append(snap(job).members, r)
		case kind == "_quorum":
			snap(job).quorum = &storedValue{kv.Value, kv.ModRevision}
		case kind == "_history":
			snap(job).history = append(snap(job).history, storedValue{kv.Value, kv.ModRevision})
		case kind == "epoch" && strings.HasPrefix(rest, "revoked/"):
			var r membership.Revocation
			if json.Unmarshal(kv.Value, &r) == nil {
				snap(job).revocations = append(snap(job).revocations, r)
			}
		case kind == "_settings":
			snap(job).settings = kv.Value
		case kind == "claims":
			if c, ok := claimOf(job, rest, kv); ok {
				snap(job).claims = append(snap(job).claims, c)
			}
		}
	}
	// Deaths gossip reported before this term.
	l.c.mu.Lock()
	for n := range l.c.deadSeen {
		in.deaths = append(in.deaths, n)
	}
	l.c.mu.Unlock()
	if err := l.feed(ctx, time.Now(), in); err != nil {
		return 0, err
	}
	if err := l.feed(ctx, time.Now(), tick{}); err != nil {
		return 0, err
	}
	return resp.Header.Revision, nil
}

// maxBatch bounds how long the coordinator applies watch responses that
// are ready before it decides (see follow).
const maxBatch = 50 * time.Millisecond

// follow feeds the machine watch events from rev+1, gossip deaths, probes'
// verdicts and its timer, and decides after each, until the watch breaks
// (nil) or leadership ends (an error).
func (l *leadership) follow(ctx context.Context, rev int64, timer *time.Timer, gossipEvents <-chan gossip.Event) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	keys := l.c.keys
	wch := l.c.cli.Watch(clientv3.WithRequireLeader(wctx), keys.Prefix(), clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithPrevKV())
	// applyWatch feeds one watch response; false when the watch broke.
	applyWatch := func(wr clientv3.WatchResponse, ok bool) (bool, error) {
		if !ok || wr.Err() != nil {
			if ctx.Err() == nil {
				l.c.lg.Info("watch broke; reloading", zap.Error(wr.Err()))
			}
			return false, nil
		}
		now := time.Now()
		for _, ev := range wr.Events {
			if in := l.event(ev); in != nil {
				if err := l.feed(ctx, now, in); err != nil {
					return false, err
				}
			}
		}
		return true, nil
	}
	for {
		l.armTimer(timer)
		select {
		case wr, ok := <-wch:
			if ok, err := applyWatch(wr, ok); !ok {
				return cmpErr(err, ctx.Err())
			}
			// Apply what else the watch has ready before deciding: a
			// decision looks at every member of the job, so deciding
			// after each response made a 10,000-member job's joins and
			// formed reports cost 10,000 decisions of 10,000 members
			// each, and the coordinator fell tens of seconds behind.
			// Bounded, so that a flood cannot hold a decision back long.
			for deadline := time.Now().Add(maxBatch); time.Now().Before(deadline); {
				select {
				case wr, ok := <-wch:
					if ok, err := applyWatch(wr, ok); !ok {
						return cmpErr(err, ctx.Err())
					}
					continue
				default:
				}
				break
			}
		case ev := <-gossipEvents:
			if ev.Kind == gossip.Dead {
				if err := l.feed(ctx, time.Now(), gossipDied{ev.Name}); err != nil {
					return err
				}
			}
		case v := <-l.verified:
			if err := l.feed(ctx, time.Now(), v); err != nil {
				return err
			}
		case <-timer.C:
		case <-l.sess.Done():
			return fmt.Errorf("%w: session expired", ErrNotLeader)
		case <-ctx.Done():
			return ctx.Err()
		}
		if err := l.feed(ctx, time.Now(), tick{}); err != nil {
			return err
		}
	}
}

// cmpErr returns the first error that is not nil.
func cmpErr(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// event is the machine's input for a watch event (nil: none).
func (l *leadership) event(ev *clientv3.Event) input {
	job, kind, rest, ok := l.c.keys.Parse(string(ev.Kv.Key))
	if !ok {
		return nil
	}
	switch {
	case kind == "members" && ev.Type == mvccpb.PUT:
		var r membership.MemberRecord
		if json.Unmarshal(ev.Kv.Value, &r) != nil {
			return nil
		}
		r.Incarnation = ev.Kv.CreateRevision
		return recordPut{job, r}
	case kind == "members" && ev.Type == mvccpb.DELETE:
		var inc int64
		if ev.PrevKv != nil {
			inc = ev.PrevKv.CreateRevision
		}
		return recordDeleted{job, rest, inc}
	case kind == "epoch" && strings.HasPrefix(rest, "revoked/") && ev.Type == mvccpb.PUT:
		var r membership.Revocation
		if json.Unmarshal(ev.Kv.Value, &r) == nil {
			return revocationPut{job, r}
		}
	case kind == "claims" && ev.Type == mvccpb.PUT:
		if c, ok := claimOf(job, rest, ev.Kv); ok {
			return c
		}
	case kind == "_settings" && ev.Type == mvccpb.PUT:
		return settingsPut{job, ev.Kv.Value}
	case kind == "_quorum":
		return quorumWritten{job, ev.Kv.ModRevision, ev.Kv.Value, ev.Type == mvccpb.DELETE}
	case kind == "_view":
		return viewWritten{job, ev.Kv.ModRevision, ev.Kv.Value, ev.Type == mvccpb.DELETE}
	}
	return nil
}

// claimOf reads a claim on member id.
func claimOf(job, id string, kv *mvccpb.KeyValue) (claimed, bool) {
	var c membership.Claim
	if json.Unmarshal(kv.Value, &c) != nil || id == "" {
		return claimed{}, false
	}
	return claimed{job: job, id: id, claim: c, rev: kv.ModRevision}, true
}

func (l *leadership) armTimer(t *time.Timer) {
	d := time.Hour
	if next := l.m.wake(); !next.IsZero() {
		d = max(time.Until(next), 0)
	}
	t.Reset(d)
}

// feed hands the machine one input and carries out the actions that
// follow. The answer to a write is fed back at once, before anything
// else. It returns an error when leadership ends: a write the fence
// refused (ErrNotLeader), a quorum it cannot encode, or ctx's end.
func (l *leadership) feed(ctx context.Context, now time.Time, in input) error {
	acts := slices.Clone(l.m.handle(now, in))
	for i := 0; i < len(acts); i++ {
		var answer *written
		switch a := acts[i].(type) {
		case publish:
			w, err := l.publish(ctx, a)
			if err != nil {
				return err
			}
			answer = &w
		case restoreRecord:
			w := l.fencedTxn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(l.c.keys.Quorum(a.job)), "=", a.ifRev)},
				clientv3.OpPut(l.c.keys.Quorum(a.job), string(a.value)))
			answer = &w
		case deleteRecord:
			w := l.fencedTxn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(l.c.keys.Quorum(a.job)), "=", a.ifRev)},
				clientv3.OpDelete(l.c.keys.Quorum(a.job)))
			answer = &w
		case deleteView:
			w := l.fencedTxn(ctx, nil, clientv3.OpDelete(l.c.keys.QuorumView(a.job)))
			answer = &w
		case probe:
			l.probe(a)
		case deleteClaim:
			key := l.c.keys.Claim(a.job, a.id)
			l.fencedTxn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", a.rev)}, clientv3.OpDelete(key))
		case deleteRegistration:
			l.deleteMember(ctx, a.job, a.rec)
		case removed:
			l.c.metrics.removals.WithLabelValues(a.job, removalLabel(a.removal.Cause)).Inc()
			l.c.lg.Info("member removed", zap.String("job", a.job), zap.String("member", a.id), zap.String("why", a.removal.String()))
		case status:
			l.report(a)
		case observe:
			l.observe(a)
		case logLine:
			l.logLine(a)
		case notLeader:
			return fmt.Errorf("%w: %s", ErrNotLeader, a.what)
		}
		if answer != nil {
			acts = append(acts, l.m.handle(time.Now(), *answer)...)
			if ctx.Err() != nil {
				return ctx.Err()
			}
		}
	}
	return nil
}

// fence is the compare every write of the leader carries: the leader key
// it campaigned with still exists.
func (l *leadership) fence() clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(l.fenceKey), "=", l.fenceRev)
}

// fencedTxn runs ops if the fence and cmps hold.
func (l *leadership) fencedTxn(ctx context.Context, cmps []clientv3.Cmp, ops ...clientv3.Op) written {
	tr, err := l.c.cli.Txn(ctx).If(append([]clientv3.Cmp{l.fence()}, cmps...)...).Then(ops...).Commit()
	if err != nil {
		return written{err: err}
	}
	return written{ok: tr.Succeeded, rev: tr.Header.Revision}
}

// publish writes a decision in one Txn fenced by the leader key and the
// quorum key's revision.
func (l *leadership) publish(ctx context.Context, a publish) (written, error) {
	ops, val, err := publishOps(l.c.keys, l.c.cfg.HistoryLimit, a, l.c.sign())
	if err != nil {
		return written{}, err
	}
	start := time.Now()
	w := l.fencedTxn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(l.c.keys.Quorum(a.job)), "=", a.ifRev)}, ops...)
	if w.err == nil {
		l.c.metrics.publishSeconds.Observe(time.Since(start).Seconds())
	} else if tooLarge(w.err) {
		// Retrying cannot help: say what would (the machine retries all
		// the same, as the next decision of the job may be smaller).
		l.c.metrics.tooLarge.WithLabelValues(a.job).Inc()
		n := 0
		if a.quorum != nil {
			n = len(a.quorum.Participants)
		}
		l.c.lg.Error("a quorum publication is larger than etcd takes: it can never be written as it is; raise etcd's --max-request-bytes (and the clients' send limit) or split the job",
			zap.String("job", a.job), zap.Int("bytes", opsBytes(ops)), zap.Int("participants", n), zap.Error(w.err))
	}
	w.value = val
	return w, nil
}

// tooLarge reports whether a request failed for its size: refused by
// etcd (--max-request-bytes) or by the client before it was sent (its
// gRPC send limit).
func tooLarge(err error) bool {
	return errors.Is(err, rpctypes.ErrRequestTooLarge) || errors.Is(err, rpctypes.ErrGRPCRequestTooLarge) ||
		grpcstatus.Code(err) == codes.ResourceExhausted
}

// opsBytes is about the size of a transaction of ops: their keys and
// values.
func opsBytes(ops []clientv3.Op) int {
	n := 0
	for _, op := range ops {
		n += len(op.KeyBytes()) + len(op.ValueBytes())
		if op.IsTxn() {
			_, thenOps, elseOps := op.Txn()
			n += opsBytes(thenOps) + opsBytes(elseOps)
		}
	}
	return n
}

// publishOps are the operations of a publication (fenced by the caller),
// and the quorum record they store (nil: a revocation alone): the
// revocation, if any, unless one of its epoch is stored; the quorum's
// record and history entry (the whole list, compact: EncodeQuorumRecord)
// and its view (a change of the previous epoch); the deletion of history,
// revocations and rendezvous keys past their time, and of the whole list
// a coordinator of the old encoding kept apart (…/viewfull: the record is
// that list now). At 100,000 participants they are about 0.7 MB, under
// etcd's default request limit (TestEpochTxnFitsEtcdDefaults).
func publishOps(k etcdkeys.Layout, historyLimit int, a publish, sign func([]byte) *membership.QuorumSignature) ([]clientv3.Op, []byte, error) {
	job := a.job
	var ops []clientv3.Op
	if r := a.revocation; r != nil {
		val, _ := json.Marshal(r)
		rk := k.Revocation(job, r.Epoch)
		ops = append(ops, clientv3.OpTxn(
			[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(rk), "=", 0)},
			[]clientv3.Op{clientv3.OpPut(rk, string(val))}, nil))
	}
	q := a.quorum
	if q == nil {
		return ops, nil, nil
	}
	val, err := membership.EncodeQuorumRecord(*q, a.viewRev, a.settings, sign)
	if err != nil {
		return nil, nil, fmt.Errorf("coordinator: encode quorum: %w", err)
	}
	// Members watch the view, not the record: a change of the previous
	// epoch, a few bytes per participant that changed.
	view := val
	if a.prev != nil {
		if view, err = membership.EncodeQuorumViewWith(a.prev, *q, a.viewRev, a.settings, sign); err != nil {
			return nil, nil, fmt.Errorf("coordinator: encode quorum view: %w", err)
		}
	}
	// The view after the record: the watch delivers the record's event
	// first (see machine.onQuorumWritten).
	ops = append(ops, clientv3.OpPut(k.Quorum(job), string(val)), clientv3.OpPut(k.QuorumView(job), string(view)),
		clientv3.OpPut(k.HistoryEntry(job, q.Epoch), string(val)), clientv3.OpDelete(k.QuorumViewFull(job)))
	if lim := uint64(historyLimit); q.Epoch > lim {
		ops = append(ops,
			clientv3.OpDelete(k.HistoryEntry(job, 0), clientv3.WithRange(k.HistoryEntry(job, q.Epoch-lim))),
			clientv3.OpDelete(k.Revocation(job, 0), clientv3.WithRange(k.Revocation(job, q.Epoch-lim))))
	}
	if q.Epoch > 2 {
		// Rendezvous keys of epochs before the previous one are done.
		ops = append(ops, clientv3.OpDelete(k.RendezvousPrefix(job, 0), clientv3.WithRange(k.RendezvousPrefix(job, q.Epoch-1))))
	}
	return ops, val, nil
}

// probe dials a blamed member's address on its own goroutine, which ends
// with the dial (verifyTimeout) or the leadership; the verdict comes back
// through verified.
func (l *leadership) probe(a probe) {
	ctx := l.ctx
	go func() {
		dead, err := probeDead(ctx, a.addr)
		select {
		case l.verified <- probed{job: a.job, id: a.id, inc: a.inc, dead: dead, err: err}:
		case <-ctx.Done():
		}
	}()
}

// deleteMember deletes a member's key if this leader still leads and the
// incarnation still holds it, then revokes its lease unless the lease is
// its replica group's.
func (l *leadership) deleteMember(ctx context.Context, job string, rec membership.MemberRecord) {
	key := l.c.keys.Member(job, rec.ID)
	w := l.fencedTxn(ctx, []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(key), "=", rec.Incarnation)}, clientv3.OpDelete(key))
	if w.err != nil || !w.ok {
		return
	}
	if rec.Lease != 0 && !rec.SharedLease { // a group's lease stays with the group's other members
		l.c.cli.Revoke(ctx, clientv3.LeaseID(rec.Lease))
	}
}

// report keeps the leader's view of a job for Status and the metrics.
func (l *leadership) report(a status) {
	m := l.c.metrics
	st := JobStatus{Job: a.job, Members: a.members, Quorum: a.quorum, Waiting: a.waiting, Updated: a.at,
		Target: a.target, Spares: a.spares, ReadySpares: a.ready, UnusableSpares: a.unusable}
	if q := a.quorum; q != nil {
		m.epoch.WithLabelValues(a.job).Set(float64(q.Epoch))
		m.participants.WithLabelValues(a.job).Set(float64(len(q.Participants)))
	}
	m.members.WithLabelValues(a.job).Set(float64(a.members))
	m.stalled.WithLabelValues(a.job).Set(float64(a.stalled))
	m.target.WithLabelValues(a.job).Set(float64(a.target))
	m.spares.WithLabelValues(a.job, spareWaiting).Set(float64(len(a.spares)))
	m.spares.WithLabelValues(a.job, spareReady).Set(float64(len(a.ready)))
	unusable := 0
	for _, u := range a.unusable {
		unusable += len(u.Members)
	}
	m.spares.WithLabelValues(a.job, spareUnusable).Set(float64(unusable))
	l.c.mu.Lock()
	l.c.status[a.job] = st
	m.jobs.Set(float64(len(l.c.status)))
	l.c.mu.Unlock()
}

func (l *leadership) observe(a observe) {
	m := l.c.metrics
	switch a.what {
	case metricJoin:
		m.joins.WithLabelValues(a.job).Inc()
	case metricForeign:
		m.foreign.WithLabelValues(a.job).Inc()
	case metricQuorum:
		m.quorums.WithLabelValues(a.job).Inc()
	case metricStalled:
		m.stalled.WithLabelValues(a.job).Set(a.value)
	}
}

func (l *leadership) logLine(a logLine) {
	fs := make([]zap.Field, 0, len(a.fields))
	for _, f := range a.fields {
		switch v := f.value.(type) {
		case nil:
		case error:
			fs = append(fs, zap.NamedError(f.key, v))
		default:
			fs = append(fs, zap.Any(f.key, v))
		}
	}
	if a.warn {
		l.c.lg.Warn(a.msg, fs...)
	} else {
		l.c.lg.Info(a.msg, fs...)
	}
}
