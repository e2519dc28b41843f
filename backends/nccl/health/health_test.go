package health

import (
	"context"
	"errors"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	"github.com/ftcomm/ftcomm/comm"
)

// fakeGPUs is a machine of GPUs behind go-nvml's mock: tests change its
// counters and links and push driver events.
type fakeGPUs struct {
	mu      sync.Mutex
	ecc     []uint64
	links   [][]nvml.EnableState
	lost    []bool
	events  chan nvml.EventData
	devs    []*mock.Device
	freed   bool
	shut    bool
	noEvent bool
}

func newFakeGPUs(n int) *fakeGPUs {
	f := &fakeGPUs{ecc: make([]uint64, n), lost: make([]bool, n), events: make(chan nvml.EventData, 8)}
	for i := range n {
		links := make([]nvml.EnableState, 4)
		for l := range links {
			links[l] = nvml.FEATURE_ENABLED
		}
		links[3] = nvml.FEATURE_DISABLED // present but never up
		f.links = append(f.links, links)
		f.devs = append(f.devs, &mock.Device{
			GetUUIDFunc: func() (string, nvml.Return) {
				f.mu.Lock()
				defer f.mu.Unlock()
				if f.lost[i] {
					return "", nvml.ERROR_GPU_IS_LOST
				}
				return "GPU-" + string(rune('a'+i)), nvml.SUCCESS
			},
			GetNameFunc: func() (string, nvml.Return) { return "Fake H200", nvml.SUCCESS },
			GetSupportedEventTypesFunc: func() (uint64, nvml.Return) {
				return nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError | nvml.EventTypeSingleBitEccError, nvml.SUCCESS
			},
			RegisterEventsFunc: func(uint64, nvml.EventSet) nvml.Return { return nvml.SUCCESS },
			GetTotalEccErrorsFunc: func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) {
				f.mu.Lock()
				defer f.mu.Unlock()
				return f.ecc[i], nvml.SUCCESS
			},
			GetNvLinkStateFunc: func(l int) (nvml.EnableState, nvml.Return) {
				f.mu.Lock()
				defer f.mu.Unlock()
				if l >= len(f.links[i]) {
					return 0, nvml.ERROR_INVALID_ARGUMENT
				}
				return f.links[i][l], nvml.SUCCESS
			},
		})
	}
	return f
}

func (f *fakeGPUs) lib() *mock.Interface {
	set := &mock.EventSet{
		WaitFunc: func(ms uint32) (nvml.EventData, nvml.Return) {
			if f.noEvent {
				return nvml.EventData{}, nvml.ERROR_NOT_SUPPORTED
			}
			select {
			case e := <-f.events:
				return e, nvml.SUCCESS
			case <-time.After(time.Duration(ms) * time.Millisecond):
				return nvml.EventData{}, nvml.ERROR_TIMEOUT
			}
		},
		FreeFunc: func() nvml.Return { f.mu.Lock(); f.freed = true; f.mu.Unlock(); return nvml.SUCCESS },
	}
	return &mock.Interface{
		InitFunc:                   func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:               func() nvml.Return { f.mu.Lock(); f.shut = true; f.mu.Unlock(); return nvml.SUCCESS },
		ErrorStringFunc:            func(r nvml.Return) string { return r.String() },
		DeviceGetCountFunc:         func() (int, nvml.Return) { return len(f.devs), nvml.SUCCESS },
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) { return f.devs[i], nvml.SUCCESS },
		EventSetCreateFunc:         func() (nvml.EventSet, nvml.Return) { return set, nvml.SUCCESS },
	}
}

