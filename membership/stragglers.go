package membership

import (
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// StragglerPolicy takes a replica whose steps stay slow out of its job's
// quorums, so that it no longer sets the job's pace, and lets it back when
// it keeps up. Step times come from the members' heartbeats
// (Member.SetStepTime: each replica's own compute time per step, without
// the collectives that wait for the others). The zero value is off.
//
//   - Out: a participant whose step time stays above Factor times the
//     median of the other participants' for Window. Never so many that
//     fewer than MinReplicas, or half the participants, remain; the
//     slowest go first.
//   - Back: a replica that is out joins the next quorum as soon as it
//     reports a new step time within Factor of the participants' median
//     (a loop that keeps computing while it sits out), or else when its
//     probation ends (Probation, doubling with each take-out in a row up
//     to 8×), to be judged in the job again. A replica back in the job
//     that keeps up for Window starts its count of take-outs afresh.
type StragglerPolicy struct {
	// Factor: a participant is slow while its step time is above Factor
	// times the median of the other participants' (0: off; else above
	// 1).
	Factor float64 `json:"factor,omitempty"`
	// Window is how long a participant must stay slow before it is taken
	// out (0: DefaultStragglerWindow).
	Window time.Duration `json:"windowNs,omitempty"`
	// Probation is how long a replica taken out stays out unless it
	// reports keeping up sooner (0: DefaultStragglerProbation).
	Probation time.Duration `json:"probationNs,omitempty"`
}

// Defaults of StragglerPolicy's zero fields.
const (
	DefaultStragglerWindow    = 30 * time.Second
	DefaultStragglerProbation = time.Minute
)

// Validate says what is wrong with the policy, if anything.
func (p StragglerPolicy) Validate() error {
	if p.Factor < 0 || p.Factor > 0 && p.Factor <= 1 {
		return fmt.Errorf("%w: membership: straggler factor %g: want 0 (off) or above 1", comm.ErrInvalidArgument, p.Factor)
	}
	if p.Window < 0 || p.Probation < 0 {
		return fmt.Errorf("%w: membership: straggler window %v and probation %v must not be negative", comm.ErrInvalidArgument, p.Window, p.Probation)
	}
	return nil
}
