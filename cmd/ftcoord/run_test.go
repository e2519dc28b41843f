package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/coordinator/server"
	"github.com/ftcomm/ftcomm/internal/testutil"
	"github.com/ftcomm/ftcomm/membership"
)

// `ftcoord job new-run <job>` starts a new run through the API: refused,
// naming them, while the job has live members; then the run starts, and
// `ftcoord status -job` names it.
func TestJobNewRunCommand(t *testing.T) {
	sc := server.DefaultConfig()
	sc.DataDir, sc.Listen, sc.Name, sc.Insecure, sc.UnsafeNoFsync, sc.Gossip = t.TempDir(), "127.0.0.1:0", "c", true, true, nil
	s, err := server.New(testutil.Ctx(t, 30*time.Second), sc)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(context.Background()) }()
	defer func() { s.Close(); <-served }()
	creds, err := membership.LoadCredentials(s.CredentialsPath())
	if err != nil {
		t.Fatal(err)
	}
	cli, err := creds.NewClient(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	a := joinMember(t, cli, creds, "demo", "a", nil)
	first := a.Run()

	cmd := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := run(args, func(string) string { return "" }, &out, &errb)
		return code, out.String(), errb.String()
	}
	if code, _, errs := cmd("job", "new-run", "-addr", s.URL(), "demo"); code != 1 || !strings.Contains(errs, "409") || !strings.Contains(errs, "live members (a)") {
		t.Fatalf("new-run beside a live member: %d %s", code, errs)
	}
	if err := a.Leave(testutil.Ctx(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	code, out, errs := cmd("job", "new-run", "-addr", s.URL(), "-run", "r2", "demo")
	if code != 0 || !strings.Contains(out, "job demo: run r2 started; run "+first+" ended.") {
		t.Fatalf("new-run: %d %s %s", code, out, errs)
	}
	if code, out, errs := cmd("status", "-addr", s.URL(), "-job", "demo"); code != 0 || !strings.Contains(out, "r2, started") {
		t.Fatalf("status: %d %s %s", code, out, errs)
	}
	if code, _, errs := cmd("job", "new-run", "-addr", s.URL()); code != 2 || !strings.Contains(errs, "which job?") {
		t.Fatalf("new-run without a job: %d %s", code, errs)
	}
}
