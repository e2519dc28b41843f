package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ftcomm/ftcomm/internal/netns"
)

// proxyNetwork is the network without root: every replica's gloo
// connections and its etcd connection pass through a TCP proxy in the
// harness, which can drop (stall, as a blackhole does), reset and slow
// them. A replica listens for gloo on 127.0.0.1:P and advertises
// 127.0.0.2:P, where its proxy listens; the proxy learns which replica
// dialed from the kernel's socket table (/proc/net/tcp and the replicas'
// /proc/<pid>/fd). What it cannot cut: state transfer (recovery addresses
// are not advertised through it) and gossip (off in this network: deaths
// are found by the collectives, blame and leases).
type proxyNetwork struct {
	mu     sync.Mutex
	links  map[string]*proxyLink // listen address → proxy
	pids   map[int]string        // replica processes
	cut    map[[2]string]bool    // {x, y} with x < y; "" is the coordinators
	shapes map[string]netns.Shape
	conns  map[*proxyConn]bool
	closed bool
}

// proxyLink forwards what reaches one listener to one destination.
type proxyLink struct {
	ln    net.Listener
	dst   string
	owner string // the replica behind it ("" for none)
	etcd  string // for an etcd proxy: the replica it serves
}

// proxyConn is one forwarded connection between two parties.
type proxyConn struct {
	a, b    string // its ends: replicas, "" the coordinators
	in, out net.Conn
	mu      sync.Mutex
	resume  chan struct{} // closed when a cut is healed
	paused  bool
	done    chan struct{} // closed when it is reset or closed
	once    sync.Once
}

// end closes both ends, with a reset (RST) when rst.
func (pc *proxyConn) end(rst bool) {
	pc.once.Do(func() {
		close(pc.done)
		for _, c := range []net.Conn{pc.in, pc.out} {
			if tc, ok := c.(*net.TCPConn); ok && rst {
				tc.SetLinger(0)
			}
			c.Close()
		}
	})
}

func newProxyNetwork() *proxyNetwork {
	return &proxyNetwork{links: map[string]*proxyLink{}, pids: map[int]string{}, cut: map[[2]string]bool{},
		shapes: map[string]netns.Shape{}, conns: map[*proxyConn]bool{}}
}

func (w *proxyNetwork) kind() string       { return "proxy" }
func (w *proxyNetwork) serverHost() string { return "127.0.0.1" }

func pair(x, y string) [2]string {
	if x > y {
		x, y = y, x
	}
	return [2]string{x, y}
}

func (w *proxyNetwork) place(_ context.Context, name string, eps []string) (*placement, error) {
	// The replica's etcd connection: its own proxy to the coordinators.
	eln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	w.serve(&proxyLink{ln: eln, dst: eps[0], etcd: name})
	// Its gloo listener, and the proxy in front of it.
	listen, err := freeAddr("127.0.0.1")
	if err != nil {
		return nil, err
	}
	_, port, _ := net.SplitHostPort(listen)
	gln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.2", port))
	if err != nil {
		return nil, fmt.Errorf("chaos: proxy: %w (is 127.0.0.2 on the loopback?)", err)
	}
	w.serve(&proxyLink{ln: gln, dst: listen, owner: name})
	return &placement{command: func(p string) *exec.Cmd { return exec.Command(p) }, host: "127.0.0.1",
		glooListen: listen, glooAdvertise: "127.0.0.2", endpoints: []string{eln.Addr().String()},
		env: []string{"FTCOMM_GLOO_SHM=0"}}, nil
}

// started tells the proxy which replica a process is.
func (w *proxyNetwork) started(name string, pid int) {
	w.mu.Lock()
	w.pids[pid] = name
	w.mu.Unlock()
}

func (w *proxyNetwork) serve(l *proxyLink) {
	w.mu.Lock()
	w.links[l.ln.Addr().String()] = l
	w.mu.Unlock()
	go func() { // exits when the listener closes (close)
		for {
			c, err := l.ln.Accept()
			if err != nil {
				return
			}
			go w.forward(l, c)
		}
	}()
}

// forward connects an accepted connection to the link's destination and
// copies both ways, subject to cuts and shapes.
func (w *proxyNetwork) forward(l *proxyLink, in net.Conn) {
	a, b := "", l.owner
	if l.etcd != "" {
		a, b = l.etcd, ""
	} else {
		a = w.dialer(in)
	}
	out, err := net.DialTimeout("tcp", l.dst, 5*time.Second)
	if err != nil {
		in.Close()
		return
	}
	pc := &proxyConn{a: a, b: b, in: in, out: out, resume: make(chan struct{}), done: make(chan struct{})}
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		in.Close()
		out.Close()
		return
	}
	w.conns[pc] = true
	if w.cut[pair(a, b)] {
		pc.paused = true
	}
	w.mu.Unlock()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); w.pump(pc, in, out, a) }()
	go func() { defer wg.Done(); w.pump(pc, out, in, b) }()
	wg.Wait()
	pc.end(false)
	w.mu.Lock()
	delete(w.conns, pc)
	w.mu.Unlock()
}

