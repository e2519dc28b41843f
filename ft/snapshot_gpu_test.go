package ft

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/backends/nccl"
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
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	size := healBytes(t)
	lib, copier, pool, src, dst, a, b := gpuSnapshotPair(ctx, t, size, "snap")
	blobs := []recovery.Blob{{Name: "state", Mem: &deviceState{copier: copier, t: src.Tensor(comm.Uint8), pool: pool}}}
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

// TestGPUSnapshotManyTensors times the own copy and the restore of a
// state made of many device tensors, as a model's is (an 8-layer GPT's
// parameters and AdamW moments: about 300 tensors, 154 MB per rank of 2):
// FTCOMM_FT_SNAPSHOT_TENSORS tensors (300) of FTCOMM_FT_SNAPSHOT_MIB MiB in
// all (160), uneven slices of one buffer. The copies and the restore are
// checked byte for byte.
func TestGPUSnapshotManyTensors(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	n := envInts(t, "FTCOMM_FT_SNAPSHOT_TENSORS", []int{300})[0]
	size := envInts(t, "FTCOMM_FT_SNAPSHOT_MIB", []int{160})[0] << 20
	lib, copier, pool, src, dst, a, b := gpuSnapshotPair(ctx, t, size, "snapmany")
	// Uneven pieces (multiples of 8 bytes): some small, as a model's
	// biases and norms are, the last one taking what is left.
	cuts := []int{0}
	for i := 1; i < n; i++ {
		cuts = append(cuts, min(size, cuts[i-1]+(size/n/8*(1+i%3))/2*8))
	}
	cuts = append(cuts, size)
	blobsOf := func(buf *nccl.DeviceBuffer) []recovery.Blob {
		var bs []recovery.Blob
		for i := range n {
			tn := buf.Tensor(comm.Uint8).Slice(cuts[i], cuts[i+1]-cuts[i])
			bs = append(bs, recovery.Blob{Name: fmt.Sprintf("t%d", i), Mem: &deviceState{copier: copier, t: tn, pool: pool}})
		}
		return bs
	}
	blobs := blobsOf(src)
	want := make([]byte, size)
	healPattern(want, 0)
	for step := int64(1); step <= 4; step++ {
		t0 := time.Now()
		a.take(step, history{}.encode(), blobs)
		if err := a.waitCopied(ctx); err != nil {
			t.Fatal(err)
		}
		own := time.Since(t0)
		if c := findCopy(a.own, step, 0); c == nil || !bytes.Equal(c.buf, want) {
			t.Fatalf("step %d: the own copy is not the state", step)
		}
		t1 := time.Now()
		b.pull(step)
		pulled := time.Since(t1)
		a.learned(step)
		b.learned(step)
		t.Logf("FIGURE snapshot %d of %d device tensors, %d MiB: own copy %v (%.2f GB/s), buddy's pull %v (%.2f GB/s)",
			step, n, size>>20, own.Round(100*time.Microsecond), float64(size)/own.Seconds()/1e9,
			pulled.Round(100*time.Microsecond), float64(size)/pulled.Seconds()/1e9)
	}
	held := findCopy(b.held, 4, 0)
	if held == nil {
		t.Fatal("the buddy holds no copy")
	}
	b.heldSrv.OfferWithMeta(4, held.meta, []recovery.Blob{{Name: snapshotBlob, Data: held.buf}})
	t2 := time.Now()
	if _, err := a.fetchInto(ctx, 4, b.heldSrv.Addr(), blobsOf(dst)); err != nil {
		t.Fatal(err)
	}
	restore := time.Since(t2)
	if err := checkDevice(ctx, lib, dst); err != nil {
		t.Fatalf("restored state wrong at %v", err)
	}
	t.Logf("FIGURE restore of %d device tensors, %d MiB, from the buddy's copy: %v (%.2f GB/s)", n, size>>20,
		restore.Round(100*time.Microsecond), float64(size)/restore.Seconds()/1e9)
}

// gpuSnapshotPair is what the snapshot GPU tests share: device 0's library
// and copier, a staging pool, device buffers of size bytes (src filled
// with healPattern, dst not), and two ranks' snapshot stores (metrics
// named metName), b pulling a's copies. All is released at the test's end.
func gpuSnapshotPair(ctx context.Context, t *testing.T, size int, metName string) (*nccl.Library, libCopier, *stagingPool,
	*nccl.DeviceBuffer, *nccl.DeviceBuffer, *peerSnapshots, *peerSnapshots) {
	t.Helper()
	lib := gpuOnly(t)
	copier := libCopier{lib, 0}
	var bufs [2]*nccl.DeviceBuffer
	for i := range bufs {
		buf, err := lib.Alloc(0, size)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { buf.Free() })
		bufs[i] = buf
	}
	if err := fillDevice(ctx, lib, bufs[0]); err != nil {
		t.Fatal(err)
	}
	pool := newStagingPool(copier, 4<<20, stagingBuffers)
	t.Cleanup(func() { pool.close(time.Now().Add(time.Minute)) })
	met, err := newMetrics(nil, metName, "x")
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
	return lib, copier, pool, bufs[0], bufs[1], a, b
}
