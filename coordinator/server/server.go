package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

// Config configures a coordinator service. Start from DefaultConfig: its
// zero value turns gossip off and has no data directory.
type Config struct {
	// Listen is the HTTP host:port of the API, dashboard and metrics
	// (port 0: a free one).
	Listen string
	// Advertise is the host:port others reach the API at, when it differs
	// from the listener's (a listener on 0.0.0.0, behind NAT): URL and
	// GET /api/v1/coordinator give it (port 0: the bound port).
	Advertise string
	// TLSCert and TLSKey are PEM files: the API is served over HTTPS.
	TLSCert, TLSKey string
	// Token, when set, is the bearer token the API and /metrics demand.
	Token string

	// Etcd lists the endpoints (host:port) of an external etcd cluster;
	// empty: an embedded single-node etcd keeps its data in DataDir.
	Etcd []string
	// DataDir holds the embedded etcd's data and its certificates (pki/),
	// the coordinator's secrets and the trainers' credentials file. With
	// an external etcd it holds the last two.
	DataDir string
	// EtcdClientAddr and EtcdPeerAddr are where the embedded etcd listens
	// (port 0: the port of its last start on DataDir, which the trainers'
	// credentials name, else a free one; see etcdhost.EmbeddedConfig).
	EtcdClientAddr, EtcdPeerAddr string
	// EtcdAdvertiseAddr is the host:port trainers reach the embedded etcd
	// at, written into their credentials (default: EtcdClientAddr, or
	// this host's name when that listens on all addresses).
	EtcdAdvertiseAddr string
	// EtcdCertHosts are more names and addresses the embedded etcd's
	// server certificate covers (trainers may connect through them).
	EtcdCertHosts []string
	// EtcdCACert, EtcdCert and EtcdKey (files) and EtcdUser and
	// EtcdPassword reach a secured external etcd.
	EtcdCACert, EtcdCert, EtcdKey string
	EtcdUser, EtcdPassword        string
	// TrainerEtcdCert, TrainerEtcdKey (files), TrainerEtcdUser and
	// TrainerEtcdPassword are the trainers' identity on an external etcd,
	// written into their credentials file with EtcdCACert.
	TrainerEtcdCert, TrainerEtcdKey      string
	TrainerEtcdUser, TrainerEtcdPassword string
	// UnsafeNoFsync skips the embedded etcd's fsyncs: for tests and demos
	// whose data may be lost.
	UnsafeNoFsync bool

	// Insecure turns the protection of the jobs off: the embedded etcd
	// serves plain TCP without authentication, quorums are not signed,
	// and gossip is not encrypted unless Gossip.SecretKey is set. Anyone
	// who reaches etcd's port can then rewrite every job: for local
	// experiments only. Off (the default), the embedded etcd serves TLS
	// with client certificates and etcd's roles, quorums are signed, and
	// gossip is encrypted; trainers get what they need in one file
	// (CredentialsPath).
	Insecure bool
	// SecretsFile holds the coordinator's quorum-signing and gossip keys
	// (created on first start; default <DataDir>/coordinator-secrets.json).
	// Coordinators of one root must share it.
	SecretsFile string
	// CredentialsFile is where the trainers' credentials are written
	// (default <DataDir>/trainer-credentials.json).
	CredentialsFile string

	// Root is the etcd key prefix of every job.
	Root string
	// Name tells coordinator instances apart.
	Name string
	// Quorum holds the default rules of every job.
	Quorum quorum.Config
	// SessionTTL: a dead leader is replaced about this long after it
	// stops (≥ 2 s).
	SessionTTL time.Duration
	// HistoryLimit is how many past quorums each job keeps.
	HistoryLimit int
	// Gossip makes the coordinator a gossip node (nil: off).
	Gossip *membership.GossipConfig
	// EvictKeepOut is how long an evicted member may not register again
	// (an eviction request may say otherwise; zero: the default; negative:
	// not at all).
	EvictKeepOut time.Duration

	// ReadHeaderTimeout, ReadTimeout, WriteTimeout and IdleTimeout bound
	// each HTTP connection (http.Server's fields of those names), so that
	// slow or idle clients cannot hold the server's goroutines; zero:
	// DefaultConfig's.
	ReadHeaderTimeout, ReadTimeout, WriteTimeout, IdleTimeout time.Duration

	// ShutdownTimeout bounds a graceful shutdown.
	ShutdownTimeout time.Duration
	// Version and Revision label the metric ftcomm_coordinator_build_info
	// (empty: "unknown").
	Version, Revision string
	// Logger (nil: none).
	Logger *zap.Logger
}

