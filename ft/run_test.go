package ft

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/comm/inproc"
	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/membership"
)

// gaugeValue returns the value of a gauge with the given labels in reg
// (-1 when absent).
func gaugeValue(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
					continue next
				}
			}
			return m.GetGauge().GetValue()
		}
	}
	return -1
}

// waitJob waits until cond holds of the job's view (read again at every
// change of its members' records, and at least every 100 ms for the
// coordinator's own reading of them), or fails the test after 60 s.
func waitJob(t *testing.T, cli *clientv3.Client, job, what string, cond func(coordinator.JobView) bool) coordinator.JobView {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	admin := coordinator.NewAdmin(cli, "")
	changes := cli.Watch(ctx, etcdkeys.Layout{}.Members(job), clientv3.WithPrefix())
	recheck := time.NewTicker(100 * time.Millisecond)
	defer recheck.Stop()
	for {
		v, err := admin.Job(ctx, job)
		if err == nil && cond(v) {
			return v
		}
		select {
		case <-changes:
		case <-recheck.C:
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v (last view %+v)", what, context.Cause(ctx), v)
		}
	}
}

// With DurableCommit, replicas that wait for a holder of a step the job
// committed show it: each member's record says what it waits for (the
// API, `ftcoord status` and the dashboard show it), the coordinator's
// ftcomm_coordinator_waiting_members counts them, and both clear once a
// quorum lets them go on.
func TestEtcdDurableWaitIsShown(t *testing.T) {
	j := newEtcdJob(t, "inproc", inproc.NewCluster())
	j.cfg.DurableCommit = true
	a, b := j.start("a", forever, 64), j.start("b", forever, 64)
	a.waitParticipants(2)
	b.waitStep(3)
	cli, err := j.etcd.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// A step far ahead, recorded by a holder none of them can reach.
	ghost := membership.CommitRecord{Step: 1 << 20, Epoch: 1, By: "ghost.0", At: time.Now()}
	val, _ := json.Marshal(ghost)
	if _, err := cli.Put(ctx, etcdkeys.Layout{}.Commit("toy", ghost.Step), string(val)); err != nil {
		t.Fatal(err)
	}
	// The next epoch's agreement gives a's and b's step, below it.
	c := j.start("c", forever, 64)
	v := waitJob(t, cli, "toy", "three waiting members", func(v coordinator.JobView) bool { return len(v.WaitingMembers) == 3 })
	for _, m := range v.Members {
		if m.WaitingFor != ghost.Step || !strings.Contains(m.Waiting, "step 1048576 was committed by epoch 1; no participant holds it") {
			t.Errorf("member %s: waiting for %d: %q", m.ID, m.WaitingFor, m.Waiting)
		}
	}
	waitJob(t, cli, "toy", "the coordinator's count of waiting members", func(coordinator.JobView) bool {
		return gaugeValue(t, j.reg, "ftcomm_coordinator_waiting_members", map[string]string{"ftcomm_job": "toy"}) == 3
	})

	// The record goes and c leaves: the next epoch lets a and b go on.
	if _, err := cli.Delete(ctx, etcdkeys.Layout{}.Commit("toy", ghost.Step)); err != nil {
		t.Fatal(err)
	}
	c.cancel()
	<-c.done
	if err := c.c.Close(); err != nil {
		t.Fatal(err)
	}
	waitJob(t, cli, "toy", "no waiting member", func(v coordinator.JobView) bool {
		return len(v.WaitingMembers) == 0 &&
			gaugeValue(t, j.reg, "ftcomm_coordinator_waiting_members", map[string]string{"ftcomm_job": "toy"}) == 0
	})
	at := a.c.CommittedStep()
	a.waitStep(at + 2)
	b.waitStep(at + 2)
	stopAll(t, j.ledger, a, b)
}

// A replica whose registration ended cannot register again once its run
// ended: its state is that run's. Step then fails with ErrMembershipLost,
// saying why, instead of trying to register forever.
func TestEtcdReregisterIntoEndedRun(t *testing.T) {
	j := newEtcdJob(t, "inproc", inproc.NewCluster())
	a := j.start("a", forever, 64)
	a.waitStep(2)
	cli, err := j.etcd.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// a is evicted and kept out for a moment; meanwhile an operator
	// starts a new run of the job.
	if _, err := coordinator.NewAdmin(cli, "").EvictFor(ctx, "toy", "a.0", "test", 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := coordinator.NewAdmin(cli, "").NewRun(ctx, "toy", "next", "test"); err != nil {
		t.Fatal(err)
	}
	err = a.wait()
	if !errors.Is(err, ErrMembershipLost) || !errors.Is(err, membership.ErrRunEnded) {
		t.Fatalf("a's training ended with %v; want ErrMembershipLost for an ended run", err)
	}
	a.c.Close()
}
