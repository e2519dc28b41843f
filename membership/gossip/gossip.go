package gossip

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

// Config configures SWIM failure detection (hashicorp/memberlist,
// with Lifeguard) among the members of jobs and the coordinators.
//
// The defaults are tuned for a LAN: a SIGKILLed or SIGSTOPped process is
// declared dead in about 1 s (memberlist's LAN profile takes 5–25 s),
// with Lifeguard's awareness stretching a loaded node's own timeouts so
// that a busy machine does not suspect healthy peers. See
// docs/measurements.md and membership's soak test (go test -run TestGossipSoak
// ./membership -args -membership.soak=10m).
type Config struct {
	// BindAddr is host:port to listen on (TCP and UDP). Default
	// "127.0.0.1:0": a free loopback port.
	BindAddr string
	// AdvertiseAddr is host:port peers reach this node at (default: the
	// bound address).
	AdvertiseAddr string
	// ProbeInterval is how often each node probes a random peer.
	ProbeInterval time.Duration
	// ProbeTimeout is how long a probe waits for an ack before asking
	// IndirectChecks other nodes to probe.
	ProbeTimeout   time.Duration
	IndirectChecks int
	// SuspicionMult scales the time a suspect has to refute before it is
	// declared dead: SuspicionMult × max(1, log10(n)) × ProbeInterval, up
	// to SuspicionMaxTimeoutMult times that without confirmations.
	SuspicionMult           int
	SuspicionMaxTimeoutMult int
	// AwarenessMaxMultiplier bounds how far Lifeguard stretches a node's
	// probe timeouts while it is itself slow.
	AwarenessMaxMultiplier int
	// GossipInterval and GossipNodes set how fast news spreads.
	GossipInterval time.Duration
	GossipNodes    int
	// PushPullInterval is the period of full state syncs.
	PushPullInterval time.Duration
	// TCPTimeout bounds push/pull and TCP-fallback probes.
	TCPTimeout time.Duration
	// SecretKey (16, 24 or 32 bytes) encrypts and authenticates gossip;
	// nil: plain text.
	SecretKey []byte
	// Logger receives memberlist's logs (nil: none).
	Logger *zap.Logger
}

// DefaultConfig returns the fast LAN profile measured in this
// package's soak test.
func DefaultConfig() Config {
	return Config{
		BindAddr:                "127.0.0.1:0",
		ProbeInterval:           200 * time.Millisecond,
		ProbeTimeout:            100 * time.Millisecond,
		IndirectChecks:          3,
		SuspicionMult:           2,
		SuspicionMaxTimeoutMult: 2,
		AwarenessMaxMultiplier:  8,
		GossipInterval:          50 * time.Millisecond,
		GossipNodes:             3,
		PushPullInterval:        15 * time.Second,
		TCPTimeout:              2 * time.Second,
	}
}

// Validate says what is wrong with the configuration, if anything.
func (c Config) Validate() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("%w: gossip: "+f, append([]any{comm.ErrInvalidArgument}, a...)...)
	}
	if _, _, err := net.SplitHostPort(c.BindAddr); err != nil {
		return bad("BindAddr %q is not host:port: %v", c.BindAddr, err)
	}
	if c.AdvertiseAddr != "" {
		if _, _, err := net.SplitHostPort(c.AdvertiseAddr); err != nil {
			return bad("AdvertiseAddr %q is not host:port: %v", c.AdvertiseAddr, err)
		}
	}
	switch {
	case c.ProbeInterval <= 0:
		return bad("ProbeInterval %v must be positive", c.ProbeInterval)
	case c.ProbeTimeout <= 0 || c.ProbeTimeout >= c.ProbeInterval:
		return bad("ProbeTimeout %v must be positive and below ProbeInterval %v", c.ProbeTimeout, c.ProbeInterval)
	case c.SuspicionMult < 1 || c.SuspicionMaxTimeoutMult < 1:
		return bad("SuspicionMult %d and SuspicionMaxTimeoutMult %d must be at least 1", c.SuspicionMult, c.SuspicionMaxTimeoutMult)
	case c.GossipInterval <= 0 || c.GossipNodes < 1:
		return bad("GossipInterval %v must be positive and GossipNodes %d at least 1", c.GossipInterval, c.GossipNodes)
	case c.IndirectChecks < 0 || c.AwarenessMaxMultiplier < 1:
		return bad("IndirectChecks %d must not be negative, AwarenessMaxMultiplier %d at least 1", c.IndirectChecks, c.AwarenessMaxMultiplier)
	case c.PushPullInterval <= 0 || c.TCPTimeout <= 0:
		return bad("PushPullInterval %v and TCPTimeout %v must be positive", c.PushPullInterval, c.TCPTimeout)
	}
	switch len(c.SecretKey) {
	case 0, 16, 24, 32:
	default:
		return bad("SecretKey has %d bytes; want 16, 24 or 32", len(c.SecretKey))
	}
	return nil
}

