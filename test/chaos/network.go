package main

import (
	"context"
	"fmt"
	"os/exec"
	"sync"

	"github.com/ftcomm/ftcomm/internal/netns"
)

// network places replica processes so that the links between them, and
// between them and the coordinators, can be cut and slowed.
type network interface {
	kind() string
	// serverHost is where etcd and the coordinators listen: reachable by
	// every replica (while not cut off).
	serverHost() string
	// place prepares replica name (once; its restarts reuse it).
	place(ctx context.Context, name string, endpoints []string) (*placement, error)
	// partition cuts every link between side a and side b; with gateway,
	// side a also loses the coordinators. heal removes every cut.
	partition(ctx context.Context, a, b []string, gateway bool) error
	heal(ctx context.Context) error
	// shape slows what replica name sends; the zero shape restores it.
	shape(ctx context.Context, name string, s netns.Shape) error
	close() error
}

// placement is how a replica runs in the network.
type placement struct {
	command       func(path string) *exec.Cmd
	host          string
	glooListen    string
	glooAdvertise string
	endpoints     []string
	gossip        bool // gossip reaches it through the network's cuts
	env           []string
}

// noNetwork is plain loopback: nothing can be cut.
type noNetwork struct{}

func (noNetwork) kind() string       { return "none" }
func (noNetwork) serverHost() string { return "127.0.0.1" }
func (noNetwork) place(_ context.Context, _ string, eps []string) (*placement, error) {
	return &placement{command: func(p string) *exec.Cmd { return exec.Command(p) }, host: "127.0.0.1", endpoints: eps, gossip: true}, nil
}
func (noNetwork) partition(context.Context, []string, []string, bool) error {
	return fmt.Errorf("chaos: no network to cut")
}
func (noNetwork) heal(context.Context) error { return nil }
func (noNetwork) shape(context.Context, string, netns.Shape) error {
	return fmt.Errorf("chaos: no network to shape")
}
func (noNetwork) close() error { return nil }

// nsNetwork puts each replica in its own network namespace on a bridge
// (internal/netns); the coordinators stay in the root namespace, at the
// bridge's gateway address. Cuts are blackhole routes, slow links netem.
type nsNetwork struct {
	n     *netns.Net
	mu    sync.Mutex
	hosts map[string]*netns.Host
}

func newNSNetwork(ctx context.Context) (*nsNetwork, error) {
	n, err := netns.New(ctx)
	if err != nil {
		return nil, err
	}
	return &nsNetwork{n: n, hosts: map[string]*netns.Host{}}, nil
}

func (w *nsNetwork) kind() string       { return "netns" }
func (w *nsNetwork) serverHost() string { return w.n.Gateway() }

func (w *nsNetwork) place(ctx context.Context, name string, eps []string) (*placement, error) {
	h, err := w.n.AddHost(ctx, name)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	w.hosts[name] = h
	w.mu.Unlock()
	// Gloo's shared memory would carry data around a cut: the namespaces
	// share a kernel and a pid namespace.
	return &placement{command: func(p string) *exec.Cmd { return h.Command(p) }, host: h.IP, endpoints: eps,
		gossip: true, env: []string{"FTCOMM_GLOO_SHM=0"}}, nil
}

func (w *nsNetwork) lookup(names []string) ([]*netns.Host, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var hs []*netns.Host
	for _, n := range names {
		h, ok := w.hosts[n]
		if !ok {
			return nil, fmt.Errorf("chaos: no host %q", n)
		}
		hs = append(hs, h)
	}
	return hs, nil
}

func (w *nsNetwork) partition(ctx context.Context, a, b []string, gateway bool) error {
	ha, err := w.lookup(a)
	if err != nil {
		return err
	}
	hb, err := w.lookup(b)
	if err != nil {
		return err
	}
	return w.n.Cut(ctx, ha, hb, gateway)
}

func (w *nsNetwork) heal(ctx context.Context) error { return w.n.Heal(ctx) }

func (w *nsNetwork) shape(ctx context.Context, name string, s netns.Shape) error {
	hs, err := w.lookup([]string{name})
	if err != nil {
		return err
	}
	return hs[0].Shape(ctx, s)
}

func (w *nsNetwork) close() error { return w.n.Close() }

// shapeString describes a shape for the timeline.
func shapeString(s netns.Shape) string {
	out := ""
	if s.Delay > 0 {
		out += fmt.Sprintf("delay %v±%v ", s.Delay, s.Jitter)
	}
	if s.Rate != "" {
		out += "rate " + s.Rate + " "
	}
	if s.Loss > 0 {
		out += fmt.Sprintf("loss %g%% ", s.Loss)
	}
	return out
}
