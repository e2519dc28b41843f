package membership_test

import (
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// A member that blamed a peer dials it, and says in its record once the
// peer answers (the link works again): the coordinator ends the blame's
// hold then, not after a fixed time.
func TestBlamedPeerReachedAgain(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	ln := listen(t)
	a, err := joinAt(t, tj, "a.0", "", listen(t), 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := joinAt(t, tj, "b.0", "", ln, 20*time.Second); err != nil {
		t.Fatal(err)
	}
	q := clustertest.WaitQuorum(t, a, 0, "a.0", "b.0")
	ctx := clustertest.Ctx(t, 20*time.Second)
	if err := a.ReportCommitFailure(ctx, q.Epoch, "b.0"); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, ctx, "a's record saying it reached b.0 again", func() bool { return a.Record().Reached["b.0"] == q.Epoch })
}
