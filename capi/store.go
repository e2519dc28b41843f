package main

/*
#include <stdint.h>
*/
import "C"

import (
	"context"
	"time"
	"unsafe"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/httpstore"
)

// storeObj is what a store handle names: a client of an httpstore, and
// the server too when this process hosts it.
type storeObj struct {
	store  comm.Store
	client *httpstore.Client
	server *httpstore.Server
	addr   string
	can    *canceler
}

// ftcomm_store_listen hosts a store on addr ("host:port"; port 0 picks
// one; ftcomm_store_addr says which) and returns a handle to it; token,
// if not empty, must be presented by clients.
//
//export ftcomm_store_listen
func ftcomm_store_listen(addr, token *C.char, out *C.uint64_t) C.int32_t {
	return guard(func() error {
		srv, err := httpstore.Listen(goString(addr), httpstore.Config{Token: goString(token)})
		if err != nil {
			return err
		}
		*out = C.uint64_t(abi.put(&storeObj{store: srv.Store(), server: srv, addr: srv.Addr(), can: newCanceler()}))
		return nil
	})
}

// ftcomm_store_connect returns a handle to the store hosted at addr. It
// does not connect yet: each request retries until the server is up or
// its timeout ends.
//
//export ftcomm_store_connect
func ftcomm_store_connect(addr, token *C.char, out *C.uint64_t) C.int32_t {
	return guard(func() error {
		a := goString(addr)
		c := httpstore.NewClient(a, httpstore.Config{Token: goString(token)})
		*out = C.uint64_t(abi.put(&storeObj{store: c, client: c, addr: a, can: newCanceler()}))
		return nil
	})
}

// ftcomm_store_addr copies the store's address ("host:port") into buf.
//
//export ftcomm_store_addr
func ftcomm_store_addr(h C.uint64_t, buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t) C.int32_t {
	return guard(func() error {
		s, err := lookup[*storeObj](uint64(h))
		if err != nil {
			return err
		}
		return putBytes([]byte(s.addr), buf, capacity, n)
	})
}

func (s *storeObj) call(timeoutNs C.int64_t, f func(ctx context.Context) error) error {
	ctx := s.can.enter()
	defer s.can.leave()
	if timeoutNs > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(timeoutNs))
		defer cancel()
	}
	return interrupted(ctx, f(ctx))
}

// ftcomm_store_set stores n bytes at val under key.
//
//export ftcomm_store_set
func ftcomm_store_set(h C.uint64_t, key *C.char, val unsafe.Pointer, n C.int64_t, timeoutNs C.int64_t) C.int32_t {
	return guard(func() error {
		s, err := lookup[*storeObj](uint64(h))
		if err != nil {
			return err
		}
		v := C.GoBytes(val, C.int(n))
		return s.call(timeoutNs, func(ctx context.Context) error { return s.store.Set(ctx, goString(key), v) })
	})
}

// ftcomm_store_get waits until key exists (up to timeout_ns; interruptible)
// and copies its value into buf, storing its length in *n; with a buffer
// too small it returns FTCOMM_ERR_SHORT_BUFFER and *n (call again).
//
//export ftcomm_store_get
func ftcomm_store_get(h C.uint64_t, key *C.char, buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t, timeoutNs C.int64_t) C.int32_t {
	return guard(func() error {
		s, err := lookup[*storeObj](uint64(h))
		if err != nil {
			return err
		}
		var v []byte
		if err := s.call(timeoutNs, func(ctx context.Context) (err error) {
			v, err = s.store.Get(ctx, goString(key))
			return err
		}); err != nil {
			return err
		}
		return putBytes(v, buf, capacity, n)
	})
}

// ftcomm_store_add adds delta to the integer under key and stores the
// result in *out.
//
//export ftcomm_store_add
func ftcomm_store_add(h C.uint64_t, key *C.char, delta C.int64_t, out *C.int64_t, timeoutNs C.int64_t) C.int32_t {
	return guard(func() error {
		s, err := lookup[*storeObj](uint64(h))
		if err != nil {
			return err
		}
		return s.call(timeoutNs, func(ctx context.Context) error {
			v, err := s.store.Add(ctx, goString(key), int64(delta))
			*out = C.int64_t(v)
			return err
		})
	})
}

// ftcomm_store_free closes the store (a hosted one stops serving) and
// frees the handle.
//
//export ftcomm_store_free
func ftcomm_store_free(h C.uint64_t) C.int32_t {
	return guard(func() error {
		s, err := take[*storeObj](uint64(h))
		if err != nil {
			return err
		}
		s.can.release()
		if s.server != nil {
			return s.server.Close()
		}
		return s.client.Close()
	})
}
