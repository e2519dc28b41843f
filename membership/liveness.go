package membership

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/membership/gossip"
)

// A member's liveness: its registration under a lease (its own, or its
// replica group's: grouplease.go), the watch of its own key, lease renewal,
// heartbeats and gossip. Whichever ends first ends the membership.

// liveness is the part of a member that registers it and keeps the
// registration alive: Join registers through it and starts its goroutines
// (renew, heartbeats and drainGossip while the member keeps its lease
// alive, watchSelf always); a group member that takes the lease over
// (groupFollower.takeOver) starts them there. It has no state of its own:
// it drives the record, the lease and, for the group's record, the links'
// address.
type liveness struct {
	*memberEnv
	end   *ending
	rec   *recordDraft
	lease *leaseBinding
	links *linkServer
}

// errRunMoved: the job's run changed while the member registered.
var errRunMoved = errors.New("membership: the job's run changed")

// errLeaseGone: the lease the member registered under no longer exists.
var errLeaseGone = errors.New("membership: the lease ended before the registration")

// register creates the member key if no other incarnation holds it and
// the job's run is the one the member entered (errRunMoved: it changed),
// and returns the registration's incarnation.
func (l *liveness) register(ctx context.Context) (int64, error) {
	for {
		val, lease := l.rec.encode()
		keepOut := l.keys.Evicted(l.cfg.Job, l.cfg.ID)
		runKey := l.keys.Run(l.cfg.Job)
		cmps := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(l.key), "=", 0), clientv3.Compare(clientv3.CreateRevision(keepOut), "=", 0),
			clientv3.Compare(clientv3.ModRevision(runKey), "=", l.runRev)}
		then := []clientv3.Op{clientv3.OpPut(l.key, string(val), clientv3.WithLease(lease))}
		els := []clientv3.Op{clientv3.OpGet(l.key), clientv3.OpGet(keepOut), clientv3.OpGet(runKey)}
		if l.cfg.GroupLease {
			c, ops := l.lease.groupBinding(l.links.addr())
			cmps, els, then = append(cmps, c), append(els, clientv3.OpGet(l.groupKey())), append(then, ops...)
		}
		tr, err := l.cli.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			// The lease ended before the registration: the group's (its
			// leader's renewals lapsed on a starved host) or this member's
			// own. Join binds to a lease again.
			return 0, errLeaseGone
		}
		if err != nil {
			return 0, fmt.Errorf("membership: join %s/%s: %w", l.cfg.Job, l.cfg.ID, ctxErr(ctx, err))
		}
		if tr.Succeeded {
			return l.registered(tr.Header.Revision), nil
		}
		if kvs := tr.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 && l.ownRegistration(kvs[0], lease) {
			// An earlier try of this Join was applied and its answer lost
			// (joinRetry): the registration is this one, and so is the
			// group record it may have created in the same transaction.
			return l.registered(kvs[0].CreateRevision), nil
		}
		if l.checkRun(tr.Responses[2].GetResponseRange().Kvs) != nil {
			return 0, errRunMoved
		}
		if l.cfg.GroupLease && l.lease.moved(tr.Responses[3].GetResponseRange().Kvs) {
			return 0, errGroupMoved
		}
		if kos := tr.Responses[1].GetResponseRange().Kvs; len(kos) > 0 {
			var ko KeepOut
			_ = json.Unmarshal(kos[0].Value, &ko)
			return 0, &KeptOutError{Job: l.cfg.Job, ID: l.cfg.ID, By: ko.By, Until: ko.Until}
		}
		kvs := tr.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 0 {
			continue // gone in between
		}
		var holder MemberRecord
		_ = json.Unmarshal(kvs[0].Value, &holder)
		dup := &DuplicateMemberError{Job: l.cfg.Job, ID: l.cfg.ID, Incarnation: kvs[0].CreateRevision, Addr: holder.Addr}
		l.claim(ctx, dup)
		if !l.cfg.WaitForDuplicate {
			return 0, dup
		}
		l.lg.Info("waiting for the previous incarnation to go", zap.Int64("holder", dup.Incarnation))
		if err := l.waitDeleted(ctx, tr.Header.Revision+1); err != nil {
			return 0, fmt.Errorf("%w (waited: %v)", dup, err)
		}
	}
}

// registered records the registration made at revision inc (its
// incarnation) and returns inc.
func (l *liveness) registered(inc int64) int64 {
	l.rec.update(func(r *MemberRecord) bool { r.Incarnation = inc; return false })
	if l.cfg.GroupLease {
		l.lease.registered(inc)
	}
	return inc
}

