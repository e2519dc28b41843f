package coordinator

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/membership"
)

// A job's settings (membership.JobSettings): any coordinator instance
// changes the document — validated whole, versioned, signed with the
// coordinators' quorum key, stored only if no other change came first —
// and the leader publishes it with the job's next quorum, from whose
// first step every replica of the epoch uses it.

// SettingsUpdate is what SetSettings did.
type SettingsUpdate struct {
	Settings membership.JobSettings `json:"settings"`
	// Epoch is the first epoch that carries the new version (0: none yet —
	// the job has no replicas, or no quorum came within the wait).
	Epoch uint64 `json:"epoch,omitempty"`
	// Pending says, when Epoch is 0, why.
	Pending string `json:"pending,omitempty"`
}

// settingsWait bounds how long SetSettings waits for the quorum that puts
// a new version in force.
const settingsWait = 10 * time.Second

// Settings returns a job's settings document (version 0, no values, when
// none was ever set).
func (a *Admin) Settings(ctx context.Context, job string) (membership.JobSettings, error) {
	doc, _, err := a.settings(ctx, job)
	return doc, err
}

// settings reads a job's settings document and its mod revision (0: none).
func (a *Admin) settings(ctx context.Context, job string) (membership.JobSettings, int64, error) {
	if err := checkName("job", job); err != nil {
		return membership.JobSettings{}, 0, err
	}
	resp, err := a.cli.Get(ctx, a.keys.Settings(job))
	if err != nil {
		return membership.JobSettings{}, 0, fmt.Errorf("coordinator: read the settings of %s: %w", job, ctxErr(ctx, err))
	}
	doc := membership.JobSettings{Job: job, Values: map[string]membership.Setting{}}
	if len(resp.Kvs) == 0 {
		return doc, 0, nil
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &doc); err != nil {
		return membership.JobSettings{}, 0, fmt.Errorf("coordinator: the settings document of %s: %w", job, err)
	}
	return doc, resp.Kvs[0].ModRevision, nil
}

// SetSettings changes a job's settings: all of changes or none (a value
// that does not parse as its key's type fails the whole with an error
// wrapping comm.ErrInvalidArgument, and nothing is stored). The new
// version is signed with the coordinators' quorum key and stored unless
// another change came first (then it applies the changes to that one).
// It then waits, up to ctx or 10 s, for the leader to publish the quorum
// that puts the version in force, and says which epoch that is.
func (c *Coordinator) SetSettings(ctx context.Context, job string, changes []membership.SettingChange, by string) (SettingsUpdate, error) {
	a := NewAdmin(c.cli, c.cfg.Root)
	if by == "" {
		by = "operator"
	}
	var doc membership.JobSettings
	var rev int64
	for {
		cur, curRev, err := a.settings(ctx, job)
		if err != nil {
			return SettingsUpdate{}, err
		}
		next, err := cur.Apply(changes)
		if err != nil {
			return SettingsUpdate{}, err
		}
		next.Job, next.Updated, next.By = job, time.Now().UTC(), by
		raw, err := json.Marshal(next)
		if err != nil {
			return SettingsUpdate{}, err
		}
		if s := c.cfg.QuorumSigner; s != nil {
			msg, _, err := membership.CanonicalSettings(raw)
			if err != nil {
				return SettingsUpdate{}, err
			}
			next.Signature = s.Sign(msg)
			if raw, err = json.Marshal(next); err != nil {
				return SettingsUpdate{}, err
			}
		}
		key := a.keys.Settings(job)
		tr, err := c.cli.Txn(ctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", curRev)).
			Then(clientv3.OpPut(key, string(raw))).Commit()
		if err != nil {
			return SettingsUpdate{}, fmt.Errorf("coordinator: store the settings of %s: %w", job, ctxErr(ctx, err))
		}
		if tr.Succeeded {
			doc, rev = next, tr.Header.Revision
			break
		}
	}
	c.lg.Info("job settings stored", zap.String("job", job), zap.Uint64("version", doc.Version), zap.String("by", by),
		zap.String("settings", doc.Summary()))
	up := SettingsUpdate{Settings: doc}
	wctx, cancel := context.WithTimeout(ctx, settingsWait)
	defer cancel()
	epoch, err := a.awaitSettings(wctx, job, doc.Version, rev)
	switch {
	case err == nil:
		up.Epoch = epoch
	case ctx.Err() == nil:
		up.Pending = fmt.Sprintf("stored; no quorum carries it yet (%v): it takes effect from the job's next epoch", err)
	default:
		up.Pending = "stored; the wait for the quorum that carries it ended: " + ctx.Err().Error()
	}
	return up, nil
}

// awaitSettings waits for the job's quorum record to carry settings
// version (or a later one), watching from revision rev, and returns its
// epoch.
func (a *Admin) awaitSettings(ctx context.Context, job string, version uint64, rev int64) (uint64, error) {
	carries := func(raw []byte) (uint64, bool) {
		q, err := membership.DecodeQuorumRecord(raw, nil)
		if err != nil || q.Settings == nil || q.Settings.Version < version {
			return 0, false
		}
		return q.Epoch, true
	}
	resp, err := a.cli.Get(ctx, a.keys.Quorum(job))
	if err != nil {
		return 0, ctxErr(ctx, err)
	}
	if len(resp.Kvs) == 0 {
		return 0, fmt.Errorf("%w for job %q", ErrNoQuorum, job)
	}
	if e, ok := carries(resp.Kvs[0].Value); ok {
		return e, nil
	}
	for wr := range a.cli.Watch(ctx, a.keys.Quorum(job), clientv3.WithRev(max(rev, resp.Header.Revision)+1)) {
		if err := wr.Err(); err != nil {
			return 0, err
		}
		for _, ev := range wr.Events {
			if e, ok := carries(ev.Kv.Value); ok {
				return e, nil
			}
		}
	}
	return 0, ctxErr(ctx, ctx.Err())
}