// DefaultConfig returns what `ftcoord serve` runs with no flags: the API
// on 127.0.0.1:8080, an embedded etcd in ./ftcoord-data on loopback ports
// (free ones at the first start, the same ones after), gossip on.
func DefaultConfig() Config {
	cc := coordinator.DefaultConfig()
	g := membership.DefaultGossipConfig()
	return Config{
		Listen:          "127.0.0.1:8080",
		DataDir:         "./ftcoord-data",
		EtcdClientAddr:  "127.0.0.1:0",
		EtcdPeerAddr:    "127.0.0.1:0",
		Root:            cc.Root,
		Name:            cc.Name,
		Quorum:          cc.Quorum,
		SessionTTL:      cc.SessionTTL,
		HistoryLimit:    cc.HistoryLimit,
		Gossip:          &g,
		EvictKeepOut:    cc.EvictKeepOut,
		ShutdownTimeout: 10 * time.Second,

		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       60 * time.Second,
	}
}

// Validate says what is wrong with the configuration, all at once.
func (c Config) Validate() error {
	var probs []string
	bad := func(f string, a ...any) { probs = append(probs, fmt.Sprintf(f, a...)) }
	hostPort := func(what, v string) {
		if _, _, err := net.SplitHostPort(v); err != nil {
			bad("%s %q is not host:port", what, v)
		}
	}
	hostPort("listen address", c.Listen)
	if c.Advertise != "" {
		hostPort("advertised API address", c.Advertise)
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		bad("the TLS certificate and key go together")
	}
	if len(c.Etcd) == 0 {
		if c.DataDir == "" {
			bad("the embedded etcd needs a data directory")
		}
		hostPort("embedded etcd client address", c.EtcdClientAddr)
		hostPort("embedded etcd peer address", c.EtcdPeerAddr)
		if c.EtcdAdvertiseAddr != "" {
			hostPort("embedded etcd advertised address", c.EtcdAdvertiseAddr)
		}
		if c.EtcdCACert != "" || c.EtcdCert != "" || c.EtcdUser != "" || c.TrainerEtcdCert != "" || c.TrainerEtcdUser != "" {
			bad("the etcd CA, certificates and users apply to an external etcd")
		}
	} else {
		if c.DataDir == "" && !c.Insecure && (c.SecretsFile == "" || c.CredentialsFile == "") {
			bad("a data directory (or the secrets and credentials files) is needed for the coordinator's keys")
		}
		if c.EtcdAdvertiseAddr != "" || len(c.EtcdCertHosts) > 0 {
			bad("the advertised address and certificate hosts apply to the embedded etcd")
		}
		for _, ep := range c.Etcd {
			hostPort("etcd endpoint", strings.TrimPrefix(strings.TrimPrefix(ep, "http://"), "https://"))
		}
	}
	if (c.EtcdCert == "") != (c.EtcdKey == "") {
		bad("the etcd client certificate and key go together")
	}
	if c.EtcdPassword != "" && c.EtcdUser == "" {
		bad("an etcd password needs an etcd user")
	}
	if (c.TrainerEtcdCert == "") != (c.TrainerEtcdKey == "") {
		bad("the trainers' etcd certificate and key go together")
	}
	if c.TrainerEtcdPassword != "" && c.TrainerEtcdUser == "" {
		bad("the trainers' etcd password needs a user")
	}
	if !strings.HasPrefix(c.Root, "/") {
		bad("root %q must start with /", c.Root)
	}
	if !membership.ValidName(c.Name) {
		bad("name %q: want 1–128 of [A-Za-z0-9._-]", c.Name)
	}
	if err := c.Quorum.Validate(); err != nil {
		bad("%v", err)
	}
	if c.SessionTTL < 2*time.Second {
		bad("session TTL %v is below etcd's minimum of 2s", c.SessionTTL)
	}
	if c.HistoryLimit < 1 {
		bad("history limit %d must be at least 1", c.HistoryLimit)
	}
	if c.Gossip != nil {
		if err := c.Gossip.Validate(); err != nil {
			bad("%v", err)
		}
	}
	if c.ShutdownTimeout <= 0 {
		bad("shutdown timeout %v must be positive", c.ShutdownTimeout)
	}
	if c.ReadHeaderTimeout < 0 || c.ReadTimeout < 0 || c.WriteTimeout < 0 || c.IdleTimeout < 0 {
		bad("HTTP timeouts must not be negative")
	}
	if len(probs) > 0 {
		return fmt.Errorf("%w: ftcoord: invalid configuration:\n  %s", comm.ErrInvalidArgument, strings.Join(probs, "\n  "))
	}
	return nil
}

