package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// Admin reads and manages jobs through etcd directly, for operators and
// any coordinator instance (leader or not). Safe for concurrent use.
type Admin struct {
	cli  *clientv3.Client
	keys etcdkeys.Layout
}

// NewAdmin returns an Admin over the keys under root ("" : etcdkeys.DefaultRoot).
func NewAdmin(cli *clientv3.Client, root string) *Admin {
	return &Admin{cli: cli, keys: etcdkeys.Layout{Root: root}}
}

// JobSummary is one line of Jobs.
type JobSummary struct {
	Job          string    `json:"job"`
	Members      int       `json:"members"`
	Epoch        uint64    `json:"epoch"`
	Participants int       `json:"participants"`
	Updated      time.Time `json:"updated"` // when the current quorum formed
}

// MemberView is a member as the dashboard shows it.
type MemberView struct {
	membership.MemberRecord
	Incarnation int64 `json:"incarnation"`
	// Rank in the current quorum, -1 when not a participant.
	Rank int `json:"rank"`
	// Healing: a participant whose reported step is behind the quorum's
	// max step (it is catching up from its peers).
	Healing bool `json:"healing"`
}

// JobView is a job's current state.
type JobView struct {
	Job    string             `json:"job"`
	Quorum *membership.Quorum `json:"quorum,omitempty"`
	// Step is the highest step a live member reported. Members report
	// their step with their heartbeats, so it trails the job by up to a
	// heartbeat interval; the quorum's MaxStep is older still (the
	// participants' reports when it formed).
	Step int64 `json:"step"`
	// Run is the job's current run (nil: the default run, "").
	Run         *membership.RunRecord   `json:"run,omitempty"`
	Members     []MemberView            `json:"members"`
	Revocations []membership.Revocation `json:"revocations,omitempty"` // newest first
	// WaitingMembers are the members that wait for a holder of a step
	// the job committed (MemberRecord.WaitingFor), by id.
	WaitingMembers []string `json:"waitingMembers,omitempty"`
	// Settings is the job's settings document (nil: none was set); the
	// quorum's Settings says which version is in force.
	Settings *membership.JobSettings `json:"settings,omitempty"`
}

// Jobs lists the jobs that have members or a quorum.
func (a *Admin) Jobs(ctx context.Context) ([]JobSummary, error) {
	resp, err := a.cli.Get(ctx, a.keys.Prefix(), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		return nil, fmt.Errorf("coordinator: list jobs: %w", ctxErr(ctx, err))
	}
	byJob := map[string]*JobSummary{}
	var names []string
	for _, kv := range resp.Kvs {
		job, kind, _, ok := a.keys.Parse(string(kv.Key))
		if !ok || !(kind == "members" || kind == "_quorum") {
			continue
		}
		s, ok := byJob[job]
		if !ok {
			s = &JobSummary{Job: job}
			byJob[job] = s
			names = append(names, job)
		}
		if kind == "members" {
			s.Members++
		}
	}
	sort.Strings(names)
	out := make([]JobSummary, 0, len(names))
	for _, name := range names {
		s := byJob[name]
		if q, err := a.Quorum(ctx, name); err == nil {
			s.Epoch, s.Participants, s.Updated = q.Epoch, len(q.Participants), q.Created
		}
		out = append(out, *s)
	}
	return out, nil
}

// Quorum returns a job's current quorum (ErrNoQuorum when none), as its
// record holds it: the participants carry ID, Group and Incarnation (their
// addresses and steps are in the members' records: Job fills them in).
func (a *Admin) Quorum(ctx context.Context, job string) (membership.Quorum, error) {
	if err := checkName("job", job); err != nil {
		return membership.Quorum{}, err
	}
	resp, err := a.cli.Get(ctx, a.keys.Quorum(job))
	if err != nil {
		return membership.Quorum{}, fmt.Errorf("coordinator: read quorum of %s: %w", job, ctxErr(ctx, err))
	}
	if len(resp.Kvs) == 0 {
		return membership.Quorum{}, fmt.Errorf("%w for job %q", ErrNoQuorum, job)
	}
	q, err := membership.DecodeQuorumRecord(resp.Kvs[0].Value, nil)
	if err != nil {
		return membership.Quorum{}, fmt.Errorf("coordinator: quorum record of %s: %w", job, err)
	}
	return q, nil
}

