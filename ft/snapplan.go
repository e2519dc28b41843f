package ft

import (
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/ftcomm/ftcomm/comm"
)

// The group's decision at a reconfiguration under peer snapshots
// (snapshot.go): what each rank holds (snapInventory, all-gathered on the
// group's control comm), where each rank's copies go (buddies), and which
// snapshot the group restores (decideRestore) — pure functions of what
// every rank of the group received alike.

// snapInventory is what one rank of a group holds, all-gathered at every
// reconfiguration of the group.
type snapInventory struct {
	Rank     int     `json:"r"`
	Step     int64   `json:"s"` // the committed step it holds
	Host     string  `json:"h"`
	Own      []int64 `json:"o,omitempty"` // steps of its complete own copies
	HeldSlot int     `json:"hs"`          // whose copies Held are (-1: none)
	Held     []int64 `json:"hd,omitempty"`
	Complete int64   `json:"c"` // newest step it knows complete (-1: none)
	OwnAddr  string  `json:"oa"`
	HeldAddr string  `json:"ha"`
}

// inventoryRecordSize bounds an encoded inventory (two addresses, a host
// name of up to 253 bytes and four steps fit well within it).
const inventoryRecordSize = 2048

func gatherInventories(ctx context.Context, ctl *comm.Comm, mine snapInventory) ([]snapInventory, error) {
	b, err := json.Marshal(mine)
	if err != nil {
		return nil, err
	}
	if len(b)+4 > inventoryRecordSize {
		return nil, fmt.Errorf("%w: ft: snapshot inventory of %d bytes (host name too long?)", comm.ErrInvalidArgument, len(b))
	}
	rec := make([]byte, inventoryRecordSize)
	binary.LittleEndian.PutUint32(rec, uint32(len(b)))
	copy(rec[4:], b)
	all := make([]byte, inventoryRecordSize*ctl.Size())
	if err := ctl.AllGather(ctx, comm.Uint8s(all), comm.Uint8s(rec)); err != nil {
		return nil, err
	}
	invs := make([]snapInventory, ctl.Size())
	for r := range invs {
		x := all[r*inventoryRecordSize : (r+1)*inventoryRecordSize]
		n := int(binary.LittleEndian.Uint32(x))
		if n > inventoryRecordSize-4 {
			return nil, fmt.Errorf("%w: ft: rank %d's snapshot inventory is malformed", comm.ErrMismatch, r)
		}
		if err := json.Unmarshal(x[4:4+n], &invs[r]); err != nil {
			return nil, fmt.Errorf("%w: ft: rank %d's snapshot inventory: %v", comm.ErrMismatch, r, err)
		}
		if invs[r].Rank != r {
			return nil, fmt.Errorf("%w: ft: the group's rank %d says it is slot %d", comm.ErrMismatch, r, invs[r].Rank)
		}
	}
	return invs, nil
}

// buddies maps each slot of a group to its buddy, the slot that holds a
// copy of its snapshots: a permutation, so every rank holds one copy.
// Slots are ordered by host (then slot) and each is sent as many places on
// as the largest host has ranks, so a layout of equal hosts puts every
// copy on the next host; one host alone pairs each slot with the next.
func buddies(hosts []string) []int {
	n := len(hosts)
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(hosts[a], hosts[b]) })
	per := map[string]int{}
	most := 0
	for _, h := range hosts {
		per[h]++
		most = max(most, per[h])
	}
	shift := most
	if shift >= n {
		shift = 1
	}
	out := make([]int, n)
	for i, slot := range order {
		out[slot] = order[(i+shift)%n]
	}
	return out
}

// restorePlan is the group's decision at a reconfiguration.
type restorePlan struct {
	Restore bool
	Step    int64 // the snapshot step every rank restores
	// From[r] is the rank whose held copy slot r restores from; -1: its
	// own copy.
	From []int
}

// ErrSnapshotLost is matched by a *SnapshotLostError.
var ErrSnapshotLost = errors.New("ft: the peer snapshots of a shard are lost")

