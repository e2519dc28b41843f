package ft

import (
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
	"github.com/ftcomm/ftcomm/recovery"
)

// Errors callers branch on with errors.Is.
var (
	// ErrNotParticipating: this rank is not in the current quorum's FT comm
	// (its replica group is incomplete, or it has not been admitted yet).
	ErrNotParticipating = errors.New("ft: not participating in the current epoch")
	// ErrTooManyCommitFailures: Config.MaxCommitFailures commits in a row failed.
	ErrTooManyCommitFailures = errors.New("ft: too many consecutive commit failures")
	// ErrClosed: the Comm was closed.
	ErrClosed = errors.New("ft: closed")
	// ErrMembershipLost: the registration ended and could not be renewed
	// (a Membership supplied in Config is not re-created).
	ErrMembershipLost = errors.New("ft: membership lost")
	// ErrStepFailed: the training loop failed its step (Comm.FailStep).
	// The step's first error wraps it, with the loop's reason; so does
	// the ErrTooManyCommitFailures error when that step was the last to
	// fail.
	ErrStepFailed = errors.New("ft: the training loop failed the step")
)

// DefaultControlBackend carries ft's control messages when the data
// backend keeps device memory.
const DefaultControlBackend = "gloo"

// AnyRank as Config.GroupRank (with Spare) makes a slot spare.
const AnyRank = -1

// The stall bound's defaults (Config.StallFactor, Config.StallMin).
const (
	DefaultStallFactor = 10
	DefaultStallMin    = time.Second
)