// ownRegistration reports whether kv, the member key found registered,
// is this Join's own registration: written under the lease it registers
// with, by the same Join (its record's Joined time, address and id).
// Another incarnation of the id (a process before this one) has another
// Joined time, even under the same group lease.
func (l *liveness) ownRegistration(kv *mvccpb.KeyValue, lease clientv3.LeaseID) bool {
	var holder MemberRecord
	if kv.Lease != int64(lease) || json.Unmarshal(kv.Value, &holder) != nil {
		return false
	}
	own := l.rec.get()
	return holder.ID == own.ID && holder.Addr == own.Addr && holder.Joined.Equal(own.Joined)
}

// Claim asks the coordinator to confirm that the incarnation holding a
// member id is dead (at etcdkeys.Layout.Claim): a new process of the member
// found its id taken, most often by its own previous process, killed a
// moment ago, whose lease has not expired yet. The coordinator dials the
// holder's address; a refused connection (no process listens there) ends
// the holder's registration at once, for a lease of its own or its
// group's, and the new process registers without waiting for the lease.
// A holder that answers is left alone: another live process with the
// same id, or one that is not dead yet.
type Claim struct {
	Incarnation int64     `json:"incarnation"` // the holder's
	Addr        string    `json:"addr"`        // the holder's address, as its record gives it
	By          string    `json:"by"`          // the claimant's address
	At          time.Time `json:"at"`
}

// claim writes a Claim for the holder dup names (best effort: the wait
// for its lease remains the fallback).
func (l *liveness) claim(ctx context.Context, dup *DuplicateMemberError) {
	if dup.Addr == "" || dup.Addr == l.cfg.Addr {
		return // the same address: a dial cannot tell the two apart
	}
	val, _ := json.Marshal(Claim{Incarnation: dup.Incarnation, Addr: dup.Addr, By: l.cfg.Addr, At: time.Now()})
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := l.cli.Put(cctx, l.keys.Claim(l.cfg.Job, l.cfg.ID), string(val)); err != nil {
		l.lg.Info("asking the coordinator to confirm the previous incarnation dead", zap.Error(err))
	}
}

// waitDeleted watches the member key from rev until it is deleted.
func (l *liveness) waitDeleted(ctx context.Context, rev int64) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for wr := range l.cli.Watch(wctx, l.key, clientv3.WithRev(rev), clientv3.WithFilterPut()) {
		if err := wr.Err(); err != nil {
			return nil // compacted or similar: the caller reads again
		}
		if len(wr.Events) > 0 {
			return nil
		}
	}
	return context.Cause(ctx)
}

// joinGossip contacts the coordinators and a few members of the job.
func (l *liveness) joinGossip(ctx context.Context) error {
	var seeds []string
	resp, err := l.cli.Get(ctx, l.keys.CoordinatorGossip(), clientv3.WithPrefix())
	if err != nil {
		return err
	}
	for _, kv := range resp.Kvs {
		seeds = append(seeds, string(kv.Value))
	}
	resp, err = l.cli.Get(ctx, l.keys.Members(l.cfg.Job), clientv3.WithPrefix(), clientv3.WithLimit(8))
	if err != nil {
		return err
	}
	for _, kv := range resp.Kvs {
		var r MemberRecord
		if json.Unmarshal(kv.Value, &r) == nil && r.Gossip != "" && r.ID != l.cfg.ID {
			seeds = append(seeds, r.Gossip)
		}
	}
	rand.Shuffle(len(seeds), func(i, j int) { seeds[i], seeds[j] = seeds[j], seeds[i] })
	_, err = l.lease.gossip().Join(ctx, seeds)
	return err
}

// watchSelf ends the membership when the member key is deleted (eviction,
// lease expiry, a coordinator's verdict of death).
func (l *liveness) watchSelf() {
	rev := l.inc + 1
	for l.life.Err() == nil {
		for wr := range l.cli.Watch(l.life, l.key, clientv3.WithRev(rev), clientv3.WithFilterPut()) {
			if wr.Err() != nil {
				break
			}
			if len(wr.Events) > 0 {
				l.end.lost(fmt.Errorf("%w: %s/%s: registration deleted", ErrEvicted, l.cfg.Job, l.cfg.ID))
				return
			}
			rev = wr.Header.Revision + 1
		}
		if l.life.Err() != nil {
			return
		}
		// Compacted past our revision: look at the key itself.
		resp, err := l.cli.Get(l.life, l.key)
		if err != nil {
			continue
		}
		if len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != l.inc {
			l.end.lost(fmt.Errorf("%w: %s/%s: registration gone", ErrEvicted, l.cfg.Job, l.cfg.ID))
			return
		}
		rev = resp.Header.Revision + 1
	}
}

// renew keeps lease alive: it drains its keepalive responses (ka). The
// channel closes when the lease is gone (expired, revoked), when the
// membership ends, and also when etcd has not answered for a TTL: the
// client gives up on a lease that "may be expired". Only etcd knows, and
// an etcd that restarted restores every lease with a fresh TTL, so a
// registration outlives an outage of etcd of any length (a coordinator's
// embedded etcd, killed with it). renew then asks etcd once it answers:
// the membership is lost if the lease is gone, and otherwise the same
// lease is renewed again — the registration and its incarnation hold,
// and the epoch the member takes part in is not ended by the outage.
func (l *liveness) renew(lease clientv3.LeaseID, ka <-chan *clientv3.LeaseKeepAliveResponse) {
	for ka != nil {
		for range ka {
		}
		if l.life.Err() != nil {
			return
		}
		ka = l.renewAgain(lease)
	}
}

