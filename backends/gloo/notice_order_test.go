package gloo

import (
	"context"
	"errors"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
)

// Found by test/chaos: when a peer was SIGKILLed, the survivor that saw it
// first failed its step and ft revoked the comm at once; its monitor then
// had both a fault and a revocation to tell the others and sent the
// revocation first, so a third of the survivors failed with ErrRevoked
// instead of ErrPeerFailed naming the dead rank. A rank that learned of a
// death and was then revoked must tell its peers of the death first.
func TestDeathToldBeforeRevocation(t *testing.T) {
	for range 5 {
		j := newJob(t, 4, nil)
		errs := j.run(func(r int, c *comm.Comm) error {
			switch r {
			case 1, 2: // waiting on ranks 0 and 3, which never post
				return c.AllReduce(context.Background(), comm.Float32s(make([]float32, 1<<10)), comm.Sum)
			case 0:
				waitFor(t, "ranks 1 and 2 blocked", func() bool { return inOp(j.comms[1]) && inOp(j.comms[2]) })
				// Rank 0 learns that rank 3 died, and its caller revokes
				// right after (as ft does when a step fails).
				b := backendOf(c)
				b.breakWith(faultInfo{
					nt:  notice{kind: noticePeerFailed, origin: 0, subject: 3, cause: "EOF"},
					err: &comm.RankError{Rank: 3, Epoch: b.epoch, Err: comm.ErrPeerFailed},
				})
				c.Revoke(errors.New("ft: commit failed: rank 3 failed"))
			}
			return nil
		})
		for _, r := range []int{1, 2} {
			if err := errs[r]; !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != 3 {
				t.Fatalf("rank %d: got %v, want ErrPeerFailed naming rank 3", r, err)
			}
		}
		j.close()
	}
}
