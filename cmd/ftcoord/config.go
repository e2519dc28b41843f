package main

import (
	"encoding/base64"
	"encoding/hex"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"github.com/ftcomm/ftcomm/coordinator/quorum"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/coordinator/server"
	"github.com/ftcomm/ftcomm/membership"
)

// serveConfig is everything `ftcoord serve` takes.
type serveConfig struct {
	Listen        string // HTTP listen address
	Advertise     string // the API's host:port as others reach it
	AdvertiseHost string // default host of every advertised address
	AddrFile      string // write the API's URL here (for scripts and tests)
	TLSCert       string
	TLSKey        string
	Token         string
	TokenFile     string

	DataDir             string
	Etcd                string // external endpoints, comma-separated; empty: embedded
	EtcdClientAddr      string
	EtcdPeerAddr        string
	EtcdAdvertiseAddr   string
	EtcdCertHosts       string // comma-separated
	EtcdCACert          string
	EtcdCert            string
	EtcdKey             string
	EtcdUser            string
	EtcdPassword        string
	TrainerEtcdCert     string
	TrainerEtcdKey      string
	TrainerEtcdUser     string
	TrainerEtcdPassword string
	Insecure            bool
	SecretsFile         string
	CredentialsFile     string

	Root               string
	Name               string
	MinReplicas        int
	JoinTimeout        time.Duration
	SessionTTL         time.Duration
	History            int
	Gossip             bool
	GossipAddr         string
	GossipAdvertise    string
	GossipKey          string
	GossipProbe        time.Duration
	GossipProbeTimeout time.Duration
	GossipSuspicion    int

	EvictKeepOut time.Duration

	// Quorum rules beyond -min-replicas and -join-timeout.
	FailureSettle      time.Duration
	HolderGrace        time.Duration
	BlameHold          time.Duration
	BlameMinHold       time.Duration
	SilentEpochs       int
	StragglerFactor    float64
	StragglerWindow    time.Duration
	StragglerProbation time.Duration

	LogLevel        string
	LogFormat       string
	ShutdownTimeout time.Duration
}

func defaultServeConfig() serveConfig {
	cc := coordinator.DefaultConfig()
	gc := membership.DefaultGossipConfig()
	return serveConfig{
		Listen:             "127.0.0.1:8080",
		DataDir:            "./ftcoord-data",
		EtcdClientAddr:     "127.0.0.1:0",
		EtcdPeerAddr:       "127.0.0.1:0",
		Root:               etcdkeys.DefaultRoot,
		Name:               defaultName(os.Hostname),
		MinReplicas:        cc.Quorum.MinReplicas,
		JoinTimeout:        cc.Quorum.JoinTimeout,
		SessionTTL:         cc.SessionTTL,
		History:            cc.HistoryLimit,
		Gossip:             true,
		GossipAddr:         gc.BindAddr,
		GossipProbe:        gc.ProbeInterval,
		GossipProbeTimeout: gc.ProbeTimeout,
		GossipSuspicion:    gc.SuspicionMult,
		EvictKeepOut:       cc.EvictKeepOut,
		FailureSettle:      cc.Quorum.FailureSettle,
		HolderGrace:        cc.Quorum.HolderGrace,
		BlameHold:          cc.Quorum.BlameHold,
		BlameMinHold:       cc.Quorum.BlameMinHold,
		SilentEpochs:       cc.Quorum.SilentEpochs,
		StragglerWindow:    membership.DefaultStragglerWindow,
		StragglerProbation: membership.DefaultStragglerProbation,
		LogLevel:           "info",
		LogFormat:          "console",
		ShutdownTimeout:    10 * time.Second,
	}
}

// defaultName is the default -name: the host name, which stays the same
// across restarts (a StatefulSet's pod name, a VM's name), unlike the
// host-pid of membership's default. Characters a name may not hold become
// '-'; no host name gives "ftcoord".
func defaultName(hostname func() (string, error)) string {
	h, err := hostname()
	if err != nil {
		return "ftcoord"
	}
	b := []byte(h)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			b[i] = '-'
		}
	}
	name := strings.TrimLeft(string(b[:min(len(b), 128)]), "._-")
	if !membership.ValidName(name) {
		return "ftcoord"
	}
	return name
}

