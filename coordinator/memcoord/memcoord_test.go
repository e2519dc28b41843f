package memcoord_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/ftcomm/ftcomm/coordinator/memcoord"
	"github.com/ftcomm/ftcomm/membership"
)

// next waits for m's next quorum after epoch.
func next(t *testing.T, m *memcoord.Member, epoch uint64) membership.Quorum {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		ch := m.Changed()
		if q, ok := m.Quorum(); ok && q.Epoch > epoch {
			return q
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("%s: no quorum after epoch %d", m.ID(), epoch)
		}
	}
}

func ids(q membership.Quorum) string { return fmt.Sprint(q.Participants) }

// The machine's decisions reach every member: joins, a removal (with a
// revocation of the broken epoch), a severed member's lost reports, a
// commit failure forcing the next epoch, and durable commit records.
func TestCoordinator(t *testing.T) {
	cfg := quorum.Config{MinReplicas: 2, JoinTimeout: time.Second}
	c := memcoord.New("job", cfg)
	defer c.Close()
	a, b := c.Join("a.0", "a", 0), c.Join("b.0", "b", 0)
	q1 := next(t, a, 0)
	if len(q1.Participants) != 2 {
		t.Fatalf("first quorum %v", ids(q1))
	}
	if q := next(t, b, 0); q.Epoch != q1.Epoch {
		t.Fatalf("b saw epoch %d, a %d", q.Epoch, q1.Epoch)
	}
	ctx := context.Background()
	cc := c.Join("c.0", "c", 0)
	q2 := next(t, a, q1.Epoch)
	if len(q2.Participants) != 3 || q2.Added[0] != "c.0" {
		t.Fatalf("after c joined: %+v", q2)
	}
	if err := a.ReportCommitFailure(ctx, q2.Epoch, "c.0"); err != nil {
		t.Fatal(err)
	}
	q3 := next(t, b, q2.Epoch)
	if r, ok := c.Record("a.0"); !ok || r.CommitFailed != q2.Epoch || len(r.Blamed) != 1 {
		t.Fatalf("a's record %+v", r)
	}
	c.Sever("c.0")
	if err := cc.ReportFormed(ctx, q3.Epoch); err != memcoord.ErrSevered {
		t.Fatalf("a severed member's report: %v", err)
	}
	c.Remove("c.0", quorum.PortClosed)
	q4 := next(t, a, q3.Epoch)
	if len(q4.Participants) != 2 {
		t.Fatalf("after c was removed: %v", ids(q4))
	}
	if _, ok := a.Revocation(q3.Epoch); !ok {
		t.Errorf("epoch %d, which lost c, was not revoked", q3.Epoch)
	}
	select {
	case <-cc.Done():
	default:
		t.Error("the removed member's Done is open")
	}
	if _, ok, _ := a.RecordCommit(ctx, 1, q4.Epoch); !ok {
		t.Fatal("the first record of step 1 was refused")
	}
	if rec, ok, _ := b.RecordCommit(ctx, 1, q4.Epoch+1); ok || rec.Epoch != q4.Epoch {
		t.Fatalf("step 1 recorded twice: %+v %v", rec, ok)
	}
	if last, ok, _ := b.LastCommit(ctx); !ok || last.Step != 1 {
		t.Fatalf("last commit %+v %v", last, ok)
	}
	b.Close()
	b.Close()
	if _, ok := c.Record("b.0"); ok {
		t.Fatal("b is still a member after Close")
	}
}