// Server is a running coordinator service: etcd (embedded or a client of
// an external one), a coordinator.Coordinator, and the HTTP API,
// dashboard and metrics. Create with New, run with Serve.
type Server struct {
	cfg      Config
	lg       *zap.Logger
	embedded *etcdhost.Embedded
	cli      *clientv3.Client
	coord    *coordinator.Coordinator
	reg      *prometheus.Registry
	ln       net.Listener
	srv      *http.Server
	url      string
	creds    string // the trainers' credentials file

	serveOnce   sync.Once
	stop        context.CancelFunc // ends Serve
	stopCtx     context.Context
	served      chan struct{} // closed when Serve returned
	releaseOnce sync.Once
	released    chan struct{} // closed when release is done
}

// New starts etcd (when embedded), connects to it, prepares the
// coordinator and binds the HTTP listener; Serve runs them. On error
// everything New started is stopped.
func New(ctx context.Context, cfg Config) (_ *Server, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	s := &Server{cfg: cfg, lg: lg, served: make(chan struct{}), released: make(chan struct{})}
	s.stopCtx, s.stop = context.WithCancel(context.Background())
	defer func() {
		if err != nil {
			<-s.releaseAsync()
		}
	}()

	secure := !cfg.Insecure
	if cfg.DataDir != "" {
		if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
			return nil, fmt.Errorf("ftcoord: data directory: %w", err)
		}
	}
	var signer *coordinator.QuorumSigner
	var gossipKey []byte
	if secure {
		path := cfg.SecretsFile
		if path == "" {
			path = filepath.Join(cfg.DataDir, "coordinator-secrets.json")
		}
		secrets, created, err := coordinator.LoadOrCreateSecrets(path)
		if err != nil {
			return nil, err
		}
		if signer, err = secrets.Signer(); err != nil {
			return nil, err
		}
		gossipKey = secrets.GossipKey
		lg.Info("coordinator secrets", zap.String("file", path), zap.Bool("created", created), zap.String("quorum key", signer.KeyID()))
	} else {
		lg.Warn("INSECURE: -insecure is set: etcd serves plain TCP without authentication, quorums are not signed" +
			" and gossip is not encrypted unless -gossip-key is given; anyone who reaches etcd's port can rewrite every job." +
			" Use it for local experiments only.")
	}
	if cfg.Gossip != nil && len(cfg.Gossip.SecretKey) > 0 {
		gossipKey = cfg.Gossip.SecretKey
	}

	var ccfg clientv3.Config
	clientLog := lg.Named("etcd-client").WithOptions(zap.IncreaseLevel(zapcore.WarnLevel))
	var trainer *membership.Credentials
	if len(cfg.Etcd) == 0 {
		ec := etcdhost.DefaultEmbeddedConfig()
		ec.Dir, ec.Name, ec.Logger = cfg.DataDir, cfg.Name, lg
		ec.UnsafeNoFsync = cfg.UnsafeNoFsync
		ec.Secure, ec.CertHosts, ec.AdvertiseClientAddr, ec.Root = secure, cfg.EtcdCertHosts, cfg.EtcdAdvertiseAddr, cfg.Root
		ec.ClientAddr, ec.PeerAddr = cfg.EtcdClientAddr, cfg.EtcdPeerAddr
		sctx, cancel := context.WithTimeout(ctx, time.Minute)
		s.embedded, err = etcdhost.StartEmbedded(sctx, ec)
		cancel()
		if err != nil {
			return nil, err
		}
		lg.Info("embedded etcd running", zap.Strings("endpoints", s.embedded.Endpoints()), zap.String("data-dir", cfg.DataDir),
			zap.Bool("tls", s.embedded.Secure()))
		own, err := s.embedded.Access(etcdhost.UserCoordinator)
		if err != nil {
			return nil, err
		}
		if ccfg, err = credentialsOf(own).ClientConfig(nil, clientLog); err != nil {
			return nil, err
		}
		ta, err := s.embedded.Access(etcdhost.UserTrainer)
		if err != nil {
			return nil, err
		}
		trainer = credentialsOf(ta)
	} else {
		var endpoints []string
		for _, ep := range cfg.Etcd {
			endpoints = append(endpoints, strings.TrimSpace(ep))
		}
		ccfg = membership.ClientConfig(endpoints, clientLog)
		if cfg.EtcdCACert != "" || cfg.EtcdCert != "" {
			ti := transport.TLSInfo{CertFile: cfg.EtcdCert, KeyFile: cfg.EtcdKey, TrustedCAFile: cfg.EtcdCACert}
			tc, err := ti.ClientConfig()
			if err != nil {
				return nil, fmt.Errorf("ftcoord: etcd TLS: %w", err)
			}
			ccfg.TLS = tc
		}
		ccfg.Username, ccfg.Password = cfg.EtcdUser, cfg.EtcdPassword
		if trainer, err = externalTrainerCredentials(cfg, endpoints); err != nil {
			return nil, err
		}
		if secure && ccfg.TLS == nil && ccfg.Username == "" {
			lg.Warn("the external etcd is reached without TLS or credentials: if its port is reachable, anyone can rewrite every job" +
				" (members still ignore quorums not signed by this coordinator's key)")
		}
	}
	if s.cli, err = connectEtcd(ctx, ccfg, lg); err != nil {
		return nil, fmt.Errorf("ftcoord: etcd client: %w", err)
	}
	if cfg.DataDir != "" || cfg.CredentialsFile != "" {
		s.creds = cfg.CredentialsFile
		if s.creds == "" {
			s.creds = filepath.Join(cfg.DataDir, "trainer-credentials.json")
		}
		if signer != nil {
			trainer.QuorumKeys = []membership.QuorumKey{signer.PublicKey()}
		}
		trainer.GossipKey = gossipKey
		if err := membership.WriteCredentials(s.creds, trainer); err != nil {
			return nil, err
		}
		lg.Info("trainer credentials written: give trainers this file ("+membership.CredentialsEnv+"=<file>, or ft.Config.Credentials)",
			zap.String("file", s.creds), zap.Strings("endpoints", trainer.Endpoints), zap.Bool("tls", trainer.CACert != ""),
			zap.Bool("signed quorums", signer != nil), zap.Bool("gossip key", len(gossipKey) > 0))
	}

	s.reg = prometheus.NewRegistry()
	s.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		collectors.NewBuildInfoCollector(), buildInfo(cfg.Version, cfg.Revision))
	cc := coordinator.DefaultConfig()
	cc.Client, cc.Root, cc.Name = s.cli, cfg.Root, cfg.Name
	cc.Quorum, cc.SessionTTL, cc.HistoryLimit = cfg.Quorum, cfg.SessionTTL, cfg.HistoryLimit
	cc.Logger, cc.Registerer = lg, s.reg
	cc.QuorumSigner, cc.EvictKeepOut = signer, cfg.EvictKeepOut
	if cfg.Gossip != nil {
		g := *cfg.Gossip
		if g.Logger == nil {
			g.Logger = lg.Named("gossip").WithOptions(zap.IncreaseLevel(zapcore.WarnLevel))
		}
		g.SecretKey = gossipKey
		cc.Gossip = &g
	}
	if s.coord, err = coordinator.New(cc); err != nil {
		return nil, err
	}

	if s.ln, err = net.Listen("tcp", cfg.Listen); err != nil {
		return nil, fmt.Errorf("ftcoord: listen %s: %w", cfg.Listen, err)
	}
	scheme := "http"
	keepOut := cfg.EvictKeepOut
	if keepOut == 0 {
		keepOut = coordinator.DefaultEvictKeepOut
	}
	a := &api{admin: coordinator.NewAdmin(s.cli, cfg.Root), coord: s.coord, cli: s.cli, token: cfg.Token, gatherer: s.reg, lg: lg,
		keepOut: max(keepOut, 0), version: cfg.Version,
		healthKey: strings.TrimSuffix(cfg.Root, "/") + "/_health"}
	d := DefaultConfig()
	or := func(v, def time.Duration) time.Duration {
		if v > 0 {
			return v
		}
		return def
	}
	s.srv = &http.Server{
		Handler:           a.handler(),
		ReadHeaderTimeout: or(cfg.ReadHeaderTimeout, d.ReadHeaderTimeout),
		ReadTimeout:       or(cfg.ReadTimeout, d.ReadTimeout),
		WriteTimeout:      or(cfg.WriteTimeout, d.WriteTimeout),
		IdleTimeout:       or(cfg.IdleTimeout, d.IdleTimeout),
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          zap.NewStdLog(lg.Named("http")),
	}
	if cfg.TLSCert != "" {
		cert, err := tls.LoadX509KeyPair(cfg.TLSCert, cfg.TLSKey)
		if err != nil {
			return nil, fmt.Errorf("ftcoord: TLS certificate: %w", err)
		}
		s.srv.TLSConfig = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
		s.ln = tls.NewListener(s.ln, s.srv.TLSConfig)
		scheme = "https"
	}
	s.url = fmt.Sprintf("%s://%s", scheme, advertisedAddr(cfg.Advertise, s.ln.Addr()))
	a.url = s.url
	if host, _, _ := net.SplitHostPort(cfg.Listen); cfg.Token == "" && !isLoopback(host) {
		lg.Warn("the API listens beyond this host without a token: anyone who reaches it can evict members (set a token)",
			zap.String("listen", cfg.Listen))
	}
	return s, nil
}

