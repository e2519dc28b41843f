package main

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/membership"
)

// The phases of a run, in order; each prints its figures (loadRun.fig).

// form is phase 1: the members join (the groups' leaders first, then
// the others), and it waits for the first quorum holding everyone.
func (l *loadRun) form(ctx context.Context) error {
	o, n := l.o, l.n
	keys := etcdkeys.Layout{}
	cpu0, etcd0, self0, b0 := l.coord.cpu(), cpus(l.etcds), l.membersCPU(), l.watchBytes(ctx)
	start := time.Now()
	var joined time.Time
	for wave := 0; wave < 2; wave++ {
		rs, err := all(ctx, l.shards, shardReq{Op: "join", Wave: wave})
		if err != nil {
			return fmt.Errorf("join: %w", err)
		}
		for _, r := range rs {
			if r.LastJoin > joined.UnixNano() {
				joined = time.Unix(0, r.LastJoin)
			}
		}
	}
	l.fig("join.seconds", joined.Sub(start).Seconds(), "%.2f s to register %d members", joined.Sub(start).Seconds(), n)
	decided, seenAll, epoch, err := l.waitShards(ctx, shardReq{Size: o.members})
	if err != nil {
		return fmt.Errorf("first quorum: %w", err)
	}
	wb := l.watchBytes(ctx) - b0
	l.fig("form.decided_after_last_join", decided.Sub(joined).Seconds(), "%.2f s (the coordinator decided the full quorum, after the last join)", decided.Sub(joined).Seconds())
	l.fig("form.all_seen_after_last_join", seenAll.Sub(joined).Seconds(), "%.2f s (the last member saw it)", seenAll.Sub(joined).Seconds())
	l.fig("form.epochs_per_job", float64(epoch), "%d epochs (the highest job's) to the full quorum", epoch)
	l.fig("form.watch_bytes_per_member", float64(wb)/float64(n), "%.0f B received on watches per member while forming", float64(wb)/float64(n))
	el := time.Since(start).Seconds()
	l.fig("form.coordinator_cores", (l.coord.cpu()-cpu0).Seconds()/el, "%.2f cores (coordinator, over %.1f s)", (l.coord.cpu()-cpu0).Seconds()/el, el)
	for i, c := range l.etcds {
		l.fig("form."+c.name+"_cores", (c.cpu()-etcd0[i]).Seconds()/el, "%.2f cores", (c.cpu()-etcd0[i]).Seconds()/el)
	}
	l.fig("form.members_process_cores", (l.membersCPU()-self0).Seconds()/el, "%.2f cores (the members' processes and this one)", (l.membersCPU()-self0).Seconds()/el)
	dbSizes(ctx, l.admin, l.clientAddrs, "form", l.fig)
	// The largest request a publication makes is about three records
	// (record, history entry, the view of a forming epoch): etcd runs
	// with its default limit, and refuses anything larger.
	if r, err := l.admin.Get(ctx, keys.Quorum(jobName(0))); err == nil && len(r.Kvs) > 0 {
		b := len(r.Kvs[0].Value)
		l.fig("form.record_bytes", float64(b), "%d B: the quorum record of %d participants (%.2f B each); a publication ≤ ~%d B, etcd's default limit %d B",
			b, o.members, float64(b)/float64(o.members), 3*b, membership.MaxRequestBytes)
	}
	l.cur = epoch
	return nil
}

