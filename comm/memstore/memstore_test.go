package memstore_test

import (
	"context"
	"errors"
	"sort"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

func TestGetWaitsForSet(t *testing.T) {
	s := memstore.New()
	ctx := context.Background()
	got := make(chan []byte)
	go func() {
		v, err := s.Get(ctx, "addr/1")
		if err != nil {
			t.Error(err)
		}
		got <- v
	}()
	if err := s.Set(ctx, "addr/1", []byte("10.0.0.1:7")); err != nil {
		t.Fatal(err)
	}
	if v := <-got; string(v) != "10.0.0.1:7" {
		t.Fatalf("got %q", v)
	}
}

func TestGetHonoursCtxAndClose(t *testing.T) {
	s := memstore.New()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := s.Get(ctx, "never"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
	done := make(chan error)
	go func() {
		_, err := s.Get(context.Background(), "never")
		done <- err
	}()
	s.Close()
	if err := <-done; !errors.Is(err, comm.ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
	if err := s.Set(context.Background(), "k", nil); !errors.Is(err, comm.ErrClosed) {
		t.Fatal(err)
	}
	s.Close() // twice is fine
}

func TestAddDeleteAndPrefix(t *testing.T) {
	s := memstore.New()
	ctx := context.Background()
	p := comm.WithPrefix(comm.WithPrefix(s, "job"), "epoch/3/")
	for i := int64(1); i <= 3; i++ {
		n, err := p.Add(ctx, "count", 1)
		if err != nil || n != i {
			t.Fatalf("Add = %d, %v", n, err)
		}
	}
	v, err := s.Get(ctx, "job/epoch/3/count")
	if err != nil || string(v) != "3" {
		t.Fatalf("raw value %q, %v", v, err)
	}
	if err := p.Set(ctx, "x", []byte("not a number")); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Add(ctx, "x", 1); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("Add to text: %v", err)
	}
	_ = s.Set(ctx, "job/other", []byte("keep"))
	if err := p.DeletePrefix(ctx, ""); err != nil {
		t.Fatal(err)
	}
	keys := s.Keys("")
	sort.Strings(keys)
	if len(keys) != 1 || keys[0] != "job/other" {
		t.Fatalf("keys after DeletePrefix: %v", keys)
	}
	if err := s.Delete(ctx, "job/other"); err != nil || len(s.Keys("")) != 0 {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "missing"); err != nil {
		t.Fatal(err)
	}
}

// The value handed to Set is copied: changing the caller's slice later
// does not change the store.
func TestValuesAreCopied(t *testing.T) {
	s := memstore.New()
	b := []byte("abc")
	_ = s.Set(context.Background(), "k", b)
	b[0] = 'X'
	v, _ := s.Get(context.Background(), "k")
	v[1] = 'Y'
	w, _ := s.Get(context.Background(), "k")
	if string(w) != "abc" {
		t.Fatalf("store value changed to %q", w)
	}
}
