// Package ncclsim simulates NCCL and the CUDA runtime in Go memory, for
// tests: a machine with some GPUs (New) on which package nccl's code runs
// unchanged, so that the tests of nccl and of the packages built on it
// (ft's) run whole jobs of GPU ranks in one process, with no GPU. Each
// simulated process opens its own nccl.Library on the simulation:
//
//	sim := ncclsim.New(2)
//	lib, err := nccl.OpenSimulation(sim, nccl.LibraryConfig{})
//
// It models streams, nonblocking comms and their polling rules,
// collectives, shrink, grow and split, pinned copies and NVML (for nccl's
// WatchHealth, through nccl.Config.NVML); it injects faults (Kill,
// Restart, KillDuring, InjectAsyncError, StallCopies, StallAborts,
// InjectXid, AddECCErrors), reads and writes simulated device memory
// (ReadDevice, WriteDevice), and collects the misuse the real library
// would punish (Faults), which a test should fail on. Simulation says
// what is modelled and how.
//
// Only tests import this package, so no production binary links it, nor
// go-nvml's mock: `go list -deps ./capi ./cmd/ftcoord` has no ncclsim. It
// plugs into nccl through nccl.OpenSimulation, implementing the seam
// between nccl and the libraries (backends/nccl/internal/libapi).
//
// A Simulation is safe for concurrent use and starts no goroutines: work
// advances only inside the calls of the Libraries opened on it. Two
// Simulations share nothing; the package keeps no global state.
package ncclsim