func (c *serveConfig) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.Listen, "listen", c.Listen, "HTTP `host:port` the API, dashboard and metrics listen on (port 0: a free one)")
	fs.StringVar(&c.Advertise, "advertise", c.Advertise, "`host:port` others reach the API at, when it differs from -listen (default: -advertise-host with -listen's port)")
	fs.StringVar(&c.AdvertiseHost, "advertise-host", c.AdvertiseHost, "`host` (name or IP) others reach this instance at: the default host of -advertise, -etcd-advertise-addr and -gossip-advertise, with their listen ports (a pod: its IP or stable DNS name)")
	fs.StringVar(&c.AddrFile, "addr-file", c.AddrFile, "write the API's base URL (advertised when set) to this `file` once listening")
	fs.StringVar(&c.TLSCert, "tls-cert", c.TLSCert, "serve HTTPS with this certificate `file` (with -tls-key)")
	fs.StringVar(&c.TLSKey, "tls-key", c.TLSKey, "private key `file` for -tls-cert")
	fs.StringVar(&c.Token, "token", c.Token, "bearer `token` required by the API and /metrics (prefer -token-file or FTCOORD_TOKEN)")
	fs.StringVar(&c.TokenFile, "token-file", c.TokenFile, "read the bearer token from this `file`")
	fs.StringVar(&c.DataDir, "data-dir", c.DataDir, "data `dir`ectory: the embedded etcd's data and certificates, the coordinator's secrets, the trainers' credentials")
	fs.BoolVar(&c.Insecure, "insecure", c.Insecure, "no TLS, no etcd authentication, unsigned quorums, unencrypted gossip: anyone who reaches etcd can rewrite jobs (local experiments only)")
	fs.StringVar(&c.SecretsFile, "secrets-file", c.SecretsFile, "the coordinator's quorum-signing and gossip keys, created if missing (default <data-dir>/coordinator-secrets.json); coordinators of one root share it")
	fs.StringVar(&c.CredentialsFile, "credentials-file", c.CredentialsFile, "write the trainers' credentials here (default <data-dir>/trainer-credentials.json)")
	fs.StringVar(&c.Etcd, "etcd", c.Etcd, "external etcd `endpoints` (host:port,…); empty: run an embedded single-node etcd")
	fs.StringVar(&c.EtcdClientAddr, "etcd-client-addr", c.EtcdClientAddr, "embedded etcd client `host:port` (port 0: the port of the last start on -data-dir, which trainers' credentials name, else a free one)")
	fs.StringVar(&c.EtcdPeerAddr, "etcd-peer-addr", c.EtcdPeerAddr, "embedded etcd peer `host:port` (port 0: the port of the last start on -data-dir, else a free one)")
	fs.StringVar(&c.EtcdAdvertiseAddr, "etcd-advertise-addr", c.EtcdAdvertiseAddr, "`host:port` trainers reach the embedded etcd at, written into their credentials (default: -advertise-host with -etcd-client-addr's port, or -etcd-client-addr, or this host's name when that listens on all addresses)")
	fs.StringVar(&c.EtcdCertHosts, "etcd-cert-hosts", c.EtcdCertHosts, "more `names` and addresses (comma-separated) for the embedded etcd's server certificate")
	fs.StringVar(&c.EtcdCACert, "etcd-cacert", c.EtcdCACert, "CA `file` to verify external etcd servers")
	fs.StringVar(&c.EtcdCert, "etcd-cert", c.EtcdCert, "client certificate `file` for external etcd")
	fs.StringVar(&c.EtcdKey, "etcd-key", c.EtcdKey, "client key `file` for external etcd")
	fs.StringVar(&c.EtcdUser, "etcd-user", c.EtcdUser, "etcd `user` name (auth)")
	fs.StringVar(&c.EtcdPassword, "etcd-password", c.EtcdPassword, "etcd `password` (prefer FTCOORD_ETCD_PASSWORD)")
	fs.StringVar(&c.TrainerEtcdCert, "trainer-etcd-cert", c.TrainerEtcdCert, "external etcd: the trainers' client certificate `file`, for their credentials file")
	fs.StringVar(&c.TrainerEtcdKey, "trainer-etcd-key", c.TrainerEtcdKey, "external etcd: the trainers' client key `file`")
	fs.StringVar(&c.TrainerEtcdUser, "trainer-etcd-user", c.TrainerEtcdUser, "external etcd: the trainers' etcd `user`")
	fs.StringVar(&c.TrainerEtcdPassword, "trainer-etcd-password", c.TrainerEtcdPassword, "external etcd: the trainers' etcd `password` (prefer FTCOORD_TRAINER_ETCD_PASSWORD)")
	fs.StringVar(&c.Root, "root", c.Root, "etcd key `prefix` of all jobs")
	fs.StringVar(&c.Name, "name", c.Name, "this instance's `name`, unique among the coordinators of a root (default: the host name, stable across restarts; give each instance on one host its own)")
	fs.IntVar(&c.MinReplicas, "min-replicas", c.MinReplicas, "default min replicas of a quorum (members may ask for more)")
	fs.DurationVar(&c.JoinTimeout, "join-timeout", c.JoinTimeout, "how long a quorum waits for stragglers")
	fs.DurationVar(&c.SessionTTL, "session-ttl", c.SessionTTL, "leader election lease TTL (≥ 2s): a dead leader is replaced after about this long")
	fs.IntVar(&c.History, "history", c.History, "past quorums kept per job")
	fs.BoolVar(&c.Gossip, "gossip", c.Gossip, "join members' gossip to learn of deaths directly")
	fs.StringVar(&c.GossipAddr, "gossip-addr", c.GossipAddr, "gossip `host:port`, TCP and UDP (port 0: a free one)")
	fs.StringVar(&c.GossipAdvertise, "gossip-advertise", c.GossipAdvertise, "gossip `host:port` others reach this instance at (default: -advertise-host with -gossip-addr's port, or the bound address)")
	fs.StringVar(&c.GossipKey, "gossip-key", c.GossipKey, "gossip encryption `key`, 16/24/32 bytes in hex or base64 (prefer FTCOORD_GOSSIP_KEY)")
	fs.DurationVar(&c.GossipProbe, "gossip-probe-interval", c.GossipProbe, "gossip probe interval")
	fs.DurationVar(&c.GossipProbeTimeout, "gossip-probe-timeout", c.GossipProbeTimeout, "gossip probe timeout")
	fs.IntVar(&c.GossipSuspicion, "gossip-suspicion-mult", c.GossipSuspicion, "gossip suspicion multiplier")
	fs.DurationVar(&c.EvictKeepOut, "evict-keep-out", c.EvictKeepOut, "how long an evicted member may not register again (0: not at all; an eviction request may say otherwise)")
	fs.DurationVar(&c.FailureSettle, "failure-settle", c.FailureSettle, "how long a failed epoch waits for more reports (a blame) before the next forms (0: not at all)")
	fs.DurationVar(&c.HolderGrace, "holder-grace", c.HolderGrace, "how long a quorum none of whose members holds the job's step waits for lapsed members that held it to come back (0: not at all)")
	fs.DurationVar(&c.BlameHold, "blame-hold", c.BlameHold, "how long live members that could not reach each other stay in different quorums, doubling while it recurs (0: blame never splits a job)")
	fs.DurationVar(&c.BlameMinHold, "blame-min-hold", c.BlameMinHold, "the shortest such a hold lasts once one of the two reports reaching the other again, doubling while it recurs (0: the report ends it at once)")
	fs.IntVar(&c.SilentEpochs, "silent-epochs", c.SilentEpochs, "failed epochs in a row a member may be blamed in while reporting nothing before quorums leave it out (0: never)")
	fs.Float64Var(&c.StragglerFactor, "straggler-factor", c.StragglerFactor, "take a replica out of its job's quorums while its step time stays above this many times its peers' median (0: off; a job's members may ask for a policy)")
	fs.DurationVar(&c.StragglerWindow, "straggler-window", c.StragglerWindow, "how long a replica must stay slow before it is taken out")
	fs.DurationVar(&c.StragglerProbation, "straggler-probation", c.StragglerProbation, "how long a replica taken out stays out unless it reports keeping up (doubles while it recurs)")
	fs.StringVar(&c.LogLevel, "log-level", c.LogLevel, "log `level`: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log-format", c.LogFormat, "log `format`: console (tab-separated, for people) or json (one object a line, for log collectors)")
	fs.DurationVar(&c.ShutdownTimeout, "shutdown-timeout", c.ShutdownTimeout, "how long a graceful shutdown may take")
}

