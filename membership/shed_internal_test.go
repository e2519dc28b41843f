package membership

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A join step that etcd refuses while it sheds load, or whose request was
// lost in transit, is made again; any other failure, and the end of ctx,
// end it.
func TestJoinRetry(t *testing.T) {
	m := newMember(&memberEnv{lg: zap.NewNop()})
	ctx := context.Background()
	tries := 0
	err := m.joinRetry(ctx, func() error {
		tries++
		if tries < 3 {
			return fmt.Errorf("membership: join j/a: %w", rpctypes.ErrTooManyRequests)
		}
		return nil
	})
	if err != nil || tries != 3 {
		t.Fatalf("after two refusals: %v after %d tries, want success at the third", err, tries)
	}
	other := errors.New("id taken")
	tries = 0
	if err := m.joinRetry(ctx, func() error { tries++; return other }); !errors.Is(err, other) || tries != 1 {
		t.Fatalf("another failure: %v after %d tries, want it at once", err, tries)
	}
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	err = m.joinRetry(cctx, func() error { return rpctypes.ErrNoLeader })
	if err == nil || cctx.Err() == nil {
		t.Fatalf("refused until ctx ended: %v (ctx %v)", err, cctx.Err())
	}
	if shed(rpctypes.ErrTimeout) {
		t.Error("a timed-out request may have been applied: not retried blindly")
	}
	tries = 0
	err = m.joinRetry(ctx, func() error {
		tries++
		if tries < 2 {
			return fmt.Errorf("membership: join j/a: %w", status.Error(codes.Unavailable, "keepalive ping failed to receive ACK within timeout"))
		}
		return nil
	})
	if err != nil || tries != 2 {
		t.Fatalf("after a request lost in transit: %v after %d tries, want success at the second", err, tries)
	}
	for _, err := range []error{status.Error(codes.DeadlineExceeded, "x"), context.Canceled, rpctypes.ErrLeaseNotFound} {
		if lost(err) {
			t.Errorf("%v is not a request lost in transit", err)
		}
	}
}
