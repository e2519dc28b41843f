package ncclsim

import (
	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
)

// Faults a test injects: dead and restarted processes, stalled copies
// and aborts, asynchronous errors.

// StallCopies holds (true) or releases (false) every copy of page-locked
// memory on its stream, as a busy copy engine would.
func (w *Simulation) StallCopies(stall bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stallCopies = stall
}

// StallAborts holds (true) or releases (false) every ncclCommAbort of a
// comm on GPU dev in the call: the comm's GPU work goes on until the call
// returns. (A real abort took 0.5 s after a peer's death on 2×H200; its
// kernels are certain to have stopped only when it returns.)
func (w *Simulation) StallAborts(dev int, stall bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stallAborts[dev] = stall
	w.cond.Broadcast()
}

// Kill makes the process on GPU dev die, as by SIGKILL: its streams never
// advance again (its peers' collectives never complete), and its calls
// that wait for peers (shrink, split) never return. What it left behind
// may still be used by the test (closing its comms, say) without a fault.
func (w *Simulation) Kill(dev int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.dead[dev] = true
}

// KillDuring makes the process on GPU dev die as it calls name (e.g.
// "ncclCommShrink", "ncclCommSplit"): the call never arrives at its
// rendezvous.
func (w *Simulation) KillDuring(name string, dev int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.killOn[name] = dev + 1
}

// Killed reports whether the process on GPU dev is dead.
func (w *Simulation) Killed(dev int) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.dead[dev]
}

// Restart starts a new process on GPU dev after Kill: the dead process's
// GPU work is gone (its comms' work is terminated and everything queued
// on its streams is dropped, as the driver does when a process exits), and
// the GPU serves new comms, copies and streams. The dead process's objects
// (comms, streams, memory) stay valid for the test to close or free.
func (w *Simulation) Restart(dev int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range w.comms {
		if c.dev == dev {
			w.terminate(c)
			c.pending = nil
		}
	}
	for _, st := range w.streams {
		if st.dev != dev {
			continue
		}
		for _, it := range st.items {
			if e, ok := it.(*simEventItem); ok {
				e.step(w)
			}
		}
		st.items = nil
	}
	delete(w.dead, dev)
	for name, d := range w.killOn {
		if d == dev+1 {
			delete(w.killOn, name)
		}
	}
}

// InjectAsyncError makes every live comm on GPU dev report the
// ncclResult_t code (e.g. 6, ncclRemoteError) from ncclCommGetAsyncError.
func (w *Simulation) InjectAsyncError(dev int, code int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, c := range w.comms {
		if c.dev == dev {
			c.state, c.pending = libapi.Result(code), nil
		}
	}
}

// dies reports whether a call by c is made by a dead process (dying now
// if KillDuring says so); such a call stays in progress forever.
func (w *Simulation) dies(c *simComm, name string) bool {
	if w.killOn[name] == c.dev+1 {
		w.dead[c.dev] = true
	}
	if !w.dead[c.dev] {
		return false
	}
	c.pending = &simPending{ready: func() bool { return false }}
	return true
}