// EventKind says what happened to a node.
type EventKind int

const (
	// Joined: a node appeared (or came back under the same name).
	Joined EventKind = iota
	// Left: a node left gracefully.
	Left
	// Dead: a node stopped answering and was declared dead.
	Dead
)

func (k EventKind) String() string {
	switch k {
	case Joined:
		return "join"
	case Left:
		return "leave"
	case Dead:
		return "dead"
	}
	return "?"
}

// Event is one change seen by this node.
type Event struct {
	Kind EventKind
	Name string // the node's name
	Addr string // host:port
	At   time.Time
}

// Stats counts what a node saw since it started.
type Stats struct {
	// Suspicions: times this node suspected a peer (no ack in time).
	Suspicions int64
	// Refutations: times this node was suspected or declared dead by a
	// peer and refuted it (a false suspicion of this node).
	Refutations int64
	// Deaths: peers this node saw declared dead.
	Deaths int64
}

// Node is one node of a memberlist cluster. Its events arrive in order
// on Events, through an unbounded queue, so a slow reader never stalls
// failure detection. One goroutine forwards them; it exits at Close.
type Node struct {
	ml   *memberlist.Memberlist
	name string
	lg   *zap.Logger

	mu      sync.Mutex
	queue   []Event
	wake    chan struct{}
	events  chan Event
	closed  chan struct{}
	done    chan struct{}
	once    sync.Once
	leaving atomic.Bool
	// leftBy holds the peers that told this node they are leaving;
	// unacked, the peers yet to acknowledge this node's own leave (closing
	// allAcked when it empties); both under mu. sending counts the
	// goroutines sending handshake messages, which start only while
	// !stopped (under mu).
	leftBy   map[string]bool
	unacked  map[string]bool
	allAcked chan struct{}
	sending  sync.WaitGroup
	joining  sync.WaitGroup
	leaveMu  sync.Mutex // held by Leave; Close waits for it
	stopped  bool
	// noLeaveMeta (tests) leaves the "leaving" metadata out of Leave, so
	// that only the handshake tells peers.
	noLeaveMeta bool

	suspect atomic.Int64
	refute  atomic.Int64
	deaths  atomic.Int64
}

// NodeName is the gossip node name of a member registered under
// lease: "<job>/<id>/<lease in hex>", unique per incarnation, so that a
// coordinator maps a gossip death to the registration it ends.
func NodeName(job, id string, lease int64) string {
	return job + "/" + id + "/" + strconv.FormatInt(lease, 16)
}

// Start starts a node named name (unique in the cluster; ftcomm uses
// NodeName for members and "_coordinator/<name>" for coordinators).
// Join it to others with Join.
func Start(name string, cfg Config) (*Node, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	host, portS, _ := net.SplitHostPort(cfg.BindAddr)
	port, err := strconv.Atoi(portS)
	if err != nil {
		return nil, fmt.Errorf("%w: gossip: BindAddr port %q", comm.ErrInvalidArgument, portS)
	}
	g := &Node{
		name:   name,
		lg:     cfg.Logger,
		wake:   make(chan struct{}, 1),
		events: make(chan Event),
		closed: make(chan struct{}),
		done:   make(chan struct{}),
		leftBy: map[string]bool{},
	}
	if g.lg == nil {
		g.lg = zap.NewNop()
	}
	mc := memberlist.DefaultLANConfig()
	mc.Name = name
	mc.BindAddr, mc.BindPort = host, port
	if cfg.AdvertiseAddr != "" {
		ah, ap, _ := net.SplitHostPort(cfg.AdvertiseAddr)
		mc.AdvertiseAddr = ah
		mc.AdvertisePort, _ = strconv.Atoi(ap)
	}
	mc.ProbeInterval, mc.ProbeTimeout = cfg.ProbeInterval, cfg.ProbeTimeout
	mc.IndirectChecks = cfg.IndirectChecks
	mc.SuspicionMult, mc.SuspicionMaxTimeoutMult = cfg.SuspicionMult, cfg.SuspicionMaxTimeoutMult
	mc.AwarenessMaxMultiplier = cfg.AwarenessMaxMultiplier
	mc.GossipInterval, mc.GossipNodes = cfg.GossipInterval, cfg.GossipNodes
	mc.PushPullInterval, mc.TCPTimeout = cfg.PushPullInterval, cfg.TCPTimeout
	mc.GossipToTheDeadTime = 2 * time.Second
	mc.SecretKey = cfg.SecretKey
	mc.Events = (*gossipEvents)(g)
	mc.Delegate = (*gossipMeta)(g)
	mc.Logger = log.New(&memberlistLog{g: g}, "", 0)
	ml, err := memberlist.Create(mc)
	if err != nil {
		return nil, fmt.Errorf("gossip: start %s on %s: %w", name, cfg.BindAddr, err)
	}
	g.ml = ml
	go g.forward()
	return g, nil
}

