package comm

import (
	"encoding/json"
	"sync"
	"time"
)

// OpState is where an op is in its life.
type OpState uint8

// The op states, in order.
const (
	OpEnqueued OpState = iota + 1
	OpStarted
	OpDone
	OpFailed
)

func (s OpState) String() string {
	switch s {
	case OpEnqueued:
		return "enqueued"
	case OpStarted:
		return "started"
	case OpDone:
		return "done"
	case OpFailed:
		return "failed"
	}
	return "unknown"
}

// MarshalText makes OpState read as its name in JSON.
func (s OpState) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// UnmarshalText parses the names MarshalText writes.
func (s *OpState) UnmarshalText(b []byte) error {
	for v := OpEnqueued; v <= OpFailed; v++ {
		if v.String() == string(b) {
			*s = v
			return nil
		}
	}
	return invalidf("unknown op state %q", b)
}

// FlightEntry is one op as the flight recorder saw it.
type FlightEntry struct {
	Seq      uint64    `json:"seq"`
	Op       string    `json:"op"`
	DType    string    `json:"dtype,omitempty"`
	Count    int       `json:"count"`
	ReduceOp string    `json:"reduce_op,omitempty"`
	Root     int       `json:"root"` // -1 when the op has none
	Peer     int       `json:"peer"` // -1 when the op has none
	State    OpState   `json:"state"`
	Enqueued time.Time `json:"enqueued"`
	Started  time.Time `json:"started,omitzero"`
	Finished time.Time `json:"finished,omitzero"`
	Error    string    `json:"error,omitempty"`
}

// FlightDump is what Comm.FlightRecord returns and Comm.Dump encodes.
type FlightDump struct {
	Comm  string        `json:"comm"`
	Rank  int           `json:"rank"`
	Size  int           `json:"size"`
	Epoch uint64        `json:"epoch"`
	State string        `json:"state"`
	Ops   []FlightEntry `json:"ops"` // oldest first
}

// flightRecorder keeps the last len(ring) ops in a ring indexed by seq. It
// records typed values and formats only when dumped, so recording costs no
// allocation.
type flightRecorder struct {
	mu   sync.Mutex
	ring []flightRec
}

type flightRec struct {
	seq                         uint64
	op                          OpType
	dtype                       DType
	count                       int
	rop                         ReduceOp
	root, peer                  int
	state                       OpState
	enqueued, started, finished time.Time
	err                         error
}

func newFlightRecorder(n int) *flightRecorder { return &flightRecorder{ring: make([]flightRec, n)} }

func (f *flightRecorder) enqueue(seq uint64, d *opDesc, now time.Time) {
	f.mu.Lock()
	r := &f.ring[seq%uint64(len(f.ring))]
	*r = flightRec{seq: seq, op: d.kind, dtype: d.dtype(), count: d.count(), rop: d.op,
		root: d.rootOrNone(), peer: d.peerOrNone(), state: OpEnqueued, enqueued: now}
	f.mu.Unlock()
}

func (f *flightRecorder) start(seq uint64, now time.Time) {
	f.mu.Lock()
	if r := &f.ring[seq%uint64(len(f.ring))]; r.seq == seq {
		r.state, r.started = OpStarted, now
	}
	f.mu.Unlock()
}

func (f *flightRecorder) finish(seq uint64, now time.Time, err error) {
	f.mu.Lock()
	if r := &f.ring[seq%uint64(len(f.ring))]; r.seq == seq {
		r.state, r.finished, r.err = OpDone, now, err
		if err != nil {
			r.state = OpFailed
		}
	}
	f.mu.Unlock()
}

func (f *flightRecorder) entries() []FlightEntry {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []FlightEntry
	n := uint64(len(f.ring))
	var newest uint64
	for i := range f.ring {
		newest = max(newest, f.ring[i].seq)
	}
	start := uint64(1)
	if newest >= n {
		start = newest - n + 1
	}
	for s := start; s <= newest && newest > 0; s++ {
		r := f.ring[s%n]
		if r.seq != s {
			continue
		}
		e := FlightEntry{Seq: r.seq, Op: r.op.String(), Count: r.count, Root: r.root, Peer: r.peer,
			State: r.state, Enqueued: r.enqueued, Started: r.started, Finished: r.finished}
		if r.dtype.Valid() {
			e.DType = r.dtype.String()
		}
		if r.rop.Valid() {
			e.ReduceOp = r.rop.String()
		}
		if r.err != nil {
			e.Error = r.err.Error()
		}
		out = append(out, e)
	}
	return out
}

func (d FlightDump) json() []byte {
	b, err := json.Marshal(d)
	if err != nil { // cannot happen for these field types
		return []byte(`{"error":"flight recorder: ` + err.Error() + `"}`)
	}
	return b
}