// envName is the environment variable that sets a flag: FTCOORD_<FLAG>,
// upper case, '-' as '_'.
func envName(flagName string) string {
	return "FTCOORD_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// showEnv appends its environment variable to the usage of every flag of
// fs, so that -h shows how to set each one in a container's environment.
func showEnv(fs *flag.FlagSet) {
	fs.VisitAll(func(f *flag.Flag) { f.Usage += " [$" + envName(f.Name) + "]" })
}

// parseFlags parses args, then fills every flag not given on the command
// line from its environment variable.
func parseFlags(fs *flag.FlagSet, args []string, getenv func(string) string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] || err != nil {
			return
		}
		if v := getenv(envName(f.Name)); v != "" {
			if e := f.Value.Set(v); e != nil {
				err = fmt.Errorf("%s=%q: %v", envName(f.Name), v, e)
			}
		}
	})
	return err
}

// validate says what is wrong, all at once.
func (c *serveConfig) validate() error {
	var probs []string
	bad := func(f string, a ...any) { probs = append(probs, fmt.Sprintf(f, a...)) }
	hostPort := func(flagName, v string) {
		if _, _, err := net.SplitHostPort(v); err != nil {
			bad("-%s %q is not host:port", flagName, v)
		}
	}
	hostPort("listen", c.Listen)
	if c.Advertise != "" {
		hostPort("advertise", c.Advertise)
	}
	if c.AdvertiseHost != "" {
		if strings.ContainsAny(c.AdvertiseHost, " /") || strings.Count(c.AdvertiseHost, ":") == 1 {
			bad("-advertise-host %q: want a host name or IP address, without a port", c.AdvertiseHost)
		}
		// The addresses it completes take their listen port: a port the
		// OS picks cannot be advertised in advance.
		fixed := func(flagName, bind, explicit string) {
			if _, port, err := net.SplitHostPort(bind); err == nil && port == "0" && explicit == "" {
				bad("-advertise-host needs a fixed port in -%s (it is %q)", flagName, bind)
			}
		}
		fixed("listen", c.Listen, c.Advertise)
		if c.Etcd == "" {
			fixed("etcd-client-addr", c.EtcdClientAddr, c.EtcdAdvertiseAddr)
		}
		if c.Gossip {
			fixed("gossip-addr", c.GossipAddr, c.GossipAdvertise)
		}
	}
	if (c.TLSCert == "") != (c.TLSKey == "") {
		bad("-tls-cert and -tls-key go together")
	}
	if c.Token != "" && c.TokenFile != "" {
		bad("give -token or -token-file, not both")
	}
	if c.Etcd == "" {
		if c.DataDir == "" {
			bad("-data-dir must not be empty with the embedded etcd")
		}
		hostPort("etcd-client-addr", c.EtcdClientAddr)
		hostPort("etcd-peer-addr", c.EtcdPeerAddr)
		if c.EtcdCACert != "" || c.EtcdCert != "" || c.EtcdUser != "" || c.TrainerEtcdCert != "" || c.TrainerEtcdUser != "" {
			bad("-etcd-cacert, -etcd-cert, -etcd-user and -trainer-etcd-* apply to an external etcd (-etcd)")
		}
		if c.EtcdAdvertiseAddr != "" {
			hostPort("etcd-advertise-addr", c.EtcdAdvertiseAddr)
		}
	} else {
		for _, ep := range strings.Split(c.Etcd, ",") {
			hostPort("etcd", strings.TrimPrefix(strings.TrimPrefix(strings.TrimSpace(ep), "http://"), "https://"))
		}
	}
	if (c.EtcdCert == "") != (c.EtcdKey == "") {
		bad("-etcd-cert and -etcd-key go together")
	}
	if (c.TrainerEtcdCert == "") != (c.TrainerEtcdKey == "") {
		bad("-trainer-etcd-cert and -trainer-etcd-key go together")
	}
	if c.TrainerEtcdPassword != "" && c.TrainerEtcdUser == "" {
		bad("-trainer-etcd-password needs -trainer-etcd-user")
	}
	if c.Etcd != "" && (c.EtcdAdvertiseAddr != "" || c.EtcdCertHosts != "") {
		bad("-etcd-advertise-addr and -etcd-cert-hosts apply to the embedded etcd")
	}
	if c.EtcdPassword != "" && c.EtcdUser == "" {
		bad("-etcd-password needs -etcd-user")
	}
	if !strings.HasPrefix(c.Root, "/") {
		bad("-root %q must start with /", c.Root)
	}
	if !membership.ValidName(c.Name) {
		bad("-name %q: want 1–128 of [A-Za-z0-9._-]", c.Name)
	}
	if c.MinReplicas < 1 {
		bad("-min-replicas %d must be at least 1", c.MinReplicas)
	}
	if c.JoinTimeout < 0 {
		bad("-join-timeout %v is negative", c.JoinTimeout)
	}
	if c.SessionTTL < 2*time.Second {
		bad("-session-ttl %v is below etcd's minimum of 2s", c.SessionTTL)
	}
	if c.FailureSettle < 0 || c.HolderGrace < 0 || c.BlameHold < 0 || c.BlameMinHold < 0 || c.SilentEpochs < 0 {
		bad("-failure-settle %v, -holder-grace %v, -blame-hold %v and -silent-epochs %d must not be negative", c.FailureSettle, c.HolderGrace, c.BlameHold, c.SilentEpochs)
	}
	if err := c.stragglers().Validate(); err != nil || c.StragglerWindow <= 0 || c.StragglerProbation <= 0 {
		bad("-straggler-factor %g (0, or above 1), -straggler-window %v and -straggler-probation %v (above 0)", c.StragglerFactor, c.StragglerWindow, c.StragglerProbation)
	}
	if c.History < 1 {
		bad("-history %d must be at least 1", c.History)
	}
	if c.Gossip {
		if _, err := c.gossipConfig(); err != nil {
			bad("%v", err)
		}
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		bad("-log-level %q: want debug, info, warn or error", c.LogLevel)
	}
	switch c.LogFormat {
	case "console", "json":
	default:
		bad("-log-format %q: want console or json", c.LogFormat)
	}
	if c.ShutdownTimeout <= 0 {
		bad("-shutdown-timeout %v must be positive", c.ShutdownTimeout)
	}
	if c.EvictKeepOut < 0 {
		bad("-evict-keep-out %v is negative", c.EvictKeepOut)
	}
	if len(probs) > 0 {
		return fmt.Errorf("invalid configuration:\n  %s", strings.Join(probs, "\n  "))
	}
	return nil
}

