package membership_test

import (
	"encoding/json"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// cutProxy forwards TCP to a backend and can cut every connection and
// refuse new ones until healed: a network partition between a client and
// etcd.
type cutProxy struct {
	ln      net.Listener
	backend string
	mu      sync.Mutex
	cut     bool
	conns   map[net.Conn]bool
	wg      sync.WaitGroup
}

func newCutProxy(t *testing.T, backend string) *cutProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, backend: backend, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(p.close)
	return p
}

func (p *cutProxy) addr() string { return p.ln.Addr().String() }

func (p *cutProxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.cut {
			p.mu.Unlock()
			c.Close()
			continue
		}
		b, err := net.Dial("tcp", p.backend)
		if err != nil {
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.conns[c], p.conns[b] = true, true
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { defer p.wg.Done(); io.Copy(b, c); b.Close() }()
		go func() { defer p.wg.Done(); io.Copy(c, b); c.Close() }()
	}
}

func (p *cutProxy) setCut(cut bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = cut
	if cut {
		for c := range p.conns {
			c.Close()
		}
		clear(p.conns)
	}
}

func (p *cutProxy) close() {
	p.ln.Close()
	p.setCut(true)
	p.wg.Wait()
}

// A member cut off from etcd while epochs pass and history is compacted
// re-reads the quorum when it reconnects (its watch gets ErrCompacted).
func TestMemberWatchResumesAfterCompaction(t *testing.T) {
	e := clustertest.StartEtcd(t)
	admin := clustertest.NewClient(t, e)
	proxy := newCutProxy(t, e.Endpoints()[0])
	cli, err := membership.NewClient([]string{proxy.addr()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx := clustertest.Ctx(t, 60*time.Second)
	cfg := membership.DefaultMemberConfig()
	cfg.Client, cfg.Job, cfg.ID, cfg.Addr = cli, "j", "a", "a:1"
	cfg.LeaseTTL = 30 * time.Second
	cfg.Logger = zaptest.NewLogger(t)
	m, err := membership.Join(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	keys := etcdkeys.Layout{}
	put := func(epoch uint64) int64 {
		// What a coordinator writes: the record and its view.
		q := membership.Quorum{Job: "j", Epoch: epoch, Participants: []membership.Participant{{ID: "a", Incarnation: m.Incarnation()}}}
		v, _ := json.Marshal(q)
		view, err := membership.EncodeQuorumView(nil, q, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := admin.Txn(ctx).Then(clientv3.OpPut(keys.Quorum("j"), string(v)), clientv3.OpPut(keys.QuorumView("j"), string(view))).Commit()
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	put(1)
	if q, err := m.NextQuorum(ctx, 0); err != nil || q.Epoch != 1 {
		t.Fatalf("first quorum %+v, %v", q, err)
	}
	proxy.setCut(true)
	put(2)
	rev := put(3)
	if _, err := admin.Compact(ctx, rev); err != nil {
		t.Fatal(err)
	}
	proxy.setCut(false)
	q, err := m.NextQuorum(ctx, 1)
	if err != nil || q.Epoch != 3 {
		t.Fatalf("after reconnect: %+v, %v", q, err)
	}
	if _, ok := m.Revocation(2); ok {
		t.Fatal("invented a revocation")
	}
	select {
	case <-m.Revoked(1):
	default:
		t.Fatal("epoch 1 not revoked after epoch 3 was seen")
	}
	put(4)
	if q, err := m.NextQuorum(ctx, 3); err != nil || q.Epoch != 4 {
		t.Fatalf("watch did not resume: %+v, %v", q, err)
	}
}
