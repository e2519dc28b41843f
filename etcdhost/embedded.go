package etcdhost

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdclient"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ftcomm/ftcomm/comm"
)

// EmbeddedConfig configures an etcd server run inside this process.
type EmbeddedConfig struct {
	// Dir is the data directory. Empty: a fresh temporary directory that
	// Close removes.
	Dir string
	// Name is the etcd member name (default "ftcomm").
	Name string
	// Logger receives etcd's logs at EtcdLogLevel and above. nil: etcd
	// logs nothing.
	Logger *zap.Logger
	// EtcdLogLevel is the lowest level of etcd's own logs passed on to
	// Logger (default Warn: etcd is chatty at Info).
	EtcdLogLevel zapcore.Level
	// ClientAddr and PeerAddr are host:port to listen on. Empty: on
	// loopback. Port 0: the port of the last start on Dir (kept in
	// Dir/ftcomm-addresses.json, so that clients' endpoints stay valid
	// across restarts), or a free port the OS chooses. A kept client port
	// that another process took fails StartEmbedded with a
	// *KeptAddrInUseError; a kept peer port is replaced.
	ClientAddr, PeerAddr string
	// InitialCluster ("name=http://host:port,…") and ClusterState ("new"
	// or "existing") form a multi-member cluster; empty: a single-member
	// cluster of this server alone. StartEmbeddedCluster fills them.
	InitialCluster string
	ClusterState   string
	// ClusterToken tells clusters apart (default "ftcomm").
	ClusterToken string
	// TickMs and ElectionMs are raft's heartbeat and election timeout
	// (defaults 100 and 1000, etcd's).
	TickMs, ElectionMs uint
	// CompactionRetention keeps this much history for watchers that
	// resume from a revision (periodic compaction; default 1h; negative:
	// never compact).
	CompactionRetention time.Duration
	// QuotaBackendBytes caps the database size (0: etcd's default, 2 GiB).
	QuotaBackendBytes int64
	// MaxRequestBytes is the largest request etcd accepts (0: etcd's
	// default, 1.5 MiB, which membership.MaxRequestBytes names and which
	// one epoch of a 100,000-participant job fits).
	MaxRequestBytes uint
	// UnsafeNoFsync skips fsync: for tests and throwaway clusters only.
	UnsafeNoFsync bool

	// Secure serves clients (and peers) over TLS, requires client
	// certificates, and turns etcd's authentication on with ftcomm's
	// roles (ConfigureAuth): on first start a CA, a server certificate and
	// client certificates for the users UserRoot, UserCoordinator and
	// UserTrainer are made and kept in <Dir>/pki (see Credentials).
	// Off (the default): plain TCP and no authentication — anyone who
	// reaches the port can rewrite every job; for tests and experiments.
	// Single-member servers only.
	Secure bool
	// CertHosts are more names and addresses the server certificate must
	// cover (it always covers loopback, the listen host and the advertised
	// one; every local address and the host name when listening on all).
	CertHosts []string
	// AdvertiseClientAddr is the host:port clients reach this server at
	// (Endpoints); default ClientAddr, or this host's name with its port
	// when ClientAddr's host is unspecified (0.0.0.0, ::).
	AdvertiseClientAddr string
	// Root is the ftcomm key prefix the roles of a Secure server cover
	// (default etcdkeys.DefaultRoot).
	Root string
}

// DefaultEmbeddedConfig returns a single-member configuration on
// loopback ports (free ones at the first start on a data directory, the
// same ones after) with a temporary data directory and silent logs.
func DefaultEmbeddedConfig() EmbeddedConfig {
	return EmbeddedConfig{
		Name:                "ftcomm",
		EtcdLogLevel:        zapcore.WarnLevel,
		ClusterToken:        "ftcomm",
		TickMs:              100,
		ElectionMs:          1000,
		CompactionRetention: time.Hour,
	}
}