func (c *serveConfig) gossipConfig() (membership.GossipConfig, error) {
	g := membership.DefaultGossipConfig()
	g.BindAddr, g.AdvertiseAddr = c.GossipAddr, c.advertised(c.GossipAdvertise, c.GossipAddr)
	g.ProbeInterval, g.ProbeTimeout, g.SuspicionMult = c.GossipProbe, c.GossipProbeTimeout, c.GossipSuspicion
	if c.GossipKey != "" {
		key, err := decodeKey(c.GossipKey)
		if err != nil {
			return g, fmt.Errorf("-gossip-key: %v", err)
		}
		g.SecretKey = key
	}
	if err := g.Validate(); err != nil {
		return g, err
	}
	return g, nil
}

// advertised is the address others reach a listener at: explicit when
// set, else -advertise-host with bind's port, else "" (the listener's own
// address, as the component decides).
func (c *serveConfig) advertised(explicit, bind string) string {
	if explicit != "" || c.AdvertiseHost == "" {
		return explicit
	}
	_, port, _ := net.SplitHostPort(bind)
	return net.JoinHostPort(c.AdvertiseHost, port)
}

func decodeKey(s string) ([]byte, error) {
	if b, err := hex.DecodeString(s); err == nil {
		return b, nil
	}
	if b, err := base64.StdEncoding.DecodeString(s); err == nil {
		return b, nil
	}
	return nil, fmt.Errorf("not hex or base64")
}

