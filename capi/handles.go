package main

/*
#include <stdint.h>
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
)

// abiState is everything the ABI keeps between calls (see "State" in the
// package doc).
type abiState struct {
	mu   sync.RWMutex
	next uint64
	objs map[uint64]any

	errMu sync.Mutex
	errs  map[int]*errInfo // by OS thread id; cleared when read

	intrMu sync.Mutex
	intr   map[*canceler]struct{} // every live object with blocking calls

	sigOnce sync.Once
	sigErr  error
}

// abi is the one package-level value of the ABI.
var abi = &abiState{objs: map[uint64]any{}, errs: map[int]*errInfo{}, intr: map[*canceler]struct{}{}}

// put stores v and returns its new handle (never 0, never reused).
func (a *abiState) put(v any) uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.next++
	a.objs[a.next] = v
	return a.next
}

// lookup returns the object of handle h if it is a T.
func lookup[T any](h uint64) (T, error) {
	abi.mu.RLock()
	v, ok := abi.objs[h]
	abi.mu.RUnlock()
	t, isT := v.(T)
	if !ok || !isT {
		var zero T
		if !ok {
			return zero, fmt.Errorf("%w: %d (unknown or already freed)", ErrBadHandle, h)
		}
		return zero, fmt.Errorf("%w: %d is a %T, not a %T", ErrBadHandle, h, v, zero)
	}
	return t, nil
}

// take removes handle h if it names a T and returns its object: the
// first free wins, a second finds nothing.
func take[T any](h uint64) (T, error) {
	abi.mu.Lock()
	defer abi.mu.Unlock()
	var zero T
	v, ok := abi.objs[h]
	if !ok {
		return zero, fmt.Errorf("%w: %d (unknown or already freed)", ErrBadHandle, h)
	}
	t, isT := v.(T)
	if !isT {
		return zero, fmt.Errorf("%w: %d is a %T, not a %T", ErrBadHandle, h, v, zero)
	}
	delete(abi.objs, h)
	return t, nil
}

// live reports how many handles exist (tests).
func (a *abiState) live() int {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return len(a.objs)
}

func (a *abiState) setLastError(tid int, info *errInfo) {
	a.errMu.Lock()
	a.errs[tid] = info
	a.errMu.Unlock()
}

func (a *abiState) lastError(tid int) *errInfo {
	a.errMu.Lock()
	defer a.errMu.Unlock()
	return a.errs[tid]
}

func (a *abiState) clearLastError(tid int) {
	a.errMu.Lock()
	delete(a.errs, tid)
	a.errMu.Unlock()
}

// ---- interruptible calls ----

// canceler gives an object's blocking calls a ctx that ftcomm_interrupt
// cancels. A call brackets its wait with enter and leave; interrupt
// cancels the ctx of an object with a call inside and gives it a fresh one
// for later calls.
type canceler struct {
	blocked atomic.Int32
	cur     atomic.Pointer[cancelCtx]
}

type cancelCtx struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
}

func newCanceler() *canceler {
	c := &canceler{}
	c.renew()
	abi.intrMu.Lock()
	abi.intr[c] = struct{}{}
	abi.intrMu.Unlock()
	return c
}

func (c *canceler) renew() {
	ctx, cancel := context.WithCancelCause(context.Background())
	c.cur.Store(&cancelCtx{ctx, cancel})
}

// enter returns the ctx for a blocking call; leave must follow.
func (c *canceler) enter() context.Context {
	c.blocked.Add(1)
	return c.cur.Load().ctx
}

func (c *canceler) leave() { c.blocked.Add(-1) }

// ctx is the current ctx, for ops that outlive the call (async ops):
// an interrupt while one is blocked in a wait cancels it too.
func (c *canceler) ctx() context.Context { return c.cur.Load().ctx }

func (c *canceler) interrupt() bool {
	if c.blocked.Load() == 0 {
		return false
	}
	old := c.cur.Load()
	c.renew()
	old.cancel(ErrInterrupted)
	return true
}

// release unregisters c (the object was freed) and cancels what is left.
func (c *canceler) release() {
	abi.intrMu.Lock()
	delete(abi.intr, c)
	abi.intrMu.Unlock()
}

// interrupted makes an error of a call whose ctx an interrupt cancelled
// say so (ErrInterrupted), whatever the callee wrapped.
func interrupted(ctx context.Context, err error) error {
	if err != nil && !errors.Is(err, ErrInterrupted) && errors.Is(context.Cause(ctx), ErrInterrupted) {
		return fmt.Errorf("%w: %w", ErrInterrupted, err)
	}
	return err
}

// interruptAll cancels every blocking call in progress; it returns how
// many objects had one.
func interruptAll() int {
	abi.intrMu.Lock()
	cs := make([]*canceler, 0, len(abi.intr))
	for c := range abi.intr {
		cs = append(cs, c)
	}
	abi.intrMu.Unlock()
	n := 0
	for _, c := range cs {
		if c.interrupt() {
			n++
		}
	}
	return n
}

// ftcomm_interrupt ends every blocking call in progress in this process
// with FTCOMM_ERR_INTERRUPTED (the comms they were running on are
// aborted). It returns how many objects had a call to end.
//
//export ftcomm_interrupt
func ftcomm_interrupt() C.int32_t { return C.int32_t(interruptAll()) }

// ftcomm_blocked_calls is the number of blocking calls in progress in
// this process (tests wait on it to know a call is inside the library).
//
//export ftcomm_blocked_calls
func ftcomm_blocked_calls() C.int64_t {
	abi.intrMu.Lock()
	defer abi.intrMu.Unlock()
	n := 0
	for c := range abi.intr {
		n += int(c.blocked.Load())
	}
	return C.int64_t(n)
}

// ftcomm_live_handles is the number of handles not yet freed (leak checks).
//
//export ftcomm_live_handles
func ftcomm_live_handles() C.int64_t { return C.int64_t(abi.live()) }
