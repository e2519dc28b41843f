package gloo

import (
	"bytes"
	"errors"
	"net"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
)

func seedFrames() [][]byte {
	d := desc{op: comm.OpAllReduce, dtype: comm.Float32, redop: comm.Sum, algo: AlgorithmRing, root: -1, count: 16}
	var nt [64]byte
	n := (&notice{kind: noticeRevoke, origin: 1, subject: -1, cause: "quorum"}).encode(nt[:])
	rn := resyncNote{from: 2, excluded: []int{2, 5}}
	rs := make([]byte, resyncLen(&rn))
	encodeResync(rs, &resyncInfo{epoch: 3, size: 2, rank: 1, members: 9}, &rn)
	return [][]byte{
		frameBytes(header{typ: frameHeartbeat}, nil, trailerOK),
		frameBytes(header{typ: frameOp, d: d, seq: 1, tag: 0}, make([]byte, 64), trailerOK),
		frameBytes(header{typ: frameOp, d: d, seq: 1, tag: 1}, make([]byte, 32), trailerAbandon),
		frameBytes(header{typ: frameOp, d: desc{op: comm.OpSend, dtype: comm.Int8, root: -1, count: 3}}, []byte{1, 2, 3}, trailerOK),
		frameBytes(header{typ: frameNotice, seq: 0}, nt[:n], trailerOK),
		frameBytes(header{typ: frameResync, seq: 3}, rs[:], trailerOK),
		frameBytes(header{typ: frameBye}, nil, trailerOK),
		frameBytes(header{typ: frameRefused, d: desc{op: comm.OpAllReduce, root: 1}, tag: refusedColl, seq: 1}, []byte("root 9 outside [0, 2)"), trailerOK),
		frameBytes(header{typ: frameRefused, d: desc{op: comm.OpSend, root: 1}, tag: refusedRecv, seq: 0}, []byte("no tensor"), trailerOK),
		frameBytes(header{typ: frameRefused, d: desc{op: comm.OpSend, root: 1}, tag: refusedStray, seq: 0}, nil, trailerOK),
	}
}

// FuzzDecodeHeader: any 40 bytes decode to an error or to a header that
// encodes back to the same bytes; never a panic.
func FuzzDecodeHeader(f *testing.F) {
	for _, s := range seedFrames() {
		f.Add(s[:headerSize])
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHeader(b)
		if err != nil {
			if !errors.Is(err, errMalformed) {
				t.Fatalf("error %v does not wrap errMalformed", err)
			}
			return
		}
		var out [headerSize]byte
		h.encode(out[:])
		if !bytes.Equal(out[:], b[:headerSize]) {
			t.Fatalf("round trip: %x -> %+v -> %x", b[:headerSize], h, out)
		}
	})
}

// FuzzReadHello: the listener's parser of the first handshake message
// reads a bounded amount and never panics; what it accepts round-trips.
func FuzzReadHello(f *testing.F) {
	h := goodHello()
	h.version = protocolVersion
	f.Add(h.encode())
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	f.Add([]byte(handshakeMagic + "\x01\x00\xff\xff"))
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		h, raw, _, err := readHello(r)
		if err != nil {
			return
		}
		if !bytes.Equal(h.encode(), raw) || !bytes.Equal(raw, b[:len(raw)]) {
			t.Fatalf("round trip mismatch")
		}
	})
}

// fuzzDesc is the collective whose receives fuzzLink posts.
var fuzzDesc = desc{op: comm.OpAllReduce, dtype: comm.Float32, redop: comm.Sum, algo: AlgorithmRing, root: -1, count: 16}

// fuzzLink starts rank 0 of a 2-rank backend whose link to rank 1 reads
// conn (and seg, for shared memory), with two receives of collective #1
// posted: step 0 copying 64 bytes, step 1 reducing 32.
func fuzzLink(conn net.Conn, seg *shmSeg) (*Backend, *link) {
	nd := &node{cfg: *DefaultConfig(), log: zap.NewNop()}
	b := newBackend(nd, nil, "fuzz", 0, 0, 2)
	l := newLink(conn, b, 1, identity{}, seg)
	b.setLinks([]*link{nil, l})
	b.start()
	b.collSeq = 1
	b.curColl.Store(1)
	l.plan(1, 2)
	l.post(entry{seq: 1, tag: 0, d: fuzzDesc, mode: modeCopy, dst: make([]byte, 64)})
	l.post(entry{seq: 1, tag: 1, d: fuzzDesc, mode: modeReduce, dst: make([]byte, 32)})
	return b, l
}

// FuzzLinkReader feeds an arbitrary byte stream to a connection's reader
// with receives posted (one copying, one reducing): it must fail the link
// cleanly or deliver, never panic, and never write a posted buffer from a
// frame that does not match it.
func FuzzLinkReader(f *testing.F) {
	var all []byte
	for _, s := range seedFrames() {
		f.Add(s)
		all = append(all, s...)
	}
	f.Add(all)
	f.Fuzz(func(t *testing.T, stream []byte) {
		mine, theirs := net.Pipe()
		b, l := fuzzLink(mine, nil)
		wrote := make(chan struct{})
		go func() {
			theirs.Write(stream) // net.Pipe: returns once the reader has taken every byte
			theirs.Close()
			close(wrote)
		}()
		select {
		case <-l.readerDone:
		case <-wrote:
			// The reader may be holding a frame for a receive nobody will
			// post; give it a moment to finish what it has, then end it.
			select {
			case <-l.readerDone:
			case <-time.After(5 * time.Millisecond):
				l.fail(errLocal)
				<-l.readerDone
			}
		case <-time.After(10 * time.Second):
			t.Fatal("reader stuck")
		}
		<-wrote
		b.Close()
		mine.Close()
	})
}
