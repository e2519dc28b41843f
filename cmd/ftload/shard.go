package main

import (
	"bufio"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"runtime/pprof"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cenkalti/backoff/v4"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/membership"
)

// A shard simulates some of the job's members: in this process (-shards
// 0, as before), or in a child process (role "members") that the load
// process drives over its stdin and stdout, one JSON request and one JSON
// answer per line. A process's file and port limits then bound a shard,
// not the job; the victims of the death phases have shards of their own,
// so that their deaths are real process deaths (SIGKILL: their ports
// refuse, their links reset).

// shardReq is one request to a shard.
type shardReq struct {
	Op string `json:"op"` // join, wait, follow, revoke, churn, die, stats
	// join: wave 0 joins the members that lead their group (group rank
	// 0), wave 1 the others.
	Wave int `json:"wave,omitempty"`
	// wait: until every member's quorum has an epoch above After, Size
	// participants (0: any) and none of Without, for at most Timeout (0:
	// no bound): a wait that ends unseen answers with the members it
	// still waited for and what each held.
	After   uint64        `json:"after,omitempty"`
	Size    int           `json:"size,omitempty"`
	Without []string      `json:"without,omitempty"`
	Timeout time.Duration `json:"timeout,omitempty"`
	// follow: until the shard's members of Group are bound to one lease
	// other than NotLease.
	Group    string `json:"group,omitempty"`
	NotLease int64  `json:"notLease,omitempty"`
	// revoke: the shard's first member revokes Epoch blaming Blame. die:
	// the member of Rank dies How (report: its address refuses; lease:
	// its lease is revoked). churn: N epochs, each revoked by the shard's
	// first member once it sees it.
	Epoch uint64   `json:"epoch,omitempty"`
	Blame []string `json:"blame,omitempty"`
	Rank  int      `json:"rank,omitempty"`
	How   string   `json:"how,omitempty"`
	N     int      `json:"n,omitempty"`
}

// shardResp is a shard's answer.
type shardResp struct {
	Err      string `json:"err,omitempty"`
	LastJoin int64  `json:"lastJoin,omitempty"` // unix ns
	// Seen is when the last member saw what it waited for (unix ns),
	// Decided the latest Created of those quorums, Epoch the highest
	// epoch among them.
	Seen    int64  `json:"seen,omitempty"`
	Decided int64  `json:"decided,omitempty"`
	Epoch   uint64 `json:"epoch,omitempty"`
	Members int    `json:"members,omitempty"`
	// SeenAt is when each member waited for saw it (unix ns), and
	// Slowest the last few of them to, with what each held then (wait).
	SeenAt  []int64      `json:"seenAt,omitempty"`
	Slowest []slowMember `json:"slowest,omitempty"`
	// stats
	WatchBytes int64   `json:"watchBytes,omitempty"`
	CPU        float64 `json:"cpu,omitempty"` // seconds of this process
	// Leases are the shard's members' leases (stats: for counting them).
	Leases []int64 `json:"leases,omitempty"`
	// Lease is a member's lease (stats with Rank).
	Lease int64 `json:"lease,omitempty"`
}

// shardConfig is what every shard shares.
type shardConfig struct {
	endpoints                 []string
	jobs, members             int
	groupSize                 int
	groupLease                bool
	clients, parallel         int
	leaseTTL, heartbeat       time.Duration
	minReplicas               int
	shareQuorums, linkIPs     bool
	linkInterval, linkTimeout time.Duration
	ranks                     []int // global member indices
	victimAddrOwn             int   // the rank with an address of its own (-1: none), for -death report in one process
}

// shardServer is a shard's members and what it answers with.
type shardServer struct {
	cfg     shardConfig
	clients []*clientv3.Client
	bytes   *byteCounter
	cache   *membership.QuorumCache
	addr    net.Listener // every member's Addr but the victim's
	victim  net.Listener // victimAddrOwn's (nil: none)
	sims    []*sim
}

func jobName(j int) string { return fmt.Sprintf("load%04d", j) }

