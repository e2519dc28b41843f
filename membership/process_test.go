package membership_test

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/membership/gossip"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// The test binary doubles as a member process (FTCOMM_TEST_MEMBER) and as a
// CPU burner (FTCOMM_TEST_BUSY) for the process-level tests.
func TestMain(m *testing.M) {
	switch {
	case os.Getenv("FTCOMM_TEST_BUSY") != "":
		//lint:ignore SA5002 burning a core is the point
		for {
		}
	case os.Getenv("FTCOMM_TEST_MEMBER") != "":
		os.Exit(memberProcess())
	}
	os.Exit(m.Run())
}

// memberProcess joins as the member described by the environment, prints
// "joined <incarnation>", and stays until SIGTERM (then prints its gossip
// stats and leaves) or until its membership is lost (exit 3). With
// FTCOMM_TEST_GROUP it joins that replica group on the group's lease, and
// with FTCOMM_TEST_HOLDLINK it does not link to the group's leader. With
// FTCOMM_TEST_FASTLINK its links ping every 50 ms and time out after
// 300 ms, and each SIGUSR2 starves them or ends that: while starved, its
// links send nothing and a goroutine spins (the process stays runnable,
// as one starved of CPU); it prints "starved" and "fed".
func memberProcess() int {
	env := os.Getenv
	cli, err := membership.NewClient(strings.Split(env("FTCOMM_TEST_ETCD"), ","), nil)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer cli.Close()
	cfg := membership.DefaultMemberConfig()
	cfg.Client, cfg.Job, cfg.ID = cli, env("FTCOMM_TEST_JOB"), env("FTCOMM_TEST_MEMBER")
	cfg.Addr = cfg.ID + ":1"
	cfg.WantQuorum = true
	cfg.LeaseTTL, _ = time.ParseDuration(env("FTCOMM_TEST_TTL"))
	if env("FTCOMM_TEST_GOSSIP") != "" {
		g := membership.DefaultGossipConfig()
		cfg.Gossip = &g
	}
	if g := env("FTCOMM_TEST_GROUP"); g != "" {
		cfg.Group, cfg.GroupLease, cfg.GroupLinkAddr = g, true, "127.0.0.1:0"
	}
	if env("FTCOMM_TEST_HOLDLINK") != "" {
		membership.HoldLinks(&cfg, make(chan struct{}))
	}
	var starved atomic.Bool
	if env("FTCOMM_TEST_FASTLINK") != "" {
		cfg.GroupLinkInterval, cfg.GroupLinkTimeout = 50*time.Millisecond, 300*time.Millisecond
		membership.MuteLinks(&cfg, &starved)
		usr2 := make(chan os.Signal, 1)
		signal.Notify(usr2, syscall.SIGUSR2)
		go func() {
			for range usr2 {
				if starved.Load() {
					starved.Store(false)
					fmt.Println("fed")
					continue
				}
				starved.Store(true)
				go func() {
					for starved.Load() { //lint:ignore SA5002 a thread kept runnable is the point
					}
				}()
				fmt.Println("starved")
			}
		}()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	m, err := membership.Join(ctx, cfg)
	cancel()
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println("joined", m.Incarnation())
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM, syscall.SIGUSR1)
	for {
		select {
		case sig := <-term:
			if s, ok := m.GossipStats(); ok {
				fmt.Printf("stats suspicions=%d refutations=%d deaths=%d\n", s.Suspicions, s.Refutations, s.Deaths)
			}
			if sig == syscall.SIGUSR1 {
				continue
			}
			m.Close()
			return 0
		case <-m.Done():
			fmt.Println("lost", m.Err())
			return 3
		}
	}
}

// memberProc is a member running in its own process.
type memberProc struct {
	id   string
	cmd  *exec.Cmd
	inc  int64
	mu   sync.Mutex
	out  []string
	more chan struct{} // closed and replaced at every output line
	done chan struct{}
}

// startMemberProc starts member id in a process of its own and waits
// until it joined; env adds to its environment (memberProcess).
func startMemberProc(t testing.TB, etcd []string, job, id string, ttl time.Duration, gossip bool, env ...string) *memberProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "FTCOMM_TEST_MEMBER="+id, "FTCOMM_TEST_JOB="+job,
		"FTCOMM_TEST_ETCD="+strings.Join(etcd, ","), "FTCOMM_TEST_TTL="+ttl.String())
	if gossip {
		cmd.Env = append(cmd.Env, "FTCOMM_TEST_GOSSIP=1")
	}
	cmd.Env = append(cmd.Env, env...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &memberProc{id: id, cmd: cmd, done: make(chan struct{}), more: make(chan struct{})}
	joined := make(chan int64, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.out = append(p.out, line)
			close(p.more)
			p.more = make(chan struct{})
			p.mu.Unlock()
			if v, ok := strings.CutPrefix(line, "joined "); ok {
				n, _ := strconv.ParseInt(v, 10, 64)
				joined <- n
			}
		}
		cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGCONT)
		cmd.Process.Kill()
		<-p.done
	})
	select {
	case p.inc = <-joined:
	case <-p.done:
		t.Fatalf("member %s exited: %v", id, p.lines())
	case <-time.After(30 * time.Second):
		t.Fatalf("member %s did not join", id)
	}
	return p
}

