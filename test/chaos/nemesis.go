package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"syscall"
	"time"

	"github.com/ftcomm/ftcomm/internal/netns"
)

// nemesis injects faults for Config.Duration: one every MTBF, start to
// start (or at exponentially distributed gaps of mean MTBF), cycling
// through the kinds in a new random order each round. Each fault is undone
// (restarted, continued, healed) before the next begins.
func (h *harness) nemesis(ctx context.Context) {
	kinds := h.kinds()
	end := time.Now().Add(h.cfg.Duration)
	if len(kinds) == 0 { // a run without faults (false deaths under load, say)
		select {
		case <-ctx.Done():
		case <-time.After(h.cfg.Duration):
		}
		return
	}
	next := time.Now()
	var order []FaultKind
	for id := 1; ; id++ {
		gap := h.cfg.MTBF
		if h.cfg.Random {
			gap = time.Duration(h.rng.ExpFloat64() * float64(h.cfg.MTBF))
		}
		next = next.Add(gap)
		if next.After(end) {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Until(next)):
		}
		if len(order) == 0 {
			order = append([]FaultKind(nil), kinds...)
			h.rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		}
		kind := order[0]
		order = order[1:]
		f := &Fault{ID: id, Kind: kind, Start: time.Now(), Epoch: h.rec.epoch(), Detection: -1, Recovery: -1, Rejoin: -1}
		h.inject(ctx, f) // a fault that outlasts the gap delays the next one
	}
}

// uniform returns a duration in [lo, hi).
func (h *harness) uniform(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(h.rng.Int64N(int64(hi-lo)))
}

func (h *harness) pick(names []string) string { return names[h.rng.IntN(len(names))] }

// length is how long a cut, stall or starve fault lasts: Config.FaultLength,
// or a duration in [lo, hi).
func (h *harness) length(lo, hi time.Duration) time.Duration {
	d := h.uniform(lo, hi)
	if h.cfg.FaultLength > 0 {
		d = h.cfg.FaultLength
	}
	return d
}

// halves splits the replicas in two random halves.
func (h *harness) halves() (a, b []string) {
	perm := h.rng.Perm(len(h.names))
	half := len(h.names) / 2
	for i, k := range perm {
		if i < half {
			a = append(a, h.names[k])
		} else {
			b = append(b, h.names[k])
		}
	}
	return a, b
}

