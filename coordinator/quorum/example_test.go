package quorum_test

import (
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership"
)

// Three members ask in; one dies. The machine decides each epoch from
// what it was told, with the time as an input.
func Example() {
	now := time.Unix(0, 0)
	m := quorum.NewMachine("job", quorum.Config{MinReplicas: 2, JoinTimeout: time.Second}, nil)
	for i, id := range []string{"a", "b", "c"} {
		m.Upsert(now, membership.MemberRecord{ID: id, Incarnation: int64(i + 1), WantQuorum: true})
	}
	d := m.Advance(now.Add(quorum.DefaultFormWindow)) // once joins are quiet
	fmt.Println(d.Quorum.Epoch, len(d.Quorum.Participants), d.Quorum.Reason)
	m.Published(*d.Quorum)

	m.Remove(now, "c", 0, quorum.Removal{Cause: quorum.GossipDeath})
	d = m.Advance(now.Add(quorum.DefaultLossWindow)) // once losses are quiet
	fmt.Println(d.Quorum.Epoch, len(d.Quorum.Participants), d.Quorum.Reason)
	fmt.Println("revoke", d.Revocation.Epoch, d.Revocation.Failed)
	// Output:
	// 1 3 initial quorum
	// 2 2 c died (gossip)
	// revoke 1 [c]
}