// buildInfo is the constant metric ftcomm_coordinator_build_info: 1,
// labelled with what runs (Prometheus's build-info convention).
func buildInfo(version, revision string) prometheus.Collector {
	or := func(s string) string {
		if s == "" {
			return "unknown"
		}
		return s
	}
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name:        "ftcomm_coordinator_build_info",
		Help:        "1, labelled with the version, VCS revision and Go version of the running ftcoord.",
		ConstLabels: prometheus.Labels{"version": or(version), "revision": or(revision), "goversion": runtime.Version()},
	})
	g.Set(1)
	return g
}

// advertisedAddr is the API's address as others reach it: advertise
// (its port 0 replaced by the bound one), or the bound address.
func advertisedAddr(advertise string, bound net.Addr) string {
	if advertise == "" {
		return bound.String()
	}
	host, port, _ := net.SplitHostPort(advertise)
	if port == "0" {
		if a, ok := bound.(*net.TCPAddr); ok {
			port = fmt.Sprint(a.Port)
		}
	}
	return net.JoinHostPort(host, port)
}

// isLoopback reports whether host names this machine only.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// credentialsOf are the member credentials that carry an embedded etcd's
// access for one of its users.
func credentialsOf(a *etcdhost.Access) *membership.Credentials {
	return &membership.Credentials{Version: membership.CredentialsVersion, Endpoints: a.Endpoints, Root: a.Root,
		CACert: a.CACert, Cert: a.Cert, Key: a.Key}
}

