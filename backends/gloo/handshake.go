package gloo

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// Handshake (dialer = client, the higher rank; listener = server):
//
//	C→S hello:     "FTGLOOHS" version:u16 jobLen:u16 job prefixLen:u16 prefix
//	               epoch:u64 from:i32 to:i32 size:i32 clientNonce[32] clientIdentity[40]
//	S→C challenge: status:u8=0 serverNonce[32] serverIdentity[40]
//	               HMAC(secret, "gloo-server"‖hello‖serverNonce‖serverIdentity)
//	   or refusal: status:u8=code reasonLen:u16 reason
//	C→S proof:     HMAC(secret, "gloo-client"‖hello‖serverNonce‖serverIdentity)
//	S→C verdict:   status:u8=0, or a refusal as above
//
// Both sides prove knowledge of the job secret over nonces chosen by the
// other, so a recorded handshake cannot be replayed. The server checks the
// job, the comm (prefix, epoch) and the ranks before it issues a challenge,
// and refuses anything unexpected without disturbing the comm. The
// identities (see identity) tell each end which kernel, pid namespace and
// process the other is; the MACs cover them.
const (
	handshakeMagic   = "FTGLOOHS"
	protocolVersion  = 4 // 4: frameRefused
	nonceLen         = 32
	macLen           = sha256.Size
	maxJobLen        = 256
	maxPrefixLen     = 1024
	maxReasonLen     = 512
	serverLabel      = "gloo-server"
	clientLabel      = "gloo-client"
	helloFixedPrefix = 8 + 2 + 2 // magic, version, jobLen
	helloFixedTail   = 8 + 4 + 4 + 4 + nonceLen + identityLen
)

type refusal uint8

const (
	refuseVersion   refusal = 1 // unknown protocol version or magic
	refuseJob       refusal = 2 // another job
	refuseEpoch     refusal = 3 // no comm with this prefix and epoch awaits this rank here (stale or future)
	refuseRank      refusal = 4 // rank out of range, or already connected
	refuseAuth      refusal = 5 // wrong secret
	refuseBusy      refusal = 6 // too many handshakes in progress, or the rank's old connection still in use
	refuseMalformed refusal = 7 // could not parse the hello
)

func (r refusal) String() string {
	switch r {
	case refuseVersion:
		return "protocol version"
	case refuseJob:
		return "wrong job"
	case refuseEpoch:
		return "no such comm or epoch"
	case refuseRank:
		return "bad rank"
	case refuseAuth:
		return "authentication failed"
	case refuseBusy:
		return "busy"
	case refuseMalformed:
		return "malformed hello"
	}
	return fmt.Sprintf("refusal(%d)", uint8(r))
}

// errRefused is returned by the dialer when the server refused it.
type errRefused struct {
	code   refusal
	reason string
}

func (e *errRefused) Error() string {
	return fmt.Sprintf("gloo: handshake refused (%s): %s", e.code, e.reason)
}

// retryable reports whether a later attempt may succeed (the peer has not
// reached the epoch yet, or was busy: with other handshakes, or with the
// connection of the comm before, which the dialer has dropped and it has
// yet to see closed).
func (e *errRefused) retryable() bool { return e.code == refuseEpoch || e.code == refuseBusy }

// hello is the dialer's first message.
type hello struct {
	version uint16
	job     string
	prefix  string
	epoch   uint64
	from    int32
	to      int32
	size    int32
	nonce   [nonceLen]byte
	id      identity // the dialer's
}

func (h *hello) encode() []byte {
	b := make([]byte, 0, helloFixedPrefix+len(h.job)+2+len(h.prefix)+helloFixedTail)
	b = append(b, handshakeMagic...)
	b = binary.LittleEndian.AppendUint16(b, h.version)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(h.job)))
	b = append(b, h.job...)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(h.prefix)))
	b = append(b, h.prefix...)
	b = binary.LittleEndian.AppendUint64(b, h.epoch)
	b = binary.LittleEndian.AppendUint32(b, uint32(h.from))
	b = binary.LittleEndian.AppendUint32(b, uint32(h.to))
	b = binary.LittleEndian.AppendUint32(b, uint32(h.size))
	b = append(b, h.nonce[:]...)
	var id [identityLen]byte
	h.id.encode(id[:])
	return append(b, id[:]...)
}

// readHello reads and parses a hello from r, returning the raw bytes too
// (they are MACed). It never reads more than the hello's bounded size.
func readHello(r io.Reader) (hello, []byte, refusal, error) {
	var h hello
	fixed := make([]byte, helloFixedPrefix)
	if _, err := io.ReadFull(r, fixed); err != nil {
		return h, nil, refuseMalformed, fmt.Errorf("gloo: read hello: %w", err)
	}
	if string(fixed[:8]) != handshakeMagic {
		return h, nil, refuseVersion, fmt.Errorf("gloo: hello: bad magic %q", fixed[:8])
	}
	h.version = binary.LittleEndian.Uint16(fixed[8:])
	if h.version != protocolVersion {
		return h, nil, refuseVersion, fmt.Errorf("gloo: hello: protocol version %d, want %d", h.version, protocolVersion)
	}
	jl := int(binary.LittleEndian.Uint16(fixed[10:]))
	if jl > maxJobLen {
		return h, nil, refuseMalformed, fmt.Errorf("gloo: hello: job id of %d bytes", jl)
	}
	rest := make([]byte, jl+2)
	if _, err := io.ReadFull(r, rest); err != nil {
		return h, nil, refuseMalformed, fmt.Errorf("gloo: read hello: %w", err)
	}
	h.job = string(rest[:jl])
	pl := int(binary.LittleEndian.Uint16(rest[jl:]))
	if pl > maxPrefixLen {
		return h, nil, refuseMalformed, fmt.Errorf("gloo: hello: prefix of %d bytes", pl)
	}
	tail := make([]byte, pl+helloFixedTail)
	if _, err := io.ReadFull(r, tail); err != nil {
		return h, nil, refuseMalformed, fmt.Errorf("gloo: read hello: %w", err)
	}
	h.prefix = string(tail[:pl])
	t := tail[pl:]
	h.epoch = binary.LittleEndian.Uint64(t)
	h.from = int32(binary.LittleEndian.Uint32(t[8:]))
	h.to = int32(binary.LittleEndian.Uint32(t[12:]))
	h.size = int32(binary.LittleEndian.Uint32(t[16:]))
	copy(h.nonce[:], t[20:])
	h.id = decodeIdentity(t[20+nonceLen:])
	raw := make([]byte, 0, len(fixed)+len(rest)+len(tail))
	raw = append(append(append(raw, fixed...), rest...), tail...)
	return h, raw, 0, nil
}

