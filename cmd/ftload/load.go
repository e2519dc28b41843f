package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/membership"
)

type report struct {
	Machine       string             `json:"machine"`
	CPUs          int                `json:"cpus"`
	Load          string             `json:"load"`
	Jobs          int                `json:"jobs"`
	MembersPerJob int                `json:"membersPerJob"`
	Clients       int                `json:"clients"`
	Fsync         bool               `json:"fsync"`
	Shards        int                `json:"shards"`
	GroupSize     int                `json:"groupSize"`
	GroupLease    bool               `json:"groupLease"`
	ShareQuorums  bool               `json:"shareQuorums"`
	Phases        map[string]float64 `json:"figures"`
}

func runLoad(o options) error {
	raiseFileLimit()
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	sctx, scancel := untilSignal()
	defer scancel()
	go func() { <-sctx.Done(); cancel() }()

	n := o.jobs * o.members
	rep := report{Machine: machine(), CPUs: runtime.NumCPU(), Load: loadavg(), Jobs: o.jobs, MembersPerJob: o.members,
		Clients: o.clients, Fsync: o.fsync, Shards: o.shards, GroupSize: o.groupSize, GroupLease: o.groupLease,
		ShareQuorums: o.shareQuorums, Phases: map[string]float64{}}
	fig := func(k string, v float64, format string, args ...any) {
		rep.Phases[k] = v
		fmt.Printf("%-38s "+format+"\n", append([]any{k}, args...)...)
	}
	fmt.Printf("ftload: %d job(s) × %d members (groups of %d, group lease %v), %d shard process(es), %d clients each, %d etcd members (fsync %v, etcd's default request limit), %s, %d CPUs, load %s\n",
		o.jobs, o.members, o.groupSize, o.groupLease, max(o.shards, 1), o.clients, o.etcdMembers, o.fsync, rep.Machine, rep.CPUs, rep.Load)
	if o.groupSize < 1 || o.members < 1 || o.jobs < 1 {
		return fmt.Errorf("-members, -jobs and -group-size must be at least 1")
	}
	// A member holds up to about 4 files (its group link's listener and
	// connection, its leader's end of its link, its share of clients).
	var lim syscall.Rlimit
	if o.groupLease && syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim) == nil {
		per := n
		if o.shards > 0 {
			per = (n + o.shards - 1) / o.shards
		}
		if need := uint64(4*per + 1024); need > lim.Max {
			return fmt.Errorf("a process of %d members needs about %d open files, and the limit is %d: use -shards %d or more",
				per, need, lim.Max, (4*n+int(lim.Max)-1025)/(int(lim.Max)-1024))
		}
	}

	dir := o.dir
	if dir == "" {
		d, err := os.MkdirTemp("", "ftload-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(d)
		dir = d
	}
	// etcd: n children on loopback.
	var names, clientAddrs, peerAddrs []string
	for i := 0; i < o.etcdMembers; i++ {
		ca, err := freeAddr()
		if err != nil {
			return err
		}
		pa, err := freeAddr()
		if err != nil {
			return err
		}
		names, clientAddrs, peerAddrs = append(names, fmt.Sprintf("etcd-%d", i)), append(clientAddrs, ca), append(peerAddrs, pa)
	}
	var initial []string
	for i := range names {
		initial = append(initial, names[i]+"=http://"+peerAddrs[i])
	}
	var etcds []*child
	defer func() {
		for _, c := range etcds {
			c.stop()
		}
	}()
	for i := range names {
		c, err := startChild(names[i], "-role", "etcd", "-name", names[i], "-client-addr", clientAddrs[i], "-peer-addr", peerAddrs[i],
			"-initial-cluster", strings.Join(initial, ","), "-data-dir", filepath.Join(dir, names[i]), "-fsync="+strconv.FormatBool(o.fsync), "-profile", o.profile)
		if err != nil {
			return err
		}
		etcds = append(etcds, c)
	}
	admin, err := membership.NewClient(clientAddrs, nil)
	if err != nil {
		return err
	}
	defer admin.Close()
	if o.etcdStats > 0 {
		sctx, stop := context.WithCancel(ctx)
		defer stop()
		go logEtcdStats(sctx, os.Stderr, names, clientAddrs, o.etcdStats)
	}
	for _, ep := range clientAddrs {
		for {
			sctx, c := context.WithTimeout(ctx, time.Second)
			_, err := admin.Status(sctx, ep)
			c()
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return fmt.Errorf("etcd %s did not start: %w", ep, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	args := []string{"-role", "coordinator", "-endpoints", strings.Join(clientAddrs, ","),
		"-form-window", o.formWindow.String(), "-form-max-wait", o.formMaxWait.String(), "-profile", o.profile}
	coord, err := startChild("coordinator", args...)
	if err != nil {
		return err
	}
	defer coord.stop()
	keys := etcdkeys.Layout{}
	for {
		resp, err := admin.Get(ctx, keys.Election(), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err == nil && resp.Count > 0 {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("no coordinator leads: %w", ctx.Err())
		}
		time.Sleep(50 * time.Millisecond)
	}

	// The shards: this process (-shards 0), or child processes, the
	// victims of the death phases each in a shard of their own.
	p := planShards(o)
	var shards []*shard
	defer func() {
		// The coordinator first, so that the members' ends publish nothing.
		coord.stop()
		var wg sync.WaitGroup
		for _, sh := range shards {
			wg.Add(1)
			go func() { defer wg.Done(); sh.stop() }()
		}
		wg.Wait()
	}()
	if o.shards == 0 {
		all := make([]int, n)
		for i := range all {
			all[i] = i
		}
		s, err := newShardServer(shardConfig{endpoints: clientAddrs, jobs: o.jobs, members: o.members, groupSize: o.groupSize,
			groupLease: o.groupLease, clients: o.clients, parallel: o.parallel, leaseTTL: o.leaseTTL, heartbeat: o.heartbeat,
			minReplicas: o.minReplicas, shareQuorums: o.shareQuorums, linkIPs: o.linkIPs, linkInterval: o.linkInterval,
			linkTimeout: o.linkTimeout, ranks: all, victimAddrOwn: 0})
		if err != nil {
			return err
		}
		shards = append(shards, &shard{name: "local", ranks: all, local: s})
	} else {
		common := []string{"-endpoints", strings.Join(clientAddrs, ","), "-jobs", strconv.Itoa(o.jobs), "-members", strconv.Itoa(o.members),
			"-group-size", strconv.Itoa(o.groupSize), "-group-lease=" + strconv.FormatBool(o.groupLease), "-clients", strconv.Itoa(o.clients),
			"-parallel", strconv.Itoa(o.parallel), "-lease-ttl", o.leaseTTL.String(), "-heartbeat", o.heartbeat.String(),
			"-min-replicas", strconv.Itoa(o.minReplicas), "-share-quorums=" + strconv.FormatBool(o.shareQuorums),
			"-link-ips=" + strconv.FormatBool(o.linkIPs), "-link-interval", o.linkInterval.String(), "-link-timeout", o.linkTimeout.String()}
		for _, sp := range p.shards {
			args := slices.Concat(common, []string{"-name", sp.name})
			if strings.HasPrefix(sp.name, "shard-") {
				args = append(args, "-profile", o.profile) // not the victims: SIGKILL leaves no profile
			}
			sh, err := startShard(sp.name, sp.ranks, args)
			if err != nil {
				return err
			}
			shards = append(shards, sh)
		}
	}
	byName := map[string]*shard{}
	for _, sh := range shards {
		byName[sh.name] = sh
	}
	watchBytes := func() int64 {
		var b int64
		for _, sh := range shards {
			if sh.local != nil {
				b += sh.local.bytes.watch.Load()
				continue
			}
			if sh.dead {
				continue
			}
			if r, err := sh.call(ctx, shardReq{Op: "stats"}); err == nil {
				b += r.WatchBytes
			}
		}
		return b
	}
	membersCPU := func() time.Duration {
		d := selfCPU()
		for _, sh := range shards {
			d += sh.cpu()
		}
		return d
	}
	live := func() []*shard {
		var out []*shard
		for _, sh := range shards {
			if !sh.dead {
				out = append(out, sh)
			}
		}
		return out
	}
	// waitShards waits for a condition at every live shard: decided is
	// the latest Created of the quorums, seen when the last member saw it.
	// A wait that fails says which members it waited for and what they
	// held (each shard's answer), and what the coordinator's record holds
	// against what the wait wanted. The shards end their waits first, so
	// that their answers come back before the run's own deadline.
	gone := map[string]bool{} // the victims of the phases so far
	waitShards := func(req shardReq) (decided, seen time.Time, epoch uint64, err error) {
		timeout := o.waitTimeout
		if d, ok := ctx.Deadline(); ok {
			timeout = min(timeout, time.Until(d)-20*time.Second)
		}
		rs, err := all(ctx, live(), shardReq{Op: "wait", After: req.After, Size: req.Size, Without: req.Without, Timeout: max(timeout, time.Second)})
		if err != nil {
			return decided, seen, 0, fmt.Errorf("%w; %s", err, recordAgainst(admin, jobName(0), o.members, req.Size, gone))
		}
		for _, r := range rs {
			if r.Decided > decided.UnixNano() {
				decided = time.Unix(0, r.Decided)
			}
			if r.Seen > seen.UnixNano() {
				seen = time.Unix(0, r.Seen)
			}
			epoch = max(epoch, r.Epoch)
		}
		return decided, seen, epoch, nil
	}

	// Phase 1: join (the groups' leaders first, then the others), and wait
	// for the first quorum holding everyone.
	cpu0, etcd0, self0, b0 := coord.cpu(), cpus(etcds), membersCPU(), watchBytes()
	start := time.Now()
	var joined time.Time
	for wave := 0; wave < 2; wave++ {
		rs, err := all(ctx, shards, shardReq{Op: "join", Wave: wave})
		if err != nil {
			return fmt.Errorf("join: %w", err)
		}
		for _, r := range rs {
			if r.LastJoin > joined.UnixNano() {
				joined = time.Unix(0, r.LastJoin)
			}
		}
	}
	fig("join.seconds", joined.Sub(start).Seconds(), "%.2f s to register %d members", joined.Sub(start).Seconds(), n)
	decided, seenAll, epoch, err := waitShards(shardReq{Size: o.members})
	if err != nil {
		return fmt.Errorf("first quorum: %w", err)
	}
	wb := watchBytes() - b0
	fig("form.decided_after_last_join", decided.Sub(joined).Seconds(), "%.2f s (the coordinator decided the full quorum, after the last join)", decided.Sub(joined).Seconds())
	fig("form.all_seen_after_last_join", seenAll.Sub(joined).Seconds(), "%.2f s (the last member saw it)", seenAll.Sub(joined).Seconds())
	fig("form.epochs_per_job", float64(epoch), "%d epochs (the highest job's) to the full quorum", epoch)
	fig("form.watch_bytes_per_member", float64(wb)/float64(n), "%.0f B received on watches per member while forming", float64(wb)/float64(n))
	el := time.Since(start).Seconds()
	fig("form.coordinator_cores", (coord.cpu()-cpu0).Seconds()/el, "%.2f cores (coordinator, over %.1f s)", (coord.cpu()-cpu0).Seconds()/el, el)
	for i, c := range etcds {
		fig("form."+c.name+"_cores", (c.cpu()-etcd0[i]).Seconds()/el, "%.2f cores", (c.cpu()-etcd0[i]).Seconds()/el)
	}
	fig("form.members_process_cores", (membersCPU()-self0).Seconds()/el, "%.2f cores (the members' processes and this one)", (membersCPU()-self0).Seconds()/el)
	dbSizes(ctx, admin, clientAddrs, "form", fig)
	// The largest request a publication makes is about three records
	// (record, history entry, the view of a forming epoch): etcd runs
	// with its default limit, and refuses anything larger.
	if r, err := admin.Get(ctx, keys.Quorum(jobName(0))); err == nil && len(r.Kvs) > 0 {
		b := len(r.Kvs[0].Value)
		fig("form.record_bytes", float64(b), "%d B: the quorum record of %d participants (%.2f B each); a publication ≤ ~%d B, etcd's default limit %d B",
			b, o.members, float64(b)/float64(o.members), 3*b, membership.MaxRequestBytes)
	}

	// Phase 2: steady.
	epoch0 := epoch
	cpu0, etcd0, self0, b0 = coord.cpu(), cpus(etcds), membersCPU(), watchBytes()
	t0 := time.Now()
	select {
	case <-time.After(o.steady):
	case <-ctx.Done():
		return ctx.Err()
	}
	el = time.Since(t0).Seconds()
	changed := 0
	for j := range o.jobs {
		q, err := coordinator.NewAdmin(admin, "").Quorum(ctx, jobName(j))
		if err == nil && q.Epoch != epoch0 {
			changed++
		}
	}
	fig("steady.jobs_with_new_epochs", float64(changed), "%d jobs published an epoch in %.0f s steady (want 0)", changed, el)
	fig("steady.coordinator_cores", (coord.cpu()-cpu0).Seconds()/el, "%.3f cores (coordinator), RSS %d MiB", (coord.cpu()-cpu0).Seconds()/el, coord.rssMiB())
	for i, c := range etcds {
		fig("steady."+c.name+"_cores", (c.cpu()-etcd0[i]).Seconds()/el, "%.3f cores, RSS %d MiB", (c.cpu()-etcd0[i]).Seconds()/el, c.rssMiB())
	}
	fig("steady.members_process_cores", (membersCPU()-self0).Seconds()/el, "%.3f cores (the members' processes)", (membersCPU()-self0).Seconds()/el)
	fig("steady.watch_bytes_per_member_s", float64(watchBytes()-b0)/float64(n)/el, "%.1f B/s per member on watches", float64(watchBytes()-b0)/float64(n)/el)
	// The leases the members' registrations are bound to: one per member,
	// or one per replica group with -group-lease.
	leases := map[int64]bool{}
	for j := range o.jobs {
		resp, err := admin.Get(ctx, keys.Members(jobName(j)), clientv3.WithPrefix())
		if err != nil {
			return fmt.Errorf("count leases: %w", err)
		}
		for _, kv := range resp.Kvs {
			leases[kv.Lease] = true
		}
	}
	fig("steady.member_leases", float64(len(leases)), "%d leases hold the %d members' registrations (%.0f renewals/s at TTL %v)",
		len(leases), n, float64(len(leases))*3/o.leaseTTL.Seconds(), o.leaseTTL)
	if o.death == "none" || o.members < 2 {
		return finish(ctx, admin, clientAddrs, coord, fig, rep)
	}

	// Phase 3: one member of job 0 dies.
	size := o.members
	cur := epoch0
	cpu0, b0 = coord.cpu(), watchBytes()
	victimID := memberID(p.single)
	killed := time.Now()
	if o.shards == 0 {
		// In one process: its address refuses (report) or its lease goes.
		if _, err := shards[0].call(ctx, shardReq{Op: "die", Rank: p.single, How: o.death}); err != nil {
			return err
		}
	} else {
		vs := byName["victim"]
		r, err := vs.call(ctx, shardReq{Op: "stats", Rank: p.single})
		if err != nil {
			return err
		}
		killed = time.Now()
		vs.kill() // its process is gone: the port refuses, its group link resets
		if o.death == "lease" {
			if _, err := admin.Revoke(ctx, clientv3.LeaseID(r.Lease)); err != nil && !o.groupLease {
				return err
			}
		}
	}
	if o.death == "report" {
		// A peer's collective failed: it revokes the epoch blaming it, as ft does.
		if _, err := all(ctx, live()[:1], shardReq{Op: "revoke", Epoch: cur, Blame: []string{victimID}}); err != nil {
			return err
		}
	}
	size--
	gone[victimID] = true
	decided, seenAll, epoch, err = waitShards(shardReq{After: cur, Size: size, Without: []string{victimID}})
	if err != nil {
		return fmt.Errorf("quorum after the death: %w", err)
	}
	fig("death.decided", decided.Sub(killed).Seconds(), "%.3f s from the death (%s) to the quorum without it (epoch %d → %d)", decided.Sub(killed).Seconds(), o.death, cur, epoch)
	fig("death.all_seen", seenAll.Sub(killed).Seconds(), "%.3f s until every survivor of the job saw it", seenAll.Sub(killed).Seconds())
	de := float64(epoch - cur)
	fig("death.watch_bytes_per_member_epoch", float64(watchBytes()-b0)/float64(o.members)/de,
		"%.0f B per member of the job per epoch (all watch bytes of the phase / %d members / %.0f epochs)", float64(watchBytes()-b0)/float64(o.members)/de, o.members, de)
	fig("death.coordinator_cpu_seconds", (coord.cpu() - cpu0).Seconds(), "%.3f s of coordinator CPU in %.2f s", (coord.cpu() - cpu0).Seconds(), time.Since(killed).Seconds())
	cur = epoch

	// Phase 4: a group's leader dies; its group's ranks follow the member
	// that takes the lease over.
	if ls := byName["leader"]; ls != nil {
		r, err := ls.call(ctx, shardReq{Op: "stats", Rank: p.leader})
		if err != nil {
			return err
		}
		group := fmt.Sprintf("g%06d", p.leader/o.groupSize)
		leaderID := memberID(p.leader)
		killed := time.Now()
		ls.kill()
		size--
		gone[leaderID] = true
		followed := make(chan error, 1)
		var followedAt atomic.Int64
		go func() {
			rs, err := all(ctx, live(), shardReq{Op: "follow", Group: group, NotLease: r.Lease})
			for _, x := range rs {
				followedAt.Store(max(followedAt.Load(), x.Seen))
			}
			followed <- err
		}()
		decided, seenAll, epoch, err = waitShards(shardReq{After: cur, Size: size, Without: []string{leaderID}})
		if err != nil {
			return fmt.Errorf("quorum after the leader's death: %w", err)
		}
		if err := <-followed; err != nil {
			return fmt.Errorf("the group following its new leader: %w", err)
		}
		fig("leader_death.followed", time.Unix(0, followedAt.Load()).Sub(killed).Seconds(), "%.3f s from the leader's death (SIGKILL) until its group's %d other ranks were on the new leader's lease", time.Unix(0, followedAt.Load()).Sub(killed).Seconds(), o.groupSize-1)
		fig("leader_death.decided", decided.Sub(killed).Seconds(), "%.3f s to the quorum without it (epoch %d → %d)", decided.Sub(killed).Seconds(), cur, epoch)
		fig("leader_death.all_seen", seenAll.Sub(killed).Seconds(), "%.3f s until every survivor saw it", seenAll.Sub(killed).Seconds())
		cur = epoch
	}

	// Phase 5: a share of the ranks (1 %) dies at once.
	if ms := byName["mass"]; ms != nil {
		var ids []string
		for _, r := range ms.ranks {
			ids = append(ids, memberID(r))
		}
		cpu0 = coord.cpu()
		killed := time.Now()
		ms.kill()
		if o.death == "report" {
			// The peers whose collectives failed blame them (one report
			// naming all: the coordinator probes each address).
			if _, err := all(ctx, live()[:1], shardReq{Op: "revoke", Epoch: cur, Blame: ids}); err != nil {
				return err
			}
		}
		size -= len(ids)
		for _, id := range ids {
			gone[id] = true
		}
		decided, seenAll, epoch, err = waitShards(shardReq{After: cur, Size: size, Without: ids})
		if err != nil {
			return fmt.Errorf("quorum after the mass death: %w", err)
		}
		fig("mass_death.ranks", float64(len(ids)), "%d ranks died at once (SIGKILL of their process)", len(ids))
		fig("mass_death.epochs", float64(epoch-cur), "%d epoch(s) to the quorum without them (epoch %d → %d)", epoch-cur, cur, epoch)
		fig("mass_death.decided", decided.Sub(killed).Seconds(), "%.3f s to the final quorum without them", decided.Sub(killed).Seconds())
		fig("mass_death.all_seen", seenAll.Sub(killed).Seconds(), "%.3f s until every survivor was on it", seenAll.Sub(killed).Seconds())
		fig("mass_death.coordinator_cpu_seconds", (coord.cpu() - cpu0).Seconds(), "%.3f s of coordinator CPU", (coord.cpu() - cpu0).Seconds())
		cur = epoch
	}

	// Phase 6: many epochs (a failed commit's path: the same participants
	// again), for the database's growth.
	if o.epochs > 0 {
		t0 := time.Now()
		rs, err := all(ctx, live()[:1], shardReq{Op: "churn", N: o.epochs})
		if err != nil {
			return fmt.Errorf("epochs: %w", err)
		}
		last := rs[0].Epoch
		if _, _, _, err := waitShards(shardReq{After: last - 1, Size: size}); err != nil {
			return fmt.Errorf("epochs: %w", err)
		}
		fig("epochs.count", float64(last-cur), "%d epochs published in %.1f s, every member on the last", last-cur, time.Since(t0).Seconds())
		dbSizes(ctx, admin, clientAddrs, "epochs", fig)
	}
	return finish(ctx, admin, clientAddrs, coord, fig, rep)
}

// finish reports the end figures and the JSON line.
func finish(ctx context.Context, admin *clientv3.Client, eps []string, coord *child, fig func(string, float64, string, ...any), rep report) error {
	dbSizes(ctx, admin, eps, "end", fig)
	fig("end.coordinator_rss_mib", float64(coord.rssMiB()), "%d MiB", coord.rssMiB())
	return printJSON(rep)
}

func printJSON(rep report) error {
	b, _ := json.Marshal(rep)
	fmt.Printf("json %s\n", b)
	return nil
}

// recordAgainst says what the coordinator's quorum record of job holds
// against what a wait wanted (want participants, none of gone, every
// other of the job's members ids m000000…): its epoch and size, the
// victims still in it and the survivors missing from it, each with its
// registration in etcd.
func recordAgainst(cli *clientv3.Client, job string, members, want int, gone map[string]bool) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	q, err := coordinator.NewAdmin(cli, "").Quorum(ctx, job)
	if err != nil {
		return fmt.Sprintf("the coordinator's record of %s: unread (%v)", job, err)
	}
	in := map[string]bool{}
	for _, p := range q.Participants {
		in[p.ID] = true
	}
	var victims, missing []string
	for i := range members {
		id := memberID(i)
		switch {
		case gone[id] && in[id]:
			victims = append(victims, id)
		case !gone[id] && !in[id]:
			missing = append(missing, id)
		}
	}
	reg := func(id string) string {
		r, err := cli.Get(ctx, etcdkeys.Layout{}.Member(job, id))
		switch {
		case err != nil:
			return id + " (registration unread)"
		case len(r.Kvs) == 0:
			return id + " (no registration)"
		}
		return fmt.Sprintf("%s (registered, incarnation %d, lease %x: %s)", id, r.Kvs[0].CreateRevision, r.Kvs[0].Lease, leaseTTL(ctx, cli, r.Kvs[0].Lease))
	}
	list := func(ids []string) string {
		var out []string
		for i, id := range ids {
			if i == laggardsNamed {
				out = append(out, fmt.Sprintf("and %d more", len(ids)-i))
				break
			}
			out = append(out, reg(id))
		}
		return strings.Join(out, ", ")
	}
	return fmt.Sprintf("the coordinator's record of %s: epoch %d, %d participants (the wait wanted %d), reason %q; %d victims still in it: %s; %d survivors missing from it: %s",
		job, q.Epoch, len(q.Participants), want, q.Reason, len(victims), list(victims), len(missing), list(missing))
}

func dbSizes(ctx context.Context, cli *clientv3.Client, eps []string, phase string, fig func(string, float64, string, ...any)) {
	var most int64
	for _, ep := range eps {
		st, err := cli.Status(ctx, ep)
		if err == nil {
			most = max(most, st.DbSize)
		}
	}
	fig(phase+".etcd_db_mib", float64(most)/(1<<20), "%.1f MiB (largest etcd member's database)", float64(most)/(1<<20))
}
