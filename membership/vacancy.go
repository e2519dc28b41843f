package membership

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
)

// WaitVacancy waits until a rank of a replica group leaves a place free:
// the registration of member "<group>.<rank>" (rank < size) of job, seen
// registered while it waited, is deleted — the member died (its group's
// leader or the coordinator removed it, or its lease expired) or left. It
// returns that rank. A rank absent when it starts is not a vacancy: at a
// job's launch it is a rank still starting. ft's slot spares wait here
// (ft.Config.GroupRank ft.AnyRank), then register in the free place;
// several spares may see the same vacancy, and the registration decides
// (ErrDuplicateMember for all but one).
//
// seen (of length size, or nil) carries what the caller saw registered
// from one call to the next: a spare that lost the race for one free
// place calls again with it and gets at once another place that was
// freed meanwhile (two ranks that died together), which it saw
// registered before.
func WaitVacancy(ctx context.Context, cli *clientv3.Client, root, job, group string, size int, seen []bool) (int, error) {
	if size < 1 || !ValidName(job) || !ValidName(group) || (seen != nil && len(seen) != size) {
		return -1, fmt.Errorf("%w: membership: wait for a vacancy in job %q group %q of size %d", comm.ErrInvalidArgument, job, group, size)
	}
	if seen == nil {
		seen = make([]bool, size)
	}
	prefix := etcdkeys.Layout{Root: root}.Members(job)
	rankOf := func(key []byte) (int, bool) {
		id, ok := strings.CutPrefix(string(key), prefix)
		if !ok {
			return 0, false
		}
		i := strings.LastIndexByte(id, '.') // "<group>.<rank>"; a group name may hold dots
		if !ok || i <= 0 || id[:i] != group {
			return 0, false
		}
		r := id[i+1:]
		n, err := strconv.Atoi(r)
		if err != nil || n < 0 || n >= size || strconv.Itoa(n) != r {
			return 0, false
		}
		return n, true
	}
	present := seen
	for {
		resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
		if err != nil {
			return -1, fmt.Errorf("membership: wait for a vacancy: %w", err)
		}
		now := make([]bool, size)
		for _, kv := range resp.Kvs {
			if r, ok := rankOf(kv.Key); ok {
				now[r] = true
			}
		}
		for r := range size {
			if present[r] && !now[r] {
				present[r] = false
				return r, nil // deleted while no watch was on
			}
		}
		copy(present, now)
		wctx, cancel := context.WithCancel(ctx)
		wch := cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
		for wr := range wch {
			if err := wr.Err(); err != nil {
				break // compacted or cancelled: read again
			}
			for _, ev := range wr.Events {
				r, ok := rankOf(ev.Kv.Key)
				if !ok {
					continue
				}
				if ev.Type == clientv3.EventTypePut {
					present[r] = true
				} else if present[r] {
					present[r] = false
					cancel()
					return r, nil
				}
			}
		}
		cancel()
		if err := ctx.Err(); err != nil {
			return -1, context.Cause(ctx)
		}
	}
}
