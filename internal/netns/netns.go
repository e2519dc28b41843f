// Package netns builds small networks of Linux network namespaces for
// tests that need real links to cut or slow between processes on one
// machine: hosts (namespaces) on one bridge, with the test process in the
// root namespace as the gateway. Cuts are blackhole routes, so a cut link
// drops packets silently, as a real partition does (connections stall
// until their deadlines instead of being reset); rate limits are tc tbf
// qdiscs on a host's uplink, delay, jitter, rate and loss netem qdiscs
// (Shape).
//
// It needs root (CAP_NET_ADMIN) and iproute2; Available says whether this
// machine has both. Names and the subnet are random, so several networks
// (several test packages at once) do not meet. Close removes everything;
// processes started in a host must be stopped first.
package netns

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Net is one bridge and the hosts on it.
type Net struct {
	id     string
	bridge string
	prefix string // "10.x.y."
	gw     string

	mu     sync.Mutex
	hosts  []*Host
	routes []route // blackholes in place, to remove on Heal
	closed bool
}

// Host is one network namespace on the bridge.
type Host struct {
	Name string // the caller's name for it
	NS   string // the namespace's name (for ip netns exec)
	IP   string
	dev  string // the host's end of its link
	peer string // the bridge's end
	n    *Net
}

type route struct {
	ns  string // "" for the root namespace
	dst string
}

