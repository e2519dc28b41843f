package httpstore_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm/httpstore"
	"github.com/ftcomm/ftcomm/internal/testutil"
)

func testCtx(t *testing.T) context.Context { return testutil.Ctx(t, 20*time.Second) }

func serve(t *testing.T, cfg httpstore.Config) (*httpstore.Server, *httpstore.Client) {
	t.Helper()
	srv, err := httpstore.Listen("127.0.0.1:0", cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	c := httpstore.NewClient(srv.Addr(), cfg)
	t.Cleanup(func() { c.Close() })
	return srv, c
}

// The client behaves as comm.Store says: Get waits for a later Set, Add
// counts, deletes remove.
func TestStoreSemantics(t *testing.T) {
	ctx := testCtx(t)
	_, c := serve(t, httpstore.Config{})
	got := make(chan []byte, 1)
	go func() {
		v, err := c.Get(ctx, "a/b")
		if err != nil {
			t.Error(err)
		}
		got <- v
	}()
	if err := c.Set(ctx, "a/b", []byte("hello")); err != nil {
		t.Fatal(err)
	}
	if v := <-got; string(v) != "hello" {
		t.Fatalf("get = %q", v)
	}
	for i, want := range []int64{3, 5} {
		n, err := c.Add(ctx, "n", []int64{3, 2}[i])
		if err != nil || n != want {
			t.Fatalf("add = %d, %v; want %d", n, err, want)
		}
	}
	if err := c.Set(ctx, "a/c", nil); err != nil {
		t.Fatal(err)
	}
	if err := c.DeletePrefix(ctx, "a/"); err != nil {
		t.Fatal(err)
	}
	if err := c.Delete(ctx, "n"); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := c.Get(short, "a/b"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("get of a deleted key: %v, want a deadline", err)
	}
}

// Many ranks rendezvous through one server, each waiting for every other.
func TestConcurrentRendezvous(t *testing.T) {
	ctx := testCtx(t)
	srv, _ := serve(t, httpstore.Config{})
	const n = 8
	var wg sync.WaitGroup
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := httpstore.NewClient(srv.Addr(), httpstore.Config{})
			defer c.Close()
			if err := c.Set(ctx, "addr/"+string(rune('a'+r)), []byte{byte(r)}); err != nil {
				t.Error(err)
				return
			}
			for p := 0; p < n; p++ {
				v, err := c.Get(ctx, "addr/"+string(rune('a'+p)))
				if err != nil || len(v) != 1 || int(v[0]) != p {
					t.Errorf("rank %d get %d: %v %v", r, p, v, err)
				}
			}
		}()
	}
	wg.Wait()
}

// A client that starts before its server retries until the server is up.
func TestClientWaitsForServer(t *testing.T) {
	ctx := testCtx(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	c := httpstore.NewClient(addr, httpstore.Config{})
	defer c.Close()
	got := make(chan error, 1)
	go func() {
		v, err := c.Get(ctx, "k")
		if err == nil && string(v) != "v" {
			err = errors.New("wrong value " + string(v))
		}
		got <- err
	}()
	srv, err := httpstore.Listen(addr, httpstore.Config{})
	if err != nil {
		t.Skipf("port %s was taken meanwhile: %v", addr, err)
	}
	defer srv.Close()
	if err := srv.Store().Set(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
}

// Close wakes a waiting Get with comm.ErrClosed; a wrong token is refused.
func TestCloseAndToken(t *testing.T) {
	ctx := testCtx(t)
	srv, c := serve(t, httpstore.Config{Token: "s3cret"})
	bad := httpstore.NewClient(srv.Addr(), httpstore.Config{Token: "other"})
	defer bad.Close()
	if err := bad.Set(ctx, "k", nil); err == nil || !strings.Contains(err.Error(), "Unauthorized") {
		t.Fatalf("wrong token: %v", err)
	}
	got := make(chan error, 1)
	short, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	go func() {
		_, err := c.Get(short, "never")
		got <- err
	}()
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	if err := srv.Close(); err != nil {
		t.Fatal("second close:", err)
	}
	// Parked on the server, the Get gets ErrClosed; not yet sent, it
	// finds no server: an error either way, never a hang.
	if err := <-got; err == nil {
		t.Fatal("get returned nil after close")
	}
	if _, err := c.Get(short, "k"); err == nil {
		t.Fatal("get after close succeeded")
	}
}