// gossipStats asks the process for its gossip counters (SIGUSR1) and
// waits for the answer.
func (p *memberProc) gossipStats(t testing.TB) gossip.Stats {
	t.Helper()
	p.mu.Lock()
	n := len(p.out)
	p.mu.Unlock()
	p.cmd.Process.Signal(syscall.SIGUSR1)
	var st gossip.Stats
	p.waitOutput(t, n, "stats", func(l string) (ok bool) { st, ok = parseStats(l); return ok })
	return st
}

// waitOutput waits until p prints a line (after its first `from` lines)
// that match takes, naming what in a failure, and returns how many lines
// p had printed up to it.
func (p *memberProc) waitOutput(t testing.TB, from int, what string, match func(string) bool) int {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		p.mu.Lock()
		out, more := p.out, p.more
		p.mu.Unlock()
		for i := from; i < len(out); i++ {
			if match(out[i]) {
				return i + 1
			}
		}
		select {
		case <-more:
		case <-p.done:
			t.Fatalf("member %s exited before printing %s: %v", p.id, what, p.lines())
		case <-deadline:
			t.Fatalf("member %s did not print %s: %v", p.id, what, p.lines())
		}
	}
}

// waitEvicted waits until p, continued after its removal, finds its
// registration gone and exits with 3.
func (p *memberProc) waitEvicted(t testing.TB) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("member %s did not notice its eviction", p.id)
	}
	if code := p.cmd.ProcessState.ExitCode(); code != 3 {
		t.Fatalf("member %s exited %d: %v", p.id, code, p.lines())
	}
}

func parseStats(l string) (gossip.Stats, bool) {
	var st gossip.Stats
	s, ok := strings.CutPrefix(l, "stats ")
	if !ok {
		return st, false
	}
	_, err := fmt.Sscanf(s, "suspicions=%d refutations=%d deaths=%d", &st.Suspicions, &st.Refutations, &st.Deaths)
	return st, err == nil
}

func (p *memberProc) lines() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.out...)
}

var detectRounds = flag.Int("membership.detect.rounds", 1, "rounds of the SIGKILL/SIGSTOP detection measurement")

// Member processes are SIGKILLed and SIGSTOPped; the in-process
// coordinator (a gossip node) publishes an epoch without them. The times
// are reported, not asserted (targets: 1.5 s and 2 s).
func TestProcessDeathDetection(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 1, JoinTimeout: time.Second}, true)
	long := func(c *membership.MemberConfig) { c.LeaseTTL = 30 * time.Second } // gossip, not the lease, must find them
	obs := tj.Join("observer", long)
	clustertest.WaitQuorum(t, obs, 0, "observer") // before b and c: rank 0
	var kills, stops []time.Duration
	for round := 0; round < *detectRounds; round++ {
		cur, _ := obs.Quorum()
		b := startMemberProc(t, tj.Etcd.Endpoints(), tj.Name, "b", 30*time.Second, true)
		c := startMemberProc(t, tj.Etcd.Endpoints(), tj.Name, "c", 30*time.Second, true)
		q := clustertest.WaitQuorum(t, obs, cur.Epoch, "observer", "b", "c")

		start := time.Now()
		c.cmd.Process.Signal(syscall.SIGKILL)
		q = clustertest.WaitQuorum(t, obs, q.Epoch, "observer", "b")
		kills = append(kills, time.Since(start))
		if q.Reason != "c died (gossip)" {
			t.Fatalf("reason %q", q.Reason)
		}

		start = time.Now()
		b.cmd.Process.Signal(syscall.SIGSTOP)
		q = clustertest.WaitQuorum(t, obs, q.Epoch, "observer")
		stops = append(stops, time.Since(start))
		if q.Reason != "b died (gossip)" {
			t.Fatalf("reason %q", q.Reason)
		}
		// Resumed, b finds its registration gone and says so.
		b.cmd.Process.Signal(syscall.SIGCONT)
		b.waitEvicted(t)
		<-c.done
	}
	t.Logf("SIGKILL → epoch without it: %s", testutil.Durations(kills))
	t.Logf("SIGSTOP → epoch without it: %s", testutil.Durations(stops))
}
