package diloco_test

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	_ "github.com/ftcomm/ftcomm/backends/gloo"
	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/ft"
	"github.com/ftcomm/ftcomm/ft/diloco"
	"github.com/ftcomm/ftcomm/membership"
)

// A toy job over a real embedded etcd, a real coordinator and gloo on
// loopback: replica r's inner steps pull its parameters towards its own
// target (θ ← θ − η(θ − t_r)); the outer loop pulls the global parameters
// towards the targets' mean. Every replica that commits a step must hold
// the same global parameters and momentum.

type job struct {
	t      testing.TB
	etcd   *etcdhost.Embedded
	cfg    ft.Config
	dcfg   diloco.Config
	n      int // parameters
	mu     sync.Mutex
	hashes map[int64]uint64 // committed step → hash of global ‖ momentum
	errs   []error
}

func newJob(t testing.TB, dcfg diloco.Config) *job {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e, err := etcdhost.StartEmbedded(ctx, etcdhost.EmbeddedConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	cli, err := e.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	cc := coordinator.DefaultConfig()
	cc.Client, cc.Quorum.JoinTimeout, cc.SessionTTL = cli, 300*time.Millisecond, 2*time.Second
	cc.Logger = zaptest.NewLogger(t).Named("coordinator")
	coord, err := coordinator.New(cc)
	if err != nil {
		t.Fatal(err)
	}
	cctx, stop := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := coord.Run(cctx); err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("coordinator: %v", err)
		}
	}()
	t.Cleanup(func() { stop(); <-done; cli.Close() })
	mc := membership.DefaultMemberConfig()
	mc.LeaseTTL = 2 * time.Second
	return &job{t: t, etcd: e, dcfg: dcfg, n: 1000, hashes: map[int64]uint64{},
		cfg: ft.Config{Job: "toy", Coordinator: e.Endpoints(), Member: mc, Backend: "gloo", Secret: []byte("k"),
			MinReplicas: 2, Timeout: 10 * time.Second}}
}

func hashState(g, m []float32) uint64 {
	h := fnv.New64a()
	for _, s := range [][]float32{g, m} {
		for _, x := range s {
			u := math.Float32bits(x)
			h.Write([]byte{byte(u), byte(u >> 8), byte(u >> 16), byte(u >> 24)})
		}
	}
	return h.Sum64()
}

func (j *job) record(who string, step int64, h uint64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if prev, ok := j.hashes[step]; ok && prev != h {
		j.errs = append(j.errs, fmt.Errorf("%s committed step %d with state %x, another replica with %x", who, step, h, prev))
	}
	j.hashes[step] = h
}

type replica struct {
	id       string
	c        *ft.Comm
	d        *diloco.DiLoCo
	cancel   context.CancelFunc
	done     chan struct{}
	mu       sync.Mutex
	outcomes []diloco.Outcome
	err      error
	finished *ft.FinishedError // the run ended at another replica first
	progress chan struct{}
}

func (r *replica) history() []diloco.Outcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]diloco.Outcome(nil), r.outcomes...)
}

