package ft

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/membership"
)

// Three replica processes and a spare (Config.Spare). A replica is
// SIGKILLed: the survivors commit without it, the spare is promoted, heals
// and the job commits at full size again (capacity back: the figure of
// docs/spares.md); the spare never committed before. The dead replica,
// started again as a launcher would (not as a spare), waits as a spare —
// its place was taken — and is promoted when the next replica dies.
func TestProcessSpareTakesTheDeadsPlace(t *testing.T) {
	if testing.Short() {
		t.Skip("starts replica processes")
	}
	j := newProcJob(t)
	const params = 1 << 16
	for _, g := range []string{"a", "b", "c"} {
		j.spawn(g, 0, 1, params)
	}
	j.spawnCmd(childCmd(), "s", 0, 1, params, "FTCOMM_FT_SPARE=1")
	seen := map[string]bool{}
	j.await("three replicas committing together", func(ev childEvent) bool {
		if ev.Kind == "" && ev.Participants == 3 {
			seen[ev.ID] = true
		}
		return len(seen) == 3
	})
	if seen["s.0"] {
		t.Fatal("the spare committed a step while the job was at its target")
	}
	j.awaitReady("s.0")
	// What a waiting spare costs: its CPU time while the job trains 200
	// steps without it.
	cpu0, w0 := j.cpuTime("s.0"), time.Now()
	n := 0
	j.await("200 more steps without the spare", func(ev childEvent) bool {
		if ev.Kind == "" && ev.ID == "a.0" {
			n++
		}
		return n == 200
	})
	if cpu, wall := j.cpuTime("s.0")-cpu0, time.Since(w0); cpu >= 0 {
		t.Logf("FIGURE a waiting spare used %.3f cores (%v of CPU in %v)", cpu.Seconds()/wall.Seconds(), cpu, wall.Round(time.Millisecond))
	}

	t0 := j.kill("c.0")
	var shrunk, full time.Duration
	j.await("the survivors' commit without c, then the job at full size with the spare", func(ev childEvent) bool {
		at := time.Unix(0, ev.UnixNano)
		switch {
		case ev.Kind == "" && at.After(t0) && ev.Participants == 2 && shrunk == 0:
			shrunk = at.Sub(t0)
		case ev.Kind == "" && at.After(t0) && ev.Participants == 3 && ev.ID == "s.0":
			full = at.Sub(t0)
			return true
		}
		return false
	})
	// The promotion's event and the commits come on different paths:
	// compare epochs, not the order they were printed in.
	j.awaitSeen("the spare's promotion", func(ev childEvent) bool { return ev.Kind == "promoted" && ev.ID == "s.0" })
	j.spareCommittedFrom("s.0", t0)
	j.grewWithoutStopping([]string{"a.0", "b.0"}, "s.0")
	t.Logf("FIGURE SIGKILL of a replica, one spare: survivors' next commit %v, capacity back (first commit at full size) %v",
		shrunk.Round(time.Millisecond), full.Round(time.Millisecond))
	if shrunk == 0 {
		t.Error("the job reached full size again without a commit of the survivors alone: the spare was promoted with the loss")
	}

	// c, started again, waits as a spare: the job is at its target.
	j.spawn("c", 0, 1, params)
	j.awaitReady("c.0")
	if q := j.quorum(); q.Rank("c.0") >= 0 || !slices.Contains(q.Replaced, "c") {
		t.Fatalf("epoch %d (replaced %v) after c's restart: want c waiting as a spare", q.Epoch, q.Replaced)
	}
	t1 := j.kill("a.0")
	j.await("c promoted in a's place, committing at full size", func(ev childEvent) bool {
		if ev.Kind == "" && ev.ID == "c.0" && time.Unix(0, ev.UnixNano).Before(t1) {
			t.Fatalf("the restarted c committed step %d before a's death: it grew the job past its target", ev.Step)
		}
		return ev.Kind == "" && ev.ID == "c.0" && ev.Participants == 3
	})
	j.awaitSeen("c's promotion", func(ev childEvent) bool { return ev.Kind == "promoted" && ev.ID == "c.0" })
	j.spareCommittedFrom("c.0", t1)
	j.stopAll()
	j.check()
}

