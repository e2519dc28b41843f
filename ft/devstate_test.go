package ft

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// heldCopier's pinned buffers are freed only once release is closed, as a
// device backend's free waits for copies a cancelled ctx abandoned on the
// GPU.
type heldCopier struct {
	release chan struct{}
	freed   chan struct{}
}

func (c *heldCopier) PinnedHost(n int) ([]byte, func(), error) {
	return make([]byte, n), func() { <-c.release; c.freed <- struct{}{} }, nil
}
func (c *heldCopier) CopyToHost(context.Context, []byte, comm.Tensor, int) error   { return nil }
func (c *heldCopier) CopyFromHost(context.Context, comm.Tensor, int, []byte) error { return nil }

// Closing the staging pool (in Comm.Close) waits for the frees until its
// deadline and no longer: a copy that never ends on the GPU must not hang
// Close. What it could not free is freed once the copies end.
func TestStagingCloseIsBounded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, held := range []bool{false, true} {
		c := &heldCopier{release: make(chan struct{}), freed: make(chan struct{}, 2)}
		if !held {
			close(c.release)
		}
		p := newStagingPool(c, 64, 2)
		var puts []func()
		for range 2 {
			_, put, err := p.get(ctx, 64)
			if err != nil {
				t.Fatal(err)
			}
			puts = append(puts, put)
		}
		for _, put := range puts {
			put()
		}
		deadline := time.Now().Add(time.Minute) // returns as soon as the frees are done
		if held {
			deadline = time.Now() // already due: close must not wait for the held frees
		}
		err := p.close(deadline)
		if held != (err != nil) {
			t.Fatalf("held %v: close: %v", held, err)
		}
		if _, _, err := p.get(ctx, 64); !errors.Is(err, ErrClosed) {
			t.Fatalf("get after close: %v, want ErrClosed", err)
		}
		if err := p.close(time.Now()); err != nil {
			t.Fatalf("second close: %v", err)
		}
		if held {
			close(c.release)
		}
		for range 2 {
			select {
			case <-c.freed:
			case <-ctx.Done():
				t.Fatalf("held %v: a staging buffer was never freed", held)
			}
		}
	}
}
