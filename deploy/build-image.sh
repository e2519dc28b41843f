#!/usr/bin/env bash
# Builds the images of ftcoord and of the example trainer without a
# Docker daemon: static binaries (no cgo, -trimpath, version and revision
# stamped) for each platform, packaged by deploy/mkimage as OCI layouts
# with fixed times (SOURCE_DATE_EPOCH: the last commit's), so that the
# same commit gives the same image digests.
#
#   deploy/build-image.sh [VERSION]     # default: git describe
#
# Writes build/bin/<os>-<arch>/{ftcoord,trainer} and
# build/image/{ftcoord,trainer} (OCI layouts, multi-platform) with
# build/image/<name>.<os>-<arch>.tar archives for `docker load` or
# `podman load`. Push a layout with any OCI tool, e.g.
#   crane push build/image/ftcoord REGISTRY/ftcoord:VERSION   (or skopeo copy oci:build/image/ftcoord docker://…)
# Environment: PLATFORMS (default linux/amd64,linux/arm64), REPO (image
# name prefix, default ftcomm).
set -euo pipefail
cd "$(dirname "$0")/.."

version=${1:-$(git describe --tags --always --dirty 2>/dev/null || echo devel)}
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
platforms=${PLATFORMS:-linux/amd64,linux/arm64}
repo=${REPO:-ftcomm}
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)

go build -o build/bin/mkimage ./deploy/mkimage
ftcoord=() trainer=()
for p in ${platforms//,/ }; do
  os=${p%/*} arch=${p#*/}
  echo "== go build $p"
  CGO_ENABLED=0 GOOS=$os GOARCH=$arch go build -trimpath -buildvcs=false \
    -ldflags "-s -w -buildid= -X main.version=$version -X main.revision=$revision" \
    -o "build/bin/$os-$arch/" ./cmd/ftcoord ./examples/trainer
  ftcoord+=("$p=build/bin/$os-$arch/ftcoord")
  trainer+=("$p=build/bin/$os-$arch/trainer")
done

labels=(-label "org.opencontainers.image.version=$version" -label "org.opencontainers.image.revision=$revision"
  -label "org.opencontainers.image.created=$created" -label "org.opencontainers.image.source=https://github.com/ftcomm/ftcomm"
  -label "org.opencontainers.image.licenses=BSD-3-Clause")

# ftcoord's container defaults: listen on all addresses at the documented
# ports (docs/deploy.md), data in /var/lib/ftcoord, JSON logs. Flags and
# FTCOORD_* variables override them.
build/bin/mkimage build -o build/image/ftcoord -ref "$repo/ftcoord:$version" -entrypoint /ftcoord -cmd serve \
  -env FTCOORD_LISTEN=0.0.0.0:8080 -env FTCOORD_DATA_DIR=/var/lib/ftcoord \
  -env FTCOORD_ETCD_CLIENT_ADDR=0.0.0.0:2379 -env FTCOORD_ETCD_PEER_ADDR=127.0.0.1:2380 \
  -env FTCOORD_GOSSIP_ADDR=0.0.0.0:7946 -env FTCOORD_LOG_FORMAT=json \
  -port 8080/tcp -port 2379/tcp -port 7946/tcp -port 7946/udp -dir /var/lib/ftcoord:0700 \
  -label org.opencontainers.image.title=ftcoord "${labels[@]}" "${ftcoord[@]}"

build/bin/mkimage build -o build/image/trainer -ref "$repo/trainer:$version" -entrypoint /trainer \
  -port 29600/tcp -port 7947/tcp -port 7947/udp -port 8081/tcp \
  -label org.opencontainers.image.title=ftcomm-trainer "${labels[@]}" "${trainer[@]}"