// inject carries out fault f and undoes it; it returns when it is undone.
func (h *harness) inject(ctx context.Context, f *Fault) {
	// Once begun, f is shared with the watcher: changes to it hold h.mu.
	note := func(format string, args ...any) { f.Note = fmt.Sprintf(format, args...) }
	begin := func() {
		f.Start = time.Now()
		h.mu.Lock()
		h.faults = append(h.faults, f)
		h.mu.Unlock()
		h.rec.harness(Event{Kind: evFault, Fault: f.ID, Reason: string(f.Kind), Targets: f.Targets, Err: f.Note})
		h.logf("fault #%d %s %v %s", f.ID, f.Kind, f.Targets, f.Note)
	}
	fail := func(err error) {
		if err != nil {
			h.mu.Lock()
			f.Err = err.Error()
			h.mu.Unlock()
			h.logf("fault #%d %s: %v", f.ID, f.Kind, err)
		}
	}
	pause := func(d time.Duration) {
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
	}
	switch f.Kind {
	case FaultKill:
		r := h.pick(h.names)
		delay := h.uniform(500*time.Millisecond, 3*time.Second)
		f.Targets, f.Affects = []string{r}, []string{r}
		note("restart after %v", delay.Round(time.Millisecond))
		begin()
		if p, err := h.signal(r, syscall.SIGKILL); err != nil {
			fail(err)
		} else {
			<-p.done
		}
		pause(delay)
		fail(h.spawn(r))
	case FaultStop:
		r := h.pick(h.names)
		d := h.uniform(h.cfg.LeaseTTL+time.Second, h.cfg.LeaseTTL+4*time.Second)
		f.Targets, f.Affects, f.Silent = []string{r}, []string{r}, true
		note("for %v (lease %v)", d.Round(time.Millisecond), h.cfg.LeaseTTL)
		begin()
		_, err := h.signal(r, syscall.SIGSTOP)
		fail(err)
		pause(d)
		_, err = h.signal(r, syscall.SIGCONT)
		fail(err)
	case FaultCoordKill, FaultCoordTerm:
		sig := syscall.SIGKILL
		if f.Kind == FaultCoordTerm {
			sig = syscall.SIGTERM
		}
		lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		i, err := h.cl.leader(lctx)
		cancel()
		if err != nil {
			running := h.cl.running()
			if len(running) == 0 {
				fail(fmt.Errorf("no coordinator to stop: %w", err))
				return
			}
			i = running[0]
		}
		delay := h.uniform(time.Second, 4*time.Second)
		f.Targets = []string{h.cl.coords[i].name}
		note("the leader, restarted after %v", delay.Round(time.Millisecond))
		begin()
		fail(h.cl.stopCoord(i, sig))
		pause(delay)
		fail(h.cl.startCoord(i))
	case FaultCoordAll:
		d := h.uniform(3*time.Second, 8*time.Second)
		for _, cp := range h.cl.coords {
			f.Targets = append(f.Targets, cp.name)
		}
		note("all down for %v", d.Round(time.Millisecond))
		begin()
		for _, i := range h.cl.running() {
			fail(h.cl.stopCoord(i, syscall.SIGKILL))
		}
		pause(d)
		for _, i := range h.cl.coordsDown() {
			fail(h.cl.startCoord(i))
		}
	case FaultEtcd:
		d := h.uniform(time.Second, 5*time.Second)
		f.Targets = []string{"etcd"}
		note("down for %v", d.Round(time.Millisecond))
		begin()
		fail(h.cl.stopEtcd(syscall.SIGKILL))
		pause(d)
		fail(h.cl.startEtcd())
	case FaultPartition:
		a, b := h.halves()
		d := h.uniform(4*time.Second, 10*time.Second)
		f.Targets, f.Affects, f.Silent = append(append([]string(nil), a...), b...), append(append([]string(nil), a...), b...), true
		note("%v | %v+coordinators for %v", a, b, d.Round(time.Millisecond))
		begin()
		fail(h.net.partition(ctx, a, b, true))
		pause(d)
		fail(h.net.heal(ctx))
	case FaultIsolate:
		r := h.pick(h.names)
		var rest []string
		for _, n := range h.names {
			if n != r {
				rest = append(rest, n)
			}
		}
		d := h.uniform(3*time.Second, 8*time.Second)
		f.Targets, f.Affects, f.Silent = []string{r}, []string{r}, true
		note("for %v", d.Round(time.Millisecond))
		begin()
		fail(h.net.partition(ctx, []string{r}, rest, true))
		if rn, ok := h.net.(interface{ reset(string) }); ok {
			rn.reset(r) // the proxy resets its connections, then drops the new ones
		}
		pause(d)
		fail(h.net.heal(ctx))
	case FaultSlow:
		r := h.pick(h.names)
		s := netns.Shape{Delay: h.uniform(10*time.Millisecond, 80*time.Millisecond), Jitter: 5 * time.Millisecond,
			Rate: fmt.Sprintf("%dmbit", 3+h.rng.IntN(28)), Loss: math.Round(h.rng.Float64()*10) / 10}
		d := h.uniform(5*time.Second, 12*time.Second)
		f.Targets, f.Affects, f.Silent = []string{r}, []string{r}, true
		note("%sfor %v", shapeString(s), d.Round(time.Millisecond))
		begin()
		if err := h.net.shape(ctx, r, s); errors.Is(err, netns.ErrNoNetem) {
			h.mu.Lock()
			f.Note += " (no netem here: the rate cap only)"
			h.mu.Unlock()
		} else {
			fail(err)
		}
		pause(d)
		fail(h.net.shape(ctx, r, netns.Shape{}))
	case FaultCut:
		a, b := h.halves()
		d := h.length(15*time.Second, 30*time.Second)
		all := append(append([]string(nil), a...), b...)
		f.Targets, f.Affects, f.Silent = all, all, true
		note("%v | %v, both reaching the coordinators, for %v", a, b, d.Round(time.Millisecond))
		begin()
		fail(h.net.partition(ctx, a, b, false))
		pause(d)
		fail(h.net.heal(ctx))
	case FaultStall:
		r := h.pick(h.names)
		d := h.length(20*time.Second, 40*time.Second)
		f.Targets, f.Affects, f.Silent = []string{r}, []string{r}, true
		note("its loop calls no Step for %v", d.Round(time.Millisecond))
		begin()
		fail(h.tell(r, "pause"))
		pause(d)
		fail(h.tell(r, "resume"))
	case FaultSettings:
		h.mu.Lock()
		h.settingsSet++
		n := h.settingsSet
		h.mu.Unlock()
		lr, every := fmt.Sprintf("%.4g", 0.7/float64(n)), fmt.Sprint(10*n)
		f.Targets = []string{"ftcoord"}
		note("ftcoord job set %s lr=%s sync_every=%s", job, lr, every)
		begin()
		v, err := h.cl.setSettings(ctx, job, "lr="+lr, "sync_every="+every)
		h.mu.Lock()
		f.Version = v
		h.mu.Unlock()
		fail(err)
	case FaultStarve:
		r := h.pick(h.names)
		d := h.length(40*time.Second, 60*time.Second)
		f.Targets, f.Affects = []string{r}, []string{r}
		var undo func() error
		var err error
		if q := h.cfg.StarveQuota; q > 0 {
			note("limited to %.0f%% of one CPU for %v", 100*q, d.Round(time.Millisecond))
			begin()
			undo, err = h.quota(r, q)
		} else {
			note("pinned to one CPU beside %d busy loops for %v", h.cfg.StarveLoops, d.Round(time.Millisecond))
			begin()
			undo, err = h.starve(r, h.cfg.StarveLoops)
		}
		fail(err)
		pause(d)
		if undo != nil {
			fail(undo())
		}
	}
	h.mu.Lock()
	f.End = time.Now()
	h.mu.Unlock()
	h.rec.harness(Event{Kind: evHealed, Fault: f.ID, Reason: string(f.Kind), Targets: f.Targets})
}
