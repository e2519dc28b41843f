package membership

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.uber.org/zap"
)

// A join step that etcd refuses while it sheds load is made again; any
// other failure, and the end of ctx, end it.
func TestShedRetry(t *testing.T) {
	m := newMember(&memberEnv{lg: zap.NewNop()})
	ctx := context.Background()
	tries := 0
	err := m.shedRetry(ctx, func() error {
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
	if err := m.shedRetry(ctx, func() error { tries++; return other }); !errors.Is(err, other) || tries != 1 {
		t.Fatalf("another failure: %v after %d tries, want it at once", err, tries)
	}
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	err = m.shedRetry(cctx, func() error { return rpctypes.ErrNoLeader })
	if err == nil || cctx.Err() == nil {
		t.Fatalf("refused until ctx ended: %v (ctx %v)", err, cctx.Err())
	}
	if shed(rpctypes.ErrTimeout) {
		t.Error("a timed-out request may have been applied: not retried blindly")
	}
}
