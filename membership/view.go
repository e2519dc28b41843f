package membership

import (
	"bytes"
	"compress/flate"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
)

// The quorum view is what members watch (<root>/_coordinator/jobs/<job>/view): a quorum in a
// compact form, written by the coordinator in the same transaction as the
// record (…/quorum, the whole list in the same form: record.go). A member
// needs of a quorum only what it acts on — the epoch, each participant's
// id, group and incarnation in rank order, and the epoch's facts
// (MaxStep, Base, Final, Run, Departed) — not the participants' addresses
// and steps, which are in the members' own records.
//
// A view is either a change of epoch From (the participants of From less
// Removed, then the added ones: the quorum rules keep survivors in order
// and append joiners) or, with From 0, the whole list. The participants
// are packed (ids and groups front-coded, incarnations as varint deltas)
// and, past a few hundred bytes, compressed (deflate): the whole list of
// 100,000 participants with sequential ids is about 230 KB. A signature
// covers the header, and the header the stored participants (their
// digest): a member that cannot apply a view (it does not hold epoch
// From) reads the whole list, the record, instead.
//
// Encoding: the header as JSON, a newline, the packed participants.

// quorumView is a view's header.
type quorumView struct {
	Job    string `json:"job"`
	Epoch  uint64 `json:"epoch"`
	From   uint64 `json:"from,omitempty"` // 0: the packed list is every participant
	N      int    `json:"n"`              // participants
	Packed string `json:"packed"`         // packDigest of the packed participants (as stored, compressed or not)
	// Enc is how the packed participants are stored: "" as they are,
	// "deflate" compressed (RFC 1951), which a list of more than a few
	// hundred bytes is: sequential ids and groups compress to about a
	// third.
	Enc     string `json:"enc,omitempty"`
	MaxStep int64  `json:"maxStep"`
	// Revocation is the previous epoch's, when the coordinator knew it: a
	// member takes it before the quorum, so that Revocation has the record
	// when Revoked fires.
	Revocation *Revocation `json:"revocation,omitempty"`
	// Created, Reason (capped at maxViewReason), Removed, Departed, Base,
	// Prepared, Final, Run and PublishedBy are the quorum's.
	Created     time.Time `json:"created"`
	Reason      string    `json:"reason,omitempty"`
	Removed     []string  `json:"removed,omitempty"`
	Departed    []string  `json:"departed,omitempty"`
	Base        uint64    `json:"base,omitempty"`
	Prepared    bool      `json:"prepared,omitempty"`
	Final       int64     `json:"final,omitempty"`
	FinalFrom   []string  `json:"finalFrom,omitempty"`
	Run         string    `json:"run,omitempty"`
	RunStep     int64     `json:"runStep,omitempty"`
	PublishedBy string    `json:"publishedBy,omitempty"`
	// Target, Promoted and Replaced are the quorum's (spares).
	Target   int      `json:"target,omitempty"`
	Promoted []string `json:"promoted,omitempty"`
	Replaced []string `json:"replaced,omitempty"`
	// Settings names the job's settings in force (Quorum.Settings);
	// SettingsDoc is that document, carried by the view that changes it
	// and by every whole list, so a member needs no other read.
	Settings    *SettingsRef     `json:"settings,omitempty"`
	SettingsDoc *JobSettings     `json:"settingsDoc,omitempty"`
	Signature   *QuorumSignature `json:"signature,omitempty"`
}

// maxViewReason caps the reason a view carries ("joined …" names every
// joiner).
const maxViewReason = 256

const viewSigContext = "ftcomm-quorum-view-v1\n"

// EncodeQuorumView returns the view of q that members watch: a change of
// prev (nil: the whole list), with rev, the revocation of prev's epoch
// when known (nil: none). sign, when not nil, signs the header's
// canonical bytes (coordinator.QuorumSigner.Sign).
func EncodeQuorumView(prev *Quorum, q Quorum, rev *Revocation, sign func(msg []byte) *QuorumSignature) ([]byte, error) {
	return EncodeQuorumViewWith(prev, q, rev, nil, sign)
}

