package membership

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/google/renameio/v2"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/connectivity"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/internal/etcdclient"
)

// CredentialsEnv names the environment variable that holds the path of a
// trainer's credentials file (ft.Config reads it when its Credentials
// field is empty).
const CredentialsEnv = "FTCOMM_CREDENTIALS"

// CredentialsVersion is the format version Credentials files carry.
const CredentialsVersion = 1

// Credentials are what a member (a trainer) needs to take part in the
// jobs of a secured coordinator, in one JSON file (written 0600 by
// `ftcoord serve`, by default <data-dir>/trainer-credentials.json):
//
//	{"version": 1, "endpoints": ["10.0.0.5:2379"], "root": "/ftcomm",
//	 "caCert": "-----BEGIN CERTIFICATE-----…", "cert": "…", "key": "…",
//	 "user": "", "password": "",
//	 "quorumKeys": [{"id": "…", "ed25519": "<base64>"}],
//	 "gossipKey": "<base64>"}
//
// Every field may be empty: the etcd endpoints and key root; the CA that
// signs etcd's server certificate; a client certificate and key (etcd's
// client-cert authentication takes the user from its common name); an
// etcd user and password (for a cluster that uses passwords instead);
// the coordinators' quorum-verification keys (members then act only on
// quorums signed with one of them); and the gossip encryption key.
type Credentials struct {
	Version    int         `json:"version"`
	Endpoints  []string    `json:"endpoints,omitempty"`
	Root       string      `json:"root,omitempty"`
	CACert     string      `json:"caCert,omitempty"`
	Cert       string      `json:"cert,omitempty"`
	Key        string      `json:"key,omitempty"`
	User       string      `json:"user,omitempty"`
	Password   string      `json:"password,omitempty"`
	QuorumKeys []QuorumKey `json:"quorumKeys,omitempty"`
	GossipKey  []byte      `json:"gossipKey,omitempty"`
}

// LoadCredentials reads a credentials file.
func LoadCredentials(path string) (*Credentials, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("membership: credentials: %w", err)
	}
	var c Credentials
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("%w: membership: credentials file %s: %v", comm.ErrInvalidArgument, path, err)
	}
	if c.Version != CredentialsVersion {
		return nil, fmt.Errorf("%w: membership: credentials file %s has version %d; this program reads version %d",
			comm.ErrInvalidArgument, path, c.Version, CredentialsVersion)
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("%w (in %s)", err, path)
	}
	return &c, nil
}

// credentialsFromEnv loads the file CredentialsEnv names; nil and no
// error when it is unset.
func credentialsFromEnv() (*Credentials, error) {
	path := os.Getenv(CredentialsEnv)
	if path == "" {
		return nil, nil
	}
	c, err := LoadCredentials(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", CredentialsEnv, err)
	}
	return c, nil
}

// LoadCredentialsOrEnv loads the file at path, or when path is empty the
// one CredentialsEnv names; nil and no error when neither is set. The
// methods of a nil *Credentials add nothing (ClientConfig, ApplyMember).
func LoadCredentialsOrEnv(path string) (*Credentials, error) {
	if path == "" {
		return credentialsFromEnv()
	}
	return LoadCredentials(path)
}

// WriteCredentials stores c at path, readable by the owner only, with
// the format version LoadCredentials reads. The file is replaced through
// a temporary file and a rename, so a reader (a member following it)
// never sees it half written.
func WriteCredentials(path string, c *Credentials) error {
	cc := *c
	cc.Version = CredentialsVersion
	b, err := json.MarshalIndent(cc, "", "  ")
	if err != nil {
		return err
	}
	if err := renameio.WriteFile(path, append(b, '\n'), 0o600); err != nil {
		return fmt.Errorf("membership: write credentials: %w", err)
	}
	return nil
}

// Validate says what is wrong with the credentials, if anything.
func (c *Credentials) Validate() error {
	bad := func(f string, a ...any) error {
		return fmt.Errorf("%w: membership: credentials: "+f, append([]any{comm.ErrInvalidArgument}, a...)...)
	}
	if (c.Cert == "") != (c.Key == "") {
		return bad("a client certificate and its key go together")
	}
	if c.Password != "" && c.User == "" {
		return bad("a password needs a user")
	}
	switch len(c.GossipKey) {
	case 0, 16, 24, 32:
	default:
		return bad("gossip key has %d bytes; want 16, 24 or 32", len(c.GossipKey))
	}
	for _, k := range c.QuorumKeys {
		if len(k.Ed25519) != 32 {
			return bad("quorum key %q has %d bytes; want 32", k.ID, len(k.Ed25519))
		}
	}
	if _, err := c.TLS(); err != nil {
		return err
	}
	return nil
}