func newShardServer(cfg shardConfig) (*shardServer, error) {
	s := &shardServer{cfg: cfg, bytes: &byteCounter{}}
	if cfg.shareQuorums {
		s.cache = membership.NewQuorumCache()
	}
	s.clients = make([]*clientv3.Client, cfg.clients)
	for i := range s.clients {
		cc := membership.ClientConfig(cfg.endpoints, nil)
		cc.DialOptions = append(cc.DialOptions, grpc.WithStatsHandler(s.bytes))
		var err error
		if s.clients[i], err = clientv3.New(cc); err != nil {
			s.close()
			return nil, err
		}
	}
	var err error
	if s.addr, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		s.close()
		return nil, err
	}
	go acceptAll(s.addr)
	if cfg.victimAddrOwn >= 0 {
		if s.victim, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			s.close()
			return nil, err
		}
		go acceptAll(s.victim)
	}
	for _, r := range cfg.ranks {
		s.sims = append(s.sims, &sim{rank: r, job: r / cfg.members, idx: r % cfg.members})
	}
	return s, nil
}

// close ends the shard's members (Close: as a process that exits; the
// coordinator is stopped first, so that nothing is published) and
// clients.
func (s *shardServer) close() {
	var wg sync.WaitGroup
	sem := make(chan struct{}, max(s.cfg.parallel, 1))
	for _, sm := range s.sims {
		if sm.m != nil {
			wg.Add(1)
			sem <- struct{}{}
			go func() { defer wg.Done(); sm.m.Close(); <-sem }()
		}
	}
	wg.Wait()
	for _, c := range s.clients {
		if c != nil {
			c.Close()
		}
	}
	if s.addr != nil {
		s.addr.Close()
	}
	if s.victim != nil {
		s.victim.Close()
	}
}

// linkAddr spreads the group links' listeners over loopback addresses
// (127.1.x.1): one address has 64K ports, a job of 100,000 members one
// listener each.
func (s *shardServer) linkAddr(rank int) string {
	if !s.cfg.linkIPs {
		return "127.0.0.1:0"
	}
	return fmt.Sprintf("127.1.%d.1:0", (rank>>14)%256)
}

func (s *shardServer) handle(ctx context.Context, req shardReq) shardResp {
	var r shardResp
	var err error
	switch req.Op {
	case "join":
		r.LastJoin, err = s.join(ctx, req.Wave)
		r.Members = len(s.sims)
	case "wait":
		without := map[string]bool{}
		for _, id := range req.Without {
			without[id] = true
		}
		// Every member's quorum of an epoch is the same: look for the
		// victims once per epoch.
		var mu sync.Mutex
		clean := map[string]bool{}
		r, err = s.wait(ctx, without, req.Timeout, func(q membership.Quorum, ok bool) bool {
			if !ok || q.Epoch <= req.After || req.Size > 0 && len(q.Participants) != req.Size {
				return false
			}
			if len(without) == 0 {
				return true
			}
			key := fmt.Sprintf("%s/%d", q.Job, q.Epoch)
			mu.Lock()
			defer mu.Unlock()
			v, seen := clean[key]
			if !seen {
				v = true
				for _, p := range q.Participants {
					if without[p.ID] {
						v = false
						break
					}
				}
				clean[key] = v
			}
			return v
		})
	case "follow":
		r.Seen, err = s.follow(ctx, req.Group, req.NotLease)
	case "revoke":
		by := s.first()
		for _, sm := range s.sims {
			if sm.m != nil && sm.m.Err() == nil && !slices.Contains(req.Blame, sm.m.ID()) {
				by = sm
				break
			}
		}
		err = by.m.Revoke(ctx, req.Epoch, "collective failed: connection reset", req.Blame...)
	case "churn":
		r.Epoch, err = s.churn(ctx, req.N)
	case "die":
		err = s.die(ctx, req.Rank, req.How)
	case "stats":
		r.WatchBytes, r.CPU = s.bytes.watch.Load(), selfCPU().Seconds()
		for _, sm := range s.sims {
			if sm.m != nil {
				r.Leases = append(r.Leases, sm.m.Record().Lease)
				if sm.rank == req.Rank {
					r.Lease = sm.m.Record().Lease
				}
			}
		}
	default:
		err = fmt.Errorf("unknown op %q", req.Op)
	}
	if err != nil {
		r.Err = err.Error()
	}
	return r
}

func (s *shardServer) first() *sim {
	for _, sm := range s.sims {
		if sm.m != nil && sm.m.Err() == nil {
			return sm
		}
	}
	return s.sims[0]
}

