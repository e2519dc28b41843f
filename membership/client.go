package membership

import (
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
)

// NewClient connects to the etcd endpoints (host:port) with the settings
// ftcomm uses everywhere: a 5 s dial timeout and keepalives that notice a
// dead server within seconds. lg nil: the client logs nothing.
func NewClient(endpoints []string, lg *zap.Logger) (*clientv3.Client, error) {
	return clientv3.New(ClientConfig(endpoints, lg))
}

// ClientConfig is the clientv3.Config NewClient uses; add TLS or
// credentials to it for a secured cluster (Credentials.ClientConfig
// does).
//
// Its connection backoff is short: gRPC's default grows to two minutes
// between attempts (15 s after a few), so a member started before its
// coordinator would join many seconds after etcd came up. Here attempts
// are at most ReconnectMaxDelay apart, so a client connects within about
// that long of etcd becoming reachable, and reconnects as fast after an
// etcd restart.
func ClientConfig(endpoints []string, lg *zap.Logger) clientv3.Config {
	if lg == nil {
		lg = zap.NewNop()
	}
	return clientv3.Config{
		Endpoints:            endpoints,
		DialTimeout:          5 * time.Second,
		DialKeepAliveTime:    2 * time.Second,
		DialKeepAliveTimeout: 2 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: grpcbackoff.Config{
				BaseDelay:  100 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   ReconnectMaxDelay,
			},
			MinConnectTimeout: 2 * time.Second,
		})},
		Logger: lg,
	}
}

// ReconnectMaxDelay is the longest wait between two connection attempts
// of a client made by ClientConfig.
const ReconnectMaxDelay = 500 * time.Millisecond