// renewAgain asks etcd, until it answers or the membership ends, whether
// lease lives after its keepalive lapsed. It returns a new keepalive
// channel when it does, or nil: the lease is gone (the membership is
// lost) or the membership ended.
func (l *liveness) renewAgain(lease clientv3.LeaseID) <-chan *clientv3.LeaseKeepAliveResponse {
	since := time.Now()
	l.lg.Warn("lease renewal lapsed: etcd did not answer for a lease TTL; the registration holds unless etcd says its lease expired",
		zap.String("lease", fmt.Sprintf("%x", int64(lease))))
	stopNotice := waitNotice(l.cli, l.lg, "confirm the member's lease")
	defer stopNotice()
	pause := 50 * time.Millisecond
	for {
		ctx, cancel := context.WithTimeout(l.life, l.cfg.LeaseTTL)
		_, err := l.cli.KeepAliveOnce(ctx, lease)
		cancel()
		if err == nil {
			ka, kerr := l.cli.KeepAlive(l.life, lease)
			if kerr == nil {
				l.lg.Info("lease renewed again: etcd kept it, the registration holds",
					zap.Duration("lapsed_for", time.Since(since).Round(time.Millisecond)))
				return ka
			}
			err = kerr
		}
		switch {
		case errors.Is(err, rpctypes.ErrLeaseNotFound):
			l.end.lost(fmt.Errorf("%w: %s/%s: lease %x expired or revoked", ErrEvicted, l.cfg.Job, l.cfg.ID, int64(lease)))
			return nil
		case l.cli.Ctx().Err() != nil: // closed before the member: nothing can be renewed or asked
			l.end.lost(fmt.Errorf("%w: %s/%s: lease %x not renewed: the etcd client was closed", ErrEvicted, l.cfg.Job, l.cfg.ID, int64(lease)))
			return nil
		}
		select {
		case <-l.life.Done():
			return nil
		case <-time.After(pause):
		}
		pause = min(2*pause, time.Second)
	}
}

func (l *liveness) heartbeats() {
	t := time.NewTicker(l.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			if l.rec.changed() {
				ctx, cancel := context.WithTimeout(l.life, l.cfg.HeartbeatInterval)
				if err := l.rec.write(ctx, "heartbeat"); err != nil && !errors.Is(err, ErrEvicted) && l.life.Err() == nil {
					l.lg.Warn("heartbeat failed", zap.Error(err))
				}
				cancel()
			}
		case <-l.life.Done():
			return
		}
	}
}

func (l *liveness) drainGossip() {
	g := l.lease.gossip()
	for {
		select {
		case ev := <-g.Events():
			if ev.Kind != gossip.Joined {
				l.lg.Debug("gossip", zap.Stringer("event", ev.Kind), zap.String("node", ev.Name))
			}
		case <-l.life.Done():
			return
		}
	}
}

// waitNoticeAfter is how long an etcd call may wait before waitNotice
// says what it waits for; waitNoticeEvery how often it says it again.
const (
	waitNoticeAfter = time.Second
	waitNoticeEvery = 5 * time.Second
)

// waitNotice logs, while the call it was started for has not returned,
// that it waits for etcd, where, and what is in the way (the port refuses
// connections, or answers but the client cannot connect: TLS or
// credentials). The returned func stops it and waits for its goroutine.
func waitNotice(cli *clientv3.Client, lg *zap.Logger, what string) (stop func()) {
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTimer(waitNoticeAfter)
		defer t.Stop()
		start := time.Now()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			eps := cli.Endpoints()
			fields := []zap.Field{zap.Strings("endpoints", eps), zap.Duration("waited", time.Since(start).Round(time.Millisecond))}
			if cc := cli.ActiveConnection(); cc != nil {
				fields = append(fields, zap.Stringer("connection", cc.GetState()))
			}
			var probs []string
			for _, ep := range eps {
				host := ep
				if u, err := url.Parse(ep); err == nil && u.Host != "" {
					host = u.Host
				}
				c, err := net.DialTimeout("tcp", host, 500*time.Millisecond)
				if err != nil {
					probs = append(probs, err.Error())
					continue
				}
				c.Close()
				probs = append(probs, host+" accepts connections but the client is not connected (TLS or credentials?)")
			}
			fields = append(fields, zap.Strings("why", probs))
			lg.Warn("waiting for the coordinator's etcd to "+what+" (is ftcoord running and reachable?)", fields...)
			t.Reset(waitNoticeEvery)
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); <-exited }) }
}