// join joins the members of a wave, cfg.parallel at a time, and returns
// when the last Join returned (unix ns; 0: none in the wave).
func (s *shardServer) join(ctx context.Context, wave int) (int64, error) {
	var lastJoin atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, s.cfg.parallel)
	errs := make(chan error, len(s.sims))
	lg := zap.NewNop()
	switch os.Getenv("FTLOAD_MEMBER_LOGS") {
	case "":
	case "info": // every removal, takeover and move, with its cause
		lg, _ = zap.NewProduction()
	default:
		lg, _ = zap.NewProduction(zap.IncreaseLevel(zapcore.WarnLevel))
	}
	for i, sm := range s.sims {
		leads := sm.idx%s.cfg.groupSize == 0
		if wave == 0 && !leads || wave == 1 && leads {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			mc := membership.DefaultMemberConfig()
			mc.Client, mc.Job, mc.ID = s.clients[i%len(s.clients)], jobName(sm.job), memberID(sm.idx)
			mc.Addr, mc.Group, mc.WantQuorum = s.addr.Addr().String(), fmt.Sprintf("g%06d", sm.idx/s.cfg.groupSize), true
			mc.LeaseTTL, mc.HeartbeatInterval, mc.MinReplicas = s.cfg.leaseTTL, s.cfg.heartbeat, s.cfg.minReplicas
			mc.Quorums, mc.Logger = s.cache, lg
			if s.cfg.groupLease && s.cfg.groupSize > 1 {
				mc.GroupLease, mc.GroupLinkAddr = true, s.linkAddr(sm.rank)
				mc.GroupLinkInterval, mc.GroupLinkTimeout = s.cfg.linkInterval, s.cfg.linkTimeout
			}
			if sm.rank == s.cfg.victimAddrOwn && s.victim != nil {
				mc.Addr = s.victim.Addr().String()
			}
			m, err := membership.Join(ctx, mc)
			if err != nil {
				errs <- fmt.Errorf("join %s: %w", mc.ID, err)
				return
			}
			sm.m = m
			lastJoin.Store(max(lastJoin.Load(), time.Now().UnixNano()))
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		return 0, err
	}
	return lastJoin.Load(), nil
}

func memberID(idx int) string { return fmt.Sprintf("m%06d", idx) }

// wait waits until every live member's quorum satisfies ok (see
// waitAll), but for the members of skip (the victims), for at most
// timeout (0: until ctx ends). A wait that fails says which members it
// still waited for and what each held (laggards).
func (s *shardServer) wait(ctx context.Context, skip map[string]bool, timeout time.Duration, ok func(membership.Quorum, bool) bool) (shardResp, error) {
	var live []*sim
	for _, sm := range s.sims {
		if sm.m != nil && sm.m.Err() != nil && !skip[sm.m.ID()] {
			// Its registration is gone (a link silent past its timeout, a
			// lease that lapsed: an overloaded host): the quorum will not
			// hold it again. Say so rather than wait.
			return shardResp{}, fmt.Errorf("member %s ended before the wait: %w (%s)", sm.m.ID(), sm.m.Err(), s.laggards([]*sim{sm}, ok))
		}
		if sm.m != nil && sm.m.Err() == nil && !skip[sm.m.ID()] {
			sm.seen.Store(0)
			live = append(live, sm)
		}
	}
	wctx := ctx
	if timeout > 0 {
		var cancel context.CancelFunc
		wctx, cancel = context.WithTimeoutCause(ctx, timeout, fmt.Errorf("not seen within %v", timeout))
		defer cancel()
	}
	decided, err := waitAll(wctx, live, ok)
	if err != nil {
		return shardResp{}, fmt.Errorf("%w (%s)", err, s.laggards(live, ok))
	}
	r := shardResp{Seen: latest(live).UnixNano(), Decided: decided.UnixNano(), Members: len(live)}
	for _, sm := range live {
		q, _ := sm.m.Quorum()
		r.Epoch = max(r.Epoch, q.Epoch)
		r.SeenAt = append(r.SeenAt, sm.seen.Load())
	}
	slow := slices.Clone(live)
	slices.SortFunc(slow, func(a, b *sim) int { return cmp.Compare(b.seen.Load(), a.seen.Load()) })
	for _, sm := range slow[:min(len(slow), slowestNamed)] {
		st := sm.m.State()
		r.Slowest = append(r.Slowest, slowMember{ID: st.ID, Seen: sm.seen.Load(), Leads: st.Leads, Leader: st.Leader,
			Watched: st.Watched, Forwarded: st.Forwarded, Read: st.Read, Epoch: st.Epoch})
	}
	return r, nil
}

// slowestNamed is how many of its slowest members a shard's wait names.
const slowestNamed = 4