// Name returns this node's name.
func (g *Node) Name() string { return g.name }

// Addr returns the host:port peers reach this node at.
func (g *Node) Addr() string { return g.ml.LocalNode().Address() }

// Join contacts the seeds (host:port), one after another, and merges their
// view; it returns how many it reached. Joining an empty list is a no-op.
// memberlist's join takes no ctx: when ctx ends Join returns, and the seed
// being contacted is given up after TCPTimeout at most, which Close waits
// for. After Close it fails with comm.ErrClosed.
func (g *Node) Join(ctx context.Context, seeds []string) (int, error) {
	if len(seeds) == 0 {
		return 0, nil
	}
	type res struct {
		n   int
		err error
	}
	ch := make(chan res, 1)
	g.mu.Lock()
	if g.stopped {
		g.mu.Unlock()
		return 0, fmt.Errorf("gossip: join: %w", comm.ErrClosed)
	}
	g.joining.Add(1)
	g.mu.Unlock()
	// memberlist.Join takes no ctx; each seed is bounded by TCPTimeout.
	// One seed at a time, so that Close waits for one at most.
	go func() {
		defer g.joining.Done()
		var r res
		for _, s := range seeds {
			if ctx.Err() != nil || g.isStopped() {
				break
			}
			n, err := g.ml.Join([]string{s})
			r.n += n
			if err != nil {
				r.err = err
			}
		}
		ch <- r
	}()
	select {
	case r := <-ch:
		if r.err != nil && r.n == 0 {
			return 0, fmt.Errorf("gossip: join %v: %w", seeds, r.err)
		}
		return r.n, nil
	case <-ctx.Done():
		return 0, fmt.Errorf("gossip: join: %w", context.Cause(ctx))
	}
}

// Events delivers what this node sees about others, in order.
func (g *Node) Events() <-chan Event { return g.events }

// Alive returns the names of the nodes this node believes alive,
// itself included.
func (g *Node) Alive() []string {
	var out []string
	for _, n := range g.ml.Members() {
		out = append(out, n.Name)
	}
	return out
}

// NumAlive returns how many nodes this node believes alive.
func (g *Node) NumAlive() int { return g.ml.NumMembers() }

// Health returns Lifeguard's awareness score (0: healthy; higher: this
// node has been slow to answer and stretches its timeouts).
func (g *Node) Health() int { return g.ml.GetHealthScore() }

// Stats returns what this node counted.
func (g *Node) Stats() Stats {
	return Stats{Suspicions: g.suspect.Load(), Refutations: g.refute.Load(), Deaths: g.deaths.Load()}
}

func (g *Node) isStopped() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.stopped
}

