package diloco

// span is a fragment: params[lo:hi].
type span struct{ lo, hi int }

func (s span) len() int { return s.hi - s.lo }

// split cuts n parameters into f contiguous fragments of nearly equal
// size, their boundaries on multiples of align where that leaves none
// empty (so quantization blocks do not straddle fragments).
func split(n, f, align int) []span {
	out := make([]span, f)
	unit := align
	if n/f < align {
		unit = 1
	}
	units := (n + unit - 1) / unit
	for i := range f {
		lo, hi := i*units/f*unit, (i+1)*units/f*unit
		out[i] = span{min(lo, n), min(hi, n)}
	}
	out[f-1].hi = n
	return out
}

// Schedule says what the inner loop does around inner step t (counted
// from the replica's first step, 0-based, after the step ran): a sync
// starts after every H/F-th inner step, counting the replica's start as
// the first (its join), and the sync started at t finishes after t+τ.
type Schedule struct {
	Every, Overlap int // H/F and τ
	// From is the inner step the period counts from: 0, or the start of
	// the sync at which the period last changed (DiLoCo.Retune).
	From int
}

// StartsAt reports whether a sync starts once `done` inner steps have run
// since the replica started (done = 0 is the join sync before any step).
func (s Schedule) StartsAt(done int) bool { return done >= s.From && (done-s.From)%s.Every == 0 }

// FinishesAt reports whether the sync started at `started` is finished
// once `done` inner steps have run.
func (s Schedule) FinishesAt(started, done int) bool { return done-started >= s.Overlap }

// Fragment is the fragment the sync of committed step `step` exchanges:
// round robin over the committed steps, so every replica of a quorum,
// which agrees on the committed step, picks the same one, and a sync whose
// commit failed is retried next time.
func Fragment(step int64, fragments int) int { return int(step % int64(fragments)) }
