package coordinator

import (
	"context"
	"errors"
	"net"
	"syscall"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// verifyTimeout bounds the dials that confirm a reported death.
const verifyTimeout = 500 * time.Millisecond

// probeWait is how long a quorum waits for a probe's verdict: the dials'
// time and a little more.
const probeWait = verifyTimeout + 100*time.Millisecond

// probeDead dials addr until it refuses a connection (dead: no process
// listens there), for up to verifyTimeout. A process killed a moment ago
// may still accept: the kernel closes its listener only when the exit has
// torn down its memory, which takes a big process a few hundred
// milliseconds after its peers saw their connections to it end. A dial
// that times out or fails otherwise (unreachable) decides at once: not
// dead. err is the last dial's (nil: it connected).
func probeDead(ctx context.Context, addr string) (dead bool, err error) {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 50*time.Millisecond, 150*time.Millisecond, verifyTimeout
	deadline := time.Now().Add(verifyTimeout)
	_ = backoff.Retry(func() error {
		d := net.Dialer{Deadline: deadline}
		var c net.Conn
		c, err = d.DialContext(ctx, "tcp", addr)
		switch {
		case err == nil:
			c.Close()
			return errors.New("it accepted") // perhaps still exiting: again
		case errors.Is(err, syscall.ECONNRESET):
			return err // its listener closing under the dial: again
		case errors.Is(err, syscall.ECONNREFUSED):
			dead = true
			return nil
		}
		return backoff.Permanent(err)
	}, backoff.WithContext(b, ctx))
	return dead, err
}
