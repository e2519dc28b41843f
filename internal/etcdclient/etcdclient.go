// Package etcdclient holds the etcd client settings every ftcomm process
// uses: members (package membership), coordinators and the etcd host's own
// clients (package etcdhost). It is apart from both so that the etcd host
// need not import the member client, nor the member client the etcd
// server; membership re-exports NewClient, ClientConfig, ReconnectMaxDelay
// and MaxRequestBytes for the module's users.
package etcdclient

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc"
	grpcbackoff "google.golang.org/grpc/backoff"
)

// NewClient connects to the etcd endpoints (host:port) with the settings
// ftcomm uses everywhere: a 5 s dial timeout and keepalives that notice a
// dead server within seconds. lg nil: the client logs nothing (see
// ClientConfig for what it logs otherwise).
func NewClient(endpoints []string, lg *zap.Logger) (*clientv3.Client, error) {
	return clientv3.New(ClientConfig(endpoints, lg))
}

// ClientConfig is the clientv3.Config NewClient uses; add TLS or
// credentials to it for a secured cluster (membership's
// Credentials.ClientConfig does).
//
// Its connection backoff is short: gRPC's default grows to two minutes
// between attempts (15 s after a few), so a member started before its
// coordinator would join many seconds after etcd came up. Here attempts
// are at most ReconnectMaxDelay apart, so a client connects within about
// that long of etcd becoming reachable, and reconnects as fast after an
// etcd restart.
//
// The client logs to lg at Info and above, without its per-attempt retry
// lines ("retrying of unary invoker", one or two for every attempt of
// every call while etcd is away): a member says what it waits for once
// every few seconds instead, and a call that gives up returns its error.
func ClientConfig(endpoints []string, lg *zap.Logger) clientv3.Config {
	if lg == nil {
		lg = zap.NewNop()
	}
	lg = lg.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core { return clientLogCore{c} }))
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
		// A coordinator's publication of a large job's epoch is one
		// transaction: see MaxRequestBytes.
		MaxCallSendMsgSize: MaxRequestBytes + 512<<10,
		Logger:             lg,
	}
}

// ReconnectMaxDelay is the longest wait between two connection attempts
// of a client made by ClientConfig.
const ReconnectMaxDelay = 500 * time.Millisecond

// MaxRequestBytes is the largest request ftcomm sends etcd: etcd's
// default --max-request-bytes (1.5 MiB), which ftcomm's etcd keeps. The
// coordinator publishes an epoch in one transaction holding the quorum
// record and its history entry (the whole list, packed and compressed:
// about 2.3 bytes per participant with sequential ids, at most about 7)
// and the view members watch: about 0.7 MB for a job of 100,000
// participants. (Before, the record was JSON of ~97 bytes per participant
// and etcd had to accept 8 MiB.) A deployment may still raise etcd's
// limit (etcdhost.EmbeddedConfig.MaxRequestBytes, --max-request-bytes).
const MaxRequestBytes = 3 << 19

// clientLogCore passes on the etcd client's logs at Info and above but
// its retry lines.
type clientLogCore struct{ zapcore.Core }

func (c clientLogCore) Enabled(l zapcore.Level) bool {
	return l >= zapcore.InfoLevel && c.Core.Enabled(l)
}

func (c clientLogCore) With(fields []zapcore.Field) zapcore.Core {
	return clientLogCore{c.Core.With(fields)}
}

func (c clientLogCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if e.Level < zapcore.InfoLevel || strings.HasPrefix(e.Message, "retrying of unary invoker") {
		return ce
	}
	return c.Core.Check(e, ce)
}

// TLS is the client TLS configuration for a CA and a client certificate
// and key, all PEM (nil, nil when both the CA and the certificate are
// empty). Its errors say which part is bad; callers mark them as invalid
// arguments.
func TLS(caPEM, certPEM, keyPEM string) (*tls.Config, error) {
	if caPEM == "" && certPEM == "" {
		return nil, nil
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if caPEM != "" {
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM([]byte(caPEM)) {
			return nil, errors.New("caCert holds no PEM certificate")
		}
		tc.RootCAs = pool
	}
	if certPEM != "" {
		cert, err := tls.X509KeyPair([]byte(certPEM), []byte(keyPEM))
		if err != nil {
			return nil, fmt.Errorf("client certificate: %v", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}
