package nccl

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
)

// This file chooses which libnccl Open loads when none is named: the
// newest of one the process has loaded already, the one the loader would
// find (the system's) and those bundled in Python environments (the
// nvidia-nccl-cu* wheel PyTorch depends on).
// Discovery reads directories and files only: it runs no interpreter and
// loads no library, so a candidate that is not chosen never enters the
// process. The choice itself (chooseNCCL) is a pure function of the
// candidates found and the driver's CUDA version.

// NCCLSource says where the loaded libnccl came from.
type NCCLSource string

const (
	// SourceConfig: LibraryConfig.NCCLPath named it.
	SourceConfig NCCLSource = "config"
	// SourceEnv: EnvNCCLLib (FTCOMM_NCCL_LIB) named it.
	SourceEnv NCCLSource = "env"
	// SourceSystem: where dlopen("libnccl.so.2") finds it (LD_LIBRARY_PATH,
	// /etc/ld.so.cache, the system library directories).
	SourceSystem NCCLSource = "system"
	// SourcePython: nvidia/nccl/lib in a Python environment's
	// site-packages (the nvidia-nccl-cu12/-cu13 wheel).
	SourcePython NCCLSource = "python"
	// SourceProcess: a libnccl this process had loaded already (PyTorch's,
	// in a Python process that imported torch first).
	SourceProcess NCCLSource = "process"
	// SourceLoader: no file was found or none could be read; dlopen was
	// given the soname libnccl.so.2 and the loader chose (in a process
	// that already holds a libnccl.so.2, PyTorch's for instance, that one).
	SourceLoader NCCLSource = "loader"
	// SourceSimulation: a simulation (OpenSimulation).
	SourceSimulation NCCLSource = "simulation"
)

// ncclSoname is what dlopen is given when no file was chosen.
const ncclSoname = "libnccl.so.2"

// NCCLCandidate is one libnccl that Open considered (Info.Candidates).
type NCCLCandidate struct {
	Path   string
	Source NCCLSource
	// Where says how it was found: "LD_LIBRARY_PATH", "/etc/ld.so.cache",
	// a system directory, "VIRTUAL_ENV", "python3 on PATH
	// (/usr/bin/python3)", …; for a wheel, its package and version.
	Where string
	// Version is what the file says it is (NCCL's "NCCL version …" string,
	// else the version in its file name); zero if unread.
	Version Version
	// CUDA is the CUDA version it was built for, in the runtime's
	// encoding (12090 for 12.9); 0 if unknown.
	CUDA int
	// Err is why its version could not be read.
	Err error
	// Chosen: this is the one Open loaded (or tried first).
	Chosen bool
	// Reason says why it was chosen, or why not.
	Reason string
}

func (c NCCLCandidate) String() string {
	v := "version unknown"
	if c.Err == nil {
		v = "NCCL " + c.Version.String()
		if c.CUDA > 0 {
			v += fmt.Sprintf("+cuda%d.%d", c.CUDA/1000, c.CUDA%1000/10)
		}
	}
	return fmt.Sprintf("%s (%s, %s; %s): %s", c.Path, c.Source, c.Where, v, c.Reason)
}

// ncclBuild is what a libnccl file says about itself.
type ncclBuild struct {
	Version Version
	CUDA    int // 12090 for +cuda12.9; 0 if unknown
}

// ncclSearch is where the selection looks, as values, so tests can point
// it at a fake tree and a fake version reader.
type ncclSearch struct {
	Getenv func(string) string
	// LDCache is the loader's cache (/etc/ld.so.cache); SystemDirs the
	// directories the loader searches after it.
	LDCache    string
	SystemDirs []string
	// Maps is the process's memory map (/proc/self/maps): a libnccl
	// mapped there is a candidate.
	Maps string
	// Pythons are interpreters looked at besides those on PATH (the
	// process's own executable if it is one, and /usr/bin/python3).
	Pythons []string
	// ReadBuild reads a file's version without loading it.
	ReadBuild func(path string) (ncclBuild, error)
}

// defaultSearch is the process's environment and this machine's loader
// directories.
func defaultSearch() ncclSearch {
	triple := map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu", "ppc64le": "powerpc64le-linux-gnu"}[runtime.GOARCH]
	var dirs []string
	if triple != "" {
		dirs = append(dirs, "/lib/"+triple, "/usr/lib/"+triple)
	}
	dirs = append(dirs, "/lib64", "/usr/lib64", "/lib", "/usr/lib")
	var pythons []string
	if exe, err := os.Executable(); err == nil && strings.HasPrefix(filepath.Base(exe), "python") {
		pythons = append(pythons, exe) // libftcomm.so in an interpreter that is not on PATH
	}
	pythons = append(pythons, "/usr/bin/python3")
	return ncclSearch{Getenv: os.Getenv, LDCache: "/etc/ld.so.cache", SystemDirs: dirs, Maps: "/proc/self/maps",
		Pythons: pythons, ReadBuild: readNCCLBuild}
}

