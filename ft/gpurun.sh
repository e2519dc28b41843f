#!/bin/bash
# Builds ft's GPU tests into <main checkout>/.gpu/ftgpu (here) or runs them
# (on the device machine, from the checkout root):
#
#   ft/gpurun.sh build /work/main      # here: ft.test and this script into /work/main/.gpu/ftgpu
#   bash .gpu/ftgpu/gpurun.sh run      # there: one GPU (kind nvidia-h100-x1), carry [".gpu/ftgpu"]
#
# run: TestGPUFTOneReplica (ft with the NCCL data backend and one replica:
# a one-rank NCCL comm beside a gloo control comm, a few steps on device
# tensors, the state checked) and TestGPUHealThroughput (1 GiB of device
# state healed between processes sharing the GPU, from 1 source and from 3,
# for each chunk size and stream count of the sweep; every byte checked).
# Its FIGURE lines are the throughputs. The sweep is set by
# FTCOMM_FT_HEAL_CHUNKS (MiB), FTCOMM_FT_HEAL_STREAMS, FTCOMM_FT_HEAL_BYTES
# and FTCOMM_FT_HEAL_SOURCES (see ft/gpu_test.go). The full log goes to
# $OUT/ft-gpu.log. NVLink multicast stays off.
set -u
export NCCL_NVLS_ENABLE=0 FTCOMM_FT_GPU="${FTCOMM_FT_GPU:-1}" # "sim": a dry run without a GPU

case "${1:-}" in
build)
	dst="${2:?main checkout}/.gpu/ftgpu"
	mkdir -p "$dst"
	root="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
	cd "$root" || exit 1
	# ~30 MiB, under the device tool's 64 MiB carry limit.
	CGO_ENABLED=1 go test -c -ldflags="-s -w" -o "$dst/ft.test" ./ft &&
		cp ft/gpurun.sh "$dst/"
	;;
run)
	cd "$(dirname "$0")" || exit 1
	OUT="${OUT:-/tmp}"
	echo "== $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)"
	timeout 400 ./ft.test -test.run '^TestGPU(FTOneReplica|HealThroughput)$' -test.v -test.count=1 -test.timeout 390s >"$OUT/ft-gpu.log" 2>&1
	echo "rc=$?"
	grep -E '^(--- |FAIL|ok|PASS)|FIGURE|defaults:|heal [0-9]+ MiB of|step [0-9]+ committed|NCCL [0-9]|    [a-z_0-9]+\.go:[0-9]+: .*(want|wrong|fetch)' "$OUT/ft-gpu.log"
	echo "== load after: $(cut -d' ' -f1-3 /proc/loadavg)"
	;;
*)
	echo "usage: $0 build <main checkout> | run" >&2
	exit 2
	;;
esac
