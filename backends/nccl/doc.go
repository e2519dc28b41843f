// Package nccl is ftcomm's GPU backend: NCCL collectives on device memory,
// with the fault handling ftcomm needs (deadlines, revocation, shrink, grow,
// split) and no link-time dependency on NCCL or CUDA.
//
// # Loading
//
// The first New (or Open) loads libnccl.so.2 and the CUDA runtime
// (libcudart.so.13, then .12, from the loader's path and the usual CUDA
// directories) with dlopen. EnvNCCLLib (FTCOMM_NCCL_LIB) and EnvCUDARTLib
// (FTCOMM_CUDART_LIB), or Config.LibraryConfig, choose other files. The NCCL
// version is read with ncclGetVersion and optional entry points are probed;
// Library.Info reports both. Where a native call is missing the backend
// falls back: ncclCommShrink (2.27.3+) → a fresh init among the survivors,
// ncclCommRevoke (2.28.7+) → abort, ncclCommGrow (2.29.2+) → a fresh init
// with a new unique id, ncclAlltoAll/ncclGather/ncclScatter (2.28.3+) →
// grouped send/recv. Without the libraries (or without cgo) every call
// returns an error wrapping comm.ErrBackendUnavailable and the loader's
// message. Libraries are never unloaded (NCCL's threads outlive comms).
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
// is returned, since NCCL connects lazily.
//
// # Ops
//
// Each op is enqueued on the comm's own CUDA stream and waited for by
// polling the stream (busily for Config.SpinWait, then yielding, then
// sleeping), as comm.Backend requires: it returns when the op has
// completed, failed, or been interrupted by Abort, Revoke, Close or its ctx.
// Communicators are nonblocking (ncclConfig_t.blocking = 0), and after
// every NCCL call ncclCommGetAsyncError is polled until it leaves
// ncclInProgress, as NCCL requires before the next call. On NCCL 2.28 that
// mode launches every collective from a helper thread, which costs about
// 50 µs per op (measured on 2×H200, the same in C); Config.BlockingComm
// trades the safety of nonblocking comms for that time (see its doc).
//
// # Faults
//
// A peer's death does not make NCCL fail: the survivor's kernel waits for
// it forever. The op fails when the membership layer revokes the comm
// (Comm.Revoke: within microseconds), at its deadline (the comm's Timeout
// or the ctx), or when the watchdog reads an asynchronous NCCL error. The
// GPU work is cancelled off that path: by the next Shrink
// (ncclCommShrink with NCCL_SHRINK_ABORT, ~25 ms), or by ncclCommAbort
// (~0.5 s) on Close or Config.AbortDelay after the failure; with
// Config.Revoke = RevokeNative, Revoke runs ncclCommRevoke at once.
//
// # Lifecycle and concurrency
//
// A Backend serves one op at a time (comm.Comm guarantees it); Abort,
// Revoke and Close may come from any goroutine at any time. Each Backend
// runs one watchdog goroutine, which exits after Close has released
// everything: Close returns at once and the NCCL comm, stream and scratch
// memory are released in the background (Released is closed when done),
// so that replacing a failed comm does not wait for ncclCommAbort.
// Library values are safe for concurrent use and may be shared between
// comms (Config.Library); there is no package-global state.
//
// # Tests on GPUs
//
// The unit tests run anywhere against a simulation of NCCL and CUDA. The GPU
// tests (every collective against a host reference, a SIGKILLed rank,
// shrink, grow, deadlines) skip unless FTCOMM_NCCL_GPU=1:
//
//	CGO_ENABLED=1 go test -c -o nccl.test ./backends/nccl
//	FTCOMM_NCCL_GPU=1 NCCL_NVLS_ENABLE=0 ./nccl.test -test.run GPU -test.v
//
// cmd/ncclbench measures the collectives in nccl-tests' format;
// subpackage health watches the GPUs through NVML.
package nccl