func (c *EmbeddedConfig) fillDefaults() {
	d := DefaultEmbeddedConfig()
	if c.Name == "" {
		c.Name = d.Name
	}
	if c.ClusterToken == "" {
		c.ClusterToken = d.ClusterToken
	}
	if c.TickMs == 0 {
		c.TickMs = d.TickMs
	}
	if c.ElectionMs == 0 {
		c.ElectionMs = d.ElectionMs
	}
	if c.CompactionRetention == 0 {
		c.CompactionRetention = d.CompactionRetention
	}
	if c.ClusterState == "" {
		c.ClusterState = embed.ClusterStateFlagNew
	}
}

// Validate says what is wrong with the configuration, if anything. Zero
// fields are valid: they take their defaults.
func (c EmbeddedConfig) Validate() error {
	for _, a := range []struct{ name, v string }{{"ClientAddr", c.ClientAddr}, {"PeerAddr", c.PeerAddr}} {
		if a.v == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(a.v); err != nil {
			return fmt.Errorf("%w: etcdhost: embedded etcd %s %q is not host:port: %v", comm.ErrInvalidArgument, a.name, a.v, err)
		}
	}
	if c.ClusterState != "" && c.ClusterState != embed.ClusterStateFlagNew && c.ClusterState != embed.ClusterStateFlagExisting {
		return fmt.Errorf("%w: etcdhost: embedded etcd ClusterState %q: want %q or %q", comm.ErrInvalidArgument, c.ClusterState, embed.ClusterStateFlagNew, embed.ClusterStateFlagExisting)
	}
	if c.TickMs != 0 && c.ElectionMs != 0 && c.ElectionMs < 5*c.TickMs {
		return fmt.Errorf("%w: etcdhost: embedded etcd ElectionMs %d must be at least 5×TickMs (%d)", comm.ErrInvalidArgument, c.ElectionMs, c.TickMs)
	}
	if c.AdvertiseClientAddr != "" {
		if _, _, err := net.SplitHostPort(c.AdvertiseClientAddr); err != nil {
			return fmt.Errorf("%w: etcdhost: embedded etcd AdvertiseClientAddr %q is not host:port: %v", comm.ErrInvalidArgument, c.AdvertiseClientAddr, err)
		}
	}
	if c.Secure && c.InitialCluster != "" {
		return fmt.Errorf("%w: etcdhost: a Secure embedded etcd is a single-member server (no InitialCluster)", comm.ErrInvalidArgument)
	}
	if c.QuotaBackendBytes < 0 {
		return fmt.Errorf("%w: etcdhost: embedded etcd QuotaBackendBytes %d is negative", comm.ErrInvalidArgument, c.QuotaBackendBytes)
	}
	return nil
}

// Embedded is an etcd server running in this process.
type Embedded struct {
	etcd      *embed.Etcd
	cfg       EmbeddedConfig
	tempDir   string
	endpoints []string
	peerURL   string

	clientMu  sync.Mutex
	closed    bool
	cli       *clientv3.Client
	cliErr    error
	closeOnce sync.Once
	closeErr  error
	// logLevel gates etcd's logs; Close silences them, since stopping its
	// listeners makes etcd log errors that are only the shutdown itself.
	logLevel zap.AtomicLevel
	// lock is the data directory's lock file, held until Close.
	lock *os.File
	// streams ends the client streams (watches, lease keepalives) at
	// Close, so that etcd's graceful stop need not wait for them.
	streams *streamCutter
	// pki holds the certificates of a Secure server (nil otherwise).
	pki *pki
}

// StartEmbedded starts an etcd server and waits until it serves clients or
// ctx ends. A single-member server is ready at once; a member of a new
// multi-member cluster is ready when a quorum of its peers is up, so start
// them concurrently (StartEmbeddedCluster does).
func StartEmbedded(ctx context.Context, cfg EmbeddedConfig) (*Embedded, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.fillDefaults()
	// Ports we chose ourselves may be taken between our probe and etcd's
	// bind; choose again in that case. A kept client port is not ours to
	// change (trainers' credentials name it).
	for attempt := 0; ; attempt++ {
		e, err := startEmbeddedOnce(ctx, cfg)
		var kept *KeptAddrInUseError
		if err == nil || attempt >= 4 || !errors.Is(err, syscall.EADDRINUSE) || errors.As(err, &kept) ||
			fixedPort(cfg.ClientAddr) && fixedPort(cfg.PeerAddr) {
			return e, err
		}
	}
}