// start runs replica `group` (index k: its target) until it has committed
// `until` steps or is stopped.
func (j *job) start(group string, k int, until int64) *replica {
	cfg := j.cfg
	cfg.Group, cfg.Logger = group, zaptest.NewLogger(j.t).Named(group)
	c, err := ft.New(context.Background(), cfg)
	if err != nil {
		j.t.Fatal(err)
	}
	params := make([]float32, j.n) // the same initial values everywhere
	dcfg := j.dcfg
	dcfg.Logger = cfg.Logger
	d, err := diloco.New(c, params, dcfg)
	if err != nil {
		j.t.Fatal(err)
	}
	target := make([]float32, j.n)
	for i := range target {
		target[i] = float32(k+1) * float32(i%7-3) / 3
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &replica{id: group, c: c, d: d, cancel: cancel, done: make(chan struct{}), progress: make(chan struct{}, 1)}
	go func() {
		defer close(r.done)
		fail := func(err error) {
			r.mu.Lock()
			r.err = err
			r.mu.Unlock()
		}
		for c.CommittedStep() < until {
			out, err := d.Tick(ctx)
			if errors.As(err, &r.finished) {
				return // another replica ended the run
			}
			if err != nil {
				fail(err)
				return
			}
			if out.Synced {
				if out.Committed {
					j.record(group, out.Step, hashState(d.Global(), d.Momentum()))
				}
				r.mu.Lock()
				r.outcomes = append(r.outcomes, out)
				r.mu.Unlock()
				select {
				case r.progress <- struct{}{}:
				default:
				}
			}
			for i := range params {
				params[i] -= 0.1 * (params[i] - target[i])
			}
		}
		// The end of the run: a peer still in its last step ends it, one
		// behind is told (ft.ErrFinished) instead of waiting for us.
		if _, err := d.Flush(ctx); err != nil {
			fail(err)
		} else if err := c.Finish(ctx); err != nil {
			fail(err)
		}
	}()
	return r
}

// waitFor blocks until one of r's outcomes satisfies pred.
func (r *replica) waitFor(t *testing.T, what string, pred func(diloco.Outcome) bool) diloco.Outcome {
	t.Helper()
	deadline := time.After(60 * time.Second)
	seen := 0
	for {
		h := r.history()
		for _, o := range h[seen:] {
			if pred(o) {
				return o
			}
		}
		seen = len(h)
		select {
		case <-r.progress:
		case <-r.done:
			h := r.history()
			for _, o := range h[seen:] {
				if pred(o) {
					return o
				}
			}
			t.Fatalf("%s stopped before %s: %v", r.id, what, r.err)
		case <-deadline:
			t.Fatalf("%s: timed out waiting for %s", r.id, what)
		}
	}
}

func (r *replica) stop(t *testing.T) {
	r.cancel()
	<-r.done
	if err := r.c.Close(); err != nil {
		t.Errorf("close %s: %v", r.id, err)
	}
}

func (j *job) check() {
	j.mu.Lock()
	defer j.mu.Unlock()
	for _, err := range j.errs {
		j.t.Error(err)
	}
}

// Streaming DiLoCo on ft.Comm: three replicas converge on the mean of
// their targets, with identical global state at every committed step, for
// each way of sending outer gradients.
func TestStreamingOverFT(t *testing.T) {
	for _, q := range []diloco.Quantization{diloco.Float32, diloco.Int4} {
		t.Run(q.String(), func(t *testing.T) {
			cfg := diloco.DefaultStreamingConfig()
			cfg.InnerSteps, cfg.Fragments, cfg.Overlap, cfg.Alpha, cfg.Quantization = 8, 2, 1, 0.5, q
			cfg.OuterLR, cfg.OuterMomentum = 0.7, 0.5
			j := newJob(t, cfg)
			const until = 60
			rs := []*replica{j.start("a", 0, until), j.start("b", 1, until), j.start("c", 2, until)}
			// A replica that stops stepping (its loop is done) holds no
			// one up: every replica ends, at the last step or told that
			// the run finished there.
			for _, r := range rs {
				<-r.done
				if r.err != nil {
					t.Fatalf("%s: %v", r.id, r.err)
				}
				if f := r.finished; f != nil && f.Final < until {
					t.Errorf("%s: the run finished at step %d, before %d", r.id, f.Final, until)
				}
			}
			j.check()
			// The targets' mean is 2·(i%7−3)/3.
			g := rs[0].d.Global()
			var worst float64
			for i, x := range g {
				worst = max(worst, math.Abs(float64(x)-2*float64(i%7-3)/3))
			}
			if worst > 0.05 {
				t.Errorf("global parameters are %v from the targets' mean after %d steps", worst, until)
			}
			for _, r := range rs {
				if s := r.d.Stats(); s.Committed == 0 || s.PeakPayload == 0 {
					t.Errorf("%s: %+v", r.id, s)
				}
				r.c.Close()
			}
		})
	}
}

// A replica is killed in the middle of training (its loop stops mid-sync,
// its comm goes away); the survivors' sync fails, is discarded, and they go
// on with two. Started again, it heals to the committed global parameters
// and momentum (the same hash as its peers at that step) and rejoins.
func TestKilledReplicaHealsAndRejoins(t *testing.T) {
	cfg := diloco.DefaultStreamingConfig()
	cfg.InnerSteps, cfg.Fragments, cfg.Overlap, cfg.Alpha = 8, 4, 1, 0.5
	cfg.Quantization = diloco.Int8
	j := newJob(t, cfg)
	const forever = math.MaxInt64
	a, b, c := j.start("a", 0, forever), j.start("b", 1, forever), j.start("c", 2, forever)
	a.waitFor(t, "a sync with three", func(o diloco.Outcome) bool { return o.Committed && o.Participants == 3 && o.Step > 5 })
	c.stop(t) // mid-training: its exchange in flight is cut off
	after := a.waitFor(t, "a sync with two", func(o diloco.Outcome) bool { return o.Committed && o.Participants == 2 })
	b.waitFor(t, "b past the kill", func(o diloco.Outcome) bool { return o.Committed && o.Step >= after.Step+3 })
	c2 := j.start("c", 2, forever)
	first := c2.waitFor(t, "the restarted replica's first sync", func(o diloco.Outcome) bool { return o.Committed })
	if !first.Healed || first.Participants != 3 || first.Step <= after.Step {
		t.Fatalf("the restarted replica did not heal and rejoin: %+v", first)
	}
	c2.waitFor(t, "more syncs of the restarted replica", func(o diloco.Outcome) bool { return o.Committed && o.Step >= first.Step+4 })
	for _, r := range []*replica{a, b, c2} {
		r.stop(t)
	}
	j.check() // c2's commits carried the same state hashes as a's and b's
	if s := c2.d.Stats(); s.Heals != 1 {
		t.Errorf("restarted replica: %+v", s)
	}
}
