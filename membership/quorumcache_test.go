package membership

import (
	"slices"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// Members that share a QuorumCache decode a record once and hold one copy
// of the quorum it yields; a member holding another quorum gets its own
// result, and a change it cannot apply is refused as without a cache.
func TestQuorumCacheShares(t *testing.T) {
	c := NewQuorumCache()
	q1 := viewQuorum(1, "a", "b", "c")
	whole, _ := EncodeQuorumRecord(q1, nil, nil, nil)
	rec := &mvccpb.KeyValue{Key: []byte("/r"), Value: whole, ModRevision: 5}
	take := func(kv *mvccpb.KeyValue, cur *Quorum) (*Quorum, bool) {
		h, added, err := c.decode(kv, nil)
		if err != nil {
			t.Fatal(err)
		}
		return c.apply(kv, h, added, cur)
	}
	a, okA := take(rec, nil)
	b, okB := take(rec, nil)
	if !okA || !okB || a != b || !slices.Equal(a.Participants, compact(q1).Participants) {
		t.Fatalf("the whole list: %v %v, shared %v", okA, okB, a == b)
	}
	q2 := viewQuorum(2, "a", "c")
	q2.Participants[1] = q1.Participants[2]
	change, _ := EncodeQuorumView(&q1, q2, nil, nil)
	ch := &mvccpb.KeyValue{Key: []byte("/v"), Value: change, ModRevision: 6}
	x, okX := take(ch, a)
	y, okY := take(ch, b) // the same shared quorum: the same result
	if !okX || !okY || x != y || x.Epoch != 2 || x.Rank("b") >= 0 {
		t.Fatalf("the change: %v %v shared %v: %+v", okX, okY, x == y, x)
	}
	own := compact(q1) // a member that decoded epoch 1 itself
	z, okZ := take(ch, &own)
	if !okZ || z == x || !slices.Equal(z.Participants, x.Participants) {
		t.Fatalf("another copy of epoch 1: %v, separate %v", okZ, z != x)
	}
	if _, ok := take(ch, nil); ok {
		t.Fatal("a change applied without the epoch it changes")
	}
}