// EncodeQuorumViewWith is EncodeQuorumView with the settings document q
// names (q.Settings; nil when it names none): the view carries it when it
// is a whole list or the settings changed since prev.
func EncodeQuorumViewWith(prev *Quorum, q Quorum, rev *Revocation, settings *JobSettings, sign func(msg []byte) *QuorumSignature) ([]byte, error) {
	v := quorumView{Job: q.Job, Epoch: q.Epoch, N: len(q.Participants), MaxStep: q.MaxStep, Revocation: rev,
		Created: q.Created, Reason: q.Reason, Departed: q.Departed, Base: q.Base, Prepared: q.Prepared, Final: q.Final, FinalFrom: q.FinalFrom,
		Run: q.Run, RunStep: q.RunStep, PublishedBy: q.PublishedBy, Settings: q.Settings,
		Target: q.Target, Promoted: q.Promoted, Replaced: q.Replaced}
	if q.Settings != nil && settings != nil && (prev == nil || prev.Settings == nil || *prev.Settings != *q.Settings) {
		doc := *settings
		v.SettingsDoc = &doc
	}
	if len(v.Reason) > maxViewReason {
		v.Reason = v.Reason[:maxViewReason-3] + "..."
	}
	added := q.Participants
	if prev != nil {
		v.From = prev.Epoch
		v.Removed, added = changeOf(prev.Participants, q.Participants)
	}
	if v.From == 0 {
		v.Removed = q.Removed
	}
	packed := packParticipants(added)
	if len(packed) > deflateAbove {
		var err error
		if packed, err = deflateBytes(packed); err != nil {
			return nil, err
		}
		v.Enc = encDeflate
	}
	v.Packed = packDigest(packed)
	head, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	if sign != nil {
		msg, _, err := canonicalRecord(viewSigContext, head)
		if err != nil {
			return nil, err
		}
		v.Signature = sign(msg)
		if head, err = json.Marshal(v); err != nil {
			return nil, err
		}
	}
	return append(append(head, '\n'), packed...), nil
}

// changeOf expresses next as prev less removed, then tail: the survivors
// that keep their order, then the rest (a survivor that moved, which the
// rules never do, is removed and added again).
func changeOf(prev, next []Participant) (removed []string, tail []Participant) {
	j := 0
	for _, p := range prev {
		if j < len(next) && next[j].ID == p.ID && next[j].Incarnation == p.Incarnation && next[j].Group == p.Group {
			j++
			continue
		}
		removed = append(removed, p.ID)
	}
	return removed, next[j:]
}

// packDigest is the first 16 bytes of the SHA-256 of a view's packed
// participants, hex: the signed header binds them through it. The list a
// change yields is right when the list it changes was (the member's
// previous view, or the record), and the count checks it again.
func packDigest(packed []byte) string {
	sum := sha256.Sum256(packed)
	return hex.EncodeToString(sum[:16])
}

// packParticipants front-codes ids and groups (the length shared with
// the previous one, then the rest) and writes incarnations as varint
// deltas.
func packParticipants(ps []Participant) []byte {
	out := make([]byte, 0, 12*len(ps))
	var prevID, prevGroup string
	var prevInc int64
	front := func(prev, s string) {
		n := 0
		for n < len(prev) && n < len(s) && prev[n] == s[n] {
			n++
		}
		out = binary.AppendUvarint(out, uint64(n))
		out = binary.AppendUvarint(out, uint64(len(s)-n))
		out = append(out, s[n:]...)
	}
	for _, p := range ps {
		front(prevID, p.ID)
		out = binary.AppendVarint(out, p.Incarnation-prevInc)
		front(prevGroup, p.Group)
		prevID, prevInc, prevGroup = p.ID, p.Incarnation, p.Group
	}
	return out
}

// ErrMalformedQuorum: a quorum record or view cannot be read (not one of
// the encodings a coordinator writes, truncated, or its participants do
// not match its header). Members ignore it; the leader repairs a record
// it cannot read.
var ErrMalformedQuorum = errors.New("membership: malformed quorum record")

var errBadView = ErrMalformedQuorum

const (
	// encDeflate: the packed participants are compressed (quorumView.Enc).
	encDeflate = "deflate"
	// deflateAbove is the packed size above which a view compresses it.
	deflateAbove = 512
	// maxPackedParticipant bounds the packed bytes of one participant
	// (an id and a group of at most 128 bytes each, their lengths and an
	// incarnation): a compressed list inflates to at most N times that.
	maxPackedParticipant = 2*(128+2*binary.MaxVarintLen64) + binary.MaxVarintLen64
	// maxViewParticipants bounds the count a view may claim.
	maxViewParticipants = 1 << 24
)

