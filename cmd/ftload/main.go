// Command ftload measures ftcomm's membership at scale: a 3-member etcd
// cluster on loopback (child processes of this binary), a real coordinator
// (a child process, so its CPU is its own) and N simulated members per job
// in this process, each a real membership.Member (Join, lease keepalive,
// watches, heartbeats) over real etcd client connections that the members
// share (-clients). Gossip is off: thousands of memberlist nodes in one
// process measure the process, not the membership; lease expiry and death
// reports are the failure detectors here.
//
// It reports, per phase (forming, steady, one death): the time from the
// last join to the first quorum holding every member (when the coordinator
// decided it and when the last member saw it), the bytes the members'
// clients received on their watch streams (per member per epoch), the CPU
// and memory of the coordinator and of each etcd member, and etcd's
// database size. See docs/scaling.md and docs/capacity.md.
//
//	go build ./cmd/ftload && ./ftload -members 2000
//	./ftload -jobs 1000 -members 10
//
// Built with CGO_ENABLED=0 it is one static binary with no dependencies,
// for a bigger host.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ftcomm/ftcomm/internal/keys"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

type options struct {
	role string

	// load
	jobs, members, groupSize int
	groupLease               bool
	clients, parallel        int
	etcdMembers              int
	fsync                    bool
	leaseTTL, heartbeat      time.Duration
	minReplicas              int
	steady                   time.Duration
	death                    string
	dir                      string
	formWindow, formMaxWait  time.Duration
	timeout                  time.Duration
	profile                  string

	// children
	name, clientAddr, peerAddr, initialCluster, dataDir, endpoints string
}

func main() {
	var o options
	flag.StringVar(&o.role, "role", "load", "load (the default), or etcd and coordinator (the children it starts)")
	flag.IntVar(&o.jobs, "jobs", 1, "jobs")
	flag.IntVar(&o.members, "members", 100, "members per job (for ft.Comm: one per replica group's leader)")
	flag.IntVar(&o.groupSize, "group-size", 1, "members per replica group name (MemberConfig.Group)")
	flag.BoolVar(&o.groupLease, "group-lease", false, "with -group-size above 1, each group's members share one lease held by its leader (MemberConfig.GroupLease, what ft does for replica groups)")
	flag.IntVar(&o.clients, "clients", 32, "etcd clients (gRPC connections) the members share")
	flag.IntVar(&o.parallel, "parallel", 128, "joins in flight at once")
	flag.IntVar(&o.etcdMembers, "etcd", 3, "etcd cluster members (child processes)")
	flag.BoolVar(&o.fsync, "fsync", true, "etcd fsyncs its log (what a deployment runs)")
	flag.DurationVar(&o.leaseTTL, "lease-ttl", 5*time.Second, "members' lease TTL")
	flag.DurationVar(&o.heartbeat, "heartbeat", 10*time.Second, "members' heartbeat interval")
	flag.IntVar(&o.minReplicas, "min-replicas", 0, "members' MinReplicas (0: the coordinator's default, 1)")
	flag.DurationVar(&o.steady, "steady", 10*time.Second, "how long to watch the formed jobs with nothing changing")
	flag.StringVar(&o.death, "death", "report", "how the one member dies: report (a peer revokes the epoch blaming it and its port refuses: ft's path after a SIGKILL), lease (its lease is revoked: what lease expiry does, minus the TTL), none")
	flag.StringVar(&o.dir, "dir", "", "directory for etcd's data (default: a temporary one, removed)")
	flag.DurationVar(&o.formWindow, "form-window", -1, "coordinator's QuorumConfig.FormWindow (0: none, one epoch per joiner as before; negative: its default)")
	flag.DurationVar(&o.formMaxWait, "form-max-wait", -1, "coordinator's QuorumConfig.FormMaxWait (negative: its default)")
	flag.DurationVar(&o.timeout, "timeout", 10*time.Minute, "give up after this long")
	flag.StringVar(&o.profile, "profile", "", "write CPU profiles of this process and the coordinator to this directory (load.pprof, coordinator.pprof)")
	flag.StringVar(&o.name, "name", "", "child: etcd member name")
	flag.StringVar(&o.clientAddr, "client-addr", "", "child: etcd client address")
	flag.StringVar(&o.peerAddr, "peer-addr", "", "child: etcd peer address")
	flag.StringVar(&o.initialCluster, "initial-cluster", "", "child: etcd initial cluster")
	flag.StringVar(&o.dataDir, "data-dir", "", "child: etcd data directory")
	flag.StringVar(&o.endpoints, "endpoints", "", "child: etcd endpoints of the coordinator")
	flag.Parse()
	if o.profile != "" {
		f, err := os.Create(filepath.Join(o.profile, o.role+".pprof"))
		if err == nil {
			pprof.StartCPUProfile(f)
			defer pprof.StopCPUProfile()
		}
	}
	var err error
	switch o.role {
	case "etcd":
		err = runEtcd(o)
	case "coordinator":
		err = runCoordinator(o)
	case "load":
		err = runLoad(o)
	default:
		err = fmt.Errorf("unknown -role %q", o.role)
	}
	if err != nil {
		pprof.StopCPUProfile()
		fmt.Fprintln(os.Stderr, "ftload:", err)
		os.Exit(1)
	}
}

