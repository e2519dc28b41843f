// Package gloo is a pure-Go collectives backend for CPU memory over TCP,
// after Gloo's design (one connection per peer pair, a tagged pair-level
// send/receive, collectives as plain functions over it), built so that no
// operation can hang: peer deaths, aborts, revocations and ranks that
// disagree all fail every pending op promptly, and the survivors can shrink
// the communicator over the connections they already have.
//
// # Use
//
// Import the package for its side effect and create communicators through
// comm.New:
//
//	import _ "github.com/ftcomm/ftcomm/backends/gloo"
//
//	c, err := comm.New(ctx, "gloo", comm.Options{
//		Rank: r, Size: n, Epoch: e, JobID: "llama", Secret: secret,
//		Store: store, Prefix: "jobs/llama/ft0",
//		BackendConfig: gloo.DefaultConfig(), // or nil
//	})
//
// Config (comm.Options.BackendConfig, a *Config) sets the listen address,
// socket buffers, timeouts, the heartbeat, the pipelining segment and the
// algorithm (Algorithm forces one family for tests and benchmarks;
// SmallThreshold and OneShotBytes switch between them under
// AlgorithmAuto), and the shared-memory rings and lanes. All ranks of a
// comm must use the same Algorithm, SmallThreshold and OneShotBytes matter
// only through the choices they make (which must agree), and everything
// else may differ per rank.
//
// # Lifecycle
//
// New (through comm.New) listens on Config.ListenAddr, publishes the
// address under Prefix + "/epoch/<E>/addr/<rank>" in the Store, and connects
// to every peer: the higher rank dials the lower (cenkalti/backoff retries,
// bounded by ctx and Config.ConnectTimeout), so each pair has exactly one
// connection. It returns once every connection is authenticated.
//
// Shrink, Grow and Split return a new Backend; the Comm wrapper then closes
// the old one (Shrink, Grow) or keeps it (Split). Shrink and Grow reuse the
// connections to surviving peers: each end sends a resync frame for the new
// epoch after whatever the failed op left unfinished, and discards the
// other's frames until it sees that marker, so no stale data reaches the new
// epoch. Connections that are gone are replaced through the Store: the
// higher rank dials again, and the lower, if it has yet to see its end of
// the old one break, has it retry until then. Joiners
// of a Grow call comm.New with Rank ≥ the old size, the new Size and the same
// Prefix and Epoch, and dial in. Split exchanges colors and keys with an
// all-gather and connects each new comm afresh under its own prefix. The
// comms derived from one New share its listener (reference counted), so a
// process listens on one port however often it reconfigures.
//
// Close fails a pending op, sends a goodbye on the connections the backend
// still owns (not those a newer comm took over), closes them, waits for its
// goroutines and releases the listener when the last comm sharing it is
// closed. Close is safe to call twice. A peer that receives the goodbye
// has by then received everything sent before it, so a rank may close
// right after its last collective: a slower peer still finishing that
// collective completes it, and only its next op (or a receive from, or a
// send to, the rank that left) fails, with comm.ErrPeerFailed naming it.
// An op that still expected data from the closing rank fails at once.
//
// # Wire protocol
//
// Handshake (dialer → listener): hello (magic, protocol version, job id,
// comm prefix, epoch, from and to rank, size, client nonce); the listener
// checks job, comm, epoch and ranks against the comms it is forming and
// either refuses (with a reason, logged at warn level) or sends a challenge:
// a server nonce and HMAC-SHA256(secret, hello ‖ server nonce); the dialer
// verifies it and answers with its own HMAC over the same transcript. Both
// sides prove the secret over nonces the other chose, so a recorded
// handshake cannot be replayed. Strangers, other jobs, wrong secrets, stale
// or future epochs and bad ranks are refused without disturbing the comm.
//
// Frames: a 40-byte header (magic, type, the op's descriptor: op, dtype,
// reduce op, algorithm, root, count and a counts-vector hash; payload length,
// step tag and sequence number), the payload, and a trailer byte that marks
// the frame complete or abandoned (a write interrupted by an abort is
// finished with filler and an "abandoned" trailer, so the reader can skip it
// and the stream stays in sync). Types: op data, heartbeat, notice (why a
// comm failed: abort — flagged when it was a timeout —, revoke, peer
// failed, mismatch; origin and subject ranks, cause text), resync (start of
// an epoch on a reused connection: the new epoch's size, rank and
// membership hash, the epoch left, and the ranks a Shrink excluded — up to
// 1015 listed), bye, refused (an op this rank refused, or gave up because a
// peer refused it: see Refused ops).
//
// Every collective first agrees on its descriptor: a dissemination round
// (⌈log₂ n⌉ steps of header-only frames, folded into the data exchange of
// the recursive-doubling all-reduce) that completes only if every rank
// issued the same op, dtype, count, reduce op, root and algorithm. No user
// buffer is written before it completes; every later frame is checked
// against the receive it would fill before a byte of it is written.
//
// # Shared memory between ranks on one host
//
// A link between two processes on the same host (the handshake tells: same
// kernel boot id and pid namespace) carries its op data through shared
// memory when both ends set Config.SharedMemory (the default; the
// environment variable FTCOMM_GLOO_SHM=0 turns it off for a process). After
// the handshake the listener creates an anonymous, sealed memory file
// (memfd: nothing is left in /dev/shm after a SIGKILL), sends its fd number
// and a random token over the authenticated connection, and the dialer maps
// it through /proc/<pid>/fd after checking seals, size and token; if any
// step fails the link uses TCP (logged at info). The segment holds one
// single-producer single-consumer byte ring per direction
// (Config.SharedMemoryRing bytes each): frames are written as on TCP but
// without the trailer, each side keeps its own position and checks the
// other's before using it (a corrupt position drops the link as a
// malformed frame would). No goroutine reads the rings on its own: the op
// goroutine writes its frames and, whenever it waits, takes what its rx
// rings hold and copies or reduces it straight into the posted receives
// (with the same checks as the socket reader of a TCP link), so a small op
// costs no handoff between goroutines. A waiter polls for up to 100 µs
// (yielding each round, to other processes too when the host runs more
// ranks than it has CPUs), then marks itself asleep in the segment and
// parks; the other side, after publishing a ring position, sees the mark
// and sends a wake frame over TCP. The TCP connection stays for everything
// else — handshake, heartbeats, notices, resync, bye, wake — and for
// liveness: a peer that dies resets it, which fails the link at once as on
// TCP. A write interrupted by an abort simply stops; the resync frame of
// the next epoch carries the writer's ring positions, and the consumer
// drops everything before them.
//
// Lanes: a segment may hold further ring pairs (512 KiB each way), as many
// as Config.SharedMemoryLanes allows (0: the host's CPUs divided by the
// comm's ranks, at most 8). A large all-reduce whose two ring neighbours
// are shared-memory links is cut into as many parts as every rank can
// take (agreed on in the descriptor agreement; one lane per MiB at most):
// the op goroutine moves part 0 as usual, and a lane helper goroutine per
// further part runs its own pipelined ring through its lane, polling and
// parking as the op goroutine does, so the copies and reductions of one
// rank run on several cores. A failure stops every helper before the op
// returns. The same agreement says whether every rank has shared memory to
// both ring neighbours; a ring on one lane then pipelines in the larger
// Config.SharedMemorySegment (4 MiB) instead of SegmentSize, alike at
// every rank. Float32 and float64 sums reduce on AVX2 where the CPU has it
// (comm/reduce).
//
// # Algorithms
//
// All-reduce: one-shot for small messages (Config.OneShotBytes: every rank
// sends its vector to every other and reduces all n in rank order, reading
// shared-memory rings in place), recursive doubling (non-power-of-two sizes
// fold the extra ranks in and out) for other small ones; for large ones a
// pipelined ring run
// as a wavefront over pieces, whose receiving side reduces segments into
// the destination as they arrive while the next is on the wire.
// Reduce-scatter and all-gather: ring (reduce-scatter through recursive
// doubling when small). Broadcast: binomial tree or pipelined chain. Reduce:
// binomial tree or pipelined chain (non-root buffers are never written).
// Gather, scatter: direct. All-to-all(v): pairwise, every receive posted
// first. fp16 and bf16 reduce in float32 (comm/reduce). Avg is Sum divided
// by Size once. Steady-state ops allocate nothing: scratch is kept per
// backend, receive queues and frame buffers per connection.
//
// # Performance notes
//
// Over shared memory the work is one copy into the ring and one copy (or
// reduction) out of it, on as many cores as there are lanes; a small op
// costs no handoff between goroutines or processes beyond the cache lines
// of the ring (one-shot all-reduce: one step; figures against Open MPI's
// shared-memory transport, libgloo and PyTorch gloo, with the host's
// memcpy bandwidth as the ceiling: README, bench/compare-cpu.sh). Ops over
// shared memory do not arm a context.AfterFunc (they poll and select on
// the ctx, and look at it before each frame); one that writes to a socket
// does, once. The backend is a comm.CtxWatcher, so the Comm arms none
// either: a cancelable ctx costs an op nothing. Over TCP loopback it is the kernel's
// socket copies (about 40% of CPU in profiles), the reduction (about 10%,
// comm/reduce's unrolled kernels) and thread wakeups; there the backend
// runs at the loopback ceiling, level with libgloo's newer ring, and shared
// memory is what takes it past (figures, against libgloo in the same run:
// README, bench/compare-gloo.sh). With 2 ranks the single connection of
// the pair carries both directions at once, and Linux serialises a
// socket's send and receive copies: a raw stream over one shared
// connection moves 25–35% less than over one connection per direction,
// and so does the 2-rank ring over TCP. (With 3 or more ranks each ring
// connection carries one direction.) Kernel autotuning of socket buffers
// (Config.SocketBuffer 0) works better than a fixed size here; see Config.
// BenchmarkTCPRing is the raw yardstick.
//
// # Failure semantics
//
// A peer whose connection resets or closes fails the pending op on every
// survivor at once with a *comm.RankError naming it and wrapping
// comm.ErrPeerFailed (survivors also tell each other). That holds too for a
// survivor that hears first from a faster one which has already shrunk the
// dead rank away: the resync frames of a Shrink carry the ranks it
// excluded, and a rank still in (or next running) an op of the old comm
// fails it with a *comm.RankError per excluded rank (errors.Join if
// several), wrapping comm.ErrPeerFailed ("rank 0 shrank the comm to epoch
// 1 without it"). So does a rank whose peers shrink a live rank away (the
// quorum dropped it) while it waits on it: comm.FailedRanks names whom to
// leave out. Only a peer that grows first leaves a bare comm.ErrAborted
// ("rank p moved on to epoch e"). Every connection
// idle for Config.HeartbeatInterval sends a heartbeat, so a live peer that
// merely starts its op late is not silent — that case is the deadline's
// (the Comm wrapper aborts the backend when an op's deadline passes). While
// an op is pending, a peer from which nothing has arrived for
// Config.PeerTimeout is looked at more closely before it is declared failed
// the same way, because on a loaded machine a live process can go seconds
// without being scheduled: a peer on the same host (the handshake tells:
// same kernel boot and pid namespace) is declared failed only if /proc says
// its process is stopped (SIGSTOP), gone, or has had no runnable thread for
// another PeerTimeout (frozen by a cgroup, hung in the kernel); one with a
// runnable thread is starved and never declared failed for its silence.
// For a peer elsewhere the timeout stretches with this process's own
// scheduling delays and the peer's recent gaps, up to 10 × PeerTimeout.
//
// Abort wakes every waiter at once with comm.ErrAborted and tells the peers,
// whose pending ops fail too. An abort for a timeout (an op past the
// Comm's deadline or its ctx's) is flagged as one: the peers' errors then
// match comm.ErrTimeout as well as comm.ErrAborted and say which rank timed
// out ("rank 1 timed out: …"), so every rank waiting on a rank that never
// posted the op sees a timeout, whether its own deadline or the notice of
// a faster one came first. Revoke does the same with comm.ErrRevoked, and
// every rank forwards the revocation. Ranks that disagree on an op get
// comm.ErrMismatch (a *comm.RankError naming a disagreeing rank) on every
// rank, with no buffer written. A malformed frame drops that connection
// with an error naming the peer; nothing panics. After any failure the
// backend runs no further collectives: only Shrink, Grow, Split, Abort and
// Close.
//
// # Refused ops
//
// A refused op is no failure: the Backend is a comm.Refuser, so an op that
// one rank refuses (its arguments are invalid there: comm.Comm validates
// every op, and Comm.Refuse serves layers with checks of their own) still
// takes its place in that rank's sequence, and the peers' matching op
// fails within a round trip with a *comm.RankError naming the refusing
// rank and wrapping comm.ErrPeerRefused, with a *comm.Refusal giving the
// refusing rank's reason ("rank 1 refused its broadcast: root 5 outside
// [0, 2)"). Nothing
// breaks and nothing is aborted: every rank's next op runs as usual. The
// refusing rank sends a refused frame on its links, on the data path (the
// socket or the shared-memory ring), in the op's place among its op frames.
//
//   - Collectives (all of them, Barrier included): every rank fails its op
//     of that number — at once if it runs, at its start if it has not
//     started yet — and before it sends anything of a later op it passes a
//     refused frame of its own to every peer, so on each link one such
//     frame separates the refused op's frames from the next op's. Frames of
//     the refused op are dropped unread; no user buffer is written (no
//     rank's op can complete without the refusing rank). A rank reads a
//     shared-memory ring only while it runs an op: one that is idle learns
//     of a refusal when its next op starts waiting.
//   - Point-to-point: messages are numbered per pair and direction. A
//     refused send consumes its number, and the peer's receive of it
//     (running or still to come) fails, its buffer unwritten. A refused
//     receive consumes its number and drops the message, and the peer's
//     send of it fails unless it has already handed all its data to the
//     transport (a send completes then, as always; the data is dropped).
//     In a batch only the refused sends and receives fail: the batch's
//     other entries complete, then the batch returns the refusal; a refused
//     batch refuses all its entries. A send refused for its peer (outside
//     the comm, or this rank) names no rank to tell: every peer is told,
//     and each one's next receive from the refusing rank of the number it
//     would have had fails, giving the number back (the rank the send was
//     meant for fails whenever it gets to that receive; another rank fails
//     its next receive from that rank once, and a retry receives the next
//     message). A receive refused for its peer tells no one: a send meant
//     for it waits for a receive (its data, once sent, is what the next
//     receive from that sender gets), bounded by the op's deadline.
//
// # Concurrency
//
// The comm.Backend contract holds: one op at a time (from any goroutine);
// Abort, Revoke and Close may be called from any goroutine at any time.
// Goroutines: per node (listener) an accept loop, exiting when the last
// comm sharing it closes, and one goroutine per inbound handshake, exiting
// within Config.HandshakeTimeout; per connection one reader, which delivers
// frames into the receives the op posted and exits when the connection
// closes; per backend one monitor (heartbeats, the liveness check, failure
// notices), exiting in Close. Forming a comm starts short-lived goroutines
// (dials, resyncs) that exit before it returns. The first all-reduce that
// uses lanes starts the lane helpers it needs (at most
// Config.SharedMemoryLanes − 1 per backend), which wait for further work
// and exit in Close; ops start no other goroutines.
package gloo
