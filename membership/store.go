package membership

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ftcomm/ftcomm/comm"
)

// store is a comm.Store kept in etcd under a key prefix (NewStore).
//
// Get waits on an etcd watch started just after the revision of its first
// read, so a value written between the read and the watch is never missed
// and nothing polls. Add is a compare-and-swap loop in a Txn, so concurrent
// adders never lose an update.
type store struct {
	cli    *clientv3.Client
	prefix string
}

var _ comm.Store = (*store)(nil)

// NewStore returns a comm.Store kept in etcd that keeps every key under
// prefix + "/" (prefix "" keeps keys as they are); Member.Store gives one
// per epoch of a job. It is safe for concurrent use and holds no
// goroutines between calls; the caller owns the client and closes it.
func NewStore(cli *clientv3.Client, prefix string) comm.Store {
	prefix = strings.TrimSuffix(prefix, "/")
	if prefix != "" {
		prefix += "/"
	}
	return &store{cli: cli, prefix: prefix}
}

func (s *store) wrap(op, key string, err error) error {
	if err == nil {
		return nil
	}
	if s.cli.Ctx().Err() != nil {
		return fmt.Errorf("membership: store %s %q: %w", op, key, comm.ErrClosed)
	}
	return fmt.Errorf("membership: store %s %q: %w", op, key, err)
}

// Set implements comm.Store.
func (s *store) Set(ctx context.Context, key string, value []byte) error {
	_, err := s.cli.Put(ctx, s.prefix+key, string(value))
	return s.wrap("set", key, err)
}

// Get implements comm.Store: it returns at once when key exists, else
// waits for its creation on a watch.
func (s *store) Get(ctx context.Context, key string) ([]byte, error) {
	full := s.prefix + key
	for {
		resp, err := s.cli.Get(ctx, full)
		if err != nil {
			return nil, s.wrap("get", key, ctxErr(ctx, err))
		}
		if len(resp.Kvs) > 0 {
			return resp.Kvs[0].Value, nil
		}
		v, found, err := s.waitPut(ctx, full, resp.Header.Revision+1)
		if err != nil {
			return nil, s.wrap("get", key, ctxErr(ctx, err))
		}
		if found {
			return v, nil
		}
		// The watch ended without news (compaction, lost leader, server
		// restart): read again and watch from the new revision.
	}
}

// waitPut watches key from rev and returns the first value put. found is
// false when the watch ended without one and the caller should re-read.
func (s *store) waitPut(ctx context.Context, key string, rev int64) (v []byte, found bool, err error) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	for wr := range s.cli.Watch(wctx, key, clientv3.WithRev(rev)) {
		if err := wr.Err(); err != nil {
			if errors.Is(err, rpctypes.ErrCompacted) || errors.Is(err, rpctypes.ErrNoLeader) {
				return nil, false, nil
			}
			return nil, false, err
		}
		for _, ev := range wr.Events {
			if ev.Type == mvccpb.PUT {
				return ev.Kv.Value, true, nil
			}
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, false, err
	}
	if err := s.cli.Ctx().Err(); err != nil {
		return nil, false, comm.ErrClosed
	}
	return nil, false, nil
}

// Add implements comm.Store with a compare-and-swap loop: read the value
// and its revision, write value+delta if the key has not changed since,
// else read again.
func (s *store) Add(ctx context.Context, key string, delta int64) (int64, error) {
	full := s.prefix + key
	for {
		resp, err := s.cli.Get(ctx, full)
		if err != nil {
			return 0, s.wrap("add", key, ctxErr(ctx, err))
		}
		var cur int64
		cmp := clientv3.Compare(clientv3.CreateRevision(full), "=", 0)
		if len(resp.Kvs) > 0 {
			kv := resp.Kvs[0]
			cur, err = strconv.ParseInt(string(kv.Value), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("%w: membership: store add to %q: value %.32q is not an integer", comm.ErrInvalidArgument, key, kv.Value)
			}
			cmp = clientv3.Compare(clientv3.ModRevision(full), "=", kv.ModRevision)
		}
		next := cur + delta
		tr, err := s.cli.Txn(ctx).If(cmp).Then(clientv3.OpPut(full, strconv.FormatInt(next, 10))).Commit()
		if err != nil {
			return 0, s.wrap("add", key, ctxErr(ctx, err))
		}
		if tr.Succeeded {
			return next, nil
		}
	}
}

// Delete implements comm.Store.
func (s *store) Delete(ctx context.Context, key string) error {
	_, err := s.cli.Delete(ctx, s.prefix+key)
	return s.wrap("delete", key, err)
}

// DeletePrefix implements comm.Store; DeletePrefix("") removes every key of
// this Store.
func (s *store) DeletePrefix(ctx context.Context, prefix string) error {
	full := s.prefix + prefix
	if full == "" {
		return fmt.Errorf("%w: membership: store delete of the whole keyspace refused", comm.ErrInvalidArgument)
	}
	_, err := s.cli.Delete(ctx, full, clientv3.WithPrefix())
	return s.wrap("delete prefix", prefix, err)
}

// ctxErr prefers the cause of ctx's end over the client's rendering of it
// (a gRPC status), so callers can errors.Is(err, context.DeadlineExceeded).
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return err
}

// shed says whether etcd refused a request without applying it because it
// is shedding load ("too many requests": its applied index is far behind
// its committed one) or has no leader: the same request may simply be
// made again, later.
func shed(err error) bool {
	return errors.Is(err, rpctypes.ErrTooManyRequests) || errors.Is(err, rpctypes.ErrNoLeader)
}

// lost says whether a request failed in transit: the client's connection
// to etcd broke before the answer came (gRPC Unavailable: a keepalive ping
// unanswered on a starved host, an endpoint restarting). etcd may or may
// not have applied it. A context's end is never lost (ctxErr).
func lost(err error) bool {
	return status.Code(err) == codes.Unavailable
}

// joinRetry runs f (one step of joining) until it succeeds, fails for
// another reason, or ctx ends, pausing between tries (50 ms doubling to
// 2 s, jittered) while etcd sheds load (at 100,000 ranks joining at once a
// 3-member etcd answered "too many requests" to some joins, which ended
// them: ftload on the device host, 2026-11-28) or a request was lost in
// transit (10,000 ranks registering on a loaded 2-core host saw a client's
// keepalive go unanswered, which failed every request in flight and ended
// the joins: docs/capacity.md). Each step is safe to make again whether or
// not etcd applied the lost try: a lease granted unanswered expires unused
// after its TTL; the run's and the group's records are read before any
// conditional write; a registration applied unanswered is found as this
// Join's own (liveness.register).
func (e *memberEnv) joinRetry(ctx context.Context, f func() error) error {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = 50*time.Millisecond, 2*time.Second, 0
	return backoff.RetryNotify(func() error {
		err := f()
		if err != nil && !shed(err) && !lost(err) {
			return backoff.Permanent(err)
		}
		return err
	}, backoff.WithContext(bo, ctx), func(err error, d time.Duration) {
		e.lg.Debug("etcd sheds load or a request was lost; joining again later", zap.Duration("in", d), zap.Error(err))
	})
}
