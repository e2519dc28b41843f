package coordinator

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/membership"
)

// leaderSim drives the leader's machine as follow does — records in
// watch responses, a decision after each — with each write answered at
// once, a publication encoded as the leader would (publishOps).
type leaderSim struct {
	b      *testing.B
	m      *machine
	now    time.Time
	rev    int64
	epochs int
	last   *membership.Quorum
}

func newLeaderSim(b *testing.B) *leaderSim {
	s := &leaderSim{b: b, m: newMachine(machineConfig{name: "c0", quorum: quorum.DefaultConfig(), probeWait: probeWait}),
		now: time.Unix(1000, 0), rev: 1}
	s.m.handle(s.now, loaded{jobs: map[string]*jobSnapshot{}})
	return s
}

// feed hands the machine one input and answers the writes that follow.
func (s *leaderSim) feed(in input) {
	acts := append([]action(nil), s.m.handle(s.now, in)...)
	for i := 0; i < len(acts); i++ {
		var w *written
		switch a := acts[i].(type) {
		case publish:
			_, val, err := publishOps(etcdkeys.Layout{}, 100, a, nil)
			if err != nil {
				s.b.Fatal(err)
			}
			s.rev++
			w = &written{ok: true, rev: s.rev, value: val}
			if a.quorum != nil {
				s.epochs++
				s.last = a.quorum
			}
		case restoreRecord, deleteRecord, deleteView:
			s.b.Fatalf("unexpected %T", a)
		}
		if w != nil {
			acts = append(acts, s.m.handle(s.now, *w)...)
		}
	}
}

// A job of 100,000 ranks forming through the leader's machine: the
// records arrive as JSON in watch responses of 256, 20 ms apart (12,800
// joins a second), the leader deciding after each; after the last, it
// decides at its timer until the quorum holds everyone. Reported: the
// leader's time for the whole forming, and the epochs.
func BenchmarkLeaderForming100K(b *testing.B) {
	const n, batch = 100000, 256
	raw := make([][]byte, n)
	for i := range raw {
		raw[i], _ = json.Marshal(membership.MemberRecord{Job: "j", ID: fmt.Sprintf("m%06d", i), Group: fmt.Sprintf("g%06d", i/8),
			Addr: "10.1.2.3:29500", WantQuorum: true, Lease: int64(1 + i/8), SharedLease: true})
	}
	epochs := 0
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		s := newLeaderSim(b)
		for k := 0; k < n; k += batch {
			for j := k; j < min(k+batch, n); j++ {
				var r membership.MemberRecord
				if err := json.Unmarshal(raw[j], &r); err != nil {
					b.Fatal(err)
				}
				s.rev++
				r.Incarnation = s.rev
				s.feed(recordPut{job: "j", rec: r})
			}
			s.feed(tick{})
			s.now = s.now.Add(20 * time.Millisecond)
		}
		for s.last == nil || len(s.last.Participants) < n {
			next := s.m.wake()
			if next.IsZero() {
				b.Fatal("no timer, and no quorum of everyone")
			}
			s.now = next
			s.feed(tick{})
		}
		epochs = s.epochs
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e9, "s/forming")
	b.ReportMetric(float64(epochs), "epochs")
}
