#!/bin/bash
# Builds the GPU tests and benchmarks into <main checkout>/.gpu/nccl (here) or
# runs them (on the device machine, from the checkout root):
#
#   backends/nccl/gpurun.sh build <checkout>     # here: binaries + scripts into <checkout>/.gpu/nccl
#   bash .gpu/nccl/gpurun.sh run-tests           # there, 2-8 GPUs; each of these three
#   bash .gpu/nccl/gpurun.sh run-torch           #   runs in under 10 minutes
#   bash .gpu/nccl/gpurun.sh run-bench
#   bash .gpu/nccl/gpurun.sh run1                # there, one GPU
#
# Unless FTCOMM_NCCL_LIB names one, Open loads the newest NCCL it finds
# (here PyTorch's); the runs below name the one they measure: the system's
# by its soname (libnccl.so.2, the loader's choice), PyTorch's by path.
# TestGPULibrarySelection (in run-tests and run1) shows the choice itself.
#
# run-tests: every GPU test with the system NCCL (collectives vs host
# references, peer that never posts, revoke modes, SIGKILL + shrink + grow
# across processes, a second death during shrink (3+ GPUs) and grow,
# deadline, the kill-shrink-grow soak on every GPU, the NVML watch).
# run-torch: the NCCL behaviours the shrink relies on (TestGPUNCCL*) and the
# fault tests with PyTorch's NCCL (2.28.9: ncclCommRevoke),
# and PyTorch's all_reduce over ncclbench's sizes. run-bench: ncclbench
# sweeps (waited-for and stream-ordered ops, each comm mode) and ftbench's
# nccl-tests table for the default mode with -async (nccl-tests' method).
# run1: what one GPU can show: single-rank comms in every mode, the launch
# cost of each mode with the system NCCL and with PyTorch's, the host
# copier and its throughput, the NVML watch (run1 needs nccl.test only).
# NVLink multicast stays off everywhere.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FTCOMM_NCCL_GPU=1

# torch_nccl prints the path of PyTorch's libnccl.so.2, if there is one.
torch_nccl() {
	python3 - <<'EOF' 2>/dev/null
import glob, os, site
cands = []
for d in site.getsitepackages() + [site.getusersitepackages()]:
    cands += glob.glob(os.path.join(d, "nvidia", "nccl", "lib", "libnccl.so.2"))
print(cands[0] if cands else "")
EOF
}

case "${1:-}" in
build)
	dst="${2:?main checkout}/.gpu/nccl"
	mkdir -p "$dst"
	root="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
	cd "$root" || exit 1
	# nccl.test, ncclbench and ftbench: 62 MiB, under the device tool's
	# 64 MiB carry limit (the NVML read is nccl.test's TestGPUWatchHealth).
	CGO_ENABLED=1 go test -c -ldflags="-s -w" -o "$dst/nccl.test" ./backends/nccl &&
		CGO_ENABLED=1 go build -ldflags="-s -w" -o "$dst/ncclbench" ./backends/nccl/cmd/ncclbench &&
		CGO_ENABLED=1 go build -ldflags="-s -w" -o "$dst/ftbench" ./cmd/ftbench &&
		cp backends/nccl/cmd/ncclbench/ref/latency.c bench/torch_allreduce.py backends/nccl/gpurun.sh "$dst/"
	;;
run-tests)
	cd "$(dirname "$0")" || exit 1
	OUT="${OUT:-/tmp}"
	n=$(nvidia-smi -L | wc -l)
	echo "== $n GPUs; $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)"
	echo "== tests (default mode, system NCCL)"
	FTCOMM_NCCL_LIB="${FTCOMM_NCCL_LIB:-libnccl.so.2}" FTCOMM_NCCL_RANKS=$n FTCOMM_NCCL_CYCLES=10 timeout 560 ./nccl.test -test.run GPU -test.v -test.timeout 550s >"$OUT/tests.log" 2>&1
	echo "rc=$?"
	grep -E '^(--- |FAIL|ok|PASS)|FIGURE|per op|    [a-z_0-9]+\.go:[0-9]+:' "$OUT/tests.log" | grep -v -- '--- PASS: .*/'
	if [ "$n" -ge 3 ]; then
		echo "== the shrink's data comm side by side: split off the shrunk control comm (before), then made by the shrink itself (the default)"
		for sh in split ""; do
			FTCOMM_NCCL_SHRINK=$sh FTCOMM_NCCL_RANKS=$n FTCOMM_NCCL_CYCLES=10 timeout 200 ./nccl.test -test.run '^TestGPUKillCycles$' -test.v >"$OUT/cycles-shrink-${sh:-data}.log" 2>&1
			grep -E 'kill->first collective|shrinks made by|grow' "$OUT/cycles-shrink-${sh:-data}.log" | head -20
		done
	fi
	if [ "$n" = 2 ]; then
		echo "== the lone survivor's shrink side by side: an NCCL comm of one rank (ncclCommShrink), then device copies (the default)"
		for one in nccl ""; do
			FTCOMM_NCCL_ONE_RANK=$one FTCOMM_NCCL_CYCLES=10 timeout 120 ./nccl.test -test.run '^TestGPUKillCycles$' -test.v >"$OUT/cycles-onerank-${one:-local}.log" 2>&1
			grep -E 'kill->first collective|shrinks made by' "$OUT/cycles-onerank-${one:-local}.log"
		done
	fi
	;;