func deflateBytes(b []byte) ([]byte, error) {
	var out bytes.Buffer
	w, err := flate.NewWriter(&out, flate.BestSpeed)
	if err != nil {
		return nil, err
	}
	if _, err := w.Write(b); err != nil {
		return nil, err
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

// inflateParticipants undoes deflateBytes for a list of n participants,
// refusing more than n participants can pack to (a bomb).
func inflateParticipants(b []byte, n int) ([]byte, error) {
	if n < 0 || n > maxViewParticipants {
		return nil, fmt.Errorf("%w: a view of %d participants", errBadView, n)
	}
	limit := int64(n) * maxPackedParticipant
	r := flate.NewReader(bytes.NewReader(b))
	defer r.Close()
	out, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, fmt.Errorf("%w: the participants do not inflate: %v", errBadView, err)
	}
	if int64(len(out)) > limit {
		return nil, fmt.Errorf("%w: the participants inflate past %d bytes", errBadView, limit)
	}
	return out, nil
}

func unpackParticipants(b []byte, n int) ([]Participant, error) {
	if n < 0 || n > len(b) {
		n = 0
	}
	ps := make([]Participant, 0, n)
	var prevID, prevGroup string
	var prevInc int64
	front := func(prev string) (string, bool) {
		shared, k := binary.Uvarint(b)
		if k <= 0 || shared > uint64(len(prev)) {
			return "", false
		}
		b = b[k:]
		rest, k := binary.Uvarint(b)
		if k <= 0 || rest > uint64(len(b)-k) {
			return "", false
		}
		s := prev[:shared] + string(b[k:k+int(rest)])
		b = b[k+int(rest):]
		return s, true
	}
	for len(b) > 0 {
		id, ok := front(prevID)
		if !ok {
			return nil, errBadView
		}
		d, k := binary.Varint(b)
		if k <= 0 {
			return nil, errBadView
		}
		b = b[k:]
		g, ok := front(prevGroup)
		if !ok {
			return nil, errBadView
		}
		prevID, prevInc, prevGroup = id, prevInc+d, g
		ps = append(ps, Participant{ID: id, Incarnation: prevInc, Group: g})
	}
	return ps, nil
}

// decodeView splits a view record into its header and added participants,
// checking the header's signature when v is not nil.
func decodeView(raw []byte, v *QuorumVerifier) (quorumView, []Participant, error) {
	var h quorumView
	i := bytes.IndexByte(raw, '\n')
	if i < 0 {
		return h, nil, errBadView
	}
	if v != nil {
		if err := v.verifyRecord(viewSigContext, raw[:i]); err != nil {
			return h, nil, err
		}
	}
	if err := json.Unmarshal(raw[:i], &h); err != nil {
		return h, nil, fmt.Errorf("%w: %v", errBadView, err)
	}
	packed := raw[i+1:]
	if packDigest(packed) != h.Packed {
		return h, nil, fmt.Errorf("%w: the participants do not match the header", errBadView)
	}
	switch h.Enc {
	case "":
	case encDeflate:
		var err error
		if packed, err = inflateParticipants(packed, h.N); err != nil {
			return h, nil, err
		}
	default:
		return h, nil, fmt.Errorf("%w: unknown participants encoding %q", errBadView, h.Enc)
	}
	added, err := unpackParticipants(packed, h.N)
	return h, added, err
}

// viewHeader decodes a view's header alone (unverified).
func viewHeader(raw []byte) (quorumView, bool) {
	var h quorumView
	i := bytes.IndexByte(raw, '\n')
	return h, i > 0 && json.Unmarshal(raw[:i], &h) == nil
}

// applyView returns the quorum a view describes, given the member's
// current one (nil: none); ok false when the view is a change of an epoch
// the member does not hold, or the result has not the view's count.
func applyView(h quorumView, added []Participant, cur *Quorum) (Quorum, bool) {
	var ps []Participant
	var addedIDs []string
	switch {
	case h.From == 0:
		ps = added
	case cur != nil && cur.Epoch == h.From:
		ps = make([]Participant, 0, h.N)
		gone := make(map[string]bool, len(h.Removed))
		for _, id := range h.Removed {
			gone[id] = true
		}
		for _, p := range cur.Participants {
			if !gone[p.ID] {
				ps = append(ps, p)
			}
		}
		ps = append(ps, added...)
		for _, p := range added {
			addedIDs = append(addedIDs, p.ID)
		}
	default:
		return Quorum{}, false
	}
	if len(ps) != h.N {
		return Quorum{}, false
	}
	return Quorum{Job: h.Job, Epoch: h.Epoch, Participants: ps, MaxStep: h.MaxStep, Created: h.Created, Reason: h.Reason,
		Removed: h.Removed, Added: addedIDs, Departed: h.Departed, PublishedBy: h.PublishedBy, Base: h.Base, Prepared: h.Prepared, Final: h.Final,
		FinalFrom: h.FinalFrom, Run: h.Run, RunStep: h.RunStep, Settings: h.Settings,
		Target: h.Target, Promoted: h.Promoted, Replaced: h.Replaced}, true
}

// compact strips from q what a view does not carry (participants'
// addresses and steps; the signature), so that a member's quorum looks
// the same whether it came from a view or a record of the old encoding.
func compact(q Quorum) Quorum {
	ps := make([]Participant, len(q.Participants))
	for i, p := range q.Participants {
		ps[i] = Participant{ID: p.ID, Group: p.Group, Incarnation: p.Incarnation}
	}
	q.Participants, q.Signature = ps, nil
	return q
}

// verifyRecord checks the signature a JSON record carries over its
// canonical bytes under context.
func (v *QuorumVerifier) verifyRecord(context string, raw []byte) error {
	msg, sig, err := canonicalRecord(context, raw)
	if err != nil {
		return err
	}
	if sig == nil {
		return fmt.Errorf("%w: the record is not signed", ErrForgedQuorum)
	}
	pub, ok := v.keys[sig.KeyID]
	if !ok {
		return fmt.Errorf("%w: signed by key %q, trusted: %v", ErrForgedQuorum, sig.KeyID, v.Keys())
	}
	if !ed25519.Verify(pub, msg, sig.Ed25519) {
		return fmt.Errorf("%w: bad signature by key %q", ErrForgedQuorum, sig.KeyID)
	}
	return nil
}