// Leave tells the others this node is going (they see Left, not
// Dead), waiting until ctx ends at most. After Close, or when Close
// comes while it waits for acknowledgements, it fails with comm.ErrClosed.
//
// memberlist (v0.7) reports a leave to the others' event delegates like a
// death, and its gossip may deliver the leave before any news sent ahead
// of it. So Leave first tells every peer over TCP and waits for each to
// acknowledge (a peer that acknowledged reports the leave as a leave,
// whatever order gossip brings the rest in), then puts "leaving" in its
// metadata for peers that did not answer in time, then leaves.
func (g *Node) Leave(ctx context.Context) error {
	g.leaveMu.Lock()
	defer g.leaveMu.Unlock()
	if g.isStopped() {
		return fmt.Errorf("gossip: leave: %w", comm.ErrClosed)
	}
	timeout := 2 * time.Second
	if d, ok := ctx.Deadline(); ok {
		timeout = time.Until(d)
	}
	g.leaving.Store(true)
	g.tellLeaving(ctx, time.Now().Add(timeout/3))
	if ctx.Err() != nil {
		return fmt.Errorf("gossip: leave: %w", context.Cause(ctx))
	}
	if g.isStopped() { // Close came meanwhile and waits for this Leave
		return fmt.Errorf("gossip: leave: %w", comm.ErrClosed)
	}
	if !g.noLeaveMeta {
		if err := g.ml.UpdateNode(timeout / 3); err != nil {
			return fmt.Errorf("gossip: leave: %w", err)
		}
	}
	if err := g.ml.Leave(timeout / 3); err != nil {
		return fmt.Errorf("gossip: leave: %w", err)
	}
	return nil
}

// User messages between nodes: a kind byte, the length of the sender's
// name (uvarint), the name, then the sender's host:port (a peer may not
// know the sender yet when it must answer).
const (
	msgLeaving  byte = 'L' // the sender is about to leave
	msgLeaveAck byte = 'A' // the sender will report that leave as a leave
)

