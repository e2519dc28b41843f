package ft

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The reports to the coordinator: each report action's send method says
// how it reaches the registration it was made under, and the reporter
// sends them in order.

// memberReport is a report: what it is, for the log, and how send makes
// it to m.
type memberReport interface {
	what() string
	send(ctx context.Context, m *member) error
}

// report queues a best-effort report to the coordinator, made to the
// current registration.
func (d *driver) report(r memberReport) {
	d.reports.add(r.what(), reportTo{r, d.m}.send)
}

// reportTo is a report and the registration it is made to.
type reportTo struct {
	r memberReport
	m *member
}

func (t reportTo) send(ctx context.Context) error { return t.r.send(ctx, t.m) }

func (reportFormed) what() string { return "reporting the formed epoch" }
func (a reportFormed) send(ctx context.Context, m *member) error {
	return m.ReportFormed(ctx, a.epoch)
}

func (reportFailure) what() string { return "reporting the failed epoch" }
func (a reportFailure) send(ctx context.Context, m *member) error {
	return m.ReportCommitFailure(ctx, a.epoch, a.blamed...)
}

func (revokeEpoch) what() string { return "reporting failed peers" }
func (a revokeEpoch) send(ctx context.Context, m *member) error {
	return m.Revoke(ctx, a.epoch, a.reason, a.blamed...)
}

func (reportHeartbeat) what() string { return "reporting the healed step" }
func (reportHeartbeat) send(ctx context.Context, m *member) error {
	return m.beat.Heartbeat(ctx)
}

func (reportWaiting) what() string { return "reporting the wait" }
func (a reportWaiting) send(ctx context.Context, m *member) error {
	return m.waits.SetWaiting(ctx, a.step, a.reason)
}

func (reportStall) what() string { return "reporting a stalled step" }
func (a reportStall) send(ctx context.Context, m *member) error {
	return m.stalls.ReportStall(ctx, a.s)
}

func (reportFinish) what() string { return "reporting the run's end" }
func (a reportFinish) send(ctx context.Context, m *member) error {
	return m.Finish(ctx, a.step)
}

// revokeEpoch blames failed peers: logged, then reported.
func (d *driver) revokeEpoch(a revokeEpoch) {
	d.log.Info("blaming failed peers", zap.Uint64("epoch", a.epoch), zap.Strings("blamed", a.blamed), zap.String("reason", a.reason))
	d.report(a)
}

// reporter sends the coordinator its reports in order, on a goroutine of
// its own, each try bounded by the op timeout: a replica cut off from
// etcd never blocks the driver on them, and the coordinator learns of
// failures from leases and gossip meanwhile. A report that etcd did not
// take — no answer within the timeout, no leader, load shed — is tried
// again (after 50 ms, doubling to 1 s) until it is taken or fails for
// another reason (the registration it was made under ended), the later
// ones waiting behind it: what a replica reports, a failed epoch and the
// peers it blames above all, is what the coordinator decides on, and an
// outage of the coordinator's etcd used to lose it (the survivors of a
// death inside the outage then waited for the dead replica's lease).
// Every report is idempotent: one taken twice is one.
type reporter struct {
	log     *zap.Logger
	timeout time.Duration
	mu      sync.Mutex
	queue   []report
	wake    chan struct{}
	ctx     context.Context
	cancel  context.CancelFunc
	done    chan struct{}
}

// report is one report: what it is, for the log, and how to make it.
type report struct {
	what string
	f    func(context.Context) error
}

func newReporter(log *zap.Logger, timeout time.Duration) *reporter {
	ctx, cancel := context.WithCancel(context.Background())
	r := &reporter{log: log, timeout: timeout, wake: make(chan struct{}, 1), ctx: ctx, cancel: cancel, done: make(chan struct{})}
	go r.run()
	return r
}

func (r *reporter) add(what string, f func(context.Context) error) {
	r.mu.Lock()
	r.queue = append(r.queue, report{what, f})
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// run exits when stop is called.
func (r *reporter) run() {
	defer close(r.done)
	for {
		r.mu.Lock()
		q := r.queue
		r.queue = nil
		r.mu.Unlock()
		for _, rep := range q {
			r.send(rep)
		}
		select {
		case <-r.wake:
		case <-r.ctx.Done():
			return
		}
	}
}

// send makes one report, trying again while etcd does not take it.
func (r *reporter) send(rep report) {
	pause := 50 * time.Millisecond
	for tries := 1; ; tries++ {
		ctx, cancel := context.WithTimeout(r.ctx, r.timeout)
		err := rep.f(ctx)
		cancel()
		switch {
		case err == nil:
			if tries > 1 {
				r.log.Info(rep.what+": taken", zap.Int("tries", tries))
			}
			return
		case r.ctx.Err() != nil:
			return
		case !notTaken(err):
			r.log.Warn(rep.what, zap.Error(err))
			return
		case tries == 1:
			r.log.Warn(rep.what+": not taken; trying again until etcd takes it", zap.Error(err))
		}
		select {
		case <-r.ctx.Done():
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, time.Second)
	}
}

// notTaken says whether err means that etcd did not take a request that
// may simply be made again: no answer in time (etcd down or cut off), no
// leader, load shed.
func notTaken(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, rpctypes.ErrNoLeader) ||
		errors.Is(err, rpctypes.ErrTooManyRequests) || status.Code(err) == codes.Unavailable
}

func (r *reporter) stop() {
	r.cancel()
	<-r.done
}
