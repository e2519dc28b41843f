package ft

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// runShardChild is the replica process of the snapshot tests
// (FTCOMM_FT_SNAPSHOT_EVERY): one rank of a group with no replica, holding
// a shard of its own (shardInit) that every step changes by the group's
// all-reduce (shardContribution, shardApply), so the parent can say what
// each shard must be at each step. It reports every commit with its
// shard's hash, and its restores and rollbacks.
//
// With dev (BACKEND=nccl) the shard registered is device memory: the loop
// keeps a host mirror, read back from the device at every step (a restore
// writes the device) and written to it after every commit, so the hashes
// it reports are of what the device held.
func runShardChild(ctx context.Context, c *Comm, out *json.Encoder, n int, dev *childDevice) int {
	slot := c.GroupRank()
	id := memberID(c.cfg.Group, slot)
	params := shardInit(slot, n)
	state := comm.Float32s(params)
	if dev != nil {
		if err := dev.load(ctx, params); err != nil {
			fmt.Fprintln(os.Stderr, "child:", err)
			return 2
		}
		state = dev.params.Tensor(comm.Float32)
	}
	if err := c.Register("shard", state); err != nil {
		fmt.Fprintln(os.Stderr, "child: register:", err)
		return 2
	}
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
		}
		os.Exit(0)
	}()
	v := make([]float32, n)
	for {
		var rb *RollbackError
		if err := c.Step(ctx); errors.As(err, &rb) {
			out.Encode(childEvent{Kind: "rollback", From: rb.FromStep, To: rb.ToStep, ID: id, Pid: os.Getpid(),
				Step: rb.Step, UnixNano: time.Now().UnixNano()})
		} else if err != nil {
			fmt.Fprintln(os.Stderr, "child: step:", err)
			out.Encode(childEvent{Kind: "error", ID: id, Pid: os.Getpid(), Err: err.Error(), UnixNano: time.Now().UnixNano()})
			return 1
		}
		if dev != nil {
			b := make([]byte, 4*n)
			if err := dev.params.CopyToHost(ctx, b); err != nil {
				fmt.Fprintln(os.Stderr, "child:", err)
				return 1
			}
			copy(params, f32s(b))
		}
		shardContribution(c.CommittedStep(), slot, v)
		if g := c.Group(); g != nil {
			g.AllReduce(ctx, comm.Float32s(v), comm.Sum) // a failure fails the group's vote
		}
		ok, err := c.Commit(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, "child: commit:", err)
			return 1
		}
		if !ok {
			continue
		}
		shardApply(params, v)
		if dev != nil {
			if err := dev.load(ctx, params); err != nil {
				fmt.Fprintln(os.Stderr, "child:", err)
				return 1
			}
		}
		out.Encode(childEvent{ID: id, Pid: os.Getpid(), Step: c.CommittedStep(), Epoch: c.Epoch(),
			Participants: c.Participants(), Hash: shardHash(params), UnixNano: time.Now().UnixNano()})
	}
}

func shardHash(p []float32) uint64 {
	h := fnv.New64a()
	b := make([]byte, 4*len(p))
	for i, x := range p {
		u := math.Float32bits(x)
		b[4*i], b[4*i+1], b[4*i+2], b[4*i+3] = byte(u), byte(u>>8), byte(u>>16), byte(u>>24)
	}
	h.Write(b)
	return h.Sum64()
}

// shardHashes are slot's shard hashes after steps 0..upto.
func shardHashes(slot, slots int, upto int64, n int) []uint64 {
	var out []uint64
	shardRun(slot, slots, upto, n, func(p []float32) { out = append(out, shardHash(p)) })
	return out
}

// snapJob is a group of shardSlots rank processes with peer snapshots
// every K steps, on one host.
func (j *procJob) spawnShards(every, n int) { j.spawnGroup(shardSlots, every, n) }

// spawnGroup starts a group of slots rank processes with peer snapshots.
func (j *procJob) spawnGroup(slots, every, n int) {
	for s := range slots {
		j.spawnCmd(childCmd(), "fsdp", s, slots, n, "FTCOMM_FT_SNAPSHOT_EVERY="+strconv.Itoa(every))
	}
}

