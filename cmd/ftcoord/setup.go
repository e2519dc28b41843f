package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ftcomm/ftcomm/internal/etcdkeys"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/coordinator"
	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/membership"
)

// credentialsConfig is `ftcoord credentials`: print the trainers'
// credentials file that `ftcoord serve` wrote. Its flags are serve's, so
// that in a container (kubectl exec) it finds the file through the same
// environment.
type credentialsConfig struct {
	DataDir, CredentialsFile string
}

func defaultCredentialsConfig() credentialsConfig {
	return credentialsConfig{DataDir: defaultServeConfig().DataDir}
}

func (c *credentialsConfig) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.DataDir, "data-dir", c.DataDir, "serve's data `dir`ectory")
	fs.StringVar(&c.CredentialsFile, "credentials-file", c.CredentialsFile, "the credentials `file` (default <data-dir>/trainer-credentials.json)")
}

func (c *credentialsConfig) validate() error {
	if c.DataDir == "" && c.CredentialsFile == "" {
		return errors.New("invalid configuration:\n  give -data-dir or -credentials-file")
	}
	return nil
}

func (c *credentialsConfig) path() string {
	if c.CredentialsFile != "" {
		return c.CredentialsFile
	}
	return filepath.Join(c.DataDir, "trainer-credentials.json")
}

// print checks the file and copies it to w.
func (c *credentialsConfig) print(w io.Writer) error {
	if _, err := membership.LoadCredentials(c.path()); err != nil {
		return err
	}
	b, err := os.ReadFile(c.path())
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// certsConfig is `ftcoord certs`: the certificates of a secured external
// etcd and its clients, made with the same code as the embedded etcd's.
type certsConfig struct {
	Dir   string
	Hosts string
}

func defaultCertsConfig() certsConfig { return certsConfig{Dir: "./pki"} }

func (c *certsConfig) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.Dir, "dir", c.Dir, "`dir`ectory of the certificates: an existing CA there is kept and signs the rest")
	fs.StringVar(&c.Hosts, "hosts", c.Hosts, "`names` and IP addresses (comma-separated) etcd's server certificate covers besides loopback: every name clients and peers dial")
}

func (c *certsConfig) validate() error {
	if c.Dir == "" {
		return errors.New("invalid configuration:\n  -dir must not be empty")
	}
	return nil
}

func (c *certsConfig) hosts() []string {
	var hs []string
	for _, h := range strings.Split(c.Hosts, ",") {
		if h = strings.TrimSpace(h); h != "" {
			hs = append(hs, h)
		}
	}
	return hs
}

func (c *certsConfig) make(w io.Writer) error {
	if err := etcdhost.WritePKI(c.Dir, c.hosts()); err != nil {
		return err
	}
	fmt.Fprintf(w, `certificates in %s:
  ca.pem                          the CA: etcd's --trusted-ca-file and --peer-trusted-ca-file, ftcoord's -etcd-cacert
  ca-key.pem                      the CA's key: keep it off the servers
  server.pem, server-key.pem      etcd's --cert-file/--key-file and --peer-cert-file/--peer-key-file (covers %s)
  root.pem, root-key.pem          etcd's root user: ftcoord etcd-init -etcd-cert/-etcd-key
  ftcoord.pem, ftcoord-key.pem    the coordinators: ftcoord serve -etcd-cert/-etcd-key
  trainer.pem, trainer-key.pem    the trainers: ftcoord serve -trainer-etcd-cert/-trainer-etcd-key
`, c.Dir, strings.Join(append([]string{"loopback"}, c.hosts()...), ", "))
	return nil
}

// secretsConfig is `ftcoord secrets`: the keys every coordinator of a
// root shares, made once before starting several.
type secretsConfig struct {
	SecretsFile string
}

func defaultSecretsConfig() secretsConfig {
	return secretsConfig{SecretsFile: "./coordinator-secrets.json"}
}

func (c *secretsConfig) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.SecretsFile, "secrets-file", c.SecretsFile, "the `file` to create (0600); an existing one is kept")
}

func (c *secretsConfig) validate() error {
	if c.SecretsFile == "" {
		return errors.New("invalid configuration:\n  -secrets-file must not be empty")
	}
	return nil
}

func (c *secretsConfig) make(w io.Writer) error {
	s, created, err := coordinator.LoadOrCreateSecrets(c.SecretsFile)
	if err != nil {
		return err
	}
	signer, err := s.Signer()
	if err != nil {
		return err
	}
	what := "kept the existing"
	if created {
		what = "created"
	}
	fmt.Fprintf(w, "%s %s (quorum key %s): give it to every coordinator (-secrets-file), never to trainers\n", what, c.SecretsFile, signer.KeyID())
	return nil
}