// externalTrainerCredentials are the trainers' credentials for an
// external etcd: its endpoints and CA, and the trainers' identity given
// in the configuration.
func externalTrainerCredentials(cfg Config, endpoints []string) (*membership.Credentials, error) {
	c := &membership.Credentials{Version: membership.CredentialsVersion, Endpoints: endpoints, Root: cfg.Root,
		User: cfg.TrainerEtcdUser, Password: cfg.TrainerEtcdPassword}
	for _, f := range []struct {
		path string
		to   *string
	}{{cfg.EtcdCACert, &c.CACert}, {cfg.TrainerEtcdCert, &c.Cert}, {cfg.TrainerEtcdKey, &c.Key}} {
		if f.path == "" {
			continue
		}
		b, err := os.ReadFile(f.path)
		if err != nil {
			return nil, fmt.Errorf("ftcoord: trainers' credentials: %w", err)
		}
		*f.to = string(b)
	}
	return c, c.Validate()
}

// CredentialsPath returns the file New wrote the trainers' credentials
// to: the etcd endpoints, and when secure the CA, the trainers' client
// certificate, the quorum-verification key and the gossip key. Give it
// to trainers (membership.CredentialsEnv, ft.Config.Credentials).
func (s *Server) CredentialsPath() string { return s.creds }

