package membership

import (
	"context"
	"encoding/json"
	"maps"
	"net"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Reaching blamed peers again. A member that blamed peers (a failed
// commit's Blamed, a revocation's Failed: their connections failed or went
// silent) keeps dialling their addresses; once one answers, the link
// works again and the member says so (MemberRecord.Reached), so that the
// coordinator ends the blame's hold at once instead of after a fixed time
// (a cut that healed, a slow link that timed an op out once). The dial is
// a TCP connect to the peer's registered address (its state server), the
// same route its collectives take between the two hosts.

// reachTarget is a blamed peer to dial: the epoch of the blame, and its
// address once read.
type reachTarget struct {
	epoch uint64
	addr  string
}

// Dial pacing: the first dials come quickly (a single false blame), then
// back off while the peer stays unreachable (a long cut).
const (
	reachFirst   = 100 * time.Millisecond
	reachMax     = time.Second
	reachTimeout = 300 * time.Millisecond
)

// reachProbe is the part of a member that dials the peers it blamed
// until they answer (run).
type reachProbe struct {
	*memberEnv
	wake chan struct{} // targets were added (capacity 1)

	mu      sync.Mutex             // guards targets
	targets map[string]reachTarget // by member id
}

func (r *reachProbe) init(env *memberEnv) {
	r.memberEnv, r.wake, r.targets = env, make(chan struct{}, 1), map[string]reachTarget{}
}

// probe adds the peers blamed in epoch to what the prober dials.
func (r *reachProbe) probe(epoch uint64, ids []string) {
	if len(ids) == 0 {
		return
	}
	r.mu.Lock()
	for _, id := range ids {
		if id == r.cfg.ID {
			continue
		}
		if t, ok := r.targets[id]; !ok || t.epoch < epoch {
			r.targets[id] = reachTarget{epoch: epoch}
		}
	}
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// run is the prober's goroutine: it hands the peers it reached to tell
// (id → the blame's epoch), once each. It exits with the membership.
func (r *reachProbe) run(tell func(reached map[string]uint64)) {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = reachFirst, reachMax, 0
	for {
		r.mu.Lock()
		targets := maps.Clone(r.targets)
		r.mu.Unlock()
		var wait <-chan time.Time
		if len(targets) > 0 {
			reached := r.dialTargets(targets)
			if len(reached) > 0 {
				bo.Reset()
				r.reached(reached)
				tell(reached)
			}
			wait = time.After(bo.NextBackOff())
		} else {
			bo.Reset()
		}
		select {
		case <-r.wake:
			bo.Reset()
		case <-wait:
		case <-r.life.Done():
			return
		}
	}
}

// dialTargets dials every target once, at the same time, and returns
// those that answered (id → the blame's epoch). A target no longer
// registered is dropped: the coordinator decides about it.
func (r *reachProbe) dialTargets(targets map[string]reachTarget) map[string]uint64 {
	ctx, cancel := context.WithTimeout(r.life, 2*reachTimeout)
	defer cancel()
	var mu sync.Mutex
	var wg sync.WaitGroup
	reached := map[string]uint64{}
	for id, t := range targets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			addr := t.addr
			if addr == "" {
				resp, err := r.cli.Get(ctx, r.keys.Member(r.cfg.Job, id))
				if err != nil {
					return
				}
				var rec MemberRecord
				if len(resp.Kvs) == 0 || json.Unmarshal(resp.Kvs[0].Value, &rec) != nil || rec.Addr == "" {
					r.drop(id, t.epoch)
					return
				}
				addr = rec.Addr
				r.setAddr(id, t.epoch, addr)
			}
			d := net.Dialer{Timeout: reachTimeout}
			c, err := d.DialContext(ctx, "tcp", addr)
			if err != nil {
				// Read its record again next time: it may be gone (then
				// the coordinator decides) or registered elsewhere.
				r.setAddr(id, t.epoch, "")
				return
			}
			c.Close()
			mu.Lock()
			reached[id] = t.epoch
			mu.Unlock()
		}()
	}
	wg.Wait()
	return reached
}

// setAddr records the address of target id, blamed in epoch ("": read
// it again).
func (r *reachProbe) setAddr(id string, epoch uint64, addr string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cur, ok := r.targets[id]; ok && cur.epoch == epoch {
		cur.addr = addr
		r.targets[id] = cur
	}
}

func (r *reachProbe) drop(id string, epoch uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cur, ok := r.targets[id]; ok && cur.epoch == epoch {
		delete(r.targets, id)
	}
}

// reached drops the targets reached (id → the blame's epoch).
func (r *reachProbe) reached(reached map[string]uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, e := range reached {
		if cur, ok := r.targets[id]; ok && cur.epoch == e {
			delete(r.targets, id)
		}
	}
}
