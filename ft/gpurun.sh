#!/bin/bash
# Builds ft's GPU tests into <main checkout>/.gpu/ftgpu (here) or runs them
# (on the device machine, from the checkout root):
#
#   ft/gpurun.sh build <checkout>      # here: ft.test and this script into <checkout>/.gpu/ftgpu
#   bash .gpu/ftgpu/gpurun.sh run      # there, one GPU, from the checkout's copy
#   bash .gpu/ftgpu/gpurun.sh kill     # there, two or more GPUs (TestKillCycles over NCCL)
#   bash .gpu/ftgpu/gpurun.sh kill-onerank  # there, two GPUs: the lone survivor's two paths side by side
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
kill)
	# The kill cycles over NCCL, one replica process per GPU (kind
	# nvidia-h100-x2 or larger): FTCOMM_FT_KILL_CYCLES SIGKILLs (default
	# 20), with the system NCCL and then PyTorch's if it has one. FIGURE
	# lines: kill → the survivors' next commit.
	cd "$(dirname "$0")" || exit 1
	OUT="${OUT:-/tmp}"
	echo "== $(nvidia-smi -L | wc -l) GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)"
	torchnccl=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0] + "/lib/libnccl.so.2")' 2>/dev/null)
	for lib in "" "$torchnccl"; do
		[ -n "$lib" ] && [ ! -e "$lib" ] && continue
		name=system; [ -n "$lib" ] && name=torch
		FTCOMM_NCCL_LIB="$lib" FTCOMM_FT_KILL_CYCLES="${FTCOMM_FT_KILL_CYCLES:-20}" FTCOMM_FT_KILL_BACKEND=nccl \
			timeout 280 ./ft.test -test.run '^TestKillCycles$' -test.v -test.count=1 -test.timeout 270s >"$OUT/kill-$name.log" 2>&1
		echo "== $name NCCL ${lib:-libnccl.so.2}: rc=$?"
		grep -E 'killcycles_test.go:[0-9]+: (NCCL|cycle|FIGURE)|^(--- |FAIL|ok|PASS)|    [a-z_]+_test.go:[0-9]+: [^a-z0-9{]' "$OUT/kill-$name.log" | grep -v 'test: \(SIGKILL\|stopping\)' | cut -c1-240
	done
	;;
kill-onerank)
	# The lone survivor's two paths side by side, two replicas on two GPUs,
	# alternated (docs/measurements.md, "The lone survivor without an NCCL
	# comm"): FTCOMM_FT_NCCL_ONE_RANK=nccl (an NCCL comm of one rank made
	# by ncclCommShrink) and the default (device copies, no NCCL comm), 10
	# kills per run, two runs each, the library Open chooses.
	cd "$(dirname "$0")" || exit 1
	OUT="${OUT:-/tmp}"
	echo "== $(nvidia-smi -L | wc -l) GPUs; $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)"
	for i in 1 2; do
		for path in nccl local; do
			one=""; [ $path = nccl ] && one=nccl
			FTCOMM_FT_NCCL_ONE_RANK=$one FTCOMM_FT_KILL_BACKEND=nccl FTCOMM_FT_KILL_CYCLES=10 FTCOMM_FT_KILL_REPLICAS=2 \
				timeout 150 ./ft.test -test.run '^TestKillCycles$' -test.v -test.count=1 >"$OUT/kill-onerank-$path-$i.log" 2>&1
			echo "== one rank by $path, run $i: rc=$?"
			grep -E 'killcycles_test.go:[0-9]+: (NCCL|FIGURE)' "$OUT/kill-onerank-$path-$i.log" | cut -c1-240
		done
	done
	;;
*)
	echo "usage: $0 build <main checkout> | run | kill | kill-onerank" >&2
	exit 2
	;;
esac