func handshakeMAC(secret []byte, label string, helloRaw, serverNonce, serverID []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(label))
	m.Write(helloRaw)
	m.Write(serverNonce)
	m.Write(serverID)
	return m.Sum(nil)
}

func writeRefusal(w io.Writer, code refusal, reason string) {
	if len(reason) > maxReasonLen {
		reason = reason[:maxReasonLen]
	}
	b := make([]byte, 0, 3+len(reason))
	b = append(b, byte(code))
	b = binary.LittleEndian.AppendUint16(b, uint16(len(reason)))
	b = append(b, reason...)
	_, _ = w.Write(b)
}

// readStatus reads a status byte and, when it is a refusal, its reason.
func readStatus(r io.Reader) error {
	var st [1]byte
	if _, err := io.ReadFull(r, st[:]); err != nil {
		return fmt.Errorf("gloo: handshake: %w", err)
	}
	if st[0] == 0 {
		return nil
	}
	var l [2]byte
	if _, err := io.ReadFull(r, l[:]); err != nil {
		return &errRefused{code: refusal(st[0]), reason: "(no reason)"}
	}
	n := int(binary.LittleEndian.Uint16(l[:]))
	if n > maxReasonLen {
		n = maxReasonLen
	}
	reason := make([]byte, n)
	if _, err := io.ReadFull(r, reason); err != nil {
		return &errRefused{code: refusal(st[0]), reason: "(truncated)"}
	}
	return &errRefused{code: refusal(st[0]), reason: string(reason)}
}

// clientHandshake runs the dialer's side on conn within timeout and
// returns the listener's identity.
func clientHandshake(conn net.Conn, secret []byte, h hello, timeout time.Duration) (identity, error) {
	if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
		return identity{}, err
	}
	defer conn.SetDeadline(time.Time{})
	if _, err := rand.Read(h.nonce[:]); err != nil {
		return identity{}, fmt.Errorf("gloo: handshake nonce: %w", err)
	}
	h.version = protocolVersion
	raw := h.encode()
	if _, err := conn.Write(raw); err != nil {
		return identity{}, fmt.Errorf("gloo: handshake: send hello: %w", err)
	}
	if err := readStatus(conn); err != nil {
		return identity{}, err
	}
	var ch [nonceLen + identityLen + macLen]byte
	if _, err := io.ReadFull(conn, ch[:]); err != nil {
		return identity{}, fmt.Errorf("gloo: handshake: read challenge: %w", err)
	}
	serverNonce, serverID := ch[:nonceLen], ch[nonceLen:nonceLen+identityLen]
	if !hmac.Equal(ch[nonceLen+identityLen:], handshakeMAC(secret, serverLabel, raw, serverNonce, serverID)) {
		return identity{}, &errRefused{code: refuseAuth, reason: "the listener does not know the job secret"}
	}
	if _, err := conn.Write(handshakeMAC(secret, clientLabel, raw, serverNonce, serverID)); err != nil {
		return identity{}, fmt.Errorf("gloo: handshake: send proof: %w", err)
	}
	if err := readStatus(conn); err != nil {
		return identity{}, err
	}
	return decodeIdentity(serverID), nil
}

// errHandshake wraps a server-side refusal for logging.
var errHandshake = errors.New("gloo: inbound handshake refused")

// serverChallenge issues the challenge for a parsed hello, with this end's
// identity, and verifies the proof. The caller has already checked the
// hello against its registrations.
func serverChallenge(conn net.Conn, secret []byte, raw []byte, self identity) error {
	var msg [1 + nonceLen + identityLen + macLen]byte
	serverNonce := msg[1 : 1+nonceLen]
	if _, err := rand.Read(serverNonce); err != nil {
		return err
	}
	serverID := msg[1+nonceLen : 1+nonceLen+identityLen]
	self.encode(serverID)
	copy(msg[1+nonceLen+identityLen:], handshakeMAC(secret, serverLabel, raw, serverNonce, serverID))
	if _, err := conn.Write(msg[:]); err != nil {
		return fmt.Errorf("gloo: handshake: send challenge: %w", err)
	}
	var proof [macLen]byte
	if _, err := io.ReadFull(conn, proof[:]); err != nil {
		return fmt.Errorf("gloo: handshake: read proof: %w", err)
	}
	if !hmac.Equal(proof[:], handshakeMAC(secret, clientLabel, raw, serverNonce, serverID)) {
		writeRefusal(conn, refuseAuth, "authentication failed")
		return fmt.Errorf("%w: %s: bad proof (wrong secret or replayed handshake)", errHandshake, refuseAuth)
	}
	return nil
}
