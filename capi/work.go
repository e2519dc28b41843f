package main

/*
#include <stdint.h>
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl"
	"github.com/ftcomm/ftcomm/comm"
)

// workObj is what a work handle names: an async op, the ctx it runs
// under (cancelled by ftcomm_work_cancel, or by an interrupt while a
// wait on it blocks) and the canceler of its comm.
type workObj struct {
	w      *comm.Work
	ctx    context.Context
	cancel context.CancelCauseFunc
	stop   context.CancelFunc // of the op's timeout, if any
	can    *canceler
}

func newWork(can *canceler, a *opArgs) *workObj {
	ctx, cancel := context.WithCancelCause(can.ctx())
	wk := &workObj{ctx: ctx, cancel: cancel, can: can}
	if a.timeout > 0 {
		wk.ctx, wk.stop = context.WithTimeout(wk.ctx, a.timeout)
	}
	if a.device {
		wk.ctx = nccl.WithStreamOrder(wk.ctx, nccl.StreamOrder{Stream: a.stream, Async: true})
	}
	return wk
}

// release frees the op's ctx once the op is done (at once if it is).
func (wk *workObj) release() {
	done := func() {
		if wk.stop != nil {
			wk.stop()
		}
		wk.cancel(context.Canceled)
	}
	if wk.w == nil {
		done()
		return
	}
	select {
	case <-wk.w.Done():
		done()
	default:
		go func() { // exits when the op completes (bounded by its deadline)
			<-wk.w.Done()
			done()
		}()
	}
}

// ftcomm_work_wait waits for the op: up to timeout_ns (< 0: until it is
// done), interruptibly. It returns FTCOMM_OK or the op's error once the
// op is done, FTCOMM_PENDING if the time ran out first, and
// FTCOMM_ERR_INTERRUPTED if ftcomm_interrupt came first (the op is then
// cancelled, which aborts its comm, and waited for).
//
//export ftcomm_work_wait
func ftcomm_work_wait(h C.uint64_t, timeoutNs C.int64_t) C.int32_t {
	var pending bool
	st := guard(func() error {
		wk, err := lookup[*workObj](uint64(h))
		if err != nil {
			return err
		}
		select {
		case <-wk.w.Done():
			return wk.w.Err()
		default:
		}
		if timeoutNs == 0 {
			pending = true
			return nil
		}
		ictx := wk.can.enter()
		defer wk.can.leave()
		var timer <-chan time.Time
		if timeoutNs > 0 {
			t := time.NewTimer(time.Duration(timeoutNs))
			defer t.Stop()
			timer = t.C
		}
		select {
		case <-wk.w.Done():
			return wk.w.Err()
		case <-timer:
			pending = true
			return nil
		case <-ictx.Done():
			wk.cancel(ErrInterrupted)
			<-wk.w.Done() // prompt: the cancel aborts the op
			err := wk.w.Err()
			if err == nil || !errors.Is(err, ErrInterrupted) {
				err = fmt.Errorf("%w (op: %v)", ErrInterrupted, err)
			}
			return err
		}
	})
	if st == statusOK && pending {
		return statusPending
	}
	return st
}

// ftcomm_work_test stores 1 in *done if the op has completed (successfully
// or not: ftcomm_work_wait then returns its result at once), else 0.
//
//export ftcomm_work_test
func ftcomm_work_test(h C.uint64_t, done *C.int32_t) C.int32_t {
	return guard(func() error {
		wk, err := lookup[*workObj](uint64(h))
		if err != nil {
			return err
		}
		select {
		case <-wk.w.Done():
			*done = 1
		default:
			*done = 0
		}
		return nil
	})
}

// ftcomm_work_cancel cancels the op (it fails, and its comm is aborted if
// it had started: a collective cannot be left half-way). Waiting for it
// then returns promptly.
//
//export ftcomm_work_cancel
func ftcomm_work_cancel(h C.uint64_t) C.int32_t {
	return guard(func() error {
		wk, err := lookup[*workObj](uint64(h))
		if err != nil {
			return err
		}
		wk.cancel(fmt.Errorf("%w: cancelled by the caller", ErrInterrupted))
		return nil
	})
}

// ftcomm_work_free frees the handle; the op itself runs on to completion.
//
//export ftcomm_work_free
func ftcomm_work_free(h C.uint64_t) C.int32_t {
	return guard(func() error {
		wk, err := take[*workObj](uint64(h))
		if err != nil {
			return err
		}
		wk.release()
		return nil
	})
}