func (j *procJob) spawnSlotSpare(key string, every, n int) {
	j.spawnSlotSpareOf(shardSlots, key, every, n)
}

// spawnSlotSpareOf starts a slot spare of a group of slots ranks.
func (j *procJob) spawnSlotSpareOf(slots int, key string, every, n int) {
	j.spawnCmd(childCmd(), "fsdp", AnyRank, slots, n, "FTCOMM_FT_SNAPSHOT_EVERY="+strconv.Itoa(every),
		"FTCOMM_FT_SPARE=1", "FTCOMM_FT_KEY="+key)
}

// checkShards asserts that every commit any process reported holds the
// shard the run without failures holds at that step, bit for bit.
func (j *procJob) checkShards(n int) { j.checkShardsOf(shardSlots, n) }

// checkShardsOf is checkShards for a group of slots ranks.
func (j *procJob) checkShardsOf(slots, n int) {
	j.t.Helper()
	for drained := false; !drained; {
		select {
		case ev := <-j.events:
			j.all = append(j.all, ev)
		default:
			drained = true
		}
	}
	var top int64
	for _, ev := range j.all {
		top = max(top, ev.Step)
	}
	want := make([][]uint64, slots)
	for s := range want {
		want[s] = shardHashes(s, slots, top, n)
	}
	commits := 0
	for _, ev := range j.all {
		if ev.Kind != "" {
			continue
		}
		_, slot, _ := parseMemberID(ev.ID)
		if ev.Hash != want[slot][ev.Step] {
			j.t.Errorf("%s (pid %d) committed step %d with a shard that differs from the run without failures", ev.ID, ev.Pid, ev.Step)
		}
		commits++
	}
	if commits == 0 {
		j.t.Fatal("no commits")
	}
}

// A rank of a group with no replica is SIGKILLed; a slot spare, waiting
// beside the job, takes its place and restores its shard from the buddy's
// copy, the survivors roll back to the same snapshot, and every shard of
// every commit before and after is the one of the run without the
// failure. A second death — the first spare, killed as it takes the place,
// before or during its restore — costs another spare's restore, never a
// wrong shard.
func TestProcessSnapshotSpareRestoresTheDead(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	// FTCOMM_FT_SNAPSHOT_FLOATS: each rank's shard, in float32s (a figure's size).
	n := envInts(t, "FTCOMM_FT_SNAPSHOT_FLOATS", []int{1 << 16})[0]
	const every = 5
	j := newProcJob(t)
	j.spawnShards(every, n)
	j.spawnSlotSpare("spare-a", every, n)
	j.spawnSlotSpare("spare-b", every, n)
	for s := range shardSlots {
		j.await(fmt.Sprintf("fsdp.%d at step 30", s), func(ev childEvent) bool { return ev.Kind == "" && ev.ID == memberID("fsdp", s) && ev.Step >= 30 })
	}
	t0 := j.kill("fsdp.1")
	claimed := j.await("a spare to take the place", func(ev childEvent) bool { return ev.Kind == "claimed" })
	t.Logf("%s took the dead rank's place %v after the kill", claimed.ID, time.Unix(0, claimed.UnixNano).Sub(t0))
	j.kill(claimed.ID) // as it takes the place: before or during its restore
	var resumed time.Time
	restored := map[string]childEvent{}
	for len(restored) < shardSlots || resumed.IsZero() {
		ev := j.await("the group to restore and commit", func(ev childEvent) bool {
			return ev.Kind == "restored" && ev.Pid != claimed.Pid || ev.Kind == "" && time.Unix(0, ev.UnixNano).After(t0) && ev.Participants > 0
		})
		if ev.Kind == "restored" {
			restored[ev.ID] = ev
			continue
		}
		if len(restored) == shardSlots && resumed.IsZero() {
			resumed = time.Unix(0, ev.UnixNano)
		}
	}
	var step int64 = -1
	for id, ev := range restored {
		if step >= 0 && ev.Step != step {
			t.Errorf("%s restored step %d, another rank %d", id, ev.Step, step)
		}
		step = ev.Step
		if id == "fsdp.1" && ev.Bytes != int64(4*n) {
			t.Errorf("the new fsdp.1 received %d bytes, want its shard's %d", ev.Bytes, 4*n)
		}
		if id != "fsdp.1" && ev.Bytes != 0 {
			t.Errorf("%s received %d bytes: survivors restore their own copy", id, ev.Bytes)
		}
	}
	if step%every != 0 || step < 30-2*every {
		t.Errorf("restored step %d: want the newest complete snapshot (every %d) near the kill", step, every)
	}
	t.Logf("kill → all restored to step %d and committing again at full size: %v; the new fsdp.1 restored %d MiB in %v (%.2f GB/s)",
		step, resumed.Sub(t0), restored["fsdp.1"].Bytes>>20, time.Duration(restored["fsdp.1"].TookNs).Round(time.Millisecond),
		float64(restored["fsdp.1"].Bytes)/time.Duration(restored["fsdp.1"].TookNs).Seconds()/1e9)
	for s := range shardSlots {
		j.await(fmt.Sprintf("fsdp.%d past the restore", s), func(ev childEvent) bool {
			return ev.Kind == "" && ev.ID == memberID("fsdp", s) && ev.Step >= step+2*every
		})
	}
	j.stopAll()
	j.checkShards(n)
}

