package deploy

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/coordinator/server"
	"github.com/ftcomm/ftcomm/membership"
)

var (
	sizingMembers = flag.Int("deploy.members", 0, "members joining one job in TestLoopbackSizing (0: skip the test)")
	sizingSteady  = flag.Duration("deploy.steady", 30*time.Second, "how long TestLoopbackSizing watches the joined members")
	sizingClients = flag.Int("deploy.clients", 8, "etcd clients the members of TestLoopbackSizing share")
	sizingMin     = flag.Int("deploy.min-replicas", 0, "the members' MinReplicas in TestLoopbackSizing (0: the default)")
)

// TestLoopbackSizing measures the figures docs/deploy.md sizes with, on
// the topology of kubernetes/overlays/ha as processes on loopback (a
// 3-member etcd with TLS, client certificates and authentication; three
// ftcoord): N members of one job (membership.Member, as ft.Comm runs one
// per replica, gossip off, lease TTL 5 s) join with the trainers'
// credentials, spread over a few etcd clients in this process. It reports
// how long until one quorum holds them all, then, over a steady window,
// the epochs published (0 expected: no lease may lapse), the CPU and
// memory of the leading ftcoord and of each etcd member, and last how long
// a graceful leave takes to become an epoch.
//
//	go test -run TestLoopbackSizing -v ./deploy -args -deploy.members=1000
func TestLoopbackSizing(t *testing.T) {
	if *sizingMembers == 0 {
		t.Skip("sizing run: enable with -args -deploy.members=N")
	}
	n := *sizingMembers
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute+*sizingSteady)
	defer cancel()
	tp := startTopology(t, ctx)
	creds, err := membership.LoadCredentials(tp.creds)
	if err != nil {
		t.Fatal(err)
	}
	clients := make([]*clientv3.Client, *sizingClients)
	for i := range clients {
		if clients[i], err = creds.NewClient(nil); err != nil {
			t.Fatal(err)
		}
		defer clients[i].Close()
	}
	const job = "sizing"
	members := make([]*membership.Member, n)
	defer func() {
		// Coordinators first, so that the leaves below publish no
		// epochs (each would go to every member's watch).
		for _, p := range tp.coords {
			p.cmd.Process.Kill()
		}
		var wg sync.WaitGroup
		for _, m := range members {
			if m != nil {
				wg.Add(1)
				go func() { defer wg.Done(); m.Close() }()
			}
		}
		wg.Wait()
	}()
	start := time.Now()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	errs := make(chan error, n)
	for i := range members {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			mc := membership.DefaultMemberConfig()
			mc.Client, mc.Job, mc.ID, mc.Addr, mc.WantQuorum = clients[i%len(clients)], job, fmt.Sprintf("m%05d", i), "127.0.0.1:1", true
			if *sizingMin > 0 {
				mc.MinReplicas = *sizingMin
			}
			creds.ApplyMember(&mc)
			m, err := membership.Join(ctx, mc)
			if err != nil {
				errs <- err
				return
			}
			members[i] = m
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	registered := time.Since(start)
	q := waitQuorum(t, ctx, tp.api, tp.apis, job, 0, n, "")
	all := time.Since(start)
	var info server.CoordinatorInfo
	if err := tp.api.get(tp.apis["ftcoord-0"]+"/api/v1/coordinator", &info); err != nil {
		t.Fatal(err)
	}
	leader := tp.coords[info.Leader]
	t.Logf("%d members registered in %v; epoch %d holds all of them %v after the first join (published by %s)",
		n, registered.Round(time.Millisecond), q.Epoch, all.Round(time.Millisecond), info.Leader)

	// Steady: nothing changes; what does it cost?
	procs := append([]*proc{leader}, tp.etcd...)
	cpu0 := make([]time.Duration, len(procs))
	for i, p := range procs {
		cpu0[i] = cpuTime(t, p)
	}
	steadyStart := time.Now()
	select {
	case <-time.After(*sizingSteady):
	case <-ctx.Done():
		t.Fatal(ctx.Err())
	}
	elapsed := time.Since(steadyStart)
	var q2 membership.Quorum
	if err := tp.api.get(tp.apis[info.Leader]+"/api/v1/jobs/"+job+"/quorum", &q2); err != nil {
		t.Fatal(err)
	}
	for i, p := range procs {
		used := cpuTime(t, p) - cpu0[i]
		t.Logf("steady %v: %s used %.1f%% of a core, RSS %d MiB", elapsed.Round(time.Second), p.name,
			100*used.Seconds()/elapsed.Seconds(), rssKiB(t, p)/1024)
	}
	t.Logf("steady %v: %d epochs published (want 0), %d participants", elapsed.Round(time.Second), q2.Epoch-q.Epoch, len(q2.Participants))
	if q2.Epoch != q.Epoch {
		t.Errorf("epochs changed in the steady window: %d → %d (%s)", q.Epoch, q2.Epoch, q2.Reason)
	}

	if *sizingMin >= n {
		return // a quorum of n-1 could not form
	}
	left := time.Now()
	members[0].Close()
	q3 := waitQuorum(t, ctx, tp.api, tp.apis, job, q2.Epoch, n-1, "")
	t.Logf("a member left: epoch %d with %d participants %v later", q3.Epoch, n-1, time.Since(left).Round(time.Millisecond))
}

// cpuTime is the user and system CPU time a running process used so far.
func cpuTime(t *testing.T, p *proc) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	// Fields after the command (which may hold spaces) in parentheses.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime+stime) * time.Second / 100 // USER_HZ
}

// rssKiB is a running process's resident memory.
func rssKiB(t *testing.T, p *proc) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kib, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kib
		}
	}
	return 0
}
