package ft

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// The step machine on news that its epoch is over: a newer quorum (a
// member gone, or a grow to prepare), a revocation, a comm that failed.
// Each stops the comms that could wait for a lost peer, and blames it.

// onQuorum takes a newer quorum: a prepared grow it supersedes is
// dropped, a reconfiguration toward an older epoch cancelled, and comms
// that hold a member the quorum lost are revoked at once.
func (m *machine) onQuorum(now time.Time, q membership.Quorum) {
	if m.latest != nil && q.Epoch <= m.latest.Epoch {
		return
	}
	m.latest = &q
	m.final = max(m.final, q.Final)
	m.do(observe{what: metricEpochSeen, value: float64(q.Epoch)})
	if m.prep != nil {
		m.dropPrep(fmt.Errorf("ft: epoch %d superseded by %d", m.prep.epoch, q.Epoch))
	}
	if m.task != 0 && m.stage.reconfiguring() && q.Epoch > m.target.Epoch && !m.growsFormed(q) {
		m.cancel(fmt.Errorf("ft: epoch %d superseded by %d", m.target.Epoch, q.Epoch))
	}
	if q.Epoch <= m.epoch {
		return
	}
	// A member of the current comms is gone: revoke them at once, so no
	// survivor waits out a collective timeout for it. One that departed
	// (left or finished after its last step) is not waited for by any op
	// still running, and an op that needed it ends by its connection.
	gone := func(members []participant) bool {
		return slices.ContainsFunc(members, func(p participant) bool {
			return p.ID != "" && !q.Includes(p.ID, p.Incarnation) && !slices.Contains(q.Departed, p.ID)
		})
	}
	cause := fmt.Sprintf("ft: epoch %d: %s", q.Epoch, q.Reason)
	if m.holds(dimFT) && gone(m.view.ft) {
		m.revoke(dimFT, partBoth, cause)
	}
	if m.holds(dimGroup) && gone(m.view.group) {
		m.revoke(dimGroup, partBoth, cause)
	}
	if m.prepare(now, q) {
		return // the step in flight goes on: its peers step on too
	}
	// A new epoch in the middle of a step: FT peers that had not started
	// it move on and never post their part of its ops. gloo sees that as a
	// mismatch, but a device comm waits for them until the op's Timeout,
	// so the step's device ops stop now. Only the FT data comm: the
	// control comms keep the replica group's vote whole (a vote cut at one
	// rank but not the other would split the group's commit), and the
	// group's ranks started this step together (the gate), so a group-mate
	// still here posts its part of the group's ops (one that is gone
	// revoked the group's comms above).
	if m.phase == phaseInStep && m.split[dimFT] {
		m.revoke(dimFT, partData, fmt.Sprintf("ft: epoch %d began mid-step: the old epoch's device ops may wait for peers that moved on", q.Epoch))
	}
}

func (m *machine) onRevocation(r membership.Revocation) {
	if r.Epoch != m.epoch || r.Epoch <= m.revoked || !m.holds(dimFT) {
		return
	}
	m.revoked = r.Epoch
	m.revoke(dimFT, partBoth, fmt.Sprintf("ft: epoch %d revoked by %s: %s", r.Epoch, r.By, r.Reason))
}

// onCommFailed acts on a comm that stopped: the step's comms that could
// wait for the failed peer stop at once, and the peer the failure names is
// blamed, so the coordinator can confirm the death without waiting for
// gossip or its lease. A failed control comm fails the step; a peer that
// merely closed its comm after the ops that needed it fails nothing.
func (m *machine) onCommFailed(in commFailed) {
	if m.prep != nil && in.dim == dimFT && in.epoch == m.prep.epoch {
		m.prepBroken(in)
		return
	}
	if m.life != running || in.epoch != m.commsEpoch(in.dim) || !m.holds(in.dim) {
		return
	}
	m.comms = commsBroken
	orderly := errors.Is(in.err, comm.ErrPeerClosed)
	if m.phase == phaseInStep && !orderly && m.split[in.dim] {
		// The step's own ops report their errors through Commit; a comm
		// that broke after they completed does not undo them (revoking
		// the epoch is the coordinator's policy, not a failure of the
		// step). But a control comm that failed (not revoked) leaves the
		// step's vote nothing to stand on, and the loop's own ops on the
		// group's data comm (Group()) are not tracked: either fails the
		// step.
		err := fmt.Errorf("ft: %s %s comm: %w", in.dim, in.part, in.err)
		switch {
		case in.dim == dimFT && in.part == partCtl && !errors.Is(in.err, comm.ErrRevoked):
			m.stepErrs = append(m.stepErrs, err)
		case in.dim == dimGroup && in.part == partData:
			m.groupErrs = append(m.groupErrs, err)
		}
	}
	if m.split[in.dim] && in.part == partCtl {
		// The data comm's ops would wait for the failed peer (NCCL sees
		// no failure of its own). The group's control comm is never
		// stopped: it carries the group's vote.
		m.revoke(in.dim, partData, fmt.Sprintf("ft: the %s control comm failed: %v", in.dim, in.err))
	}
	if orderly {
		return
	}
	// Peers it hears nothing from at all are blamed too: when one rank's
	// op fails on a cut link, the others' ops end by the revocation and
	// name no one, and the coordinator would see the cut from one side.
	silent := m.blameSilent(in.silent)
	if ids := m.newlyBlamed(in.dim, []error{in.err}); len(ids) > 0 {
		m.do(revokeEpoch{epoch: m.epoch, reason: fmt.Sprintf("%s %s comm failed: %v", in.dim, in.part, in.err), blamed: append(ids, silent...)})
	} else if m.phase != phaseInStep && (!errors.Is(in.err, comm.ErrRevoked) || len(silent) > 0) {
		// Broken between steps: make sure the next step gets a new
		// epoch, and say whom this rank cannot hear.
		m.do(reportFailure{epoch: m.epoch, blamed: m.blamed})
	}
}

// newlyBlamed maps the ranks named by errs' peer failures in dim's comms
// to member ids this rank has not blamed in the epoch yet.
func (m *machine) newlyBlamed(d dim, errs []error) []string {
	members := m.view.ft
	if d == dimGroup {
		members = m.view.group
	}
	var ids []string
	for _, err := range errs {
		if !errors.Is(err, comm.ErrPeerFailed) || errors.Is(err, comm.ErrPeerClosed) {
			continue
		}
		for _, r := range comm.FailedRanks(err) {
			if r < 0 || r >= len(members) || members[r].ID == "" || members[r].ID == m.cfg.id {
				continue
			}
			if id := members[r].ID; !slices.Contains(m.blamed, id) {
				m.blamed = append(m.blamed, id)
				ids = append(ids, id)
			}
		}
	}
	return ids
}
