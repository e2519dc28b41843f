package nccl

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/backends/nccl/health"
	"github.com/ftcomm/ftcomm/comm"
)

// ncclsim.Simulation's own API, as other packages use it: a killed process,
// a new one on its GPU, device memory read and written directly, NVML.

// A rank's process dies mid-all-reduce; the survivor shrinks; a new
// process on the dead one's GPU starts: the dead process's leftovers are
// released at once (its GPU work is gone), and a new two-rank comm works.
func TestSimulationKillRestart(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", nil)
	x, err := ranks[0].alloc(comm.Float32, 16)
	if err != nil {
		t.Fatal(err)
	}
	w.Kill(1)
	if !w.Killed(1) || w.Killed(0) {
		t.Fatal("Killed does not report the dead process")
	}
	work := ranks[0].c.AllReduceAsync(ctx, x.t(), comm.Sum)
	eventually(t, "the op to be running", ranks[0].c.Backend().(*Backend).opActive.Load)
	ranks[0].c.Revoke(errors.New("rank 1 died"))
	if err := work.Wait(ctx); !errors.Is(err, comm.ErrRevoked) {
		t.Fatalf("stuck op after Revoke: %v", err)
	}
	nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
	if err != nil {
		t.Fatal(err)
	}
	// The revoked comm's aborted op was queued on its stream with x: x is
	// freed below only once that comm has released its stream.
	revoked := ranks[0].c
	ranks[0].c = nc
	revoked.Close()

	w.Restart(1)
	if w.Killed(1) {
		t.Fatal("Killed after Restart")
	}
	// The dead process's comm releases without waiting out its
	// ReleaseTimeout (10 s by default): its stream was emptied.
	old := ranks[1].c.Backend().(*Backend)
	ranks[1].c.Close()
	select {
	case <-old.Released():
	case <-time.After(5 * time.Second):
		t.Fatal("the dead process's comm was not released after Restart")
	}
	ranks[1] = nil
	closeJob(t, ranks[:1])
	ranks[0] = nil
	select {
	case <-revoked.Backend().(*Backend).Released():
	case <-time.After(5 * time.Second):
		t.Fatal("the revoked comm did not release its stream")
	}
	x.b.Free()

	again := startJob(t, ctx, simLibrary(w), devs(2), 3, "job2", nil)
	collectiveSuite(t, ctx, again, []comm.DType{comm.Float32}, 8, 3)
}

func TestSimulationDeviceMemory(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	L := simLibrary(w)
	b, err := L.Alloc(1, 64)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	want := bytes.Repeat([]byte{1, 2, 3, 4}, 16)
	if err := w.WriteDevice(b.Tensor(comm.Uint8), want); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 64)
	if err := b.CopyToHost(ctx, got); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("copy of what WriteDevice wrote: %v %v", got, err)
	}
	if err := b.CopyFromHost(ctx, bytes.Repeat([]byte{9}, 64)); err != nil {
		t.Fatal(err)
	}
	if got, err := w.ReadDevice(b.Tensor(comm.Uint8).Slice(8, 8)); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{9}, 8)) {
		t.Fatalf("ReadDevice of a slice: %v %v", got, err)
	}
	for name, tt := range map[string]comm.Tensor{
		"host tensor":   comm.Uint8s(make([]byte, 4)),
		"other device":  comm.DeviceTensor(b.Ptr(), 0, 64, comm.Uint8),
		"past the end":  comm.DeviceTensor(b.Ptr(), 1, 65, comm.Uint8),
		"never alloced": comm.DeviceTensor(0x10, 1, 1, comm.Uint8),
	} {
		if _, err := w.ReadDevice(tt); !errors.Is(err, comm.ErrInvalidArgument) {
			t.Errorf("ReadDevice of %s: %v, want ErrInvalidArgument", name, err)
		}
	}
	if err := w.WriteDevice(b.Tensor(comm.Uint8), make([]byte, 65)); !errors.Is(err, comm.ErrInvalidArgument) {
		t.Errorf("WriteDevice past the end: %v", err)
	}
	if len(w.Faults()) != 0 {
		t.Errorf("faults from the direct reads: %v", w.Faults())
	}
}

// WatchHealth on the simulation's NVML sees its own GPU's faults only.
func TestSimulationNVML(t *testing.T) {
	ctx := testCtx(t)
	w := newFakeWorld(t, 2)
	ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
		c.NVML = w.NVML()
		c.Health = health.Config{PollInterval: 5 * time.Millisecond, EventWait: 5 * time.Millisecond}
	})
	events := make(chan comm.HealthEvent, 16)
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	if err := ranks[1].c.Backend().(comm.HealthWatcher).WatchHealth(wctx, func(e comm.HealthEvent) { events <- e }); err != nil {
		t.Fatal(err)
	}
	next := func() comm.HealthEvent {
		t.Helper()
		select {
		case e := <-events:
			return e
		case <-time.After(10 * time.Second):
			t.Fatal("no health event within 10 s")
			return comm.HealthEvent{}
		}
	}
	w.InjectXid(0, 79) // another GPU's
	w.InjectXid(1, 13)
	if e := next(); e.Critical || e.Device != 1 || !strings.Contains(e.Reason, "Xid 13") {
		t.Errorf("Xid 13 on GPU 1: %+v", e)
	}
	w.InjectXid(1, 79)
	if e := next(); !e.Critical || !strings.Contains(e.Reason, "Xid 79") || !strings.Contains(e.Reason, "GPU-sim-1") {
		t.Errorf("Xid 79 on GPU 1: %+v", e)
	}
	w.AddECCErrors(1, 2)
	if e := next(); !e.Critical || !strings.Contains(e.Reason, "ECC") {
		t.Errorf("uncorrected ECC on GPU 1: %+v", e)
	}
}