// serverConfig turns the flags into the server's configuration.
func (c *serveConfig) serverConfig() (server.Config, error) {
	sc := server.DefaultConfig()
	token, err := c.token()
	if err != nil {
		return sc, err
	}
	sc.Listen, sc.TLSCert, sc.TLSKey, sc.Token = c.Listen, c.TLSCert, c.TLSKey, token
	sc.Advertise = c.advertised(c.Advertise, c.Listen)
	sc.Etcd = nil
	if c.Etcd != "" {
		for _, ep := range strings.Split(c.Etcd, ",") {
			sc.Etcd = append(sc.Etcd, strings.TrimSpace(ep))
		}
	}
	sc.DataDir, sc.EtcdClientAddr, sc.EtcdPeerAddr = c.DataDir, c.EtcdClientAddr, c.EtcdPeerAddr
	if c.Etcd == "" {
		sc.EtcdAdvertiseAddr = c.advertised(c.EtcdAdvertiseAddr, c.EtcdClientAddr)
	}
	sc.EtcdCertHosts = nil
	for _, h := range strings.Split(c.EtcdCertHosts, ",") {
		if h = strings.TrimSpace(h); h != "" {
			sc.EtcdCertHosts = append(sc.EtcdCertHosts, h)
		}
	}
	sc.EtcdCACert, sc.EtcdCert, sc.EtcdKey = c.EtcdCACert, c.EtcdCert, c.EtcdKey
	sc.EtcdUser, sc.EtcdPassword = c.EtcdUser, c.EtcdPassword
	sc.TrainerEtcdCert, sc.TrainerEtcdKey = c.TrainerEtcdCert, c.TrainerEtcdKey
	sc.TrainerEtcdUser, sc.TrainerEtcdPassword = c.TrainerEtcdUser, c.TrainerEtcdPassword
	sc.Insecure, sc.SecretsFile, sc.CredentialsFile = c.Insecure, c.SecretsFile, c.CredentialsFile
	sc.Root, sc.Name = c.Root, c.Name
	sc.Quorum = c.quorum()
	sc.SessionTTL, sc.HistoryLimit = c.SessionTTL, c.History
	sc.Gossip = nil
	if c.Gossip {
		g, err := c.gossipConfig()
		if err != nil {
			return sc, err
		}
		sc.Gossip = &g
	}
	sc.ShutdownTimeout = c.ShutdownTimeout
	sc.EvictKeepOut = c.EvictKeepOut
	if c.EvictKeepOut == 0 {
		sc.EvictKeepOut = -1 // not at all
	}
	return sc, nil
}

