package membership

import (
	"context"
	"encoding/json"
	"maps"
	"net"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"go.uber.org/zap"
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

// probeReach adds the peers blamed in epoch to what the prober dials.
func (m *Member) probeReach(epoch uint64, ids []string) {
	if len(ids) == 0 {
		return
	}
	m.mu.Lock()
	if m.reach == nil {
		m.reach = map[string]reachTarget{}
	}
	for _, id := range ids {
		if id == m.cfg.ID {
			continue
		}
		if t, ok := m.reach[id]; !ok || t.epoch < epoch {
			m.reach[id] = reachTarget{epoch: epoch}
		}
	}
	m.mu.Unlock()
	select {
	case m.reachWake <- struct{}{}:
	default:
	}
}

// reachPeers is the prober's goroutine; it exits with the membership.
func (m *Member) reachPeers() {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval, bo.MaxInterval, bo.MaxElapsedTime = reachFirst, reachMax, 0
	for {
		m.mu.Lock()
		targets := maps.Clone(m.reach)
		m.mu.Unlock()
		var wait <-chan time.Time
		if len(targets) > 0 {
			reached := m.dialTargets(targets)
			if len(reached) > 0 {
				bo.Reset()
				m.tellReached(reached)
			}
			wait = time.After(bo.NextBackOff())
		} else {
			bo.Reset()
		}
		select {
		case <-m.reachWake:
			bo.Reset()
		case <-wait:
		case <-m.life.Done():
			return
		}
	}
}

// dialTargets dials every target once, at the same time, and returns
// those that answered (id → the blame's epoch). A target no longer
// registered is dropped: the coordinator decides about it.
func (m *Member) dialTargets(targets map[string]reachTarget) map[string]uint64 {
	ctx, cancel := context.WithTimeout(m.life, 2*reachTimeout)
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
				resp, err := m.cli.Get(ctx, m.keys.Member(m.cfg.Job, id))
				if err != nil {
					return
				}
				var r MemberRecord
				if len(resp.Kvs) == 0 || json.Unmarshal(resp.Kvs[0].Value, &r) != nil || r.Addr == "" {
					m.dropTarget(id, t.epoch)
					return
				}
				addr = r.Addr
				m.mu.Lock()
				if cur, ok := m.reach[id]; ok && cur.epoch == t.epoch {
					cur.addr = addr
					m.reach[id] = cur
				}
				m.mu.Unlock()
			}
			d := net.Dialer{Timeout: reachTimeout}
			c, err := d.DialContext(ctx, "tcp", addr)
			if err != nil {
				// Read its record again next time: it may be gone (then
				// the coordinator decides) or registered elsewhere.
				m.mu.Lock()
				if cur, ok := m.reach[id]; ok && cur.epoch == t.epoch {
					cur.addr = ""
					m.reach[id] = cur
				}
				m.mu.Unlock()
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

func (m *Member) dropTarget(id string, epoch uint64) {
	m.mu.Lock()
	if cur, ok := m.reach[id]; ok && cur.epoch == epoch {
		delete(m.reach, id)
	}
	m.mu.Unlock()
}

// tellReached records the peers reached and writes the record at once.
func (m *Member) tellReached(reached map[string]uint64) {
	m.mu.Lock()
	if m.rec.Reached == nil {
		m.rec.Reached = map[string]uint64{}
	} else {
		m.rec.Reached = maps.Clone(m.rec.Reached) // the last write's map stays as written
	}
	for id, e := range reached {
		if cur, ok := m.reach[id]; ok && cur.epoch == e {
			delete(m.reach, id)
		}
		m.rec.Reached[id] = e
	}
	m.mu.Unlock()
	ctx, cancel := context.WithTimeout(m.life, 5*time.Second)
	defer cancel()
	if err := m.write(ctx, "reached"); err != nil && m.life.Err() == nil {
		m.lg.Info("reporting blamed peers reached again", zap.Error(err))
	}
	m.lg.Info("blamed peers reached again", zap.Any("peers", reached))
}
