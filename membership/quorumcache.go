package membership

import (
	"sync"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// QuorumCache lets the members of one process that share it
// (MemberConfig.Quorums) decode each quorum view and record once and hold
// one copy of each quorum: every member applies the same records to the
// same quorums, so they share the results. A process that hosts many
// members of a job — cmd/ftload's simulated thousands, or one process per
// host with a member per GPU — then costs the memory and CPU of one
// member for its quorums, not of all of them (a quorum of 100,000
// participants is a few MB; 10,000 members each holding their own copy
// would not fit a host). Without it every member decodes and keeps its
// own.
//
// Records are known by their key and etcd mod revision, which name one
// value in one etcd cluster: members that share a cache must watch the
// same cluster and trust the same keys (MemberConfig.QuorumVerifier).
// The quorums a member takes from it are shared: never modify them
// (Member.Quorum returns them by value, its slices shared, as without a
// cache). Safe for concurrent use; the zero value is ready.
type QuorumCache struct {
	mu      sync.Mutex
	decoded map[recordID]*decodedRecord
	applied map[appliedID]*Quorum
	pruneAt int // prune when decoded and applied hold more
}

// NewQuorumCache returns an empty cache.
func NewQuorumCache() *QuorumCache { return &QuorumCache{} }

// recordID names a stored value: its key and mod revision.
type recordID struct {
	key string
	rev int64
}

type decodedRecord struct {
	h     quorumView
	added []Participant
	err   error
}

// appliedID names the result of applying a record to a quorum (nil: to
// none), by the quorum's identity: members that hold the same shared
// quorum get the same result.
type appliedID struct {
	recordID
	from *Quorum
}

// keepCached is how many decoded records and applied results a cache
// keeps before it drops the older epochs'.
const keepCached = 64

// decode is decodeView, once per record for the members sharing c.
func (c *QuorumCache) decode(kv *mvccpb.KeyValue, v *QuorumVerifier) (quorumView, []Participant, error) {
	if c == nil {
		return decodeView(kv.Value, v)
	}
	id := recordID{string(kv.Key), kv.ModRevision}
	c.mu.Lock()
	d, ok := c.decoded[id]
	c.mu.Unlock()
	if ok {
		return d.h, d.added, d.err
	}
	// Decoded outside the lock: two members may both decode a new record,
	// which costs what no cache costs, and store the same result.
	h, added, err := decodeView(kv.Value, v)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.decoded == nil {
		c.decoded = map[recordID]*decodedRecord{}
	}
	c.decoded[id] = &decodedRecord{h: h, added: added, err: err}
	c.maybePruneLocked()
	return h, added, err
}

// apply is applyView, once per record and quorum for the members sharing
// c; it returns the shared result.
func (c *QuorumCache) apply(kv *mvccpb.KeyValue, h quorumView, added []Participant, cur *Quorum) (*Quorum, bool) {
	if c == nil {
		q, ok := applyView(h, added, cur)
		return &q, ok
	}
	from := cur
	if h.From == 0 {
		from = nil // a whole list does not depend on the member's quorum
	}
	id := appliedID{recordID{string(kv.Key), kv.ModRevision}, from}
	c.mu.Lock()
	q, ok := c.applied[id]
	c.mu.Unlock()
	if ok {
		return q, q != nil
	}
	r, good := applyView(h, added, cur)
	if good {
		q = &r
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.applied == nil {
		c.applied = map[appliedID]*Quorum{}
	}
	if prev, ok := c.applied[id]; ok {
		return prev, prev != nil // another member was first: share its result
	}
	c.applied[id] = q
	c.maybePruneLocked()
	return q, good
}

func (c *QuorumCache) maybePruneLocked() {
	if n := len(c.decoded) + len(c.applied); n > max(c.pruneAt, keepCached) {
		c.pruneLocked()
		c.pruneAt = 2 * (len(c.decoded) + len(c.applied))
	}
}

// pruneLocked drops what each job's older epochs left: a member still
// holding one of their quorums applies the next record itself (and
// caches it).
func (c *QuorumCache) pruneLocked() {
	newest := map[string]uint64{}
	for _, d := range c.decoded {
		newest[d.h.Job] = max(newest[d.h.Job], d.h.Epoch)
	}
	const keepEpochs = 4
	for id, d := range c.decoded {
		if d.h.Epoch+keepEpochs <= newest[d.h.Job] {
			delete(c.decoded, id)
		}
	}
	for id, q := range c.applied {
		if q == nil || q.Epoch+keepEpochs <= newest[q.Job] {
			delete(c.applied, id)
		}
	}
}
