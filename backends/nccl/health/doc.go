// Package health watches NVIDIA GPUs through NVML (github.com/NVIDIA/go-nvml)
// so that a member whose GPU is failing can leave the quorum on its own
// before it hangs its peers' collectives.
//
// What is watched, per GPU:
//   - driver events: Xid errors and double-bit ECC errors (nvmlEventSetWait);
//     an Xid in Config.CriticalXIDs (DefaultCriticalXIDs()) is critical;
//   - polled every Config.PollInterval: the volatile count of uncorrected
//     ECC errors (any increase is critical), the state of every NVLink that
//     was up at Start (one going down is critical), and whether the GPU still
//     answers (ERROR_GPU_IS_LOST is critical).
//
// Lifecycle: Start initialises NVML, reads a baseline and starts two
// goroutines (event wait, polling), which exit in Close or when Start's ctx
// ends. Events are delivered on Events (buffered, never closed), to
// Config.OnEvent if set, and the first critical one closes Critical, so a
// caller can simply select on it:
//
//	mon, err := health.Start(ctx, nvml.New(), health.DefaultConfig())
//	…
//	select {
//	case <-mon.Critical():
//		ev, _ := mon.FirstCritical()
//		member.Leave(ctx, ev.String()) // the membership layer's job, not this package's
//	case …:
//	}
//
// This package imports no membership code (imports flow backends → comm);
// whoever owns the member wires Critical to leaving the quorum.
//
// Concurrency: every method is safe for concurrent use. OnEvent is called
// from the monitor's goroutines, never concurrently, and must return
// quickly. Without NVML (no driver, no GPU), Start returns an error
// wrapping comm.ErrBackendUnavailable. Tests drive the monitor with
// go-nvml's mock package.
package health
