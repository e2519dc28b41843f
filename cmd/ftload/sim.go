package main

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/stats"

	"github.com/ftcomm/ftcomm/membership"
)

// The simulated members a shard runs, and how it counts and waits on them.

// byteCounter counts the bytes the clients receive, watch streams apart.
type byteCounter struct{ watch, other atomic.Int64 }

type watchKey struct{}

func (b *byteCounter) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, watchKey{}, strings.HasSuffix(info.FullMethodName, "/Watch"))
}

func (b *byteCounter) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if in, ok := s.(*stats.InPayload); ok {
		if w, _ := ctx.Value(watchKey{}).(bool); w {
			b.watch.Add(int64(in.WireLength))
		} else {
			b.other.Add(int64(in.WireLength))
		}
	}
}

func (b *byteCounter) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (b *byteCounter) HandleConn(context.Context, stats.ConnStats)                       {}

// sim is one simulated member.
type sim struct {
	rank     int // in all jobs' members
	job, idx int
	m        *membership.Member
	seen     atomic.Int64 // unix nanos when it saw the awaited quorum
}

func acceptAll(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		c.Close()
	}
}

// waitAll waits until every member's quorum satisfies ok, noting when each
// saw it; it returns the latest Created of those quorums (when the
// coordinator decided it). It ends early, with why, when ctx ends or a
// member's membership does (the quorum will not hold it again: waiting on
// would only run into ctx's end).
func waitAll(ctx context.Context, sims []*sim, ok func(membership.Quorum, bool) bool) (time.Time, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var decided time.Time
	var pending atomic.Int64
	pending.Store(int64(len(sims)))
	for _, s := range sims {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				ch := s.m.Changed()
				if q, have := s.m.Quorum(); ok(q, have) {
					s.seen.Store(time.Now().UnixNano())
					mu.Lock()
					if q.Created.After(decided) {
						decided = q.Created
					}
					mu.Unlock()
					pending.Add(-1)
					return
				}
				select {
				case <-ch:
				case <-s.m.Done():
					cancel(fmt.Errorf("member %s ended while waited for: %w", s.m.ID(), s.m.Err()))
					return
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	wg.Wait()
	if pending.Load() > 0 {
		return time.Time{}, context.Cause(ctx)
	}
	return decided, nil
}

func latest(sims []*sim) time.Time {
	var t int64
	for _, s := range sims {
		t = max(t, s.seen.Load())
	}
	return time.Unix(0, t)
}
