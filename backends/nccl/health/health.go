package health

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

// Kind says what an Event is about.
type Kind uint8

// The kinds of events.
const (
	KindXID    Kind = iota + 1 // an Xid error reported by the driver
	KindECC                    // uncorrected (double-bit) ECC errors
	KindNVLink                 // an NVLink that was up went down
	KindLost                   // the GPU stopped answering NVML (fell off the bus)
)

func (k Kind) String() string {
	switch k {
	case KindXID:
		return "xid"
	case KindECC:
		return "ecc"
	case KindNVLink:
		return "nvlink"
	case KindLost:
		return "lost"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Event is one fault seen on a GPU.
type Event struct {
	Time     time.Time
	Device   int    // NVML index
	UUID     string // GPU UUID
	Kind     Kind
	XID      uint64 // the Xid, for KindXID
	Link     int    // the NVLink, for KindNVLink
	Count    uint64 // uncorrected ECC errors so far (volatile), for KindECC
	Critical bool   // the GPU cannot be trusted: its member should leave the quorum
	Detail   string
}

func (e Event) String() string {
	crit := ""
	if e.Critical {
		crit = " CRITICAL"
	}
	return fmt.Sprintf("gpu %d (%s)%s %s: %s", e.Device, e.UUID, crit, e.Kind, e.Detail)
}

// DefaultCriticalXIDs are the Xids after which the GPU is not trusted
// (NVIDIA's Xid catalogue: they need a GPU reset or indicate failing
// hardware): 48 double-bit ECC, 62 internal micro-controller halt, 64 ECC
// page retirement or row remapping failure, 74 NVLink error, 79 GPU fallen
// off the bus, 95 uncontained ECC error, 119/120 GSP errors, 140
// unrecovered ECC. Application-level Xids (13, 31, 43, 45, …) are reported
// but not critical.
func DefaultCriticalXIDs() []uint64 { return []uint64{48, 62, 64, 74, 79, 95, 119, 120, 140} }

// XIDDescription names the Xids the catalogue calls out for failing or
// unreachable hardware ("" for others).
func XIDDescription(xid uint64) string {
	switch xid {
	case 48:
		return "double-bit ECC error"
	case 62:
		return "internal micro-controller halt"
	case 63:
		return "ECC page retirement or row remapping recorded"
	case 64:
		return "ECC page retirement or row remapping failure"
	case 74:
		return "NVLink error"
	case 79:
		return "GPU has fallen off the bus"
	case 92:
		return "high single-bit ECC error rate"
	case 94:
		return "contained ECC error"
	case 95:
		return "uncontained ECC error"
	case 119, 120:
		return "GSP error"
	case 140:
		return "unrecovered ECC error"
	}
	return ""
}

// Config configures a Monitor.
type Config struct {
	// Devices are the NVML indexes to watch; nil (with no BusIDs) watches
	// every GPU.
	Devices []int
	// BusIDs are GPUs to watch by PCI address, as CUDA prints it
	// (cudaDeviceGetPCIBusId: "0000:3b:00.0"), for a caller that knows
	// its GPU by CUDA ordinal: NVML's order and CUDA's may differ.
	BusIDs []string
	// PollInterval is how often ECC counters, NVLink states and
	// reachability are read. Default 1 s.
	PollInterval time.Duration
	// EventWait bounds one wait for driver events (and so how long Close
	// may take). Default 200 ms.
	EventWait time.Duration
	// CriticalXIDs: nil means DefaultCriticalXIDs().
	CriticalXIDs []uint64
	// OnEvent, if set, is called for every event from the monitor's
	// goroutines (never concurrently); it must return quickly.
	OnEvent func(Event)
	// Logger: nil logs nothing.
	Logger *zap.Logger
}

// DefaultConfig returns the default settings.
func DefaultConfig() Config {
	return Config{PollInterval: time.Second, EventWait: 200 * time.Millisecond}
}

// Validate reports what is wrong with c, or nil.
func (c *Config) Validate() error {
	switch {
	case c.PollInterval < 0:
		return fmt.Errorf("health: %w: negative PollInterval %s", comm.ErrInvalidArgument, c.PollInterval)
	case c.EventWait < 0 || c.EventWait > time.Minute:
		return fmt.Errorf("health: %w: EventWait %s outside [0, 1m]", comm.ErrInvalidArgument, c.EventWait)
	}
	for _, d := range c.Devices {
		if d < 0 {
			return fmt.Errorf("health: %w: negative device %d", comm.ErrInvalidArgument, d)
		}
	}
	return nil
}

// DeviceState is what the monitor last read from one GPU.
type DeviceState struct {
	Device            int
	UUID              string
	Name              string
	EventsSupported   bool   // the driver delivers Xid/ECC events for it
	ECCUncorrected    uint64 // volatile uncorrected ECC errors (0 if unsupported)
	ECCSupported      bool
	NVLinksActive     int
	NVLinksSeen       int // links NVML reports at all
	Lost              bool
	LastEvent         *Event
	ReadErrors        []string // NVML reads that failed (not supported ones are skipped)
	ReadAt            time.Time
	UnsupportedEvents []string
}

type device struct {
	idx       int
	h         nvml.Device
	uuid      string
	state     DeviceState
	baseECC   uint64
	activeAt0 map[int]bool // links up when the monitor started
	downLinks map[int]bool // links already reported down
	lost      bool
}

// Monitor watches GPUs through NVML. It is safe for concurrent use. Its two
// goroutines (driver events, polling) exit in Close or when the ctx given
// to Start ends.
type Monitor struct {
	lib     nvml.Interface
	cfg     Config
	log     *zap.Logger
	devs    []*device
	set     nvml.EventSet
	crit    map[uint64]bool
	events  chan Event
	critCh  chan struct{}
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	emitMu  sync.Mutex // serialises OnEvent
	mu      sync.Mutex
	first   *Event
	closeMu sync.Once
	closeEr error
}

// Start initialises NVML through lib (nvml.New() for the real library; a
// mock in tests), takes a baseline of every watched GPU and starts
// watching. Without NVML it returns an error wrapping
// comm.ErrBackendUnavailable.
func Start(ctx context.Context, lib nvml.Interface, cfg Config) (*Monitor, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	d := DefaultConfig()
	if cfg.PollInterval == 0 {
		cfg.PollInterval = d.PollInterval
	}
	if cfg.EventWait == 0 {
		cfg.EventWait = d.EventWait
	}
	if cfg.CriticalXIDs == nil {
		cfg.CriticalXIDs = DefaultCriticalXIDs()
	}
	if ret := lib.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("health: %w: nvmlInit: %s", comm.ErrBackendUnavailable, errString(lib, ret))
	}
	m := &Monitor{lib: lib, cfg: cfg, log: cfg.Logger, crit: map[uint64]bool{},
		events: make(chan Event, 64), critCh: make(chan struct{})}
	if m.log == nil {
		m.log = zap.NewNop()
	}
	for _, x := range cfg.CriticalXIDs {
		m.crit[x] = true
	}
	if err := m.setup(); err != nil {
		lib.Shutdown()
		return nil, err
	}
	ctx, m.cancel = context.WithCancel(ctx)
	m.wg.Add(2)
	go m.eventLoop(ctx)
	go m.pollLoop(ctx)
	return m, nil
}

func errString(lib nvml.Interface, r nvml.Return) string {
	if s := lib.ErrorString(r); s != "" {
		return s
	}
	return fmt.Sprintf("nvml return %d", int32(r))
}

func (m *Monitor) setup() error {
	n, ret := m.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return fmt.Errorf("health: %w: nvmlDeviceGetCount: %s", comm.ErrBackendUnavailable, errString(m.lib, ret))
	}
	idx := slices.Clone(m.cfg.Devices)
	for _, id := range m.cfg.BusIDs {
		i, err := m.indexOfBusID(n, id)
		if err != nil {
			return err
		}
		if !slices.Contains(idx, i) {
			idx = append(idx, i)
		}
	}
	if idx == nil {
		for i := range n {
			idx = append(idx, i)
		}
	}
	set, ret := m.lib.EventSetCreate()
	if ret != nvml.SUCCESS {
		m.log.Warn("no NVML event set; relying on polling", zap.String("nvml", errString(m.lib, ret)))
		set = nil
	}
	m.set = set
	for _, i := range idx {
		if i >= n {
			return fmt.Errorf("health: %w: device %d, but NVML sees %d", comm.ErrInvalidArgument, i, n)
		}
		h, ret := m.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return fmt.Errorf("health: device %d: %s", i, errString(m.lib, ret))
		}
		d := &device{idx: i, h: h, activeAt0: map[int]bool{}, downLinks: map[int]bool{}}
		d.uuid, _ = h.GetUUID()
		name, _ := h.GetName()
		d.state = DeviceState{Device: i, UUID: d.uuid, Name: name}
		if set != nil {
			want := uint64(nvml.EventTypeXidCriticalError | nvml.EventTypeDoubleBitEccError)
			sup, ret := h.GetSupportedEventTypes()
			if ret == nvml.SUCCESS && sup&want != 0 {
				if ret := h.RegisterEvents(sup&want, set); ret == nvml.SUCCESS {
					d.state.EventsSupported = true
				} else {
					d.state.UnsupportedEvents = append(d.state.UnsupportedEvents, "register: "+errString(m.lib, ret))
				}
			} else {
				d.state.UnsupportedEvents = append(d.state.UnsupportedEvents, fmt.Sprintf("supported types %#x (%s)", sup, errString(m.lib, ret)))
			}
		}
		// Baseline: errors counted before the monitor started are history.
		if v, ret := h.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); ret == nvml.SUCCESS {
			d.baseECC, d.state.ECCUncorrected, d.state.ECCSupported = v, v, true
		}
		for l := range nvml.NVLINK_MAX_LINKS {
			st, ret := h.GetNvLinkState(l)
			if ret != nvml.SUCCESS {
				continue
			}
			d.state.NVLinksSeen++
			if st == nvml.FEATURE_ENABLED {
				d.activeAt0[l] = true
				d.state.NVLinksActive++
			}
		}
		d.state.ReadAt = time.Now()
		m.devs = append(m.devs, d)
	}
	return nil
}

