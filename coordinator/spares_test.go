package coordinator_test

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

func asSpare(c *membership.MemberConfig) { c.Spare = true }

// setTarget changes the job's setting ftcomm.target_replicas ("-": unset).
func setTarget(t *testing.T, tj *clustertest.Job, v string) (coordinator.SettingsUpdate, error) {
	t.Helper()
	change := membership.SettingTargetReplicas + ":int=" + v
	if v == "-" {
		change = "-" + membership.SettingTargetReplicas
	}
	cs, err := membership.ParseSettingChanges([]string{change})
	if err != nil {
		t.Fatal(err)
	}
	return tj.Coord.SetSettings(clustertest.Ctx(t, 30*time.Second), tj.Name, cs, "test")
}

// The job's setting ftcomm.target_replicas, set through the coordinator,
// reaches the leader's quorum rules: raised above the job's size, a
// ready spare is promoted; unset, the target is the most replica groups
// the run had, which spares keep the job at. A value the coordinator
// cannot use is refused and changes nothing. The leader's status shows
// the target and the spares all along.
func TestTargetSettingPromotesSpares(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 1, JoinTimeout: time.Second, FormMaxWait: 300 * time.Millisecond}, false)
	a, b := tj.Join("a", nil), tj.Join("b", nil)
	q := clustertest.WaitQuorum(t, a, 0, "a", "b")
	tj.Join("s", asSpare)
	waitStatus(t, tj.Coord, tj.Name, 20*time.Second, func(st coordinator.JobStatus) bool {
		return st.Target == 2 && slices.Equal(st.Spares, []string{"s"}) && slices.Equal(st.ReadySpares, []string{"s"})
	})

	// Bad input: refused with an error, nothing stored.
	if _, err := setTarget(t, tj, "0"); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Fatalf("target 0: %v", err)
	}
	if doc, err := coordinator.NewAdmin(tj.Client, "").Settings(clustertest.Ctx(t, 10*time.Second), tj.Name); err != nil || doc.Version != 0 {
		t.Fatalf("after a refused change: %+v, %v", doc, err)
	}

	if _, err := setTarget(t, tj, "3"); err != nil {
		t.Fatal(err)
	}
	q = clustertest.WaitQuorum(t, a, q.Epoch, "a", "b", "s")
	if !slices.Equal(q.Promoted, []string{"s"}) || q.Target < 2 {
		t.Fatalf("epoch %d: promoted %v, target %d, reason %q", q.Epoch, q.Promoted, q.Target, q.Reason)
	}
	st := waitStatus(t, tj.Coord, tj.Name, 20*time.Second, func(st coordinator.JobStatus) bool {
		return st.Target == 3 && st.Spares == nil && st.Quorum != nil && st.Quorum.Epoch >= q.Epoch
	})
	if st.ReadySpares != nil || st.UnusableSpares != nil {
		t.Fatalf("status %+v", st)
	}

	// Unset: the target is the run's most, 3; a new spare waits, and
	// takes the place of a replica that leaves.
	tj.Join("t", asSpare)
	if _, err := setTarget(t, tj, "-"); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, tj.Coord, tj.Name, 20*time.Second, func(st coordinator.JobStatus) bool {
		return st.Target == 3 && slices.Equal(st.ReadySpares, []string{"t"}) && st.Quorum != nil &&
			st.Quorum.Settings != nil && st.Quorum.Settings.Version == 2
	})
	if err := b.Leave(clustertest.Ctx(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	q = clustertest.WaitQuorum(t, a, q.Epoch, "a", "s", "t")
	if !slices.Equal(q.Promoted, []string{"t"}) {
		t.Fatalf("epoch %d: promoted %v, reason %q", q.Epoch, q.Promoted, q.Reason)
	}
}

// A spare registers in the job's current run like any member
// (membership.Join): one that names another run — an ended one, or one
// that would start while the job runs — is refused by Join with
// ErrRunEnded or ErrRunBusy, registers nothing, and the leader never
// sees it as a spare.
func TestSpareOfAnotherRunIsRefused(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.Config{MinReplicas: 1, JoinTimeout: time.Second}, false)
	inRun := func(run string, start bool) func(*membership.MemberConfig) {
		return func(c *membership.MemberConfig) { c.Run, c.StartRun = run, start }
	}
	a := tj.Join("a", inRun("r1", true))
	q := clustertest.WaitQuorum(t, a, 0, "a")
	join := func(id string, mut func(*membership.MemberConfig)) error {
		cfg := membership.DefaultMemberConfig()
		cfg.Client = clustertest.NewClient(t, tj.Etcd)
		cfg.Job, cfg.ID, cfg.Addr, cfg.WantQuorum, cfg.Spare = tj.Name, id, id+".example:1", true, true
		mut(&cfg)
		m, err := membership.Join(clustertest.Ctx(t, 20*time.Second), cfg)
		if err == nil {
			m.Close()
		}
		return err
	}
	if err := join("s0", inRun("r0", false)); !errors.Is(err, membership.ErrRunEnded) {
		t.Fatalf("a spare naming a run that is not current: %v", err)
	}
	if err := join("s2", inRun("r2", true)); !errors.Is(err, membership.ErrRunBusy) {
		t.Fatalf("a spare starting a run while the job runs: %v", err)
	}
	// The run ends (its last member leaves, r2 starts): a spare of r1
	// is refused.
	ctx := clustertest.Ctx(t, 20*time.Second)
	if err := a.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	admin := coordinator.NewAdmin(tj.Client, "")
	if _, err := admin.NewRun(ctx, tj.Name, "r2", "test"); err != nil {
		t.Fatal(err)
	}
	if err := join("s1", inRun("r1", false)); !errors.Is(err, membership.ErrRunEnded) {
		t.Fatalf("a spare of an ended run: %v", err)
	}
	v, err := admin.Job(ctx, tj.Name)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range v.Members {
		t.Errorf("member %s registered (run %q)", m.ID, m.Run)
	}
	if st, ok := tj.Coord.Status(tj.Name); ok && st.Spares != nil {
		t.Fatalf("leader sees spares %v (epoch %d)", st.Spares, q.Epoch)
	}
}
