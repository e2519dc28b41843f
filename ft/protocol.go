package ft

import (
	"encoding/binary"
	"fmt"
	"slices"

	"github.com/ftcomm/ftcomm/comm"
)

// This file is the step protocol as pure functions of what every rank of an
// epoch knows alike: the published quorums and the records the ranks
// exchange. Comm (comm.go) is the thin driver that feeds them and does the
// I/O. See the package doc, "The step protocol", for the argument.

// planFor decides how a rank moves its comms to the view next of a quorum
// whose Base is base; held is the view of the epoch whose comms the rank
// holds (a view with no FT comm when it sat that epoch out). The
// coordinator sets Base only when every continuing participant reported
// holding base's comms, so the ranks of base's FT comm all hold the same
// comms, derived from the same quorum, and compute the same plan from
// (held.ft, next.ft). Every other rank is new to the FT comm — it sat base
// out, or never formed it and so was not in it (Base would be 0) — and
// creates its comm with comm.New, which is what both a fresh formation and
// a Grow ask of a joiner.
func planFor(base uint64, held, next view, id string, incarnation int64) (how reconfig, exclude []int) {
	if base == 0 || held.epoch != base || !held.includes(id, incarnation) {
		return freshComm, nil
	}
	return plan(held.ft, next.ft)
}

// segment says that steps From, From+1, … (up to the next segment's From)
// were committed in Epoch.
type segment struct {
	Epoch uint64
	From  int64
}

// maxSegments bounds a history: its first segment (the run's origin: the
// epoch that committed step 1), one gap standing for the segments dropped
// after it, and the newest segments, one per epoch in which the replica
// committed.
const maxSegments = 64

// history is the sequence of epochs in which a replica's committed steps
// were committed: the job's history as this replica knows it. Two replicas
// whose histories give different epochs for one step hold different
// contents for it (the state of a step is a function of the step's inputs
// and the participants of its epoch), so comparing histories is how a
// replica learns that a step it committed is not part of the job's history.
// A segment of epoch 0 is a gap: its steps' epochs were dropped.
type history []segment

// commit returns the history with step committed in epoch: h itself when
// epoch is its newest, else a new history. h is never modified, so a
// caller can compare the two (Comm re-encodes the history it serves when
// they differ). A full history keeps its first segment and turns the
// oldest segments after it into one gap.
func (h history) commit(step int64, epoch uint64) history {
	if n := len(h); n > 0 && h[n-1].Epoch == epoch {
		return h
	}
	if len(h)+1 <= maxSegments {
		out := make(history, len(h), len(h)+1)
		copy(out, h)
		return append(out, segment{Epoch: epoch, From: step})
	}
	out := make(history, 0, maxSegments)
	out = append(out, h[0], segment{Epoch: 0, From: h[1].From})
	out = append(out, h[len(h)-(maxSegments-3):]...)
	return append(out, segment{Epoch: epoch, From: step})
}

// epochOf returns the epoch in which step was committed; false when step
// is 0 (the initial state, in every history), older than the history, or
// in a gap.
func (h history) epochOf(step int64) (uint64, bool) {
	if step <= 0 {
		return 0, step == 0
	}
	i, found := slices.BinarySearchFunc(h, step, func(s segment, t int64) int {
		switch {
		case s.From < t:
			return -1
		case s.From > t:
			return 1
		}
		return 0
	})
	if !found {
		i--
	}
	if i < 0 || h[i].Epoch == 0 {
		return 0, false
	}
	return h[i].Epoch, true
}

// last returns the epoch of the newest committed step (0 when none).
func (h history) last() uint64 {
	if len(h) == 0 {
		return 0
	}
	return h[len(h)-1].Epoch
}

func (h history) encode() []byte {
	b := make([]byte, 0, 16*len(h))
	for _, s := range h {
		b = binary.LittleEndian.AppendUint64(b, s.Epoch)
		b = binary.LittleEndian.AppendUint64(b, uint64(s.From))
	}
	return b
}