// Config configures a Comm. Job, Group and Secret are required, and a way
// to the coordinator: Coordinator endpoints, a credentials file
// (Credentials or $FTCOMM_CREDENTIALS), or a Membership.
type Config struct {
	Job   string // the training job
	Group string // this replica group's id ("g3")
	// GroupRank and GroupSize place this process in its replica group (the
	// shard dimension of HSDP); 0 and 1 for plain data parallelism.
	// GroupRank AnyRank, with Spare, makes a slot spare: New waits until
	// a rank of Group dies (its registration is removed) and takes its
	// place, as that rank's restarted process would — for a group with no
	// replica (SnapshotEvery), whose replacement restores the dead rank's
	// shard. Comm.GroupRank says which rank it became.
	GroupRank, GroupSize int

	// Coordinator lists the etcd endpoints of the ftcoord cluster.
	Coordinator []string
	// Member configures the registration made through Coordinator (lease
	// TTL, heartbeat interval, gossip, etcd root, straggler policy); ft
	// fills in the client, job, id, group, address and min replicas. Under
	// a straggler policy (Member.Stragglers, or ftcoord's) each step's
	// compute time counts from Step's return to the loop's first ft
	// collective, or to Commit.
	Member membership.MemberConfig
	// EtcdTLS and EtcdUsername/EtcdPassword reach a secured etcd.
	EtcdTLS                    *tls.Config
	EtcdUsername, EtcdPassword string
	// Credentials is the path of a trainer credentials file
	// (membership.LoadCredentials; `ftcoord serve` writes one); default
	// $FTCOMM_CREDENTIALS. It gives the etcd endpoints when Coordinator
	// is empty, TLS and identity unless EtcdTLS or EtcdUsername are set,
	// the coordinators' quorum-verification keys and the gossip key. With
	// its endpoints, the Comm follows the file: when they all fail, it
	// reads the file again and moves to the endpoints written there
	// (membership.Credentials.Follow).
	Credentials string
	// Membership, if set, is used instead of registering through
	// Coordinator; ft closes it in Close.
	Membership Membership

	// Backend is the data backend: the training loop's collectives run on
	// it ("gloo", or "nccl" for device tensors; default "gloo"), with
	// BackendConfig and, on GPUs, Device (the CUDA ordinal).
	Backend       string
	BackendConfig any
	Device        int
	// ControlBackend carries ft's own control messages (the step
	// agreement, the group's commit vote) in host memory. Default: the
	// data backend itself when it keeps host memory, else
	// DefaultControlBackend; it is formed beside the data comm, at the same
	// epochs, through the same Store. Import it (e.g. backends/gloo).
	ControlBackend       string
	ControlBackendConfig any
	// GroupBackend is the backend of the replica group's data comm (the
	// shard dimension, Group()), with GroupBackendConfig; default Backend
	// and BackendConfig. A training loop that shards over a comm of its
	// own (Python's FT-HSDP runs FSDP2 over its own device mesh) sets it
	// to the control backend: the group then has one host comm, which
	// carries ft's group messages, and no device comm is made for the
	// group at each reconfiguration (on GPUs that is a connection set-up).
	GroupBackend       string
	GroupBackendConfig any
	// Spare makes this process a warm standby of its job (docs/spares.md):
	// it registers as a spare (a spare replica group registers each of
	// its ranks so, with its GroupSize), and its first Step waits —
	// costing the job no step — until the coordinator promotes it because
	// the job runs below its target size; it then heals from its peers
	// like a joining replica and returns from Step as a participant, with
	// EventPromoted. Do in New's caller what a replica does before its
	// first Step (model, optimizer, data loader) so that the promotion
	// costs no more than the heal. Once promoted it is a replica: a later
	// registration (after its lease lapsed) is not a spare's.
	Spare bool
	// Host is where this process runs, a placement hint for spares: the
	// coordinator promotes the spare on the host of the replica the job
	// lost first (its GPU is the one the death freed). Default: the
	// machine's host name.
	Host string
	// MinReplicas is the fewest replica groups a step may commit with; default 1.
	MinReplicas int
	// Timeout bounds each collective (comm.Options.Timeout); default 30 s.
	Timeout time.Duration
	// MaxCommitFailures is how many commits in a row may fail before
	// Commit returns ErrTooManyCommitFailures; default 10.
	MaxCommitFailures int
	// StallFactor and StallMin make the stall bound: StallFactor times the
	// slowest of this replica's last 64 steps (from one Step's return to
	// the next: compute, collectives, commit and the loop's own time
	// between steps), and at least StallMin. A step that waited that long
	// in its collectives (or its epoch's formation) for its peers, or that
	// this replica's loop has not taken for that long, is reported to the
	// coordinator, which leaves out at once a replica that does not step
	// while a peer waits for it — instead of after the collective's
	// Timeout — and lets it back when its loop steps again. A peer it
	// hears nothing from at all while it waits (a cut link) is blamed. The
	// bound is known after a few steps; a job whose loop pauses longer
	// than that now and then (an evaluation on some replicas only, a
	// checkpoint) raises StallMin above the pause. Defaults 10 and 1 s; a
	// negative StallFactor turns stall reports off.
	StallFactor float64
	StallMin    time.Duration
	// InitialStep is the committed step of the state this replica
	// registers: 0 for a model's initial state, or the step of a
	// checkpoint it restored. A job restarted against a coordinator that
	// kept its data continues its run from such a state; with no replica
	// holding any step of a run that reached one, Step fails with a
	// *StaleRunError rather than restart the run's history from 0.
	InitialStep int64
	// Secret authenticates the job's peers (backend handshakes and state
	// transfer).
	Secret []byte
	// RecoveryAddr is where this replica serves its committed state to
	// healing peers; default "127.0.0.1:0". Use a routable address across hosts.
	RecoveryAddr string
	// Heal tunes state transfer: chunk size (default 4 MiB) and parallel
	// streams per source (default recovery.DefaultStreams(): one per two
	// CPUs, 2–8).
	HealChunkSize, HealStreams int

	// Run names the run of the job this replica takes part in: one
	// training from step 0 (membership.RunRecord). Empty: the job's
	// current run, whichever it is — what a replica restarted into a
	// running job wants. A Run the job has not used yet starts a new run
	// (its commit records cleared) as soon as the job has no live member
	// (replicas of the previous run still registered are waited for, up
	// to three lease TTLs); a Run the job used before fails New with a
	// *membership.RunEndedError. Give every replica of one launch the
	// same new id (a launcher's job id, say); or leave it empty and start
	// the run with `ftcoord job new-run`.
	Run string

	// RankLeases gives every rank of a replica group its own etcd lease,
	// heartbeats and gossip node, as before group leases. By default
	// (GroupSize > 1 through Coordinator) the group shares one lease
	// (membership.MemberConfig.GroupLease): its leader renews it,
	// heartbeats and gossips; the other ranks link to the leader, which
	// removes a rank whose link ends, and take the lease over when the
	// leader's link ends.
	RankLeases bool

	// DurableCommit records every committed step in etcd before Commit
	// returns true (one transaction per replica group per step, written by
	// the group's rank 0 after the group's vote): a step one replica
	// reports committed is then never redone by another epoch, even across
	// a partition — replicas that lose such a step wait for one of its
	// holders instead of redoing it. Without it (the default) that rare
	// conflict is detected when the replicas meet again and reported as a
	// rollback (EventRolledBack, *RollbackError, ftcomm_ft_rollbacks_total).
	DurableCommit bool
	// SnapshotEvery turns on peer snapshots, fault tolerance for a replica
	// group whose shards have no copy in another group (an FSDP job whose
	// one group spans every GPU): every SnapshotEvery committed steps
	// (steps 0, K, 2K, …) each rank copies its registered state into its
	// own host memory and into its buddy's, a rank of the group on
	// another host, in the background of the next step. When a rank of
	// the group is replaced (its restarted process or a spare holds
	// nothing), the replacement restores the dead rank's state from its
	// buddy's copy and every other rank rolls back to the same snapshot
	// from its own (Step returns a *RollbackError there): the steps since
	// the newest complete snapshot are lost — up to SnapshotEvery, more
	// when copies take longer than that to reach the buddies (a snapshot
	// step is skipped while the previous one travels). See the package
	// doc, "Peer snapshots". 0: off. Needs GroupSize > 1; not with DurableCommit (a
	// restore discards committed steps, which DurableCommit promises
	// never to do).
	SnapshotEvery int
	// OnEvent, if set, is called from the training goroutine (inside Step
	// and Commit) with each reconfiguration, heal, rollback, sit-out and
	// failed commit. It must not call the Comm's Step, Commit, collectives
	// or Close (Close waits for the reconfiguration that calls it).
	OnEvent func(Event)
	// DisableHealthWatch turns off ft's watch of a device data backend's
	// GPU (comm.HealthWatcher): by default a critical fault (an XID, an
	// uncorrectable ECC error, a lost NVLink) reports this replica
	// Critical, which takes it out of the next quorum.
	DisableHealthWatch bool

	Logger     *zap.Logger
	Registerer prometheus.Registerer // default: none
}

