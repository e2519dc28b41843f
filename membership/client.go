package membership

import (
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/internal/etcdclient"
)

// NewClient connects to the etcd endpoints (host:port) with the settings
// ftcomm uses everywhere: a 5 s dial timeout, keepalives that notice a
// dead server within seconds, reconnection attempts at most
// ReconnectMaxDelay apart. lg nil: the client logs nothing; otherwise it
// logs at Info and above, without its per-attempt retry lines.
func NewClient(endpoints []string, lg *zap.Logger) (*clientv3.Client, error) {
	return etcdclient.NewClient(endpoints, lg)
}

// ClientConfig is the clientv3.Config NewClient uses; add TLS or
// credentials to it for a secured cluster (Credentials.ClientConfig
// does).
func ClientConfig(endpoints []string, lg *zap.Logger) clientv3.Config {
	return etcdclient.ClientConfig(endpoints, lg)
}

// ReconnectMaxDelay is the longest wait between two connection attempts
// of a client made by ClientConfig.
const ReconnectMaxDelay = etcdclient.ReconnectMaxDelay

// MaxRequestBytes is the largest request ftcomm sends etcd: etcd's
// default --max-request-bytes (1.5 MiB), which ftcomm's etcd keeps (see
// etcdclient.MaxRequestBytes for what fills it).
const MaxRequestBytes = etcdclient.MaxRequestBytes