// Job returns a job's members, quorum and recent revocations
// (ErrNotFound for a job with neither members nor quorum).
func (a *Admin) Job(ctx context.Context, job string) (JobView, error) {
	if err := checkName("job", job); err != nil {
		return JobView{}, err
	}
	resp, err := a.cli.Txn(ctx).Then(
		clientv3.OpGet(a.keys.Members(job), clientv3.WithPrefix()),
		clientv3.OpGet(a.keys.Revocations(job), clientv3.WithPrefix()),
		clientv3.OpGet(a.keys.Quorum(job)),
		clientv3.OpGet(a.keys.Run(job)),
		clientv3.OpGet(a.keys.Settings(job)),
	).Commit()
	if err != nil {
		return JobView{}, fmt.Errorf("coordinator: read job %s: %w", job, ctxErr(ctx, err))
	}
	v := JobView{Job: job, Members: []MemberView{}}
	for _, kv := range resp.Responses[4].GetResponseRange().Kvs {
		var st membership.JobSettings
		if json.Unmarshal(kv.Value, &st) == nil {
			st.Signature = nil
			v.Settings = &st
		}
	}
	for _, kv := range resp.Responses[3].GetResponseRange().Kvs {
		var r membership.RunRecord
		if json.Unmarshal(kv.Value, &r) == nil {
			v.Run = &r
		}
	}
	for _, kv := range resp.Responses[2].GetResponseRange().Kvs {
		if q, err := membership.DecodeQuorumRecord(kv.Value, nil); err == nil {
			v.Quorum = &q
		}
	}
	var rank map[string]int // participant id → rank
	if v.Quorum != nil {
		rank = make(map[string]int, len(v.Quorum.Participants))
		for i, p := range v.Quorum.Participants {
			rank[p.ID] = i
		}
	}
	for _, kv := range resp.Responses[1].GetResponseRange().Kvs {
		var r membership.Revocation
		if json.Unmarshal(kv.Value, &r) == nil {
			v.Revocations = append(v.Revocations, r)
		}
	}
	sort.Slice(v.Revocations, func(i, j int) bool { return v.Revocations[i].Epoch > v.Revocations[j].Epoch })
	if len(v.Revocations) > 20 {
		v.Revocations = v.Revocations[:20]
	}
	for _, kv := range resp.Responses[0].GetResponseRange().Kvs {
		var r membership.MemberRecord
		if json.Unmarshal(kv.Value, &r) != nil {
			continue
		}
		v.Step = max(v.Step, r.Step)
		if r.WaitingFor > 0 {
			v.WaitingMembers = append(v.WaitingMembers, r.ID)
		}
		mv := MemberView{MemberRecord: r, Incarnation: kv.CreateRevision, Rank: -1}
		mv.MemberRecord.Incarnation = kv.CreateRevision
		if i, ok := rank[r.ID]; ok && v.Quorum.Participants[i].Incarnation == kv.CreateRevision {
			// The record holds ids; the address and step are the member's.
			p := &v.Quorum.Participants[i]
			p.Addr, p.Step = r.Addr, r.Step
			mv.Rank = i
			mv.Healing = r.Step < v.Quorum.MaxStep
		}
		v.Members = append(v.Members, mv)
	}
	if len(v.Members) == 0 && v.Quorum == nil && v.Run == nil {
		return v, fmt.Errorf("%w: job %q", ErrNotFound, job)
	}
	return v, nil
}

// NewRun starts a new run of a job (membership.StartRun): id, or a fresh
// one when empty, becomes the job's current run and the job's commit
// records are cleared, so that trainers started from step 0 can record
// theirs. It fails with a *membership.RunBusyError while the job has live
// members (stop or evict them first), and with a
// *membership.RunEndedError for an id the job used before.
func (a *Admin) NewRun(ctx context.Context, job, id, by string) (membership.RunRecord, error) {
	if by == "" {
		by = "operator"
	}
	return membership.StartRun(ctx, a.cli, a.keys.Root, job, id, by)
}

// History returns up to limit past quorums of a job, newest first, as
// their entries hold them (see Quorum).
func (a *Admin) History(ctx context.Context, job string, limit int) ([]membership.Quorum, error) {
	if err := checkName("job", job); err != nil {
		return nil, err
	}
	if limit <= 0 {
		return nil, fmt.Errorf("%w: coordinator: history limit %d", comm.ErrInvalidArgument, limit)
	}
	resp, err := a.cli.Get(ctx, a.keys.History(job), clientv3.WithPrefix(),
		clientv3.WithSort(clientv3.SortByKey, clientv3.SortDescend), clientv3.WithLimit(int64(limit)))
	if err != nil {
		return nil, fmt.Errorf("coordinator: read history of %s: %w", job, ctxErr(ctx, err))
	}
	out := make([]membership.Quorum, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		if q, err := membership.DecodeQuorumRecord(kv.Value, nil); err == nil {
			out = append(out, q)
		}
	}
	return out, nil
}

