package membership_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

func TestStoreSetGetDelete(t *testing.T) {
	e := clustertest.StartEtcd(t)
	cli := clustertest.NewClient(t, e)
	ctx := clustertest.Ctx(t, 20*time.Second)
	s := membership.NewStore(cli, "/ftcomm/job/rdzv/1/")
	if err := s.Set(ctx, "addr/0", []byte("127.0.0.1:1")); err != nil {
		t.Fatal(err)
	}
	v, err := s.Get(ctx, "addr/0")
	if err != nil || string(v) != "127.0.0.1:1" {
		t.Fatalf("get = %q, %v", v, err)
	}
	// The key really lives under the prefix in etcd.
	resp, err := cli.Get(ctx, "/ftcomm/job/rdzv/1/addr/0")
	if err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "127.0.0.1:1" {
		t.Fatalf("raw etcd get = %v, %v", resp, err)
	}
	if err := s.Delete(ctx, "addr/0"); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "never-written"); err != nil {
		t.Fatalf("deleting a missing key: %v", err)
	}
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if _, err := s.Get(short, "addr/0"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("get of a deleted key = %v, want a deadline error", err)
	}
}

func TestStoreGetWaitsForSet(t *testing.T) {
	e := clustertest.StartEtcd(t)
	ctx := clustertest.Ctx(t, 20*time.Second)
	s := membership.NewStore(clustertest.NewClient(t, e), "/ftcomm/j/rdzv/2")
	const n = 8
	type res struct {
		v   []byte
		err error
	}
	out := make(chan res, n)
	for i := 0; i < n; i++ {
		go func() {
			v, err := s.Get(ctx, "uid")
			out <- res{v, err}
		}()
	}
	// A second client writes, as another rank would.
	w := membership.NewStore(clustertest.NewClient(t, e), "/ftcomm/j/rdzv/2")
	if err := w.Set(ctx, "uid", []byte{0, 1, 2, 255}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		r := <-out
		if r.err != nil || string(r.v) != string([]byte{0, 1, 2, 255}) {
			t.Fatalf("waiting get = %v, %v", r.v, r.err)
		}
	}
}

func TestStoreAddConcurrent(t *testing.T) {
	e := clustertest.StartEtcd(t)
	ctx := clustertest.Ctx(t, 60*time.Second)
	const workers, adds = 6, 20
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		cli := clustertest.NewClient(t, e) // separate clients: real contention
		s := membership.NewStore(cli, "/ftcomm/j/rdzv/3")
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < adds; i++ {
				if _, err := s.Add(ctx, "counter", 1); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	s := membership.NewStore(clustertest.NewClient(t, e), "/ftcomm/j/rdzv/3")
	v, err := s.Get(ctx, "counter")
	if err != nil || string(v) != fmt.Sprint(workers*adds) {
		t.Fatalf("counter = %q, %v; want %d", v, err, workers*adds)
	}
	got, err := s.Add(ctx, "counter", -workers*adds-5)
	if err != nil || got != -5 {
		t.Fatalf("add negative = %d, %v", got, err)
	}
	if got, err := s.Add(ctx, "fresh", 7); err != nil || got != 7 {
		t.Fatalf("add to a missing key = %d, %v", got, err)
	}
}

func TestStoreAddNotInteger(t *testing.T) {
	e := clustertest.StartEtcd(t)
	ctx := clustertest.Ctx(t, 20*time.Second)
	s := membership.NewStore(clustertest.NewClient(t, e), "/p")
	if err := s.Set(ctx, "k", []byte("abc")); err != nil {
		t.Fatal(err)
	}
	_, err := s.Add(ctx, "k", 1)
	if !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("add to text = %v, want ErrInvalidArgument", err)
	}
	if v, _ := s.Get(ctx, "k"); string(v) != "abc" {
		t.Fatalf("value changed to %q", v)
	}
}

func TestStoreDeletePrefixIsolation(t *testing.T) {
	e := clustertest.StartEtcd(t)
	ctx := clustertest.Ctx(t, 20*time.Second)
	cli := clustertest.NewClient(t, e)
	a := membership.NewStore(cli, "/ftcomm/j/rdzv/4")
	b := membership.NewStore(cli, "/ftcomm/j/rdzv/40") // a prefix of a's is not a's
	for _, k := range []string{"x/1", "x/2", "y"} {
		if err := a.Set(ctx, k, []byte(k)); err != nil {
			t.Fatal(err)
		}
		if err := b.Set(ctx, k, []byte(k)); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.DeletePrefix(ctx, "x/"); err != nil {
		t.Fatal(err)
	}
	if v, err := a.Get(ctx, "y"); err != nil || string(v) != "y" {
		t.Fatalf("y after DeletePrefix(x/) = %q, %v", v, err)
	}
	if err := a.DeletePrefix(ctx, ""); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, "/ftcomm/j/rdzv/4/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil || resp.Count != 0 {
		t.Fatalf("keys left under a = %v, %v", resp.Count, err)
	}
	resp, err = cli.Get(ctx, "/ftcomm/j/rdzv/40/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil || resp.Count != 3 {
		t.Fatalf("keys of b = %v, %v; want 3 untouched", resp.Count, err)
	}
	if err := membership.NewStore(cli, "").DeletePrefix(ctx, ""); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("deleting the whole keyspace = %v, want refusal", err)
	}
}

func TestStoreClosedClient(t *testing.T) {
	e := clustertest.StartEtcd(t)
	cli, err := e.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	s := membership.NewStore(cli, "/p")
	ctx := clustertest.Ctx(t, 20*time.Second)
	done := make(chan error, 1)
	go func() { _, err := s.Get(ctx, "never"); done <- err }()
	// Whether the Get is still reading or already watching, closing the
	// client ends it.
	cli.Close()
	select {
	case err := <-done:
		if !errors.Is(err, comm.ErrClosed) {
			t.Fatalf("get on a closed client = %v, want ErrClosed", err)
		}
	case <-ctx.Done():
		t.Fatal("get did not end when its client closed")
	}
	if err := s.Set(ctx, "k", nil); !errors.Is(err, comm.ErrClosed) {
		t.Fatalf("set on a closed client = %v, want ErrClosed", err)
	}
}

// Store and the in-memory store behave alike through comm.WithPrefix.
func TestStoreWithPrefix(t *testing.T) {
	e := clustertest.StartEtcd(t)
	ctx := clustertest.Ctx(t, 20*time.Second)
	cli := clustertest.NewClient(t, e)
	s := comm.WithPrefix(membership.NewStore(cli, "/ftcomm/j"), "rdzv/5")
	if err := s.Set(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, "/ftcomm/j/rdzv/5/k")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("raw = %v, %v", resp, err)
	}
}
