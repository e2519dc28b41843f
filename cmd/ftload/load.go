package main

import (
	"cmp"
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
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
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

// runLoad runs the load (-role load): it starts etcd, the coordinator and
// the shards, then measures each phase in turn and prints its figures,
// the JSON line last. Everything it started ends with it.
func runLoad(o options) error {
	raiseFileLimit()
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	sctx, scancel := untilSignal()
	defer scancel()
	go func() { <-sctx.Done(); cancel() }()

	l := newLoadRun(o)
	l.printSetup()
	if err := l.check(); err != nil {
		return err
	}
	defer l.stop()
	if err := l.startEtcd(ctx); err != nil {
		return err
	}
	if err := l.startCoordinator(ctx); err != nil {
		return err
	}
	if err := l.startShards(); err != nil {
		return err
	}
	if err := l.form(ctx); err != nil {
		return err
	}
	if err := l.steady(ctx); err != nil {
		return err
	}
	if o.death == "none" || o.members < 2 {
		return l.finish(ctx)
	}
	for _, phase := range []func(context.Context) error{l.death, l.leaderDeath, l.massDeath, l.manyEpochs} {
		if err := phase(ctx); err != nil {
			return err
		}
	}
	return l.finish(ctx)
}

// loadRun is one run of the load: what it started (stop ends it all), the
// report its phases fill, and what they hand on to the next. It is used
// from runLoad's goroutine only.
type loadRun struct {
	o   options
	n   int // members in all jobs
	rep report

	tmpDir             string   // etcd's data, when -dir named none (stop removes it)
	names, clientAddrs []string // the etcd members'
	etcds              []*child
	admin              *clientv3.Client
	stopStats          context.CancelFunc // ends logEtcdStats (-etcd-stats)
	coord              *child

	// The shards: this process (-shards 0), or child processes, the
	// victims of the death phases each in a shard of their own.
	p      plan
	shards []*shard
	byName map[string]*shard

	gone map[string]bool // the victims of the phases so far
	cur  uint64          // the epoch of the last phase's quorum
	size int             // job 0's members left, from the death phases on
}

func newLoadRun(o options) *loadRun {
	return &loadRun{o: o, n: o.jobs * o.members, gone: map[string]bool{},
		rep: report{Machine: machine(), CPUs: runtime.NumCPU(), Load: loadavg(), Jobs: o.jobs, MembersPerJob: o.members,
			Clients: o.clients, Fsync: o.fsync, Shards: o.shards, GroupSize: o.groupSize, GroupLease: o.groupLease,
			ShareQuorums: o.shareQuorums, Phases: map[string]float64{}}}
}

// fig records figure k of the report and prints it.
func (l *loadRun) fig(k string, v float64, format string, args ...any) {
	l.rep.Phases[k] = v
	fmt.Printf("%-38s "+format+"\n", append([]any{k}, args...)...)
}

// printSetup prints what the run is made of and where it runs.
func (l *loadRun) printSetup() {
	o, rep := l.o, l.rep
	fmt.Printf("ftload: %d job(s) × %d members (groups of %d, group lease %v), %d shard process(es), %d clients each, %d etcd members (fsync %v, etcd's default request limit), %s, %d CPUs, load %s\n",
		o.jobs, o.members, o.groupSize, o.groupLease, max(o.shards, 1), o.clients, o.etcdMembers, o.fsync, rep.Machine, rep.CPUs, rep.Load)
}

// check refuses flags the run cannot work with, before it starts anything.
func (l *loadRun) check() error {
	o, n := l.o, l.n
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
	return nil
}

// stop ends what the start steps started, the last first: the
// coordinator first, so that the members' ends publish nothing, then the
// shards, the etcd client, the etcd members and a temporary data
// directory.
func (l *loadRun) stop() {
	if l.coord != nil {
		l.coord.stop()
	}
	var wg sync.WaitGroup
	for _, sh := range l.shards {
		wg.Add(1)
		go func() { defer wg.Done(); sh.stop() }()
	}
	wg.Wait()
	if l.stopStats != nil {
		l.stopStats()
	}
	if l.admin != nil {
		l.admin.Close()
	}
	for _, c := range l.etcds {
		c.stop()
	}
	if l.tmpDir != "" {
		os.RemoveAll(l.tmpDir)
	}
}

// startEtcd starts the etcd members, children on loopback, and waits
// until each answers.
func (l *loadRun) startEtcd(ctx context.Context) error {
	o := l.o
	dir := o.dir
	if dir == "" {
		d, err := os.MkdirTemp("", "ftload-")
		if err != nil {
			return err
		}
		l.tmpDir = d
		dir = d
	}
	var peerAddrs []string
	for i := 0; i < o.etcdMembers; i++ {
		ca, err := freeAddr()
		if err != nil {
			return err
		}
		pa, err := freeAddr()
		if err != nil {
			return err
		}
		l.names, l.clientAddrs, peerAddrs = append(l.names, fmt.Sprintf("etcd-%d", i)), append(l.clientAddrs, ca), append(peerAddrs, pa)
	}
	names, clientAddrs := l.names, l.clientAddrs
	var initial []string
	for i := range names {
		initial = append(initial, names[i]+"=http://"+peerAddrs[i])
	}
	for i := range names {
		c, err := startChild(names[i], "-role", "etcd", "-name", names[i], "-client-addr", clientAddrs[i], "-peer-addr", peerAddrs[i],
			"-initial-cluster", strings.Join(initial, ","), "-data-dir", filepath.Join(dir, names[i]), "-fsync="+strconv.FormatBool(o.fsync), "-profile", o.profile)
		if err != nil {
			return err
		}
		l.etcds = append(l.etcds, c)
	}
	admin, err := membership.NewClient(clientAddrs, nil)
	if err != nil {
		return err
	}
	l.admin = admin
	if o.etcdStats > 0 {
		sctx, stop := context.WithCancel(ctx)
		l.stopStats = stop
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
	return nil
}

// startCoordinator starts the coordinator, a child, and waits until it
// leads.
func (l *loadRun) startCoordinator(ctx context.Context) error {
	o := l.o
	args := []string{"-role", "coordinator", "-endpoints", strings.Join(l.clientAddrs, ","),
		"-form-window", o.formWindow.String(), "-form-max-wait", o.formMaxWait.String(), "-profile", o.profile}
	coord, err := startChild("coordinator", args...)
	if err != nil {
		return err
	}
	l.coord = coord
	keys := etcdkeys.Layout{}
	for {
		resp, err := l.admin.Get(ctx, keys.Election(), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err == nil && resp.Count > 0 {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("no coordinator leads: %w", ctx.Err())
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}

// startShards starts the shards planned for the run (planShards).
func (l *loadRun) startShards() error {
	o, n, clientAddrs := l.o, l.n, l.clientAddrs
	l.p = planShards(o)
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
		l.shards = append(l.shards, &shard{name: "local", ranks: all, local: s})
	} else {
		common := []string{"-endpoints", strings.Join(clientAddrs, ","), "-jobs", strconv.Itoa(o.jobs), "-members", strconv.Itoa(o.members),
			"-group-size", strconv.Itoa(o.groupSize), "-group-lease=" + strconv.FormatBool(o.groupLease), "-clients", strconv.Itoa(o.clients),
			"-parallel", strconv.Itoa(o.parallel), "-lease-ttl", o.leaseTTL.String(), "-heartbeat", o.heartbeat.String(),
			"-min-replicas", strconv.Itoa(o.minReplicas), "-share-quorums=" + strconv.FormatBool(o.shareQuorums),
			"-link-ips=" + strconv.FormatBool(o.linkIPs), "-link-interval", o.linkInterval.String(), "-link-timeout", o.linkTimeout.String()}
		for _, sp := range l.p.shards {
			args := slices.Concat(common, []string{"-name", sp.name})
			if strings.HasPrefix(sp.name, "shard-") {
				args = append(args, "-profile", o.profile) // not the victims: SIGKILL leaves no profile
			}
			sh, err := startShard(sp.name, sp.ranks, args)
			if err != nil {
				return err
			}
			l.shards = append(l.shards, sh)
		}
	}
	l.byName = map[string]*shard{}
	for _, sh := range l.shards {
		l.byName[sh.name] = sh
	}
	return nil
}

// watchBytes is what the members' clients received on watch streams so
// far, in all shards alive.
func (l *loadRun) watchBytes(ctx context.Context) int64 {
	var b int64
	for _, sh := range l.shards {
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

// membersCPU is the CPU time of this process and of the shards'.
func (l *loadRun) membersCPU() time.Duration {
	d := selfCPU()
	for _, sh := range l.shards {
		d += sh.cpu()
	}
	return d
}

// live is the shards whose process was not killed.
func (l *loadRun) live() []*shard {
	var out []*shard
	for _, sh := range l.shards {
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
// seenSpread says when the members saw what a wait waited for, from t0:
// the quantiles, and the last few with how each got its quorum (the
// slowest members each shard named).
func seenSpread(rs []shardResp, t0 time.Time) string {
	var at []float64
	var slow []slowMember
	for _, r := range rs {
		for _, ns := range r.SeenAt {
			at = append(at, time.Unix(0, ns).Sub(t0).Seconds())
		}
		slow = append(slow, r.Slowest...)
	}
	if len(at) == 0 {
		return "no member waited for"
	}
	slices.Sort(at)
	q := func(p float64) float64 { return at[min(len(at)-1, int(p*float64(len(at))))] }
	slices.SortFunc(slow, func(a, b slowMember) int { return cmp.Compare(b.Seen, a.Seen) })
	var last []string
	for _, m := range slow[:min(len(slow), 6)] {
		role := "follows " + m.Leader
		if m.Leads {
			role = "leads"
		}
		last = append(last, fmt.Sprintf("%s %.3f s (%s; epoch %d: watched %d, forwarded %d, read %d)", m.ID,
			time.Unix(0, m.Seen).Sub(t0).Seconds(), role, m.Epoch, m.Watched, m.Forwarded, m.Read))
	}
	return fmt.Sprintf("%d members saw it: p50 %.3f s, p90 %.3f s, p99 %.3f s, max %.3f s; the last: %s", len(at),
		q(0.5), q(0.9), q(0.99), at[len(at)-1], strings.Join(last, "; "))
}

func (l *loadRun) waitShards(ctx context.Context, req shardReq) (decided, seen time.Time, epoch uint64, err error) {
	decided, seen, epoch, _, err = l.waitShardsAll(ctx, req)
	return decided, seen, epoch, err
}

// waitShardsAll is waitShards with every shard's answer.
func (l *loadRun) waitShardsAll(ctx context.Context, req shardReq) (decided, seen time.Time, epoch uint64, rs []shardResp, err error) {
	o := l.o
	timeout := o.waitTimeout
	if d, ok := ctx.Deadline(); ok {
		timeout = min(timeout, time.Until(d)-20*time.Second)
	}
	rs, err = all(ctx, l.live(), shardReq{Op: "wait", After: req.After, Size: req.Size, Without: req.Without, Timeout: max(timeout, time.Second)})
	if err != nil {
		return decided, seen, 0, nil, fmt.Errorf("%w; %s", err, recordAgainst(l.admin, jobName(0), o.members, req.Size, l.gone))
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
	return decided, seen, epoch, rs, nil
}

// finish reports the end figures and the JSON line.
func (l *loadRun) finish(ctx context.Context) error {
	dbSizes(ctx, l.admin, l.clientAddrs, "end", l.fig)
	l.fig("end.coordinator_rss_mib", float64(l.coord.rssMiB()), "%d MiB", l.coord.rssMiB())
	return printJSON(l.rep)
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
