// Command mkimage writes a container image of one static binary as an OCI
// image layout, with no Docker daemon and reproducibly (fixed file
// times, ownership and creation date: the same binaries give the same
// digest), and checks one. deploy/build-image.sh drives it.
//
//	mkimage build -o DIR -ref NAME:TAG -entrypoint /ftcoord [-cmd serve] [-env K=V]… [-port 8080/tcp]…
//	        [-label K=V]… [-dir PATH:MODE]… linux/amd64=bin/linux-amd64/ftcoord linux/arm64=…
//	mkimage check -layout DIR -platform linux/amd64 -binary bin/linux-amd64/ftcoord [-run --version]
//
// build writes DIR (an OCI layout: oci-layout, index.json, blobs/) holding
// one multi-platform index named -ref, and DIR.<os>-<arch>.tar for each
// platform (a `docker load` / `podman load` archive). Each image has one
// layer: the binary at -entrypoint (0755, owned by root), /etc/passwd
// and /etc/group naming the user nonroot (65532), and the -dir
// directories owned by it. The image runs as 65532:65532. Times are
// $SOURCE_DATE_EPOCH (default 0).
//
// check finds the image of -platform in the layout, checks its
// configuration (entrypoint, non-root user), extracts the entrypoint's
// file from the layer, compares its SHA-256 with -binary's, and, with
// -run, runs the extracted file with the arguments after -run and prints
// its output: what CI does instead of `docker run`.
package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

const nonroot = 65532

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: mkimage build|check [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "build":
		err = build(os.Args[2:])
	case "check":
		err = check(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(s string) error { *l = append(*l, s); return nil }

func build(args []string) error {
	fs := flag.NewFlagSet("mkimage build", flag.ContinueOnError)
	out := fs.String("o", "", "output `dir`ectory (an OCI layout)")
	ref := fs.String("ref", "", "image `name:tag` (the layout's ref name, the archives' tag)")
	entry := fs.String("entrypoint", "", "absolute `path` of the binary in the image")
	var cmd, env, ports, labels, dirs list
	fs.Var(&cmd, "cmd", "default `argument` (repeatable)")
	fs.Var(&env, "env", "`K=V` in the image's environment (repeatable)")
	fs.Var(&ports, "port", "exposed `port/proto` (repeatable)")
	fs.Var(&labels, "label", "`K=V` label (repeatable)")
	fs.Var(&dirs, "dir", "`path:mode` of an empty directory owned by the image's user (repeatable)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *out == "" || *ref == "" || !path.IsAbs(*entry) || fs.NArg() == 0 {
		return errors.New("build wants -o, -ref, an absolute -entrypoint and os/arch=binary arguments")
	}
	tag, err := name.NewTag(*ref)
	if err != nil {
		return err
	}
	created := time.Unix(0, 0).UTC()
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		sec, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return fmt.Errorf("SOURCE_DATE_EPOCH=%q: %v", s, err)
		}
		created = time.Unix(sec, 0).UTC()
	}
	labelMap := map[string]string{}
	for _, l := range labels {
		k, v, _ := strings.Cut(l, "=")
		labelMap[k] = v
	}
	exposed := map[string]struct{}{}
	for _, p := range ports {
		exposed[p] = struct{}{}
	}

	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	if err := os.RemoveAll(*out); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(filepath.Clean(*out)), 0o755); err != nil {
		return err
	}
	for _, a := range fs.Args() {
		plat, bin, ok := strings.Cut(a, "=")
		osName, arch, ok2 := strings.Cut(plat, "/")
		if !ok || !ok2 {
			return fmt.Errorf("argument %q: want os/arch=binary", a)
		}
		layerTar, err := layerOf(bin, *entry, dirs, created)
		if err != nil {
			return err
		}
		layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerTar)), nil },
			tarball.WithMediaType(types.OCILayer))
		if err != nil {
			return err
		}
		img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
		img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
		img, err = mutate.Append(img, mutate.Addendum{Layer: layer, History: v1.History{Created: v1.Time{Time: created},
			CreatedBy: "mkimage: " + filepath.Base(bin) + " at " + *entry}})
		if err != nil {
			return err
		}
		cf, err := img.ConfigFile()
		if err != nil {
			return err
		}
		cf = cf.DeepCopy()
		cf.OS, cf.Architecture, cf.Created = osName, arch, v1.Time{Time: created}
		cf.Config = v1.Config{Entrypoint: []string{*entry}, Cmd: cmd, Env: append([]string{"PATH=/"}, env...),
			User: fmt.Sprintf("%d:%d", nonroot, nonroot), WorkingDir: "/", ExposedPorts: exposed, Labels: labelMap}
		if img, err = mutate.ConfigFile(img, cf); err != nil {
			return err
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: osName, Architecture: arch}}})
		archive := fmt.Sprintf("%s.%s-%s.tar", strings.TrimSuffix(*out, "/"), osName, arch)
		if err := tarball.WriteToFile(archive, tag, img); err != nil {
			return err
		}
		d, _ := img.Digest()
		fmt.Printf("%s %s/%s: %s (archive %s)\n", tag, osName, arch, d, archive)
	}
	p, err := layout.Write(*out, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": tag.String()})); err != nil {
		return err
	}
	d, err := idx.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("%s: index %s in %s\n", tag, d, *out)
	return nil
}