// candidates lists every libnccl found, in the order that breaks ties:
// those this process has loaded already (a second copy of the same
// version would gain nothing), the system's, then the Python
// environments' in the order searched; each file once, with its version
// read.
func (s ncclSearch) candidates() []NCCLCandidate {
	var out []NCCLCandidate
	seen := map[string]int{} // real path → index in out
	add := func(path string, src NCCLSource, where string) {
		c := NCCLCandidate{Path: path, Source: src, Where: where}
		real, err := filepath.EvalSymlinks(path)
		if err != nil {
			return // vanished or a dangling link: nothing the loader could open either
		}
		if i, ok := seen[real]; ok {
			c.Err = out[i].Err
			c.Version, c.CUDA = out[i].Version, out[i].CUDA
			c.Reason = "the same file as " + out[i].Path
			out = append(out, c)
			return
		}
		seen[real] = len(out)
		b, err := s.ReadBuild(path)
		c.Version, c.CUDA, c.Err = b.Version, b.CUDA, err
		out = append(out, c)
	}
	for _, p := range mappedNCCL(s.Maps) {
		add(p, SourceProcess, "loaded in this process")
	}
	if p, where := s.systemNCCL(); p != "" {
		add(p, SourceSystem, where)
	}
	for _, site := range s.pythonSites() {
		libs, _ := filepath.Glob(filepath.Join(site.dir, "nvidia", "nccl", "lib", "libnccl.so*"))
		slices.Sort(libs)
		where := site.where
		if pkg := wheelOf(site.dir); pkg != "" {
			where += ", " + pkg
		}
		for _, l := range libs {
			add(l, SourcePython, where)
		}
	}
	return out
}

// systemNCCL is the file dlopen("libnccl.so.2") would open from a program
// without RUNPATH: the first in LD_LIBRARY_PATH, then the loader's cache,
// then the system directories.
func (s ncclSearch) systemNCCL() (path, where string) {
	for _, d := range filepath.SplitList(s.Getenv("LD_LIBRARY_PATH")) {
		if d != "" && isFile(filepath.Join(d, ncclSoname)) {
			return filepath.Join(d, ncclSoname), "LD_LIBRARY_PATH"
		}
	}
	if s.LDCache != "" {
		if data, err := os.ReadFile(s.LDCache); err == nil {
			for _, p := range ldCacheLookup(data, ncclSoname, runtime.GOARCH) {
				if isFile(p) {
					return p, s.LDCache
				}
			}
		}
	}
	for _, d := range s.SystemDirs {
		if isFile(filepath.Join(d, ncclSoname)) {
			return filepath.Join(d, ncclSoname), d
		}
	}
	return "", ""
}