// steady is phase 2: nothing changes for -steady, and it measures what
// that costs.
func (l *loadRun) steady(ctx context.Context) error {
	o, n := l.o, l.n
	keys := etcdkeys.Layout{}
	epoch0 := l.cur
	cpu0, etcd0, self0, b0 := l.coord.cpu(), cpus(l.etcds), l.membersCPU(), l.watchBytes(ctx)
	t0 := time.Now()
	select {
	case <-time.After(o.steady):
	case <-ctx.Done():
		return ctx.Err()
	}
	el := time.Since(t0).Seconds()
	changed := 0
	for j := range o.jobs {
		q, err := coordinator.NewAdmin(l.admin, "").Quorum(ctx, jobName(j))
		if err == nil && q.Epoch != epoch0 {
			changed++
		}
	}
	l.fig("steady.jobs_with_new_epochs", float64(changed), "%d jobs published an epoch in %.0f s steady (want 0)", changed, el)
	l.fig("steady.coordinator_cores", (l.coord.cpu()-cpu0).Seconds()/el, "%.3f cores (coordinator), RSS %d MiB", (l.coord.cpu()-cpu0).Seconds()/el, l.coord.rssMiB())
	for i, c := range l.etcds {
		l.fig("steady."+c.name+"_cores", (c.cpu()-etcd0[i]).Seconds()/el, "%.3f cores, RSS %d MiB", (c.cpu()-etcd0[i]).Seconds()/el, c.rssMiB())
	}
	l.fig("steady.members_process_cores", (l.membersCPU()-self0).Seconds()/el, "%.3f cores (the members' processes)", (l.membersCPU()-self0).Seconds()/el)
	l.fig("steady.watch_bytes_per_member_s", float64(l.watchBytes(ctx)-b0)/float64(n)/el, "%.1f B/s per member on watches", float64(l.watchBytes(ctx)-b0)/float64(n)/el)
	// The leases the members' registrations are bound to: one per member,
	// or one per replica group with -group-lease.
	leases := map[int64]bool{}
	for j := range o.jobs {
		resp, err := l.admin.Get(ctx, keys.Members(jobName(j)), clientv3.WithPrefix())
		if err != nil {
			return fmt.Errorf("count leases: %w", err)
		}
		for _, kv := range resp.Kvs {
			leases[kv.Lease] = true
		}
	}
	l.fig("steady.member_leases", float64(len(leases)), "%d leases hold the %d members' registrations (%.0f renewals/s at TTL %v)",
		len(leases), n, float64(len(leases))*3/o.leaseTTL.Seconds(), o.leaseTTL)
	return nil
}

// death is phase 3: one member of job 0 dies (-death says how).
func (l *loadRun) death(ctx context.Context) error {
	o, p := l.o, l.p
	l.size = o.members
	cur := l.cur
	cpu0, b0 := l.coord.cpu(), l.watchBytes(ctx)
	victimID := memberID(p.single)
	killed := time.Now()
	if o.shards == 0 {
		// In one process: its address refuses (report) or its lease goes.
		if _, err := l.shards[0].call(ctx, shardReq{Op: "die", Rank: p.single, How: o.death}); err != nil {
			return err
		}
	} else {
		vs := l.byName["victim"]
		r, err := vs.call(ctx, shardReq{Op: "stats", Rank: p.single})
		if err != nil {
			return err
		}
		killed = time.Now()
		vs.kill() // its process is gone: the port refuses, its group link resets
		if o.death == "lease" {
			if _, err := l.admin.Revoke(ctx, clientv3.LeaseID(r.Lease)); err != nil && !o.groupLease {
				return err
			}
		}
	}
	if o.death == "report" {
		// A peer's collective failed: it revokes the epoch blaming it, as ft does.
		if _, err := all(ctx, l.live()[:1], shardReq{Op: "revoke", Epoch: cur, Blame: []string{victimID}}); err != nil {
			return err
		}
	}
	l.size--
	l.gone[victimID] = true
	decided, seenAll, epoch, err := l.waitShards(ctx, shardReq{After: cur, Size: l.size, Without: []string{victimID}})
	if err != nil {
		return fmt.Errorf("quorum after the death: %w", err)
	}
	l.fig("death.decided", decided.Sub(killed).Seconds(), "%.3f s from the death (%s) to the quorum without it (epoch %d → %d)", decided.Sub(killed).Seconds(), o.death, cur, epoch)
	l.fig("death.all_seen", seenAll.Sub(killed).Seconds(), "%.3f s until every survivor of the job saw it", seenAll.Sub(killed).Seconds())
	de := float64(epoch - cur)
	l.fig("death.watch_bytes_per_member_epoch", float64(l.watchBytes(ctx)-b0)/float64(o.members)/de,
		"%.0f B per member of the job per epoch (all watch bytes of the phase / %d members / %.0f epochs)", float64(l.watchBytes(ctx)-b0)/float64(o.members)/de, o.members, de)
	l.fig("death.coordinator_cpu_seconds", (l.coord.cpu() - cpu0).Seconds(), "%.3f s of coordinator CPU in %.2f s", (l.coord.cpu() - cpu0).Seconds(), time.Since(killed).Seconds())
	l.cur = epoch
	return nil
}