// untilSignal returns a context that ends at SIGTERM or SIGINT.
func untilSignal() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
}

func runEtcd(o options) error {
	ctx, cancel := untilSignal()
	defer cancel()
	cfg := etcdhost.DefaultEmbeddedConfig()
	cfg.Name, cfg.ClientAddr, cfg.PeerAddr, cfg.InitialCluster, cfg.Dir = o.name, o.clientAddr, o.peerAddr, o.initialCluster, o.dataDir
	cfg.UnsafeNoFsync = !o.fsync
	e, err := etcdhost.StartEmbedded(ctx, cfg)
	if err != nil {
		return err
	}
	<-ctx.Done()
	return e.Close()
}

func runCoordinator(o options) error {
	ctx, cancel := untilSignal()
	defer cancel()
	cli, err := membership.NewClient(strings.Split(o.endpoints, ","), nil)
	if err != nil {
		return err
	}
	defer cli.Close()
	lg, _ := zap.NewProduction(zap.IncreaseLevel(zapcore.WarnLevel))
	cfg := coordinator.DefaultConfig()
	cfg.Client, cfg.Name, cfg.Logger = cli, "ftload", lg
	if o.formWindow >= 0 {
		setFormWindow(&cfg.Quorum, o.formWindow, o.formMaxWait)
	}
	c, err := coordinator.New(cfg)
	if err != nil {
		return err
	}
	if err := c.Run(ctx); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// child is a process this one started.
type child struct {
	name string
	cmd  *exec.Cmd
}

func (c *child) cpu() time.Duration { return procCPU(c.cmd.Process.Pid) }
func (c *child) rssMiB() int        { return procRSSKiB(c.cmd.Process.Pid) / 1024 }

func (c *child) stop() {
	c.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { c.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		c.cmd.Process.Kill()
		<-done
	}
}

func startChild(name string, args ...string) (*child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, args...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	// The children die with this process, whatever ends it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &child{name: name, cmd: cmd}, nil
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// byteCounter counts the bytes the clients receive, watch streams apart.
type byteCounter struct{ watch, other atomic.Int64 }

type watchKey struct{}

func (b *byteCounter) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, watchKey{}, strings.HasSuffix(info.FullMethodName, "/Watch"))
}

func (b *byteCounter) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if in, ok := s.(*stats.InPayload); ok {
		if w, _ := ctx.Value(watchKey{}).(bool); w {
			b.watch.Add(int64(in.WireLength))
		} else {
			b.other.Add(int64(in.WireLength))
		}
	}
}

func (b *byteCounter) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (b *byteCounter) HandleConn(context.Context, stats.ConnStats)                       {}

// sim is one simulated member.
type sim struct {
	job, idx int
	m        *membership.Member
	seen     atomic.Int64 // unix nanos when it saw the awaited quorum
}

type report struct {
	Machine       string             `json:"machine"`
	CPUs          int                `json:"cpus"`
	Load          string             `json:"load"`
	Jobs          int                `json:"jobs"`
	MembersPerJob int                `json:"membersPerJob"`
	Clients       int                `json:"clients"`
	Fsync         bool               `json:"fsync"`
	Phases        map[string]float64 `json:"figures"`
}

