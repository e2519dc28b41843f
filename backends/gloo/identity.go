package gloo

import (
	"encoding/binary"

	"github.com/ftcomm/ftcomm/internal/silence"
)

// identity says which kernel and which process one end of a connection is
// (silence.Identity), and what it can do. Both ends send theirs in the
// handshake (covered by its MACs). It lets a rank ask its own kernel about
// a silent peer on the same host (is that process stopped, gone, or merely
// not scheduled? liveness.go), and decide whether a link can use shared
// memory. A zero identity (not Linux, no /proc) turns both off. The
// network namespace is not sent: gloo's peers are judged on pid space
// alone, as before it was told.
type identity struct {
	silence.Identity
	flags uint32 // capability bits (idFlag…)
}

const identityLen = 16 + 8 + 8 + 4 + 4

// Capability bits of identity.flags.
const (
	idFlagShm = 1 << iota // this end sets up shared memory with peers on its host
)

func (id *identity) encode(b []byte) {
	_ = b[identityLen-1]
	copy(b, id.Boot[:])
	binary.LittleEndian.PutUint64(b[16:], id.PidNS)
	binary.LittleEndian.PutUint64(b[24:], id.Start)
	binary.LittleEndian.PutUint32(b[32:], uint32(id.Pid))
	binary.LittleEndian.PutUint32(b[36:], id.flags)
}

func decodeIdentity(b []byte) identity {
	var id identity
	copy(id.Boot[:], b[:16])
	id.PidNS = binary.LittleEndian.Uint64(b[16:])
	id.Start = binary.LittleEndian.Uint64(b[24:])
	id.Pid = int32(binary.LittleEndian.Uint32(b[32:]))
	id.flags = binary.LittleEndian.Uint32(b[36:])
	return id
}

// localIdentity is this process's identity as gloo sends it (no network
// namespace), without capabilities.
func localIdentity() identity {
	id := silence.Self()
	id.NetNS = 0
	return identity{Identity: id}
}
