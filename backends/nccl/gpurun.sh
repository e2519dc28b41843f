#!/bin/bash
# Builds the GPU tests and benchmarks into <main checkout>/.gpu/nccl (here) or
# runs them (on the device machine, from the checkout root):
#
#   backends/nccl/gpurun.sh build /work/main     # here: binaries + scripts into /work/main/.gpu/nccl
#   bash .gpu/nccl/gpurun.sh run                 # there (device tool, carry [".gpu/nccl"], kind nvidia-h200-x2)
#
# The run: every GPU test (collectives vs host references, peer that never
# posts, revoke modes, SIGKILL + shrink + grow across processes, deadline),
# the NVML read, ncclbench sweeps (blocking and stream-ordered, nonblocking
# and blocking NCCL comms) and PyTorch's all_reduce over the same sizes.
# NVLink multicast stays off everywhere.
set -u
case "${1:-}" in
build)
	dst="${2:?main checkout}/.gpu/nccl"
	mkdir -p "$dst"
	root="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
	cd "$root" || exit 1
	CGO_ENABLED=1 go test -c -ldflags="-s -w" -o "$dst/nccl.test" ./backends/nccl &&
		CGO_ENABLED=1 go test -c -ldflags="-s -w" -o "$dst/health.test" ./backends/nccl/health &&
		CGO_ENABLED=1 go build -ldflags="-s -w" -o "$dst/ncclbench" ./backends/nccl/cmd/ncclbench &&
		cp backends/nccl/cmd/ncclbench/ref/latency.c bench/torch_allreduce.py backends/nccl/gpurun.sh "$dst/"
	;;
run)
	cd "$(dirname "$0")" || exit 1
	export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 FTCOMM_NCCL_GPU=1
	OUT="${OUT:-/tmp}"
	echo "== tests"
	timeout 200 ./nccl.test -test.run GPU -test.v -test.timeout 190s >"$OUT/tests.log" 2>&1
	echo "rc=$?"
	grep -E '^(--- |FAIL|ok|PASS)|FIGURE|per op|    [a-z_]+\.go:[0-9]+:' "$OUT/tests.log" | grep -v -- '--- PASS: .*/'
	echo "== NVML"
	FTCOMM_NVML=1 timeout 60 ./health.test -test.run RealNVML -test.v 2>&1 | tail -6
	echo "== ncclbench 8 B .. 1 GiB"
	for m in "-mode blocking" "-mode stream" "-mode blocking -blockingcomm" "-mode stream -blockingcomm"; do
		timeout 120 ./ncclbench -b 8 -e 1G -f 8 -n 20 $m 2>&1 | tee -a "$OUT/sweeps.log"
	done
	echo "== PyTorch"
	timeout 150 python3 torch_allreduce.py -b 8 -e 1G -f 8 2>&1 | grep -v Warning | tee "$OUT/torch.log"
	;;
*)
	echo "usage: $0 build MAIN_CHECKOUT | run" >&2
	exit 2
	;;
esac
