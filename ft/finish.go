package ft

import (
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// The step machine at the run's end and at Close: Finish, the wait
// for replicas behind the final step, a heal to the final step, and
// closing every comm.

// onFinish: the training loop ended the run at its committed step. This
// rank serves that state from now until Close, which waits (Config.
// Timeout at most) until no replica behind the final step is left to
// heal from it.
func (m *machine) onFinish(now time.Time) {
	if m.phase != phaseIdle || m.task != 0 {
		m.do(finishDone{err: fmt.Errorf("%w: ft: Finish between Commit and Step only", comm.ErrInvalidArgument)})
		return
	}
	m.finishing = true
	m.closeHeld()
	m.do(offerState{step: m.step, hist: m.hist})
	m.do(finishDone{})
}

// lingering reports whether Close still waits, after Finish, for replicas
// behind the final step: the latest quorum of the finished run still has
// participants (those that did not finish), and the wait's bound has not
// passed.
func (m *machine) lingering(now time.Time) bool {
	if !m.finishing || m.lingerUntil.IsZero() || !now.Before(m.lingerUntil) {
		return false
	}
	q := m.latest
	return q == nil || q.Final == 0 || len(q.Participants) > 0
}

// onFinalHealed: the final state arrived (or not); the run is over either
// way. A rank that holds the final state says so, and serves it too.
func (m *machine) onFinalHealed(now time.Time, in stateHealed) {
	if in.err != nil {
		m.logf(true, "could not heal to the run's final step %d (staying at %d): %v", m.final, m.step, in.err)
		return
	}
	from := m.step
	m.hist, m.step = in.hist, m.final
	m.do(setStep{step: m.step})
	m.emit(Event{Kind: EventHealed, Epoch: m.epoch, FromStep: from, Bytes: in.bytes, Took: in.took})
	m.finishing = true
	m.do(offerState{step: m.step, hist: m.hist})
	m.do(reportFinish{step: m.step})
}

// finishClose closes every comm once no task runs, and answers the
// training loop.
func (m *machine) finishClose() {
	m.closeHeld()
	switch m.phase {
	case phaseStepping:
		m.do(stepDone{err: ErrClosed})
	case phaseCommitting:
		m.do(commitDone{err: ErrClosed})
	}
	m.phase, m.life = phaseIdle, closed
	m.do(stopped{})
}
