package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ftcomm/ftcomm/membership"
)

// cluster is the coordination service under test: one `ftcoord serve` with
// its embedded etcd ("embedded" topology), or an etcd server process and
// three `ftcoord serve -etcd` instances that elect a leader ("cluster").
// Every process can be killed and started again on the same data directory
// and the same etcd addresses.
type cluster struct {
	topology string
	ftcoord  string // the ftcoord binary
	self     string // this program (the etcd role)
	dir      string
	host     string // where etcd and the coordinators' gossip listen
	client   string // etcd's client address (fixed: trainers keep it)
	peer     string // etcd's peer address (fixed: its data names it)
	rec      *recorder
	http     *http.Client
	gossip   GossipTuning

	mu     sync.Mutex
	etcd   *child
	coords []*coordProc
}

type coordProc struct {
	name    string
	dataDir string
	proc    *child // nil while down
	url     string
	starts  int
}

// freeAddr asks the OS for a free port on host and returns host:port.
func freeAddr(host string) (string, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

func newCluster(topology, ftcoord, self, dir, host string, rec *recorder) (*cluster, error) {
	c := &cluster{topology: topology, ftcoord: ftcoord, self: self, dir: dir, host: host, rec: rec,
		http: &http.Client{Timeout: 2 * time.Second}}
	var err error
	if c.client, err = freeAddr(host); err != nil {
		return nil, err
	}
	if c.peer, err = freeAddr("127.0.0.1"); err != nil {
		return nil, err
	}
	n := 1
	if topology == "cluster" {
		n = 3
	}
	for i := range n {
		name := fmt.Sprintf("coord%d", i+1)
		c.coords = append(c.coords, &coordProc{name: name, dataDir: filepath.Join(dir, name)})
	}
	return c, nil
}

// endpoints are what trainers dial.
func (c *cluster) endpoints() []string { return []string{c.client} }

// credentialsFile is where coordinator i writes the trainers' credentials
// (the same keys for every instance).
func (c *cluster) credentialsFile(i int) string {
	return filepath.Join(c.dir, "trainer-credentials-"+c.coords[i].name+".json")
}

func (c *cluster) start(ctx context.Context) error {
	if c.topology == "cluster" {
		if err := c.startEtcd(); err != nil {
			return err
		}
	}
	for i := range c.coords {
		if err := c.startCoord(i); err != nil {
			return err
		}
	}
	return nil
}

func (c *cluster) startEtcd() error {
	spec, _ := json.Marshal(etcdSpec{Dir: filepath.Join(c.dir, "etcd"), ClientAddr: c.client, PeerAddr: c.peer})
	cmd := exec.Command(c.self)
	cmd.Env = append(os.Environ(), etcdEnv+"="+string(spec))
	p, err := startChild("etcd", cmd, filepath.Join(c.dir, "etcd.log"), nil)
	if err != nil {
		return err
	}
	if err := p.waitLine("ready", time.Minute); err != nil {
		p.stop(syscall.SIGKILL, time.Second)
		return err
	}
	c.mu.Lock()
	c.etcd = p
	c.mu.Unlock()
	c.rec.harness(Event{Kind: evCoord, Reason: "etcd started", Pid: p.pid()})
	return nil
}

// stopEtcd ends the etcd process with sig.
func (c *cluster) stopEtcd(sig syscall.Signal) error {
	c.mu.Lock()
	p := c.etcd
	c.etcd = nil
	c.mu.Unlock()
	if p == nil {
		return errors.New("etcd is not running")
	}
	err := p.stop(sig, 10*time.Second)
	c.rec.harness(Event{Kind: evCoord, Reason: "etcd stopped: " + exitReason(p.err)})
	return err
}

func (c *cluster) startCoord(i int) error {
	cp := c.coords[i]
	addrFile := filepath.Join(c.dir, cp.name+".url")
	os.Remove(addrFile)
	// Secured as by default: the instances share one secrets file (the
	// quorum-signing and gossip keys) and write the trainers' credentials.
	args := []string{"serve", "-name", cp.name, "-listen", "127.0.0.1:0", "-addr-file", addrFile,
		"-min-replicas", "1", "-join-timeout", "500ms", "-session-ttl", "2s", "-history", "10000",
		"-gossip-addr", net.JoinHostPort(c.host, "0"), "-shutdown-timeout", "5s", "-data-dir", cp.dataDir,
		"-secrets-file", filepath.Join(c.dir, "coordinator-secrets.json"), "-credentials-file", c.credentialsFile(i)}
	if g := c.gossip; g.Probe > 0 {
		args = append(args, "-gossip-probe-interval", g.Probe.String(), "-gossip-probe-timeout", g.ProbeTimeout.String(),
			"-gossip-suspicion-mult", fmt.Sprint(g.Suspicion))
	}
	if c.topology == "cluster" {
		args = append(args, "-etcd", c.client)
	} else {
		args = append(args, "-etcd-client-addr", c.client, "-etcd-peer-addr", c.peer)
	}
	p, err := startChild(cp.name, exec.Command(c.ftcoord, args...), filepath.Join(c.dir, cp.name+".log"), nil)
	if err != nil {
		return err
	}
	if err := p.waitLine("\tserving\t", time.Minute); err != nil {
		p.stop(syscall.SIGKILL, time.Second)
		return err
	}
	b, err := os.ReadFile(addrFile)
	if err != nil {
		p.stop(syscall.SIGKILL, time.Second)
		return err
	}
	c.mu.Lock()
	cp.proc, cp.url = p, strings.TrimSpace(string(b))
	cp.starts++
	c.mu.Unlock()
	c.rec.harness(Event{Kind: evCoord, Reason: cp.name + " serving at " + cp.url, Pid: p.pid()})
	return nil
}

// stopCoord ends coordinator i with sig (SIGTERM: a graceful shutdown).
func (c *cluster) stopCoord(i int, sig syscall.Signal) error {
	c.mu.Lock()
	cp := c.coords[i]
	p := cp.proc
	cp.proc = nil
	c.mu.Unlock()
	if p == nil {
		return fmt.Errorf("%s is not running", cp.name)
	}
	err := p.stop(sig, 15*time.Second)
	c.rec.harness(Event{Kind: evCoord, Reason: cp.name + " stopped: " + exitReason(p.err)})
	return err
}

// running lists the coordinators that are up.
func (c *cluster) running() []int {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []int
	for i, cp := range c.coords {
		if cp.proc != nil && !cp.proc.exited() {
			out = append(out, i)
		}
	}
	return out
}

// get decodes the JSON answer of path from the first coordinator that
// gives one.
func (c *cluster) get(ctx context.Context, path string, v any) error {
	var errs []error
	for _, i := range c.running() {
		c.mu.Lock()
		url := c.coords[i].url
		c.mu.Unlock()
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+path, nil)
		resp, err := c.http.Do(req)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		err = func() error {
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s%s: %s", url, path, resp.Status)
			}
			return json.NewDecoder(resp.Body).Decode(v)
		}()
		if err == nil {
			return nil
		}
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		return errors.New("no coordinator is running")
	}
	return errors.Join(errs...)
}

