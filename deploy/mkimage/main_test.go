package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The same inputs give the same digests (the layouts' index.json files
// are equal byte for byte), and check accepts the binary the image was
// built from and refuses another.
func TestBuildReproducibleAndCheck(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "tool")
	if err := os.WriteFile(bin, []byte("#!not really a binary\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SOURCE_DATE_EPOCH", "1700000000")
	layout := func(name string) string {
		out := filepath.Join(dir, name)
		err := build([]string{"-o", out, "-ref", "example.com/tool:v1", "-entrypoint", "/tool", "-cmd", "serve",
			"-env", "A=b", "-port", "8080/tcp", "-label", "k=v", "-dir", "/var/lib/tool:0700",
			"linux/amd64=" + bin, "linux/arm64=" + bin})
		if err != nil {
			t.Fatal(err)
		}
		idx, err := os.ReadFile(filepath.Join(out, "index.json"))
		if err != nil {
			t.Fatal(err)
		}
		return string(idx)
	}
	first, second := layout("a"), layout("b")
	if first != second {
		t.Fatalf("two builds differ:\n%s\n%s", first, second)
	}
	if _, err := os.Stat(filepath.Join(dir, "a.linux-arm64.tar")); err != nil {
		t.Fatalf("no docker-load archive: %v", err)
	}
	if err := check([]string{"-layout", filepath.Join(dir, "a"), "-platform", "linux/arm64", "-binary", bin}); err != nil {
		t.Fatalf("check of the built binary: %v", err)
	}
	other := filepath.Join(dir, "other")
	os.WriteFile(other, []byte("something else\n"), 0o755)
	if err := check([]string{"-layout", filepath.Join(dir, "a"), "-platform", "linux/amd64", "-binary", other}); err == nil || !strings.Contains(err.Error(), "differs") {
		t.Fatalf("check of another binary: %v", err)
	}
	if err := check([]string{"-layout", filepath.Join(dir, "a"), "-platform", "linux/s390x", "-binary", bin}); err == nil {
		t.Fatal("check found an image for a platform never built")
	}
}
