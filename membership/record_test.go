package membership

import (
	"bytes"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand"
	"slices"
	"testing"
)

// bigQuorum is a quorum of n participants in groups of 8, with ids and
// groups as cmd/ftload names them and incarnations as concurrent joins
// leave them (etcd revisions, shuffled within windows of 128 joins).
func bigQuorum(n int) Quorum {
	r := rand.New(rand.NewSource(1))
	incs := make([]int64, n)
	for i := range incs {
		incs[i] = int64(1000 + 2*i)
	}
	for w := 0; w < n; w += 128 {
		e := min(w+128, n)
		r.Shuffle(e-w, func(i, j int) { incs[w+i], incs[w+j] = incs[w+j], incs[w+i] })
	}
	q := viewQuorum(3)
	q.Participants = make([]Participant, n)
	for i := range q.Participants {
		q.Participants[i] = Participant{ID: fmt.Sprintf("m%06d", i), Addr: "10.0.0.1:29500", Group: fmt.Sprintf("g%06d", i/8),
			Step: 1234, Incarnation: incs[i]}
	}
	return q
}

// The record holds the whole list compactly: 100,000 participants in far
// less than the 1.5 MiB etcd takes by default, three copies (record,
// history entry, the view of a forming job) included.
func TestQuorumRecordSize(t *testing.T) {
	for _, n := range []int{10000, 100000} {
		q := bigQuorum(n)
		raw, err := EncodeQuorumRecord(q, &Revocation{Epoch: 2, Reason: "x"}, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		old, _ := json.Marshal(q)
		t.Logf("%d participants: record %d bytes (%.2f per participant; the JSON record was %.1f)", n, len(raw),
			float64(len(raw))/float64(n), float64(len(old))/float64(n))
		if 3*len(raw) > MaxRequestBytes/2 {
			t.Fatalf("%d participants: a record of %d bytes; three must fit half of %d", n, len(raw), MaxRequestBytes)
		}
		got, err := DecodeQuorumRecord(raw, nil)
		if err != nil {
			t.Fatal(err)
		}
		if want := compact(q); !slices.Equal(got.Participants, want.Participants) || got.Epoch != q.Epoch {
			t.Fatalf("%d participants: the record does not round-trip", n)
		}
	}
}

// Records of both encodings are read, signed or not; a forged one of
// either is refused (ErrForgedQuorum), and an unreadable one is
// ErrMalformedQuorum, never a panic.
func TestQuorumRecordEncodings(t *testing.T) {
	pub, key, _ := ed25519.GenerateKey(nil)
	k := NewQuorumKey(pub)
	sign := func(msg []byte) *QuorumSignature {
		return &QuorumSignature{KeyID: k.ID, Ed25519: ed25519.Sign(key, msg)}
	}
	v := NewQuorumVerifier(k)
	q := viewQuorum(4, "a", "b", "c")

	compactRaw, _ := EncodeQuorumRecord(q, nil, nil, sign)
	legacyUnsigned, _ := json.Marshal(q)
	legacy := signLegacy(t, q, key, k.ID)
	for name, c := range map[string]struct {
		raw []byte
		v   *QuorumVerifier
	}{"compact": {compactRaw, v}, "compact, unverified": {compactRaw, nil}, "legacy": {legacy, v}, "legacy, unsigned": {legacyUnsigned, nil}} {
		got, err := DecodeQuorumRecord(c.raw, c.v)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !slices.Equal(compact(got).Participants, compact(q).Participants) || got.Epoch != 4 || got.Job != "j" || got.MaxStep != 7 {
			t.Fatalf("%s: got %+v", name, got)
		}
		if e, ok := QuorumRecordEpoch(c.raw); !ok || e != 4 {
			t.Fatalf("%s: epoch %d %v", name, e, ok)
		}
	}
	for name, raw := range map[string][]byte{"legacy unsigned": legacyUnsigned, "compact unsigned": mustRecord(t, q, nil)} {
		if _, err := DecodeQuorumRecord(raw, v); !errors.Is(err, ErrForgedQuorum) {
			t.Fatalf("%s: %v, want ErrForgedQuorum", name, err)
		}
	}
	change, _ := EncodeQuorumView(&q, viewQuorum(5, "a", "b"), nil, nil)
	for name, raw := range map[string][]byte{
		"empty": nil, "garbage": []byte("\x00\xff"), "header alone": []byte("{\"epoch\":3}\n"),
		"a change": change, "bad list": append(bytes.Clone(mustRecord(t, q, nil)), 0x80),
	} {
		if _, err := DecodeQuorumRecord(raw, nil); !errors.Is(err, ErrMalformedQuorum) {
			t.Fatalf("%s: %v, want ErrMalformedQuorum", name, err)
		}
	}
}

// A compressed list that inflates past what its count can pack to is
// refused, not inflated.
func TestQuorumViewInflateBound(t *testing.T) {
	bomb, err := deflateBytes(make([]byte, 1<<22))
	if err != nil {
		t.Fatal(err)
	}
	h := quorumView{Job: "j", Epoch: 1, N: 2, Enc: encDeflate, Packed: packDigest(bomb)}
	raw := append(append(mustJSON(t, h), '\n'), bomb...)
	if _, _, err := decodeView(raw, nil); !errors.Is(err, ErrMalformedQuorum) {
		t.Fatalf("bomb: %v", err)
	}
	h.Enc = "zstd"
	raw = append(append(mustJSON(t, h), '\n'), bomb...)
	if _, _, err := decodeView(raw, nil); !errors.Is(err, ErrMalformedQuorum) {
		t.Fatalf("unknown encoding: %v", err)
	}
}

func mustRecord(t *testing.T, q Quorum, sign func([]byte) *QuorumSignature) []byte {
	t.Helper()
	raw, err := EncodeQuorumRecord(q, nil, nil, sign)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// signLegacy writes q as a coordinator of the old encoding did: JSON,
// signed over CanonicalQuorum.
func signLegacy(t *testing.T, q Quorum, key ed25519.PrivateKey, id string) []byte {
	t.Helper()
	raw := mustJSON(t, q)
	msg, _, err := CanonicalQuorum(raw)
	if err != nil {
		t.Fatal(err)
	}
	q.Signature = &QuorumSignature{KeyID: id, Ed25519: ed25519.Sign(key, msg)}
	return mustJSON(t, q)
}
