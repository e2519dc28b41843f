// Package comm is the backend-agnostic core of ftcomm: the types of a
// collective (DType, ReduceOp, Tensor), the Backend interface a transport
// implements, the Store ranks rendezvous through, and Comm, the wrapper that
// gives every backend the same fault-tolerant behaviour.
//
// # Lifecycle
//
// Import a backend for its side effect and create one Comm per rank:
//
//	import _ "github.com/ftcomm/ftcomm/backends/gloo"
//
//	c, err := comm.New(ctx, "gloo", comm.Options{Rank: r, Size: n, Epoch: e, Store: store})
//	defer c.Close()
//	err = c.AllReduce(ctx, comm.Float32s(grads), comm.Avg)
//
// New blocks until the rank is connected to its peers (or ctx ends). A comm
// then runs ops until it breaks or is closed. It breaks when an op passes its
// deadline (ErrTimeout), when a peer fails (a *RankError wrapping
// ErrPeerFailed), when ranks disagree on an op (ErrMismatch), when the
// caller's ctx ends during an op, on Abort, and on Revoke (here or at a
// peer: ErrRevoked). A broken comm refuses further collectives with the
// error that broke it (Err reports it; Broken is closed the moment it
// breaks, also when a backend that implements FailureNotifier sees a
// peer fail while no op runs) and is repaired by Shrink (survivors
// form a smaller comm at a new epoch) or Grow (joiners are admitted), each
// of which returns a new Comm and closes the old; or it is simply closed.
// Split makes sub-communicators and leaves the parent as it was.
//
// # Caller duties
//
//   - Every rank issues the same collectives in the same order with
//     matching dtype, count, reduce op and root; backends detect a mismatch
//     and fail the op on every rank rather than hang or corrupt memory.
//   - A Tensor is a view of the caller's memory: keep it alive and untouched
//     until the op completes (for Async ops, until its Work is done — even
//     if Wait returned early because its ctx ended).
//   - All survivors pass Shrink the same exclude set and epoch (they come
//     from the membership quorum); excluded ranks do not call it.
//   - Close every Comm, including one that broke.
//
// # Deadlines
//
// Every op runs under a deadline: Options.Timeout from when it starts
// executing (default DefaultTimeout), tightened by the caller's ctx. At the
// deadline the backend is aborted, the op fails with ErrTimeout, the flight
// recorder is written to the log, and the comm is broken. If the caller's ctx
// is cancelled while the op runs, the comm is aborted too: a collective cannot
// be abandoned half-way without leaving peers in an unknown state. An op whose
// ctx ends while it is still queued fails without touching the comm. A
// backend that watches each op's ctx itself (a CtxWatcher, such as gloo)
// returns at once when it ends and Comm then breaks the comm; on any other
// backend Comm registers a callback on the ctx of each op (a few
// allocations per op whose ctx can be cancelled) that aborts it.
//
// # Concurrency
//
// A Comm is safe for concurrent use. Ops execute one at a time in issue
// order; concurrency between point-to-point ops is expressed with BatchP2P.
// A sync op issued on an idle comm runs on the caller's goroutine; queued ops
// run on the comm's one worker goroutine, which starts with the first queued
// op and exits in Close. Each comm also owns one timer for deadlines. On a
// backend whose ops run in order on a device queue (an Enqueuer, such as
// nccl), the worker starts queued ops without waiting for the ones before
// them, and a completer goroutine (also exiting in Close) waits for their
// completions in order, each under its own deadline: async ops then keep
// the device busy, as nccl-tests does, while ordering, deadlines, Revoke and
// Close behave as for any other backend. Abort,
// Revoke and Close may be called from any goroutine at any time, including
// while another goroutine is blocked in an op; each wakes it at once.
// Separate Comms share nothing (the backend registry is written only by
// backends' init functions).
//
// # Errors
//
// Errors wrap the sentinels ErrTimeout, ErrAborted, ErrRevoked,
// ErrPeerFailed, ErrMismatch, ErrInvalidArgument, ErrPeerRefused,
// ErrBackendUnavailable and ErrClosed, for errors.Is (ErrPeerClosed beside ErrPeerFailed marks a
// peer that closed its comm in an orderly way: alive, not crashed);
// failures tied to a rank are *RankError, for errors.As, and FailedRanks
// lists them. An op ended by Abort, Revoke,
// Close or its deadline matches that cause and also what its backend saw
// (a peer that had died meanwhile stays in FailedRanks). A Shrink or Grow
// keeps Options.Timeout too, on a broken comm as well; Close while one
// completes gets the new comm closed and ErrClosed.
//
// # Refused ops
//
// An op whose arguments are invalid here fails with ErrInvalidArgument
// and leaves the comm usable. A collective or point-to-point op refused so
// concerns the peers too, whose matching op would otherwise wait for its
// deadline and break their comm. On a backend that implements Refuser
// (gloo) the refused op therefore still takes its place in the issue
// order, sends nothing of its data, and tells the peers: each peer's
// matching op fails at once with a *RankError naming this rank and
// wrapping ErrPeerRefused and a *Refusal that says why, with no buffer of a
// collective written, and every comm stays usable — the next op runs as
// usual on every rank. Comm.Refuse does the same for an op that a layer
// above rejected before issuing it; Close lets a refusal that is being told
// finish (under its deadline) rather than abort it, which would abort the
// peers' comms. On other backends (nccl) nothing
// reaches the backend and the peers are not told; see their docs. Shrink,
// Grow and Split with invalid arguments fail here only.
//
// # Observability
//
// Options.Logger (zap) receives state changes and timeout dumps;
// Options.Metrics (see PrometheusMetrics) sees every finished op; the
// flight recorder keeps the last Options.FlightRecorder ops (FlightRecord,
// Dump) so a hang can be traced to the rank that stopped advancing.
package comm