// mappedNCCL lists the libnccl files mapped in a /proc/<pid>/maps file,
// each once, in the order they appear.
func mappedNCCL(maps string) []string {
	if maps == "" {
		return nil
	}
	data, err := os.ReadFile(maps)
	if err != nil {
		return nil
	}
	var out []string
	for line := range strings.Lines(string(data)) {
		i := strings.IndexByte(line, '/')
		if i < 0 {
			continue
		}
		p := strings.TrimSpace(line[i:])
		if strings.HasPrefix(filepath.Base(p), "libnccl.so") && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}

type pythonSite struct{ dir, where string }

// pythonSites lists the site-packages directories of the Python
// environments this process can see, without running Python: those of
// VIRTUAL_ENV and CONDA_PREFIX, PYTHONPATH's entries, those of every
// python3 on PATH and of s.Pythons (a venv's own prefix and the prefix of
// the interpreter it links to; pyenv's versions behind its shims), and the
// user's site (PYTHONUSERBASE, else ~/.local).
func (s ncclSearch) pythonSites() []pythonSite {
	var out []pythonSite
	seen := map[string]bool{}
	addSite := func(dir, where string) {
		dir = filepath.Clean(dir)
		real, err := filepath.EvalSymlinks(dir) // a venv's lib64 is a link to lib
		if err != nil || seen[real] || !isDir(dir) {
			return
		}
		seen[real] = true
		out = append(out, pythonSite{dir, where})
	}
	addPrefix := func(prefix, where string) {
		if prefix == "" {
			return
		}
		for _, pat := range []string{"lib/python3*/site-packages", "lib/python3*/dist-packages",
			"lib64/python3*/site-packages", "local/lib/python3*/dist-packages", "local/lib/python3*/site-packages"} {
			m, _ := filepath.Glob(filepath.Join(prefix, pat))
			slices.Sort(m)
			for _, d := range m {
				addSite(d, where)
			}
		}
	}
	for _, env := range []string{"VIRTUAL_ENV", "CONDA_PREFIX"} {
		if v := s.Getenv(env); v != "" {
			addPrefix(v, env)
		}
	}
	for _, d := range filepath.SplitList(s.Getenv("PYTHONPATH")) {
		if d != "" {
			addSite(d, "PYTHONPATH")
		}
	}
	interp := func(py, where string) {
		if !isFile(py) {
			return
		}
		bin := filepath.Dir(py)
		if filepath.Base(bin) == "shims" { // pyenv: the interpreters live under versions/
			vs, _ := filepath.Glob(filepath.Join(filepath.Dir(bin), "versions", "*"))
			slices.Sort(vs)
			for _, v := range vs {
				addPrefix(v, where)
			}
			return
		}
		addPrefix(filepath.Dir(bin), where) // a venv: its own prefix
		if real, err := filepath.EvalSymlinks(py); err == nil {
			addPrefix(filepath.Dir(filepath.Dir(real)), where)
		}
	}
	for _, d := range filepath.SplitList(s.Getenv("PATH")) {
		if d != "" {
			interp(filepath.Join(d, "python3"), "python3 on PATH ("+filepath.Join(d, "python3")+")")
		}
	}
	for _, py := range s.Pythons {
		interp(py, py)
	}
	base := s.Getenv("PYTHONUSERBASE")
	if base == "" {
		if h := s.Getenv("HOME"); h != "" {
			base = filepath.Join(h, ".local")
		}
	}
	addPrefix(base, "user site")
	return out
}

// wheelOf names the nvidia-nccl wheel installed in a site-packages
// directory ("nvidia-nccl-cu12 2.28.9"), from its dist-info directory.
func wheelOf(site string) string {
	m, _ := filepath.Glob(filepath.Join(site, "nvidia_nccl_cu*-*.dist-info"))
	if len(m) == 0 {
		return ""
	}
	slices.Sort(m)
	name, ver, _ := strings.Cut(strings.TrimSuffix(filepath.Base(m[len(m)-1]), ".dist-info"), "-")
	return strings.ReplaceAll(name, "_", "-") + " " + ver
}

// chooseNCCL picks the newest candidate whose version was read, skipping
// those built for a CUDA newer than the driver supports (driverCUDA, in
// the runtime's encoding; 0 if unknown) and duplicates of an earlier
// file. Ties go to the earlier candidate: one loaded already, else the
// system's. Every candidate's Reason is filled in. It returns the
// candidates in the order to try them (the chosen first, then the other
// eligible ones, newest first), or none when no candidate is eligible.
func chooseNCCL(cands []NCCLCandidate, driverCUDA int) (ranked []int) {
	for i := range cands {
		c := &cands[i]
		switch {
		case c.Reason != "": // a duplicate
		case c.Err != nil:
			c.Reason = "its version could not be read: " + c.Err.Error()
		case driverCUDA > 0 && c.CUDA/1000 > driverCUDA/1000:
			c.Reason = fmt.Sprintf("built for CUDA %d.%d; the driver supports CUDA %d.%d",
				c.CUDA/1000, c.CUDA%1000/10, driverCUDA/1000, driverCUDA%1000/10)
		default:
			ranked = append(ranked, i)
		}
	}
	slices.SortStableFunc(ranked, func(a, b int) int { return cands[b].Version.Code() - cands[a].Version.Code() })
	if len(ranked) == 0 {
		return nil
	}
	best := &cands[ranked[0]]
	best.Chosen = true
	best.Reason = "the newest"
	if len(ranked) == 1 {
		best.Reason = "the only one usable"
	}
	for _, i := range ranked[1:] {
		c := &cands[i]
		if c.Version == best.Version {
			c.Reason = fmt.Sprintf("the same version as %s, found first", best.Path)
		} else {
			c.Reason = fmt.Sprintf("older than %s (NCCL %s)", best.Path, best.Version)
		}
	}
	return ranked
}

// versionString matches NCCL's VERSION_STRING (src/init.cc, every 2.x:
// "NCCL version " major.minor.patch, a suffix, "+cuda" major.minor), which
// NCCL keeps in its read-only data precisely so that `strings` reveals it.
var versionString = regexp.MustCompile(`NCCL version (\d+)\.(\d+)\.(\d+)[^+\x00\s]{0,16}(?:\+cuda(\d+)\.(\d+))?`)

// fileVersion matches a versioned file name: libnccl.so.2.28.3.
var fileVersion = regexp.MustCompile(`^libnccl\.so\.(\d+)\.(\d+)\.(\d+)$`)

// readNCCLBuild reads a libnccl's version from the file, without loading
// it: NCCL's version string in its read-only data, else the version in the
// name of the file a link leads to (libnccl.so.2.28.3). A file for another
// architecture is refused, as the loader would refuse it.
func readNCCLBuild(path string) (ncclBuild, error) {
	f, err := elf.Open(path)
	if err != nil {
		return ncclBuild{}, err
	}
	defer f.Close()
	if want, ok := elfMachine[runtime.GOARCH]; ok && (f.Machine != want || f.Class != elf.ELFCLASS64) {
		return ncclBuild{}, fmt.Errorf("an ELF file for %v, not this machine's %v", f.Machine, want)
	}
	for _, s := range f.Sections {
		if !strings.HasPrefix(s.Name, ".rodata") || s.Type != elf.SHT_PROGBITS {
			continue
		}
		if b, ok := scanVersion(s.Open()); ok {
			return b, nil
		}
	}
	if real, err := filepath.EvalSymlinks(path); err == nil {
		if m := fileVersion.FindStringSubmatch(filepath.Base(real)); m != nil {
			return ncclBuild{Version: Version{atoi(m[1]), atoi(m[2]), atoi(m[3])}}, nil
		}
	}
	return ncclBuild{}, errors.New("no NCCL version string in its read-only data, nor a version in its file name")
}

var elfMachine = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64, "ppc64le": elf.EM_PPC64}