// leader returns the index of the leading coordinator.
func (c *cluster) leader(ctx context.Context) (int, error) {
	var info struct {
		Leader string `json:"leader"`
	}
	if err := c.get(ctx, "/api/v1/coordinator", &info); err != nil {
		return -1, err
	}
	for i, cp := range c.coords {
		if cp.name == info.Leader {
			return i, nil
		}
	}
	return -1, fmt.Errorf("no coordinator is named %q", info.Leader)
}

// setSettings runs `ftcoord job set` against a running coordinator and
// returns the version it stored, once the command returned.
func (c *cluster) setSettings(ctx context.Context, job string, changes ...string) (uint64, error) {
	running := c.running()
	if len(running) == 0 {
		return 0, errors.New("no coordinator is running")
	}
	c.mu.Lock()
	url := c.coords[running[0]].url
	c.mu.Unlock()
	args := append([]string{"job", "set", "-addr", url, "-by", "chaos", "-timeout", "15s", job}, changes...)
	out, err := exec.CommandContext(ctx, c.ftcoord, args...).CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("ftcoord job set: %w: %s", err, strings.TrimSpace(string(out)))
	}
	var v uint64
	if _, err := fmt.Sscanf(strings.TrimPrefix(string(out), "job "+job+": "), "settings version %d", &v); err != nil {
		return 0, fmt.Errorf("ftcoord job set said %q", strings.TrimSpace(string(out)))
	}
	c.rec.harness(Event{Kind: evCoord, Reason: "ftcoord job set: " + strings.TrimSpace(string(out)), Version: v})
	return v, nil
}

// history returns the job's past quorums, newest first.
func (c *cluster) history(ctx context.Context, job string) ([]membership.Quorum, error) {
	var qs []membership.Quorum
	err := c.get(ctx, "/api/v1/jobs/"+job+"/history?limit=10000", &qs)
	return qs, err
}

// close stops everything (the coordinators first, then etcd).
func (c *cluster) close() {
	for _, i := range c.running() {
		c.stopCoord(i, syscall.SIGTERM)
	}
	c.mu.Lock()
	e := c.etcd
	c.mu.Unlock()
	if e != nil {
		c.stopEtcd(syscall.SIGTERM)
	}
}

// coordsDown lists the coordinators that are not running.
func (c *cluster) coordsDown() []int {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []int
	for i, cp := range c.coords {
		if cp.proc == nil || cp.proc.exited() {
			out = append(out, i)
		}
	}
	return out
}

// etcdDown reports whether the cluster topology's etcd is not running.
func (c *cluster) etcdDown() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.topology == "cluster" && (c.etcd == nil || c.etcd.exited())
}
