//go:build ftcomm_diag

package main

/*
#include <stdint.h>
*/
import "C"

import (
	"os"
	"runtime/pprof"
	"sync/atomic"
	"time"
)

// A diagnostic build (-tags ftcomm_diag, never shipped) times the ops
// inside the library, so that a caller can tell its own cost (ctypes, the
// cgo entry) from the library's, and profiles the library's CPU.

var diagOps struct {
	n, nanos atomic.Int64
}

const diagOn = true

func diagEnd(t0 time.Time) {
	diagOps.n.Add(1)
	diagOps.nanos.Add(int64(time.Since(t0)))
}

// ftcomm_diag_ops stores the ops timed so far and the nanoseconds spent
// inside them (from the entry's first statement to its return).
//
//export ftcomm_diag_ops
func ftcomm_diag_ops(n, nanos *C.int64_t) {
	*n, *nanos = C.int64_t(diagOps.n.Load()), C.int64_t(diagOps.nanos.Load())
}

var diagProfile *os.File

// ftcomm_diag_profile starts a CPU profile of the library into path, or
// with an empty path stops the one running.
//
//export ftcomm_diag_profile
func ftcomm_diag_profile(path *C.char) C.int32_t {
	return guard(func() error {
		p := goString(path)
		if p == "" {
			pprof.StopCPUProfile()
			if diagProfile != nil {
				diagProfile.Close()
				diagProfile = nil
			}
			return nil
		}
		f, err := os.Create(p)
		if err != nil {
			return err
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			f.Close()
			return err
		}
		diagProfile = f
		return nil
	})
}
