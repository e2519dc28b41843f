package coordinator

import (
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// Secrets are the keys coordinators hold and trainers must not: the
// quorum-signing key and the gossip key (trainers get the gossip key and
// the public half of the signing key in their membership.Credentials).
// Coordinators that share a job root must share these; `ftcoord serve`
// keeps them in <data-dir>/coordinator-secrets.json (0600).
type Secrets struct {
	Version int `json:"version"`
	// QuorumSigningKey is an ed25519 seed (32 bytes).
	QuorumSigningKey []byte `json:"quorumSigningKey"`
	// GossipKey encrypts gossip (memberlist's SecretKey, 32 bytes).
	GossipKey []byte `json:"gossipKey"`
}

// LoadOrCreateSecrets reads the secrets at path, or creates them with
// fresh random keys if the file does not exist (created reports which).
// Two processes creating at once end up with the same keys: the file is
// created exclusively.
func LoadOrCreateSecrets(path string) (s *Secrets, created bool, err error) {
	s = &Secrets{Version: membership.CredentialsVersion, QuorumSigningKey: make([]byte, 32), GossipKey: make([]byte, 32)}
	if _, err := rand.Read(s.QuorumSigningKey); err != nil {
		return nil, false, err
	}
	if _, err := rand.Read(s.GossipKey); err != nil {
		return nil, false, err
	}
	b, _ := json.MarshalIndent(s, "", "  ")
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	switch {
	case err == nil:
		_, err = f.Write(append(b, '\n'))
		if e := f.Close(); err == nil {
			err = e
		}
		if err != nil {
			os.Remove(path)
			return nil, false, fmt.Errorf("coordinator: write coordinator secrets %s: %w", path, err)
		}
		return s, true, nil
	case !errors.Is(err, os.ErrExist):
		return nil, false, fmt.Errorf("coordinator: coordinator secrets: %w", err)
	}
	b, err = os.ReadFile(path)
	if err != nil {
		return nil, false, fmt.Errorf("coordinator: coordinator secrets: %w", err)
	}
	s = new(Secrets)
	if err := json.Unmarshal(b, s); err != nil {
		return nil, false, fmt.Errorf("%w: coordinator: coordinator secrets %s: %v", comm.ErrInvalidArgument, path, err)
	}
	if len(s.QuorumSigningKey) != 32 || len(s.GossipKey) != 32 {
		return nil, false, fmt.Errorf("%w: coordinator: coordinator secrets %s: want 32-byte quorumSigningKey and gossipKey", comm.ErrInvalidArgument, path)
	}
	return s, false, nil
}

// Signer returns the quorum signer of the secrets.
func (s *Secrets) Signer() (*QuorumSigner, error) {
	return NewQuorumSigner(s.QuorumSigningKey)
}