func runLoad(o options) error {
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	sctx, scancel := untilSignal()
	defer scancel()
	go func() { <-sctx.Done(); cancel() }()

	rep := report{Machine: machine(), CPUs: runtime.NumCPU(), Load: loadavg(), Jobs: o.jobs, MembersPerJob: o.members,
		Clients: o.clients, Fsync: o.fsync, Phases: map[string]float64{}}
	fig := func(k string, v float64, format string, args ...any) {
		rep.Phases[k] = v
		fmt.Printf("%-34s "+format+"\n", append([]any{k}, args...)...)
	}
	fmt.Printf("ftload: %d job(s) × %d members, %d clients, %d etcd members (fsync %v), %s, %d CPUs, load %s\n",
		o.jobs, o.members, o.clients, o.etcdMembers, o.fsync, rep.Machine, rep.CPUs, rep.Load)

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
			"-initial-cluster", strings.Join(initial, ","), "-data-dir", filepath.Join(dir, names[i]), "-fsync="+strconv.FormatBool(o.fsync))
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
	keys := keys.Layout{}
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

	// The members' clients, counting what they receive.
	var bytes byteCounter
	clients := make([]*clientv3.Client, o.clients)
	for i := range clients {
		cfg := membership.ClientConfig(clientAddrs, nil)
		cfg.DialOptions = append(cfg.DialOptions, grpc.WithStatsHandler(&bytes))
		if clients[i], err = clientv3.New(cfg); err != nil {
			return err
		}
		defer clients[i].Close()
	}
	// Addresses: every member answers at one listener but the victim,
	// whose port closes when it dies.
	shared, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer shared.Close()
	go acceptAll(shared)
	victimL, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer victimL.Close()
	go acceptAll(victimL)

	n := o.jobs * o.members
	sims := make([]*sim, n)
	for i := range sims {
		sims[i] = &sim{job: i / o.members, idx: i % o.members}
	}
	defer func() {
		// The coordinator first, so that the leaves publish nothing.
		coord.stop()
		var wg sync.WaitGroup
		sem := make(chan struct{}, o.parallel)
		for _, s := range sims {
			if s.m != nil {
				wg.Add(1)
				sem <- struct{}{}
				go func() { defer wg.Done(); s.m.Close(); <-sem }()
			}
		}
		wg.Wait()
	}()
	jobName := func(j int) string { return fmt.Sprintf("load%04d", j) }

	// Phase 1: join, and wait for the first quorum holding everyone.
	cpu0, etcd0, self0, b0 := coord.cpu(), cpus(etcds), selfCPU(), bytes.watch.Load()
	start := time.Now()
	var lastJoin atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, o.parallel)
	errs := make(chan error, n)
	for i, s := range sims {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			mc := membership.DefaultMemberConfig()
			mc.Client, mc.Job, mc.ID = clients[i%len(clients)], jobName(s.job), fmt.Sprintf("m%06d", s.idx)
			mc.Addr, mc.Group, mc.WantQuorum = shared.Addr().String(), fmt.Sprintf("g%06d", s.idx/o.groupSize), true
			mc.LeaseTTL, mc.HeartbeatInterval, mc.MinReplicas = o.leaseTTL, o.heartbeat, o.minReplicas
			if o.groupLease && o.groupSize > 1 {
				mc.GroupLease, mc.GroupLinkAddr = true, "127.0.0.1:0"
			}
			if i == 0 {
				mc.Addr = victimL.Addr().String()
			}
			m, err := membership.Join(ctx, mc)
			if err != nil {
				errs <- err
				return
			}
			s.m = m
			lastJoin.Store(time.Now().UnixNano())
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		return fmt.Errorf("join: %w", err)
	}
	joined := time.Unix(0, lastJoin.Load())
	fig("join.seconds", joined.Sub(start).Seconds(), "%.2f s to register %d members", joined.Sub(start).Seconds(), n)
	full := func(q membership.Quorum, ok bool) bool { return ok && len(q.Participants) == o.members }
	decided, err := waitAll(ctx, sims, full)
	if err != nil {
		return fmt.Errorf("first quorum: %w", err)
	}
	seenAll := latest(sims)
	epochs := 0
	for _, s := range sims {
		if s.idx == 0 {
			q, _ := s.m.Quorum()
			epochs += int(q.Epoch)
		}
	}
	wb := bytes.watch.Load() - b0
	fig("form.decided_after_last_join", decided.Sub(joined).Seconds(), "%.2f s (the coordinator decided the full quorum, after the last join)", decided.Sub(joined).Seconds())
	fig("form.all_seen_after_last_join", seenAll.Sub(joined).Seconds(), "%.2f s (the last member saw it)", seenAll.Sub(joined).Seconds())
	fig("form.epochs_per_job", float64(epochs)/float64(o.jobs), "%.1f epochs per job to the full quorum", float64(epochs)/float64(o.jobs))
	fig("form.watch_bytes_per_member", float64(wb)/float64(n), "%.0f B received on watches per member while forming", float64(wb)/float64(n))
	el := time.Since(start).Seconds()
	fig("form.coordinator_cores", (coord.cpu()-cpu0).Seconds()/el, "%.2f cores (coordinator, over %.1f s)", (coord.cpu()-cpu0).Seconds()/el, el)
	for i, c := range etcds {
		fig("form."+c.name+"_cores", (c.cpu()-etcd0[i]).Seconds()/el, "%.2f cores", (c.cpu()-etcd0[i]).Seconds()/el)
	}
	fig("form.members_process_cores", (selfCPU()-self0).Seconds()/el, "%.2f cores (this process: members and clients)", (selfCPU()-self0).Seconds()/el)
	dbSizes(ctx, admin, clientAddrs, "form", fig)

	// Phase 2: steady.
	epoch0 := map[int]uint64{}
	for _, s := range sims {
		if s.idx == 1 || o.members == 1 {
			q, _ := s.m.Quorum()
			epoch0[s.job] = q.Epoch
		}
	}
	cpu0, etcd0, self0, b0 = coord.cpu(), cpus(etcds), selfCPU(), bytes.watch.Load()
	t0 := time.Now()
	select {
	case <-time.After(o.steady):
	case <-ctx.Done():
		return ctx.Err()
	}
	el = time.Since(t0).Seconds()
	changed := 0
	for _, s := range sims {
		if s.idx == 1 || o.members == 1 {
			if q, _ := s.m.Quorum(); q.Epoch != epoch0[s.job] {
				changed++
			}
		}
	}
	fig("steady.jobs_with_new_epochs", float64(changed), "%d jobs published an epoch in %.0f s steady (want 0)", changed, el)
	fig("steady.coordinator_cores", (coord.cpu()-cpu0).Seconds()/el, "%.3f cores (coordinator), RSS %d MiB", (coord.cpu()-cpu0).Seconds()/el, coord.rssMiB())
	for i, c := range etcds {
		fig("steady."+c.name+"_cores", (c.cpu()-etcd0[i]).Seconds()/el, "%.3f cores, RSS %d MiB", (c.cpu()-etcd0[i]).Seconds()/el, c.rssMiB())
	}
	fig("steady.members_process_cores", (selfCPU()-self0).Seconds()/el, "%.3f cores (this process)", (selfCPU()-self0).Seconds()/el)
	fig("steady.watch_bytes_per_member_s", float64(bytes.watch.Load()-b0)/float64(n)/el, "%.1f B/s per member on watches", float64(bytes.watch.Load()-b0)/float64(n)/el)
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

	// Phase 3: one member of job 0 dies.
	if o.death == "none" || o.members < 2 {
		return printJSON(rep)
	}
	victim, witness := sims[0], sims[1]
	q0, _ := witness.m.Quorum()
	for _, s := range sims[:o.members] {
		s.seen.Store(0)
	}
	cpu0, etcd0, b0 = coord.cpu(), cpus(etcds), bytes.watch.Load()
	killed := time.Now()
	switch o.death {
	case "report":
		// Its process is gone (the port refuses) and a peer's collective
		// failed: the peer revokes the epoch blaming it, as ft does.
		victimL.Close()
		if err := witness.m.Revoke(ctx, q0.Epoch, "collective failed: connection reset", victim.m.ID()); err != nil {
			return err
		}
	case "lease":
		cli := clients[0] // the victim's: sims[i] uses clients[i%len(clients)]
		if _, err := cli.Revoke(ctx, clientv3.LeaseID(victim.m.Record().Lease)); err != nil {
			return err
		}
	default:
		return fmt.Errorf("unknown -death %q", o.death)
	}
	without := func(q membership.Quorum, ok bool) bool {
		return ok && q.Epoch > q0.Epoch && q.Rank(victim.m.ID()) < 0
	}
	decided, err = waitAll(ctx, sims[1:o.members], without)
	if err != nil {
		return fmt.Errorf("quorum after the death: %w", err)
	}
	seenAll = latest(sims[1:o.members])
	q1, _ := witness.m.Quorum()
	fig("death.decided", decided.Sub(killed).Seconds(), "%.3f s from the death (%s) to the quorum without it (epoch %d → %d)", decided.Sub(killed).Seconds(), o.death, q0.Epoch, q1.Epoch)
	fig("death.all_seen", seenAll.Sub(killed).Seconds(), "%.3f s until every survivor of the job saw it", seenAll.Sub(killed).Seconds())
	// Only job 0's members take part: bytes per member of that job, per epoch.
	de := float64(q1.Epoch - q0.Epoch)
	fig("death.watch_bytes_per_member_epoch", float64(bytes.watch.Load()-b0)/float64(o.members)/de,
		"%.0f B per member of the job per epoch (all watch bytes of the phase / %d members / %.0f epochs)", float64(bytes.watch.Load()-b0)/float64(o.members)/de, o.members, de)
	el = time.Since(killed).Seconds()
	fig("death.coordinator_cpu_seconds", (coord.cpu() - cpu0).Seconds(), "%.3f s of coordinator CPU in %.2f s", (coord.cpu() - cpu0).Seconds(), el)
	dbSizes(ctx, admin, clientAddrs, "end", fig)
	fig("end.coordinator_rss_mib", float64(coord.rssMiB()), "%d MiB", coord.rssMiB())
	return printJSON(rep)
}

