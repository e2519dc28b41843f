package ncclsim

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// simNVML is the NVML of a Simulation, built on go-nvml's mock package:
// NVML device i is CUDA device i, at the PCI address the simulated CUDA
// runtime reports for it, with no NVLinks. Faults reach the event sets
// that registered the device (InjectXid) or the polled ECC counter
// (AddECCErrors).
type simNVML struct {
	lib  *mock.Interface
	devs []*mock.Device

	mu   sync.Mutex
	ecc  []uint64               // volatile uncorrected ECC errors per device
	regs map[*simEventSet][]int // live event sets → the devices registered on them
}

// simEventSet is one nvmlEventSet: events wait in ch until Wait takes them.
type simEventSet struct {
	ch chan nvml.EventData
}

// NVML returns a go-nvml Interface that sees the simulation's GPUs (NVML
// index i is CUDA ordinal i, found at the same PCI address), for
// Config.NVML: the backend's WatchHealth then watches simulated GPUs,
// driven by InjectXid and AddECCErrors. Every call returns the same
// Interface; it is safe for concurrent use.
func (w *Simulation) NVML() nvml.Interface {
	return w.simNVML().lib
}

// InjectXid makes GPU dev report Xid xid to every NVML event set that
// registered it (e.g. 79, "GPU has fallen off the bus": critical; 13, a
// graphics engine exception: not).
func (w *Simulation) InjectXid(dev int, xid uint64) {
	n := w.simNVML()
	if dev < 0 || dev >= len(n.devs) {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	for s, devs := range n.regs {
		if slices.Contains(devs, dev) {
			select {
			case s.ch <- nvml.EventData{Device: n.devs[dev], EventType: nvml.EventTypeXidCriticalError, EventData: xid}:
			default: // a full set drops the event, as a driver's queue would
			}
		}
	}
}

// AddECCErrors raises GPU dev's count of uncorrected ECC errors by count
// (a watcher polling it reports any increase as critical).
func (w *Simulation) AddECCErrors(dev int, count uint64) {
	n := w.simNVML()
	if dev < 0 || dev >= len(n.devs) {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.ecc[dev] += count
}

func (w *Simulation) simNVML() *simNVML {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.nvml == nil {
		w.nvml = newSimNVML(w.nDev)
	}
	return w.nvml
}

func newSimNVML(nDev int) *simNVML {
	n := &simNVML{ecc: make([]uint64, nDev), regs: map[*simEventSet][]int{}}
	for i := range nDev {
		n.devs = append(n.devs, &mock.Device{
			GetUUIDFunc: func() (string, nvml.Return) { return fmt.Sprintf("GPU-sim-%d", i), nvml.SUCCESS },
			GetNameFunc: func() (string, nvml.Return) { return "Simulated GPU", nvml.SUCCESS },
			GetPciInfoFunc: func() (nvml.PciInfo, nvml.Return) {
				return nvml.PciInfo{Domain: 0, Bus: uint32(simBus(i)), Device: 0}, nvml.SUCCESS
			},
			GetSupportedEventTypesFunc: func() (uint64, nvml.Return) {
				return nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError, nvml.SUCCESS
			},
			RegisterEventsFunc: func(_ uint64, set nvml.EventSet) nvml.Return {
				s, ok := set.(*simEventSetHandle)
				if !ok {
					return nvml.ERROR_INVALID_ARGUMENT
				}
				n.mu.Lock()
				defer n.mu.Unlock()
				if _, live := n.regs[s.s]; !live {
					return nvml.ERROR_INVALID_ARGUMENT
				}
				n.regs[s.s] = append(n.regs[s.s], i)
				return nvml.SUCCESS
			},
			GetTotalEccErrorsFunc: func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) {
				n.mu.Lock()
				defer n.mu.Unlock()
				return n.ecc[i], nvml.SUCCESS
			},
			GetNvLinkStateFunc: func(int) (nvml.EnableState, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED },
		})
	}
	n.lib = &mock.Interface{
		InitFunc:           func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:       func() nvml.Return { return nvml.SUCCESS },
		ErrorStringFunc:    func(r nvml.Return) string { return r.String() },
		DeviceGetCountFunc: func() (int, nvml.Return) { return len(n.devs), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i < 0 || i >= len(n.devs) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return n.devs[i], nvml.SUCCESS
		},
		EventSetCreateFunc: func() (nvml.EventSet, nvml.Return) {
			s := &simEventSet{ch: make(chan nvml.EventData, 64)}
			n.mu.Lock()
			n.regs[s] = nil
			n.mu.Unlock()
			return &simEventSetHandle{n: n, s: s}, nvml.SUCCESS
		},
	}
	return n
}

// simBus is the PCI bus of simulated GPU dev (pciBusID prints it).
func simBus(dev int) int { return 0x18 + dev }

// simEventSetHandle is the nvml.EventSet handed out.
type simEventSetHandle struct {
	n *simNVML
	s *simEventSet
}

// Wait returns the next event, or ERROR_TIMEOUT after ms milliseconds.
func (h *simEventSetHandle) Wait(ms uint32) (nvml.EventData, nvml.Return) {
	t := time.NewTimer(time.Duration(ms) * time.Millisecond)
	defer t.Stop()
	select {
	case e := <-h.s.ch:
		return e, nvml.SUCCESS
	case <-t.C:
		return nvml.EventData{}, nvml.ERROR_TIMEOUT
	}
}

// Free unregisters the set: it receives no more events.
func (h *simEventSetHandle) Free() nvml.Return {
	h.n.mu.Lock()
	defer h.n.mu.Unlock()
	delete(h.n.regs, h.s)
	return nvml.SUCCESS
}
