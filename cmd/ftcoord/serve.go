package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/ftcomm/ftcomm/membership"
)

func newLogger(level string, w io.Writer) *zap.Logger {
	var lvl zapcore.Level
	_ = lvl.Set(level)
	enc := zap.NewProductionEncoderConfig()
	enc.EncodeTime = zapcore.ISO8601TimeEncoder
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.AddSync(w), lvl)
	return zap.New(core)
}

// serve runs a coordinator instance until ctx ends (SIGTERM/SIGINT in
// main), then shuts down gracefully.
func serve(ctx context.Context, cfg serveConfig, stderr io.Writer) error {
	lg := newLogger(cfg.LogLevel, stderr).With(zap.String("instance", cfg.Name))
	defer lg.Sync()
	token, err := cfg.token()
	if err != nil {
		return err
	}

	// etcd: embedded single node by default, else the given cluster.
	var endpoints []string
	var embedded *membership.Embedded
	if cfg.Etcd == "" {
		ec := membership.DefaultEmbeddedConfig()
		ec.Dir, ec.Name, ec.Logger = cfg.DataDir, cfg.Name, lg
		if !strings.HasSuffix(cfg.EtcdClientAddr, ":0") {
			ec.ClientAddr = cfg.EtcdClientAddr
		}
		if !strings.HasSuffix(cfg.EtcdPeerAddr, ":0") {
			ec.PeerAddr = cfg.EtcdPeerAddr
		}
		sctx, cancel := context.WithTimeout(ctx, time.Minute)
		embedded, err = membership.StartEmbedded(sctx, ec)
		cancel()
		if err != nil {
			return err
		}
		defer embedded.Close()
		endpoints = embedded.Endpoints()
		lg.Info("embedded etcd running", zap.Strings("endpoints", endpoints), zap.String("data-dir", cfg.DataDir))
	} else {
		for _, ep := range strings.Split(cfg.Etcd, ",") {
			endpoints = append(endpoints, strings.TrimSpace(ep))
		}
	}
	ccfg := membership.ClientConfig(endpoints, lg.Named("etcd-client").WithOptions(zap.IncreaseLevel(zapcore.WarnLevel)))
	if cfg.EtcdCACert != "" || cfg.EtcdCert != "" {
		ti := transport.TLSInfo{CertFile: cfg.EtcdCert, KeyFile: cfg.EtcdKey, TrustedCAFile: cfg.EtcdCACert}
		tc, err := ti.ClientConfig()
		if err != nil {
			return fmt.Errorf("etcd TLS: %w", err)
		}
		ccfg.TLS = tc
	}
	ccfg.Username, ccfg.Password = cfg.EtcdUser, cfg.EtcdPassword
	cli, err := clientv3.New(ccfg)
	if err != nil {
		return fmt.Errorf("etcd client: %w", err)
	}
	defer cli.Close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	cc := membership.DefaultCoordinatorConfig()
	cc.Client, cc.Root, cc.Name = cli, cfg.Root, cfg.Name
	cc.Quorum = membership.QuorumConfig{MinReplicas: cfg.MinReplicas, JoinTimeout: cfg.JoinTimeout}
	cc.SessionTTL, cc.HistoryLimit = cfg.SessionTTL, cfg.History
	cc.Logger, cc.Registerer = lg, reg
	if cfg.Gossip {
		g, _ := cfg.gossipConfig()
		g.Logger = lg.Named("gossip").WithOptions(zap.IncreaseLevel(zapcore.WarnLevel))
		cc.Gossip = &g
	}
	coord, err := membership.NewCoordinator(cc)
	if err != nil {
		return err
	}

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen %s: %w", cfg.Listen, err)
	}
	scheme := "http"
	srv := &http.Server{
		Handler:           (&api{admin: membership.NewAdmin(cli, cfg.Root), coord: coord, cli: cli, token: token, gatherer: reg, lg: lg}).handler(),
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          zap.NewStdLog(lg.Named("http")),
	}
	if cfg.TLSCert != "" {
		cert, err := tls.LoadX509KeyPair(cfg.TLSCert, cfg.TLSKey)
		if err != nil {
			ln.Close()
			return fmt.Errorf("TLS certificate: %w", err)
		}
		srv.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
		ln = tls.NewListener(ln, srv.TLSConfig)
		scheme = "https"
	}
	url := fmt.Sprintf("%s://%s", scheme, ln.Addr())
	if cfg.AddrFile != "" {
		if err := writeFileAtomic(cfg.AddrFile, []byte(url+"\n")); err != nil {
			ln.Close()
			return err
		}
	}
	lg.Info("serving", zap.String("url", url), zap.Bool("token", token != ""), zap.Bool("gossip", cfg.Gossip))

	runCtx, stopCoord := context.WithCancel(ctx)
	defer stopCoord()
	coordDone := make(chan error, 1)
	go func() { coordDone <- coord.Run(runCtx) }()
	httpDone := make(chan error, 1)
	go func() { httpDone <- srv.Serve(ln) }()

	var runErr error
	select {
	case <-ctx.Done():
		lg.Info("shutting down")
	case err := <-httpDone:
		runErr = fmt.Errorf("http server: %w", err)
	case err := <-coordDone:
		runErr = fmt.Errorf("coordinator: %w", err)
		coordDone <- err
	}
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownTimeout)
	defer cancel()
	stopCoord() // resigns leadership so a standby takes over at once
	select {
	case <-coordDone:
	case <-sctx.Done():
		lg.Warn("coordinator did not stop in time")
	}
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		lg.Warn("http shutdown", zap.Error(err))
	}
	lg.Info("stopped")
	return runErr
}

func writeFileAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