func startEmbeddedOnce(ctx context.Context, cfg EmbeddedConfig) (*Embedded, error) {
	m := &Embedded{cfg: cfg}
	ec := embed.NewConfig()
	ec.Name = cfg.Name
	if cfg.MaxRequestBytes > 0 {
		ec.MaxRequestBytes = cfg.MaxRequestBytes
	}
	var err error
	if cfg.Dir == "" {
		if m.tempDir, err = os.MkdirTemp("", "ftcomm-etcd-"); err != nil {
			return nil, fmt.Errorf("etcdhost: embedded etcd: %w", err)
		}
		ec.Dir = m.tempDir
	} else {
		ec.Dir = cfg.Dir
	}
	// Another process using the directory would make etcd wait forever
	// for bbolt's file lock, deaf to signals: refuse at once instead.
	if m.lock, err = lockDataDir(ec.Dir); err != nil {
		m.removeTemp()
		return nil, err
	}
	clientAddr, peerAddr, err := m.listenAddrs(ec.Dir)
	if err != nil {
		m.unlock()
		m.removeTemp()
		return nil, err
	}
	advertise := cfg.AdvertiseClientAddr
	if advertise == "" {
		advertise = clientAddr
		if h, port, _ := net.SplitHostPort(clientAddr); net.ParseIP(h) != nil && net.ParseIP(h).IsUnspecified() {
			name, err := os.Hostname()
			if err != nil {
				m.unlock()
				m.removeTemp()
				return nil, fmt.Errorf("etcdhost: embedded etcd: no AdvertiseClientAddr and no host name: %w", err)
			}
			advertise = net.JoinHostPort(name, port)
		}
	}
	m.streams = newStreamCutter()
	ec.GRPCAdditionalServerOptions = append(ec.GRPCAdditionalServerOptions, grpc.ChainStreamInterceptor(m.streams.intercept))
	scheme := "http"
	pkiDir := filepath.Join(ec.Dir, "pki")
	if cfg.Secure {
		scheme = "https"
		var hosts []string
		for _, a := range []string{clientAddr, advertise, peerAddr} {
			h, _, _ := net.SplitHostPort(a)
			hosts = append(hosts, h)
		}
		m.pki, err = ensurePKI(pkiDir, certHosts(hosts[0], append(hosts[1:], cfg.CertHosts...)))
		if err != nil {
			m.unlock()
			m.removeTemp()
			return nil, err
		}
		ti := transport.TLSInfo{
			CertFile: m.pki.certFile("server"), KeyFile: m.pki.keyFile("server"),
			TrustedCAFile: m.pki.caFile(), ClientCertAuth: true,
		}
		ec.ClientTLSInfo, ec.PeerTLSInfo = ti, ti
		ec.ClientAutoTLS, ec.PeerAutoTLS = false, false
		ec.EnableGRPCGateway = false
	} else if _, err := os.Stat(filepath.Join(pkiDir, "ca.pem")); err == nil {
		m.unlock()
		return nil, fmt.Errorf("%w: etcdhost: %s holds a secured etcd (%s exists): without Secure nobody could authenticate; use another data directory",
			comm.ErrInvalidArgument, ec.Dir, pkiDir)
	}
	cu := url.URL{Scheme: scheme, Host: clientAddr}
	au := url.URL{Scheme: scheme, Host: advertise}
	pu := url.URL{Scheme: scheme, Host: peerAddr}
	ec.ListenClientUrls, ec.AdvertiseClientUrls = []url.URL{cu}, []url.URL{au}
	ec.ListenPeerUrls, ec.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
	if cfg.InitialCluster != "" {
		ec.InitialCluster = cfg.InitialCluster
	} else {
		ec.InitialCluster = ec.InitialClusterFromName(cfg.Name)
	}
	ec.ClusterState = cfg.ClusterState
	ec.InitialClusterToken = cfg.ClusterToken
	ec.TickMs, ec.ElectionMs = cfg.TickMs, cfg.ElectionMs
	if cfg.CompactionRetention > 0 {
		ec.AutoCompactionMode = embed.CompactorModePeriodic
		ec.AutoCompactionRetention = cfg.CompactionRetention.String()
	}
	ec.QuotaBackendBytes = cfg.QuotaBackendBytes
	ec.UnsafeNoFsync = cfg.UnsafeNoFsync
	lg := zap.NewNop()
	m.logLevel = zap.NewAtomicLevelAt(cfg.EtcdLogLevel)
	if cfg.Logger != nil {
		lg = cfg.Logger.WithOptions(zap.IncreaseLevel(m.logLevel)).Named("etcd")
	}
	ec.ZapLoggerBuilder = embed.NewZapLoggerBuilder(lg)
	ec.Logger = "zap"

	e, err := embed.StartEtcd(ec)
	if err != nil {
		m.unlock()
		m.removeTemp()
		return nil, fmt.Errorf("etcdhost: start embedded etcd %s: %w", cfg.Name, err)
	}
	m.etcd = e
	m.endpoints = []string{au.Host}
	m.peerURL = pu.String()
	select {
	case <-e.Server.ReadyNotify():
		if cfg.Secure {
			if err := m.configureAuth(ctx); err != nil {
				m.Close()
				return nil, err
			}
		}
		if cfg.Dir != "" {
			if err := writeKeptAddrs(cfg.Dir, keptAddrs{Client: clientAddr, Peer: peerAddr}); err != nil {
				m.Close()
				return nil, err
			}
		}
		return m, nil
	case err := <-e.Err():
		m.Close()
		return nil, fmt.Errorf("etcdhost: embedded etcd %s failed while starting: %w", cfg.Name, err)
	case <-ctx.Done():
		m.Close()
		return nil, fmt.Errorf("etcdhost: embedded etcd %s not ready: %w", cfg.Name, context.Cause(ctx))
	}
}