func decodeHistory(b []byte) (history, error) {
	if len(b)%16 != 0 || len(b)/16 > maxSegments {
		return nil, fmt.Errorf("%w: ft: history of %d bytes", comm.ErrMismatch, len(b))
	}
	h := make(history, len(b)/16)
	for i := range h {
		h[i] = segment{Epoch: binary.LittleEndian.Uint64(b[16*i:]), From: int64(binary.LittleEndian.Uint64(b[16*i+8:]))}
		if i > 0 && h[i].From <= h[i-1].From {
			return nil, fmt.Errorf("%w: ft: history not ordered by step", comm.ErrMismatch)
		}
	}
	return h, nil
}

// diverged compares a replica's own history, at its committed step own,
// with the history of the state it is about to adopt. It returns the range
// of the replica's committed steps that are not part of that history
// (rolled back): from the earliest step the two histories give different
// epochs for — every later step of the replica's descends from it — to
// own; or ok false when there is none: the replica was merely behind. A
// step one history does not know (older than it, or in a gap) is taken as
// shared; the first segments, which both keep, still tell a replica that
// restarted the run on its own from the job's history.
func diverged(mine history, own int64, theirs history) (from, to int64, ok bool) {
	differs := func(s int64) bool {
		a, okA := mine.epochOf(s)
		b, okB := theirs.epochOf(s)
		return okA && okB && a != b
	}
	// The epochs are constant between the steps where either history
	// changes epoch: the earliest difference is at one of those.
	first := int64(0)
	check := func(s int64) {
		if s >= 1 && s <= own && (first == 0 || s < first) && differs(s) {
			first = s
		}
	}
	for _, sg := range mine {
		check(sg.From)
	}
	for _, sg := range theirs {
		check(sg.From)
	}
	check(own)
	if first == 0 {
		return 0, 0, false
	}
	return first, own, true
}

// stepRecord is what each rank tells the others after a reconfiguration:
// its committed step, the epoch that committed it, and where it serves
// its state.
type stepRecord struct {
	Step  int64
	Epoch uint64
	Addr  string
}

const (
	maxAddrLen     = 128
	stepRecordSize = 8 + 8 + 1 + maxAddrLen
)

func (r stepRecord) encode(b []byte) error {
	if len(r.Addr) > maxAddrLen {
		return fmt.Errorf("%w: ft: recovery address %q is longer than %d bytes", comm.ErrInvalidArgument, r.Addr, maxAddrLen)
	}
	clear(b[:stepRecordSize])
	binary.LittleEndian.PutUint64(b, uint64(r.Step))
	binary.LittleEndian.PutUint64(b[8:], r.Epoch)
	b[16] = byte(len(r.Addr))
	copy(b[17:], r.Addr)
	return nil
}

func decodeStepRecord(b []byte) (stepRecord, error) {
	n := int(b[16])
	if n > maxAddrLen {
		return stepRecord{}, fmt.Errorf("%w: ft: step record with a %d-byte address", comm.ErrMismatch, n)
	}
	return stepRecord{Step: int64(binary.LittleEndian.Uint64(b)), Epoch: binary.LittleEndian.Uint64(b[8:]), Addr: string(b[17 : 17+n])}, nil
}

// agreement is the outcome of a step agreement, the same at every rank.
type agreement struct {
	Step    int64    // the committed step every rank holds after healing
	Epoch   uint64   // the epoch that committed it (0: the initial state)
	Sources []string // recovery addresses of the ranks that hold it
}

// heals reports whether a rank holding (step, epoch) must heal.
func (a agreement) heals(step int64, epoch uint64) bool {
	return step != a.Step || epoch != a.Epoch
}

// agree picks the state every rank of the epoch continues from: the most
// advanced committed step, and among ranks at that step the one committed
// in the newest epoch. A step committed in an older epoch by ranks that
// later lost their peers (a collective that completed at some ranks and
// failed at others) loses to the same step committed again by a newer
// epoch: the newer epoch's participants are the ones the coordinator let go
// on, and the older step's holders roll it back (see diverged). Ranks at
// an older step simply heal forward.
func agree(recs []stepRecord) agreement {
	var a agreement
	for _, r := range recs {
		if r.Step > a.Step || (r.Step == a.Step && r.Epoch > a.Epoch) {
			a.Step, a.Epoch = r.Step, r.Epoch
		}
	}
	for _, r := range recs {
		if r.Step == a.Step && r.Epoch == a.Epoch {
			a.Sources = append(a.Sources, r.Addr)
		}
	}
	return a
}