// A rank and its buddy (slot 1 and slot 2 on one host) die together: the
// shard of slot 1 has no copy left. Their restarted processes join, and
// every rank of the group fails with the error naming the fallback; the
// survivor's state is left as it committed it.
func TestProcessSnapshotLostWithItsBuddy(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const every, n = 3, 1024
	j := newProcJob(t)
	j.spawnShards(every, n)
	for s := range shardSlots {
		j.await(fmt.Sprintf("fsdp.%d at step 20", s), func(ev childEvent) bool { return ev.Kind == "" && ev.ID == memberID("fsdp", s) && ev.Step >= 20 })
	}
	j.kill("fsdp.1")
	j.kill("fsdp.2")
	for _, s := range []int{1, 2} {
		j.spawnCmd(childCmd(), "fsdp", s, shardSlots, n, "FTCOMM_FT_SNAPSHOT_EVERY="+strconv.Itoa(every))
	}
	failed := map[string]bool{}
	for len(failed) < shardSlots {
		ev := j.await("every rank to fail", func(ev childEvent) bool { return ev.Kind == "error" || ev.Kind == "restored" })
		if ev.Kind == "restored" {
			t.Fatalf("%s restored step %d with slot 1's copies gone", ev.ID, ev.Step)
		}
		if !strings.Contains(ev.Err, "restore the job from your checkpoint") || !strings.Contains(ev.Err, "ranks [1]") {
			t.Errorf("%s: %s", ev.ID, ev.Err)
		}
		failed[ev.ID] = true
	}
	j.stopAll()
	j.checkShards(n)
}

