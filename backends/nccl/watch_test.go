package nccl

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	"github.com/ftcomm/ftcomm/backends/nccl/health"
	"github.com/ftcomm/ftcomm/comm"
)

// nvmlMachine is go-nvml's mock of a machine whose NVML order is the
// reverse of CUDA's: NVML device i is the simulation's CUDA device n-1-i
// (it puts CUDA device d at PCI bus 0x18+d).
type nvmlMachine struct {
	mu     sync.Mutex
	ecc    []uint64
	links  [][]nvml.EnableState
	events chan nvml.EventData
	devs   []*mock.Device
	shut   int
}

func newNVMLMachine(n int) *nvmlMachine {
	m := &nvmlMachine{ecc: make([]uint64, n), events: make(chan nvml.EventData, 8)}
	for i := range n {
		cuda := n - 1 - i
		m.links = append(m.links, []nvml.EnableState{nvml.FEATURE_ENABLED, nvml.FEATURE_ENABLED})
		m.devs = append(m.devs, &mock.Device{
			GetUUIDFunc: func() (string, nvml.Return) { return "GPU-nvml" + string(rune('0'+i)), nvml.SUCCESS },
			GetNameFunc: func() (string, nvml.Return) { return "Fake H100", nvml.SUCCESS },
			GetPciInfoFunc: func() (nvml.PciInfo, nvml.Return) {
				return nvml.PciInfo{Domain: 0, Bus: uint32(0x18 + cuda), Device: 0}, nvml.SUCCESS
			},
			GetSupportedEventTypesFunc: func() (uint64, nvml.Return) {
				return nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError, nvml.SUCCESS
			},
			RegisterEventsFunc: func(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS },
			GetTotalEccErrorsFunc: func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) {
				m.mu.Lock()
				defer m.mu.Unlock()
				return m.ecc[i], nvml.SUCCESS
			},
			GetNvLinkStateFunc: func(l int) (nvml.EnableState, nvml.Return) {
				m.mu.Lock()
				defer m.mu.Unlock()
				if l >= len(m.links[i]) {
					return 0, nvml.ERROR_INVALID_ARGUMENT
				}
				return m.links[i][l], nvml.SUCCESS
			},
		})
	}
	return m
}

func (m *nvmlMachine) lib() *mock.Interface {
	return &mock.Interface{
		InitFunc:                   func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:               func() nvml.Return { m.mu.Lock(); m.shut++; m.mu.Unlock(); return nvml.SUCCESS },
		ErrorStringFunc:            func(r nvml.Return) string { return r.String() },
		DeviceGetCountFunc:         func() (int, nvml.Return) { return len(m.devs), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) { return m.devs[i], nvml.SUCCESS },
		EventSetCreateFunc: func() (nvml.EventSet, nvml.Return) {
			return &mock.EventSet{
				WaitFunc: func(ms uint32) (nvml.EventData, nvml.Return) {
					select {
					case e := <-m.events:
						return e, nvml.SUCCESS
					case <-time.After(time.Duration(ms) * time.Millisecond):
						return nvml.EventData{}, nvml.ERROR_TIMEOUT
					}
				},
				FreeFunc: func() nvml.Return { return nvml.SUCCESS },
			}, nvml.SUCCESS
		},
	}
}

func TestWatchHealth(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	m := newNVMLMachine(2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.NVML = m.lib()
		c.Health = health.Config{PollInterval: 5 * time.Millisecond, EventWait: 5 * time.Millisecond}
	})
	hw, ok := ranks[0].c.Backend().(comm.HealthWatcher)
	if !ok {
		t.Fatal("the nccl backend is not a comm.HealthWatcher")
	}
	wctx, stop := context.WithCancel(ctx)
	events := make(chan comm.HealthEvent, 16)
	if err := hw.WatchHealth(wctx, func(e comm.HealthEvent) { events <- e }); err != nil {
		t.Fatal(err)
	}
	next := func() comm.HealthEvent {
		t.Helper()
		select {
		case e := <-events:
			return e
		case <-time.After(10 * time.Second):
			t.Fatal("no health event within 10 s")
			return comm.HealthEvent{}
		}
	}
	// CUDA device 0 is NVML device 1: an Xid on NVML device 0 is another
	// GPU's and is not reported.
	m.events <- nvml.EventData{Device: m.devs[0], EventType: nvml.EventTypeXidCriticalError, EventData: 79}
	m.events <- nvml.EventData{Device: m.devs[1], EventType: nvml.EventTypeXidCriticalError, EventData: 13}
	if e := next(); e.Critical || e.Device != 0 || !strings.Contains(e.Reason, "Xid 13") {
		t.Errorf("Xid 13: %+v, want a non-critical event of device 0", e)
	}
	m.events <- nvml.EventData{Device: m.devs[1], EventType: nvml.EventTypeXidCriticalError, EventData: 79}
	if e := next(); !e.Critical || !strings.Contains(e.Reason, "Xid 79 (GPU has fallen off the bus)") || !strings.Contains(e.Reason, "GPU-nvml1") {
		t.Errorf("Xid 79: %+v", e)
	}
	m.mu.Lock()
	m.ecc[1] = 3
	m.mu.Unlock()
	if e := next(); !e.Critical || !strings.Contains(e.Reason, "ECC") {
		t.Errorf("uncorrected ECC: %+v", e)
	}
	m.mu.Lock()
	m.links[1][1] = nvml.FEATURE_DISABLED
	m.mu.Unlock()
	if e := next(); !e.Critical || !strings.Contains(e.Reason, "NVLink 1") {
		t.Errorf("NVLink down: %+v", e)
	}
	// The watch outlives the comm, and ends with its ctx.
	closeJob(t, ranks)
	m.mu.Lock()
	m.ecc[1] = 4
	m.mu.Unlock()
	if e := next(); !e.Critical {
		t.Errorf("after Close: %+v", e)
	}
	stop()
	eventually(t, "the watch to shut NVML down", func() bool { m.mu.Lock(); defer m.mu.Unlock(); return m.shut == 1 })
}

func TestWatchHealthErrors(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 1)
	m := newNVMLMachine(1)
	lib := m.lib()
	lib.InitFunc = func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }
	ranks := startJob(t, ctx, simLibrary(w), devs(1), 1, "job", func(c *Config, o *comm.Options) { c.NVML = lib })
	hw := ranks[0].c.Backend().(comm.HealthWatcher)
	if err := hw.WatchHealth(ctx, func(comm.HealthEvent) {}); !errors.Is(err, comm.ErrBackendUnavailable) {
		t.Errorf("without NVML: %v, want ErrBackendUnavailable", err)
	}
	if err := hw.WatchHealth(ctx, nil); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("nil report: %v", err)
	}
	// NVML does not see the comm's GPU.
	other := newNVMLMachine(1)
	other.devs[0].GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) { return nvml.PciInfo{Bus: 0x99}, nvml.SUCCESS }
	ranks[0].c.Backend().(*Backend).cfg.NVML = other.lib()
	if err := hw.WatchHealth(ctx, func(comm.HealthEvent) {}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("GPU not in NVML: %v", err)
	}
}
