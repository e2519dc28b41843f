package main

import (
	"encoding/binary"
	"math"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// The workload is a toy training job whose state after every committed
// step is a pure function of the step and of which replicas took part in
// it, so the checker can replay the job's committed history without
// faults and compare. Gradients are multiples of 1/8 below 2: any sum of a
// few of them is exact in float32 whatever the order of the reduction, and
// the update is the same float32 arithmetic in the replicas and in the
// replay (one function).

// learningRate scales every update.
const learningRate = float32(0.01)

// maxReplicas bounds the replicas of a run: each owns one slot after the
// gradient, where it writes rank+1, so that the reduced slots say who took
// part in a step and in which order.
const maxReplicas = 8

// initState fills the state every replica starts from (step 0).
func initState(params []float32) {
	for i := range params {
		params[i] = 1 + float32(i%5)/4
	}
}

// gradient fills grad with replica k's gradient for step (the step being
// committed: the committed step plus one).
func gradient(grad []float32, step int64, k int) {
	s := int(step % 101)
	for i := range grad {
		grad[i] = float32((s*7+i*3+k*5)%16) / 8
	}
}

// apply is the optimizer step: params -= lr × sum/n.
func apply(params, sum []float32, n int) {
	d := float32(n)
	for i := range params {
		u := float32(sum[i] / d)
		params[i] = float32(params[i] - float32(learningRate*u))
	}
}

// stateHash is a 64-bit hash of the state (FNV-1a over its words).
func stateHash(params []float32) uint64 {
	const prime = 1099511628211
	h := uint64(14695981039346656037)
	var b [8]byte
	i := 0
	for ; i+1 < len(params); i += 2 {
		binary.LittleEndian.PutUint32(b[:4], math.Float32bits(params[i]))
		binary.LittleEndian.PutUint32(b[4:], math.Float32bits(params[i+1]))
		h ^= binary.LittleEndian.Uint64(b[:])
		h *= prime
	}
	if i < len(params) {
		h ^= uint64(math.Float32bits(params[i]))
		h *= prime
	}
	return h
}

// stepInput is what a committed step's update depends on: the replicas
// that took part (a bitmask of replica indexes).
type stepInput struct {
	Step int64
	Mask uint32
}

// replay computes the state after the given committed steps (in order,
// from step 1) and calls visit with each step's hash; visit returns false
// to stop.
func replay(params int, steps []stepInput, visit func(step int64, hash uint64) bool) []float32 {
	state := make([]float32, params)
	initState(state)
	sum := make([]float32, params)
	grad := make([]float32, params)
	for _, s := range steps {
		clear(sum)
		n := 0
		for k := range maxReplicas {
			if s.Mask&(1<<k) == 0 {
				continue
			}
			n++
			gradient(grad, s.Step, k)
			for i := range sum {
				sum[i] += grad[i]
			}
		}
		apply(state, sum, n)
		if visit != nil && !visit(s.Step, stateHash(state)) {
			break
		}
	}
	return state
}

// spin does n rounds of integer work on the CPU (the "cpu" compute) and
// returns a value that depends on all of them.
func spin(n int64) uint64 {
	x := uint64(n) | 1
	for range n {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
	}
	return x
}

// spinRate measures spin's rounds per second of CPU time (this thread's,
// so that other processes' load does not bias it), spinning for about d
// of CPU time.
func spinRate(d time.Duration) float64 {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cpu := func() time.Duration {
		var ru unix.Rusage
		unix.Getrusage(unix.RUSAGE_THREAD, &ru)
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	const chunk = 100_000
	var n int64
	var sink uint64
	start := cpu()
	for cpu()-start < d {
		sink += spin(chunk)
		n += chunk
	}
	if sink == 42 { // keep the work
		n++
	}
	return float64(n) / (cpu() - start).Seconds()
}
