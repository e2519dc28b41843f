// Command ftload measures ftcomm's membership at scale: a 3-member etcd
// cluster on loopback (child processes of this binary, fsync on, etcd's
// default request limit), a real coordinator (a child process, so its CPU
// is its own) and N simulated members per job, each a real
// membership.Member (Join, lease keepalive, watches, heartbeats, group
// leases and links) over real etcd client connections that the members of
// one process share (-clients). The members run in this process
// (-shards 0) or in -shards child processes that it drives over their
// stdin and stdout (a host's file and port limits bound a process, not
// the job); the victims of the death phases then run in processes of
// their own and die by SIGKILL. Gossip is off: thousands of memberlist
// nodes in one process measure the process, not the membership; links,
// death reports and lease expiry are the failure detectors here.
//
// It reports, per phase — forming, steady, one death, a group leader's
// death, a share of the ranks dying at once, many epochs — the time from
// the event to the quorum that follows (when the coordinator decided it
// and when the last member saw it), epochs, the bytes the members'
// clients received on their watch streams, the CPU and memory of the
// coordinator and of each etcd member, and etcd's database size. See
// docs/scaling.md and docs/capacity.md; device.sh runs the 10K and 100K
// figures on a bigger host.
//
//	go build ./cmd/ftload && ./ftload -members 2000
//	./ftload -jobs 1000 -members 10
//	./ftload -members 20000 -group-size 8 -group-lease -shards 4 -epochs 100
//
// Built with CGO_ENABLED=0 it is one static binary with no dependencies,
// for a bigger host.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

type options struct {
	role string

	// load
	jobs, members, groupSize  int
	groupLease                bool
	clients, parallel         int
	etcdMembers               int
	fsync                     bool
	leaseTTL, heartbeat       time.Duration
	minReplicas               int
	steady                    time.Duration
	death                     string
	dir                       string
	formWindow, formMaxWait   time.Duration
	timeout                   time.Duration
	profile                   string
	shards                    int
	massDeath                 float64
	epochs                    int
	shareQuorums, linkIPs     bool
	linkInterval, linkTimeout time.Duration
	etcdStats                 time.Duration
	waitTimeout               time.Duration

	// children
	name, clientAddr, peerAddr, initialCluster, dataDir, endpoints string
	ranks                                                          string
}

func main() {
	var o options
	flag.StringVar(&o.role, "role", "load", "load (the default), or etcd, coordinator and members (the children it starts)")
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
	flag.StringVar(&o.profile, "profile", "", "write CPU profiles of this process, the coordinator and the etcd members to this directory (load.pprof, coordinator.pprof, etcd-0.pprof, ...)")
	flag.IntVar(&o.shards, "shards", 0, "simulate the members in this many child processes (0: in this process, as before); the victims of the death phases get processes of their own, and die by SIGKILL")
	flag.Float64Var(&o.massDeath, "mass-death", 0.01, "with -shards, the share of job 0's ranks that die at once (every 1/share-th rank, in a process of their own; 0: no such phase)")
	flag.IntVar(&o.epochs, "epochs", 0, "after the deaths, publish this many epochs (a member revokes each: a failed commit's path) and report etcd's database size")
	flag.BoolVar(&o.shareQuorums, "share-quorums", true, "the members of one process share decoded quorums (membership.QuorumCache): one copy per process, not per member")
	flag.DurationVar(&o.linkInterval, "link-interval", 200*time.Millisecond, "group links' ping interval (MemberConfig.GroupLinkInterval)")
	flag.DurationVar(&o.linkTimeout, "link-timeout", time.Second, "group links' silence that is a death (MemberConfig.GroupLinkTimeout; a killed process's link resets at once)")
	flag.DurationVar(&o.etcdStats, "etcd-stats", 0, "print each etcd member's load every this often (apply's lag behind commit, unsynced watchers, lease renewals and revocations, slow applies, CPU; 0: never)")
	flag.DurationVar(&o.waitTimeout, "wait-timeout", time.Minute, "how long a phase waits for every member to see its quorum before it fails, naming the members it waited for, what each held, and what the coordinator's record holds")
	flag.BoolVar(&o.linkIPs, "link-ips", true, "spread the group links' listeners over 127.1.x.1 (one loopback address has 64K ports)")
	flag.StringVar(&o.ranks, "ranks", "", "child members: the global member indices it simulates (\"0-99,150\")")
	flag.StringVar(&o.name, "name", "", "child: etcd member name")
	flag.StringVar(&o.clientAddr, "client-addr", "", "child: etcd client address")
	flag.StringVar(&o.peerAddr, "peer-addr", "", "child: etcd peer address")
	flag.StringVar(&o.initialCluster, "initial-cluster", "", "child: etcd initial cluster")
	flag.StringVar(&o.dataDir, "data-dir", "", "child: etcd data directory")
	flag.StringVar(&o.endpoints, "endpoints", "", "child: etcd endpoints of the coordinator")
	flag.Parse()
	if o.profile != "" {
		name := o.role
		if o.name != "" {
			name = o.name // several etcd members and shards
		}
		f, err := os.Create(filepath.Join(o.profile, name+".pprof"))
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
	case "members":
		err = runMembers(o)
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
	if os.Getenv("FTLOAD_MEMBER_LOGS") == "info" || os.Getenv("FTLOAD_COORD_LOGS") == "info" { // each publication and removal too
		lg, _ = zap.NewProduction()
	}
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
