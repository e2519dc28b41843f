package comm

import (
	"errors"
	"fmt"
)

// Errors callers branch on with errors.Is. Backends wrap them; the Comm
// wrapper adds the op and sequence number.
var (
	// ErrTimeout: an op passed its deadline; the comm was aborted.
	ErrTimeout = errors.New("comm: timeout")
	// ErrAborted: the comm was aborted (by Abort, by a timeout, by a peer
	// failure or by the caller's ctx) and refuses collectives until it is
	// shrunk, grown or closed.
	ErrAborted = errors.New("comm: aborted")
	// ErrRevoked: the comm was revoked, here or at a peer.
	ErrRevoked = errors.New("comm: revoked")
	// ErrPeerFailed: a peer died or its connection broke. Found inside a
	// *RankError that names the rank.
	ErrPeerFailed = errors.New("comm: peer failed")
	// ErrPeerClosed: a peer closed its communicator in an orderly way (it
	// left, or moved on to another epoch): its process said goodbye. Found
	// beside ErrPeerFailed (the peer is gone from the comm all the same,
	// and an op that needed it fails), so a caller may tell a departure
	// from a crash.
	ErrPeerClosed = errors.New("comm: peer closed its communicator")
	// ErrMismatch: ranks disagree on an op's kind, dtype, count or root.
	ErrMismatch = errors.New("comm: ranks disagree on the op")
	// ErrInvalidArgument: a caller error found before anything was sent;
	// the comm stays usable.
	ErrInvalidArgument = errors.New("comm: invalid argument")
	// ErrPeerRefused: a peer refused its side of the op (its arguments
	// were invalid there: ErrInvalidArgument at that rank), so the op
	// failed here without moving data; found inside a *RankError that
	// names the refusing rank, with a *Refusal that says why. Like
	// ErrInvalidArgument it leaves the comm usable: every rank's next op
	// runs as usual (on backends that implement Refuser; see Refuser).
	ErrPeerRefused = errors.New("comm: a peer refused the op")
	// ErrBackendUnavailable: the backend cannot run here (no library, no
	// device, unknown name, missing capability).
	ErrBackendUnavailable = errors.New("comm: backend unavailable")
	// ErrClosed: the comm was closed.
	ErrClosed = errors.New("comm: closed")
)

// RankError ties a failure to the rank it concerns.
type RankError struct {
	Rank  int    // the peer's rank in the comm's numbering at the time
	Op    OpType // the op that saw the failure (OpNone outside an op)
	Epoch uint64 // the comm's epoch
	Err   error  // usually wraps ErrPeerFailed, ErrMismatch or ErrPeerRefused
}

func (e *RankError) Error() string {
	return fmt.Sprintf("rank %d (%s, epoch %d): %v", e.Rank, e.Op, e.Epoch, e.Err)
}

func (e *RankError) Unwrap() error { return e.Err }

// Refusal is why a peer refused an op: inside the *RankError (naming that
// rank) of an error that wraps ErrPeerRefused, for errors.As.
type Refusal struct {
	Rank   int    // the rank that refused
	Op     OpType // the op as that rank issued it
	Reason string // what it found wrong (its ErrInvalidArgument's message)
}

func (r *Refusal) Error() string {
	return fmt.Sprintf("%v: rank %d refused its %s: %s", ErrPeerRefused, r.Rank, r.Op, r.Reason)
}

// Unwrap makes a Refusal match ErrPeerRefused.
func (r *Refusal) Unwrap() error { return ErrPeerRefused }

// FailedRanks lists the ranks named by every *RankError inside err
// (following errors.Join and wrapping), without duplicates, in order found.
func FailedRanks(err error) []int {
	var out []int
	seen := map[int]bool{}
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		if re, ok := e.(*RankError); ok && !seen[re.Rank] {
			seen[re.Rank] = true
			out = append(out, re.Rank)
		}
		switch u := e.(type) {
		case interface{ Unwrap() []error }:
			for _, x := range u.Unwrap() {
				walk(x)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalidArgument}, args...)...)
}