// pump copies src to dst; from is the party that sent it (its shape
// applies). While the connection is cut the bytes wait, as behind a
// blackhole; a reset ends both ends.
func (w *proxyNetwork) pump(pc *proxyConn, src, dst net.Conn, from string) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			for {
				pc.mu.Lock()
				paused, resume := pc.paused, pc.resume
				pc.mu.Unlock()
				if !paused {
					break
				}
				select {
				case <-resume:
				case <-pc.done:
					return
				}
			}
			w.mu.Lock()
			s := w.shapes[from]
			w.mu.Unlock()
			if s.Delay > 0 {
				time.Sleep(s.Delay)
			}
			if bps := rateBits(s.Rate); bps > 0 {
				time.Sleep(time.Duration(float64(n*8) / bps * float64(time.Second)))
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				src.Close()
				return
			}
		}
		if err != nil {
			if tc, ok := dst.(*net.TCPConn); ok && err == io.EOF {
				tc.CloseWrite()
			} else {
				dst.Close()
			}
			return
		}
	}
}

// rateBits parses "20mbit", "500kbit" (bits per second; 0: none).
func rateBits(s string) float64 {
	for suffix, mult := range map[string]float64{"gbit": 1e9, "mbit": 1e6, "kbit": 1e3} {
		if v, ok := strings.CutSuffix(s, suffix); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f * mult
		}
	}
	return 0
}

// dialer finds the replica that opened the connection in: the process
// holding the socket whose local address is in's remote one.
func (w *proxyNetwork) dialer(in net.Conn) string {
	ra, ok := in.RemoteAddr().(*net.TCPAddr)
	if !ok {
		return "?"
	}
	inode := socketInode(ra)
	if inode == "" {
		return "?"
	}
	w.mu.Lock()
	pids := make(map[int]string, len(w.pids))
	for p, n := range w.pids {
		pids[p] = n
	}
	w.mu.Unlock()
	want := "socket:[" + inode + "]"
	for pid, name := range pids {
		dir := fmt.Sprintf("/proc/%d/fd", pid)
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range ents {
			if l, err := os.Readlink(dir + "/" + e.Name()); err == nil && l == want {
				return name
			}
		}
	}
	return "?"
}

// socketInode returns the inode of the IPv4 TCP socket bound to local addr.
func socketInode(addr *net.TCPAddr) string {
	ip := addr.IP.To4()
	if ip == nil {
		return ""
	}
	local := strings.ToUpper(hex.EncodeToString([]byte{ip[3], ip[2], ip[1], ip[0]})) + ":" + fmt.Sprintf("%04X", addr.Port)
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) > 9 && f[1] == local {
			return f[9]
		}
	}
	return ""
}

func (w *proxyNetwork) partition(_ context.Context, a, b []string, gateway bool) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, x := range a {
		for _, y := range b {
			w.cut[pair(x, y)] = true
		}
		if gateway {
			w.cut[pair(x, "")] = true
		}
	}
	for pc := range w.conns {
		if w.cut[pair(pc.a, pc.b)] {
			pc.mu.Lock()
			pc.paused = true
			pc.mu.Unlock()
		}
	}
	return nil
}

// reset resets every connection of replica name now (RST).
func (w *proxyNetwork) reset(name string) {
	w.mu.Lock()
	var cs []*proxyConn
	for pc := range w.conns {
		if pc.a == name || pc.b == name {
			cs = append(cs, pc)
		}
	}
	w.mu.Unlock()
	for _, pc := range cs {
		pc.end(true)
	}
}

func (w *proxyNetwork) heal(context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.cut = map[[2]string]bool{}
	for pc := range w.conns {
		pc.mu.Lock()
		if pc.paused {
			pc.paused = false
			close(pc.resume)
			pc.resume = make(chan struct{})
		}
		pc.mu.Unlock()
	}
	return nil
}

func (w *proxyNetwork) shape(_ context.Context, name string, s netns.Shape) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if s == (netns.Shape{}) {
		delete(w.shapes, name)
	} else {
		w.shapes[name] = s
	}
	return nil
}

func (w *proxyNetwork) close() error {
	w.mu.Lock()
	w.closed = true
	links, conns := w.links, w.conns
	w.links, w.conns = map[string]*proxyLink{}, map[*proxyConn]bool{}
	w.mu.Unlock()
	for _, l := range links {
		l.ln.Close()
	}
	for pc := range conns {
		pc.end(false)
	}
	return nil
}