func (m *Embedded) removeTemp() {
	if m.tempDir != "" {
		os.RemoveAll(m.tempDir)
	}
}

// configureAuth sets up ftcomm's roles and users as root, on the
// listening address (the advertised one may not resolve here).
func (m *Embedded) configureAuth(ctx context.Context) error {
	a, err := m.Access(UserRoot)
	if err != nil {
		return err
	}
	for _, u := range m.etcd.Config().ListenClientUrls {
		a.Endpoints = []string{u.Host}
		if ip := net.ParseIP(u.Hostname()); ip != nil && ip.IsUnspecified() {
			a.Endpoints = []string{net.JoinHostPort("127.0.0.1", u.Port())}
		}
	}
	cli, err := a.NewClient(nil)
	if err != nil {
		return err
	}
	defer cli.Close()
	return ConfigureAuth(ctx, cli, m.cfg.Root)
}

// keptAddrsFile, in a data directory, holds the addresses its etcd
// listened on last, so that a restart listens there again.
const keptAddrsFile = "ftcomm-addresses.json"

type keptAddrs struct {
	Client string `json:"client"`
	Peer   string `json:"peer"`
}

func readKeptAddrs(dir string) (keptAddrs, error) {
	var k keptAddrs
	b, err := os.ReadFile(filepath.Join(dir, keptAddrsFile))
	if errors.Is(err, os.ErrNotExist) {
		return k, nil
	}
	if err == nil {
		err = json.Unmarshal(b, &k)
	}
	if err != nil {
		return k, fmt.Errorf("etcdhost: embedded etcd: the addresses kept in %s: %w (remove the file to choose new ones)", filepath.Join(dir, keptAddrsFile), err)
	}
	return k, nil
}

func writeKeptAddrs(dir string, k keptAddrs) error {
	b, _ := json.MarshalIndent(k, "", "  ")
	return writeFileAtomic(filepath.Join(dir, keptAddrsFile), append(b, '\n'), 0o600)
}

// KeptAddrInUseError is StartEmbedded's error when the client port the
// data directory's etcd listened on before (and trainers' credentials
// name) is taken by another process. errors.Is(err, syscall.EADDRINUSE)
// holds.
type KeptAddrInUseError struct {
	Addr string // the address taken
	File string // where it is kept
	Err  error  // the listener's error
}

