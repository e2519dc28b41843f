package membership_test

import (
	"errors"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/test/clustertest"
)

// A job's runs: the first member names the run; a new run starts only
// while the job has no live member, clears the job's commit records, and
// takes in the members that ask for no run; an ended run's id is never
// used again, and a member of an ended run can neither register again nor
// record or read a commit.
func TestRuns(t *testing.T) {
	tj := clustertest.StartJob(t, quorum.DefaultConfig(), false)
	ctx := clustertest.Ctx(t, 30*time.Second)
	a := tj.Join("a", nil)
	first := a.Run()
	if first == "" || a.Record().Run != first {
		t.Fatalf("the first member's run %q (record %q)", first, a.Record().Run)
	}
	if _, ok, err := a.RecordCommit(ctx, 1, 1); !ok || err != nil {
		t.Fatalf("record commit: %v %v", ok, err)
	}
	// Not while a lives.
	var busy *membership.RunBusyError
	if _, err := membership.StartRun(ctx, tj.Client, "", tj.Name, "r2", "test"); !errors.As(err, &busy) ||
		busy.Current != first || len(busy.Members) != 1 || busy.Members[0] != "a" {
		t.Fatalf("a new run beside a live member: %v", err)
	}
	if err := a.Leave(ctx); err != nil {
		t.Fatal(err)
	}
	r2, err := membership.StartRun(ctx, tj.Client, "", tj.Name, "r2", "test")
	if err != nil || r2.ID != "r2" || len(r2.Ended) != 1 || r2.Ended[0] != first {
		t.Fatalf("start r2: %+v, %v", r2, err)
	}
	b := tj.Join("b", nil)
	if b.Run() != "r2" {
		t.Fatalf("b joined run %q", b.Run())
	}
	if _, ok, err := b.LastCommit(ctx); ok || err != nil {
		t.Fatalf("r2's commit records: %v %v (want none: the new run cleared them)", ok, err)
	}
	if _, ok, err := b.RecordCommit(ctx, 1, 5); !ok || err != nil {
		t.Fatalf("r2 records step 1: %v %v", ok, err)
	}
	if err := b.SetWaiting(ctx, 9, "for a holder of step 9"); err != nil || b.Record().WaitingFor != 9 {
		t.Fatalf("set waiting: %v (%+v)", err, b.Record())
	}

	// An ended run's id: neither joined nor started again.
	var ended *membership.RunEndedError
	_, err = membership.Join(ctx, memberConfig(tj, "c", first, true))
	if !errors.As(err, &ended) || ended.Run != first || ended.Current.ID != "r2" {
		t.Fatalf("joining the ended run %s: %v", first, err)
	}
	if _, err := membership.StartRun(ctx, tj.Client, "", tj.Name, "r2", "test"); !errors.Is(err, membership.ErrRunEnded) {
		t.Fatalf("starting the current run again: %v", err)
	}
	// A member whose registration is gone (a lost lease) while run r3
	// starts can record nothing, read nothing and not register again.
	if _, err := tj.Client.Delete(ctx, etcdkeys.Layout{}.Member(tj.Name, "b")); err != nil {
		t.Fatal(err)
	}
	<-b.Done()
	if _, err := membership.StartRun(ctx, tj.Client, "", tj.Name, "r3", "test"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.RecordCommit(ctx, 2, 5); !errors.As(err, &ended) || ended.Run != "r2" || ended.Current.ID != "r3" {
		t.Fatalf("b records a commit after its run ended: %v", err)
	}
	if _, _, err := b.LastCommit(ctx); !errors.Is(err, membership.ErrRunEnded) {
		t.Fatalf("b reads the commits after its run ended: %v", err)
	}
	if _, err := membership.Join(ctx, memberConfig(tj, "b", "r2", false)); !errors.Is(err, membership.ErrRunEnded) {
		t.Fatalf("b registers again in r2: %v", err)
	}
}

func memberConfig(tj *clustertest.Job, id, run string, start bool) membership.MemberConfig {
	mc := membership.DefaultMemberConfig()
	mc.Client, mc.Job, mc.ID, mc.Addr, mc.Run, mc.StartRun = tj.Client, tj.Name, id, id+":1", run, start
	return mc
}
