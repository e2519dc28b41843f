package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// signalOn returns a logger that closes the channel at its first entry
// whose message contains s.
func signalOn(s string) (*zap.Logger, <-chan struct{}) {
	ch := make(chan struct{})
	var once sync.Once
	core, _ := observer.New(zapcore.InfoLevel) // hooks run only for entries a core takes
	lg := zap.New(core, zap.Hooks(func(e zapcore.Entry) error {
		if strings.Contains(e.Message, s) {
			once.Do(func() { close(ch) })
		}
		return nil
	}))
	return lg, ch
}

// A foreign quorum record, as it was first found, against a real `ftcoord serve`
// with its defaults: the embedded etcd had no authentication, and a forged
// <root>/<job>/epoch/quorum with one participant was obeyed by every
// replica within ~40 ms while the coordinator only logged a warning (which
// also fired on ordinary joins). Now etcd wants TLS and a client
// certificate, trainers cannot write quorums, and a quorum forged with
// etcd's root credentials is ignored by the members and restored by the
// leader at once.
func TestServeProcessForgedQuorum(t *testing.T) {
	p := startFtcoord(t, "sec")
	p.waitLog(t, "\tleading\t", 30*time.Second)
	creds := p.credentials(t)
	if creds.CACert == "" || creds.Cert == "" || len(creds.QuorumKeys) != 1 || len(creds.GossipKey) != 32 {
		t.Fatalf("credentials lack something: ca %t cert %t keys %d gossip %d", creds.CACert != "", creds.Cert != "", len(creds.QuorumKeys), len(creds.GossipKey))
	}
	if fi, err := os.Stat(p.credentialsPath()); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("credentials file mode %v, %v", fi.Mode(), err)
	}
	cli := p.etcdClient(t)
	lgA, ignoredA := signalOn("ignored a quorum record")
	lgB, ignoredB := signalOn("ignored a quorum record")
	a, b := joinMember(t, cli, creds, "job", "a", lgA), joinMember(t, cli, creds, "job", "b", lgB)
	q := waitParticipants(t, a, 2)
	waitParticipants(t, b, 2)
	ctx := testutil.Ctx(t, 60*time.Second)
	short := func() context.Context { return testutil.Ctx(t, 2*time.Second) }
	k := etcdkeys.Layout{}

	// Someone who merely reaches the port gets nothing.
	plain, err := membership.NewClient(creds.Endpoints, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if _, err := plain.Get(short(), "/", clientv3.WithPrefix()); err == nil {
		t.Fatal("a client without credentials read etcd")
	}
	// A trainer cannot write a quorum.
	forged := q
	forged.Epoch, forged.Participants, forged.Reason, forged.Signature = q.Epoch+1, q.Participants[:1], "forged", nil
	v, _ := json.Marshal(forged)
	if _, err := cli.Put(ctx, k.Quorum("job"), string(v)); err == nil || !strings.Contains(err.Error(), "permission denied") {
		t.Fatalf("a trainer wrote the quorum: %v", err)
	}
	// etcd's root (the operator's certificate in <data-dir>/pki) can; the
	// members do not obey, and the leader restores its record.
	pki := filepath.Join(p.dataDir, "pki")
	tc, err := transport.TLSInfo{CertFile: filepath.Join(pki, "root.pem"), KeyFile: filepath.Join(pki, "root-key.pem"),
		TrustedCAFile: filepath.Join(pki, "ca.pem")}.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	rcfg := membership.ClientConfig(creds.Endpoints, nil)
	rcfg.TLS = tc
	root, err := clientv3.New(rcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	// The record first (members do not watch it; the leader restores it),
	// then the view members watch, unsigned: they ignore it, and the
	// leader republishes its own.
	if _, err := root.Put(ctx, k.Quorum("job"), string(v)); err != nil {
		t.Fatal(err)
	}
	p.waitLog(t, "restored the quorum record", 20*time.Second)
	view, err := membership.EncodeQuorumView(nil, forged, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := root.Put(ctx, k.QuorumView("job"), string(view)); err != nil {
		t.Fatal(err)
	}
	for _, ch := range []<-chan struct{}{ignoredA, ignoredB} {
		select {
		case <-ch:
		case <-ctx.Done():
			t.Fatal("a member did not see the forged view")
		}
	}
	p.waitLog(t, "quorum view written by someone else", 20*time.Second)
	for _, m := range []*membership.Member{a, b} {
		if cur, _ := m.Quorum(); len(cur.Participants) != 2 || cur.Reason == "forged" {
			t.Fatalf("%s obeyed the forged quorum: %+v", m.ID(), cur)
		}
	}
	// The job goes on: a joiner is admitted.
	c := joinMember(t, cli, creds, "job", "c", nil)
	if q2 := waitParticipants(t, c, 3); q2.Epoch <= q.Epoch {
		t.Fatalf("epoch %d, want above %d", q2.Epoch, q.Epoch)
	}
	// The ordinary joins raised no alarm; each forgery one.
	out := p.output()
	if n := strings.Count(out, "written by someone else; restoring") + strings.Count(out, "written by someone else; republishing"); n != 2 {
		t.Fatalf("%d foreign-write warnings, want 2:\n%s", n, out)
	}
}
