package etcdhost_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// The embedded etcd of a secure deployment accepts only clients with a
// certificate of its CA, and etcd's roles let trainers write what members
// write and nothing of the coordinators'.
func TestSecureEmbeddedAccessControl(t *testing.T) {
	sj := clustertest.StartSecureJob(t)
	a := sj.Join("a")
	clustertest.WaitQuorum(t, a, 0, "a")
	ctx := clustertest.Ctx(t, 30*time.Second)
	k := etcdkeys.Layout{}
	// Members read the signed view (a member with a verifier refuses an
	// unsigned one); the record beside it is signed too.
	resp, err := sj.CoordClient.Get(ctx, k.Quorum(sj.Name))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("quorum record: %v", err)
	}
	q, err := membership.DecodeQuorumRecord(resp.Kvs[0].Value, sj.Signer.Verifier())
	if err != nil {
		t.Fatalf("quorum record not signed by the coordinator's key: %v", err)
	}
	tr := sj.TrainerClient()
	// A member reads the record (the whole list) when it cannot apply a view.
	if resp, err := tr.Get(ctx, k.Quorum(sj.Name)); err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("trainer reads the quorum record: %v", err)
	}
	denied := func(what string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), "permission denied") {
			t.Errorf("trainer %s: %v, want permission denied", what, err)
		}
	}
	_, err = tr.Put(ctx, k.Quorum(sj.Name), `{"job":"job1","epoch":99}`)
	denied("writes the quorum", err)
	_, err = tr.Put(ctx, k.HistoryEntry(sj.Name, 99), "x")
	denied("writes history", err)
	_, err = tr.Put(ctx, k.Election()+"/x", "me")
	denied("campaigns", err)
	_, err = tr.Delete(ctx, k.Coordinator(), clientv3.WithPrefix())
	denied("deletes the coordinators' keys", err)
	_, err = tr.Put(ctx, "/elsewhere", "x")
	denied("writes outside the root", err)
	// What members do is allowed (Join, the quorum above, and these).
	if _, err := tr.Put(ctx, k.Rendezvous(sj.Name)+"x", "1"); err != nil {
		t.Errorf("trainer rendezvous write: %v", err)
	}
	if _, _, err := a.RecordCommit(ctx, 1, q.Epoch); err != nil {
		t.Errorf("trainer commit record: %v", err)
	}
	if err := a.Revoke(ctx, q.Epoch, "test"); err != nil {
		t.Errorf("trainer revocation: %v", err)
	}

	// No client certificate, or none of this CA: refused.
	ep := sj.Etcd.Endpoints()
	short := func() context.Context { return clustertest.Ctx(t, 2*time.Second) }
	plain, err := membership.NewClient(ep, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if _, err := plain.Get(short(), "/ftcomm/"); err == nil {
		t.Error("a plain-TCP client read the data")
	}
	noCert := *sj.Trainer
	noCert.Cert, noCert.Key = "", ""
	nc, err := noCert.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := nc.Get(short(), "/ftcomm/"); err == nil {
		t.Error("a client without a certificate read the data")
	}
	other := clustertest.StartSecureJob(t) // another CA
	oc, err := other.Trainer.ClientConfig(ep, nil)
	if err != nil {
		t.Fatal(err)
	}
	oc.TLS.RootCAs = mustTLS(t, sj.Trainer).RootCAs // trusts our server, presents a foreign cert
	ocli, err := clientv3.New(oc)
	if err != nil {
		t.Fatal(err)
	}
	defer ocli.Close()
	if _, err := ocli.Get(short(), "/ftcomm/"); err == nil {
		t.Error("a client with another CA's certificate read the data")
	}
}

func mustTLS(t *testing.T, c *membership.Credentials) *tls.Config {
	tc, err := c.TLS()
	if err != nil || tc == nil {
		t.Fatal(tc, err)
	}
	return tc
}

// Credentials round-trip through their file, and what they configure.
func TestCredentialsFile(t *testing.T) {
	sj := clustertest.StartSecureJob(t)
	sj.Trainer.GossipKey = bytes.Repeat([]byte{7}, 32)
	path := filepath.Join(t.TempDir(), "creds.json")
	if err := membership.WriteCredentials(path, sj.Trainer); err != nil {
		t.Fatal(err)
	}
	t.Setenv(membership.CredentialsEnv, path)
	c, err := membership.LoadCredentialsOrEnv("")
	if err != nil {
		t.Fatal(err)
	}
	cli, err := c.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Get(clustertest.Ctx(t, 10*time.Second), "/ftcomm/"); err != nil {
		t.Fatalf("client from the file: %v", err)
	}
	g := membership.DefaultGossipConfig()
	mc := membership.MemberConfig{Gossip: &g}
	c.ApplyMember(&mc)
	if mc.QuorumVerifier == nil || !bytes.Equal(mc.Gossip.SecretKey, c.GossipKey) || g.SecretKey != nil || mc.Root != "/ftcomm" {
		t.Fatalf("ApplyMember: %+v", mc)
	}
	for _, bad := range []string{`{"version":2}`, `{"version":1,"cert":"x"}`, `{"version":1,"gossipKey":"AAAA"}`, `not json`} {
		p := filepath.Join(t.TempDir(), "bad.json")
		if err := os.WriteFile(p, []byte(bad), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := membership.LoadCredentials(p); err == nil {
			t.Errorf("LoadCredentials(%s) succeeded", bad)
		}
	}
	t.Setenv(membership.CredentialsEnv, "")
	if c, err := membership.LoadCredentialsOrEnv(""); c != nil || err != nil {
		t.Fatalf("unset env: %v %v", c, err)
	}
	// A secured data directory cannot be opened without Secure.
	sj.Stop()
	dir := sj.Etcd.Dir()
	sj.Etcd.Close()
	cfg := etcdhost.DefaultEmbeddedConfig()
	cfg.Dir = dir
	if _, err := etcdhost.StartEmbedded(clustertest.Ctx(t, 10*time.Second), cfg); err == nil || !strings.Contains(err.Error(), "secured") {
		t.Fatalf("insecure start on a secured directory: %v", err)
	}
}
