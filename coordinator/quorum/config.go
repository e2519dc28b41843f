package quorum

import (
	"fmt"
	"time"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// Config holds the rules of quorum formation for one job.
type Config struct {
	// MinReplicas is the fewest participants a new (not fast) quorum may
	// have. Members may ask for more (MemberRecord.MinReplicas); the
	// largest wins. Default 1.
	MinReplicas int
	// JoinTimeout is how long a pending quorum waits for live members
	// that have not asked to take part yet (stragglers) before it forms
	// without them. Default 10 s.
	JoinTimeout time.Duration
	// FailureSettle is how long an epoch that failed with every
	// participant still alive (a commit failure, a revocation) waits for
	// more reports before the next one forms: when a replica dies, its
	// peers' failures arrive first and the blame naming it (checked by
	// the coordinator) a moment later, and waiting for it makes one death
	// cost one epoch, not two. It waits up to ten times as long for a
	// participant that a peer blamed to report (a cut is seen from both
	// sides). Default 100 ms; 0: none.
	FailureSettle time.Duration
	// HolderGrace is how long a quorum none of whose candidates holds the
	// job's last known step waits for a participant that held it and
	// lapsed (Cause.Lapsed: its lease expired or gossip lost it, or it
	// was gone when the coordinator began to lead) to come back: an etcd
	// or coordinator outage lapses the leases of live replicas, which
	// register again within about a lease TTL. 0: DefaultHolderGrace;
	// negative: no wait.
	HolderGrace time.Duration
	// BlameHold is how long a blame between two live members (a peer
	// named the other in a failed epoch: a connection that failed or
	// never came) keeps them out of one quorum; it doubles each time the
	// pair fails again after its hold ended, up to 16 times, and is
	// forgotten once both form an epoch together. 0: DefaultBlameHold;
	// negative: blame never splits the job.
	BlameHold time.Duration
	// BlameMinHold is the shortest a blame keeps two members apart: once
	// one of them reports that it reaches the other again
	// (MemberRecord.Reached: the link works, the cause ended), the hold
	// ends as soon as BlameMinHold has passed since the last blame, doubled
	// like BlameHold each time the pair fails again after a hold ended —
	// a cut that healed costs seconds, a link that keeps failing still
	// backs off. 0: DefaultBlameMinHold; negative: reports end holds at
	// once.
	BlameMinHold time.Duration
	// SilentEpochs is how many failed epochs in a row a participant may
	// be blamed by its peers while reporting nothing itself (a live
	// process whose training loop stopped calling Step) before quorums
	// leave it out, until it shows life. 0: DefaultSilentEpochs;
	// negative: never.
	SilentEpochs int
	// Stragglers is the straggler policy of the jobs whose members ask
	// for none (membership.MemberConfig.Stragglers); the zero value is off.
	Stragglers membership.StragglerPolicy
	// FormWindow batches joins: a quorum whose only change would be to
	// admit joiners (a job forming or growing) waits until no member has
	// registered or asked to take part for this long, so that members
	// that start together form one epoch, not one per joiner (every epoch
	// goes to every member, and each costs the participants a
	// reconfiguration). 0: DefaultFormWindow; negative: none.
	FormWindow time.Duration
	// FormMaxWait bounds that wait: such a quorum forms at the latest this
	// long after it was first needed, however joins keep coming; each such
	// quorum in a row that formed at its bound, joins still arriving,
	// doubles the next one's (up to 8 times), so a mass join is a few
	// epochs. 0: DefaultFormMaxWait.
	FormMaxWait time.Duration
	// LossWindow batches losses: the first loss after a quiet spell is
	// published at once (a single death costs nothing more), and losses
	// that follow a published one within LossMaxWait wait until none was
	// lost for this long, so that many deaths at once (a rack, a switch: a
	// thousand ranks whose links reset, whose groups' leases are taken
	// over, each seen a few milliseconds apart) cost two epochs, not one
	// per death. Every epoch is revoked at once all the same. 0:
	// DefaultLossWindow; negative: none, each loss publishes at once.
	LossWindow time.Duration
	// LossMaxWait bounds that wait from the first loss it waits for. 0:
	// DefaultLossMaxWait.
	LossMaxWait time.Duration
	// MassLoss is how many ranks lost within MassLossMaxWait (those
	// published included: a rate, so that deaths a second or two apart
	// never add up to one) make a mass failure, whose losses wait for
	// quiet of at least MassLossWindow, at most MassLossMaxWait: a rack whose leases lapse
	// reaches the coordinator as etcd revokes them, every 500 ms (at most
	// 500 leases a tick), spread over the TTL/3 between the leases'
	// renewals, and LossWindow's quiet would publish an epoch per tick. A
	// smaller burst (a death, then an unrelated one a second later) waits
	// LossWindow only. 0: DefaultMassLoss; negative: no mass failures.
	MassLoss int
	// MassLossWindow is a mass failure's quiet: longer than etcd's 500 ms
	// between revocations of expired leases. 0: DefaultMassLossWindow.
	MassLossWindow time.Duration
	// MassLossMaxWait bounds a mass failure's wait: longer than the TTL/3
	// over which leases of ranks that died at once expire, plus etcd's
	// tick. 0: DefaultMassLossMaxWait.
	MassLossMaxWait time.Duration
}

// blamedReportWait is how many FailureSettles a failed epoch waits for a
// report from a participant that a peer blamed.
const blamedReportWait = 10

// Defaults of the Config fields whose zero value means "the
// default".
const (
	DefaultHolderGrace  = 15 * time.Second
	DefaultBlameHold    = 30 * time.Second
	DefaultBlameMinHold = time.Second
	DefaultSilentEpochs = 2
	DefaultFormWindow   = 200 * time.Millisecond
	DefaultFormMaxWait  = 2 * time.Second
	DefaultLossWindow   = 50 * time.Millisecond
	DefaultLossMaxWait  = 2 * time.Second
	// DefaultMassLoss is two hosts of 8 GPUs.
	DefaultMassLoss = 16
	// DefaultMassLossWindow is longer than the 500 ms between etcd's
	// revocations of expired leases (its lessor revokes those due every
	// 500 ms, at most 500 at a time).
	DefaultMassLossWindow = 600 * time.Millisecond
	// DefaultMassLossMaxWait covers the spread of lapses: a lease is
	// renewed every TTL/3, so leases of processes that died at once
	// expire up to TTL/3 apart (5 s at the TTL of 15 s a job of 100,000
	// ranks runs with), plus etcd's 500 ms tick.
	DefaultMassLossMaxWait = 6 * time.Second
)

// DefaultConfig returns MinReplicas 1, JoinTimeout 10 s,
// FailureSettle 100 ms, HolderGrace 15 s, BlameHold 30 s, BlameMinHold
// 1 s, SilentEpochs 2, FormWindow 200 ms, FormMaxWait 2 s, LossWindow
// 50 ms, LossMaxWait 2 s, MassLoss 16, MassLossWindow 600 ms,
// MassLossMaxWait 6 s and no straggler policy.
func DefaultConfig() Config {
	return Config{MinReplicas: 1, JoinTimeout: 10 * time.Second, FailureSettle: 100 * time.Millisecond,
		HolderGrace: DefaultHolderGrace, BlameHold: DefaultBlameHold, BlameMinHold: DefaultBlameMinHold,
		SilentEpochs: DefaultSilentEpochs, FormWindow: DefaultFormWindow, FormMaxWait: DefaultFormMaxWait}
}

// Validate says what is wrong with the configuration, if anything.
func (c Config) Validate() error {
	if c.MinReplicas < 1 {
		return fmt.Errorf("%w: quorum: MinReplicas %d must be at least 1", comm.ErrInvalidArgument, c.MinReplicas)
	}
	if c.FailureSettle < 0 {
		return fmt.Errorf("%w: quorum: FailureSettle %v is negative", comm.ErrInvalidArgument, c.FailureSettle)
	}
	if c.JoinTimeout < 0 {
		return fmt.Errorf("%w: quorum: JoinTimeout %v is negative", comm.ErrInvalidArgument, c.JoinTimeout)
	}
	if c.FormMaxWait < 0 {
		return fmt.Errorf("%w: quorum: FormMaxWait %v is negative", comm.ErrInvalidArgument, c.FormMaxWait)
	}
	if c.LossMaxWait < 0 {
		return fmt.Errorf("%w: quorum: LossMaxWait %v is negative", comm.ErrInvalidArgument, c.LossMaxWait)
	}
	if c.MassLossWindow < 0 || c.MassLossMaxWait < 0 {
		return fmt.Errorf("%w: quorum: MassLossWindow %v or MassLossMaxWait %v is negative", comm.ErrInvalidArgument,
			c.MassLossWindow, c.MassLossMaxWait)
	}
	return c.Stragglers.Validate()
}

func (c Config) holderGrace() time.Duration {
	if c.HolderGrace == 0 {
		return DefaultHolderGrace
	}
	return max(c.HolderGrace, 0)
}

func (c Config) blameHold() time.Duration {
	if c.BlameHold == 0 {
		return DefaultBlameHold
	}
	return max(c.BlameHold, 0)
}

func (c Config) blameMinHold() time.Duration {
	if c.BlameMinHold == 0 {
		return DefaultBlameMinHold
	}
	return max(c.BlameMinHold, 0)
}

func (c Config) formWindow() time.Duration {
	if c.FormWindow == 0 {
		return DefaultFormWindow
	}
	return max(c.FormWindow, 0)
}

func (c Config) formMaxWait() time.Duration {
	if c.FormMaxWait == 0 {
		return DefaultFormMaxWait
	}
	return c.FormMaxWait
}

func (c Config) lossWindow() time.Duration {
	if c.LossWindow == 0 {
		return DefaultLossWindow
	}
	return max(c.LossWindow, 0)
}

func (c Config) lossMaxWait() time.Duration {
	if c.LossMaxWait == 0 {
		return DefaultLossMaxWait
	}
	return c.LossMaxWait
}

func (c Config) silentEpochs() int {
	if c.SilentEpochs == 0 {
		return DefaultSilentEpochs
	}
	return max(c.SilentEpochs, 0)
}

func (c Config) massLoss() int {
	if c.MassLoss == 0 {
		return DefaultMassLoss
	}
	return max(c.MassLoss, 0)
}

func (c Config) massLossWindow() time.Duration {
	if c.MassLossWindow == 0 {
		return DefaultMassLossWindow
	}
	return c.MassLossWindow
}

func (c Config) massLossMaxWait() time.Duration {
	if c.MassLossMaxWait == 0 {
		return DefaultMassLossMaxWait
	}
	return c.MassLossMaxWait
}
