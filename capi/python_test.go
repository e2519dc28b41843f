package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// TestPython builds libftcomm.so and runs the Python package's tests
// (python/tests, pytest) against it with Debian's /usr/bin/python3 (or
// $FTCOMM_PYTHON), so that the README's one test command covers them. It
// skips when that Python cannot import torch, numpy and pytest, unless
// FTCOMM_REQUIRE_PYTHON is set (CI sets it: there a missing package is a
// failure, not a skip).
func TestPython(t *testing.T) {
	py := os.Getenv("FTCOMM_PYTHON")
	if py == "" {
		py = "/usr/bin/python3"
	}
	if out, err := exec.Command(py, "-c", "import torch, numpy, pytest").CombinedOutput(); err != nil {
		if os.Getenv("FTCOMM_REQUIRE_PYTHON") == "" {
			t.Skipf("%s cannot import torch, numpy and pytest (%v: %s); apt-get install python3-torch python3-numpy python3-pytest, or set FTCOMM_REQUIRE_PYTHON=1 to fail instead", py, err, out)
		}
		t.Fatalf("FTCOMM_REQUIRE_PYTHON is set, but %s cannot import torch, numpy and pytest: %v: %s", py, err, out)
	}
	ctx := context.Background()
	if d, ok := t.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, d.Add(-30*time.Second))
		defer cancel()
	}
	lib := filepath.Join(t.TempDir(), "libftcomm.so")
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("building libftcomm.so needs the go command: %v", err)
	}
	build := exec.CommandContext(ctx, gobin, "build", "-buildmode=c-shared", "-o", lib, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build -buildmode=c-shared: %v\n%s", err, out)
	}
	pkg, err := filepath.Abs("../python")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=120", "tests")
	cmd.Dir = pkg
	cmd.Env = append(os.Environ(), "FTCOMM_LIBRARY="+lib, "PYTHONPATH="+pkg, "PYTHONDONTWRITEBYTECODE=1")
	cmd.WaitDelay = 10 * time.Second
	out, err := cmd.CombinedOutput()
	t.Logf("pytest:\n%s", out)
	if err != nil {
		t.Fatalf("pytest: %v", err)
	}
}
