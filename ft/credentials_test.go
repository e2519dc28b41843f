package ft_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	_ "github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/coordinator/server"
	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/membership"
)

// Replicas given only the credentials file of a secured coordinator (TLS,
// client certificates, etcd roles, signed quorums, encrypted gossip) find
// its etcd, form a job and commit steps together; the file also comes
// through FTCOMM_CREDENTIALS.
func TestCredentialsFileJob(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	sc := server.DefaultConfig()
	sc.DataDir, sc.Listen, sc.UnsafeNoFsync, sc.Name = t.TempDir(), "127.0.0.1:0", true, "coord"
	sc.Quorum.JoinTimeout = 300 * time.Millisecond
	srv, err := server.New(ctx, sc)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(context.Background()) }()
	defer func() { srv.Close(); <-served }()

	g := membership.DefaultGossipConfig()
	mc := membership.DefaultMemberConfig()
	mc.LeaseTTL, mc.Gossip = 2*time.Second, &g
	base := ft.Config{Job: "secure", Member: mc, Backend: "gloo", Secret: []byte("k"), MinReplicas: 2, Timeout: 10 * time.Second}
	a := base
	a.Group, a.Credentials = "a", srv.CredentialsPath()
	t.Setenv(membership.CredentialsEnv, srv.CredentialsPath())
	b := base
	b.Group = "b" // from the environment
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for _, cfg := range []ft.Config{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- train(ctx, cfg, 3)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// train runs steps until `steps` commits with two participants.
func train(ctx context.Context, cfg ft.Config, steps int) error {
	c, err := ft.New(ctx, cfg)
	if err != nil {
		return err
	}
	defer c.Close()
	x := []float32{1}
	if err := c.Register("x", comm.Float32s(x)); err != nil {
		return err
	}
	for done := 0; done < steps; {
		if err := c.Step(ctx); err != nil {
			if errors.Is(err, ft.ErrNotParticipating) {
				continue
			}
			return err
		}
		c.AllReduce(ctx, comm.Float32s([]float32{1}), comm.Sum)
		ok, err := c.Commit(ctx)
		if err != nil && ctx.Err() != nil {
			return err
		}
		if ok && c.Participants() == 2 {
			done++
		}
	}
	return nil
}
