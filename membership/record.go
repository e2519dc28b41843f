package membership

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// The quorum record (<root>/_coordinator/jobs/<job>/quorum) and each
// history entry (…/history/<epoch>) hold the quorum as a view of the whole
// list (view.go): the header (epoch, facts, signature) and the packed,
// compressed participants — about 2–7 bytes per participant instead of
// the ~97 of the JSON record written before (addresses and steps are in
// the members' own records). One epoch's transaction (record, history
// entry, view) is then about 0.7 MB at 100,000 participants, within
// etcd's default request limit (1.5 MiB).
//
// Records of the old encoding (one JSON object, signed over
// CanonicalQuorum) are still read: a coordinator restarted on a data
// directory written before loads its quorum and history from them, and
// a member takes one the leader restored; the next publication writes
// the new encoding.

// EncodeQuorumRecord returns q as the coordinator stores its record and
// history entry: the view of the whole list, carrying rev (the previous
// epoch's revocation, nil: none) and the settings document q names (nil:
// none), signed by sign when it is not nil.
func EncodeQuorumRecord(q Quorum, rev *Revocation, settings *JobSettings, sign func(msg []byte) *QuorumSignature) ([]byte, error) {
	return EncodeQuorumViewWith(nil, q, rev, settings, sign)
}

// DecodeQuorumRecord reads a quorum record or history entry of either
// encoding, verifying its signature when v is not nil (an error wrapping
// ErrForgedQuorum when it is not signed by a key v trusts). A record that
// cannot be read is an error wrapping ErrMalformedQuorum. The quorum's
// participants carry ID, Group and Incarnation (and Addr and Step in a
// record of the old encoding); its Added is not known.
func DecodeQuorumRecord(raw []byte, v *QuorumVerifier) (Quorum, error) {
	if legacyRecord(raw) {
		var q Quorum
		if v != nil {
			var err error
			if q, err = v.Verify(raw); err != nil {
				return Quorum{}, err
			}
			return q, nil
		}
		if err := json.Unmarshal(raw, &q); err != nil {
			return Quorum{}, fmt.Errorf("%w: %v", ErrMalformedQuorum, err)
		}
		return q, nil
	}
	h, added, err := decodeView(raw, v)
	if err != nil {
		return Quorum{}, err
	}
	if h.From != 0 {
		return Quorum{}, fmt.Errorf("%w: a change of epoch %d, not a whole list", ErrMalformedQuorum, h.From)
	}
	q, ok := applyView(h, added, nil)
	if !ok {
		return Quorum{}, fmt.Errorf("%w: %d participants, the header says %d", ErrMalformedQuorum, len(added), h.N)
	}
	return q, nil
}

// QuorumRecordEpoch returns the epoch a quorum record or view of either
// encoding claims, unverified (for a record the reader will not trust,
// e.g. to publish above it).
func QuorumRecordEpoch(raw []byte) (uint64, bool) {
	head := raw
	if i := bytes.IndexByte(raw, '\n'); i >= 0 {
		head = raw[:i]
	}
	var h struct {
		Epoch uint64 `json:"epoch"`
	}
	if json.Unmarshal(head, &h) != nil {
		return 0, false
	}
	return h.Epoch, true
}

// legacyRecord reports whether raw is a record of the old encoding: one
// JSON object (json.Marshal writes no newline), where a view is its
// header, a newline and the packed participants.
func legacyRecord(raw []byte) bool {
	return bytes.IndexByte(raw, '\n') < 0
}