run-torch)
	cd "$(dirname "$0")" || exit 1
	OUT="${OUT:-/tmp}"
	n=$(nvidia-smi -L | wc -l)
	lib="$(torch_nccl)"
	echo "== tests with PyTorch's NCCL (${lib:-none found}): revoke, kill, second death"
	if [ -n "$lib" ]; then
		FTCOMM_NCCL_LIB="$lib" timeout 300 ./nccl.test -test.run 'GPUNCCL|GPURevoke|GPUKill(ShrinkGrow|Deadline)|SecondDeath|JoinerDies|GPULaunchCost' -test.v >"$OUT/tests-torch.log" 2>&1
		echo "rc=$?"
		grep -E '^(--- |FAIL|ok|PASS)|FIGURE|    [a-z_0-9]+\.go:[0-9]+:' "$OUT/tests-torch.log" | grep -v -- '--- PASS: .*/'
	fi
	echo "== PyTorch"
	timeout 200 python3 torch_allreduce.py -g "$n" -b 8 -e 1G -f 8 2>&1 | grep -v Warning | tee "$OUT/torch.log"
	;;
run-bench)
	cd "$(dirname "$0")" || exit 1
	OUT="${OUT:-/tmp}"
	n=$(nvidia-smi -L | wc -l)
	echo "== $n GPUs; $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)"
	echo "== ncclbench 8 B .. 1 GiB, $n GPUs"
	for cm in blocking-data nonblocking blocking; do
		for m in blocking stream; do
			timeout 80 ./ncclbench -g "$n" -b 8 -e 1G -f 8 -n 50 -mode $m -commmode $cm 2>&1 | tee -a "$OUT/sweeps.log"
		done
	done
	echo "== ftbench (nccl-tests table; default mode, async = nccl-tests' method)"
	timeout 100 ./ftbench -backend nccl -np "$n" -b 8 -e 1G -f 8 -n 50 -async 2>&1 | tee "$OUT/ftbench.log"
	;;
run1)
	cd "$(dirname "$0")" || exit 1
	OUT="${OUT:-/tmp}"
	echo "== $(nvidia-smi -L | head -1); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)"
	lib="$(torch_nccl)"
	echo "PyTorch's NCCL: ${lib:-none found}"
	echo "== the library Open chooses when none is named"
	timeout 60 ./nccl.test -test.run 'GPULibrarySelection' -test.v >"$OUT/tests-select.log" 2>&1
	echo "rc=$?"
	grep -E '^(--- |FAIL|ok|PASS)|FIGURE|candidate' "$OUT/tests-select.log" | cut -c1-400
	for which in system torch; do
		export FTCOMM_NCCL_LIB=libnccl.so.2
		if [ "$which" = torch ]; then
			[ -n "$lib" ] || continue
			export FTCOMM_NCCL_LIB="$lib"
		fi
		echo "== $which NCCL: one-rank comms, launch cost"
		timeout 150 ./nccl.test -test.run 'GPUInfo|GPULaunchCost|GPUOneRank' -test.v >"$OUT/tests-$which.log" 2>&1
		echo "rc=$?"
		grep -E '^(--- |FAIL|ok|PASS)|FIGURE|NCCL 2|    [a-z_0-9]+\.go:[0-9]+:' "$OUT/tests-$which.log" | grep -v -- '--- PASS: .*/' | cut -c1-400
	done
	unset FTCOMM_NCCL_LIB
	echo "== host copier, NVML watch"
	timeout 120 ./nccl.test -test.run 'GPUHostCopier|GPUWatchHealth' -test.v >"$OUT/copier.log" 2>&1
	echo "rc=$?"
	grep -E '^(--- |FAIL|ok|PASS)|FIGURE|deadline|free of|watching|    [a-z_0-9]+\.go:[0-9]+:' "$OUT/copier.log" | cut -c1-300
	echo "== host copy throughput (pinned chunks; 8 copy streams)"
	timeout 150 ./nccl.test -test.run '^$' -test.bench 'HostCopy' -test.benchtime 20x 2>&1 | tee "$OUT/bench.log" | grep -E 'Benchmark|ok|FAIL' |
		awk '{printf "%-48s %10s MB/s\n", $1, $(NF-1)}'
	;;
*)
	echo "usage: $0 build MAIN_CHECKOUT | run-tests | run-torch | run-bench | run1" >&2
	exit 2
	;;
esac
