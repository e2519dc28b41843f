package membership

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"errors"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"
)

// A record forwarded by the group's leader is taken only as one read from
// etcd would be: signed by a trusted key, of the member's job, and newer
// than the quorum the member holds. A late or replayed forward, a forged
// one and another job's change nothing; a forwarded change of the held
// epoch applies.
func TestForwardedQuorumFenced(t *testing.T) {
	pub, key, _ := ed25519.GenerateKey(nil)
	k := NewQuorumKey(pub)
	sign := func(msg []byte) *QuorumSignature {
		return &QuorumSignature{KeyID: k.ID, Ed25519: ed25519.Sign(key, msg)}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m := newMember(&memberEnv{cfg: MemberConfig{Job: "j", QuorumVerifier: NewQuorumVerifier(k)}, keys: etcdkeys.Layout{}, lg: zap.NewNop(), life: ctx})
	lay := etcdkeys.Layout{}
	rev := int64(10)
	kv := func(key string, raw []byte) *mvccpb.KeyValue {
		rev++
		return &mvccpb.KeyValue{Key: []byte(key), Value: raw, ModRevision: rev}
	}
	record := func(q Quorum, sign func([]byte) *QuorumSignature) *mvccpb.KeyValue {
		raw, err := EncodeQuorumRecord(q, nil, nil, sign)
		if err != nil {
			t.Fatal(err)
		}
		return kv(lay.Quorum(q.Job), raw)
	}
	epoch := func() uint64 {
		q, ok := m.Quorum()
		if !ok {
			return 0
		}
		return q.Epoch
	}
	q5 := viewQuorum(5, "a", "b", "c")
	m.epochs.applyForwarded(record(q5, sign))
	if epoch() != 5 {
		t.Fatalf("a signed whole list: epoch %d, want 5", epoch())
	}
	for name, f := range map[string]*mvccpb.KeyValue{
		"older epoch":      record(viewQuorum(4, "a"), sign),
		"same epoch":       record(viewQuorum(5, "a"), sign),
		"unsigned":         record(viewQuorum(9, "a"), nil),
		"another job":      record(Quorum{Job: "other", Epoch: 9, Participants: []Participant{{ID: "a", Incarnation: 1}}}, sign),
		"not a quorum key": kv("/ftcomm/j/members/a", []byte(`{"epoch":9}`)),
	} {
		m.epochs.applyForwarded(f)
		if q, _ := m.Quorum(); q.Epoch != 5 || len(q.Participants) != 3 {
			t.Fatalf("%s: the member took epoch %d with %d participants", name, q.Epoch, len(q.Participants))
		}
	}
	q6 := viewQuorum(6, "a", "c")
	q6.Participants[1] = q5.Participants[2]
	change, err := EncodeQuorumView(&q5, q6, nil, sign)
	if err != nil {
		t.Fatal(err)
	}
	m.epochs.applyForwarded(kv(lay.QuorumView("j"), change))
	if q, _ := m.Quorum(); q.Epoch != 6 || q.Rank("b") >= 0 || q.Rank("c") != 1 {
		t.Fatalf("a forwarded change of the held epoch: %+v", q)
	}
}

// A forwarded record crosses the link as it was stored; a frame that
// claims more than a record may hold is refused, not allocated.
func TestLinkRecordFrames(t *testing.T) {
	in := &mvccpb.KeyValue{Key: []byte("/ftcomm/_coordinator/jobs/j/view"), Value: bytes.Repeat([]byte{7}, 70000), ModRevision: 1 << 40}
	f := encodeLinkRecord(in)
	r := bufio.NewReader(bytes.NewReader(f))
	if b, _ := r.ReadByte(); b != linkRecord {
		t.Fatalf("frame starts with %q", b)
	}
	out, err := readLinkRecord(r)
	if err != nil || !bytes.Equal(out.Key, in.Key) || !bytes.Equal(out.Value, in.Value) || out.ModRevision != in.ModRevision {
		t.Fatalf("round trip: %v", err)
	}
	huge := []byte{0xff, 0xff, 0xff, 0xff, 0x7f}
	if _, err := readLinkRecord(bufio.NewReader(bytes.NewReader(huge))); !errors.Is(err, errBadLinkRecord) {
		t.Fatalf("an oversized key: %v", err)
	}
}

// A member's turn to take its group's lease over: the group's other
// members before it by id, the old leader and other groups aside; one
// the quorum does not hold yet comes last.
func TestTakeoverTurn(t *testing.T) {
	ps := []Participant{{ID: "a.1", Group: "a"}, {ID: "b.0", Group: "b"}, {ID: "a.0", Group: "a"},
		{ID: "a.3", Group: "a"}, {ID: "a.2", Group: "a"}, {ID: "b.1", Group: "b"}}
	for _, c := range []struct {
		self, leader string
		want         int
	}{
		{"a.1", "a.0", 0}, // the first after the leader goes at once
		{"a.2", "a.0", 1},
		{"a.3", "a.0", 2},
		{"a.0", "a.1", 0}, // a leader of any id
		{"a.3", "a.1", 2},
		{"a.9", "a.0", 3}, // not in the quorum yet: after the three others
		{"b.1", "b.0", 0},
	} {
		if got := takeoverTurn(ps, c.self[:1], c.self, c.leader); got != c.want {
			t.Errorf("%s with %s gone: turn %d, want %d", c.self, c.leader, got, c.want)
		}
	}
	if got := takeoverTurn(nil, "a", "a.1", "a.0"); got != 0 {
		t.Errorf("no quorum held: turn %d, want 0 (nothing known to wait for)", got)
	}
}

// readKV is an etcd KV whose Get answers with the quorum record the test
// holds then, and calls during (a forward that arrives while the answer is
// on its way) before answering; the reads numbered in fail get an error
// instead (etcd shedding load, or out of reach).
type readKV struct {
	clientv3.KV
	mu     sync.Mutex
	record *mvccpb.KeyValue
	reads  int
	during func(read int)
	fail   map[int]bool
}

func (k *readKV) Get(ctx context.Context, key string, _ ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	k.mu.Lock()
	k.reads++
	n, rec := k.reads, k.record
	k.mu.Unlock()
	if k.during != nil {
		k.during(n)
	}
	if k.fail[n] {
		return nil, errors.New("etcdserver: too many requests")
	}
	return &clientv3.GetResponse{Header: &etcdserverpb.ResponseHeader{}, Kvs: []*mvccpb.KeyValue{rec}}, nil
}

// A member that follows its group's leader ends on the newest epoch the
// leader forwarded, even when a view it cannot apply arrives while it
// reads the record for the one before: the read under way may predate
// that view's epoch, and the leader forwards each view once.
func TestForwardedViewDuringARead(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	lay := etcdkeys.Layout{}
	rev := int64(10)
	kv := func(key string, raw []byte) *mvccpb.KeyValue {
		rev++
		return &mvccpb.KeyValue{Key: []byte(key), Value: raw, ModRevision: rev}
	}
	record := func(q Quorum) *mvccpb.KeyValue {
		raw, err := EncodeQuorumRecord(q, nil, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		return kv(lay.Quorum(q.Job), raw)
	}
	view := func(prev, q Quorum) *mvccpb.KeyValue {
		raw, err := EncodeQuorumView(&prev, q, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		return kv(lay.QuorumView(q.Job), raw)
	}
	q5, q6, q7, q8 := viewQuorum(5, "a", "b", "c", "d"), viewQuorum(6, "a", "b", "c"), viewQuorum(7, "a", "b"), viewQuorum(8, "a")
	store := &readKV{record: record(q7)}
	m := newMember(&memberEnv{cfg: MemberConfig{Job: "j", LeaseTTL: 5 * time.Second}, cli: &clientv3.Client{KV: store}, keys: lay, lg: zap.NewNop(), life: ctx})
	m.epochs.applyForwarded(record(q5))
	rec8 := record(q8)
	store.during = func(read int) {
		if read == 1 { // etcd answered with epoch 7; epoch 8 is written and forwarded meanwhile
			store.mu.Lock()
			store.record = rec8
			store.mu.Unlock()
			m.epochs.applyForwarded(view(q7, q8))
		}
	}
	m.epochs.applyForwarded(view(q6, q7)) // the member missed epoch 6: it reads the record
	q, err := m.NextQuorum(ctx, 7)
	if err != nil {
		t.Fatalf("%v; it holds: %s", err, m.State())
	}
	if q.Epoch != 8 {
		t.Fatalf("epoch %d, want 8", q.Epoch)
	}
	m.wg.Wait()
}

// A member that follows its group's leader ends on the epoch of a view it
// could not apply even when etcd fails the reads of the record that view
// made it try: the leader forwards each view once, so nothing else would
// bring that epoch (the last of a burst of deaths has no successor).
func TestForwardedViewReadFailing(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	lay := etcdkeys.Layout{}
	rev := int64(10)
	kv := func(key string, raw []byte) *mvccpb.KeyValue {
		rev++
		return &mvccpb.KeyValue{Key: []byte(key), Value: raw, ModRevision: rev}
	}
	q5, q6, q7 := viewQuorum(5, "a", "b", "c", "d"), viewQuorum(6, "a", "b", "c"), viewQuorum(7, "a", "b")
	raw5, err := EncodeQuorumRecord(q5, nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	raw7, err := EncodeQuorumRecord(q7, nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	view7, err := EncodeQuorumView(&q6, q7, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	store := &readKV{record: kv(lay.Quorum("j"), raw7), fail: map[int]bool{1: true, 2: true}}
	m := newMember(&memberEnv{cfg: MemberConfig{Job: "j", LeaseTTL: 5 * time.Second}, cli: &clientv3.Client{KV: store}, keys: lay, lg: zap.NewNop(), life: ctx})
	m.epochs.applyForwarded(kv(lay.Quorum("j"), raw5))
	m.epochs.applyForwarded(kv(lay.QuorumView("j"), view7)) // the member missed epoch 6: it reads the record
	q, err := m.NextQuorum(ctx, 5)
	if err != nil {
		t.Fatalf("%v; it holds: %s", err, m.State())
	}
	if q.Epoch != 7 {
		t.Fatalf("epoch %d, want 7", q.Epoch)
	}
	m.wg.Wait()
	if store.reads != 3 {
		t.Errorf("%d reads, want 3 (two failed, one answered)", store.reads)
	}
}