// parseBusID reads a PCI address "domain:bus:device.function" (hex; the
// domain may be missing, as in NVML's legacy form).
func parseBusID(s string) (domain, bus, dev uint32, err error) {
	var f uint32
	if _, err = fmt.Sscanf(s, "%x:%x:%x.%x", &domain, &bus, &dev, &f); err == nil {
		return domain, bus, dev, nil
	}
	domain = 0
	if _, err = fmt.Sscanf(s, "%x:%x.%x", &bus, &dev, &f); err == nil {
		return domain, bus, dev, nil
	}
	return 0, 0, 0, fmt.Errorf("health: %w: PCI bus id %q", comm.ErrInvalidArgument, s)
}

// indexOfBusID finds the NVML index of the GPU at PCI address id.
func (m *Monitor) indexOfBusID(n int, id string) (int, error) {
	dom, bus, dev, err := parseBusID(id)
	if err != nil {
		return 0, err
	}
	for i := range n {
		h, ret := m.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue
		}
		pci, ret := h.GetPciInfo()
		if ret == nvml.SUCCESS && pci.Domain == dom && pci.Bus == bus && pci.Device == dev {
			return i, nil
		}
	}
	return 0, fmt.Errorf("health: %w: no GPU at PCI address %s among NVML's %d", comm.ErrInvalidArgument, id, n)
}