// Validate reports what is wrong with c, or nil.
func (c *Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: ft: config: "+format, append([]any{comm.ErrInvalidArgument}, args...)...)
	}
	switch {
	case !membership.ValidName(c.Job):
		return bad("job %q: want 1–128 of [A-Za-z0-9._-]", c.Job)
	case !membership.ValidName(c.Group):
		return bad("group %q: want 1–128 of [A-Za-z0-9._-]", c.Group)
	case c.Run != "" && !membership.ValidName(c.Run):
		return bad("run %q: want 1–128 of [A-Za-z0-9._-]", c.Run)
	case c.Run != "" && c.Membership != nil:
		// ft would not pass it on: a Membership of the caller's was
		// registered (in its run) before New.
		return bad("run %q with a Membership of your own: its registration names the run (membership.MemberConfig.Run), not ft", c.Run)
	case c.GroupRank == AnyRank && (!c.Spare || c.GroupSize < 2 || c.Membership != nil):
		return bad("GroupRank AnyRank (a slot spare) needs Spare, GroupSize > 1 and the Coordinator (not a Membership of your own)")
	case c.GroupSize < 0 || (c.GroupRank < 0 && c.GroupRank != AnyRank) || (c.GroupSize > 0 && c.GroupRank >= c.GroupSize) || (c.GroupSize == 0 && c.GroupRank > 0):
		return bad("group rank %d outside [0, %d)", c.GroupRank, max(c.GroupSize, 1))
	case c.Membership == nil && len(c.Coordinator) == 0 && c.Credentials == "" && os.Getenv(membership.CredentialsEnv) == "":
		return bad("neither Coordinator endpoints, Credentials nor a Membership")
	case len(c.Secret) == 0:
		return bad("empty Secret (peers and state transfer must be authenticated)")
	case c.MinReplicas < 0:
		return bad("negative MinReplicas %d", c.MinReplicas)
	case c.Timeout < 0:
		return bad("negative Timeout %v", c.Timeout)
	case c.MaxCommitFailures < 0:
		return bad("negative MaxCommitFailures %d", c.MaxCommitFailures)
	case c.StallMin < 0 || c.InitialStep < 0:
		return bad("negative StallMin %v or InitialStep %d", c.StallMin, c.InitialStep)
	case c.HealChunkSize < 0 || c.HealStreams < 0:
		return bad("negative heal chunk size or streams")
	case c.SnapshotEvery < 0:
		return bad("negative SnapshotEvery %d", c.SnapshotEvery)
	case c.SnapshotEvery > 0 && c.GroupSize < 2:
		return bad("SnapshotEvery with GroupSize %d: peer snapshots keep a replica group's shards on its other ranks (replicas of one rank heal from each other)", c.GroupSize)
	case c.SnapshotEvery > 0 && c.DurableCommit:
		return bad("SnapshotEvery with DurableCommit: a snapshot restore rolls committed steps back, which DurableCommit promises never to do")
	case c.Device < 0:
		return bad("negative Device %d", c.Device)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.GroupSize == 0 {
		c.GroupSize = 1
	}
	if c.Backend == "" {
		c.Backend = "gloo"
	}
	if c.Host == "" {
		c.Host, _ = os.Hostname()
	}
	if c.MinReplicas == 0 {
		c.MinReplicas = 1
	}
	if c.Timeout == 0 {
		c.Timeout = 30 * time.Second
	}
	if c.MaxCommitFailures == 0 {
		c.MaxCommitFailures = 10
	}
	if c.StallFactor == 0 {
		c.StallFactor = DefaultStallFactor
	}
	if c.StallMin == 0 {
		c.StallMin = DefaultStallMin
	}
	if c.RecoveryAddr == "" {
		c.RecoveryAddr = "127.0.0.1:0"
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

func (c Config) fetchConfig() recovery.FetchConfig {
	f := recovery.DefaultFetchConfig(c.Job, c.Secret)
	if c.HealChunkSize > 0 {
		f.ChunkSize = c.HealChunkSize
	}
	if c.HealStreams > 0 {
		f.Streams = c.HealStreams
	}
	f.Logger = c.Logger
	return f
}
