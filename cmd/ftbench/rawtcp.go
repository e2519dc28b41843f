package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// rawRing is the raw TCP baseline: each rank holds a plain TCP connection
// to its right neighbour (rank+1) and one from its left (rank-1), and per
// iteration sends to the right while receiving from the left the bytes a
// ring allreduce moves per rank, 2(n-1)/n of the size, with no reduction
// and no framing. It uses only net.TCPConn (NODELAY, the sockets' buffers
// as configured), so its bandwidth is the transport's ceiling on this host.
//
// Iterations follow each other as a ring's steps do: the next starts when
// this rank has finished sending and receiving the previous one. At large
// sizes that is a stream; at small sizes its time is one exchange with the
// neighbours (a write, then a read woken by the network poller), about what
// a 2-rank allreduce needs at least; a ring of n ranks needs 2(n-1) such
// dependent hops.
//
// A rawRing is used by one goroutine; above syncWriteMax bytes, run starts
// one sender goroutine per iteration and waits for it before returning.
type rawRing struct {
	rank, n     int
	left, right *net.TCPConn
	timeout     time.Duration
	send, recv  []byte
	sendDone    chan error
}

const rawMagic = "FTRW"

// rawToken authenticates the baseline's connections with the job secret.
func rawToken(secret []byte) [16]byte {
	h := sha256.Sum256(append([]byte("ftbench raw ring\x00"), secret...))
	var t [16]byte
	copy(t[:], h[:16])
	return t
}

// newRawRing connects the ring: listen on loopback, publish the address in
// store under raw/<rank>, dial the right neighbour, accept the left one.
// Connections that do not present the job's token and the expected rank
// are closed and ignored.
func newRawRing(ctx context.Context, store comm.Store, rank, n int, secret []byte, sockBuf int64, timeout time.Duration) (_ *rawRing, err error) {
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, fmt.Errorf("ftbench: raw baseline: listen: %w", err)
	}
	defer ln.Close()
	if err := store.Set(ctx, "raw/"+strconv.Itoa(rank), []byte(ln.Addr().String())); err != nil {
		return nil, fmt.Errorf("ftbench: raw baseline: publish address: %w", err)
	}
	r := &rawRing{rank: rank, n: n, timeout: timeout, sendDone: make(chan error, 1)}
	defer func() {
		if err != nil {
			r.Close()
		}
	}()
	token := rawToken(secret)
	leftRank := (rank + n - 1) % n
	rightRank := (rank + 1) % n

	accepted := make(chan error, 1)
	go func() { // exits when the left peer is accepted or ln is closed
		accepted <- r.acceptLeft(ctx, ln, leftRank, token)
	}()
	addr, err := store.Get(ctx, "raw/"+strconv.Itoa(rightRank))
	if err != nil {
		ln.Close()
		<-accepted
		return nil, fmt.Errorf("ftbench: raw baseline: address of rank %d: %w", rightRank, err)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", string(addr))
	if err != nil {
		ln.Close()
		<-accepted
		return nil, fmt.Errorf("ftbench: raw baseline: dial rank %d at %s: %w", rightRank, addr, err)
	}
	r.right = c.(*net.TCPConn)
	hello := make([]byte, 0, 24)
	hello = append(hello, rawMagic...)
	hello = binary.BigEndian.AppendUint32(hello, uint32(rank))
	hello = append(hello, token[:]...)
	r.right.SetWriteDeadline(time.Now().Add(timeout))
	if _, err := r.right.Write(hello); err != nil {
		ln.Close()
		<-accepted
		return nil, fmt.Errorf("ftbench: raw baseline: greet rank %d: %w", rightRank, err)
	}
	if err := <-accepted; err != nil {
		return nil, err
	}
	for _, c := range []*net.TCPConn{r.left, r.right} {
		c.SetNoDelay(true)
		if sockBuf > 0 {
			if err := c.SetReadBuffer(int(sockBuf)); err != nil {
				return nil, fmt.Errorf("ftbench: raw baseline: SO_RCVBUF %d: %w", sockBuf, err)
			}
			if err := c.SetWriteBuffer(int(sockBuf)); err != nil {
				return nil, fmt.Errorf("ftbench: raw baseline: SO_SNDBUF %d: %w", sockBuf, err)
			}
		}
	}
	return r, nil
}