// Events delivers every event. It is buffered; when the reader falls
// behind, non-critical events are dropped (critical ones also close
// Critical, so they are never lost).
func (m *Monitor) Events() <-chan Event { return m.events }

// Critical is closed at the first critical event.
func (m *Monitor) Critical() <-chan struct{} { return m.critCh }

// FirstCritical returns the first critical event, if there was one.
func (m *Monitor) FirstCritical() (Event, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.first == nil {
		return Event{}, false
	}
	return *m.first, true
}

// Snapshot returns the last state read from each watched GPU.
func (m *Monitor) Snapshot() []DeviceState {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]DeviceState, len(m.devs))
	for i, d := range m.devs {
		out[i] = d.state
		out[i].ReadErrors = slices.Clone(d.state.ReadErrors)
		out[i].UnsupportedEvents = slices.Clone(d.state.UnsupportedEvents)
	}
	return out
}

func (m *Monitor) emit(e Event) {
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	m.mu.Lock()
	for _, d := range m.devs {
		if d.idx == e.Device {
			ev := e
			d.state.LastEvent = &ev
		}
	}
	firstCrit := e.Critical && m.first == nil
	if firstCrit {
		ev := e
		m.first = &ev
	}
	m.mu.Unlock()
	if e.Critical {
		m.log.Error("GPU fault", zap.Stringer("event", e))
	} else {
		m.log.Warn("GPU event", zap.Stringer("event", e))
	}
	if firstCrit {
		close(m.critCh)
	}
	if m.cfg.OnEvent != nil {
		m.emitMu.Lock()
		m.cfg.OnEvent(e)
		m.emitMu.Unlock()
	}
	select {
	case m.events <- e:
	default:
		if e.Critical { // make room: a critical event beats an old one
			select {
			case <-m.events:
			default:
			}
			select {
			case m.events <- e:
			default:
			}
		}
	}
}

// eventLoop waits for driver events (Xid, double-bit ECC).
func (m *Monitor) eventLoop(ctx context.Context) {
	defer m.wg.Done()
	if m.set == nil {
		<-ctx.Done()
		return
	}
	ms := uint32(m.cfg.EventWait / time.Millisecond)
	for ctx.Err() == nil {
		data, ret := m.set.Wait(ms)
		switch ret {
		case nvml.SUCCESS:
			m.handleEvent(data)
		case nvml.ERROR_TIMEOUT:
		default:
			// Wait fails at once on some systems (no event support in a
			// VM, say): fall back to polling alone.
			m.log.Warn("NVML event wait failed; events off, polling goes on", zap.String("nvml", errString(m.lib, ret)))
			<-ctx.Done()
			return
		}
	}
}

