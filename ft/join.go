package ft

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/cenkalti/backoff/v4"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/membership"
)

// etcdMember adapts *membership.Member to Membership: a job-level
// rendezvous store, and the etcd client closed with the member.
type etcdMember struct {
	*membership.Member
	store comm.Store
	cli   *clientv3.Client // owned: closed in Close
}

func (m *etcdMember) Store() comm.Store { return m.store }

func (m *etcdMember) Close() error {
	err := m.Member.Close()
	if m.cli != nil {
		m.cli.Close()
	}
	return err
}

// rendezvousRoot is where ft's comms rendezvous inside the job's
// rendezvous prefix. It sorts after the coordinator's per-epoch prefixes
// (digits), so the coordinator's clean-up of old epochs leaves it alone;
// ft deletes its own old epochs' keys.
const rendezvousRoot = "comm/"

// joinCoordinator connects to the coordinator's etcd and registers this
// rank as a new incarnation asking to take part.
func joinCoordinator(ctx context.Context, cfg Config, id, addr string) (Membership, error) {
	cli, err := connectCoordinator(ctx, cfg)
	if err != nil {
		return nil, err
	}
	m, err := registerWhenFree(ctx, cfg, cli, id, addr)
	if err != nil {
		cli.Close()
		return nil, err
	}
	m.cli = cli
	return m, nil
}

// claimSlot is a slot spare's registration (Config.GroupRank AnyRank): it
// waits until a rank of cfg.Group leaves a place free
// (membership.WaitVacancy) and registers in it, as that rank's restarted
// process would; when another process took the place first it waits for
// the next.
func claimSlot(ctx context.Context, cfg Config, addr string) (*etcdMember, int, error) {
	cli, err := connectCoordinator(ctx, cfg)
	if err != nil {
		return nil, -1, err
	}
	root := cfg.Member.Root
	if root == "" {
		root = membership.DefaultMemberConfig().Root
	}
	cfg.Logger.Info("slot spare: waiting for a rank of the group to leave a place free", zap.String("group", cfg.Group), zap.Int("size", cfg.GroupSize))
	seen := make([]bool, cfg.GroupSize) // what it saw registered, across its tries
	for {
		r, err := membership.WaitVacancy(ctx, cli, root, cfg.Job, cfg.Group, cfg.GroupSize, seen)
		if err != nil {
			cli.Close()
			return nil, -1, fmt.Errorf("ft: slot spare: %w", err)
		}
		c := cfg
		c.GroupRank, c.Spare = r, false
		id := memberID(cfg.Group, r)
		// A spare is built already: it asks to take part at once. So the
		// coordinator forms the group with it now, and should it die
		// before its first Step the group's formation blames it (its
		// closed port removes it) instead of waiting for it for ever:
		// ranks sharing the group's lease are watched through their
		// links to its leader, which a process killed right after it
		// registered never opened.
		m, err := registerIn(ctx, c, cli, id, addr, c.Run != "", true)
		if errors.Is(err, membership.ErrDuplicateMember) {
			// The winner holds the place now: it was seen registered.
			// Should it die before the next read, its place is free again
			// though nothing was deleted while this spare watched.
			seen[r] = true
			cfg.Logger.Info("slot spare: another process took the free place first; waiting for the next", zap.String("member", id))
			continue
		}
		if err != nil {
			cli.Close()
			return nil, -1, err
		}
		cfg.Logger.Info("slot spare: took the free place", zap.String("member", id))
		m.cli = cli
		return m, r, nil
	}
}

// connectCoordinator makes the etcd client of Config's coordinator.
func connectCoordinator(ctx context.Context, cfg Config) (*clientv3.Client, error) {
	creds, err := membership.LoadCredentialsOrEnv(cfg.Credentials) // nil: none
	if err != nil {
		return nil, fmt.Errorf("ft: %w", err)
	}
	ccfg, err := creds.ClientConfig(cfg.Coordinator, cfg.Logger.Named("etcd-client"))
	if err != nil {
		return nil, fmt.Errorf("ft: %w", err)
	}
	ccfg.Context = context.WithoutCancel(ctx)
	if cfg.EtcdTLS != nil {
		ccfg.TLS = cfg.EtcdTLS
	}
	if cfg.EtcdUsername != "" {
		ccfg.Username, ccfg.Password = cfg.EtcdUsername, cfg.EtcdPassword
	}
	cli, err := clientv3.New(ccfg)
	if err != nil {
		return nil, fmt.Errorf("ft: connect to coordinator %v: %w", cfg.Coordinator, err)
	}
	if path := credentialsPath(cfg); creds != nil && len(cfg.Coordinator) == 0 {
		// The endpoints come from the file: when they all fail, follow
		// the file (a coordinator restarted elsewhere rewrites it). Exits
		// when cli is closed.
		go creds.Follow(cli.Ctx(), cli, path, cfg.Logger)
	}
	return cli, nil
}

