package clustertest

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

// SecureJob is a secured embedded etcd (TLS, client certificates, etcd
// auth) with a coordinator that signs its quorums, as `ftcoord serve`
// runs them, and the members of one job that Join adds with the
// trainers' credentials.
type SecureJob struct {
	T      *testing.T
	Etcd   *etcdhost.Embedded
	Signer *coordinator.QuorumSigner
	Coord  *coordinator.Coordinator
	// CoordClient acts as the coordinators' etcd user.
	CoordClient *clientv3.Client
	// Trainer are the trainers' credentials, with the signer's key.
	Trainer *membership.Credentials
	// Logs holds the current coordinator's logs of level Info and above.
	Logs *observer.ObservedLogs
	Name string // the job ("job1")
	stop func()
}

// StartSecureJob starts a secured etcd in a temporary directory and a
// leading coordinator "c0" that signs with a fresh key.
func StartSecureJob(t *testing.T) *SecureJob {
	t.Helper()
	cfg := etcdhost.DefaultEmbeddedConfig()
	cfg.Dir, cfg.UnsafeNoFsync, cfg.Secure = t.TempDir(), true, true
	e, err := etcdhost.StartEmbedded(Ctx(t, 60*time.Second), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	if !e.Secure() {
		t.Fatal("not secure")
	}
	signer, err := coordinator.GenerateQuorumSigner()
	if err != nil {
		t.Fatal(err)
	}
	sj := &SecureJob{T: t, Etcd: e, Signer: signer, Name: "job1"}
	sj.CoordClient = NewClient(t, e)
	sj.Trainer = Credentials(t, e, etcdhost.UserTrainer)
	sj.Trainer.QuorumKeys = []membership.QuorumKey{signer.PublicKey()}
	sj.StartCoordinator("c0")
	return sj
}

// StartCoordinator starts a coordinator that signs with the job's key
// and waits until it leads; Stop stops it.
func (sj *SecureJob) StartCoordinator(name string) {
	t := sj.T
	t.Helper()
	core, logs := observer.New(zapcore.InfoLevel)
	sj.Logs = logs
	cc := coordinator.DefaultConfig()
	cc.Client, cc.Name, cc.QuorumSigner = sj.CoordClient, name, sj.Signer
	cc.SessionTTL = 2 * time.Second
	cc.Logger = zap.New(zapcore.NewTee(core, zaptest.NewLogger(t).Core())).Named(name)
	cc.Registerer = prometheus.NewRegistry()
	c, err := coordinator.New(cc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once bool
	sj.stop = func() {
		if !once {
			once = true
			cancel()
			<-done
		}
	}
	t.Cleanup(sj.stop)
	sj.Coord = c
	WaitLeader(t, c)
}

// Stop stops the coordinator StartCoordinator started last.
func (sj *SecureJob) Stop() { sj.stop() }

// TrainerClient connects with the trainers' credentials.
func (sj *SecureJob) TrainerClient() *clientv3.Client {
	sj.T.Helper()
	cli, err := sj.Trainer.NewClient(nil)
	if err != nil {
		sj.T.Fatal(err)
	}
	sj.T.Cleanup(func() { cli.Close() })
	return cli
}

// Join adds member id to the job as a trainer would: its own client with
// the trainers' credentials, which also give it the quorum verifier.
func (sj *SecureJob) Join(id string) *membership.Member {
	t := sj.T
	t.Helper()
	mc := membership.DefaultMemberConfig()
	mc.Client, mc.Job, mc.ID, mc.Addr, mc.WantQuorum = sj.TrainerClient(), sj.Name, id, id+".example:1", true
	mc.LeaseTTL = 5 * time.Second
	mc.Logger = zaptest.NewLogger(t).Named(id)
	sj.Trainer.ApplyMember(&mc)
	if mc.QuorumVerifier == nil {
		t.Fatal("no verifier from the credentials")
	}
	m, err := membership.Join(Ctx(t, 20*time.Second), mc)
	if err != nil {
		t.Fatalf("join %s: %v", id, err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// WaitRecord waits until the job's quorum key holds want.
func (sj *SecureJob) WaitRecord(want []byte) {
	t := sj.T
	t.Helper()
	ctx := Ctx(t, 20*time.Second)
	k := etcdkeys.Layout{}.Quorum(sj.Name)
	for {
		resp, err := sj.CoordClient.Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) == 1 && bytes.Equal(resp.Kvs[0].Value, want) {
			return
		}
		wch := sj.CoordClient.Watch(ctx, k, clientv3.WithRev(resp.Header.Revision+1))
		select {
		case <-wch:
		case <-ctx.Done():
			t.Fatalf("the quorum record was not restored")
		}
	}
}

// Credentials are a member's credentials for user (etcdhost.UserTrainer,
// UserCoordinator or UserRoot) of e, as ftcoord writes them for trainers
// (without quorum or gossip keys).
func Credentials(t testing.TB, e *etcdhost.Embedded, user string) *membership.Credentials {
	t.Helper()
	a, err := e.Access(user)
	if err != nil {
		t.Fatal(err)
	}
	return &membership.Credentials{Version: membership.CredentialsVersion, Endpoints: a.Endpoints, Root: a.Root,
		CACert: a.CACert, Cert: a.Cert, Key: a.Key}
}
