package gloo

import (
	"context"
	"encoding/binary"
	"fmt"
	"sort"

	"github.com/ftcomm/ftcomm/comm"
)

// Shrink implements comm.Shrinker. The survivors' connections are reused:
// each is handed to the new comm and resynchronised (both ends send a
// resync frame for the new epoch after whatever the failed op left
// unfinished, and discard everything until the other's), so nothing of
// the old epoch leaks into the new one. A connection that is gone is
// replaced through the Store.
func (b *Backend) Shrink(ctx context.Context, exclude []int, epoch uint64) (comm.Backend, error) {
	if epoch <= b.epoch {
		return nil, fmt.Errorf("%w: gloo: shrink to epoch %d, not after %d", comm.ErrInvalidArgument, epoch, b.epoch)
	}
	survivors := make([]int, 0, b.size)
	newRank, ex := -1, 0
	for old := 0; old < b.size; old++ {
		if ex < len(exclude) && exclude[ex] == old {
			ex++
			continue
		}
		if old == b.rank {
			newRank = len(survivors)
		}
		survivors = append(survivors, old)
	}
	if newRank < 0 || ex != len(exclude) {
		return nil, fmt.Errorf("%w: gloo: shrink: exclude %v is not a sorted list of other ranks", comm.ErrInvalidArgument, exclude)
	}
	nb := b.derive(b.prefix, epoch, newRank, len(survivors))
	nb.members = hashInts(survivors)
	// The resyncs tell a survivor still in an op of this comm whom the
	// shrink left out, so its op fails naming them.
	nb.left0 = resyncNote{from: b.epoch, excluded: exclude}
	reuse := make([]*link, len(survivors))
	for i, old := range survivors {
		if old != b.rank {
			reuse[i] = b.handOver(nb, old, i)
		}
	}
	return b.reform(ctx, nb, reuse, survivors)
}

// Grow implements comm.Grower: existing ranks keep their numbers and their
// connections (resynchronised to the new epoch); the joiners dial in.
func (b *Backend) Grow(ctx context.Context, size int, epoch uint64) (comm.Backend, error) {
	if epoch <= b.epoch || size <= b.size {
		return nil, fmt.Errorf("%w: gloo: grow to size %d epoch %d from size %d epoch %d", comm.ErrInvalidArgument, size, epoch, b.size, b.epoch)
	}
	if b.store == nil {
		return nil, fmt.Errorf("%w: gloo: grow needs a Store", comm.ErrInvalidArgument)
	}
	nb := b.derive(b.prefix, epoch, b.rank, size)
	nb.members = hashInts([]int{b.size, size})
	nb.left0 = resyncNote{from: b.epoch}
	reuse := make([]*link, size)
	old := make([]int, size)
	for p := 0; p < b.size; p++ {
		old[p] = p
		if p != b.rank {
			reuse[p] = b.handOver(nb, p, p)
		}
	}
	return b.reform(ctx, nb, reuse, old)
}

// handOver gives b's link to old rank old to nb, where the peer is rank
// peer; nil if there is no live link to hand over.
func (b *Backend) handOver(nb *Backend, old, peer int) *link {
	l := b.links[old]
	if l == nil || l.isClosed() || !l.ownedBy(b) {
		return nil
	}
	l.takeover(nb, peer, resyncInfo{epoch: nb.epoch, size: uint32(nb.size), rank: uint32(peer), members: nb.members})
	return l
}

func (b *Backend) reform(ctx context.Context, nb *Backend, reuse []*link, oldRank []int) (comm.Backend, error) {
	if err := b.formFrom(ctx, nb, reuse); err != nil {
		for i, l := range reuse {
			if l != nil && !l.isClosed() {
				l.giveBack(b, oldRank[i])
			}
		}
		nb.node.release()
		return nil, err
	}
	nb.start()
	return nb, nil
}

// Split implements comm.Splitter. The colors and keys are exchanged with
// an all-gather on this comm (which stays usable); each new comm connects
// afresh under its own prefix.
func (b *Backend) Split(ctx context.Context, color, key int) (comm.Backend, error) {
	if err := b.begin(ctx, comm.OpSplit); err != nil {
		return nil, err
	}
	n := b.size
	all := make([]byte, 16*n)
	mine := make([]byte, 16)
	binary.LittleEndian.PutUint64(mine, uint64(int64(color)))
	binary.LittleEndian.PutUint64(mine[8:], uint64(int64(key)))
	off := make([]int, n+1)
	for i := range off {
		off[i] = 16 * i
	}
	d := desc{op: comm.OpSplit, dtype: comm.Int64, algo: AlgorithmRing, root: -1, count: 2}
	err := b.allGatherRing(ctx, d, all, mine, off)
	seq := b.collSeq
	if err := b.end(err); err != nil {
		return nil, err
	}
	if color == comm.NoColor {
		return nil, nil
	}
	type member struct{ key, rank int }
	var ms []member
	for p := range n {
		c := int(int64(binary.LittleEndian.Uint64(all[16*p:])))
		k := int(int64(binary.LittleEndian.Uint64(all[16*p+8:])))
		if c == color {
			ms = append(ms, member{k, p})
		}
	}
	sort.Slice(ms, func(i, j int) bool {
		if ms[i].key != ms[j].key {
			return ms[i].key < ms[j].key
		}
		return ms[i].rank < ms[j].rank
	})
	newRank := -1
	for i, m := range ms {
		if m.rank == b.rank {
			newRank = i
		}
	}
	prefix := fmt.Sprintf("%s/split%d/color%d", b.prefix, seq, color)
	nb := b.derive(prefix, b.epoch, newRank, len(ms))
	if err := b.formFrom(ctx, nb, nil); err != nil {
		nb.node.release()
		return nil, err
	}
	nb.start()
	return nb, nil
}