func start(t *testing.T, f *fakeGPUs, cfg Config) *Monitor {
	t.Helper()
	if cfg.PollInterval == 0 {
		cfg.PollInterval = time.Hour // tests call Poll themselves
	}
	cfg.EventWait = 10 * time.Millisecond
	m, err := Start(context.Background(), f.lib(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func next(t *testing.T, m *Monitor) Event {
	t.Helper()
	select {
	case e := <-m.Events():
		return e
	case <-time.After(10 * time.Second):
		t.Fatal("no event within 10 s")
		return Event{}
	}
}

func TestBaselineAndSnapshot(t *testing.T) {
	f := newFakeGPUs(2)
	f.ecc[1] = 7 // errors from before the monitor started are not news
	m := start(t, f, Config{})
	m.Poll()
	s := m.Snapshot()
	if len(s) != 2 || s[1].ECCUncorrected != 7 || !s[1].ECCSupported || s[0].NVLinksActive != 3 || s[0].NVLinksSeen != 4 ||
		!s[0].EventsSupported || s[0].UUID != "GPU-a" || s[0].Name != "Fake H200" {
		t.Fatalf("snapshot %+v", s)
	}
	select {
	case e := <-m.Events():
		t.Fatalf("unexpected event %v", e)
	default:
	}
}

func TestXIDEvents(t *testing.T) {
	f := newFakeGPUs(2)
	var seen []Event
	var mu sync.Mutex
	m := start(t, f, Config{OnEvent: func(e Event) { mu.Lock(); seen = append(seen, e); mu.Unlock() }})
	f.events <- nvml.EventData{Device: f.devs[1], EventType: nvml.EventTypeXidCriticalError, EventData: 13}
	if e := next(t, m); e.Kind != KindXID || e.XID != 13 || e.Critical || e.Device != 1 {
		t.Fatalf("Xid 13: %+v", e)
	}
	select {
	case <-m.Critical():
		t.Fatal("Xid 13 (an application error) counted as critical")
	default:
	}
	f.events <- nvml.EventData{Device: f.devs[0], EventType: nvml.EventTypeXidCriticalError, EventData: 79}
	if e := next(t, m); !e.Critical || e.XID != 79 || e.UUID != "GPU-a" {
		t.Fatalf("Xid 79: %+v", e)
	}
	<-m.Critical()
	if e, ok := m.FirstCritical(); !ok || e.XID != 79 {
		t.Fatalf("FirstCritical = %+v %v", e, ok)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 2 {
		t.Errorf("OnEvent saw %d events, want 2", len(seen))
	}
}

func TestPolledFaults(t *testing.T) {
	f := newFakeGPUs(2)
	m := start(t, f, Config{})
	f.mu.Lock()
	f.ecc[0] = 2
	f.links[1][2] = nvml.FEATURE_DISABLED
	f.mu.Unlock()
	m.Poll()
	got := map[Kind]Event{}
	for range 2 {
		e := next(t, m)
		got[e.Kind] = e
	}
	if e := got[KindECC]; !e.Critical || e.Count != 2 || e.Device != 0 {
		t.Errorf("ECC: %+v", e)
	}
	if e := got[KindNVLink]; !e.Critical || e.Link != 2 || e.Device != 1 {
		t.Errorf("NVLink: %+v", e)
	}
	// Nothing new: no repeated events.
	m.Poll()
	select {
	case e := <-m.Events():
		t.Fatalf("repeated event %v", e)
	default:
	}
	f.mu.Lock()
	f.lost[1] = true
	f.mu.Unlock()
	m.Poll()
	if e := next(t, m); e.Kind != KindLost || !e.Critical || e.Device != 1 {
		t.Fatalf("lost: %+v", e)
	}
}

func TestPollingByItself(t *testing.T) {
	f := newFakeGPUs(1)
	f.noEvent = true // a machine whose driver delivers no events: polling alone
	m := start(t, f, Config{PollInterval: 5 * time.Millisecond})
	f.mu.Lock()
	f.ecc[0] = 1
	f.mu.Unlock()
	select {
	case <-m.Critical():
	case <-time.After(10 * time.Second):
		t.Fatal("ECC increase not noticed by the poller")
	}
}

func TestCloseAndErrors(t *testing.T) {
	f := newFakeGPUs(1)
	m, err := Start(context.Background(), f.lib(), Config{EventWait: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(m.Close(), m.Close()); err != nil {
		t.Fatal(err)
	}
	if !f.freed || !f.shut {
		t.Error("Close did not free the event set and shut NVML down")
	}
	lib := f.lib()
	lib.InitFunc = func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }
	if _, err := Start(context.Background(), lib, Config{}); !errors.Is(err, comm.ErrBackendUnavailable) {
		t.Errorf("no NVML: %v", err)
	}
	if _, err := Start(context.Background(), f.lib(), Config{Devices: []int{3}}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("device 3 of 1: %v", err)
	}
	if _, err := Start(context.Background(), f.lib(), Config{PollInterval: -1}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("bad config: %v", err)
	}
}

// TestRealNVML reads the real GPUs (skipped without FTCOMM_NVML=1).
func TestRealNVML(t *testing.T) {
	if os.Getenv("FTCOMM_NVML") == "" {
		t.Skip("set FTCOMM_NVML=1 on a machine with NVIDIA GPUs to read them through NVML")
	}
	m, err := Start(context.Background(), nvml.New(), Config{PollInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	m.Poll()
	for _, s := range m.Snapshot() {
		t.Logf("gpu %d %s %s: events %v (%v), ECC uncorrected %d (supported %v), NVLinks up %d of %d, read errors %v",
			s.Device, s.UUID, s.Name, s.EventsSupported, s.UnsupportedEvents, s.ECCUncorrected, s.ECCSupported,
			s.NVLinksActive, s.NVLinksSeen, s.ReadErrors)
	}
	select {
	case e := <-m.Events():
		t.Logf("event: %v", e)
	case <-time.After(500 * time.Millisecond):
		t.Log("no GPU events in 0.5 s (as expected on healthy GPUs)")
	}
	if e, ok := m.FirstCritical(); ok {
		t.Errorf("critical GPU fault on a machine under test: %v", e)
	}
}

func TestBusIDs(t *testing.T) {
	f := newFakeGPUs(3)
	for i, d := range f.devs {
		d.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
			return nvml.PciInfo{Domain: 0, Bus: uint32(0x40 - i), Device: 0}, nvml.SUCCESS
		}
	}
	// CUDA's form and NVML's legacy and long forms all name bus 0x3f.
	for _, id := range []string{"0000:3f:00.0", "3F:00.0", "00000000:3F:00.0"} {
		m := start(t, f, Config{BusIDs: []string{id}})
		if s := m.Snapshot(); len(s) != 1 || s[0].Device != 1 {
			t.Errorf("bus id %s: watching %+v, want NVML device 1 alone", id, s)
		}
	}
	if _, err := Start(context.Background(), f.lib(), Config{BusIDs: []string{"0000:77:00.0"}}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("a bus id no GPU has: %v", err)
	}
	if _, err := Start(context.Background(), f.lib(), Config{BusIDs: []string{"gpu0"}}); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("a malformed bus id: %v", err)
	}
	if d := XIDDescription(79); d != "GPU has fallen off the bus" || XIDDescription(13) != "" {
		t.Errorf("XIDDescription: %q", d)
	}
}
