package ft

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/recovery"
)

// TestGPUSnapshotThroughput times the three transfers of a peer snapshot
// of FTCOMM_FT_HEAL_BYTES (1 GiB) of device state, through ft's own code:
// the own copy (device → this rank's host memory, in the background of a
// step: peerSnapshots.take), the buddy's pull (host → host over loopback
// TCP: pull), and a replacement's restore (its copy fetched from the
// buddy's held copy straight into its device memory through pinned
// staging buffers: the restore's fetchInto);
// the restored device memory is checked byte for byte. Each FIGURE is
// GB/s. FTCOMM_FT_GPU=sim runs it on the simulator (no figures worth
// reading).
func TestGPUSnapshotThroughput(t *testing.T) {
	lib := gpuOnly(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	size := healBytes(t)
	copier := libCopier{lib, 0}
	src, err := lib.Alloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free()
	dst, err := lib.Alloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Free()
	if err := fillDevice(ctx, lib, src); err != nil {
		t.Fatal(err)
	}
	pool := newStagingPool(copier, 4<<20, stagingBuffers)
	defer func() { pool.close(time.Now().Add(time.Minute)) }()
	blobs := []recovery.Blob{{Name: "state", Mem: &deviceState{copier: copier, t: src.Tensor(comm.Uint8), pool: pool}}}
	met, err := newMetrics(nil, "snap", "x")
	if err != nil {
		t.Fatal(err)
	}
	mk := func(rank int) *peerSnapshots {
		s, err := newSnapshots(Config{Job: "snap", Secret: []byte("k"), GroupRank: rank, GroupSize: 2, SnapshotEvery: 1,
			RecoveryAddr: "127.0.0.1:0"}.withDefaults(), zaptest.NewLogger(t).Named("snap"), met)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.close() })
		return s
	}
	a, b := mk(0), mk(1)
	b.source, b.srcAddr = 0, a.ownSrv.Addr()
	gbps := func(d time.Duration) float64 { return float64(size) / d.Seconds() / 1e9 }
	for round := 1; round <= 3; round++ {
		step := int64(round)
		t0 := time.Now()
		a.take(step, history{}.encode(), blobs)
		if err := a.waitCopied(ctx); err != nil {
			t.Fatal(err)
		}
		own := time.Since(t0)
		t1 := time.Now()
		b.pull(step)
		pulled := time.Since(t1)
		held := findCopy(b.held, step, 0)
		if held == nil {
			t.Fatalf("round %d: the buddy holds no copy", round)
		}
		// A replacement of rank 0 fetches its copy from the buddy and
		// writes it to its device.
		b.heldSrv.OfferWithMeta(step, held.meta, []recovery.Blob{{Name: snapshotBlob, Data: held.buf}})
		t2 := time.Now()
		st, err := a.fetchInto(ctx, step, b.heldSrv.Addr(), []recovery.Blob{{Name: "state", Mem: &deviceState{copier: copier, t: dst.Tensor(comm.Uint8), pool: pool}}})
		if err != nil {
			t.Fatal(err)
		}
		restore := time.Since(t2)
		b.heldSrv.Withdraw(ctx)
		if err := checkDevice(ctx, lib, dst); err != nil {
			t.Fatalf("round %d: restored state wrong at %v", round, err)
		}
		if err := dst.Fill(ctx, 0); err != nil {
			t.Fatal(err)
		}
		// The complete snapshot moves on, as after a vote.
		a.learned(step)
		b.learned(step)
		t.Logf("FIGURE snapshot of %d MiB of device state, round %d: own copy (device → host) %.2f GB/s (%v); buddy's pull (host → host, TCP loopback, %d streams) %.2f GB/s (%v); restore into the device (TCP, pinned staging, host → device) %.2f GB/s (%v, %d bytes)",
			size>>20, round, gbps(own), own.Round(time.Millisecond), b.fc.Streams, gbps(pulled), pulled.Round(time.Millisecond),
			gbps(restore), restore.Round(time.Millisecond), st.Bytes)
	}
}
