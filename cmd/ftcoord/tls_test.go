package main

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/testutil"
)

// selfSigned writes a certificate for 127.0.0.1 and its key to dir.
func selfSigned(t *testing.T, dir string) (certFile, keyFile string) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "ftcoord test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IPAddresses:           []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA:                  true,
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile
}

// HTTPS API with a token; etcd auth passed through to an external etcd.
func TestServeProcessTLSAndEtcdAuth(t *testing.T) {
	ctx := testutil.Ctx(t, 90*time.Second)
	// An external etcd with authentication on.
	ec := etcdhost.DefaultEmbeddedConfig()
	ec.UnsafeNoFsync = true
	e, err := etcdhost.StartEmbedded(ctx, ec)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	cli, err := e.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.UserAdd(ctx, "root", "rootpw"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.UserGrantRole(ctx, "root", "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.AuthEnable(ctx); err != nil {
		t.Fatal(err)
	}

	dir := t.TempDir()
	cert, key := selfSigned(t, dir)
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("tls-token\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startFtcoord(t, "secure", "-etcd", e.Endpoints()[0], "-etcd-user", "root", "-etcd-password", "rootpw",
		"-tls-cert", cert, "-tls-key", key, "-token-file", tokenFile)
	p.waitLog(t, "\tleading\t", 30*time.Second)
	if !strings.HasPrefix(p.url, "https://") {
		t.Fatalf("url %s", p.url)
	}
	var out, errb bytes.Buffer
	noEnv := func(string) string { return "" }
	if code := run([]string{"status", "-addr", p.url, "-cacert", cert, "-token", "tls-token"}, noEnv, &out, &errb); code != 0 {
		t.Fatalf("status over TLS: %d %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "leader secure") {
		t.Fatalf("status:\n%s", out.String())
	}
	errb.Reset()
	if code := run([]string{"status", "-addr", p.url, "-token", "tls-token"}, noEnv, &out, &errb); code != 1 || !strings.Contains(errb.String(), "certificate") {
		t.Fatalf("status without the CA: %d %q", code, errb.String())
	}

	// Without credentials the same etcd refuses the coordinator.
	bad := startFtcoordNoWait(t, "noauth", "-etcd", e.Endpoints()[0])
	bad.waitLog(t, "leadership ended", 30*time.Second)
	if !strings.Contains(bad.output(), "user name is empty") && !strings.Contains(bad.output(), "permission denied") {
		t.Fatalf("no auth error in logs:\n%s", bad.output())
	}
}