func (e *KeptAddrInUseError) Error() string {
	return fmt.Sprintf("etcdhost: embedded etcd: its client address %s is in use by another process (%v). "+
		"This data directory's etcd listened there before, and trainers' credentials name it, so it is kept (%s): "+
		"stop that process, or give another client address (-etcd-client-addr) and hand trainers the credentials file written then",
		e.Addr, e.Err, e.File)
}

func (e *KeptAddrInUseError) Unwrap() error { return e.Err }

// listenAddrs resolves the configured client and peer addresses. A port
// 0 takes the port kept from the last start on a data directory (with
// the configured host), else a free one. A kept client port that is
// taken fails with *KeptAddrInUseError; a kept peer port that is taken is
// replaced (no client depends on it).
func (m *Embedded) listenAddrs(dir string) (client, peer string, err error) {
	var kept keptAddrs
	if m.cfg.Dir != "" {
		if kept, err = readKeptAddrs(dir); err != nil {
			return "", "", err
		}
	}
	reuse := func(addr, keptAddr string) (string, bool) {
		if addr == "" {
			addr = "127.0.0.1:0"
		}
		host, port, err := net.SplitHostPort(addr)
		_, keptPort, kerr := net.SplitHostPort(keptAddr)
		if err != nil || kerr != nil || port != "0" {
			return addr, false
		}
		return net.JoinHostPort(host, keptPort), true
	}
	client, fromKept := reuse(m.cfg.ClientAddr, kept.Client)
	if fromKept {
		if err := probeListen(client); err != nil {
			return "", "", &KeptAddrInUseError{Addr: client, File: filepath.Join(dir, keptAddrsFile), Err: err}
		}
	} else if client, err = freeAddr(client); err != nil {
		return "", "", err
	}
	peer, fromKept = reuse(m.cfg.PeerAddr, kept.Peer)
	if fromKept && probeListen(peer) != nil {
		peer = m.cfg.PeerAddr
		if m.cfg.Logger != nil {
			m.cfg.Logger.Info("the embedded etcd's kept peer address is taken; choosing another", zap.String("kept", kept.Peer))
		}
	}
	if peer, err = freeAddr(peer); err != nil {
		return "", "", err
	}
	return client, peer, nil
}

// probeListen reports whether addr can be listened on now.
func probeListen(addr string) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	return l.Close()
}

// fixedPort reports whether addr names a port (not empty, not port 0).
func fixedPort(addr string) bool {
	_, port, err := net.SplitHostPort(addr)
	return err == nil && port != "0"
}

// freeLoopbackAddr asks the OS for a free loopback TCP port.
func freeLoopbackAddr() (string, error) { return freeAddr("") }

// freeAddr returns addr, or with its port 0 (or addr empty: on loopback)
// a free port the OS chose.
func freeAddr(addr string) (string, error) {
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	if _, port, err := net.SplitHostPort(addr); err != nil || port != "0" {
		return addr, nil
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return "", fmt.Errorf("etcdhost: find a free port on %s: %w", addr, err)
	}
	addr = l.Addr().String()
	l.Close()
	return addr, nil
}

// Endpoints returns the client endpoints (host:port) of this server.
func (m *Embedded) Endpoints() []string { return append([]string(nil), m.endpoints...) }

// PeerURL returns the URL other members of the cluster reach this one at.
func (m *Embedded) PeerURL() string { return m.peerURL }

// Name returns the etcd member name.
func (m *Embedded) Name() string { return m.cfg.Name }

// Dir returns the data directory.
func (m *Embedded) Dir() string { return m.etcd.Config().Dir }

// Secure reports whether the server requires TLS and authentication.
func (m *Embedded) Secure() bool { return m.pki != nil }

// Access returns what a client needs to act as user (UserCoordinator,
// UserTrainer or UserRoot) on this server: its endpoints and key root
// and, when Secure, the CA and the user's client certificate and key.
// A trainer's membership.Credentials are these plus the coordinators'
// quorum keys and the gossip key (ftcoord adds them).
func (m *Embedded) Access(user string) (*Access, error) {
	root := strings.TrimSuffix(etcdkeys.Layout{Root: m.cfg.Root}.Prefix(), "/")
	a := &Access{Endpoints: m.Endpoints(), Root: root}
	if m.pki == nil {
		return a, nil
	}
	switch user {
	case UserRoot, UserCoordinator, UserTrainer:
	default:
		return nil, fmt.Errorf("%w: etcdhost: no etcd user %q (want %s, %s or %s)", comm.ErrInvalidArgument, user, UserCoordinator, UserTrainer, UserRoot)
	}
	cert, key, err := m.pki.clientPEM(user)
	if err != nil {
		return nil, err
	}
	a.CACert, a.Cert, a.Key = string(m.pki.caPEM), string(cert), string(key)
	return a, nil
}

