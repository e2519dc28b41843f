package etcdhost

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/google/renameio/v2"
)

// The etcd users of a secured embedded etcd. Each has a client
// certificate whose common name is the user name (etcd's client-cert
// authentication); see ConfigureAuth for what each may do.
const (
	UserRoot        = "root"    // etcd's administrator: auth set-up only
	UserCoordinator = "ftcoord" // coordinators: everything under the root
	UserTrainer     = "trainer" // members: their jobs' keys, read the rest
)

// PKI lifetimes: the CA outlives many leaf certificates; a leaf is
// renewed at start when it expires within pkiRenewBefore (the CA stays, so
// credentials already handed out keep working until their own expiry).
const (
	pkiCALife      = 10 * 365 * 24 * time.Hour
	pkiLeafLife    = 2 * 365 * 24 * time.Hour
	pkiRenewBefore = 30 * 24 * time.Hour
)

// pki is the certificate authority of a secured embedded etcd, kept in
// <data dir>/pki: ca.pem and ca-key.pem, server.pem and server-key.pem,
// and <user>.pem and <user>-key.pem for each etcd user. Private keys are
// 0600.
type pki struct {
	dir    string
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	caPEM  []byte
	server tls.Certificate
}

// ensurePKI loads the CA in dir (creating one on first use), and renews
// the server certificate (SANs: hosts) and each user's client certificate
// when missing, expiring soon, or (the server's) not covering hosts.
func ensurePKI(dir string, hosts []string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("etcdhost: pki: %w", err)
	}
	p := &pki{dir: dir}
	caFile, caKeyFile := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	if _, err := os.Stat(caFile); errors.Is(err, os.ErrNotExist) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("etcdhost: pki: %w", err)
		}
		tmpl := &x509.Certificate{
			SerialNumber:          serial(),
			Subject:               pkix.Name{CommonName: "ftcomm etcd CA", Organization: []string{"ftcomm"}},
			NotBefore:             time.Now().Add(-time.Hour),
			NotAfter:              time.Now().Add(pkiCALife),
			KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
			IsCA:                  true,
			BasicConstraintsValid: true,
			MaxPathLenZero:        true,
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
		if err != nil {
			return nil, fmt.Errorf("etcdhost: pki: %w", err)
		}
		if err := writePEMPair(caFile, caKeyFile, der, key); err != nil {
			return nil, err
		}
	}
	var err error
	if p.ca, p.caKey, p.caPEM, err = loadPair(caFile, caKeyFile); err != nil {
		return nil, err
	}
	if time.Until(p.ca.NotAfter) < pkiRenewBefore {
		return nil, fmt.Errorf("etcdhost: pki: the CA in %s expires %s: move the pki directory away to make a new one (and hand out new credentials)", dir, p.ca.NotAfter.Format(time.DateOnly))
	}
	if err := p.ensureLeaf("server", "ftcomm etcd server", true, hosts); err != nil {
		return nil, err
	}
	for _, u := range []string{UserRoot, UserCoordinator, UserTrainer} {
		if err := p.ensureLeaf(u, u, false, nil); err != nil {
			return nil, err
		}
	}
	if p.server, err = tls.LoadX509KeyPair(p.certFile("server"), p.keyFile("server")); err != nil {
		return nil, fmt.Errorf("etcdhost: pki: %w", err)
	}
	return p, nil
}

// WritePKI makes in dir the certificates a secured external etcd and
// its clients need, as a Secure embedded etcd keeps them in <Dir>/pki:
// ca.pem and ca-key.pem (the CA), server.pem and server-key.pem (etcd's
// server and peer certificate, covering loopback and hosts), and
// <user>.pem and <user>-key.pem for UserRoot, UserCoordinator and
// UserTrainer (client certificates whose common name is the user, for
// etcd's --client-cert-auth). What is there and valid is kept: the CA
// always, a leaf until it nears expiry, the server's while it covers
// hosts. Private keys are 0600.
func WritePKI(dir string, hosts []string) error {
	_, err := ensurePKI(dir, certHosts("", hosts))
	return err
}

func (p *pki) certFile(name string) string { return filepath.Join(p.dir, name+".pem") }
func (p *pki) keyFile(name string) string  { return filepath.Join(p.dir, name+"-key.pem") }
func (p *pki) caFile() string              { return filepath.Join(p.dir, "ca.pem") }