// TestGPUSnapshotProcesses is TestProcessSnapshotSpareRestoresTheDead
// with each rank's shard in GPU memory (BACKEND=nccl: a one-rank NCCL comm
// per process, the group's comm on gloo, every process on GPU 0): the
// spare's restore writes the device, and every commit's hash is of what
// the device held, compared bit for bit with the run without failures.
func TestGPUSnapshotProcesses(t *testing.T) {
	gpuOnly(t)
	if os.Getenv(gpuEnv) == "sim" {
		t.Skip("spawns processes on a real GPU")
	}
	n := envInts(t, "FTCOMM_FT_SNAPSHOT_FLOATS", []int{1 << 20})[0]
	const every = 5
	j := newProcJob(t)
	gpu := []string{"FTCOMM_FT_BACKEND=nccl", "FTCOMM_FT_DEVICE=0", "FTCOMM_FT_SNAPSHOT_EVERY=" + strconv.Itoa(every)}
	for s := range shardSlots {
		j.spawnCmd(childCmd(), "fsdp", s, shardSlots, n, gpu...)
	}
	j.spawnCmd(childCmd(), "fsdp", AnyRank, shardSlots, n, append(gpu, "FTCOMM_FT_SPARE=1", "FTCOMM_FT_KEY=spare")...)
	for s := range shardSlots {
		j.await(fmt.Sprintf("fsdp.%d at step 30", s), func(ev childEvent) bool { return ev.Kind == "" && ev.ID == memberID("fsdp", s) && ev.Step >= 30 })
	}
	t0 := j.kill("fsdp.1")
	restored := map[string]childEvent{}
	var resumed time.Time
	for len(restored) < shardSlots || resumed.IsZero() {
		ev := j.await("the group to restore and commit", func(ev childEvent) bool {
			return ev.Kind == "restored" || ev.Kind == "" && time.Unix(0, ev.UnixNano).After(t0)
		})
		if ev.Kind == "restored" {
			restored[ev.ID] = ev
		} else if len(restored) == shardSlots {
			resumed = time.Unix(0, ev.UnixNano)
		}
	}
	r := restored["fsdp.1"]
	t.Logf("FIGURE GPU shards of %d MiB, 3 ranks + a slot spare on one GPU: kill → every rank restored to step %d and committing: %v; the spare's restore %d MiB in %v (%.2f GB/s)",
		4*n>>20, r.Step, resumed.Sub(t0).Round(time.Millisecond), r.Bytes>>20, time.Duration(r.TookNs).Round(time.Millisecond),
		float64(r.Bytes)/time.Duration(r.TookNs).Seconds()/1e9)
	for s := range shardSlots {
		j.await(fmt.Sprintf("fsdp.%d past the restore", s), func(ev childEvent) bool {
			return ev.Kind == "" && ev.ID == memberID("fsdp", s) && ev.Step >= r.Step+2*every
		})
	}
	j.stopAll()
	j.checkShards(n)
}

// Two ranks of a group of four die at once, neither the other's buddy
// (slots 0 and 2: their copies are at 1 and 3): two slot spares take the
// two places, each restores its shard from the dead rank's buddy, the
// survivors restore their own copies, and every commit holds the shards
// of the run without failures.
func TestProcessSnapshotTwoDeathsTwoSpares(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	const slots, every, n = 4, 5, 1 << 12
	j := newProcJob(t)
	j.spawnGroup(slots, every, n)
	j.spawnSlotSpareOf(slots, "spare-a", every, n)
	j.spawnSlotSpareOf(slots, "spare-b", every, n)
	for s := range slots {
		j.await(fmt.Sprintf("fsdp.%d at step 30", s), func(ev childEvent) bool { return ev.Kind == "" && ev.ID == memberID("fsdp", s) && ev.Step >= 30 })
	}
	t0 := j.kill("fsdp.0")
	j.kill("fsdp.2")
	claimed := map[string]bool{}
	restored := map[string]childEvent{}
	for len(restored) < slots {
		ev := j.await("both spares in and the group restored", func(ev childEvent) bool {
			return ev.Kind == "claimed" || ev.Kind == "restored" && time.Unix(0, ev.UnixNano).After(t0)
		})
		if ev.Kind == "claimed" {
			claimed[ev.ID] = true
			continue
		}
		restored[ev.ID] = ev
	}
	if len(claimed) != 2 {
		t.Errorf("spares that took a place: %v, want both", claimed)
	}
	var step int64 = -1
	for id, ev := range restored {
		if step >= 0 && ev.Step != step {
			t.Errorf("%s restored step %d, another rank %d", id, ev.Step, step)
		}
		step = ev.Step
		newRank := id == "fsdp.0" || id == "fsdp.2"
		if newRank && ev.Bytes != int64(4*n) || !newRank && ev.Bytes != 0 {
			t.Errorf("%s received %d bytes (new rank: %v; a shard is %d)", id, ev.Bytes, newRank, 4*n)
		}
	}
	if step%every != 0 || step < 30-2*every {
		t.Errorf("restored step %d: want the newest complete snapshot (every %d) near the kill", step, every)
	}
	for s := range slots {
		j.await(fmt.Sprintf("fsdp.%d past the restore", s), func(ev childEvent) bool {
			return ev.Kind == "" && ev.ID == memberID("fsdp", s) && ev.Step >= step+2*every
		})
	}
	j.stopAll()
	j.checkShardsOf(slots, n)
}
