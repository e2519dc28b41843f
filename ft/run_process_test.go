package ft

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/membership"
)

// A new run of a job whose earlier run committed steps, between
// processes, with DurableCommit (the run's steps recorded) and by default
// (the coordinator's quorums carry how far the run got). Fresh replicas of
// the job that say nothing of a run fail at once, saying why and what to
// do, instead of restarting the run's history from step 0 under its name
// (by default, before) or waiting forever for a holder of the old run's
// last step (DurableCommit, before). A new run started by the replicas
// (ft.Config.Run) or by an operator (`ftcoord job new-run`, here its
// Admin.NewRun) trains from step 1.
func TestProcessNewRunOfAnOldJob(t *testing.T) {
	if testing.Short() {
		t.Skip("starts replica processes")
	}
	t.Run("durable", func(t *testing.T) { testNewRunOfAnOldJob(t, "FTCOMM_FT_DURABLE=1") })
	t.Run("default", func(t *testing.T) { testNewRunOfAnOldJob(t) })
}

func testNewRunOfAnOldJob(t *testing.T, mode ...string) {
	j := newProcJob(t)
	spawn := func(group string, env ...string) {
		j.spawnCmd(exec.Command(os.Args[0], "-test.run=^$"), group, 0, 1, 1024, append(mode, env...)...)
	}
	// runStart waits until each of ids has committed a step and returns
	// the run's first commit: whichever replica made it, step 1.
	runStart := func(what string, ids ...string) childEvent {
		t.Helper()
		var first *childEvent
		seen := map[string]bool{}
		j.await(what, func(ev childEvent) bool {
			if ev.Kind == "error" {
				t.Fatalf("%s: %s failed: %s", what, ev.ID, ev.Err)
			}
			if ev.Kind == "" && strings.Contains(strings.Join(ids, " "), ev.ID) {
				if first == nil {
					first = &ev
				}
				seen[ev.ID] = true
			}
			return len(seen) == len(ids)
		})
		return *first
	}

	// The first run commits a few steps.
	spawn("a")
	spawn("b")
	seen := map[string]bool{}
	j.await("the first run's step 5 at a and b", func(ev childEvent) bool {
		if ev.Kind == "" && ev.Step >= 5 && ev.Participants == 2 {
			seen[ev.ID] = true
		}
		return len(seen) == 2
	})
	// By default the coordinator knows how far the run got from the
	// members' heartbeats (every second here): once one carried step 5.
	awaitReportedStep(t, j.endpoints, "proc", 5)
	j.stopAll()

	// Fresh replicas of the job, as the old run's were started.
	spawn("c")
	spawn("d")
	failed := map[string]string{}
	j.await("the fresh replicas' errors", func(ev childEvent) bool {
		if ev.ID != "c.0" && ev.ID != "d.0" {
			return false // the old run's last words
		}
		switch ev.Kind {
		case "":
			t.Fatalf("%s committed step %d over the old run's records", ev.ID, ev.Step)
		case "error":
			failed[ev.ID] = ev.Err
		}
		return len(failed) == 2
	})
	for id, err := range failed {
		if !strings.Contains(err, "no participant of this epoch holds any step") || !strings.Contains(err, "ft.Config.Run") ||
			!strings.Contains(err, "ftcoord job new-run") {
			t.Errorf("%s: %s", id, err)
		}
	}
	j.stopAll()

	// A new run, started by its replicas: from step 1, over the old records.
	spawn("e", "FTCOMM_FT_RUN=second")
	spawn("f", "FTCOMM_FT_RUN=second")
	if ev := runStart("the second run's commits", "e.0", "f.0"); ev.Step != 1 {
		t.Errorf("the second run began with step %d (%+v)", ev.Step, ev)
	}
	j.stopAll()

	// A new run, started by an operator once the last run's replicas are
	// gone; replicas that name no run join it.
	cli, err := membership.NewClient(j.endpoints, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	gone := cli.Watch(ctx, etcdkeys.Layout{}.Members("proc"), clientv3.WithPrefix())
	for {
		_, err := coordinator.NewAdmin(cli, "").NewRun(ctx, "proc", "third", "test")
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "live members") {
			t.Fatal(err)
		}
		select { // the stopped replicas' registrations go with their leases
		case <-gone:
		case <-ctx.Done():
			t.Fatalf("the second run's replicas stay registered: %v", err)
		}
	}
	spawn("g")
	spawn("h")
	if ev := runStart("the third run's commits", "g.0", "h.0"); ev.Step != 1 {
		t.Errorf("the operator's run began with step %d (%+v)", ev.Step, ev)
	}
	j.stopAll()
	j.check()
}

// awaitReportedStep waits until a member of job has reported step (or a
// later one) in its record, as its heartbeat does.
func awaitReportedStep(t *testing.T, endpoints []string, job string, step int64) {
	t.Helper()
	cli, err := membership.NewClient(endpoints, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	prefix := etcdkeys.Layout{}.Members(job)
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	reported := func(kvs ...[]byte) bool {
		for _, v := range kvs {
			var rec membership.MemberRecord
			if json.Unmarshal(v, &rec) == nil && rec.Step >= step {
				return true
			}
		}
		return false
	}
	for _, kv := range resp.Kvs {
		if reported(kv.Value) {
			return
		}
	}
	for wr := range cli.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1)) {
		for _, ev := range wr.Events {
			if reported(ev.Kv.Value) {
				return
			}
		}
	}
	t.Fatalf("no member of %s reported step %d: %v", job, step, ctx.Err())
}
