package coordinator

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"fmt"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// QuorumSigner signs the quorums a coordinator publishes, so that members
// act only on quorums a coordinator holding the key wrote: a stranger who
// can write etcd (or a trainer's credentials, which cannot write quorum
// keys anyway) cannot make members obey a quorum. The signature covers
// the record's canonical bytes (membership.CanonicalQuorum). Safe for concurrent use.
type QuorumSigner struct {
	key ed25519.PrivateKey
	id  string
}

// NewQuorumSigner returns the signer of an ed25519 seed (32 bytes).
func NewQuorumSigner(seed []byte) (*QuorumSigner, error) {
	if len(seed) != ed25519.SeedSize {
		return nil, fmt.Errorf("%w: coordinator: quorum signing key has %d bytes, want %d", comm.ErrInvalidArgument, len(seed), ed25519.SeedSize)
	}
	key := ed25519.NewKeyFromSeed(seed)
	return &QuorumSigner{key: key, id: membership.NewQuorumKey(key.Public().(ed25519.PublicKey)).ID}, nil
}

// GenerateQuorumSigner returns a signer with a fresh random key.
func GenerateQuorumSigner() (*QuorumSigner, error) {
	seed := make([]byte, ed25519.SeedSize)
	if _, err := rand.Read(seed); err != nil {
		return nil, fmt.Errorf("coordinator: generate quorum signing key: %w", err)
	}
	return NewQuorumSigner(seed)
}

// KeyID names the signer's key.
func (s *QuorumSigner) KeyID() string { return s.id }

// PublicKey returns the key members verify with.
func (s *QuorumSigner) PublicKey() membership.QuorumKey {
	return membership.NewQuorumKey(s.key.Public().(ed25519.PublicKey))
}

// Verifier returns a verifier that trusts this signer's key.
func (s *QuorumSigner) Verifier() *membership.QuorumVerifier {
	return membership.NewQuorumVerifier(s.PublicKey())
}

// Marshal returns q's record, signed (any signature q carries is
// replaced).
func (s *QuorumSigner) Marshal(q membership.Quorum) ([]byte, error) {
	q.Signature = nil
	raw, err := json.Marshal(q)
	if err != nil {
		return nil, err
	}
	msg, _, err := membership.CanonicalQuorum(raw)
	if err != nil {
		return nil, err
	}
	q.Signature = &membership.QuorumSignature{KeyID: s.id, Ed25519: ed25519.Sign(s.key, msg)}
	return json.Marshal(q)
}

// Sign signs msg, a record's canonical bytes (membership.EncodeQuorumView
// asks for it).
func (s *QuorumSigner) Sign(msg []byte) *membership.QuorumSignature {
	return &membership.QuorumSignature{KeyID: s.id, Ed25519: ed25519.Sign(s.key, msg)}
}
