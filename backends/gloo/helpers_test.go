package gloo

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/memstore"
)

// job is n ranks of one comm, as goroutines over loopback TCP.
type job struct {
	t      testing.TB
	store  *memstore.Store
	cfg    *Config
	opts   comm.Options
	comms  []*comm.Comm
	closed bool
}

func testConfig() *Config {
	c := DefaultConfig()
	c.PeerTimeout = 3 * time.Second // -race on 2 cores: leave room; tests of the detector set their own
	return c
}

func testOptions(store comm.Store, cfg *Config, log *zap.Logger) comm.Options {
	return comm.Options{Name: "t", JobID: "job1", Secret: []byte("s3cret"), Store: store, Prefix: "jobs/job1/comm",
		Timeout: 60 * time.Second, BackendConfig: cfg, Logger: log}
}

// newJob forms a comm of n ranks. mut may change the config.
func newJob(t testing.TB, n int, mut func(*Config)) *job {
	t.Helper()
	cfg := testConfig()
	if mut != nil {
		mut(cfg)
	}
	return newJobPerRank(t, n, func(int) *Config { return cfg })
}

// newJobPerRank forms a comm of n ranks where rank r uses cfgOf(r); j.cfg
// and j.opts are rank 0's.
func newJobPerRank(t testing.TB, n int, cfgOf func(r int) *Config) *job {
	t.Helper()
	return newJobWith(t, n, func(r int, o *comm.Options) { o.BackendConfig = cfgOf(r) })
}

// newJobWith forms a comm of n ranks where rank r's options are the test
// options changed by optsOf(r, &o); j.cfg and j.opts are rank 0's.
func newJobWith(t testing.TB, n int, optsOf func(r int, o *comm.Options)) *job {
	t.Helper()
	var log *zap.Logger
	if tt, ok := t.(*testing.T); ok && testing.Verbose() {
		log = zaptest.NewLogger(tt, zaptest.Level(zap.WarnLevel))
	}
	j := &job{t: t, store: memstore.New()}
	opts := make([]comm.Options, n)
	for r := range n {
		opts[r] = testOptions(j.store, testConfig(), log)
		optsOf(r, &opts[r])
		opts[r].Rank, opts[r].Size = r, n
	}
	j.opts, j.cfg = opts[0], opts[0].BackendConfig.(*Config)
	j.comms = make([]*comm.Comm, n)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			j.comms[r], errs[r] = comm.New(ctx, "gloo", opts[r])
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			j.close()
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	t.Cleanup(j.close)
	return j
}

func (j *job) close() {
	if j.closed {
		return
	}
	j.closed = true
	for _, c := range j.comms {
		if c != nil {
			c.Close()
		}
	}
	j.store.Close()
}

// run calls f on every rank concurrently and returns the errors by rank.
func (j *job) run(f func(r int, c *comm.Comm) error) []error {
	errs := make([]error, len(j.comms))
	var wg sync.WaitGroup
	for r, c := range j.comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if p := recover(); p != nil {
					errs[r] = fmt.Errorf("panic: %v", p)
				}
			}()
			errs[r] = f(r, c)
		}()
	}
	wg.Wait()
	return errs
}

// mustRun is run that fails the test on any error.
func (j *job) mustRun(f func(r int, c *comm.Comm) error) {
	j.t.Helper()
	for r, err := range j.run(f) {
		if err != nil {
			j.t.Fatalf("rank %d: %v", r, err)
		}
	}
}