// tellLeaving sends msgLeaving to every peer and waits, until deadline at
// most, for all of them to acknowledge it.
func (g *Node) tellLeaving(ctx context.Context, deadline time.Time) {
	// Copies: memberlist updates its nodes under its own lock. Taken
	// before g.mu, which memberlist's event callbacks take under that lock.
	var peers []*memberlist.Node
	for _, n := range g.ml.Members() {
		if n.Name != g.name {
			c := *n
			peers = append(peers, &c)
		}
	}
	g.mu.Lock()
	g.unacked = map[string]bool{}
	g.allAcked = make(chan struct{})
	for _, n := range peers {
		g.unacked[n.Name] = true
	}
	if len(peers) == 0 {
		close(g.allAcked)
	}
	all := g.allAcked
	g.mu.Unlock()
	msg := g.message(msgLeaving)
	for _, n := range peers {
		g.send(n, msg, func() { g.acked(n.Name) }) // unreachable: no use waiting
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	select {
	case <-all:
	case <-ctx.Done():
	case <-g.closed:
	case <-timer.C:
		g.mu.Lock()
		missing := len(g.unacked)
		g.mu.Unlock()
		g.lg.Info("gossip: peers did not acknowledge the leave in time; they may report a death",
			zap.String("node", g.name), zap.Int("peers", missing))
	}
}

// acked notes that peer acknowledged this node's leave (or cannot).
func (g *Node) acked(peer string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.unacked[peer] {
		delete(g.unacked, peer)
		if len(g.unacked) == 0 {
			close(g.allAcked)
		}
	}
}

// send sends msg to n over TCP from a goroutine of its own (it dials;
// memberlist's receive path must not block), calling failed if it could
// not.
func (g *Node) send(n *memberlist.Node, msg []byte, failed func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stopped {
		return
	}
	g.sending.Add(1)
	go func() {
		defer g.sending.Done()
		if err := g.ml.SendReliable(n, msg); err != nil {
			g.lg.Debug("gossip: handshake message not sent", zap.String("node", g.name), zap.String("peer", n.Name), zap.Error(err))
			if failed != nil {
				failed()
			}
		}
	}()
}

// message encodes a user message of kind from this node.
func (g *Node) message(kind byte) []byte {
	msg := binary.AppendUvarint([]byte{kind}, uint64(len(g.name)))
	msg = append(msg, g.name...)
	return append(msg, g.Addr()...)
}

// receive handles a user message from a peer. Anything else than the two
// messages above is dropped.
func (g *Node) receive(msg []byte) {
	if len(msg) < 2 {
		return
	}
	n, k := binary.Uvarint(msg[1:])
	if k <= 0 || n == 0 || n > uint64(len(msg)-1-k) {
		return
	}
	name, addr := string(msg[1+k:1+k+int(n)]), string(msg[1+k+int(n):])
	switch msg[0] {
	case msgLeaving:
		host, portS, err := net.SplitHostPort(addr)
		ip := net.ParseIP(host)
		port, perr := strconv.ParseUint(portS, 10, 16)
		if err != nil || ip == nil || perr != nil {
			return
		}
		g.mu.Lock()
		g.leftBy[name] = true
		g.mu.Unlock()
		g.send(&memberlist.Node{Name: name, Addr: ip, Port: uint16(port)}, g.message(msgLeaveAck), nil)
	case msgLeaveAck:
		g.acked(name)
	}
}

// Close stops the node without a leave message (peers declare it dead
// unless Leave ran first) and its event goroutine, after a Leave or Join in
// flight has stopped. Safe to call twice.
func (g *Node) Close() error {
	var err error
	g.once.Do(func() {
		g.mu.Lock()
		g.stopped = true
		g.mu.Unlock()
		close(g.closed)
		g.leaveMu.Lock() // a Leave in flight: memberlist panics on Leave after Shutdown
		err = g.ml.Shutdown()
		g.leaveMu.Unlock()
		<-g.done
		g.sending.Wait()
		g.joining.Wait()
	})
	return err
}

func (g *Node) push(ev Event) {
	g.mu.Lock()
	g.queue = append(g.queue, ev)
	g.mu.Unlock()
	select {
	case g.wake <- struct{}{}:
	default:
	}
}

func (g *Node) forward() {
	defer close(g.done)
	for {
		g.mu.Lock()
		batch := g.queue
		g.queue = nil
		g.mu.Unlock()
		for _, ev := range batch {
			select {
			case g.events <- ev:
			case <-g.closed:
				return
			}
		}
		select {
		case <-g.wake:
		case <-g.closed:
			return
		}
	}
}

type gossipEvents Node

func event(kind EventKind, n *memberlist.Node) Event {
	return Event{Kind: kind, Name: n.Name, Addr: n.Address(), At: time.Now()}
}

func (e *gossipEvents) NotifyJoin(n *memberlist.Node) {
	// Not clearing leftBy: the news of a node's join may come after its
	// leave handshake. The entry goes when its leave is reported.
	(*Node)(e).push(event(Joined, n))
}

func (e *gossipEvents) NotifyLeave(n *memberlist.Node) {
	g := (*Node)(e)
	g.mu.Lock()
	told := g.leftBy[n.Name]
	delete(g.leftBy, n.Name)
	g.mu.Unlock()
	if told || bytes.Equal(n.Meta, leavingMeta) {
		g.push(event(Left, n))
		return
	}
	g.deaths.Add(1)
	g.push(event(Dead, n))
}

func (e *gossipEvents) NotifyUpdate(*memberlist.Node) {}

var leavingMeta = []byte("leaving")

// gossipMeta is the memberlist.Delegate: it publishes the node's metadata
// ("leaving" once Leave began) and receives the leave handshake.
type gossipMeta Node

func (d *gossipMeta) NodeMeta(limit int) []byte {
	if (*Node)(d).leaving.Load() {
		return leavingMeta
	}
	return nil
}
func (d *gossipMeta) NotifyMsg(msg []byte)                       { (*Node)(d).receive(msg) }
func (d *gossipMeta) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (d *gossipMeta) LocalState(join bool) []byte                { return nil }
func (d *gossipMeta) MergeRemoteState(buf []byte, join bool)     {}

// memberlistLog turns memberlist's "[LEVEL] memberlist: …" lines into zap
// records and counts suspicions and refutations.
type memberlistLog struct{ g *Node }

func (w *memberlistLog) Write(p []byte) (int, error) {
	msg := string(bytes.TrimSpace(p))
	switch {
	case bytes.Contains(p, []byte("Suspect ")) && bytes.Contains(p, []byte("no acks received")):
		w.g.suspect.Add(1)
	case bytes.Contains(p, []byte("Refuting a suspect")), bytes.Contains(p, []byte("Refuting a dead")):
		w.g.refute.Add(1)
	}
	lg := w.g.lg.With(zap.String("node", w.g.name))
	switch {
	case bytes.HasPrefix(p, []byte("[DEBUG]")):
		lg.Debug(msg)
	case bytes.HasPrefix(p, []byte("[INFO]")):
		lg.Info(msg)
	case bytes.HasPrefix(p, []byte("[WARN]")):
		lg.Warn(msg)
	default:
		lg.Error(msg)
	}
	return len(p), nil
}