// URL returns the base URL of the API (http(s)://host:port).
func (s *Server) URL() string { return s.url }

// DashboardURL returns the dashboard's URL.
func (s *Server) DashboardURL() string { return s.url + "/" }

// Endpoints returns the etcd client endpoints members connect to.
func (s *Server) Endpoints() []string {
	if s.embedded != nil {
		return s.embedded.Endpoints()
	}
	return append([]string(nil), s.cfg.Etcd...)
}

// Coordinator returns the membership coordinator this server runs.
func (s *Server) Coordinator() *coordinator.Coordinator { return s.coord }

// Client returns the server's etcd client (closed by Serve's end or Close).
func (s *Server) Client() *clientv3.Client { return s.cli }

// Serve runs the coordinator and the HTTP server until ctx ends or Close
// is called (then returns nil), or one of them fails; it then shuts down
// gracefully within ShutdownTimeout: resigns leadership so that a standby
// takes over at once, finishes HTTP requests, and stops the embedded etcd.
// Call it once.
func (s *Server) Serve(ctx context.Context) error {
	err := fmt.Errorf("%w: ftcoord: Serve called twice", comm.ErrInvalidArgument)
	s.serveOnce.Do(func() {
		defer close(s.served)
		err = s.serve(ctx)
	})
	return err
}

