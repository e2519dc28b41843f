// Command capi is ftcomm's C ABI: built with
//
//	go build -buildmode=c-shared -o libftcomm.so ./capi
//
// it gives C (and Python, through ctypes: the package under python/) the
// communicator (comm.Comm on gloo or nccl), the rendezvous store
// (comm/httpstore), the fault-tolerant training-loop API (ft.Comm) and an
// embedded coordinator (ftcoord's service), with libftcomm.h declaring
// every entry point.
//
// # Conventions
//
// Every function but ftcomm_abi_version and ftcomm_last_error returns an
// int32 status: 0 (FTCOMM_OK), 1 (FTCOMM_PENDING: a bounded wait ended
// before the op did) or a negative error kind (the FTCOMM_ERR_* constants
// in status.go, one per Go sentinel: timeout, revoked, peer failed,
// mismatch, invalid argument, closed, rolled back, …). On an error the
// calling OS thread's last error is set: ftcomm_last_error copies it, as
// JSON ({"status", "kinds", "message", "ranks", "rollback", "finished",
// "refused"}), into a
// buffer the caller owns, and clears it. It is per thread, like errno:
// read it on the thread that got the status, before that thread's next
// failing call. "kinds" lists every sentinel the error matches (a peer's
// death seen at a deadline is both peer_failed and timeout); "ranks" are
// the ranks the error names (comm.FailedRanks: the failed peers, or the
// peer that refused the op); "refused" ({"rank", "op", "reason"}) is set
// when a peer refused the op (peer_refused, comm.Refusal).
//
// An op whose arguments are invalid (found by the ABI, by comm.Comm, or by
// the caller, which then calls ftcomm_comm_refuse instead of the op) is
// refused in its place in the comm's order: on gloo the peers' matching op
// fails at once with FTCOMM_ERR_PEER_REFUSED and every comm stays usable.
//
// Values cross the boundary as integers, C strings, and buffers the
// caller owns; no Go pointer ever does (cgo's rules). Objects are named
// by handles: uint64 values that are never 0 and never reused. Results
// that are variable-length (addresses, JSON) are copied into a caller's
// buffer of cap bytes; the call reports the length it needed, and a
// caller with too small a buffer calls again (these calls are
// idempotent). Settings are passed as JSON objects (field names in
// status.go and the Python package), so the ABI keeps its shape as they
// grow. ftcomm_abi_version says which ABI this library speaks
// (ABIVersion); a caller checks it first.
//
// # Lifecycle: who frees what
//
// A handle lives from the call that returns it until the caller frees it
// with the matching *_free (comm, work, store, ft, coordinator): freeing
// closes the object (a comm is closed, an ft.Comm leaves its job, a
// coordinator stops). Freeing twice, or using a freed handle, returns
// FTCOMM_ERR_BAD_HANDLE and touches nothing. Shrink and Grow close the
// comm they are called on and return a new handle; the old handle must
// still be freed. An NCCL comm releases its NCCL comms in the background
// after its free (ncclCommAbort takes about half a second), so that a
// shrink or grow does not wait for the comm it replaces; ftcomm_quiesce
// (ABI 9) waits, within a bound, until every comm freed so far has
// released its device resources, which a process must do before it exits
// (CUDA torn down under a release crashes it). Python's package calls it
// at exit; an ft.Comm's free waits for its own comms.
//
// # The sampler
//
// ftcomm_ft_sampler_new makes an ft handle's quorum-aware sampler
// (ft.NewSampler; settings as JSON) and returns a sampler handle, freed
// with ftcomm_sampler_free; it registers the sampler's position as state,
// so it comes before the first step, like ftcomm_ft_register. Between a
// step and its commit, ftcomm_sampler_plan copies this rank's plan: its
// meta as JSON and its indices into the caller's int64 array;
// ftcomm_sampler_position reads the position and epoch. Step, commit and
// sampler_new are the training loop's, one at a time (a second while one
// runs gets FTCOMM_ERR_INVALID_ARGUMENT); the sampler's getters read what
// the last of them left and may be called from any thread. Outside a step
// the plan is FTCOMM_ERR_NO_STEP; a sampler whose healed state came from
// a sampler configured otherwise gets FTCOMM_ERR_INVALID_ARGUMENT with the
// kind "sampler_mismatch" as well.
//
// # Failing a step
//
// ftcomm_ft_fail_step (ABI 7; ft.Comm.FailStep) is how a training loop
// fails its step for a reason found outside ft — a NaN loss, an error on
// a comm of its own (an FSDP shard comm), a data loader's failure —
// without issuing an op the ft handle refuses: between a step and its
// commit, it makes this replica's commit vote no, with the reason in the
// "commit failed" event, and revokes its FT comms at once, so that every
// other replica's FT op of the step that still needs this replica's part
// fails, and its commit with it (with group_size > 1 the group's vote
// carries the no to the rest of the group). A replica whose FT ops of
// the step all completed before the revocation reached it commits the
// step: call it before the FT collective that would carry what is wrong.
// Outside a started step it returns FTCOMM_ERR_INVALID_ARGUMENT and
// changes nothing.
//
// # Peer snapshots and slot spares
//
// The ft setting "snapshot_every" (ft.Config.SnapshotEvery) keeps copies
// of a replica group's registered state in its ranks' host memory; when a
// rank of the group is replaced the group restores one (the event
// "restored"; a rank that lost steps gets FTCOMM_ERR_ROLLED_BACK with
// "snapshot": true in the rollback JSON), and when both copies of a shard
// are gone every step returns FTCOMM_ERR_SNAPSHOT_LOST. A slot spare
// (group_rank -1 with spare) waits in ftcomm_ft_new, unbounded but
// interruptible, until a rank of its group leaves a place free, and
// ftcomm_ft_group_rank says which place it took.
//
// ftcomm_ft_group_comm (ABI 8) returns a comm handle of the replica
// group's data comm of the current epoch (ft.Comm.Group): the shard group
// of an FSDP job with no replica. With the ft setting "group_backend"
// "nccl" it is an NCCL comm on the ft handle's device (ncclCommRevoke where
// the library has it, else ncclCommAbort 2 s after a failure ends a kernel
// left waiting for a dead rank); by default it is the host comm that also
// carries ft's group messages. The comm stays ft's: ft revokes it when a
// rank of the group dies or fails its step, and closes it when the group
// is formed again, after which the handle's ops return FTCOMM_ERR_CLOSED;
// ftcomm_comm_free frees the handle and leaves the comm open; a shrink,
// grow, split or reconfigure of it returns FTCOMM_ERR_INVALID_ARGUMENT
// (ft reconfigures its comm itself).
//
// # Tensor memory: the rule
//
// The memory of a tensor passed to an op is the caller's, and the library
// reads or writes it until the op has ended, whatever happens to the work
// handle:
//
//   - a sync op on host memory: until the call returns;
//   - a CUDA op: as the stream order says (a sync op makes the caller's
//     stream wait for it; memory freed to an allocator that reuses it on
//     that stream is safe);
//   - an async op: until ftcomm_work_test or ftcomm_work_wait has reported
//     it done, or the comm's ftcomm_comm_free (or ftcomm_ft_free) has
//     returned: freeing a comm ends every op of it before it returns.
//
// Freeing a work handle neither cancels its op nor ends the caller's duty:
// without the handle the caller can no longer learn when the op ends, so it
// must keep the memory until it frees the comm. Ops of a comm end in issue
// order, so an async op has ended once any later op of the same comm has.
// The Python package keeps every async op's tensors (and handle) in its
// communicator until it sees the op end, so a dropped Work is safe there.
//
// # Threading
//
// Every function may be called from any thread, concurrently. Calls that
// wait (rendezvous, collectives, Step, Commit, waits on works and store
// gets) block the calling thread only: ctypes releases the GIL around
// them, so other Python threads run. A blocking call can be ended early
// in two ways: ftcomm_interrupt cancels every blocking call in progress,
// and ftcomm_interrupt_install chains a SIGINT handler in front of the
// one installed (Python's) that does the same, so Ctrl-C ends a blocked
// collective at once (the comm is aborted: a collective cannot be left
// half-way) and the call returns FTCOMM_ERR_INTERRUPTED; the chained
// handler then runs, and Python raises KeyboardInterrupt. Python
// replacing its SIGINT handler (signal.signal) removes the chain; the
// package reinstalls it when it creates a comm. The library runs the Go
// runtime's threads from the moment it is loaded. A process forked from
// one that loaded the library must not call into it (the child has none
// of those threads): the Python package refuses such calls.
//
// # State
//
// The ABI keeps one package-level value (abi, in handles.go): the handle
// table, the per-thread last errors and the interruptible calls. It is
// unavoidable: C holds integers, so the objects they name must live
// somewhere on the Go side. Two more things are process-wide by nature:
// the signal chain and its pipe (one SIGINT handler per process; a
// goroutine reads that pipe from the first install until the process
// exits), and the loaded NCCL and CUDA runtime (ncclLibrary, opened by the
// first nccl comm and shared by every later one, as the libraries are
// never unloaded). No handle shares anything else with another.
//
// # Loading
//
// go-nvml (GPU health, through backends/nccl) leaves NVML's entry points
// undefined until it dlopens libnvidia-ml; ctypes loads libraries with
// RTLD_NOW, which refuses undefined symbols, so the library defines
// stand-ins (nvml_stubs.c, go generate) that return "library not found".
// A caller that loads libnvidia-ml.so.1 with RTLD_GLOBAL first (the Python
// package does, where it exists) gets the real ones.
//
// # Failures
//
// A panic inside a call is recovered at the boundary and returned as
// FTCOMM_ERR_INTERNAL with its stack in the message: a Go bug never
// takes the Python process down. Logs go to stderr through a zap logger
// each handle builds from its settings ("log_level": debug, info, warn,
// error, off; default $FTCOMM_LOG_LEVEL, else warn): a C caller cannot
// pass a Go logger in.
package main
