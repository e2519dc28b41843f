package gloo

import (
	"context"
	"errors"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftcomm/ftcomm/comm"
)

func skipWithoutShm(t testing.TB) {
	if sharedMemoryDisabledByEnv() {
		t.Skipf("%s disables shared memory", EnvSharedMemory)
	}
}

// TestSharedMemoryNegotiation: a link carries its data through shared
// memory exactly when both of its ends enable it (both ends decide alike
// from the two identities), and collectives are correct over any mix.
func TestSharedMemoryNegotiation(t *testing.T) {
	skipWithoutShm(t)
	for _, tc := range []struct {
		name string
		on   []bool
	}{
		{"all", []bool{true, true, true}},
		{"none", []bool{false, false, false}},
		{"rank1-off", []bool{true, false, true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			comms := newJobPerRank(t, len(tc.on), func(r int) *Config {
				c := testConfig()
				c.SharedMemory = tc.on[r]
				return c
			}).comms
			for r, c := range comms {
				for p, l := range backendOf(c).links {
					if l == nil {
						continue
					}
					if want := tc.on[r] && tc.on[p]; (l.shm != nil) != want {
						t.Errorf("rank %d's link to %d uses shared memory: %v, want %v", r, p, l.shm != nil, want)
					}
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var wg sync.WaitGroup
			errs := make([]error, len(comms))
			for r, c := range comms {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs[r] = sumCheck(ctx, c, 1<<18) // ring, several frames per link
					if errs[r] == nil {
						errs[r] = sumCheck(ctx, c, 3) // recursive doubling
					}
				}()
			}
			wg.Wait()
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
}

func TestSharedMemoryEnvOff(t *testing.T) {
	t.Setenv(EnvSharedMemory, "off")
	j := newJob(t, 2, nil)
	if l := backendOf(j.comms[0]).links[1]; l.shm != nil {
		t.Fatalf("%s=off, but the link uses shared memory", EnvSharedMemory)
	}
}

func TestSharedMemoryRingSizeValidated(t *testing.T) {
	for _, n := range []int{0, 1000, 32 << 10, 3 << 20, 128 << 20} {
		c := DefaultConfig()
		c.SharedMemoryRing = n
		if err := c.Validate(); err == nil {
			t.Errorf("ring size %d accepted", n)
		}
	}
	c := DefaultConfig()
	c.SharedMemory, c.SharedMemoryRing = false, 0 // unused: not checked
	if err := c.Validate(); err != nil {
		t.Errorf("shared memory off, ring 0: %v", err)
	}
}

// TestSharedMemoryCorruptPositions: a peer that writes nonsense into the
// ring's control block (a head past what the ring can hold) makes this
// side drop the link with a malformed-data error naming that rank: the op
// fails, nothing is read or written out of bounds, nothing panics.
func TestSharedMemoryCorruptPositions(t *testing.T) {
	skipWithoutShm(t)
	j := newJob(t, 2, nil)
	l10 := backendOf(j.comms[1]).links[0]
	if l10.shm == nil {
		t.Fatal("no shared memory between two ranks in one process")
	}
	// Rank 0's end of the segment: its tx ring is rank 1's rx ring.
	l01 := backendOf(j.comms[0]).links[1]
	l01.smu.Lock()
	l01.shm.tx.head.Store(l01.shm.txPos + l01.shm.tx.size + 4096)
	l01.smu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := j.comms[1].AllReduce(ctx, comm.Float32s(make([]float32, 8)), comm.Sum)
	var re *comm.RankError
	if !errors.As(err, &re) || re.Rank != 0 || !errors.Is(err, comm.ErrPeerFailed) {
		t.Fatalf("rank 1's op after a corrupt ring: %v, want ErrPeerFailed naming rank 0", err)
	}
}

// FuzzShmReader writes arbitrary bytes into a shared-memory ring as the
// peer, and sets the ring's head to an arbitrary position, with receives
// posted (one copying, one reducing): delivering from the ring, as the op
// goroutine does while it waits, must fail the link cleanly or deliver,
// never panic, never block, and never write a posted buffer out of bounds.
func FuzzShmReader(f *testing.F) {
	if sharedMemoryDisabledByEnv() {
		f.Skip()
	}
	d := fuzzDesc
	shmFrame := func(h header, payload []byte) []byte {
		h.length = uint32(len(payload))
		b := make([]byte, headerSize, headerSize+pad8(len(payload)))
		h.encode(b)
		return append(append(b, payload...), make([]byte, pad8(len(payload))-len(payload))...)
	}
	good := append(shmFrame(header{typ: frameOp, d: d, seq: 1, tag: 0}, make([]byte, 64)),
		shmFrame(header{typ: frameOp, d: d, seq: 1, tag: 1}, make([]byte, 32))...)
	f.Add(good, uint64(len(good)))
	f.Add(good[:50], uint64(50))
	f.Add(good, uint64(len(good))+shmMinRing)
	f.Add(shmFrame(header{typ: frameHeartbeat}, nil), uint64(headerSize))
	f.Add(shmFrame(header{typ: frameOp, d: d, seq: 1, tag: 0}, make([]byte, 7)), uint64(headerSize+8))
	refused := append(shmFrame(header{typ: frameRefused, d: desc{op: comm.OpAllReduce, root: 1}, tag: refusedColl, seq: 1}, []byte("root 9")),
		shmFrame(header{typ: frameOp, d: d, seq: 1, tag: 0}, make([]byte, 64))...)
	f.Add(refused, uint64(len(refused)))
	f.Fuzz(func(t *testing.T, data []byte, head uint64) {
		if len(data) > shmMinRing {
			data = data[:shmMinRing]
		}
		seg, fd, token, err := createShm(shmMinRing, 1, 0)
		if err != nil {
			t.Skip(err)
		}
		peer, err := openShm(int32(os.Getpid()), fd, shmMinRing, 1, 0, token)
		unix.Close(fd)
		if err != nil {
			seg.unmap()
			t.Skip(err)
		}
		defer peer.unmap()
		mine, theirs := net.Pipe()
		defer theirs.Close()
		b, l := fuzzLink(mine, seg)
		tx := peer.tx(0)
		copy(tx.data, data)
		tx.head.Store(head)
		for range 3 {
			l.shmProgress()
		}
		b.Close()
	})
}

// A ring all-reduce pipelines in SharedMemorySegment only if every rank has
// shared memory to both its ring neighbours, which ranks cannot see of
// each other: here rank 1 has none, so ranks 0 and 2 have one TCP
// neighbour each while rank 3's neighbours (2 and 0) are both shared
// memory. The segments are chosen so that the two cut a 4 MiB all-reduce
// into different pieces (16 against 1): rank 3 must follow the others.
func TestSharedMemorySegmentAgreed(t *testing.T) {
	skipWithoutShm(t)
	j := newJobPerRank(t, 4, func(r int) *Config {
		c := testConfig()
		c.SharedMemory = r != 1
		c.SegmentSize, c.SharedMemorySegment = 64<<10, 1<<20
		return c
	})
	if b := backendOf(j.comms[3]); b.links[2].shm == nil || b.links[0].shm == nil {
		t.Fatal("rank 3's ring neighbours are not both shared memory")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	j.mustRun(func(r int, c *comm.Comm) error {
		for range 3 {
			if err := sumCheck(ctx, c, 1<<20); err != nil {
				return err
			}
		}
		return nil
	})
}
