#!/usr/bin/env bash
# What CI does with the images (no Docker daemon here):
#  1. builds them for linux/amd64 with deploy/build-image.sh;
#  2. checks each OCI layout with deploy/mkimage check: the entrypoint in
#     the layer is byte for byte the binary just built (SHA-256), the
#     image runs as a non-root user; and runs ftcoord's extracted
#     entrypoint with --version;
#  3. builds again and compares the index digests (reproducible);
#  4. where podman and runc can run containers: loads the archive, runs
#     `ftcoord --version` in a container, then `ftcoord serve` with a
#     read-only root file system and its data directory on a volume,
#     reads /healthz and the credentials (`ftcoord credentials` by podman
#     exec), and stops it with SIGTERM, which must end it with status 0.
#     Where containers cannot run, step 4 says so and is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
version=ci
export PLATFORMS=linux/amd64

deploy/build-image.sh "$version"
for img in ftcoord trainer; do
  args=()
  [ "$img" = ftcoord ] && args=(-run -- --version)
  build/bin/mkimage check -layout "build/image/$img" -platform linux/amd64 -binary "build/bin/linux-amd64/$img" "${args[@]}"
done

first=$(cat build/image/ftcoord/index.json build/image/trainer/index.json)
deploy/build-image.sh "$version" >/dev/null
if [ "$first" != "$(cat build/image/ftcoord/index.json build/image/trainer/index.json)" ]; then
  echo "check-image: a second build gave other digests: not reproducible" >&2
  exit 1
fi
echo "== reproducible: the same digests from a second build"

if ! command -v podman >/dev/null || ! command -v runc >/dev/null; then
  echo "== SKIPPED running the image: podman and runc are not installed"
  exit 0
fi
podman=(podman --runtime runc)
run=("${podman[@]}" run --network=host --ulimit nproc=1024:1024 --ulimit nofile=1024:1024)
data=$(mktemp -d)
name=ftcoord-check-$$
cleanup() { "${podman[@]}" rm -f "$name" >/dev/null 2>&1 || true; "${podman[@]}" rmi -f "ftcomm/ftcoord:$version" >/dev/null 2>&1 || true; rm -rf "$data"; }
trap cleanup EXIT
"${podman[@]}" load -q -i build/image/ftcoord.linux-amd64.tar
if ! out=$("${run[@]}" --rm "ftcomm/ftcoord:$version" --version 2>&1); then
  echo "== SKIPPED running the image: containers cannot run on this machine: $out"
  exit 0
fi
echo "== podman run ftcomm/ftcoord:$version --version: $out"
case "$out" in "ftcoord $version "*) ;; *) echo "check-image: unexpected version" >&2; exit 1 ;; esac

chown 65532:65532 "$data"
"${run[@]}" -d --name "$name" --read-only -v "$data:/var/lib/ftcoord" \
  -e FTCOORD_LISTEN=127.0.0.1:0 -e FTCOORD_ADDR_FILE=/var/lib/ftcoord/addr \
  -e FTCOORD_ETCD_CLIENT_ADDR=127.0.0.1:0 -e FTCOORD_GOSSIP_ADDR=127.0.0.1:0 "ftcomm/ftcoord:$version" >/dev/null
for _ in $(seq 1 240); do [ -s "$data/addr" ] && break; sleep 0.25; done
[ -s "$data/addr" ] || { echo "check-image: ftcoord wrote no address file" >&2; "${podman[@]}" logs "$name" >&2; exit 1; }
url=$(cat "$data/addr")
healthy=
for _ in $(seq 1 40); do curl -sf "$url/healthz" >/dev/null && { healthy=1; break; }; sleep 0.25; done
[ -n "$healthy" ] || { echo "check-image: $url/healthz never answered 200" >&2; "${podman[@]}" logs "$name" >&2; exit 1; }
"${podman[@]}" exec "$name" /ftcoord credentials | grep -q '"caCert"'
start=$(date +%s%N)
"${podman[@]}" stop -t 15 "$name" >/dev/null
code=$("${podman[@]}" inspect "$name" --format '{{.State.ExitCode}}')
echo "== podman: ftcoord serve in a container answered $url/healthz, printed its credentials, and stopped on SIGTERM in $((($(date +%s%N) - start) / 1000000)) ms with status $code"
[ "$code" = 0 ]