// credentialsPath is the credentials file Config names, or "".
func credentialsPath(cfg Config) string {
	if cfg.Credentials != "" {
		return cfg.Credentials
	}
	return os.Getenv(membership.CredentialsEnv)
}

// registerWhenFree registers, waiting while a previous incarnation of this
// member still holds the id: a replica restarted right after its process
// died finds its old registration alive until the old lease expires. It
// waits up to three lease TTLs (or ctx); a holder that keeps renewing is
// another live process with the same id, a configuration error.
func registerWhenFree(ctx context.Context, cfg Config, cli *clientv3.Client, id, addr string) (*etcdMember, error) {
	ttl := cfg.Member.LeaseTTL
	if ttl == 0 {
		ttl = membership.DefaultMemberConfig().LeaseTTL
	}
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 100*time.Millisecond, time.Second, 3*ttl
	var m *etcdMember
	logged := false
	err := backoff.Retry(func() error {
		var err error
		m, err = register(ctx, cfg, cli, id, addr)
		var dup *membership.DuplicateMemberError
		var busy *membership.RunBusyError
		switch {
		case errors.As(err, &dup):
			if !logged {
				logged = true
				cfg.Logger.Info("a previous incarnation still holds this member id; waiting for its lease to expire",
					zap.String("member", id), zap.Int64("incarnation", dup.Incarnation), zap.String("addr", dup.Addr),
					zap.Duration("up_to", 3*ttl))
			}
			return err
		case errors.As(err, &busy):
			// The previous run's replicas just stopped: their
			// registrations go when their leases expire.
			if !logged {
				logged = true
				cfg.Logger.Info("the job's previous run still has members; waiting for them to go before this run starts",
					zap.String("run", cfg.Run), zap.String("previous", busy.Current), zap.Strings("members", busy.Members),
					zap.Duration("up_to", 3*ttl))
			}
			return err
		}
		return backoff.Permanent(err)
	}, backoff.WithContext(b, ctx))
	return m, err
}

// register makes the membership.Member of this rank on cli, in the run
// cfg.Run names (starting it if new).
// The registration does not ask to take part yet: the first Step does
// (Comm.Step), so that the job is not held in a reconfiguration while this
// replica still builds its model and optimizer after New (seconds, for a
// PyTorch job) — the others train on, and it joins when it steps.
func register(ctx context.Context, cfg Config, cli *clientv3.Client, id, addr string) (*etcdMember, error) {
	return registerIn(ctx, cfg, cli, id, addr, cfg.Run != "", false)
}

// registerIn is register; start says whether a Run the job has not used
// yet may start, ask whether the registration asks to take part at once.
func registerIn(ctx context.Context, cfg Config, cli *clientv3.Client, id, addr string, start, ask bool) (*etcdMember, error) {
	mc := cfg.Member
	mc.Client, mc.Job, mc.ID, mc.Addr, mc.Group = cli, cfg.Job, id, addr, cfg.Group
	mc.Run, mc.StartRun = cfg.Run, start
	creds, err := membership.LoadCredentialsOrEnv(cfg.Credentials)
	if err != nil {
		return nil, fmt.Errorf("ft: %w", err)
	}
	creds.ApplyMember(&mc) // quorum verification and the gossip key; nil: none
	mc.WantQuorum = ask
	if mc.Step == 0 {
		mc.Step = cfg.InitialStep // the coordinator's history rule counts a restored state
	}
	mc.GroupLease = cfg.GroupSize > 1 && !cfg.RankLeases
	mc.GroupSize = cfg.GroupSize // the coordinator admits the group's ranks together
	mc.Spare, mc.Host = cfg.Spare, cfg.Host
	if mc.MinReplicas == 0 {
		mc.MinReplicas = cfg.MinReplicas * cfg.GroupSize
	}
	if mc.Logger == nil {
		mc.Logger = cfg.Logger
	}
	mem, err := membership.Join(ctx, mc)
	if err != nil {
		return nil, fmt.Errorf("ft: register %s with the coordinator: %w", id, err)
	}
	keys := etcdkeys.Layout{Root: mc.Root}
	return &etcdMember{Member: mem, store: membership.NewStore(cli, keys.Rendezvous(cfg.Job)+rendezvousRoot)}, nil
}

// registerAgain registers this rank again, as a new incarnation, after its
// registration m ended, with the step m last reported: in m's run only,
// which it never starts (its state is that run's), so a run that ended
// meanwhile fails it with a *membership.RunEndedError.
func (m *etcdMember) registerAgain(ctx context.Context, cfg Config, id, addr string) (*etcdMember, error) {
	cfg.Run = m.Run()
	// The step the rank holds goes with the new registration: a new
	// incarnation is a joiner to the coordinator's history rule, which
	// counts it as holding the job's step only when it reports it.
	cfg.Member.Step = max(cfg.Member.Step, m.Record().Step)
	return registerIn(ctx, cfg, m.cli, id, addr, false, true) // its loop steps already
}