// etcdInitConfig is `ftcoord etcd-init`: etcdhost.ConfigureAuth on an
// external etcd, as its root user.
type etcdInitConfig struct {
	Etcd                          string
	EtcdCACert, EtcdCert, EtcdKey string
	EtcdUser, EtcdPassword        string
	Root                          string
	Timeout                       time.Duration
}

func defaultEtcdInitConfig() etcdInitConfig {
	return etcdInitConfig{Root: etcdkeys.DefaultRoot, Timeout: 30 * time.Second}
}

func (c *etcdInitConfig) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.Etcd, "etcd", c.Etcd, "etcd `endpoints` (host:port,…)")
	fs.StringVar(&c.EtcdCACert, "etcd-cacert", c.EtcdCACert, "CA `file` to verify the etcd servers")
	fs.StringVar(&c.EtcdCert, "etcd-cert", c.EtcdCert, "root's client certificate `file` (common name root)")
	fs.StringVar(&c.EtcdKey, "etcd-key", c.EtcdKey, "root's client key `file`")
	fs.StringVar(&c.EtcdUser, "etcd-user", c.EtcdUser, "etcd `user` with the root role, when not by certificate")
	fs.StringVar(&c.EtcdPassword, "etcd-password", c.EtcdPassword, "that user's `password` (prefer FTCOORD_ETCD_PASSWORD)")
	fs.StringVar(&c.Root, "root", c.Root, "etcd key `prefix` of all jobs, as ftcoord serve's -root")
	fs.DurationVar(&c.Timeout, "timeout", c.Timeout, "give up after this long")
}

func (c *etcdInitConfig) validate() error {
	var probs []string
	if c.Etcd == "" {
		probs = append(probs, "-etcd is required")
	}
	for _, ep := range strings.Split(c.Etcd, ",") {
		if ep = strings.TrimSpace(ep); ep == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(strings.TrimPrefix(strings.TrimPrefix(ep, "http://"), "https://")); err != nil {
			probs = append(probs, fmt.Sprintf("-etcd %q is not host:port", ep))
		}
	}
	if (c.EtcdCert == "") != (c.EtcdKey == "") {
		probs = append(probs, "-etcd-cert and -etcd-key go together")
	}
	if c.EtcdPassword != "" && c.EtcdUser == "" {
		probs = append(probs, "-etcd-password needs -etcd-user")
	}
	if !strings.HasPrefix(c.Root, "/") {
		probs = append(probs, fmt.Sprintf("-root %q must start with /", c.Root))
	}
	if c.Timeout <= 0 {
		probs = append(probs, fmt.Sprintf("-timeout %v must be positive", c.Timeout))
	}
	if len(probs) > 0 {
		return fmt.Errorf("invalid configuration:\n  %s", strings.Join(probs, "\n  "))
	}
	return nil
}

func (c *etcdInitConfig) init(ctx context.Context, w io.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, c.Timeout)
	defer cancel()
	var eps []string
	for _, ep := range strings.Split(c.Etcd, ",") {
		if ep = strings.TrimSpace(ep); ep != "" {
			eps = append(eps, ep)
		}
	}
	cc := membership.ClientConfig(eps, zap.NewNop())
	if c.EtcdCACert != "" || c.EtcdCert != "" {
		tc, err := (transport.TLSInfo{CertFile: c.EtcdCert, KeyFile: c.EtcdKey, TrustedCAFile: c.EtcdCACert}).ClientConfig()
		if err != nil {
			return fmt.Errorf("etcd TLS: %w", err)
		}
		cc.TLS = tc
	}
	cc.Username, cc.Password, cc.Context = c.EtcdUser, c.EtcdPassword, ctx
	cli, err := clientv3.New(cc)
	if err != nil {
		return err
	}
	defer cli.Close()
	if err := etcdhost.ConfigureAuth(ctx, cli, c.Root); err != nil {
		return err
	}
	all, trainer := etcdhost.AuthRanges(c.Root)
	fmt.Fprintf(w, "etcd at %s: authentication on; users %s (role root), %s (role %s: read-write %s), %s (role %s: read %s, write all of it but %s_…)\n",
		strings.Join(eps, ","), etcdhost.UserRoot, etcdhost.UserCoordinator, etcdhost.RoleCoordinator, all[0][0],
		etcdhost.UserTrainer, etcdhost.RoleTrainer, all[0][0], trainer[0][0])
	return nil
}