// leaderDeath is phase 4: a group's leader dies; its group's ranks
// follow the member that takes the lease over.
func (l *loadRun) leaderDeath(ctx context.Context) error {
	o, p := l.o, l.p
	ls := l.byName["leader"]
	if ls == nil {
		return nil // no such phase (planShards)
	}
	cur := l.cur
	r, err := ls.call(ctx, shardReq{Op: "stats", Rank: p.leader})
	if err != nil {
		return err
	}
	group := fmt.Sprintf("g%06d", p.leader/o.groupSize)
	leaderID := memberID(p.leader)
	killed := time.Now()
	ls.kill()
	l.size--
	l.gone[leaderID] = true
	followed := make(chan error, 1)
	var followedAt atomic.Int64
	go func() {
		rs, err := all(ctx, l.live(), shardReq{Op: "follow", Group: group, NotLease: r.Lease})
		for _, x := range rs {
			followedAt.Store(max(followedAt.Load(), x.Seen))
		}
		followed <- err
	}()
	decided, seenAll, epoch, err := l.waitShards(ctx, shardReq{After: cur, Size: l.size, Without: []string{leaderID}})
	if err != nil {
		return fmt.Errorf("quorum after the leader's death: %w", err)
	}
	if err := <-followed; err != nil {
		return fmt.Errorf("the group following its new leader: %w", err)
	}
	l.fig("leader_death.followed", time.Unix(0, followedAt.Load()).Sub(killed).Seconds(), "%.3f s from the leader's death (SIGKILL) until its group's %d other ranks were on the new leader's lease", time.Unix(0, followedAt.Load()).Sub(killed).Seconds(), o.groupSize-1)
	l.fig("leader_death.decided", decided.Sub(killed).Seconds(), "%.3f s to the quorum without it (epoch %d → %d)", decided.Sub(killed).Seconds(), cur, epoch)
	l.fig("leader_death.all_seen", seenAll.Sub(killed).Seconds(), "%.3f s until every survivor saw it", seenAll.Sub(killed).Seconds())
	l.cur = epoch
	return nil
}

// massDeath is phase 5: a share of the ranks (-mass-death, 1 %) dies at
// once.
func (l *loadRun) massDeath(ctx context.Context) error {
	o := l.o
	ms := l.byName["mass"]
	if ms == nil {
		return nil // no such phase (planShards)
	}
	cur := l.cur
	var ids []string
	for _, r := range ms.ranks {
		ids = append(ids, memberID(r))
	}
	cpu0 := l.coord.cpu()
	killed := time.Now()
	ms.kill()
	if o.death == "report" {
		// The peers whose collectives failed blame them (one report
		// naming all: the coordinator probes each address).
		if _, err := all(ctx, l.live()[:1], shardReq{Op: "revoke", Epoch: cur, Blame: ids}); err != nil {
			return err
		}
	}
	l.size -= len(ids)
	for _, id := range ids {
		l.gone[id] = true
	}
	decided, seenAll, epoch, rs, err := l.waitShardsAll(ctx, shardReq{After: cur, Size: l.size, Without: ids})
	if err != nil {
		return fmt.Errorf("quorum after the mass death: %w", err)
	}
	fmt.Printf("   mass death: the final quorum decided %.3f s after the kill; %s\n", decided.Sub(killed).Seconds(),
		seenSpread(rs, killed))
	l.fig("mass_death.ranks", float64(len(ids)), "%d ranks died at once (SIGKILL of their process)", len(ids))
	l.fig("mass_death.epochs", float64(epoch-cur), "%d epoch(s) to the quorum without them (epoch %d → %d)", epoch-cur, cur, epoch)
	l.fig("mass_death.decided", decided.Sub(killed).Seconds(), "%.3f s to the final quorum without them", decided.Sub(killed).Seconds())
	l.fig("mass_death.all_seen", seenAll.Sub(killed).Seconds(), "%.3f s until every survivor was on it", seenAll.Sub(killed).Seconds())
	l.fig("mass_death.coordinator_cpu_seconds", (l.coord.cpu() - cpu0).Seconds(), "%.3f s of coordinator CPU", (l.coord.cpu() - cpu0).Seconds())
	l.cur = epoch
	return nil
}

// manyEpochs is phase 6: many epochs (-epochs; a failed commit's path:
// the same participants again), for the database's growth.
func (l *loadRun) manyEpochs(ctx context.Context) error {
	o := l.o
	if o.epochs <= 0 {
		return nil
	}
	cur := l.cur
	t0 := time.Now()
	rs, err := all(ctx, l.live()[:1], shardReq{Op: "churn", N: o.epochs})
	if err != nil {
		return fmt.Errorf("epochs: %w", err)
	}
	last := rs[0].Epoch
	if _, _, _, err := l.waitShards(ctx, shardReq{After: last - 1, Size: l.size}); err != nil {
		return fmt.Errorf("epochs: %w", err)
	}
	l.fig("epochs.count", float64(last-cur), "%d epochs published in %.1f s, every member on the last", last-cur, time.Since(t0).Seconds())
	dbSizes(ctx, l.admin, l.clientAddrs, "epochs", l.fig)
	return nil
}