func (s *Server) serve(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stopWatch := context.AfterFunc(s.stopCtx, cancel)
	defer stopWatch()
	if s.stopCtx.Err() != nil {
		<-s.releaseAsync()
		return nil
	}
	s.lg.Info("serving", zap.String("url", s.url), zap.Bool("token", s.cfg.Token != ""), zap.Bool("gossip", s.cfg.Gossip != nil))

	runCtx, stopCoord := context.WithCancel(ctx)
	defer stopCoord()
	coordDone := make(chan error, 1)
	go func() { coordDone <- s.coord.Run(runCtx) }()
	httpDone := make(chan error, 1)
	go func() { httpDone <- s.srv.Serve(s.ln) }()

	var runErr error
	select {
	case <-ctx.Done():
		s.lg.Info("shutting down")
	case err := <-httpDone:
		runErr = fmt.Errorf("ftcoord: http server: %w", err)
	case err := <-coordDone:
		runErr = fmt.Errorf("ftcoord: coordinator: %w", err)
		coordDone <- err
	}
	sctx, cancelShutdown := context.WithTimeout(context.Background(), s.cfg.ShutdownTimeout)
	defer cancelShutdown()
	stopCoord() // resigns leadership so a standby takes over at once
	select {
	case <-coordDone:
	case <-sctx.Done():
		s.lg.Warn("coordinator did not stop in time")
	}
	if err := s.srv.Shutdown(sctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		s.lg.Warn("http shutdown", zap.Error(err))
		s.srv.Close()
	}
	select {
	case <-s.releaseAsync():
		s.lg.Info("stopped")
	case <-sctx.Done():
		// Only a process exit is left to do: etcd's data is safe on disk.
		s.lg.Warn("etcd did not stop within the shutdown timeout; leaving it")
	}
	return runErr
}

// releaseAsync closes, once and in a goroutine, what New opened: the
// listener, the etcd client and the embedded etcd. The channel is closed
// when that is done.
func (s *Server) releaseAsync() <-chan struct{} {
	s.releaseOnce.Do(func() {
		go func() {
			defer close(s.released)
			if s.ln != nil {
				s.ln.Close()
			}
			if s.cli != nil {
				s.cli.Close()
			}
			if s.embedded != nil {
				s.embedded.Close()
			}
		}()
	})
	return s.released
}

// Close stops a running Serve and waits for it to return (Serve bounds
// its shutdown by ShutdownTimeout), or releases what New opened when
// Serve was never called. Safe to call twice.
func (s *Server) Close() error {
	s.stop()
	started := true
	s.serveOnce.Do(func() { started = false; close(s.served) })
	if started {
		<-s.served
	} else {
		<-s.releaseAsync()
	}
	return nil
}

// etcdConnectFor bounds how long New retries its first etcd connection.
const etcdConnectFor = 30 * time.Second

// connectEtcd makes the etcd client. With a user and password, clientv3.New
// authenticates within the dial timeout, and a slow etcd (bcrypt on a
// loaded host, an etcd still starting) fails it: a service waits for its
// store a while, saying so, rather than exiting at the first slow answer.
// It gives up after etcdConnectFor or when ctx ends, checked between tries
// (a try itself may take the client's dial timeout: clientv3.New takes no ctx).
func connectEtcd(ctx context.Context, ccfg clientv3.Config, lg *zap.Logger) (*clientv3.Client, error) {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval, b.MaxElapsedTime = 200*time.Millisecond, 2*time.Second, etcdConnectFor
	var cli *clientv3.Client
	err := backoff.RetryNotify(func() error {
		var err error
		cli, err = clientv3.New(ccfg)
		switch status.Code(err) {
		case codes.Unauthenticated, codes.PermissionDenied, codes.InvalidArgument, codes.FailedPrecondition:
			return backoff.Permanent(err) // wrong credentials or settings: retrying cannot help
		}
		if errors.Is(err, rpctypes.ErrAuthFailed) || errors.Is(err, rpctypes.ErrAuthNotEnabled) {
			return backoff.Permanent(err)
		}
		return err
	}, backoff.WithContext(b, ctx), func(err error, next time.Duration) {
		lg.Warn("etcd not answering yet; retrying", zap.Strings("endpoints", ccfg.Endpoints), zap.Duration("in", next), zap.Error(err))
	})
	return cli, err
}