// Available reports why networks cannot be built here, or nil.
func Available() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("netns: needs root (euid %d)", os.Geteuid())
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return fmt.Errorf("netns: iproute2's ip is not installed: %w", err)
	}
	if _, err := exec.LookPath("tc"); err != nil {
		return fmt.Errorf("netns: iproute2's tc is not installed: %w", err)
	}
	probe := "ftprobe" + randHex(3)
	if err := run(context.Background(), "", "ip", "netns", "add", probe); err != nil {
		return err
	}
	return run(context.Background(), "", "ip", "netns", "del", probe)
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// run runs a command in namespace ns ("" for the root one).
func run(ctx context.Context, ns string, name string, args ...string) error {
	if ns != "" {
		args = append([]string{"netns", "exec", ns, name}, args...)
		name = "ip"
	}
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("netns: %s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return nil
}

// New creates a bridge on a free random 10.x.y.0/24 with the root
// namespace at 10.x.y.1.
func New(ctx context.Context) (*Net, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	id := randHex(3)
	var prefix string
	for try := 0; prefix == "" && try < 50; try++ {
		b := make([]byte, 2)
		rand.Read(b)
		p := fmt.Sprintf("10.%d.%d.", 100+int(b[0])%150, b[1])
		taken := false
		for _, a := range addrs {
			taken = taken || strings.HasPrefix(a.String(), p)
		}
		if !taken {
			prefix = p
		}
	}
	if prefix == "" {
		return nil, fmt.Errorf("netns: no free 10.x.y.0/24")
	}
	n := &Net{id: id, bridge: "ftbr" + id, prefix: prefix, gw: prefix + "1"}
	steps := [][]string{
		{"ip", "link", "add", n.bridge, "type", "bridge"},
		{"ip", "addr", "add", n.gw + "/24", "dev", n.bridge},
		{"ip", "link", "set", n.bridge, "up"},
	}
	for _, s := range steps {
		if err := run(ctx, "", s[0], s[1:]...); err != nil {
			n.Close()
			return nil, err
		}
	}
	return n, nil
}

// Gateway is the root namespace's address on the bridge: where servers the
// test runs itself (etcd, a coordinator) are reachable from every host.
func (n *Net) Gateway() string { return n.gw }

// AddHost creates a namespace linked to the bridge, with loopback up.
func (n *Net) AddHost(ctx context.Context, name string) (*Host, error) {
	n.mu.Lock()
	i := len(n.hosts) + 10
	if i > 250 {
		n.mu.Unlock()
		return nil, fmt.Errorf("netns: too many hosts")
	}
	h := &Host{Name: name, NS: fmt.Sprintf("ftns-%s-%d", n.id, i), IP: n.prefix + strconv.Itoa(i),
		dev: fmt.Sprintf("ftv%s%d", n.id, i), peer: fmt.Sprintf("ftp%s%d", n.id, i), n: n}
	n.hosts = append(n.hosts, h)
	n.mu.Unlock()
	steps := []struct {
		ns   string
		args []string
	}{
		{"", []string{"ip", "netns", "add", h.NS}},
		{"", []string{"ip", "link", "add", h.dev, "type", "veth", "peer", "name", h.peer}},
		{"", []string{"ip", "link", "set", h.dev, "netns", h.NS}},
		{"", []string{"ip", "link", "set", h.peer, "master", n.bridge}},
		{"", []string{"ip", "link", "set", h.peer, "up"}},
		{h.NS, []string{"ip", "addr", "add", h.IP + "/24", "dev", h.dev}},
		{h.NS, []string{"ip", "link", "set", h.dev, "up"}},
		{h.NS, []string{"ip", "link", "set", "lo", "up"}},
		{h.NS, []string{"ip", "route", "add", "default", "via", n.gw}},
	}
	for _, s := range steps {
		if err := run(ctx, s.ns, s.args[0], s.args[1:]...); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// Command returns a command that runs in the host's namespace.
func (h *Host) Command(path string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", h.NS, path}, args...)...)
}

// Cut drops every packet between the hosts of side a and those of side b,
// both ways; with gateway, side a is also cut from the root namespace (the
// test's own servers stay with side b).
func (n *Net) Cut(ctx context.Context, a, b []*Host, gateway bool) error {
	var rs []route
	for _, x := range a {
		for _, y := range b {
			rs = append(rs, route{x.NS, y.IP}, route{y.NS, x.IP})
		}
		if gateway {
			rs = append(rs, route{x.NS, n.gw}, route{"", x.IP})
		}
	}
	for _, r := range rs {
		if err := run(ctx, r.ns, "ip", "route", "add", "blackhole", r.dst+"/32"); err != nil {
			return err
		}
		n.mu.Lock()
		n.routes = append(n.routes, r)
		n.mu.Unlock()
	}
	return nil
}

// Heal removes every cut.
func (n *Net) Heal(ctx context.Context) error {
	n.mu.Lock()
	rs := n.routes
	n.routes = nil
	n.mu.Unlock()
	var first error
	for _, r := range rs {
		if err := run(ctx, r.ns, "ip", "route", "del", "blackhole", r.dst+"/32"); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// Limit caps the rate of everything the host sends (tc tbf), e.g. "20mbit";
// "" removes the cap.
func (h *Host) Limit(ctx context.Context, rate string) error {
	run(ctx, h.NS, "tc", "qdisc", "del", "dev", h.dev, "root") // none is fine
	if rate == "" {
		return nil
	}
	return run(ctx, h.NS, "tc", "qdisc", "add", "dev", h.dev, "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms")
}

// Delay adds netem delay (and jitter) to everything the host sends; zero
// strings remove it.
func (h *Host) Delay(ctx context.Context, delay, jitter string) error {
	run(ctx, h.NS, "tc", "qdisc", "del", "dev", h.dev, "root")
	if delay == "" {
		return nil
	}
	args := []string{"qdisc", "add", "dev", h.dev, "root", "netem", "delay", delay}
	if jitter != "" {
		args = append(args, jitter)
	}
	return run(ctx, h.NS, "tc", args...)
}

// Shape is what netem does to everything a host sends: a delay with
// jitter, a rate cap, random loss. The zero Shape does nothing.
type Shape struct {
	Delay, Jitter time.Duration
	Rate          string  // e.g. "20mbit"; "" for no cap
	Loss          float64 // percent of packets dropped at random
}

func (s Shape) netemArgs() []string {
	var args []string
	if s.Delay > 0 {
		args = append(args, "delay", s.Delay.String())
		if s.Jitter > 0 {
			args = append(args, s.Jitter.String())
		}
	}
	if s.Rate != "" {
		args = append(args, "rate", s.Rate)
	}
	if s.Loss > 0 {
		args = append(args, "loss", strconv.FormatFloat(s.Loss, 'f', -1, 64)+"%")
	}
	return args
}

// ErrNoNetem: the kernel has no netem qdisc (sch_netem), so delay, jitter
// and loss cannot be emulated; a rate cap still can (tbf).
var ErrNoNetem = errors.New("netns: the kernel has no netem qdisc (sch_netem)")

// Shape replaces whatever Limit, Delay or Shape set on the host's uplink
// with s (a netem qdisc); the zero Shape removes it. Without netem in the
// kernel it caps the rate with tbf and, if s asks for more, returns an
// error wrapping ErrNoNetem.
func (h *Host) Shape(ctx context.Context, s Shape) error {
	run(ctx, h.NS, "tc", "qdisc", "del", "dev", h.dev, "root") // none is fine
	args := s.netemArgs()
	if len(args) == 0 {
		return nil
	}
	err := run(ctx, h.NS, "tc", append([]string{"qdisc", "add", "dev", h.dev, "root", "netem"}, args...)...)
	if err == nil || !strings.Contains(err.Error(), "qdisc kind is unknown") {
		return err
	}
	if s.Rate != "" {
		if err := h.Limit(ctx, s.Rate); err != nil {
			return err
		}
	}
	if s.Delay > 0 || s.Loss > 0 {
		return fmt.Errorf("%w: delay and loss not applied", ErrNoNetem)
	}
	return nil
}

// Close removes the cuts, the hosts and the bridge. Safe to call twice.
func (n *Net) Close() error {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return nil
	}
	n.closed = true
	hosts := n.hosts
	n.mu.Unlock()
	ctx := context.Background()
	first := n.Heal(ctx)
	for _, h := range hosts {
		if err := run(ctx, "", "ip", "netns", "del", h.NS); err != nil && first == nil {
			first = err
		}
		run(ctx, "", "ip", "link", "del", h.peer) // gone with the namespace's end, usually
	}
	if err := run(ctx, "", "ip", "link", "del", n.bridge); err != nil && first == nil {
		first = err
	}
	return first
}