// layerOf is the image's one layer, byte for byte the same for the same
// inputs.
func layerOf(bin, entry string, dirs []string, mtime time.Time) ([]byte, error) {
	data, err := os.ReadFile(bin)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdr := func(name string, typ byte, mode int64, uid int, size int64) error {
		return tw.WriteHeader(&tar.Header{Name: name, Typeflag: typ, Mode: mode, Uid: uid, Gid: uid, Size: size,
			ModTime: mtime, Format: tar.FormatPAX})
	}
	type entryT struct {
		name string
		dir  bool
		mode int64
		uid  int
		data []byte
	}
	entries := []entryT{
		{name: "etc/", dir: true, mode: 0o755},
		{name: "etc/passwd", mode: 0o644, data: []byte(fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:%d:%d:nonroot:/home/nonroot:/sbin/nologin\n", nonroot, nonroot))},
		{name: "etc/group", mode: 0o644, data: []byte(fmt.Sprintf("root:x:0:\nnonroot:x:%d:\n", nonroot))},
		{name: "home/", dir: true, mode: 0o755},
		{name: "home/nonroot/", dir: true, mode: 0o700, uid: nonroot},
		{name: "tmp/", dir: true, mode: 0o1777},
		{name: strings.TrimPrefix(entry, "/"), mode: 0o755, data: data},
	}
	for _, d := range dirs {
		p, m, _ := strings.Cut(d, ":")
		mode, err := strconv.ParseInt(m, 8, 64)
		if err != nil || !path.IsAbs(p) {
			return nil, fmt.Errorf("-dir %q: want /path:octal-mode", d)
		}
		parts := strings.Split(strings.Trim(p, "/"), "/")
		for i := range parts[:len(parts)-1] { // parents, owned by root
			entries = append(entries, entryT{name: strings.Join(parts[:i+1], "/") + "/", dir: true, mode: 0o755})
		}
		entries = append(entries, entryT{name: strings.Trim(p, "/") + "/", dir: true, mode: mode, uid: nonroot})
	}
	sort.SliceStable(entries, func(i, j int) bool { return entries[i].name < entries[j].name })
	seen := map[string]bool{}
	for _, e := range entries {
		if seen[e.name] {
			continue
		}
		seen[e.name] = true
		if e.dir {
			if err := hdr(e.name, tar.TypeDir, e.mode, e.uid, 0); err != nil {
				return nil, err
			}
			continue
		}
		if err := hdr(e.name, tar.TypeReg, e.mode, e.uid, int64(len(e.data))); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func check(args []string) error {
	fs := flag.NewFlagSet("mkimage check", flag.ContinueOnError)
	dir := fs.String("layout", "", "the OCI layout `dir`ectory")
	plat := fs.String("platform", "linux/amd64", "`os/arch` of the image to check")
	bin := fs.String("binary", "", "the `file` the image's entrypoint must equal")
	runArgs := fs.Bool("run", false, "run the extracted entrypoint with the arguments that follow")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *dir == "" || *bin == "" {
		return errors.New("check wants -layout and -binary")
	}
	p, err := layout.FromPath(*dir)
	if err != nil {
		return err
	}
	top, err := p.ImageIndex()
	if err != nil {
		return err
	}
	tm, err := top.IndexManifest()
	if err != nil || len(tm.Manifests) != 1 {
		return fmt.Errorf("%s: want one index in index.json (%v)", *dir, err)
	}
	idx, err := top.ImageIndex(tm.Manifests[0].Digest)
	if err != nil {
		return err
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	var img v1.Image
	for _, m := range im.Manifests {
		if m.Platform != nil && m.Platform.OS+"/"+m.Platform.Architecture == *plat {
			if img, err = idx.Image(m.Digest); err != nil {
				return err
			}
		}
	}
	if img == nil {
		return fmt.Errorf("%s: no image for %s", *dir, *plat)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	if len(cf.Config.Entrypoint) != 1 || cf.Config.User == "" || strings.HasPrefix(cf.Config.User, "0") || cf.OS+"/"+cf.Architecture != *plat {
		return fmt.Errorf("image config: entrypoint %q, user %q, platform %s/%s", cf.Config.Entrypoint, cf.Config.User, cf.OS, cf.Architecture)
	}
	want, err := os.ReadFile(*bin)
	if err != nil {
		return err
	}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	var got []byte
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		if "/"+strings.TrimPrefix(h.Name, "/") == cf.Config.Entrypoint[0] {
			if got, err = io.ReadAll(tr); err != nil {
				return err
			}
		}
	}
	if got == nil {
		return fmt.Errorf("the layer holds no %s", cf.Config.Entrypoint[0])
	}
	if sha256.Sum256(got) != sha256.Sum256(want) {
		return fmt.Errorf("%s in the image differs from %s", cf.Config.Entrypoint[0], *bin)
	}
	d, _ := img.Digest()
	fmt.Printf("%s %s: %s; entrypoint %s (sha256 %x) = %s; user %s\n", *dir, *plat, d, cf.Config.Entrypoint[0], sha256.Sum256(got), *bin, cf.Config.User)
	if !*runArgs {
		return nil
	}
	tmp, err := os.MkdirTemp("", "mkimage-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	exe := filepath.Join(tmp, path.Base(cf.Config.Entrypoint[0]))
	if err := os.WriteFile(exe, got, 0o755); err != nil {
		return err
	}
	cmd := exec.Command(exe, fs.Args()...)
	cmd.Env = cf.Config.Env
	out, err := cmd.CombinedOutput()
	fmt.Printf("$ %s %s\n%s", cf.Config.Entrypoint[0], strings.Join(fs.Args(), " "), out)
	return err
}
