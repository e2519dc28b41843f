package etcdhost

import (
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/internal/etcdclient"
)

// Access is what a client needs to reach an etcd server as one of its
// users: the endpoints, the key root, and on a Secure server the CA that
// signs the server's certificate and the user's client certificate and
// key (PEM). It is the etcd part of a trainer's membership.Credentials,
// which this package does not import: the member client does not link
// the etcd server, and the etcd host knows nothing of members.
type Access struct {
	Endpoints []string
	Root      string
	CACert    string
	Cert      string
	Key       string
}

// NewClient connects as this user, with the client settings every ftcomm
// process uses (membership.ClientConfig). lg nil: it logs nothing.
func (a *Access) NewClient(lg *zap.Logger) (*clientv3.Client, error) {
	cfg := etcdclient.ClientConfig(a.Endpoints, lg)
	tc, err := etcdclient.TLS(a.CACert, a.Cert, a.Key)
	if err != nil {
		return nil, fmt.Errorf("%w: etcdhost: access: %v", comm.ErrInvalidArgument, err)
	}
	cfg.TLS = tc
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("etcdhost: connect to %v: %w", cfg.Endpoints, err)
	}
	return cli, nil
}
