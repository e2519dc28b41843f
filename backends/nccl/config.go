package nccl

import (
	"fmt"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/ftcomm/ftcomm/backends/nccl/health"
	"github.com/ftcomm/ftcomm/comm"
)

// RevokeMode says what Revoke does on the GPU.
type RevokeMode uint8

const (
	// RevokeDeferred (the default): Revoke fails the running op and every
	// later one at once and leaves the NCCL comm as it is; the GPU work is
	// cancelled by the next Shrink (ncclCommShrink with NCCL_SHRINK_ABORT,
	// 24–27 ms to a working comm on 2×H200), or by ncclCommAbort in the
	// background on Close or after Config.AbortDelay. This is the fastest
	// path from a failure to a working smaller comm.
	RevokeDeferred RevokeMode = iota
	// RevokeNative: Revoke also calls ncclCommRevoke in the background
	// (NCCL 2.28.7+), after which Shrink uses NCCL_SHRINK_DEFAULT; on an
	// older NCCL it calls ncclCommAbort instead, and Shrink falls back to a
	// fresh init among the survivors. ncclCommRevoke took 0.51 s on 2×H200.
	RevokeNative
	// RevokeAuto: RevokeNative where the library's Recovery is
	// RecoveryRevokeShrink (ncclCommRevoke and ncclCommShrink, 2.28.7+),
	// RevokeDeferred otherwise, so an older NCCL keeps the
	// NCCL_SHRINK_ABORT path instead of RevokeNative's abort and fresh
	// init. Not the default: the native revoke costs ≈0.5 s before the
	// next Shrink can start (the package doc, Facts relied on), where the
	// deferred path reached a working comm in 24–27 ms.
	RevokeAuto
)

func (m RevokeMode) String() string {
	switch m {
	case RevokeDeferred:
		return "deferred"
	case RevokeNative:
		return "native"
	case RevokeAuto:
		return "auto"
	}
	return fmt.Sprintf("revokemode(%d)", uint8(m))
}

// nativeRevoke says whether Revoke runs the native revoke (or, where the
// library has none, the abort RevokeNative falls back to) on a library
// that offers recovery r.
func (m RevokeMode) nativeRevoke(r Recovery) bool {
	return m == RevokeNative || (m == RevokeAuto && r == RecoveryRevokeShrink)
}

// Mode says how a Backend uses NCCL communicators.
type Mode uint8

const (
	// ModeBlockingData (the default): two NCCL comms per Backend. The
	// control comm is nonblocking (ncclConfig_t.blocking = 0): it is made
	// by ncclCommInitRankConfig and runs every call that waits for peers
	// (init, Shrink, Grow, Split, revoke, and the point-to-point ops, which
	// connect lazily), so each can be abandoned at its deadline and
	// aborted. The data comm is a blocking comm split from it
	// (ncclCommSplit with blocking = 1; the split call itself follows the
	// nonblocking parent; none for a one-rank comm, whose collectives
	// are local copies): the collectives are enqueued on it directly,
	// with no helper thread per call. With eager connection set-up
	// (LibraryConfig.LazyConnect false) its calls only enqueue work: they
	// never wait for a peer, so a dead peer stalls the GPU, not the call,
	// and the op fails at Revoke or its deadline.
	ModeBlockingData Mode = iota
	// ModeNonblocking: one nonblocking comm for everything. Every call is
	// abortable, but NCCL launches each collective from a new helper
	// thread: about 50 µs per op on 2×H200 (NCCL 2.28).
	ModeNonblocking
	// ModeBlocking: one blocking comm for everything; the lowest launch
	// cost, but init, Shrink, Grow and Split block inside NCCL until every
	// rank has come (a dead peer hangs them; a ctx cannot interrupt them).
	// For measurements only.
	ModeBlocking
)

func (m Mode) String() string {
	switch m {
	case ModeBlockingData:
		return "blocking-data"
	case ModeNonblocking:
		return "nonblocking"
	case ModeBlocking:
		return "blocking"
	}
	return fmt.Sprintf("mode(%d)", uint8(m))
}

// ParseMode reads a Mode by its String.
func ParseMode(s string) (Mode, error) {
	for m := ModeBlockingData; m <= ModeBlocking; m++ {
		if m.String() == s {
			return m, nil
		}
	}
	return 0, fmt.Errorf("nccl: %w: mode %q (want blocking-data, nonblocking or blocking)", comm.ErrInvalidArgument, s)
}