// DefaultEvictKeepOut is how long an evicted member may not register
// again unless told otherwise (Admin.Evict, Config).
const DefaultEvictKeepOut = time.Minute

// Evict is EvictFor with DefaultEvictKeepOut.
func (a *Admin) Evict(ctx context.Context, job, id, by string) error {
	_, err := a.EvictFor(ctx, job, id, by, DefaultEvictKeepOut)
	return err
}

// EvictFor removes a member and keeps it out for keepOut (0 or less: not
// at all): a keep-out record is stored, the member's record is marked
// evicted (so the coordinator tells the cause), then deleted and its
// lease revoked. The member's Done fires with membership.ErrEvicted, and
// membership.Join of that id fails with a *membership.KeptOutError until
// the returned time. ErrNotFound when no such member is live. The keep-out ends at its time even if no
// coordinator runs (it is bound to an etcd lease; keepOut is rounded up
// to whole seconds, at least etcd's 2 s minimum).
func (a *Admin) EvictFor(ctx context.Context, job, id, by string, keepOut time.Duration) (until time.Time, err error) {
	if err := checkName("job", job); err != nil {
		return time.Time{}, err
	}
	if err := checkName("member id", id); err != nil {
		return time.Time{}, err
	}
	fail := func(err error) (time.Time, error) {
		return time.Time{}, fmt.Errorf("coordinator: evict %s/%s: %w", job, id, ctxErr(ctx, err))
	}
	key := a.keys.Member(job, id)
	resp, err := a.cli.Get(ctx, key)
	if err != nil {
		return fail(err)
	}
	if len(resp.Kvs) == 0 {
		return time.Time{}, fmt.Errorf("%w: member %q of job %q", ErrNotFound, id, job)
	}
	kv := resp.Kvs[0]
	var r membership.MemberRecord
	if err := json.Unmarshal(kv.Value, &r); err != nil {
		return time.Time{}, fmt.Errorf("coordinator: evict %s/%s: unreadable record: %w", job, id, err)
	}
	if by == "" {
		by = "operator"
	}
	r.Evicted = by
	val, _ := json.Marshal(r)
	ops := []clientv3.Op{clientv3.OpPut(key, string(val), clientv3.WithIgnoreLease())}
	if keepOut > 0 {
		secs := max(int64((keepOut+time.Second-1)/time.Second), 2)
		lease, err := a.cli.Grant(ctx, secs)
		if err != nil {
			return fail(err)
		}
		until = time.Now().Add(time.Duration(secs) * time.Second)
		ko, _ := json.Marshal(membership.KeepOut{By: by, Until: until})
		ops = append(ops, clientv3.OpPut(a.keys.Evicted(job, id), string(ko), clientv3.WithLease(lease.ID)))
	}
	same := clientv3.Compare(clientv3.CreateRevision(key), "=", kv.CreateRevision)
	if _, err := a.cli.Txn(ctx).If(same).Then(ops...).Commit(); err != nil {
		return fail(err)
	}
	if _, err := a.cli.Txn(ctx).If(same).Then(clientv3.OpDelete(key)).Commit(); err != nil {
		return fail(err)
	}
	if r.Lease != 0 && !r.SharedLease { // a group's lease stays with the group's other members
		if _, err := a.cli.Revoke(ctx, clientv3.LeaseID(r.Lease)); err != nil && ctx.Err() != nil {
			return fail(err)
		}
	}
	return until, nil
}

// Leader returns the name of the leading coordinator (ErrNotFound when
// none leads).
func (a *Admin) Leader(ctx context.Context) (string, error) {
	resp, err := a.cli.Get(ctx, a.keys.Election()+"/", clientv3.WithFirstCreate()...)
	if err != nil {
		return "", fmt.Errorf("coordinator: read leader: %w", ctxErr(ctx, err))
	}
	if len(resp.Kvs) == 0 {
		return "", fmt.Errorf("%w: no coordinator leads", ErrNotFound)
	}
	return string(resp.Kvs[0].Value), nil
}
