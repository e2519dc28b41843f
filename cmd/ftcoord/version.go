package main

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// Set at link time by the image build (deploy/build-image.sh):
//
//	go build -ldflags "-X main.version=v0.3.0 -X main.revision=$(git rev-parse HEAD)" ./cmd/ftcoord
var (
	version  string
	revision string
)

// build describes this binary: the version and revision set at link time,
// or else what the Go toolchain recorded (the module version of `go
// install …@v`, the VCS revision of a build in a checkout).
type build struct {
	Version, Revision, GoVersion, Platform string
}

func buildOf(bi *debug.BuildInfo, ok bool) build {
	b := build{Version: version, Revision: revision, GoVersion: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	if ok {
		if b.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			b.Version = bi.Main.Version
		}
		modified := false
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				if b.Revision == "" {
					b.Revision = s.Value
				}
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
		if modified && revision == "" && b.Revision != "" {
			b.Revision += "-dirty"
		}
	}
	if b.Version == "" {
		b.Version = "devel"
	}
	return b
}

func currentBuild() build { return buildOf(debug.ReadBuildInfo()) }

func (b build) String() string {
	rev := b.Revision
	if rev == "" {
		rev = "unknown"
	}
	return fmt.Sprintf("ftcoord %s (revision %s, %s, %s)", b.Version, rev, b.GoVersion, b.Platform)
}