// TLS returns the client TLS configuration (nil when the credentials
// hold neither a CA nor a client certificate).
func (c *Credentials) TLS() (*tls.Config, error) {
	tc, err := etcdclient.TLS(c.CACert, c.Cert, c.Key)
	if err != nil {
		return nil, fmt.Errorf("%w: membership: credentials: %v", comm.ErrInvalidArgument, err)
	}
	return tc, nil
}

// ClientConfig is ClientConfig (ftcomm's client settings) with these
// credentials; endpoints nil: the credentials' own. On nil credentials it
// is ClientConfig(endpoints, lg).
func (c *Credentials) ClientConfig(endpoints []string, lg *zap.Logger) (clientv3.Config, error) {
	if c == nil {
		return ClientConfig(endpoints, lg), nil
	}
	if len(endpoints) == 0 {
		endpoints = c.Endpoints
	}
	if len(endpoints) == 0 {
		return clientv3.Config{}, fmt.Errorf("%w: membership: credentials name no etcd endpoints, and none were given", comm.ErrInvalidArgument)
	}
	cfg := ClientConfig(endpoints, lg)
	tc, err := c.TLS()
	if err != nil {
		return cfg, err
	}
	cfg.TLS, cfg.Username, cfg.Password = tc, c.User, c.Password
	return cfg, nil
}

// NewClient connects with these credentials to their endpoints.
func (c *Credentials) NewClient(lg *zap.Logger) (*clientv3.Client, error) {
	cfg, err := c.ClientConfig(nil, lg)
	if err != nil {
		return nil, err
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("membership: connect to %v: %w", cfg.Endpoints, err)
	}
	return cli, nil
}

// Verifier returns the verifier of the quorum keys (nil when there are
// none: quorums are then taken unverified).
func (c *Credentials) Verifier() *QuorumVerifier {
	if len(c.QuorumKeys) == 0 {
		return nil
	}
	return NewQuorumVerifier(c.QuorumKeys...)
}

// ApplyMember fills what a member configuration leaves empty from the
// credentials: the key root, the quorum verifier, and the gossip key (when
// gossip is on; the GossipConfig is copied, not changed in place). On nil
// credentials it does nothing.
func (c *Credentials) ApplyMember(mc *MemberConfig) {
	if c == nil {
		return
	}
	if mc.Root == "" && c.Root != "" {
		mc.Root = c.Root
	}
	if mc.QuorumVerifier == nil {
		mc.QuorumVerifier = c.Verifier()
	}
	if mc.Gossip != nil && len(mc.Gossip.SecretKey) == 0 && len(c.GossipKey) > 0 {
		g := *mc.Gossip
		g.SecretKey = slices.Clone(c.GossipKey)
		mc.Gossip = &g
	}
}

// followInterval is how often Follow reads the credentials file while its
// client has no working connection.
const followInterval = time.Second

// Follow keeps cli, made with credentials c, on the endpoints of the
// credentials file at path, until ctx ends (give it cli.Ctx(): for the
// client's life). While cli has no working connection (its endpoints all
// fail), Follow reads the file every followInterval; when the endpoints
// there differ from cli's — the coordinator was restarted elsewhere or on
// another port, and rewrote the file — it moves cli to them
// (SetEndpoints), and the calls, watches and lease keepalives made through
// cli carry on there. While cli is connected the file is not read. A file
// whose certificates or identity differ from c's is not followed (a new
// CA: the client would not be let in): Follow says so once, and the
// trainer must be restarted with the new file. lg nil: no logs.
func (c *Credentials) Follow(ctx context.Context, cli *clientv3.Client, path string, lg *zap.Logger) {
	if lg == nil {
		lg = zap.NewNop()
	}
	t := time.NewTicker(followInterval)
	defer t.Stop()
	var refused []string // the endpoints of a file not followed, said once
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if cc := cli.ActiveConnection(); cc == nil || cc.GetState() == connectivity.Ready {
			continue
		}
		now, err := LoadCredentials(path)
		if err != nil || len(now.Endpoints) == 0 || slices.Equal(now.Endpoints, cli.Endpoints()) {
			continue // being replaced, or nothing new: the client keeps trying
		}
		if now.CACert != c.CACert || now.Cert != c.Cert || now.Key != c.Key || now.User != c.User || now.Password != c.Password {
			if !slices.Equal(refused, now.Endpoints) {
				refused = now.Endpoints
				lg.Error("the coordinator's etcd does not answer at "+fmt.Sprint(cli.Endpoints())+
					"; the credentials file names other endpoints but other certificates or another identity: restart this trainer with the new file",
					zap.String("file", path), zap.Strings("endpoints", now.Endpoints))
			}
			continue
		}
		lg.Warn("the coordinator's etcd does not answer at the endpoints this trainer used; the credentials file names others now: moving there",
			zap.String("file", path), zap.Strings("from", cli.Endpoints()), zap.Strings("to", now.Endpoints))
		cli.SetEndpoints(now.Endpoints...)
	}
}