// token returns the bearer token from -token or -token-file.
func (c *serveConfig) token() (string, error) {
	if c.TokenFile == "" {
		return c.Token, nil
	}
	b, err := os.ReadFile(c.TokenFile)
	if err != nil {
		return "", err
	}
	t := strings.TrimSpace(string(b))
	if t == "" {
		return "", fmt.Errorf("token file %s is empty", c.TokenFile)
	}
	return t, nil
}

// quorum is the coordinator's quorum rules; 0 turns a rule off.
func (c *serveConfig) quorum() quorum.Config {
	off := func(d time.Duration) time.Duration {
		if d == 0 {
			return -1
		}
		return d
	}
	q := quorum.Config{MinReplicas: c.MinReplicas, JoinTimeout: c.JoinTimeout, FailureSettle: c.FailureSettle,
		HolderGrace: off(c.HolderGrace), BlameHold: off(c.BlameHold), BlameMinHold: off(c.BlameMinHold), SilentEpochs: c.SilentEpochs,
		Stragglers: c.stragglers()}
	if c.SilentEpochs == 0 {
		q.SilentEpochs = -1
	}
	return q
}

func (c *serveConfig) stragglers() membership.StragglerPolicy {
	return membership.StragglerPolicy{Factor: c.StragglerFactor, Window: c.StragglerWindow, Probation: c.StragglerProbation}
}