// scanVersion looks for NCCL's version string in r, a chunk at a time;
// the last bytes of each chunk are kept for the next, so a string cut at
// a chunk's end is seen whole there. A string with its "+cuda" part is
// preferred: NCCL 2.28's data also holds the bare version
// ("NCCL version 2.28.3", before "NCCL version 2.28.3+cuda13.0").
func scanVersion(r io.Reader) (ncclBuild, bool) {
	const chunk, keep = 1 << 20, 128
	needle := []byte("NCCL version ")
	buf := make([]byte, 0, chunk+keep)
	var first ncclBuild
	found := false
	for {
		n, err := io.ReadFull(r, buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		end := err != nil
		for off := 0; ; {
			i := bytes.Index(buf[off:], needle)
			if i < 0 {
				break
			}
			i += off
			if !end && len(buf)-i < keep {
				break // in the kept tail: looked at again with what follows
			}
			if m := versionString.FindSubmatch(buf[i:min(len(buf), i+keep)]); m != nil {
				b := ncclBuild{Version: Version{atoi(string(m[1])), atoi(string(m[2])), atoi(string(m[3]))}}
				if len(m[4]) > 0 {
					b.CUDA = atoi(string(m[4]))*1000 + atoi(string(m[5]))*10
					return b, true
				}
				if !found {
					first, found = b, true
				}
			}
			off = i + 1
		}
		if end {
			return first, found
		}
		tail := min(keep, len(buf))
		copy(buf, buf[len(buf)-tail:])
		buf = buf[:tail]
	}
}

func atoi(s string) int { n, _ := strconv.Atoi(s); return n }

// ldCacheLookup returns the paths the loader's cache (ld.so.cache, glibc's
// "glibc-ld.so.cache1.1" format, alone or after the old one) lists for
// soname on goarch, in the cache's order, which is the loader's.
func ldCacheLookup(data []byte, soname, goarch string) []string {
	const magic = "glibc-ld.so.cache1.1"
	start := bytes.Index(data, []byte(magic))
	if start < 0 {
		return nil
	}
	c := data[start:]
	const header, entry = 48, 24
	if len(c) < header {
		return nil
	}
	le := binary.LittleEndian
	n := int(le.Uint32(c[20:]))
	// Entry flags: the library type in the low byte (3: ELF for libc6),
	// the architecture in the next (0x03 x86-64, 0x0a AArch64).
	arch, archKnown := map[string]uint32{"amd64": 0x0300, "arm64": 0x0a00}[goarch]
	str := func(off uint32) string {
		if int(off) >= len(c) {
			return ""
		}
		s := c[off:]
		if i := bytes.IndexByte(s, 0); i >= 0 {
			s = s[:i]
		}
		return string(s)
	}
	var out []string
	for i := range n {
		e := c[header+i*entry:]
		if len(e) < entry {
			break
		}
		flags := le.Uint32(e)
		if flags&0xff != 3 || (archKnown && flags&0xff00 != arch) {
			continue
		}
		if str(le.Uint32(e[4:])) == soname {
			out = append(out, str(le.Uint32(e[8:])))
		}
	}
	return out
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}

func isDir(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.IsDir()
}
