package ft

import (
	"context"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"

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
	m, err := register(ctx, cfg, cli, id, addr)
	if err != nil {
		cli.Close()
		return nil, err
	}
	m.cli = cli
	return m, nil
}

// register makes the membership.Member of this rank on cli.
func register(ctx context.Context, cfg Config, cli *clientv3.Client, id, addr string) (*etcdMember, error) {
	mc := cfg.Member
	mc.Client, mc.Job, mc.ID, mc.Addr, mc.Group = cli, cfg.Job, id, addr, cfg.Group
	creds, err := membership.LoadCredentialsOrEnv(cfg.Credentials)
	if err != nil {
		return nil, fmt.Errorf("ft: %w", err)
	}
	creds.ApplyMember(&mc) // quorum verification and the gossip key; nil: none
	mc.WantQuorum = true
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
	keys := membership.Keys{Root: mc.Root}
	return &etcdMember{Member: mem, store: membership.NewStore(cli, keys.Rendezvous(cfg.Job)+rendezvousRoot)}, nil
}
