package membership

import (
	"bytes"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
)

// ErrForgedQuorum: a quorum record is not signed by a coordinator key the
// reader trusts (unsigned, signed by an unknown key, or altered after
// signing). Members ignore such a quorum; the leader rewrites its own.
var ErrForgedQuorum = errors.New("membership: quorum not signed by a trusted coordinator key")

// QuorumSignature is an ed25519 signature over a quorum record's
// canonical bytes (see CanonicalQuorum).
type QuorumSignature struct {
	KeyID   string `json:"keyId"`
	Ed25519 []byte `json:"ed25519"`
}

// QuorumKey is a coordinator's public quorum-verification key.
type QuorumKey struct {
	ID      string            `json:"id"`
	Ed25519 ed25519.PublicKey `json:"ed25519"`
}

// NewQuorumKey returns a public key with its id: the first 8 bytes of its
// SHA-256, hex.
func NewQuorumKey(pub ed25519.PublicKey) QuorumKey {
	return QuorumKey{ID: quorumKeyID(pub), Ed25519: pub}
}

func quorumKeyID(pub ed25519.PublicKey) string {
	sum := sha256.Sum256(pub)
	return hex.EncodeToString(sum[:8])
}

// QuorumVerifier checks quorum records against trusted coordinator keys.
// Safe for concurrent use.
type QuorumVerifier struct {
	keys map[string]ed25519.PublicKey
}

// NewQuorumVerifier trusts the given keys (several during a key
// rotation).
func NewQuorumVerifier(keys ...QuorumKey) *QuorumVerifier {
	v := &QuorumVerifier{keys: map[string]ed25519.PublicKey{}}
	for _, k := range keys {
		if len(k.Ed25519) == ed25519.PublicKeySize {
			v.keys[quorumKeyID(k.Ed25519)] = k.Ed25519
		}
	}
	return v
}

// Keys returns the ids of the trusted keys.
func (v *QuorumVerifier) Keys() []string {
	out := make([]string, 0, len(v.keys))
	for id := range v.keys {
		out = append(out, id)
	}
	return out
}

// Verify decodes a quorum record and checks its signature; the error
// wraps ErrForgedQuorum when the record is not signed by a trusted key.
func (v *QuorumVerifier) Verify(raw []byte) (Quorum, error) {
	msg, sig, err := CanonicalQuorum(raw)
	if err != nil {
		return Quorum{}, err
	}
	if sig == nil {
		return Quorum{}, fmt.Errorf("%w: the record is not signed", ErrForgedQuorum)
	}
	pub, ok := v.keys[sig.KeyID]
	if !ok {
		return Quorum{}, fmt.Errorf("%w: signed by key %q, trusted: %v", ErrForgedQuorum, sig.KeyID, v.Keys())
	}
	if !ed25519.Verify(pub, msg, sig.Ed25519) {
		return Quorum{}, fmt.Errorf("%w: bad signature by key %q", ErrForgedQuorum, sig.KeyID)
	}
	var q Quorum
	if err := json.Unmarshal(raw, &q); err != nil {
		return Quorum{}, fmt.Errorf("membership: quorum record: %w", err)
	}
	return q, nil
}

const quorumSigContext = "ftcomm-quorum-v1\n"

// CanonicalQuorum returns the bytes a quorum record's signature covers,
// and the signature the record carries (nil: none). The bytes are the
// context string "ftcomm-quorum-v1\n" followed by the record's JSON object
// without its "signature" member, members sorted by name, values as
// written: fields a newer coordinator adds are covered too, and an older
// member still verifies them.
func CanonicalQuorum(raw []byte) (msg []byte, sig *QuorumSignature, err error) {
	return canonicalRecord(quorumSigContext, raw)
}

// canonicalRecord is CanonicalQuorum for a record signed under context.
func canonicalRecord(context string, raw []byte) (msg []byte, sig *QuorumSignature, err error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		return nil, nil, fmt.Errorf("membership: quorum record: %w", err)
	}
	if s, ok := fields["signature"]; ok {
		delete(fields, "signature")
		if !bytes.Equal(bytes.TrimSpace(s), []byte("null")) {
			sig = new(QuorumSignature)
			if err := json.Unmarshal(s, sig); err != nil {
				return nil, nil, fmt.Errorf("%w: unreadable signature: %v", ErrForgedQuorum, err)
			}
		}
	}
	body, err := json.Marshal(fields) // members sorted by name
	if err != nil {
		return nil, nil, err
	}
	return append([]byte(context), body...), sig, nil
}
