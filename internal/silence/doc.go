// Package silence decides whether a peer from which nothing has arrived
// for a while has failed, on a host that may be starved of CPU.
//
// Silence alone is weak evidence on a loaded machine: on 2 saturated cores
// with the race detector, ranks of one process went 4–12 s without being
// scheduled, and separate processes over a second, though nothing had
// failed. So a Verdict asks for more than a timeout:
//
//   - A peer on this host (same kernel and pid namespace, and the same
//     network namespace where both ends tell theirs) is looked up in /proc
//     (Look). Stopped (SIGSTOP, a tracer) or gone: failed once silent for
//     the base timeout. A thread of it running or runnable: alive — a
//     starved process wants a CPU (Silence.RunnableLimit bounds how long
//     that holds, or nothing does). No thread runnable in any look for
//     another base timeout: neither running nor trying to (a cgroup
//     freezer, a hang in the kernel): failed.
//   - Any other peer is failed after a timeout that stretches with how
//     late this process's own timers run (Health, a Lifeguard-style local
//     health score: when this process is starved, its view of others is
//     unreliable) and with the longest gap recently seen between arrivals
//     from that peer (Arrivals), up to MaxStretch × the base timeout.
//
// It is shared by the gloo backend's peer monitor and membership's group
// links, and imports nothing of the module.
package silence