// grewWithoutStopping checks that the spare's promotion stopped no
// survivor for its comms: each moved to the promotion's epoch as a
// prepared grow (its comms formed in the background), and none failed more
// than one step from its first commit without the dead until its first at
// full size — the one in flight when it moved, as two survivors and one
// joiner move at once (ft/prepare.go, switchStep).
func (j *procJob) grewWithoutStopping(survivors []string, spare string) {
	j.t.Helper()
	i := slices.IndexFunc(j.all, func(ev childEvent) bool { return ev.Kind == "promoted" && ev.ID == spare })
	if i < 0 {
		j.t.Fatalf("%s was never promoted", spare)
	}
	promoted := j.all[i].Epoch
	for _, id := range survivors {
		// A process's events keep their order in j.all: its first commit
		// in the shrunk epoch (the one before the promotion's), its move,
		// its first commit at full size.
		var moved *childEvent
		shrunk, full := -1, -1
		for k, ev := range j.all {
			switch {
			case ev.ID != id:
			case ev.Kind == "reconfigured" && ev.Epoch == promoted:
				moved = &j.all[k]
			case ev.Kind == "" && ev.Epoch == promoted-1 && shrunk < 0:
				shrunk = k
			case ev.Kind == "" && ev.Epoch == promoted && full < 0:
				full = k
			}
		}
		if moved == nil || moved.How != "prepared" {
			j.t.Errorf("%s moved to the spare's epoch %d by %+v, want a prepared grow", id, promoted, moved)
			continue
		}
		j.t.Logf("FIGURE %s moved to the grown epoch %d in %v (its comms formed in the background)", id, promoted, time.Duration(moved.TookNs))
		var failed []childEvent
		for k := shrunk; shrunk >= 0 && k < full; k++ {
			if ev := j.all[k]; ev.ID == id && ev.Kind == "failed" {
				failed = append(failed, ev)
			}
		}
		if len(failed) > 1 {
			j.t.Errorf("%s failed %d steps while the spare joined (%+v), want the one in flight at most", id, len(failed), failed)
		}
	}
}

// cpuTime is the CPU time (user and system) process id has used so far,
// from /proc; -1 where it cannot be read.
func (j *procJob) cpuTime(id string) time.Duration {
	j.mu.Lock()
	cmd := j.procs[id]
	j.mu.Unlock()
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", cmd.Process.Pid))
	if err != nil {
		return -1
	}
	// Fields after the command name (which may hold spaces): utime and
	// stime are the 12th and 13th after it, in clock ticks (100 a second
	// on Linux).
	f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+1:]))
	if len(f) < 13 {
		return -1
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+s) * 10 * time.Millisecond
}

// awaitReady waits until member id is registered and asks to take part
// (a spare that did everything before its first Step).
func (j *procJob) awaitReady(id string) {
	j.t.Helper()
	j.watchKey(etcdkeys.Layout{}.Member("proc", id), "member "+id+" ready", func(v []byte, ok bool) bool {
		var r membership.MemberRecord
		return ok && json.Unmarshal(v, &r) == nil && r.WantQuorum
	})
}

// quorum reads the job's current quorum record.
func (j *procJob) quorum() membership.Quorum {
	j.t.Helper()
	var q membership.Quorum
	j.watchKey(etcdkeys.Layout{}.Quorum("proc"), "the quorum", func(v []byte, ok bool) bool {
		if !ok {
			return false
		}
		var err error
		q, err = membership.DecodeQuorumRecord(v, nil)
		return err == nil
	})
	return q
}

// awaitSeen is await that also accepts an event seen already.
func (j *procJob) awaitSeen(what string, pred func(childEvent) bool) {
	j.t.Helper()
	if !slices.ContainsFunc(j.all, pred) {
		j.await(what, pred)
	}
}

// spareCommittedFrom checks that spare id (the process promoted) committed no step before the
// death at t0 that let it in, nor in an epoch before its promotion's.
func (j *procJob) spareCommittedFrom(id string, t0 time.Time) {
	j.t.Helper()
	i := slices.IndexFunc(j.all, func(ev childEvent) bool { return ev.Kind == "promoted" && ev.ID == id })
	if i < 0 {
		j.t.Fatalf("%s was never promoted", id)
	}
	for _, ev := range j.all {
		if ev.Kind == "" && ev.Pid == j.all[i].Pid && (ev.Epoch < j.all[i].Epoch || time.Unix(0, ev.UnixNano).Before(t0)) {
			j.t.Errorf("spare %s committed step %d in epoch %d: promoted in epoch %d, after the death at %v", id, ev.Step, ev.Epoch,
				j.all[i].Epoch, t0.Format(time.StampMicro))
		}
	}
}

// watchKey waits until key's value (exists false: no key) satisfies ok.
func (j *procJob) watchKey(key, what string, ok func(v []byte, exists bool) bool) {
	j.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cli, err := clientv3.New(clientv3.Config{Endpoints: j.endpoints, DialTimeout: 5 * time.Second})
	if err != nil {
		j.t.Fatal(err)
	}
	defer cli.Close()
	for {
		r, err := cli.Get(ctx, key)
		if err != nil {
			j.t.Fatalf("waiting for %s: %v", what, err)
		}
		var v []byte
		if len(r.Kvs) == 1 {
			v = r.Kvs[0].Value
		}
		if ok(v, len(r.Kvs) == 1) {
			return
		}
		wc := cli.Watch(ctx, key, clientv3.WithRev(r.Header.Revision+1))
		select {
		case <-wc:
		case <-ctx.Done():
			j.t.Fatalf("timed out waiting for %s", what)
		}
	}
}
