package coordinator

import (
	"crypto/rand"
	"encoding/hex"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// A publication larger than etcd takes can never be written as it is:
// the leader says so at the error level, with its size and what would
// fix it, and counts it (ftcomm_coordinator_publish_too_large_total),
// instead of a warning per retry that reads like a passing fault. Here
// etcd takes 4 KiB, and the quorum is 200 participants with
// incompressible ids (the record and its history entry ~9 KB each).
func TestPublicationTooLargeIsLoud(t *testing.T) {
	cfg := etcdhost.DefaultEmbeddedConfig()
	cfg.UnsafeNoFsync, cfg.MaxRequestBytes = true, 4<<10
	e, err := etcdhost.StartEmbedded(testutil.Ctx(t, 30*time.Second), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	core, logs := observer.New(zapcore.InfoLevel)
	reg := prometheus.NewRegistry()
	c, err := New(Config{Client: newClient(t, e), Name: "c0", Logger: zap.New(core), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	q := membership.Quorum{Job: "big", Epoch: 1, Created: time.Now(), Reason: "initial quorum"}
	for i := 0; i < 200; i++ {
		b := make([]byte, 24)
		rand.Read(b)
		q.Participants = append(q.Participants, membership.Participant{ID: hex.EncodeToString(b), Addr: "10.0.0.1:1", Incarnation: int64(10 + i)})
	}
	count := func() float64 {
		var pb dto.Metric
		if err := c.metrics.tooLarge.WithLabelValues("big").Write(&pb); err != nil {
			t.Fatal(err)
		}
		return pb.GetCounter().GetValue()
	}
	l := newLeadership(c, nil, "no-leader-key", 0) // the fence holds: the key does not exist
	w, err := l.publish(testutil.Ctx(t, 30*time.Second), publish{job: "big", quorum: &q})
	if err != nil {
		t.Fatal(err)
	}
	if w.err == nil || !tooLarge(w.err) {
		t.Fatalf("written %+v: want a too-large error", w)
	}
	if n := count(); n != 1 {
		t.Errorf("ftcomm_coordinator_publish_too_large_total %v, want 1", n)
	}
	errs := logs.FilterLevelExact(zapcore.ErrorLevel).FilterMessageSnippet("larger than etcd takes").All()
	if len(errs) != 1 || errs[0].ContextMap()["participants"] != int64(200) || errs[0].ContextMap()["bytes"].(int64) < 4<<10 {
		t.Fatalf("error lines %+v", errs)
	}

	// A publication that fits is written, and counts nothing.
	q.Participants = q.Participants[:5]
	if w, err = l.publish(testutil.Ctx(t, 30*time.Second), publish{job: "big", quorum: &q}); err != nil || w.err != nil || !w.ok {
		t.Fatalf("a small publication: %+v, %v", w, err)
	}
	if n := count(); n != 1 {
		t.Errorf("after a small publication: %v, want 1", n)
	}
}
