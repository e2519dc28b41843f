package ncclsim

import (
	"fmt"

	"github.com/ftcomm/ftcomm/backends/nccl/internal/libapi"
)

// The CUDA runtime's devices, streams and events: a stream is a queue of
// items that advances when someone polls it (or any event).

type simStream struct {
	dev   int
	items []simItem
}

type simEvent struct {
	done bool
	last *simEventItem // the latest record
}

type simItem interface {
	// step advances the item; it reports whether the item is complete.
	step(w *Simulation) bool
}

type simEventItem struct {
	ev    *simEvent
	fired bool
}

func (it *simEventItem) step(*Simulation) bool {
	it.fired = true
	if it.ev.last == it {
		it.ev.done = true
	}
	return true
}

// simWaitItem holds its stream until one record of an event has fired
// (cudaStreamWaitEvent).
type simWaitItem struct{ rec *simEventItem }

func (it *simWaitItem) step(*Simulation) bool { return it.rec.fired }

// progress advances stream s as far as it goes. A GPU runs every
// stream at once, so the streams s waits on (cudaStreamWaitEvent) are
// advanced as well: all of them, until none moves.
func (w *Simulation) progress(s *simStream) {
	for moved := true; moved; {
		moved = false
		for _, st := range w.streams {
			moved = w.advance(st) || moved
		}
	}
	w.advance(s) // a stream already destroyed, or one not yet in the map
}

// advance runs the ready items at the head of s and reports whether any ran.
func (w *Simulation) advance(s *simStream) bool {
	if w.dead[s.dev] {
		return false
	}
	n := len(s.items)
	for len(s.items) > 0 && s.items[0].step(w) {
		s.items = s.items[1:]
	}
	return len(s.items) != n
}

func (w library) RuntimeVersion() int { return 13000 }

func (w library) DriverVersion() int { return 13000 }

func (w library) DeviceCount() (int, error) {
	return w.nDev, nil
}

func (w *Simulation) checkDev(dev int) error {
	if dev < 0 || dev >= w.nDev {
		return &libapi.CUDAError{Op: "cudaSetDevice", Code: 101, Msg: "invalid device ordinal"}
	}
	return nil
}

func (w *Simulation) stream(dev int, s libapi.Stream, what string) (*simStream, error) {
	if s == 0 {
		// The legacy default stream of dev (PyTorch's default stream is
		// this handle): a plain stream here, made on first use.
		if err := w.checkDev(dev); err != nil {
			return nil, err
		}
		if w.nullStreams == nil {
			w.nullStreams = map[int]libapi.Stream{}
		}
		h, ok := w.nullStreams[dev]
		if !ok {
			h = libapi.Stream(w.handle())
			w.streams[h] = &simStream{dev: dev}
			w.nullStreams[dev] = h
		}
		s = h
	}
	st := w.streams[s]
	if st == nil {
		w.faultf("%s: unknown stream %#x", what, s)
		return nil, &libapi.CUDAError{Op: what, Code: 400, Msg: "invalid resource handle"}
	}
	return st, nil
}

func (w library) PCIBusID(dev int) (string, error) {
	if err := w.checkDev(dev); err != nil {
		return "", err
	}
	return fmt.Sprintf("0000:%02x:00.0", simBus(dev)), nil
}

func (w library) StreamCreate(dev int) (libapi.Stream, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if err := w.checkDev(dev); err != nil {
		return 0, err
	}
	s := libapi.Stream(w.handle())
	w.streams[s] = &simStream{dev: dev}
	return s, nil
}

func (w library) StreamDestroy(dev int, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaStreamDestroy")
	if err != nil {
		return err
	}
	if len(st.items) > 0 {
		w.faultf("cudaStreamDestroy of a stream with %d items still queued", len(st.items))
	}
	delete(w.streams, s)
	return nil
}

func (w library) StreamQuery(dev int, s libapi.Stream) (bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaStreamQuery")
	if err != nil {
		return false, err
	}
	w.progress(st)
	return len(st.items) == 0, nil
}

func (w library) EventCreate(dev int, timing bool) (libapi.Event, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	ev := libapi.Event(w.handle())
	w.events[ev] = &simEvent{}
	return ev, nil
}

func (w library) EventDestroy(dev int, ev libapi.Event) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	delete(w.events, ev)
	return nil
}

func (w library) EventRecord(dev int, ev libapi.Event, s libapi.Stream) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaEventRecord")
	if err != nil {
		return err
	}
	e := w.events[ev]
	e.done = false
	e.last = &simEventItem{ev: e}
	st.items = append(st.items, e.last)
	return nil
}

func (w library) StreamWaitEvent(dev int, s libapi.Stream, ev libapi.Event) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	st, err := w.stream(dev, s, "cudaStreamWaitEvent")
	if err != nil {
		return err
	}
	e := w.events[ev]
	if e == nil {
		w.faultf("cudaStreamWaitEvent: unknown event %#x", ev)
		return &libapi.CUDAError{Op: "cudaStreamWaitEvent", Code: 400, Msg: "invalid resource handle"}
	}
	if e.last != nil && !e.last.fired { // a never-recorded event is complete
		st.items = append(st.items, &simWaitItem{rec: e.last})
	}
	return nil
}

func (w library) EventQuery(ev libapi.Event) (bool, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, st := range w.streams {
		w.progress(st)
	}
	return w.events[ev].done, nil
}

func (w library) EventElapsed(start, end libapi.Event) (float32, error) { return 0.5, nil }
