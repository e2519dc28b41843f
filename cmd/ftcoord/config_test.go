package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestConfigErrors(t *testing.T) {
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }
	var out, errb bytes.Buffer
	run1 := func(args ...string) int {
		out.Reset()
		errb.Reset()
		return run(args, getenv, &out, &errb)
	}
	if code := run1(); code != 2 || !strings.Contains(errb.String(), "Usage") {
		t.Fatalf("no args: %d %q", code, errb.String())
	}
	if code := run1("frobnicate"); code != 2 || !strings.Contains(errb.String(), `unknown command "frobnicate"`) {
		t.Fatalf("unknown: %d %q", code, errb.String())
	}
	code := run1("serve", "-listen", "nope", "-session-ttl", "1s", "-tls-cert", "c.pem", "-etcd-password", "pw", "-root", "x", "-log-level", "loud")
	msg := errb.String()
	if code != 2 {
		t.Fatalf("exit %d", code)
	}
	for _, want := range []string{`-listen "nope"`, "-session-ttl 1s", "-tls-cert and -tls-key", "-etcd-password needs -etcd-user", `-root "x"`, `-log-level "loud"`} {
		if !strings.Contains(msg, want) {
			t.Errorf("message lacks %q:\n%s", want, msg)
		}
	}
	code = run1("serve", "-evict-keep-out", "-1s", "-trainer-etcd-password", "pw", "-etcd-advertise-addr", "nohost", "-trainer-etcd-cert", "c.pem")
	msg = errb.String()
	for _, want := range []string{"-evict-keep-out -1s", "-trainer-etcd-password needs -trainer-etcd-user", `-etcd-advertise-addr "nohost"`, "-trainer-etcd-* apply to an external etcd", "-trainer-etcd-cert and -trainer-etcd-key"} {
		if code != 2 || !strings.Contains(msg, want) {
			t.Errorf("exit %d, message lacks %q:\n%s", code, want, msg)
		}
	}
	if code := run1("serve", "-etcd", "h:1", "-etcd-cert-hosts", "x"); code != 2 || !strings.Contains(errb.String(), "apply to the embedded etcd") {
		t.Errorf("cert hosts with -etcd: %d %q", code, errb.String())
	}
	if code := run1("serve", "-min-replicas", "many"); code != 2 || !strings.Contains(errb.String(), "invalid value") {
		t.Fatalf("bad int: %d %q", code, errb.String())
	}
	// Environment variables set flags; the command line wins.
	env["FTCOORD_MIN_REPLICAS"] = "0"
	env["FTCOORD_GOSSIP_KEY"] = "abcd"
	if code := run1("serve"); code != 2 || !strings.Contains(errb.String(), "-min-replicas 0") || !strings.Contains(errb.String(), "SecretKey has 2 bytes") {
		t.Fatalf("env: %d %q", code, errb.String())
	}
	env["FTCOORD_MIN_REPLICAS"] = "x"
	if code := run1("serve"); code != 2 || !strings.Contains(errb.String(), `FTCOORD_MIN_REPLICAS="x"`) {
		t.Fatalf("bad env: %d %q", code, errb.String())
	}
	delete(env, "FTCOORD_MIN_REPLICAS")
	delete(env, "FTCOORD_GOSSIP_KEY")
	cfg := defaultServeConfig()
	env["FTCOORD_JOIN_TIMEOUT"] = "3s"
	fsCfg := cfg
	fs := newServeFlagSet(&fsCfg)
	if err := parseFlags(fs, []string{"-join-timeout", "5s"}, getenv); err != nil || fsCfg.JoinTimeout != 5*time.Second {
		t.Fatalf("flag should win over env: %v %v", err, fsCfg.JoinTimeout)
	}
	fsCfg = cfg
	fs = newServeFlagSet(&fsCfg)
	if err := parseFlags(fs, nil, getenv); err != nil || fsCfg.JoinTimeout != 3*time.Second {
		t.Fatalf("env not applied: %v %v", err, fsCfg.JoinTimeout)
	}
	if code := run1("status", "-addr", "ftp://x"); code != 2 || !strings.Contains(errb.String(), "-addr") {
		t.Fatalf("status: %d %q", code, errb.String())
	}
	if def := defaultServeConfig(); def.validate() != nil {
		err := def.validate()
		t.Fatalf("defaults invalid: %v", err)
	}
}