// Client returns a client of this server, created at the first call and
// closed by Close (after Close it fails with comm.ErrClosed). It logs
// nothing. On a Secure server it acts as UserCoordinator.
func (m *Embedded) Client() (*clientv3.Client, error) {
	m.clientMu.Lock()
	defer m.clientMu.Unlock()
	if m.closed {
		return nil, fmt.Errorf("etcdhost: embedded etcd client: %w", comm.ErrClosed)
	}
	if m.cli == nil && m.cliErr == nil {
		m.cli, m.cliErr = m.NewClient(nil)
	}
	return m.cli, m.cliErr
}

// NewClient returns a new client of this server, as UserCoordinator
// on a Secure one; the caller closes it.
func (m *Embedded) NewClient(lg *zap.Logger) (*clientv3.Client, error) {
	a, err := m.Access(UserCoordinator)
	if err != nil {
		return nil, err
	}
	return a.NewClient(lg)
}

// Close stops the server (closing the client Client returned) and removes
// a temporary data directory. Safe to call twice.
//
// Clients' streams (watches, lease keepalives) are ended first and new
// ones refused, so Close does not wait out etcd's graceful-stop timeout
// (5 s plus two election timeouts) while members or an etcdctl watch are
// attached; the clients see the server go away and reconnect, to this
// server when it restarts on the same address.
func (m *Embedded) Close() error {
	m.closeOnce.Do(func() {
		m.clientMu.Lock()
		m.closed = true
		cli := m.cli
		m.clientMu.Unlock()
		if cli != nil {
			cli.Close()
		}
		m.logLevel.SetLevel(zapcore.FatalLevel)
		m.streams.cut()
		m.etcd.Close()
		m.unlock()
		m.removeTemp()
	})
	return m.closeErr
}

func (m *Embedded) unlock() {
	if m.lock != nil {
		m.lock.Close() // releases the flock
		m.lock = nil
	}
}

// ErrDataDirInUse: another process holds the embedded etcd's data
// directory.
var ErrDataDirInUse = errors.New("etcdhost: etcd data directory in use")

// lockDataDir takes an exclusive lock on dir/ftcomm.lock (creating dir)
// and checks that no other process has etcd's database open (an etcd or
// older ftcomm that does not know this lock). The lock file holds the
// owner's pid, for the error message.
func lockDataDir(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("etcdhost: embedded etcd data directory: %w", err)
	}
	path := filepath.Join(dir, "ftcomm.lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("etcdhost: embedded etcd data directory: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		owner, _ := io.ReadAll(io.LimitReader(f, 64))
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is used by process %s (it holds %s): stop it, or give this one another data directory",
				ErrDataDirInUse, dir, strings.TrimSpace(string(owner)), path)
		}
		return nil, fmt.Errorf("etcdhost: lock %s: %w", path, err)
	}
	f.Truncate(0)
	f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	db := filepath.Join(dir, "member", "snap", "db")
	if g, err := os.Open(db); err == nil {
		err := unix.Flock(int(g.Fd()), unix.LOCK_SH|unix.LOCK_NB)
		g.Close() // releases the probe's lock
		if errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("%w: etcd's database %s is open in another process: stop it, or give this one another data directory",
				ErrDataDirInUse, db)
		}
	}
	return f, nil
}

// streamCutter is a gRPC stream interceptor that can end every client
// stream of a server at once and refuse new ones.
type streamCutter struct {
	ctx    context.Context
	cancel context.CancelFunc
}

func newStreamCutter() *streamCutter {
	ctx, cancel := context.WithCancel(context.Background())
	return &streamCutter{ctx: ctx, cancel: cancel}
}