// SnapshotLostError is returned by Step at every rank of a replica group
// whose ranks hold different steps when no complete peer snapshot has a
// copy of every shard (Config.SnapshotEvery): both copies of a shard were
// lost (the rank and its buddy died), or no snapshot was complete yet.
// Nothing was restored; restore the job from your own checkpoint. Step
// keeps returning it.
type SnapshotLostError struct {
	Group string
	Slots []int // the group ranks whose shard has no copy
	Steps []int64
	// Newest is the newest snapshot step known complete (-1: none).
	Newest int64
}

func (e *SnapshotLostError) Error() string {
	what := fmt.Sprintf("no copy of the shards of ranks %v at snapshot step %d (a rank and its buddy both lost)", e.Slots, e.Newest)
	if e.Newest < 0 {
		what = fmt.Sprintf("no peer snapshot was complete yet (ranks %v hold nothing)", e.Slots)
	}
	return fmt.Sprintf("ft: group %s: its ranks stand at steps %v and %s; nothing was restored: restore the job from your checkpoint",
		e.Group, e.Steps, what)
}

func (e *SnapshotLostError) Unwrap() error { return ErrSnapshotLost }

// decideRestore is the group's decision from every rank's inventory (in
// slot order): a pure function, so every rank decides alike. Ranks whose
// steps agree restore nothing. Otherwise the newest snapshot step up to
// the newest known complete (by any rank: it learned that every rank held
// its source's copy; a newer one may be half taken) of which every slot
// has a copy — its own, or, for a rank that lacks it, one held by another
// rank — is restored everywhere.
func decideRestore(group string, invs []snapInventory) (restorePlan, error) {
	steps := make([]int64, len(invs))
	same := true
	for i, in := range invs {
		steps[i] = in.Step
		same = same && in.Step == invs[0].Step
	}
	if same {
		return restorePlan{}, nil
	}
	newest := int64(-1)
	for _, in := range invs {
		newest = max(newest, in.Complete)
	}
	// Candidates: the steps of the copies the ranks hold, up to the
	// newest known complete (a newer one may be half taken).
	var cands []int64
	for _, in := range invs {
		for _, st := range slices.Concat(in.Own, in.Held) {
			if st <= newest && !slices.Contains(cands, st) {
				cands = append(cands, st)
			}
		}
	}
	slices.Sort(cands)
	slices.Reverse(cands)
	var lacking []int
	for _, step := range cands {
		from := make([]int, len(invs))
		lacking = lacking[:0]
		for r, in := range invs {
			if slices.Contains(in.Own, step) && in.Step >= step {
				from[r] = -1
				continue
			}
			h := slices.IndexFunc(invs, func(x snapInventory) bool { return x.HeldSlot == r && slices.Contains(x.Held, step) })
			if h < 0 {
				lacking = append(lacking, r)
			}
			from[r] = h
		}
		if len(lacking) == 0 {
			return restorePlan{Restore: true, Step: step, From: from}, nil
		}
	}
	if len(cands) == 0 {
		for r, in := range invs {
			if in.Step < slices.Max(steps) {
				lacking = append(lacking, r)
			}
		}
	}
	return restorePlan{}, &SnapshotLostError{Group: group, Slots: slices.Clone(lacking), Steps: steps, Newest: newest}
}

// describePlan is the restore's log line.
func describePlan(p restorePlan, invs []snapInventory) string {
	var parts []string
	for r, h := range p.From {
		if h >= 0 {
			parts = append(parts, fmt.Sprintf("rank %d from rank %d's copy", r, h))
		}
	}
	steps := make([]string, len(invs))
	for i, in := range invs {
		steps[i] = fmt.Sprint(in.Step)
	}
	return fmt.Sprintf("restoring snapshot step %d (ranks at steps %s; %s)", p.Step, strings.Join(steps, ","), strings.Join(parts, ", "))
}
