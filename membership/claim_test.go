package membership_test

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// claimLease is longer than every wait of these tests: a registration that
// waited for its previous incarnation's lease would fail them.
const claimLease = 60 * time.Second

// listen returns a listener on a fresh loopback port, closed with the test.
func listen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// joinAt joins member id at ln's address with a long lease (in group g on
// its shared lease when g is not empty), waiting for a previous
// incarnation to go, for up to wait.
func joinAt(t *testing.T, tj *clustertest.Job, id, g string, ln net.Listener, wait time.Duration) (*membership.Member, error) {
	t.Helper()
	cfg := membership.DefaultMemberConfig()
	cfg.Client = clustertest.NewClient(t, tj.Etcd)
	cfg.Job, cfg.ID, cfg.Addr, cfg.LeaseTTL, cfg.WantQuorum = tj.Name, id, ln.Addr().String(), claimLease, true
	cfg.WaitForDuplicate = true
	if g != "" {
		cfg.Group, cfg.GroupLease, cfg.GroupLinkAddr = g, true, "127.0.0.1:0"
	}
	m, err := membership.Join(clustertest.Ctx(t, wait), cfg)
	if err == nil {
		t.Cleanup(func() { m.Close() })
	}
	return m, err
}

// A process restarted after its previous incarnation died registers at
// once: the coordinator confirms the old one dead by its closed port and
// ends its registration, instead of leaving the new process to wait for
// the old lease — for a lease of its own as for its replica group's (the
// group's members all died: nobody is left to remove the others).
func TestRestartedMemberDoesNotWaitForTheLease(t *testing.T) {
	for _, group := range []string{"", "g"} {
		name := "own lease"
		if group != "" {
			name = "group lease"
		}
		t.Run(name, func(t *testing.T) {
			tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
			ids := []string{"g.0", "g.1"}
			var old []*membership.Member
			var lns []net.Listener
			for _, id := range ids {
				ln := listen(t)
				m, err := joinAt(t, tj, id, group, ln, 20*time.Second)
				if err != nil {
					t.Fatal(err)
				}
				old, lns = append(old, m), append(lns, ln)
			}
			q := clustertest.WaitQuorum(t, old[0], 0, ids...)
			// Both processes die: their ports close, their leases live on.
			for i, m := range old {
				m.Crash()
				lns[i].Close()
			}
			// Their restarts must not wait for the leases.
			var fresh []*membership.Member
			for _, id := range ids {
				m, err := joinAt(t, tj, id, group, listen(t), 15*time.Second)
				if err != nil {
					t.Fatalf("restarted %s did not register before its old lease (%v) expired: %v", id, claimLease, err)
				}
				fresh = append(fresh, m)
			}
			clustertest.WaitQuorum(t, fresh[0], q.Epoch, ids...)
		})
	}
}

// A holder that answers is another live process with the same id: the
// claim removes nothing, and the new process waits (here: gives up).
func TestClaimLeavesALiveHolder(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	live, err := joinAt(t, tj, "a.0", "", listen(t), 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	_, err = joinAt(t, tj, "a.0", "", listen(t), 2*time.Second)
	if !errors.Is(err, membership.ErrDuplicateMember) {
		t.Fatalf("a second process with a live holder's id: %v, want ErrDuplicateMember", err)
	}
	if live.Err() != nil {
		t.Fatalf("the live holder lost its registration: %v", live.Err())
	}
}