func printJSON(rep report) error {
	b, _ := json.Marshal(rep)
	fmt.Printf("json %s\n", b)
	return nil
}

func acceptAll(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		c.Close()
	}
}

// waitAll waits until every member's quorum satisfies ok, noting when each
// saw it; it returns the latest Created of those quorums (when the
// coordinator decided it).
func waitAll(ctx context.Context, sims []*sim, ok func(membership.Quorum, bool) bool) (time.Time, error) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var decided time.Time
	failed := make(chan error, 1)
	for _, s := range sims {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				ch := s.m.Changed()
				if q, have := s.m.Quorum(); ok(q, have) {
					s.seen.Store(time.Now().UnixNano())
					mu.Lock()
					if q.Created.After(decided) {
						decided = q.Created
					}
					mu.Unlock()
					return
				}
				select {
				case <-ch:
				case <-s.m.Done():
					select {
					case failed <- fmt.Errorf("member %s: %w", s.m.ID(), s.m.Err()):
					default:
					}
					return
				case <-ctx.Done():
					select {
					case failed <- ctx.Err():
					default:
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-failed:
		return time.Time{}, err
	default:
	}
	return decided, nil
}

func latest(sims []*sim) time.Time {
	var t int64
	for _, s := range sims {
		t = max(t, s.seen.Load())
	}
	return time.Unix(0, t)
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

func cpus(cs []*child) []time.Duration {
	out := make([]time.Duration, len(cs))
	for i, c := range cs {
		out[i] = c.cpu()
	}
	return out
}

// procCPU is a process's user+system time (Linux /proc).
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	k, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+k) * time.Second / 100 // USER_HZ
}

func procRSSKiB(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			n, _ := strconv.Atoi(strings.Fields(v)[0])
			return n
		}
	}
	return 0
}

func selfCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

func machine() string {
	b, _ := os.ReadFile("/proc/cpuinfo")
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "model name"); ok {
			return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
		}
	}
	return runtime.GOARCH
}

// setFormWindow sets the coordinator's forming window (batched joins; 0:
// none).
func setFormWindow(q *quorum.Config, window, maxWait time.Duration) {
	q.FormWindow = window
	if window == 0 {
		q.FormWindow = -1
	}
	if maxWait > 0 {
		q.FormMaxWait = maxWait
	}
}
