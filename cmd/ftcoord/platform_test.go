package main

import (
	"bytes"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/membership"
)

func runCmd(t *testing.T, env map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(args, func(k string) string { return env[k] }, &out, &errb)
	return code, out.String(), errb.String()
}

func TestVersion(t *testing.T) {
	for _, arg := range []string{"version", "--version", "-version"} {
		code, out, _ := runCmd(t, nil, arg)
		if code != 0 || !strings.HasPrefix(out, "ftcoord ") || !strings.Contains(out, "go1.") {
			t.Errorf("%s: %d %q", arg, code, out)
		}
	}
	b := buildOf(nil, false)
	if b.Version != "devel" || b.Revision != "" {
		t.Errorf("no build info: %+v", b)
	}
}

// Every flag of every command names its environment variable in -h.
func TestHelpShowsEnv(t *testing.T) {
	for name, mk := range commands() {
		code, _, help := runCmd(t, nil, name, "-h")
		if code != 0 || !strings.Contains(help, "Usage: ftcoord "+name) {
			t.Fatalf("%s -h: %d %q", name, code, help)
		}
		c := mk()
		fs := flag.NewFlagSet(name, flag.ContinueOnError)
		c.flags(fs)
		fs.VisitAll(func(f *flag.Flag) {
			if !strings.Contains(help, "[$"+envName(f.Name)+"]") {
				t.Errorf("%s -h does not name %s", name, envName(f.Name))
			}
		})
	}
}

func TestDefaultName(t *testing.T) {
	for host, want := range map[string]string{
		"ftcoord-0":        "ftcoord-0",
		"node7.example.io": "node7.example.io",
		"my host!":         "my-host-",
		"-x":               "x",
		"":                 "ftcoord",
	} {
		if got := defaultName(func() (string, error) { return host, nil }); got != want {
			t.Errorf("host %q: name %q, want %q", host, got, want)
		}
	}
	if got := defaultName(func() (string, error) { return "", errors.New("no") }); got != "ftcoord" {
		t.Errorf("no host name: %q", got)
	}
	if n := defaultServeConfig().Name; n != defaultName(os.Hostname) {
		t.Errorf("default -name %q, not the host name", n)
	}
}

