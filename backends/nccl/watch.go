package nccl

import (
	"context"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/ftcomm/ftcomm/backends/nccl/health"
	"github.com/ftcomm/ftcomm/comm"
)

// WatchHealth implements comm.HealthWatcher through NVML (subpackage
// health): Xid events, uncorrected ECC errors, NVLinks that go down and a
// GPU that stops answering, on this comm's GPU (found in NVML by its PCI
// address, since NVML's order and CUDA's may differ). Critical Xids
// (Config.Health.CriticalXIDs, default health.DefaultCriticalXIDs()), any
// new uncorrected ECC error, a lost NVLink and a lost GPU are reported as
// Critical. One goroutine calls report and exits when ctx ends, after
// shutting its NVML session down; the watch does not depend on the comm,
// so it outlives Close. Without NVML it returns an error wrapping
// comm.ErrBackendUnavailable.
func (b *Backend) WatchHealth(ctx context.Context, report func(comm.HealthEvent)) error {
	if report == nil {
		return fmt.Errorf("nccl: %w: WatchHealth with a nil report function", comm.ErrInvalidArgument)
	}
	bus, err := b.lib.PCIBusID(b.dev)
	if err != nil {
		return fmt.Errorf("nccl: %w: PCI address of device %d: %w", comm.ErrBackendUnavailable, b.dev, err)
	}
	lib := b.cfg.NVML
	if lib == nil {
		lib = nvml.New()
	}
	hc := b.cfg.Health
	hc.Devices, hc.BusIDs, hc.OnEvent = nil, []string{bus}, nil
	if hc.Logger == nil {
		hc.Logger = b.log
	}
	m, err := health.Start(ctx, lib, hc)
	if err != nil {
		return fmt.Errorf("nccl: watch device %d (%s): %w", b.dev, bus, err)
	}
	dev := b.dev
	go func() { // exits when ctx ends
		defer m.Close()
		for {
			select {
			case e := <-m.Events():
				report(healthEvent(dev, e))
			case <-ctx.Done():
				return
			}
		}
	}()
	return nil
}

// healthEvent is the comm-level view of a health event on CUDA device dev.
func healthEvent(dev int, e health.Event) comm.HealthEvent {
	reason := e.Detail
	switch e.Kind {
	case health.KindLost:
		reason = "GPU lost (" + e.Detail + ")"
	case health.KindECC:
		reason = "ECC: " + e.Detail
	}
	if e.UUID != "" {
		reason += " on " + e.UUID
	}
	return comm.HealthEvent{Device: dev, Critical: e.Critical, Reason: reason}
}