// Config holds the nccl backend's settings; pass a *Config as
// comm.Options.BackendConfig (nil means DefaultConfig()). Zero durations
// take their defaults.
type Config struct {
	// Library is the loaded NCCL to use, shared between communicators; nil
	// opens one with LibraryConfig.
	Library       *Library
	LibraryConfig LibraryConfig

	// NoWarmUp skips the one-element all-reduce every new communicator
	// runs before it is returned (NCCL connects lazily: the first
	// collective on a new comm took 0.15 s on 2×H200).
	NoWarmUp bool

	// Disable… force the fallback even where the library has the native
	// call (for tests and comparisons).
	DisableNativeShrink      bool // fresh init among the survivors
	DisableNativeGrow        bool // fresh init with a new unique id
	DisableNativeCollectives bool // AllToAll, Gather, Scatter as grouped send/recv
	// DisableLocalOneRank: a shrink to one rank makes an NCCL comm of one
	// rank (ncclCommShrink or a fresh init) rather than running the lone
	// survivor's ops as device copies (see Shrink).
	DisableLocalOneRank bool
	// DisableShrinkToData: a shrink (ModeBlockingData, two or more
	// survivors) makes the control comm and then splits the data comm off
	// it, both on the survivors' way, rather than making the data comm as
	// the shrink's child and the control comm in the background (see
	// Shrink).
	DisableShrinkToData bool

	// holdControl, set by tests, holds the background init of a shrink's
	// control comm (makeControl) until it is closed.
	holdControl chan struct{}

	// Mode says how NCCL comms are used (default ModeBlockingData; see
	// the package doc for what each costs and guarantees).
	Mode Mode

	// Revoke says what Revoke does on the GPU (default RevokeDeferred).
	Revoke RevokeMode

	// AbortDelay: after a failure that left GPU work outstanding, the
	// watchdog calls ncclCommAbort itself if neither Shrink nor Close has
	// come within this time. Default 10 s; negative: never (only Shrink
	// and Close cancel the GPU work).
	AbortDelay time.Duration

	// Waiting for an op: poll its completion busily for SpinWait, then
	// yielding the processor until YieldWait, then every PollInterval.
	// Defaults 200 µs, 20 ms, 100 µs.
	SpinWait     time.Duration
	YieldWait    time.Duration
	PollInterval time.Duration

	// WatchdogInterval is how often the watchdog reads NCCL's asynchronous
	// error while an op runs. Default 10 ms.
	WatchdogInterval time.Duration

	// NVML is the NVML WatchHealth reads; nil means the real library
	// (nvml.New()). Health tunes the watch (PollInterval, EventWait,
	// CriticalXIDs, Logger); WatchHealth sets its device and OnEvent.
	NVML   nvml.Interface
	Health health.Config

	// ReleaseTimeout bounds how long the release after an abort waits for
	// the GPU to drain the comm's stream before it frees the stream and
	// scratch memory (if it does not drain, they are leaked rather than
	// freed under a running kernel). Default 10 s.
	ReleaseTimeout time.Duration
}

// DefaultConfig returns the default settings.
func DefaultConfig() Config {
	return Config{
		AbortDelay:       10 * time.Second,
		SpinWait:         200 * time.Microsecond,
		YieldWait:        20 * time.Millisecond,
		PollInterval:     100 * time.Microsecond,
		WatchdogInterval: 10 * time.Millisecond,
		ReleaseTimeout:   10 * time.Second,
	}
}

// withDefaults fills zero durations.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	for _, f := range []struct{ v, def *time.Duration }{
		{&c.AbortDelay, &d.AbortDelay}, {&c.SpinWait, &d.SpinWait}, {&c.YieldWait, &d.YieldWait},
		{&c.PollInterval, &d.PollInterval}, {&c.WatchdogInterval, &d.WatchdogInterval},
		{&c.ReleaseTimeout, &d.ReleaseTimeout},
	} {
		if *f.v == 0 {
			*f.v = *f.def
		}
	}
	return c
}

// Validate reports what is wrong with c, or nil.
func (c *Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("nccl: %w: config: "+format, append([]any{comm.ErrInvalidArgument}, args...)...)
	}
	switch {
	case c.Mode > ModeBlocking:
		return bad("unknown mode %d", c.Mode)
	case c.Revoke > RevokeAuto:
		return bad("unknown revoke mode %d", c.Revoke)
	case c.SpinWait < 0 || c.YieldWait < 0:
		return bad("negative SpinWait %s or YieldWait %s", c.SpinWait, c.YieldWait)
	case c.YieldWait != 0 && c.SpinWait > c.YieldWait:
		return bad("SpinWait %s exceeds YieldWait %s", c.SpinWait, c.YieldWait)
	case c.PollInterval < 0 || c.PollInterval > time.Second:
		return bad("PollInterval %s outside [0, 1s]", c.PollInterval)
	case c.WatchdogInterval < 0 || c.WatchdogInterval > 10*time.Second:
		return bad("WatchdogInterval %s outside [0, 10s]", c.WatchdogInterval)
	case c.ReleaseTimeout < 0:
		return bad("negative ReleaseTimeout %s", c.ReleaseTimeout)
	}
	if err := c.Health.Validate(); err != nil {
		return fmt.Errorf("nccl: config: %w", err)
	}
	return nil
}