// ensureLeaf issues name.pem unless a valid one signed by the CA exists
// (for a server certificate: one that also covers hosts).
func (p *pki) ensureLeaf(name, cn string, server bool, hosts []string) error {
	if cert, _, _, err := loadPair(p.certFile(name), p.keyFile(name)); err == nil &&
		cert.CheckSignatureFrom(p.ca) == nil && time.Until(cert.NotAfter) > pkiRenewBefore && (!server || covers(cert, hosts)) {
		return nil
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("etcdhost: pki: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: cn, Organization: []string{"ftcomm"}},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(pkiLeafLife),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if server {
		// etcd dials itself and its peers with the server certificate.
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		for _, h := range hosts {
			if ip := net.ParseIP(h); ip != nil {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			} else {
				tmpl.DNSNames = append(tmpl.DNSNames, h)
			}
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		return fmt.Errorf("etcdhost: pki: issue %s: %w", name, err)
	}
	return writePEMPair(p.certFile(name), p.keyFile(name), der, key)
}

// covers reports whether a server certificate names every host.
func covers(cert *x509.Certificate, hosts []string) bool {
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			if !slices.ContainsFunc(cert.IPAddresses, ip.Equal) {
				return false
			}
		} else if !slices.Contains(cert.DNSNames, h) {
			return false
		}
	}
	return true
}

// clientPEM returns a user's certificate and key, PEM.
func (p *pki) clientPEM(user string) (cert, key []byte, err error) {
	if cert, err = os.ReadFile(p.certFile(user)); err != nil {
		return nil, nil, fmt.Errorf("etcdhost: pki: %w", err)
	}
	if key, err = os.ReadFile(p.keyFile(user)); err != nil {
		return nil, nil, fmt.Errorf("etcdhost: pki: %w", err)
	}
	return cert, key, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}

// writePEMPair writes a certificate (0644) and its key (0600), each
// through a temporary file and a rename.
func writePEMPair(certFile, keyFile string, der []byte, key *ecdsa.PrivateKey) error {
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("etcdhost: pki: %w", err)
	}
	if err := writeFileAtomic(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		return err
	}
	return writeFileAtomic(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
}

// loadPair reads a PEM certificate and its EC key.
func loadPair(certFile, keyFile string) (*x509.Certificate, *ecdsa.PrivateKey, []byte, error) {
	cb, err := os.ReadFile(certFile)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("etcdhost: pki: %w", err)
	}
	kb, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("etcdhost: pki: %w", err)
	}
	cblk, _ := pem.Decode(cb)
	kblk, _ := pem.Decode(kb)
	if cblk == nil || kblk == nil {
		return nil, nil, nil, fmt.Errorf("etcdhost: pki: %s or %s holds no PEM block", certFile, keyFile)
	}
	cert, err := x509.ParseCertificate(cblk.Bytes)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("etcdhost: pki: %s: %w", certFile, err)
	}
	key, err := x509.ParseECPrivateKey(kblk.Bytes)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("etcdhost: pki: %s: %w", keyFile, err)
	}
	return cert, key, cb, nil
}

// certHosts returns the names a server certificate needs for a listen
// address: its host (every local address and the host name when it is
// unspecified), loopback, and extra.
func certHosts(listenHost string, extra []string) []string {
	hosts := []string{"127.0.0.1", "::1", "localhost"}
	add := func(h string) {
		if h != "" && !slices.Contains(hosts, h) {
			hosts = append(hosts, h)
		}
	}
	if ip := net.ParseIP(listenHost); ip != nil && ip.IsUnspecified() {
		if name, err := os.Hostname(); err == nil {
			add(name)
		}
		if addrs, err := net.InterfaceAddrs(); err == nil {
			for _, a := range addrs {
				if n, ok := a.(*net.IPNet); ok {
					add(n.IP.String())
				}
			}
		}
	} else {
		add(listenHost)
	}
	for _, h := range extra {
		add(h)
	}
	return hosts
}

// writeFileAtomic writes data to path through a temporary file in the
// same directory, a sync and a rename, with the given permissions.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	if err := renameio.WriteFile(path, data, perm); err != nil {
		return fmt.Errorf("etcdhost: write %s: %w", path, err)
	}
	return nil
}