func (r *rawRing) acceptLeft(ctx context.Context, ln *net.TCPListener, leftRank int, token [16]byte) error {
	deadline := time.Now().Add(r.timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	ln.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { ln.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	for {
		c, err := ln.AcceptTCP()
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("ftbench: raw baseline: accept rank %d: %w", leftRank, context.Cause(ctx))
			}
			return fmt.Errorf("ftbench: raw baseline: accept rank %d: %w", leftRank, err)
		}
		var hello [24]byte
		c.SetReadDeadline(deadline)
		_, err = io.ReadFull(c, hello[:])
		if err != nil || string(hello[:4]) != rawMagic || int(binary.BigEndian.Uint32(hello[4:8])) != leftRank ||
			!bytes.Equal(hello[8:], token[:]) {
			c.Close() // a stranger or a wrong rank: not our peer
			continue
		}
		c.SetReadDeadline(time.Time{})
		r.left = c
		return nil
	}
}

// perRankBytes is what one rank sends (and receives) in a ring allreduce of
// size bytes across n ranks: 2(n-1)/n of it, at least one byte.
func perRankBytes(size int64, n int) int64 {
	b := (size*2*int64(n-1) + int64(n)/2) / int64(n)
	return max(b, 1)
}

// grow makes the buffers hold at least nb bytes; the send buffer holds this
// rank's byte pattern, which the receiver checks.
func (r *rawRing) grow(nb int64) {
	if int64(len(r.send)) >= nb {
		return
	}
	r.send = make([]byte, nb)
	r.recv = make([]byte, nb)
	for i := range r.send {
		r.send[i] = byte(hashOf(r.rank, i))
	}
}

// run measures one size: warmup iterations, barrier, iters timed ones.
// It returns this rank's mean time per iteration and the number of bytes
// of the last iteration that differ from the left neighbour's pattern.
func (r *rawRing) run(ctx context.Context, size int64, warmup, iters int, barrier func(context.Context) error, alive func()) (usec float64, wrong int64, err error) {
	nb := perRankBytes(size, r.n)
	r.grow(nb)
	for range warmup {
		if err := r.iteration(ctx, nb); err != nil {
			return 0, 0, err
		}
		alive()
	}
	clear(r.recv[:nb])
	if err := barrier(ctx); err != nil {
		return 0, 0, fmt.Errorf("ftbench: raw baseline: barrier: %w", err)
	}
	t0 := time.Now()
	for range iters {
		if err := r.iteration(ctx, nb); err != nil {
			return 0, 0, err
		}
		alive()
	}
	usec = float64(time.Since(t0).Nanoseconds()) / 1e3 / float64(iters)
	left := (r.rank + r.n - 1) % r.n
	for i, b := range r.recv[:nb] {
		if b != byte(hashOf(left, i)) {
			wrong++
		}
	}
	return usec, wrong, nil
}

// syncWriteMax is the largest iteration written before reading, on one
// goroutine: it fits the sockets' initial buffers (net.ipv4.tcp_wmem and
// tcp_rmem defaults 16 KiB and 128 KiB), so the write never waits for the
// peer to read. Larger iterations send and receive concurrently.
const syncWriteMax = 16 << 10

// iteration sends nb bytes right while receiving nb bytes from the left.
func (r *rawRing) iteration(ctx context.Context, nb int64) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("ftbench: raw baseline: %w", context.Cause(ctx))
	}
	deadline := time.Now().Add(r.timeout)
	r.right.SetWriteDeadline(deadline)
	r.left.SetReadDeadline(deadline)
	if nb <= syncWriteMax {
		if _, err := r.right.Write(r.send[:nb]); err != nil {
			return fmt.Errorf("ftbench: raw baseline: send to rank %d: %w", (r.rank+1)%r.n, err)
		}
		if _, err := io.ReadFull(r.left, r.recv[:nb]); err != nil {
			return fmt.Errorf("ftbench: raw baseline: receive from rank %d: %w", (r.rank+r.n-1)%r.n, err)
		}
		return nil
	}
	go func() { // exits when the write completes or fails (deadline at the latest)
		_, err := r.right.Write(r.send[:nb])
		r.sendDone <- err
	}()
	_, rerr := io.ReadFull(r.left, r.recv[:nb])
	if rerr != nil {
		r.right.SetWriteDeadline(time.Unix(1, 0)) // unblock the sender now
	}
	werr := <-r.sendDone
	switch {
	case rerr != nil:
		return fmt.Errorf("ftbench: raw baseline: receive from rank %d: %w", (r.rank+r.n-1)%r.n, rerr)
	case werr != nil:
		return fmt.Errorf("ftbench: raw baseline: send to rank %d: %w", (r.rank+1)%r.n, werr)
	}
	return nil
}

// Close closes both connections. Safe to call twice.
func (r *rawRing) Close() error {
	var errs []error
	if r.left != nil {
		errs = append(errs, r.left.Close())
		r.left = nil
	}
	if r.right != nil {
		errs = append(errs, r.right.Close())
		r.right = nil
	}
	return ignoreClosed(errors.Join(errs...))
}

func ignoreClosed(err error) error {
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}
