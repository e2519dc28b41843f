package membership

import (
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"
)

func viewQuorum(epoch uint64, ids ...string) Quorum {
	q := Quorum{Job: "j", Epoch: epoch, MaxStep: 7, Created: time.Unix(100, 0).UTC(), Reason: "why", Base: epoch - 1, Prepared: true, Run: "r1"}
	for i, id := range ids {
		q.Participants = append(q.Participants, Participant{ID: id, Addr: id + ":1", Group: "g" + id[:1], Step: 7, Incarnation: int64(100 + 3*i)})
	}
	return q
}

func decodeApply(t *testing.T, raw []byte, v *QuorumVerifier, cur *Quorum) (Quorum, bool) {
	t.Helper()
	h, added, err := decodeView(raw, v)
	if err != nil {
		t.Fatal(err)
	}
	return applyView(h, added, cur)
}

// A view rebuilds the member's quorum: the whole list at first, then a
// change of the epoch the member holds; a change of another epoch, or one
// whose result differs from its digest, is not applied (the member reads
// the full record).
func TestQuorumViewRoundTrip(t *testing.T) {
	q1 := viewQuorum(1, "a", "b", "c", "d")
	raw, err := EncodeQuorumView(nil, q1, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, ok := decodeApply(t, raw, nil, nil)
	if want := compact(q1); !ok || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("full view:\n got %+v\nwant %+v", got, want)
	}
	// b dies, c restarts (a new incarnation), e joins.
	q2 := viewQuorum(2, "a", "d", "c", "e")
	q2.Participants[0], q2.Participants[1] = q1.Participants[0], q1.Participants[3]
	q2.Participants[2].Incarnation = 999
	q2.Removed, q2.Departed = []string{"b", "c"}, []string{"b"}
	raw, err = EncodeQuorumView(&q1, q2, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, ok = decodeApply(t, raw, nil, &got)
	if want := compact(q2); !ok || !slices.Equal(got.Participants, want.Participants) || !slices.Equal(got.Removed, []string{"b", "c"}) ||
		!slices.Equal(got.Added, []string{"c", "e"}) || !slices.Equal(got.Departed, []string{"b"}) || got.Epoch != 2 || got.Base != 1 || !got.Prepared {
		t.Fatalf("change:\n got %+v\nwant %+v", got, want)
	}
	if _, ok := decodeApply(t, raw, nil, nil); ok {
		t.Fatal("a change applied without the epoch it changes")
	}
	wrong := compact(q1)
	wrong.Epoch = 7
	if _, ok := decodeApply(t, raw, nil, &wrong); ok {
		t.Fatal("a change applied to an epoch other than the one it changes")
	}
}

// A view is small: the whole list of 10,000 participants packs to a few
// bytes each, and a change of one of them to a few hundred bytes.
func TestQuorumViewSize(t *testing.T) {
	var ids []string
	for i := 0; i < 10000; i++ {
		ids = append(ids, fmt.Sprintf("m%06d", i))
	}
	q := viewQuorum(1, ids...)
	full, _ := EncodeQuorumView(nil, q, nil, nil)
	q2 := q
	q2.Epoch, q2.Participants = 2, q.Participants[1:]
	change, _ := EncodeQuorumView(&q, q2, nil, nil)
	t.Logf("10,000 participants: the whole list %d bytes (%.1f per participant), a death %d bytes", len(full), float64(len(full))/1e4, len(change))
	if len(full) > 10*10000 || len(change) > 512 {
		t.Fatalf("views of %d and %d bytes", len(full), len(change))
	}
}

// A signed view is verified; an altered header or an unsigned view is
// refused (ErrForgedQuorum), and so is an altered list (by its digest).
func TestQuorumViewSigned(t *testing.T) {
	pub, key, _ := ed25519.GenerateKey(nil)
	k := NewQuorumKey(pub)
	sign := func(msg []byte) *QuorumSignature {
		return &QuorumSignature{KeyID: k.ID, Ed25519: ed25519.Sign(key, msg)}
	}
	v := NewQuorumVerifier(k)
	q := viewQuorum(1, "a", "b")
	raw, _ := EncodeQuorumView(nil, q, nil, sign)
	if _, ok := decodeApply(t, raw, v, nil); !ok {
		t.Fatal("signed view not applied")
	}
	unsigned, _ := EncodeQuorumView(nil, q, nil, nil)
	if _, _, err := decodeView(unsigned, v); !errors.Is(err, ErrForgedQuorum) {
		t.Fatalf("unsigned view: %v", err)
	}
	h, _, _ := decodeView(raw, v)
	h.MaxStep++
	if _, _, err := decodeView(append(mustJSON(t, h), raw[slices.Index(raw, '\n'):]...), v); !errors.Is(err, ErrForgedQuorum) {
		t.Fatalf("altered header: %v", err)
	}
	tampered := append([]byte{}, raw...)
	tampered[len(tampered)-2] ^= 1 // in the packed list
	if _, _, err := decodeView(tampered, v); !errors.Is(err, errBadView) {
		t.Fatalf("altered list: %v", err)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