// -advertise-host completes the API's, etcd's and gossip's advertised
// addresses with their listen ports; explicit ones win; a port the OS
// would pick cannot be advertised.
func TestAdvertiseHost(t *testing.T) {
	code, _, msg := runCmd(t, nil, "serve", "-advertise-host", "10.1.2.3")
	if code != 2 || !strings.Contains(msg, "fixed port in -etcd-client-addr") || !strings.Contains(msg, "fixed port in -gossip-addr") ||
		strings.Contains(msg, "-listen") {
		t.Fatalf("ports 0: %d %q", code, msg)
	}
	if code, _, msg := runCmd(t, nil, "serve", "-advertise-host", "10.1.2.3:80"); code != 2 || !strings.Contains(msg, "without a port") {
		t.Fatalf("host with port: %d %q", code, msg)
	}
	cfg := defaultServeConfig()
	fs := newServeFlagSet(&cfg)
	env := map[string]string{"FTCOORD_ADVERTISE_HOST": "10.1.2.3", "FTCOORD_LISTEN": "0.0.0.0:8080",
		"FTCOORD_ETCD_CLIENT_ADDR": "0.0.0.0:2379", "FTCOORD_GOSSIP_ADDR": "0.0.0.0:7946"}
	if err := parseFlags(fs, []string{"-gossip-advertise", "gossip.example:7000"}, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	sc, err := cfg.serverConfig()
	if err != nil {
		t.Fatal(err)
	}
	if sc.Advertise != "10.1.2.3:8080" || sc.EtcdAdvertiseAddr != "10.1.2.3:2379" || sc.Gossip.AdvertiseAddr != "gossip.example:7000" || sc.Listen != "0.0.0.0:8080" {
		t.Fatalf("advertise %q, etcd %q, gossip %q, listen %q", sc.Advertise, sc.EtcdAdvertiseAddr, sc.Gossip.AdvertiseAddr, sc.Listen)
	}
}

func TestLogFormat(t *testing.T) {
	if code, _, msg := runCmd(t, nil, "serve", "-log-format", "xml"); code != 2 || !strings.Contains(msg, `-log-format "xml"`) {
		t.Fatalf("bad format: %d %q", code, msg)
	}
	var buf bytes.Buffer
	newLogger("info", "json", &buf).Info("serving", zap.String("url", "http://x"))
	var line map[string]any
	if err := json.Unmarshal(buf.Bytes(), &line); err != nil || line["msg"] != "serving" || line["url"] != "http://x" || line["level"] != "info" || line["ts"] == nil {
		t.Fatalf("json log %q: %v", buf.String(), err)
	}
}

// certs, secrets and credentials: the files an external etcd set-up needs.
func TestSetupCommands(t *testing.T) {
	dir := t.TempDir()
	pki := filepath.Join(dir, "pki")
	code, out, msg := runCmd(t, nil, "certs", "-dir", pki, "-hosts", "etcd-0.etcd.ftcomm.svc,10.9.8.7")
	if code != 0 || !strings.Contains(out, "server.pem") {
		t.Fatalf("certs: %d %q %q", code, out, msg)
	}
	b, err := os.ReadFile(filepath.Join(pki, "server.pem"))
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{"etcd-0.etcd.ftcomm.svc", "10.9.8.7", "localhost", "127.0.0.1"} {
		if cert.VerifyHostname(h) != nil {
			t.Errorf("server certificate does not cover %s", h)
		}
	}
	for _, u := range []string{"root", "ftcoord", "trainer"} {
		if fi, err := os.Stat(filepath.Join(pki, u+"-key.pem")); err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("%s key: %v %v", u, fi, err)
		}
	}

	secrets := filepath.Join(dir, "coordinator-secrets.json")
	env := map[string]string{"FTCOORD_SECRETS_FILE": secrets}
	if code, out, msg := runCmd(t, env, "secrets"); code != 0 || !strings.HasPrefix(out, "created") {
		t.Fatalf("secrets: %d %q %q", code, out, msg)
	}
	first, _ := os.ReadFile(secrets)
	if code, out, _ := runCmd(t, env, "secrets"); code != 0 || !strings.HasPrefix(out, "kept") {
		t.Fatalf("secrets again: %d %q", code, out)
	}
	if again, _ := os.ReadFile(secrets); !bytes.Equal(first, again) {
		t.Fatal("secrets rewritten")
	}

	credsFile := filepath.Join(dir, "data", "trainer-credentials.json")
	os.MkdirAll(filepath.Dir(credsFile), 0o700)
	if code, _, msg := runCmd(t, map[string]string{"FTCOORD_DATA_DIR": filepath.Join(dir, "data")}, "credentials"); code != 1 || !strings.Contains(msg, "no such file") {
		t.Fatalf("credentials before serve: %d %q", code, msg)
	}
	c := &membership.Credentials{Endpoints: []string{"etcd-0:2379"}, Root: "/ftcomm"}
	if err := membership.WriteCredentials(credsFile, c); err != nil {
		t.Fatal(err)
	}
	want, _ := os.ReadFile(credsFile)
	if code, out, msg := runCmd(t, map[string]string{"FTCOORD_DATA_DIR": filepath.Join(dir, "data")}, "credentials"); code != 0 || out != string(want) {
		t.Fatalf("credentials: %d %q %q", code, out, msg)
	}

	if code, _, msg := runCmd(t, nil, "etcd-init", "-etcd-cert", "x.pem", "-root", "r"); code != 2 ||
		!strings.Contains(msg, "-etcd is required") || !strings.Contains(msg, "-etcd-cert and -etcd-key") || !strings.Contains(msg, `-root "r"`) {
		t.Fatalf("etcd-init: %d %q", code, msg)
	}
}

func TestUnknownEnv(t *testing.T) {
	got := unknownEnv([]string{"FTCOORD_DATA_DIR=/d", "FTCOORD_SESION_TTL=3s", "FTCOORD_ADDR=http://x", "HOME=/root", "FTCOORD_HOSTS=a"})
	if len(got) != 1 || got[0] != "FTCOORD_SESION_TTL" {
		t.Fatalf("unknown: %q", got)
	}
}
