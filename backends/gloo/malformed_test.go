package gloo

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

func frameBytes(h header, payload []byte, trailer byte) []byte {
	if h.length == 0 {
		h.length = uint32(len(payload))
	}
	b := make([]byte, headerSize, headerSize+len(payload)+1)
	h.encode(b)
	return append(append(b, payload...), trailer)
}

// TestMalformedFrames: an authenticated peer (it knows the secret) sends
// garbage. The connection is dropped with an error naming that rank, the
// pending op fails, nothing panics.
func TestMalformedFrames(t *testing.T) {
	bad := func(mut func(b []byte)) []byte {
		b := frameBytes(header{typ: frameHeartbeat}, nil, trailerOK)
		mut(b)
		return b
	}
	cases := []struct {
		name      string
		bytes     []byte
		malformed bool
	}{
		{"zeros", make([]byte, 100), true},
		{"unknown type", bad(func(b []byte) { b[1] = 99 }), true},
		{"flags", bad(func(b []byte) { b[6] = 1 }), true},
		{"heartbeat with payload", bad(func(b []byte) { b[8] = 4 }), true},
		{"huge op frame", frameBytes(header{typ: frameOp, d: desc{op: comm.OpAllReduce, dtype: comm.Float32, root: -1}, length: 1 << 30}, nil, trailerOK)[:headerSize], true},
		{"op frame with no dtype", frameBytes(header{typ: frameOp, d: desc{op: comm.OpAllReduce, root: -1}}, make([]byte, 8), trailerOK), true},
		{"op frame for shrink", frameBytes(header{typ: frameOp, d: desc{op: comm.OpShrink, root: -1}}, nil, trailerOK), true},
		{"bad trailer", bad(func(b []byte) { b[headerSize] = 0x11 }), true},
		{"bad notice kind", frameBytes(header{typ: frameNotice, length: noticeFixed}, []byte{9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, trailerOK), true},
		{"short notice", frameBytes(header{typ: frameNotice, length: 3}, []byte{1, 2, 3}, trailerOK), true},
		{"truncated header", bad(func([]byte) {})[:20], false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			store := memstore.New()
			defer store.Close()
			addr, wait := formingRank(t, store, nil)
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := clientHandshake(c, []byte("s3cret"), goodHello(), 5*time.Second); err != nil {
				t.Fatal(err)
			}
			c0, err := wait()
			if err != nil {
				t.Fatal(err)
			}
			defer c0.Close()
			errc := make(chan error, 1)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				errc <- c0.AllReduce(ctx, comm.Float32s(make([]float32, 8)), comm.Sum)
			}()
			waitFor(t, "rank 0 in its op", func() bool { return inOp(c0) })
			c.Write(tc.bytes)
			if !tc.malformed {
				c.Close()
			}
			err = <-errc
			if !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != 1 || errors.Is(err, comm.ErrTimeout) {
				t.Fatalf("got %v, want ErrPeerFailed naming rank 1", err)
			}
			if tc.malformed && !strings.Contains(err.Error(), "malformed frame") {
				t.Errorf("error does not say the frame was malformed: %v", err)
			}
		})
	}
}
