package nccl

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/internal/testutil"
)

// The choice is the newest readable candidate the driver can run, the
// earlier one on a tie (the system's comes first); every candidate says
// why it was or was not chosen.
func TestChooseNCCL(t *testing.T) {
	v := func(s string) Version {
		p := strings.Split(s, ".")
		return Version{atoi(p[0]), atoi(p[1]), atoi(p[2])}
	}
	sys := func(ver string, cuda int) NCCLCandidate {
		return NCCLCandidate{Path: "/usr/lib/libnccl.so.2", Source: SourceSystem, Version: v(ver), CUDA: cuda}
	}
	py := func(path, ver string, cuda int) NCCLCandidate {
		return NCCLCandidate{Path: path, Source: SourcePython, Version: v(ver), CUDA: cuda}
	}
	unread := NCCLCandidate{Path: "/opt/libnccl.so.2", Source: SourcePython, Err: errors.New("not an ELF file")}
	for _, tc := range []struct {
		name   string
		cands  []NCCLCandidate
		driver int
		want   []int // ranked: the chosen first
		reason []string
	}{
		{"python newer", []NCCLCandidate{sys("2.28.3", 12090), py("/venv/libnccl.so.2", "2.28.9", 12090)}, 0,
			[]int{1, 0}, []string{"older than /venv/libnccl.so.2 (NCCL 2.28.9)", "the newest"}},
		{"system newer", []NCCLCandidate{sys("2.29.2", 0), py("/venv/libnccl.so.2", "2.28.9", 12090)}, 13000,
			[]int{0, 1}, []string{"the newest", "older than /usr/lib/libnccl.so.2 (NCCL 2.29.2)"}},
		{"tie goes to the system", []NCCLCandidate{sys("2.28.9", 12090), py("/venv/libnccl.so.2", "2.28.9", 12090)}, 0,
			[]int{0, 1}, []string{"the newest", "the same version as /usr/lib/libnccl.so.2, found first"}},
		{"unreadable skipped", []NCCLCandidate{sys("2.28.3", 0), unread}, 0,
			[]int{0}, []string{"the only one usable", "its version could not be read: not an ELF file"}},
		{"built for a newer CUDA than the driver", []NCCLCandidate{sys("2.28.3", 12090), py("/venv/libnccl.so.2", "2.28.9", 13000)}, 12080,
			[]int{0}, []string{"the only one usable", "built for CUDA 13.0; the driver supports CUDA 12.8"}},
		{"driver unknown: no CUDA filter", []NCCLCandidate{sys("2.28.3", 12090), py("/venv/libnccl.so.2", "2.28.9", 13000)}, 0,
			[]int{1, 0}, nil},
		{"duplicate keeps its reason", []NCCLCandidate{sys("2.28.3", 0), {Path: "/b", Source: SourcePython, Version: v("2.28.3"), Reason: "the same file as /usr/lib/libnccl.so.2"}}, 0,
			[]int{0}, []string{"the only one usable", "the same file as /usr/lib/libnccl.so.2"}},
		{"none readable", []NCCLCandidate{unread}, 0, nil, []string{"its version could not be read: not an ELF file"}},
		{"none found", nil, 0, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := chooseNCCL(tc.cands, tc.driver)
			if !slices.Equal(got, tc.want) {
				t.Fatalf("ranked %v, want %v", got, tc.want)
			}
			for i, c := range tc.cands {
				if c.Chosen != (len(tc.want) > 0 && i == tc.want[0]) {
					t.Errorf("candidate %d chosen=%v", i, c.Chosen)
				}
				if c.Reason == "" {
					t.Errorf("candidate %d has no reason", i)
				}
				if tc.reason != nil && c.Reason != tc.reason[i] {
					t.Errorf("candidate %d: reason %q, want %q", i, c.Reason, tc.reason[i])
				}
			}
		})
	}
}

// fakeTree builds files under a temporary root: each libnccl "file" holds
// NCCL's version string, which fakeReadBuild reads back.
type fakeTree struct {
	t    *testing.T
	root string
}

func (f fakeTree) p(rel string) string { return filepath.Join(f.root, rel) }

func (f fakeTree) lib(rel, version string) string {
	f.t.Helper()
	p := f.p(rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		f.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("\x00\x7fELF junk\x00NCCL version "+version+"\x00more"), 0o644); err != nil {
		f.t.Fatal(err)
	}
	return p
}

