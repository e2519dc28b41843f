package gloo

// The liveness check decides whether a peer from which nothing (data or
// heartbeat) has arrived for a while, while an op is pending, has failed.
// Silence alone is weak evidence on a loaded machine, so the monitor
// (Backend.monitor) asks package internal/silence for a verdict:
//
//   - A peer on this host (same kernel and pid namespace, learnt in the
//     handshake) is looked up in /proc once it has been silent for
//     Config.PeerTimeout. Stopped (SIGSTOP, a tracer) or gone: failed. A
//     thread of it running or runnable: alive — a starved process wants a
//     CPU, so it is never declared failed for its silence (the op deadline
//     bounds that case; a crash resets its connections at once anyway). No
//     thread runnable in any look for another PeerTimeout: it is neither
//     running nor trying to (a cgroup freezer, a hang in the kernel), and
//     it is declared failed.
//   - Any other peer is declared failed after a timeout that stretches with
//     how late this process's own monitor ticks run (silence.Health: when
//     this process is starved, its view of others is unreliable) and with
//     the longest gap recently seen between arrivals from that peer, up to
//     silence.MaxStretch × Config.PeerTimeout.