// slowMember is one of the last members of a shard to see what a wait
// waited for: when, and how its quorum came (MemberState).
type slowMember struct {
	ID                       string `json:"id"`
	Seen                     int64  `json:"seen"` // unix ns
	Leads                    bool   `json:"leads,omitempty"`
	Leader                   string `json:"leader,omitempty"`
	Watched, Forwarded, Read uint64
	Epoch                    uint64 `json:"epoch"`
}

// laggardsNamed is how many of the members a failed wait still waited for
// it describes one by one (the rest are counted).
const laggardsNamed = 8

// laggards says which of live a wait that failed still waited for: how
// many, by the epoch and role each held, and for a few of them what the
// member holds (membership.MemberState) and what etcd holds for it — its
// registration (incarnation, lease and whether the lease is alive) and
// its group's record.
func (s *shardServer) laggards(live []*sim, ok func(membership.Quorum, bool) bool) string {
	var behind []*sim
	kinds := map[string]int{}
	for _, sm := range live {
		if q, has := sm.m.Quorum(); ok(q, has) {
			continue
		}
		behind = append(behind, sm)
		st := sm.m.State()
		role := "no group lease"
		switch {
		case st.Err != nil:
			role = "ended"
		case st.GroupLease && st.Leads:
			role = "leads"
		case st.GroupLease && st.Linked:
			role = "follows, linked"
		case st.GroupLease:
			role = "follows, not linked"
		}
		in := ""
		if st.Epoch > 0 && !st.InQuorum {
			in = ", not in it"
		}
		kinds[fmt.Sprintf("epoch %d of %d%s, %s", st.Epoch, st.Participants, in, role)]++
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d of %d members still waited for; by what they held: ", len(behind), len(live))
	ks := slices.Sorted(maps.Keys(kinds))
	for i, k := range ks {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%d at %s", kinds[k], k)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i, sm := range behind {
		if i == laggardsNamed {
			fmt.Fprintf(&b, " | and %d more", len(behind)-i)
			break
		}
		fmt.Fprintf(&b, " | %s; in etcd: %s", sm.m.State(), s.registration(ctx, sm))
	}
	return b.String()
}

// registration says what etcd holds for a member: its registration (is it
// this incarnation's, on which lease, is the lease alive) and its group's
// record.
func (s *shardServer) registration(ctx context.Context, sm *sim) string {
	cli := s.clients[0]
	k := etcdkeys.Layout{}.Member(jobName(sm.job), sm.m.ID())
	resp, err := cli.Get(ctx, k)
	var b strings.Builder
	switch {
	case err != nil:
		fmt.Fprintf(&b, "registration unread (%v)", err)
	case len(resp.Kvs) == 0:
		b.WriteString("no registration")
	default:
		kv := resp.Kvs[0]
		who := "this incarnation"
		if kv.CreateRevision != sm.m.Incarnation() {
			who = fmt.Sprintf("another incarnation (%d, this one %d)", kv.CreateRevision, sm.m.Incarnation())
		}
		fmt.Fprintf(&b, "registered as %s on lease %x (%s)", who, kv.Lease, leaseTTL(ctx, cli, kv.Lease))
	}
	if g := sm.m.Record().Group; g != "" && s.cfg.groupLease {
		resp, err := cli.Get(ctx, etcdkeys.Layout{}.GroupLease(jobName(sm.job), g))
		switch {
		case err != nil:
			fmt.Fprintf(&b, "; group record unread (%v)", err)
		case len(resp.Kvs) == 0:
			fmt.Fprintf(&b, "; group %s has no record", g)
		default:
			var rec struct { // membership's group record, as any reader of the job's keys sees it
				Lease  int64  `json:"lease,string"`
				Leader string `json:"leader"`
				Claim  string `json:"claim"`
			}
			json.Unmarshal(resp.Kvs[0].Value, &rec)
			fmt.Fprintf(&b, "; group %s's record (rev %d) names leader %s on lease %x (%s)", g, resp.Kvs[0].ModRevision, rec.Leader, rec.Lease, leaseTTL(ctx, cli, rec.Lease))
			if rec.Claim != "" {
				fmt.Fprintf(&b, ", taken over by %s (claimed)", rec.Claim)
			}
		}
	}
	return b.String()
}

// leaseTTL says whether a lease is alive and for how long.
func leaseTTL(ctx context.Context, cli *clientv3.Client, lease int64) string {
	if lease == 0 {
		return "no lease"
	}
	r, err := cli.TimeToLive(ctx, clientv3.LeaseID(lease))
	switch {
	case err != nil:
		return fmt.Sprintf("TTL unread: %v", err)
	case r.TTL < 0:
		return "expired"
	}
	return fmt.Sprintf("%d s left", r.TTL)
}

// follow waits until the shard's live members of group are bound to one
// lease other than notLease, and returns when (unix ns).
func (s *shardServer) follow(ctx context.Context, group string, notLease int64) (int64, error) {
	for {
		var lease int64
		moved := true
		for _, sm := range s.sims {
			if sm.m == nil || sm.m.Err() != nil || sm.m.Record().Group != group {
				continue
			}
			l := sm.m.Record().Lease
			if l == notLease || lease != 0 && l != lease {
				moved = false
				break
			}
			lease = l
		}
		if moved {
			return time.Now().UnixNano(), nil
		}
		// A lease move changes no quorum: poll, paced.
		select {
		case <-time.After(5 * time.Millisecond):
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// churn has the shard's first member revoke its current epoch n times,
// each once it holds the one before: n epochs with the same participants
// (a failed commit's path). It returns the last epoch.
func (s *shardServer) churn(ctx context.Context, n int) (uint64, error) {
	sm := s.first()
	q, ok := sm.m.Quorum()
	if !ok {
		return 0, fmt.Errorf("member %s holds no quorum", sm.m.ID())
	}
	for i := 0; i < n; i++ {
		// A revocation is idempotent (the first record of an epoch wins):
		// try again when etcd does not answer (an overloaded host).
		bo := backoff.WithContext(backoff.NewExponentialBackOff(backoff.WithMaxElapsedTime(30*time.Second)), ctx)
		if err := backoff.Retry(func() error { return sm.m.Revoke(ctx, q.Epoch, "ftload: churn") }, bo); err != nil {
			return 0, err
		}
		next, err := sm.m.NextQuorum(ctx, q.Epoch)
		if err != nil {
			return 0, err
		}
		q = next
	}
	return q.Epoch, nil
}

// die kills the member of rank in this process: how "report" closes its
// own address (a peer then revokes blaming it), "lease" revokes its lease.
func (s *shardServer) die(ctx context.Context, rank int, how string) error {
	for _, sm := range s.sims {
		if sm.rank != rank || sm.m == nil {
			continue
		}
		switch how {
		case "report":
			if s.victim == nil {
				return fmt.Errorf("rank %d has no address of its own", rank)
			}
			return s.victim.Close()
		case "lease":
			_, err := s.clients[0].Revoke(ctx, clientv3.LeaseID(sm.m.Record().Lease))
			return err
		}
		return fmt.Errorf("unknown death %q", how)
	}
	return fmt.Errorf("rank %d is not in this shard", rank)
}

// runMembers is a child shard: it serves requests on stdin until stdin
// closes or a signal comes, then closes its members.
func runMembers(o options) error {
	raiseFileLimit()
	ctx, cancel := untilSignal()
	defer cancel()
	ranks, err := parseRanks(o.ranks)
	if err != nil {
		return err
	}
	s, err := newShardServer(shardConfig{endpoints: strings.Split(o.endpoints, ","), jobs: o.jobs, members: o.members,
		groupSize: o.groupSize, groupLease: o.groupLease, clients: o.clients, parallel: o.parallel, leaseTTL: o.leaseTTL,
		heartbeat: o.heartbeat, minReplicas: o.minReplicas, shareQuorums: o.shareQuorums, linkIPs: o.linkIPs,
		linkInterval: o.linkInterval, linkTimeout: o.linkTimeout, ranks: ranks, victimAddrOwn: -1})
	if err != nil {
		return err
	}
	defer s.close()
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var req shardReq
		if err := json.Unmarshal(in.Bytes(), &req); err != nil {
			return fmt.Errorf("shard request: %w", err)
		}
		if err := out.Encode(s.handle(ctx, req)); err != nil {
			return err
		}
	}
	// The run is over: write the profile (-profile) before closing the
	// members, which at thousands may outlast the parent's wait and end
	// in SIGKILL.
	pprof.StopCPUProfile()
	return in.Err()
}

// shard is the load process's handle on a shard.
type shard struct {
	name  string
	ranks []int
	local *shardServer // in this process
	// a child
	proc   *child
	in     io.WriteCloser
	out    *bufio.Scanner
	mu     sync.Mutex
	dead   bool
	broken bool // a request's answer was abandoned (ctx ended)
}

func (sh *shard) call(ctx context.Context, req shardReq) (shardResp, error) {
	if sh.local != nil {
		r := sh.local.handle(ctx, req)
		if r.Err != "" {
			return r, fmt.Errorf("shard %s: %s: %s", sh.name, req.Op, r.Err)
		}
		return r, nil
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.broken {
		return shardResp{}, fmt.Errorf("shard %s: an earlier request was abandoned", sh.name)
	}
	b, _ := json.Marshal(req)
	if _, err := sh.in.Write(append(b, '\n')); err != nil {
		return shardResp{}, fmt.Errorf("shard %s: %w", sh.name, err)
	}
	// The answer, or ctx's end: a shard that waits for something that
	// never comes must not hold the run (the shard is then abandoned,
	// and stopped with the rest).
	answer := make(chan []byte, 1)
	go func() {
		if sh.out.Scan() {
			answer <- append([]byte(nil), sh.out.Bytes()...)
		} else {
			answer <- nil
		}
	}()
	var line []byte
	select {
	case line = <-answer:
	case <-ctx.Done():
		sh.broken = true
		return shardResp{}, fmt.Errorf("shard %s: %s: %w", sh.name, req.Op, ctx.Err())
	}
	if line == nil {
		return shardResp{}, fmt.Errorf("shard %s: no answer to %s: %v", sh.name, req.Op, sh.out.Err())
	}
	var r shardResp
	if err := json.Unmarshal(line, &r); err != nil {
		return r, fmt.Errorf("shard %s: %w", sh.name, err)
	}
	if r.Err != "" {
		return r, fmt.Errorf("shard %s: %s: %s", sh.name, req.Op, r.Err)
	}
	return r, nil
}

// kill ends a child shard as a crash would (SIGKILL).
func (sh *shard) kill() {
	sh.dead = true
	sh.proc.cmd.Process.Kill()
	sh.proc.cmd.Wait()
}

func (sh *shard) stop() {
	switch {
	case sh.local != nil:
		sh.local.close()
	case !sh.dead:
		sh.in.Close() // it closes its members and exits
		sh.proc.stop()
	}
}

func (sh *shard) cpu() time.Duration {
	if sh.local != nil || sh.dead {
		return 0
	}
	return sh.proc.cpu()
}

// startShard starts a child shard simulating ranks.
func startShard(name string, ranks []int, args []string) (*shard, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, append(args, "-role", "members", "-ranks", formatRanks(ranks))...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	outR, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	out := bufio.NewScanner(outR)
	out.Buffer(make([]byte, 1<<20), 64<<20)
	return &shard{name: name, ranks: ranks, proc: &child{name: name, cmd: cmd}, in: in, out: out}, nil
}

// all calls every live shard at once and returns their answers.
func all(ctx context.Context, shards []*shard, req shardReq) ([]shardResp, error) {
	out := make([]shardResp, len(shards))
	errs := make([]error, len(shards))
	var wg sync.WaitGroup
	for i, sh := range shards {
		if sh.dead {
			continue
		}
		wg.Add(1)
		go func() { defer wg.Done(); out[i], errs[i] = sh.call(ctx, req) }()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return out, err
		}
	}
	return out, nil
}

// formatRanks writes ranks (sorted) as ranges: "0-99,150,200-299".
func formatRanks(ranks []int) string {
	rs := append([]int(nil), ranks...)
	sort.Ints(rs)
	var b strings.Builder
	for i := 0; i < len(rs); {
		j := i
		for j+1 < len(rs) && rs[j+1] == rs[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		if i == j {
			fmt.Fprintf(&b, "%d", rs[i])
		} else {
			fmt.Fprintf(&b, "%d-%d", rs[i], rs[j])
		}
		i = j + 1
	}
	return b.String()
}

func parseRanks(s string) ([]int, error) {
	var out []int
	for _, part := range strings.Split(s, ",") {
		if part == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			return nil, fmt.Errorf("-ranks %q: %w", s, err)
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil || b < a {
				return nil, fmt.Errorf("-ranks %q: bad range %q", s, part)
			}
		}
		for r := a; r <= b; r++ {
			out = append(out, r)
		}
	}
	return out, nil
}

// raiseFileLimit raises this process's open-file limit to its hard limit:
// every member holds sockets (its group's link and listener), and the
// soft limit is often 1,024.
func raiseFileLimit() {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) == nil && l.Cur < l.Max {
		l.Cur = l.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l)
	}
}