func (f fakeTree) dir(rel string) string {
	f.t.Helper()
	if err := os.MkdirAll(f.p(rel), 0o755); err != nil {
		f.t.Fatal(err)
	}
	return f.p(rel)
}

func (f fakeTree) link(rel, target string) string {
	f.t.Helper()
	p := f.p(rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		f.t.Fatal(err)
	}
	if err := os.Symlink(target, p); err != nil {
		f.t.Fatal(err)
	}
	return p
}

func (f fakeTree) file(rel string) string {
	f.t.Helper()
	p := f.p(rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		f.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"), 0o755); err != nil {
		f.t.Fatal(err)
	}
	return p
}

func fakeReadBuild(path string) (ncclBuild, error) {
	f, err := os.Open(path)
	if err != nil {
		return ncclBuild{}, err
	}
	defer f.Close()
	if b, ok := scanVersion(f); ok {
		return b, nil
	}
	return ncclBuild{}, errors.New("no version string")
}

func envOf(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

// The search finds the library the loader would (LD_LIBRARY_PATH before
// the cache before the system directories) and every libnccl bundled in a
// Python environment the process can see, reading directories only.
func TestNCCLSearch(t *testing.T) {
	f := fakeTree{t, t.TempDir()}
	// System: in a system directory, and another in the cache; the cache wins.
	f.lib("usr/lib/x86_64-linux-gnu/libnccl.so.2.28.3", "2.28.3+cuda12.9")
	f.link("usr/lib/x86_64-linux-gnu/libnccl.so.2", "libnccl.so.2.28.3")
	cached := f.lib("opt/nccl/lib/libnccl.so.2", "2.27.7+cuda12.8")
	cache := filepath.Join(f.dir("etc"), "ld.so.cache")
	if err := os.WriteFile(cache, fakeLDCache(runtime.GOARCH, map[string]string{"libnccl.so.2": cached}), 0o644); err != nil {
		t.Fatal(err)
	}
	// A venv whose python3 links to an interpreter under usr/local.
	venvSite := "venv/lib/python3.12/site-packages"
	venvLib := f.lib(venvSite+"/nvidia/nccl/lib/libnccl.so.2", "2.28.9+cuda12.9")
	f.dir(venvSite + "/nvidia_nccl_cu12-2.28.9.dist-info")
	f.lib("usr/local/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2", "2.27.3+cuda12.9")
	f.file("usr/local/bin/python3.12")
	f.link("venv/bin/python3", f.p("usr/local/bin/python3.12"))
	f.link("venv/lib64", "lib") // as venv makes it: the same site, searched once
	// Conda, PYTHONPATH, pyenv behind its shims, the user's site.
	f.lib("conda/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2", "2.26.2+cuda12.2")
	f.lib("pp/nvidia/nccl/lib/libnccl.so.2", "2.29.2+cuda13.0")
	f.file("pyenv/shims/python3")
	f.lib("pyenv/versions/3.10.4/lib/python3.10/site-packages/nvidia/nccl/lib/libnccl.so.2", "2.21.5+cuda12.4")
	f.lib("home/.local/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2", "2.25.1+cuda12.8")
	// One mapped in this process (PyTorch's, say), and the venv's file mapped too.
	torch := f.lib("torch/lib/libnccl.so.2", "2.28.8+cuda12.9")
	maps := filepath.Join(f.dir("proc"), "maps")
	if err := os.WriteFile(maps, []byte("7f0000000000-7f0000001000 r-xp 00000000 08:01 1234 "+torch+"\n"+
		"7f0000001000-7f0000002000 r--p 00001000 08:01 1234 "+torch+"\n"+
		"7f0000003000-7f0000004000 r--p 00000000 08:01 99 /usr/lib/libc.so.6\n"+
		"7ffd00000000-7ffd00001000 rw-p 00000000 00:00 0 [stack]\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Debian's python3 and its dist-packages, holding a link to the venv's file (one file, found twice).
	f.file("usr/bin/python3")
	f.link("usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2", venvLib)

	s := ncclSearch{
		Getenv: envOf(map[string]string{
			"VIRTUAL_ENV":  f.p("venv"),
			"CONDA_PREFIX": f.p("conda"),
			"PYTHONPATH":   f.p("pp") + ":" + f.p("missing"),
			"PATH":         f.p("venv/bin") + ":" + f.p("pyenv/shims") + ":" + f.p("nowhere"),
			"HOME":         f.p("home"),
		}),
		LDCache:    cache,
		Maps:       maps,
		SystemDirs: []string{f.p("usr/lib/x86_64-linux-gnu")},
		Pythons:    []string{f.p("usr/bin/python3")},
		ReadBuild:  fakeReadBuild,
	}
	got := s.candidates()
	type row struct {
		path, where, version string
		src                  NCCLSource
	}
	want := []row{
		{torch, "loaded in this process", "2.28.8", SourceProcess},
		{cached, cache, "2.27.7", SourceSystem},
		{venvLib, "VIRTUAL_ENV, nvidia-nccl-cu12 2.28.9", "2.28.9", SourcePython},
		{f.p("conda/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"), "CONDA_PREFIX", "2.26.2", SourcePython},
		{f.p("pp/nvidia/nccl/lib/libnccl.so.2"), "PYTHONPATH", "2.29.2", SourcePython},
		{f.p("usr/local/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"), "python3 on PATH (" + f.p("venv/bin/python3") + ")", "2.27.3", SourcePython},
		{f.p("pyenv/versions/3.10.4/lib/python3.10/site-packages/nvidia/nccl/lib/libnccl.so.2"), "python3 on PATH (" + f.p("pyenv/shims/python3") + ")", "2.21.5", SourcePython},
		{f.p("usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2"), f.p("usr/bin/python3"), "2.28.9", SourcePython},
		{f.p("home/.local/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"), "user site", "2.25.1", SourcePython},
	}
	if len(got) != len(want) {
		for _, c := range got {
			t.Logf("found %s", c)
		}
		t.Fatalf("found %d candidates, want %d", len(got), len(want))
	}
	for i, w := range want {
		c := got[i]
		if c.Path != w.path || c.Where != w.where || c.Version.String() != w.version || c.Source != w.src {
			t.Errorf("candidate %d: %s\n  want %s (%s, %s) %s", i, c, w.path, w.src, w.where, w.version)
		}
	}
	if !strings.HasPrefix(got[7].Reason, "the same file as "+venvLib) {
		t.Errorf("the link to the venv's file: reason %q", got[7].Reason)
	}
	if got[4].CUDA != 13000 || got[2].CUDA != 12090 {
		t.Errorf("CUDA builds read as %d and %d", got[4].CUDA, got[2].CUDA)
	}
	ranked := chooseNCCL(got, 12090)
	if len(ranked) == 0 || got[ranked[0]].Path != venvLib {
		t.Fatalf("chose %v; want the venv's 2.28.9 (PYTHONPATH's 2.29.2 needs CUDA 13)", ranked)
	}

	// Without the cache the loader's directories are searched; LD_LIBRARY_PATH comes before both.
	s.LDCache = f.p("etc/none")
	if p, where := s.systemNCCL(); p != f.p("usr/lib/x86_64-linux-gnu/libnccl.so.2") || where != f.p("usr/lib/x86_64-linux-gnu") {
		t.Errorf("without a cache: %s (%s)", p, where)
	}
	ld := f.lib("ld/libnccl.so.2", "2.20.5")
	s.Getenv = envOf(map[string]string{"LD_LIBRARY_PATH": f.p("empty") + ":" + filepath.Dir(ld)})
	if p, where := s.systemNCCL(); p != ld || where != "LD_LIBRARY_PATH" {
		t.Errorf("with LD_LIBRARY_PATH: %s (%s)", p, where)
	}
}

// fakeLDCache writes glibc's ld.so.cache format (new, 1.1) with one entry
// per soname for goarch, preceded by an entry for another architecture
// that the lookup must skip.
func fakeLDCache(goarch string, libs map[string]string) []byte {
	arch := map[string]uint32{"amd64": 0x0300, "arm64": 0x0a00}[goarch]
	other := uint32(0x0a00)
	if arch == other {
		other = 0x0300
	}
	type ent struct {
		flags      uint32
		key, value string
	}
	var ents []ent
	for k, v := range libs {
		ents = append(ents, ent{3 | other, k, "/foreign/" + k}, ent{3 | arch, k, v})
	}
	const header, entry = 48, 24
	strStart := header + entry*len(ents)
	var strs bytes.Buffer
	off := func(s string) uint32 {
		o := uint32(strStart + strs.Len())
		strs.WriteString(s)
		strs.WriteByte(0)
		return o
	}
	var out bytes.Buffer
	out.WriteString("glibc-ld.so.cache1.1")
	le := binary.LittleEndian
	out.Write(le.AppendUint32(nil, uint32(len(ents))))
	out.Write(make([]byte, header-out.Len()))
	for _, e := range ents {
		b := le.AppendUint32(nil, e.flags)
		b = le.AppendUint32(b, off(e.key))
		b = le.AppendUint32(b, off(e.value))
		b = le.AppendUint32(b, 0)
		b = le.AppendUint64(b, 0)
		out.Write(b)
	}
	out.Write(strs.Bytes())
	return out.Bytes()
}

// The cache reader reads this machine's real cache (where there is one):
// the C library is always in it.
func TestLDCacheReadsTheRealCache(t *testing.T) {
	data, err := os.ReadFile("/etc/ld.so.cache")
	if err != nil {
		t.Skip("no /etc/ld.so.cache here")
	}
	paths := ldCacheLookup(data, "libc.so.6", runtime.GOARCH)
	if len(paths) == 0 {
		t.Fatal("libc.so.6 not found in /etc/ld.so.cache")
	}
	if _, err := os.Stat(paths[0]); err != nil {
		t.Errorf("the cache's libc.so.6 %s: %v", paths[0], err)
	}
	if got := ldCacheLookup([]byte("ld.so-1.7.0 and nothing else"), "libc.so.6", runtime.GOARCH); got != nil {
		t.Errorf("an old-format-only cache: %v", got)
	}
}

// The version string is found wherever it falls in the stream, a chunk
// boundary included, with or without NCCL's suffix and CUDA part.
func TestScanVersion(t *testing.T) {
	for _, tc := range []struct {
		at   int
		text string
		want ncclBuild
	}{
		{0, "NCCL version 2.28.9+cuda12.9", ncclBuild{Version{2, 28, 9}, 12090}},
		{1<<20 - 20, "NCCL version 2.28.3+cuda13.0", ncclBuild{Version{2, 28, 3}, 13000}},
		{1<<20 - 5, "NCCL version 2.30.7a0+cuda12.8", ncclBuild{Version{2, 30, 7}, 12080}},
		{3 << 20, "NCCL version 2.18.1", ncclBuild{Version{2, 18, 1}, 0}},
		{2 << 20, "NCCL version 2.28.3\x00NCCL version 2.28.3+cuda13.0", ncclBuild{Version{2, 28, 3}, 13000}},
	} {
		data := make([]byte, tc.at+len(tc.text)+100)
		copy(data[10:], "NCCL version mismatch\x00")
		copy(data[tc.at:], tc.text)
		got, ok := scanVersion(bytes.NewReader(data))
		if !ok || got != tc.want {
			t.Errorf("%q at %d: %+v %v, want %+v", tc.text, tc.at, got, ok, tc.want)
		}
	}
	if _, ok := scanVersion(strings.NewReader("NCCL version mismatch detected")); ok {
		t.Error("found a version in a string without one")
	}
}

// readNCCLBuild reads a real ELF file's version string without loading
// it, falls back to a versioned file name, and refuses what is not ELF.
func TestReadNCCLBuild(t *testing.T) {
	dir := t.TempDir()
	if _, err := readNCCLBuild(filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing file read")
	}
	notELF := filepath.Join(dir, "libnccl.so.2.28.3")
	if err := os.WriteFile(notELF, []byte("NCCL version 2.28.3"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := readNCCLBuild(notELF); err == nil {
		t.Error("a file that is not ELF read")
	}
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler to build an ELF file with")
	}
	build := func(name, src string) string {
		c := filepath.Join(dir, name+".c")
		so := filepath.Join(dir, name)
		if err := os.WriteFile(c, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", so, c).CombinedOutput(); err != nil {
			t.Skipf("cc: %v: %s", err, out)
		}
		return so
	}
	so := build("libfake.so", `const char* ft_v(void) { return "NCCL version 2.28.9+cuda12.9"; }`)
	if b, err := readNCCLBuild(so); err != nil || b != (ncclBuild{Version{2, 28, 9}, 12090}) {
		t.Errorf("version string: %+v, %v", b, err)
	}
	plain := build("libnccl.so.2.27.3", `int ft_x(void) { return 1; }`)
	link := filepath.Join(dir, "libnccl.so.2")
	if err := os.Symlink(plain, link); err != nil {
		t.Fatal(err)
	}
	if b, err := readNCCLBuild(link); err != nil || b != (ncclBuild{Version: Version{2, 27, 3}}) {
		t.Errorf("file name: %+v, %v", b, err)
	}
	data, err := os.ReadFile(plain)
	if err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(dir, "libother.so")
	if err := os.WriteFile(other, data, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := readNCCLBuild(other); err == nil {
		t.Error("a file with neither a version string nor a versioned name read")
	}
}

// Where the chosen library does not load, the next best is tried; where
// none does, Open's error is the first one's, and every candidate is
// logged with why it was not used. (No libnccl loads on a machine without
// NCCL, which is what this test needs.)
func TestOpenNewestFallsBack(t *testing.T) {
	f := fakeTree{t, t.TempDir()}
	a := f.lib("a/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2", "2.28.9+cuda12.9")
	b := f.lib("b/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2", "2.28.3+cuda12.9")
	s := ncclSearch{Getenv: envOf(map[string]string{"VIRTUAL_ENV": f.p("a"), "CONDA_PREFIX": f.p("b")}), ReadBuild: fakeReadBuild}
	core, logs := observer.New(zap.InfoLevel)
	_, _, cands, err := openNewest(s, "/nonexistent/libcudart.so", zap.New(core))
	if err == nil {
		t.Skip("a fake libnccl loaded?")
	}
	if !errors.Is(err, comm.ErrBackendUnavailable) || !strings.Contains(err.Error(), a) {
		t.Fatalf("error %v: want the first candidate's load failure", err)
	}
	if len(cands) != 2 || cands[0].Path != a || cands[1].Path != b {
		t.Fatalf("candidates %v", cands)
	}
	for _, c := range cands {
		if c.Chosen || !strings.Contains(c.Reason, "does not load") {
			t.Errorf("%s", c)
		}
	}
	if n := logs.FilterMessage("NCCL library candidate").Len(); n != 2 {
		t.Errorf("%d candidates logged, want 2", n)
	}
	// Nothing found: the loader's choice, by soname.
	_, _, cands, err = openNewest(ncclSearch{Getenv: envOf(nil), ReadBuild: fakeReadBuild}, "", zap.NewNop())
	if err == nil {
		t.Skip("this machine has a libnccl.so.2")
	}
	if len(cands) != 0 || !strings.Contains(err.Error(), ncclSoname) {
		t.Errorf("nothing found: %v, %v", cands, err)
	}
}

// The gate: the revoke + shrink path needs NCCL 2.28.7+ with both
// ncclCommRevoke and ncclCommShrink; shrink-abort needs 2.27.3+ with
// ncclCommShrink; a missing symbol closes the gate whatever the version.
func TestRecoveryGate(t *testing.T) {
	both := []string{"ncclCommShrink", "ncclCommRevoke"}
	for _, tc := range []struct {
		code int
		syms []string
		want Recovery
	}{
		{22605, both, RecoveryFreshInit},
		{22703, both, RecoveryShrinkAbort},
		{22803, both, RecoveryShrinkAbort},
		{22806, both, RecoveryShrinkAbort},
		{22807, both, RecoveryRevokeShrink},
		{22809, both, RecoveryRevokeShrink},
		{23007, both, RecoveryRevokeShrink},
		{22809, []string{"ncclCommShrink"}, RecoveryShrinkAbort},
		{22809, []string{"ncclCommRevoke"}, RecoveryFreshInit},
		{22809, nil, RecoveryFreshInit},
	} {
		L := simLibrary(newFakeWorld(t, 1).WithVersion(tc.code, tc.syms...))
		if got := L.Info().Recovery; got != tc.want {
			t.Errorf("NCCL %d with %v: %s, want %s", tc.code, tc.syms, got, tc.want)
		}
	}
	for _, tc := range []struct {
		m    RevokeMode
		r    Recovery
		want bool
	}{
		{RevokeDeferred, RecoveryRevokeShrink, false},
		{RevokeNative, RecoveryShrinkAbort, true}, // its own fallback: abort
		{RevokeAuto, RecoveryRevokeShrink, true},
		{RevokeAuto, RecoveryShrinkAbort, false},
		{RevokeAuto, RecoveryFreshInit, false},
	} {
		if got := tc.m.nativeRevoke(tc.r); got != tc.want {
			t.Errorf("%s on %s: native %v", tc.m, tc.r, got)
		}
	}
}

// RevokeAuto takes the revoke + shrink path where the library allows it
// (ncclCommRevoke at Revoke, then NCCL_SHRINK_DEFAULT) and the deferred
// path where it does not (nothing at Revoke, then NCCL_SHRINK_ABORT):
// either way the survivor's stuck op ends and its shrunk comm works.
func TestRevokeAuto(t *testing.T) {
	for _, tc := range []struct {
		name   string
		code   int
		native bool
	}{{"2.28.9", 22809, true}, {"2.28.3", 22803, false}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testCtx(t)
			w := newFakeWorld(t, 2).WithVersion(tc.code, "ncclCommSplit", "ncclCommShrink", "ncclCommRevoke",
				"ncclAlltoAll", "ncclGather", "ncclScatter")
			ranks := startJob(t, ctx, simLibrary(w), devs(2), 1, "job", func(c *Config, o *comm.Options) {
				c.Revoke = RevokeAuto
				c.ReleaseTimeout = 50 * time.Millisecond
				c.DisableLocalOneRank = true // ncclCommShrink to one rank, not device copies
			})
			if b := ranks[0].c.Backend().(*Backend); b.revokeNative != tc.native {
				t.Fatalf("native revoke %v on NCCL %s", b.revokeNative, tc.name)
			}
			work, _ := stuckAllReduce(t, ctx, w, ranks)
			ranks[0].c.Revoke(errors.New("test"))
			if err := work.Wait(ctx); !errors.Is(err, comm.ErrRevoked) {
				t.Fatalf("op after Revoke: %v", err)
			}
			if tc.native {
				testutil.WaitFor(t, ctx, "the native revoke to quiesce the comm", func() bool {
					b := ranks[0].c.Backend().(*Backend)
					b.hmu.Lock()
					defer b.hmu.Unlock()
					return b.quiescent
				})
			}
			nc, err := ranks[0].c.Shrink(ctx, []int{1}, 2)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			revokes, def, abort := w.Calls("ncclCommRevoke"), w.Calls("ncclCommShrink"), w.Calls("ncclCommShrink(abort)")
			if tc.native && (revokes != 1 || def != 1 || abort != 0) || !tc.native && (revokes != 0 || def != 0 || abort != 1) {
				t.Errorf("ncclCommRevoke %d, ncclCommShrink default %d, abort %d", revokes, def, abort)
			}
			if err := nc.Barrier(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// The library's choice and recovery path are logged and exported as an
// info metric; registering the same library twice is not an error.
func TestLibraryReported(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	reg := prometheus.NewRegistry()
	w := newFakeWorld(t, 1).WithVersion(22809, "ncclCommShrink", "ncclCommRevoke", "ncclCommSplit")
	cfg := LibraryConfig{Logger: zap.New(core), Registerer: reg}
	L, err := OpenSimulation(w, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := OpenSimulation(w, cfg); err != nil {
		t.Fatalf("the same library registered twice: %v", err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			got = append(got, fmt.Sprintf("%s{%s} %g", mf.GetName(), strings.Join(ls, ","), m.GetGauge().GetValue()))
		}
	}
	want := "ftcomm_nccl_library_info{path=sim-libnccl,recovery=revoke+shrink,source=simulation,version=2.28.9} 1"
	if len(got) != 1 || got[0] != want {
		t.Errorf("gathered %q, want %q", got, want)
	}
	e := logs.FilterMessage("NCCL library").All()
	if len(e) != 2 {
		t.Fatalf("%d log lines for the library, want 2", len(e))
	}
	f := e[0].ContextMap()
	if f["recovery"] != "revoke+shrink" || f["version"] != "2.28.9" || f["source"] != "simulation" || f["path"] != "sim-libnccl" {
		t.Errorf("logged %v", f)
	}
	if i := L.Info(); i.NCCLSource != SourceSimulation || !strings.Contains(i.String(), "recovery revoke+shrink") {
		t.Errorf("Info: %s", i)
	}
}
