// Package nccl is ftcomm's GPU backend: NCCL collectives on device memory,
// with the fault handling ftcomm needs (deadlines, revocation, shrink, grow,
// split) and no link-time dependency on NCCL or CUDA.
//
// # Loading
//
// The first New (or Open) loads libnccl and the CUDA runtime
// (libcudart.so.13, then .12, from the loader's path and the usual CUDA
// directories) with dlopen. Which libnccl:
//
//   - the one LibraryConfig.NCCLPath, else EnvNCCLLib (FTCOMM_NCCL_LIB),
//     names, alone: if it does not load, Open fails (a path, or a soname
//     for the loader: "libnccl.so.2" is the loader's choice);
//   - otherwise the newest of: a libnccl this process has loaded already
//     (/proc/self/maps: PyTorch's, where torch was imported first); the
//     system's (the file dlopen("libnccl.so.2") would open:
//     LD_LIBRARY_PATH, /etc/ld.so.cache, the system library directories);
//     and those bundled in Python environments (nvidia/nccl/lib/libnccl.so*
//     in the site-packages of VIRTUAL_ENV, CONDA_PREFIX, PYTHONPATH's
//     entries, every python3 on PATH, the process's own interpreter and
//     /usr/bin/python3, and the user's site: the nvidia-nccl-cu12/-cu13
//     wheel PyTorch depends on). The search reads directories and files
//     only; it runs no interpreter and loads no library but the one chosen.
//     Each file's version is read from NCCL's version string in its
//     read-only data (else a versioned file name); a file that cannot be
//     read, or that was built for a newer CUDA major than the driver
//     supports, is passed over; a tie goes to the one loaded already, then
//     to the system's. If the chosen file does not load, the next is tried;
//     if none was found, the loader chooses by soname, as before the
//     search existed. Reading the versions and choosing took no measurable
//     time beside the load itself (≈0.25 s either way on an H200 host,
//     2026-11-29: system 2.28.3, PyTorch's 2.28.9 chosen).
//
// Every candidate, its version and why it was or was not chosen go to
// LibraryConfig.Logger (New passes comm.Options.Logger); Info reports the
// chosen path, version and NCCLSource and the Candidates. Ranks of one
// comm must load the same NCCL version (NCCL refuses to initialise
// otherwise, "Mismatched NCCL version"): on hosts whose environments
// differ, name the library. CUDARuntimePath and EnvCUDARTLib
// (FTCOMM_CUDART_LIB) choose the CUDA runtime.
//
// The NCCL version is read with ncclGetVersion and optional entry points
// are probed; Library.Info reports both, and Info.Recovery the gate on
// them: how a comm gets past a failed peer (fresh-init, shrink-abort,
// revoke+shrink; see Faults). Library.Collector (registered by Open with
// LibraryConfig.Registerer) exports it all as
// ftcomm_nccl_library_info{path,version,source,recovery}. Where a native
// call is missing the backend falls back: ncclCommShrink (2.27.3+) → a
// fresh init among the survivors, ncclCommRevoke (2.28.7+) → abort,
// ncclCommGrow (2.29.2+) → a fresh init with a new unique id,
// ncclAlltoAll/ncclGather/ncclScatter (2.28.3+) → grouped send/recv.
// Whether a Shrink or Grow runs natively is decided for all ranks at once:
// a rank whose comm failed, whose library lacks the call or whose Config
// disables it makes every rank init fresh. A Grow votes through the Store
// (every rank that holds the comm, rank 0 decides) where the library has
// ncclCommGrow; without it (NCCL before 2.29.2, as 2.28.3 and 2.28.9) no
// rank has it, since a comm's ranks run one NCCL version, and they
// initialise fresh with no vote. A Shrink does not
// wait for a vote: every survivor that can shrinks natively at once, and
// one that cannot says so in the Store, at which the others abandon their
// shrink (which cannot complete without it) for a fresh init together. Without the
// libraries (or without cgo) every call returns an error wrapping
// comm.ErrBackendUnavailable and the loader's message. Libraries are never unloaded (NCCL's threads outlive comms).
// Open sets NCCL_RUNTIME_CONNECT=0 unless the environment sets it or
// LibraryConfig.LazyConnect is true (see Modes); NCCL reads it once per
// process.
//
// # Use
//
// Import the package for its side effect and create comms through comm.New:
//
//	c, err := comm.New(ctx, "nccl", comm.Options{Rank: r, Size: n, Device: gpu,
//		Store: store, Prefix: "job/ft0", Epoch: epoch, BackendConfig: &nccl.Config{}})
//
// Options.Device is the CUDA ordinal; tensors must be device tensors on it
// (comm.DeviceTensor; Library.Alloc and the copy helpers make them), and
// host tensors are refused (Memory() is comm.DeviceMemory). Rank 0 makes an
// NCCL unique id and publishes it in the Store under
// <Prefix>/epoch/<Epoch>/nccl-uid; the others read it, so Prefix and Epoch
// must name one comm. Every new comm (New, Shrink, Grow, Split) is
// initialised eagerly and warmed up with a one-element all-reduce before it
// is returned.
//
// # Modes
//
// Config.Mode says how a Backend uses NCCL communicators. The default,
// ModeBlockingData, keeps two per Backend:
//
//   - a nonblocking control comm (ncclConfig_t.blocking = 0), made by
//     ncclCommInitRankConfig. Everything that waits for peers runs on it:
//     init, Shrink, Grow, Split, the native revoke, and the point-to-point
//     ops (Send, Recv, BatchP2P, AllToAll(V), Gather, Scatter), which NCCL
//     connects on first use of each peer. Its calls return at once while
//     NCCL works on a thread of its own; the backend polls
//     ncclCommGetAsyncError under the caller's ctx and, should the peers
//     not come, abandons the call; the abort on Close joins that thread;
//   - a blocking data comm (blocking = 1), split off the control comm
//     (ncclCommSplit with a config of its own) when the comm has two or
//     more ranks, or made by the Shrink itself (below); a one-rank comm
//     made by New or Grow enqueues on its
//     control comm, since a one-rank collective is a local copy NCCL runs
//     without its group launch. A one-rank comm made by Shrink (the lone
//     survivor of a two-replica job) has no NCCL comm at all (below). All-reduce, reduce-scatter,
//     all-gather(v), broadcast, reduce and barrier are enqueued on it
//     directly. With eager connection set-up (NCCL_RUNTIME_CONNECT=0, the
//     default Open sets) the comm connected every algorithm while it was
//     made, so these calls only enqueue work: a dead peer stalls the
//     GPU, never the call, and the op fails at Revoke or its deadline.
//
// Both comms enqueue on the Backend's one CUDA stream, so their work runs
// in issue order.
//
// A Shrink to two or more ranks makes one comm on the survivors' way,
// not two: ncclCommShrink of the control comm, with a config that says
// blocking = 1, gives the survivors their data comm (the call itself stays
// nonblocking and abandonable, as it follows the parent), and the next
// collectives run on it at once. Their new control comm is a fresh
// nonblocking init among them (rank 0 publishes its unique id at
// <Prefix>/epoch/<e>/nccl-ctl-uid) made in the background; point-to-point
// ops, Split and the next Shrink wait for it. A second failure before it
// is there makes it give up, and the next Shrink, finding no control comm
// at this rank, initialises fresh (every survivor follows, as for any
// refusal). Config.DisableShrinkToData restores the path before: shrink
// the control comm, then split the data comm off it, each connecting every
// algorithm while it is made (0.22–0.63 s each at 2–4 ranks, 4× H200).
// A native Shrink after a failure also hands the shrunk parent and the
// old data comm to the watchdog to be aborted, and the new comm's stream
// waits on the GPU (cudaStreamWaitEvent) for everything the old stream
// holds, so no kernel of the old comms runs beside the new comm's work.
//
// A shrink to one rank makes no NCCL comm (Config.DisableLocalOneRank
// restores the NCCL comm of one rank): each op of the lone survivor is the
// device copy NCCL would make of it (a reduction over one rank is its
// input; sends and receives to itself pair up in a group), on a new stream
// made to wait (cudaStreamWaitEvent) for everything the old comm's stream
// holds; after a failure the old NCCL comms go to the watchdog to be
// aborted, whose abort flag ends a kernel waiting for a dead peer. So no
// old work can touch a buffer after the survivor's next op begins, and
// nothing on the survivor's way waits for NCCL. On 2× H200 (NCCL 2.28.9,
// 2026-11-29, TestGPUKillCycles, 2 × 10 cycles each, alternated) kill →
// first collective on the shrunk comm took 2.8 ms p50 (2.9 ms max)
// against 164–184 ms p50 (191–211 ms max) for ncclCommShrink with
// NCCL_SHRINK_ABORT, which synchronises the old stream on the host and
// then initialises a one-rank child. A Split of it is local too; a Grow
// from it is a fresh init, as from any comm without ncclCommGrow. ModeNonblocking (one nonblocking comm: every call
// abortable, ~50 µs per op) and ModeBlocking (one blocking comm: init,
// Shrink, Grow and Split cannot be interrupted) are kept for comparison.
//
// Why (measured on one H100, kind nvidia-h100-x1, 2026-11-23, three
// machines, NCCL 2.28.3 and PyTorch's 2.28.9; TestGPULaunchCost): an 8-byte
// send to self plus receive from self, grouped (a one-rank collective
// bypasses NCCL's group launch, a self send/recv does not), costs 45–90 µs
// to enqueue on a nonblocking comm with either library and 6–11 µs on a
// blocking one (the data comm of ModeBlockingData included); back to back
// 42–87 µs per op against 6–12 µs. The 2×H200 figures before this mode
// (README): 8-byte all-reduce 99 µs nonblocking against nccl-tests'
// 12.1 µs, 13.1 µs blocking. What it costs instead: a second comm per rank
// (its memory, and its creation inside every New, Shrink, Grow and Split:
// 95–123 ms against 40–70 ms for a one-rank comm, 0.45 s at 3 ranks on 4×
// H200; more with peers, since both comms connect every algorithm when
// made). A one-rank comm needs none of it: an 8-byte one-rank all-reduce
// through comm.Comm took 3.7 µs (6.1 µs back to back) on the blocking data
// comm and 4.4 µs (5.2 µs) on a nonblocking comm, so one rank keeps only
// its control comm and a shrink to one rank skips the split.
//
// # Facts relied on
//
// From NCCL's source (github.com/NVIDIA/nccl, tags v2.28.3-1 and v2.28.9-1
// unless said) and nccl.h:
//
//   - On a nonblocking comm, ncclGroupEndInternal starts a new thread for
//     every group it launches (pthread_create in src/group.cc; a
//     std::thread in 2.29–2.30); every collective call is a group of one.
//     That thread is the per-op cost above; a blocking comm launches on
//     the caller's thread.
//   - ncclCommSplit and ncclCommShrink run the child's initialisation as
//     an async job of the parent (ncclCommInitChildComm → ncclAsyncLaunch
//     with the parent, src/init.cc), so whether the call blocks follows
//     the parent; the child gets the config passed (parseCommConfig) or a
//     copy of the parent's (NULL). While the job runs, the parent's
//     childAbortFlag points at the child's abort flag: ncclCommAbort of the
//     parent raises both and joins the job (ncclCommEnsureReady) before
//     freeing anything.
//   - Connections: with NCCL_RUNTIME_CONNECT=1 (NCCL's default where cuMem
//     works) each algorithm (ring, tree, PAT, NVLS, CollNet) is connected
//     inside the first collective that uses it (ncclPrepareTasks →
//     ncclCollPreconnect, src/enqueue.cc, src/group.cc); with 0,
//     initTransportsRank connects them all while the comm is made
//     (src/init.cc). Point-to-point connections are always made on first
//     use of a peer (p2pTaskAppend → ncclGroupCommPreconnect), and
//     ncclAlltoAll, ncclGather and ncclScatter are sends and receives
//     inside NCCL (taskAppend). Connecting exchanges addresses with peers
//     over bootstrap sockets whose waits loop until done or until the
//     comm's abort flag is raised, with no timeout (src/misc/socket.cc):
//     on a blocking comm, a call that connects waits for a silent peer
//     forever, on the caller's thread.
//   - ncclCommAbort raises the abort flags (which kernels and socket loops
//     poll) and then frees the comm (commReclaim); it does not wait for
//     another thread's call on the same comm, and NCCL comms are not safe
//     for concurrent calls. So this backend never aborts a comm while one
//     of its goroutines is inside an NCCL call on it (every call holds
//     the Backend's handle lock): a blocking call must not wait for peers,
//     which is what eager connection and the split of work between the two
//     comms ensure.
//   - From the CUDA runtime's documentation: work queued on a stream after
//     cudaStreamWaitEvent waits for the completion of the event's latest
//     record on another stream, on the device, without the host waiting;
//     an event destroyed while recorded work is pending is released once
//     that work completes (cudaEventDestroy), and the wait still holds.
//     The local one-rank comm's stream rests on both; TestGPUKillCycles
//     (2 ranks) checks every all-reduce after such a shrink exact, and
//     TestLocalOneRankOrderedAfterTheOldStream the order in simulation.
//   - Once connected, a collective's enqueue on a blocking comm plans the
//     work, uploads it to the work FIFO and launches the kernel. The FIFO
//     (NCCL_WORK_FIFO_BYTES, 1 MiB) makes the enqueue spin only when full
//     (waitWorkFifoAvailable), which the ≤ 64 ops comm.Comm keeps in
//     flight never fill.
//   - ncclCommSplit and ncclCommShrink return their own result
//     (ncclSuccess), not the group's ncclInProgress, even on a nonblocking
//     parent: the parent's async state says ncclInProgress until the child
//     is there, and only then is the child in the cell. A child whose
//     config says blocking = 1 is blocking whatever its parent: a group on
//     it returns ncclSuccess with no async state left in progress.
//     TestGPUNCCLBlockingChild, NCCL 2.28.3 and 2.28.9 (2× H200,
//     2026-11-29).
//   - A child shares its parent's abort flag only when it shares its
//     resources (splitShare, or shrinkShare without NCCL_SHRINK_ABORT; 0
//     by default, as this backend leaves them). Without sharing, aborting
//     the parent leaves the child working: after both ranks aborted the
//     parent, the split child's all-reduce was right.
//     TestGPUNCCLAbortParentKeepsChild, NCCL 2.28.3 and 2.28.9.
//   - NCCL_SHRINK_ABORT raises the parent's abort flags, synchronises its
//     device stream and lowers them before shrinking (ncclCommShrink): it
//     ends the parent's kernels only. A stuck all-reduce of the parent had
//     ended 15–25 µs after the child was ready; one of another comm on the
//     same stream (a data comm split off the parent) was still waiting 2 s
//     later, and ended with that comm's own ncclCommAbort.
//     TestGPUNCCLShrinkAbortEndsTheParentsKernels, NCCL 2.28.3 and 2.28.9.
//     The data comm shares no resources with the control comm (splitShare
//     0), so Shrink after a failure hands the data comm to the watchdog,
//     which aborts it (its kernels end as ncclCommAbort raises its flag)
//     while the control comm shrinks.
//   - ncclCommRevoke (2.28.7+, present in 2.28.9) raises the abort flags,
//     marks the comm revoked, and in a job synchronises its streams, stops
//     its proxy and lowers the flags; nccl.h: once the comm is quiescent,
//     destroy, split and shrink can proceed.
//   - Neither that shrink nor a split reuses the parent's connections: a
//     child of a revoked parent never shares its resources
//     (ncclCommInitChildComm: shareResources = !revokedFlag && …, every
//     release 2.28.7–2.30.7; nccl.h: "resource sharing via
//     splitShare/shrinkShare is disabled while revoked"), nor does a shrink
//     with NCCL_SHRINK_ABORT (shrinkShare is ignored). A shrink after a
//     failure thus always connects the survivors anew; shrinkShare applies
//     only to a NCCL_SHRINK_DEFAULT shrink of a comm never revoked, whose
//     child then shares the parent's abort flag (so aborting the parent
//     would stop the child): this backend does not use it. After
//     ncclCommRevoke of a parent made with splitShare = 1, its split child
//     kept working when the parent was aborted:
//     TestGPUNCCLRevokedParentDoesNotShare, NCCL 2.28.9 (it needs 2.28.7+).
//   - ncclCommRevoke and ncclCommAbort each take ≈0.5 s after a failure
//     (0.51 s measured): with the abort flag raised ncclProxyStop sends
//     its proxy no stop message, and the proxy's service threads see the
//     stop only when their poll(…, 500 ms) returns (src/proxy.cc,
//     2.28.3–2.28.9). So a native revoke delays a Shrink that follows
//     within 0.5 s; RevokeDeferred (NCCL_SHRINK_ABORT, 24–27 ms to a
//     working comm) stays the default, and RevokeAuto is the native revoke
//     where the library has it (Recovery revoke+shrink), the deferred path
//     where not. TestGPURevoke on 2× H200 (NCCL 2.28.9 chosen, 2026-11-29):
//     revoke → shrunk comm's first collective done 44.8 ms deferred,
//     557.6 ms auto (native on 2.28.9), 552.0 ms native.
//   - Version strings: every libnccl 2.x keeps "NCCL version
//     <major>.<minor>.<patch><suffix>+cuda<major>.<minor>" in its read-only
//     data (VERSION_STRING, src/init.cc: "so that running strings on the
//     lib can quickly reveal the version"); the library search reads it.
//   - NCCL_COMM_BLOCKING overrides ncclConfig_t.blocking for every comm of
//     the process (parseCommConfig); New refuses it where it contradicts
//     the mode.
//
// Seen on 2×H200 (a C probe, one process per GPU): a dead peer's survivor sees no async error
// (its kernel just waits); a nonblocking comm needs ncclCommGetAsyncError
// polled after every call until it leaves ncclInProgress, or it is
// poisoned; ncclCommAbort after a peer's death took 0.51 s. On one H100,
// aborting an idle one-rank comm also took 0.51 s (release aborts the two
// comms at once).
//
// # Ops
//
// Each op is enqueued on the Backend's CUDA stream and waited for by
// polling the stream (busily for Config.SpinWait, then yielding, then
// sleeping), as comm.Backend requires: it returns when the op has
// completed, failed, or been interrupted by Abort, Revoke, Close or its
// ctx. On a nonblocking comm, after every NCCL call ncclCommGetAsyncError
// is polled until it leaves ncclInProgress, as NCCL requires before the
// next call; a blocking comm's call returns its result.
//
// An op whose ctx carries a StreamOrder (WithStreamOrder) is ordered with
// a stream the caller owns, as torch.distributed orders collectives with
// PyTorch's current stream: the comm's stream waits for the caller's work
// so far (an event and cudaStreamWaitEvent), and unless Async the caller's
// stream waits for the op, which then returns once enqueued (for the
// collectives that are one NCCL call); the watchdog follows its
// completion against its deadline and, past it, fails the comm with
// comm.ErrTimeout and aborts its NCCL comms. The Python package uses it
// for CUDA tensors; see StreamOrder. Such an op is done for its caller
// while its kernel may still run, so closing a comm that has not failed
// first waits for its ordered ops (up to their deadlines): an abort would
// cancel them half-way and leave their outputs wrong with no op left to
// report it (a torch finalize right after a sync op). Close returns an
// error naming them if they do not complete.
//
// # Faults
//
// A peer's death does not make NCCL fail: the survivor's kernel waits for
// it forever. The op fails when the membership layer revokes the comm
// (Comm.Revoke: within microseconds), at its deadline (the comm's Timeout
// or the ctx), or when the watchdog reads an asynchronous NCCL error. The
// GPU work is cancelled off that path: by the next Shrink
// (ncclCommShrink with NCCL_SHRINK_ABORT on the control comm, ncclCommAbort
// of the data comm and then of the shrunk parent), or by ncclCommAbort on
// Close or Config.AbortDelay
// after the failure; with Config.Revoke = RevokeNative (or RevokeAuto on
// a library whose Recovery is revoke+shrink), Revoke runs ncclCommRevoke
// at once. A Shrink, Grow, Split or New whose peers do not
// come (a second rank dies meanwhile) returns at its ctx's deadline; the
// control comm's job is stopped when the comm is closed.
//
// Backend.Creation says how each comm was made and what each phase cost
// (the native-or-fresh vote, the NCCL call, the wait until the comm is
// ready, the data comm's split, the warm-up); TestGPUKillCycles prints it
// per cycle. On 4× H200 (2026-11-28, docs/measurements.md) connection
// set-up was most of every comm made — 0.22–0.24 s per comm at 2 ranks,
// 0.41–0.47 s at 3, 0.56–0.63 s at 4, by NCCL's own init timers — and a
// shrink made two (the control comm's shrink, then the data comm's
// split); it now makes one on the survivors' way (Modes). A data comm
// split with splitShare 1 saved none of it and hung a later shrink; it is
// not used. Connecting lazily (NCCL_RUNTIME_CONNECT=1) would connect only
// what the next collectives use, but NCCL reads it once per process
// (ncclParamRuntimeConnect, every release up to 2.30.7, whose config has
// no per-comm setting), and a blocking data comm that connects inside a
// collective waits for a silent peer with no timeout: so every comm
// connects eagerly.
//
// # Refused ops
//
// The Backend is not a comm.Refuser: an op that one rank refuses (its
// arguments fail comm.Comm's validation, or this backend's own checks of
// a tensor's device, dtype or counts, or the Python API's) fails there at
// once with comm.ErrInvalidArgument and never reaches NCCL, but its peers
// are not told. Their matching op is already on their streams by then
// (NCCL offers no header to send ahead of a collective, and waiting for a
// host-side agreement before every op would cost each op a round trip),
// so each peer's op waits for its deadline, fails with comm.ErrTimeout
// and aborts its comm, and the refusing rank's next collective then waits
// for peers that no longer run it, until its own deadline. A refusal on
// nccl thus costs the job a deadline and a reconfiguration, as any hang
// does; gloo keeps the comm (see its package documentation). In an ft job
// the step fails and the next epoch forms new comms. Check arguments the
// same way on every rank before a GPU collective.
//
// # Host copies and health
//
// The Backend is a comm.HostCopier: PinnedHost hands out page-locked
// memory (cudaHostAlloc), and CopyToHost/CopyFromHost copy chunks of
// device tensors through a per-device pool of CUDA streams the Library
// owns (LibraryConfig.CopyStreams, default 4), never the comm's stream, so
// copies run beside collectives and go on after the comm is closed. A copy
// abandoned by its ctx keeps its stream and blocks PinnedHost's free until
// the copy engine is done. On one H100 (PCIe 5): 44–55 GB/s each way with
// 1–64 MiB pinned chunks and 2–8 copiers, 32 (1 MiB) to 53 GB/s (16–64
// MiB) with one; one cudaMemcpyAsync polled busily: 49–55 GB/s
// (BenchmarkHostCopy, BenchmarkHostCopyRaw). It is a comm.HealthWatcher: WatchHealth watches the
// comm's GPU through NVML (subpackage health; found by PCI address) for
// Xids, uncorrected ECC errors, lost NVLinks and a lost GPU.
//
// # Lifecycle and concurrency
//
// A Backend serves one op at a time (comm.Comm guarantees it); Abort,
// Revoke and Close may come from any goroutine at any time; the HostCopier
// and WatchHealth methods from any goroutine, concurrently with ops. Each
// Backend runs one watchdog goroutine, which exits after Close has
// released everything: Close returns at once (once the stream-ordered ops
// of a comm that has not failed completed) and the NCCL comms, stream
// and scratch memory are released in the background (Released is closed
// when done), so that replacing a failed comm does not wait for
// ncclCommAbort. A copy abandoned by its ctx leaves one goroutine that
// exits when the GPU has finished the copy; WatchHealth's goroutine exits
// when its ctx ends. Library values are safe for concurrent use and may be
// shared between comms (Config.Library); there is no package-global state
// (NCCL_RUNTIME_CONNECT, set by Open, is NCCL's process-wide setting).
//
// # Simulation
//
// Package ncclsim simulates NCCL and the CUDA runtime in Go memory: a
// machine with some GPUs, on which OpenSimulation opens a Library that
// drives this package's code unchanged, so tests here and in other
// packages (ft's) run whole jobs of GPU ranks in one process with no GPU.
// It models streams, nonblocking comms, collectives, shrink, grow and
// split, pinned copies and NVML, injects faults, and collects the misuse
// the real library would punish. Only tests import ncclsim, so no
// production binary links the simulation (nor go-nvml's mock); it plugs in
// through OpenSimulation and the seam between this package and the
// libraries it drives (internal/libapi: a small interface with two
// implementations, dl.go's dlopen of libnccl and libcudart, and ncclsim's).
//
// # Tests on GPUs
//
// The unit tests run anywhere against the simulation. The GPU tests skip
// unless FTCOMM_NCCL_GPU=1, and each skips on a machine with fewer GPUs
// than it needs (one for the single-rank tests, two for most, three for
// TestGPUShrinkSecondDeath). gpurun.sh builds and runs them, and
// bench/faultpath.sh produces every figure of the fault path (the phases
// at each size, kill cycles of the backend and of ft, FT-HSDP, the steady
// state against the previous build) in one run:
//
//	backends/nccl/gpurun.sh build <checkout>     # nccl.test, ncclbench, ftbench into <checkout>/.gpu/nccl
//	bash .gpu/nccl/gpurun.sh run1                # on a host with one GPU, from the checkout's copy
//	bash .gpu/nccl/gpurun.sh run-tests           # on a host with 2-8 GPUs (each under 10 minutes)
//	bash .gpu/nccl/gpurun.sh run-torch
//	bash .gpu/nccl/gpurun.sh run-bench
//
// run-tests runs every GPU test (collectives against host references,
// revoke, SIGKILL + shrink + grow across processes, a second death during
// shrink and grow, the kill-shrink-grow soak on all GPUs); run-torch the
// fault tests and the launch cost with PyTorch's NCCL, and PyTorch's
// all_reduce; run-bench ncclbench in each mode (waited-for and
// stream-ordered ops) and ftbench's nccl-tests table of the default mode
// with -async. By hand, on n GPUs:
//
//	FTCOMM_NCCL_GPU=1 NCCL_NVLS_ENABLE=0 ./nccl.test -test.run GPU -test.v
//	FTCOMM_NCCL_GPU=1 NCCL_NVLS_ENABLE=0 FTCOMM_NCCL_RANKS=n ./nccl.test -test.run GPUKillCycles -test.v
//	NCCL_NVLS_ENABLE=0 ./ftbench -backend nccl -np n -b 8 -e 1G -f 8 -n 50 -async
//	NCCL_NVLS_ENABLE=0 ./ncclbench -g n -b 8 -e 1G -f 8 -n 50 -mode stream -commmode blocking-data
//
// The targets: 8-byte all-reduce ≤ nccl-tests + 3 µs and busbw ≥ 97 % of
// nccl-tests at ≥ 16 MiB in the default mode (ftbench -async against
// nccl-tests' all_reduce_perf on the same host), no call past its deadline.
// docs/measurements.md has the figures.
//
// cmd/ncclbench measures the collectives in nccl-tests' format;
// subpackage health watches the GPUs through NVML.
package nccl
