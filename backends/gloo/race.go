//go:build race

package gloo

import (
	"runtime"
	"unsafe"
)

// The race detector cannot see that a shared-memory ring orders what its
// two ends do: the positions are atomics in a mapping outside Go's memory,
// which each end maps at its own address (even within one process), and
// across processes the chain of events runs through the other process. So
// shared-memory links do what the runtime does for every file descriptor
// (internal/poll's ioSync): publishing a ring position is a release of one
// process-wide variable, and reading the other end's position an acquire
// of it. The detector then sees the edges TCP gives it through the
// socket, and no more. Other builds compile this away (norace.go).

var raceIO byte

func raceRelease() { runtime.RaceReleaseMerge(unsafe.Pointer(&raceIO)) }

func raceAcquire() { runtime.RaceAcquire(unsafe.Pointer(&raceIO)) }
