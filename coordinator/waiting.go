package coordinator

import (
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/membership"
)

// noteStalled keeps the set of a job's members that wait for a holder of
// a step the job committed (MemberRecord.WaitingFor), for the metric
// ftcomm_coordinator_waiting_members and the log; r is the member's new
// record (one with no WaitingFor when it left).
func (l *leadership) noteStalled(job string, j *jobState, r membership.MemberRecord) {
	waits := r.WaitingFor > 0 && r.Evicted == "" && !r.Leaving
	if waits == j.stalled[r.ID] {
		return
	}
	if waits {
		if j.stalled == nil {
			j.stalled = map[string]bool{}
		}
		j.stalled[r.ID] = true
		l.c.lg.Warn("member waits for a holder of a committed step", zap.String("job", job), zap.String("member", r.ID),
			zap.Int64("step", r.WaitingFor), zap.String("why", r.Waiting))
	} else {
		delete(j.stalled, r.ID)
	}
	l.c.metrics.stalled.WithLabelValues(job).Set(float64(len(j.stalled)))
}