func (c *streamCutter) intercept(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if c.ctx.Err() != nil {
		return status.Error(codes.Unavailable, "etcd server is stopping")
	}
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()
	stop := context.AfterFunc(c.ctx, cancel)
	defer stop()
	err := handler(srv, &cutStream{ServerStream: ss, ctx: ctx})
	if c.ctx.Err() != nil && ss.Context().Err() == nil {
		// Unavailable, not Canceled: clients retry (on this server once
		// it restarts) instead of failing their watches.
		return status.Error(codes.Unavailable, "etcd server is stopping")
	}
	return err
}

func (c *streamCutter) cut() {
	if c != nil {
		c.cancel()
	}
}

type cutStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *cutStream) Context() context.Context { return s.ctx }

// EmbeddedCluster is a multi-member etcd cluster running in this process
// (for tests and tools: each member can be stopped on its own).
type EmbeddedCluster struct {
	Members []*Embedded
}

// StartEmbeddedCluster starts n members named <cfg.Name>-0…<n-1> on free
// loopback ports, each with its own data directory (under cfg.Dir when
// set, else temporary), and waits until all serve clients.
func StartEmbeddedCluster(ctx context.Context, cfg EmbeddedConfig, n int) (*EmbeddedCluster, error) {
	if n < 1 {
		return nil, fmt.Errorf("%w: etcdhost: embedded cluster of %d members", comm.ErrInvalidArgument, n)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.ClientAddr != "" || cfg.PeerAddr != "" || cfg.InitialCluster != "" {
		return nil, fmt.Errorf("%w: etcdhost: embedded cluster chooses its own addresses; leave ClientAddr, PeerAddr and InitialCluster empty", comm.ErrInvalidArgument)
	}
	if cfg.Secure {
		return nil, fmt.Errorf("%w: etcdhost: a Secure embedded etcd is a single-member server", comm.ErrInvalidArgument)
	}
	cfg.fillDefaults()
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		c, err := startClusterOnce(ctx, cfg, n)
		if err == nil {
			return c, nil
		}
		lastErr = err
		if !errors.Is(err, syscall.EADDRINUSE) {
			break
		}
	}
	return nil, lastErr
}

func startClusterOnce(ctx context.Context, cfg EmbeddedConfig, n int) (*EmbeddedCluster, error) {
	cfgs := make([]EmbeddedConfig, n)
	var initial []string
	for i := range cfgs {
		c := cfg
		c.Name = fmt.Sprintf("%s-%d", cfg.Name, i)
		var err error
		if c.ClientAddr, err = freeLoopbackAddr(); err != nil {
			return nil, err
		}
		if c.PeerAddr, err = freeLoopbackAddr(); err != nil {
			return nil, err
		}
		if cfg.Dir != "" {
			c.Dir = cfg.Dir + "/" + c.Name
		}
		cfgs[i] = c
		initial = append(initial, c.Name+"=http://"+c.PeerAddr)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	members := make([]*Embedded, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range cfgs {
		cfgs[i].InitialCluster = strings.Join(initial, ",")
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			members[i], errs[i] = startEmbeddedOnce(ctx, cfgs[i])
			if errs[i] != nil {
				cancel() // the others would wait for a quorum forever
			}
		}(i)
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		for _, m := range members {
			if m != nil {
				m.Close()
			}
		}
		return nil, err
	}
	return &EmbeddedCluster{Members: members}, nil
}

// Endpoints returns the client endpoints of every member.
func (c *EmbeddedCluster) Endpoints() []string {
	var out []string
	for _, m := range c.Members {
		out = append(out, m.endpoints...)
	}
	return out
}

// NewClient returns a client of the whole cluster; the caller closes it.
func (c *EmbeddedCluster) NewClient(lg *zap.Logger) (*clientv3.Client, error) {
	return etcdclient.NewClient(c.Endpoints(), lg)
}

// Close stops every member. Safe to call twice.
func (c *EmbeddedCluster) Close() error {
	var wg sync.WaitGroup
	for _, m := range c.Members {
		wg.Add(1)
		go func() { defer wg.Done(); m.Close() }()
	}
	wg.Wait()
	return nil
}