func (m *Monitor) deviceOf(h nvml.Device) *device {
	if h == nil {
		return nil
	}
	uuid, _ := h.GetUUID()
	for _, d := range m.devs {
		if d.uuid == uuid {
			return d
		}
	}
	return nil
}

func (m *Monitor) handleEvent(data nvml.EventData) {
	d := m.deviceOf(data.Device)
	if d == nil {
		return
	}
	e := Event{Device: d.idx, UUID: d.uuid}
	switch {
	case data.EventType&nvml.EventTypeXidCriticalError != 0:
		e.Kind, e.XID = KindXID, data.EventData
		e.Critical = m.crit[data.EventData]
		e.Detail = fmt.Sprintf("Xid %d", data.EventData)
		if d := XIDDescription(data.EventData); d != "" {
			e.Detail += " (" + d + ")"
		}
	case data.EventType&nvml.EventTypeDoubleBitEccError != 0:
		e.Kind, e.Critical, e.Detail = KindECC, true, "double-bit ECC error event"
	default:
		return
	}
	m.emit(e)
}

// pollLoop reads ECC counters, NVLink states and reachability.
func (m *Monitor) pollLoop(ctx context.Context) {
	defer m.wg.Done()
	t := time.NewTicker(m.cfg.PollInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			m.Poll()
		}
	}
}

// Poll reads every watched GPU once now (the monitor also does so every
// PollInterval) and emits what changed.
func (m *Monitor) Poll() {
	for _, d := range m.devs {
		for _, e := range m.pollDevice(d) {
			m.emit(e)
		}
	}
}

func (m *Monitor) pollDevice(d *device) []Event {
	var out []Event
	var readErrs []string
	if _, ret := d.h.GetUUID(); ret == nvml.ERROR_GPU_IS_LOST || ret == nvml.ERROR_UNKNOWN {
		m.mu.Lock()
		already := d.lost
		d.lost, d.state.Lost = true, true
		m.mu.Unlock()
		if !already {
			out = append(out, Event{Device: d.idx, UUID: d.uuid, Kind: KindLost, Critical: true,
				Detail: "NVML: " + errString(m.lib, ret)})
		}
		return out
	}
	ecc, eccOK := uint64(0), false
	if v, ret := d.h.GetTotalEccErrors(nvml.MEMORY_ERROR_TYPE_UNCORRECTED, nvml.VOLATILE_ECC); ret == nvml.SUCCESS {
		ecc, eccOK = v, true
	} else if ret != nvml.ERROR_NOT_SUPPORTED {
		readErrs = append(readErrs, "ecc: "+errString(m.lib, ret))
	}
	active, seen := 0, 0
	var down []int
	for l := range nvml.NVLINK_MAX_LINKS {
		st, ret := d.h.GetNvLinkState(l)
		if ret != nvml.SUCCESS {
			continue
		}
		seen++
		if st == nvml.FEATURE_ENABLED {
			active++
		} else if d.activeAt0[l] && !d.downLinks[l] {
			down = append(down, l)
		}
	}
	m.mu.Lock()
	if eccOK {
		if ecc > d.state.ECCUncorrected && ecc > d.baseECC {
			out = append(out, Event{Device: d.idx, UUID: d.uuid, Kind: KindECC, Count: ecc, Critical: true,
				Detail: fmt.Sprintf("uncorrected ECC errors %d → %d", d.state.ECCUncorrected, ecc)})
		}
		d.state.ECCUncorrected, d.state.ECCSupported = ecc, true
	}
	for _, l := range down {
		d.downLinks[l] = true
		out = append(out, Event{Device: d.idx, UUID: d.uuid, Kind: KindNVLink, Link: l, Critical: true,
			Detail: fmt.Sprintf("NVLink %d went down (%d of %d up)", l, active, seen)})
	}
	d.state.NVLinksActive, d.state.NVLinksSeen = active, seen
	d.state.ReadErrors = readErrs
	d.state.ReadAt = time.Now()
	m.mu.Unlock()
	return out
}

// Close stops the monitor, waits for its goroutines and shuts NVML down.
// Safe to call twice.
func (m *Monitor) Close() error {
	m.closeMu.Do(func() {
		m.cancel()
		m.wg.Wait()
		var errs []error
		if m.set != nil {
			if ret := m.set.Free(); ret != nvml.SUCCESS {
				errs = append(errs, fmt.Errorf("health: event set free: %s", errString(m.lib, ret)))
			}
		}
		if ret := m.lib.Shutdown(); ret != nvml.SUCCESS {
			errs = append(errs, fmt.Errorf("health: nvmlShutdown: %s", errString(m.lib, ret)))
		}
		m.closeEr = errors.Join(errs...)
	})
	return m.closeEr
}
