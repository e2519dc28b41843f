package ft

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/membership"
)

// A report that etcd did not take (no answer in time, as while the
// coordinator's etcd is down) is made again until it is taken, and the
// reports queued after it follow, in order; one refused for another
// reason (the registration it was made under ended) is not made again.
func TestReporterTriesAgainUntilTaken(t *testing.T) {
	r := newReporter(zaptest.NewLogger(t), time.Second)
	defer r.stop()
	var mu sync.Mutex
	var made []string
	tries := 0
	r.add("reporting failed peers", func(ctx context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		if tries++; tries < 3 {
			return fmt.Errorf("membership: revoke epoch 1: %w", context.DeadlineExceeded)
		}
		made = append(made, "revoke")
		return nil
	})
	r.add("reporting the failed epoch", func(ctx context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		made = append(made, "evicted")
		return fmt.Errorf("membership: %w", membership.ErrEvicted)
	})
	done := make(chan struct{})
	r.add("reporting the formed epoch", func(ctx context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		made = append(made, "formed")
		close(done)
		return nil
	})
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the reports after one not taken were never made")
	}
	mu.Lock()
	defer mu.Unlock()
	if want := []string{"revoke", "evicted", "formed"}; !slices.Equal(made, want) || tries != 3 {
		t.Fatalf("made %v in %d tries of the first, want %v in 3", made, tries, want)
	}
}
