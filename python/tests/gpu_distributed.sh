#!/bin/bash
# PyTorch's parallelism stack on ftcomm, on GPUs (torch 2.x with CUDA):
# builds libftcomm.so here, runs everything there in one command.
#
#   python/tests/gpu_distributed.sh build            # here: .gpu/dist/libftcomm.so (carry .gpu/dist)
#   bash python/tests/gpu_distributed.sh run         # there, 2 or 4 GPUs, from the checkout root
#
# run, in order (each stage bounded; the next one runs whatever the last gave):
#   1. pytest: test_cuda_distributed.py (every op against torch's NCCL, stream
#      order, DDP and FSDP (1) against torch's NCCL, FSDP2 and DTensor over
#      ftcomm.device_mesh), test_distributed.py and test_distributed_ft.py
#      (the CPU tests, on torch 2.x's gloo), test_cuda.py (with a 1,500-op
#      stream-order stress against torch's NCCL);
#   2. bench/torch_parallel_ftcomm.py under torchrun on 2 GPUs: DDP, FSDP2 and
#      FT-HSDP (no failure) step times next to torch's NCCL;
#   3. examples/torch/train_hsdp.py --device cuda: FT-HSDP (2 groups x 2 GPUs
#      on 4 GPUs, 2 x 1 on 2), a rank killed at 40 %, its group restarted and
#      healed, the run without failure; hsdp-report/ to $OUT.
#   stress (only when STAGES names it): python/tests/stream_stress.py, the
#      randomized stream-order stress, STRESS_RUNS runs (default 5) of
#      STRESS_OPS ops (default 10000) on every GPU (STRESS_NPROC ranks),
#      from STRESS_SEED (default a fresh one, printed), bit for bit against
#      torch's NCCL; STRESS_MINUTES instead bounds each run by time. The
#      stage ends after STRESS_TIMEOUT s (default 3000).
# Everything goes to $OUT (default /tmp/gpu-distributed): pytest.log,
# bench.md, hsdp-report/{summary.txt,loss.svg,*.log}, stress.log.
# STAGES="tests bench example" (the default) picks stages; HSDP_STEPS sets
# the example's steps (default: the example's own, 1500 on CUDA).
set -u
export NCCL_NVLS_ENABLE=0

root="$(cd "$(dirname "$0")/../.." && pwd)"
case "${1:-run}" in
build)
	cd "$root" || exit 1
	mkdir -p .gpu/dist
	go build -buildmode=c-shared -o .gpu/dist/libftcomm.so ./capi && ls -la .gpu/dist/libftcomm.so
	;;
run)
	cd "$root" || exit 1
	OUT="${OUT:-/tmp/gpu-distributed}"
	mkdir -p "$OUT"
	if [ -z "${FTCOMM_LIBRARY:-}" ]; then
		if [ -f .gpu/dist/libftcomm.so ]; then
			export FTCOMM_LIBRARY="$root/.gpu/dist/libftcomm.so"
		elif command -v go >/dev/null; then
			go build -buildmode=c-shared -o "$OUT/libftcomm.so" ./capi || exit 1
			export FTCOMM_LIBRARY="$OUT/libftcomm.so"
		else
			echo "no library: run '$0 build' here and carry .gpu/dist, or set FTCOMM_LIBRARY" >&2
			exit 1
		fi
	fi
	export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
	PY="${PYTHON:-python3}"
	ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
	echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $ngpu; torch $($PY -c 'import torch; print(torch.__version__)'); $(nproc) cores; $(date -u +%FT%TZ)"
	stages="${STAGES:-tests bench example}"
	for s in $stages; do
		case "$s" in
		tests)
			echo "== 1. pytest"
			timeout 500 "$PY" -m pytest -q -rs -p no:cacheprovider python/tests/test_cuda_distributed.py \
				python/tests/test_distributed.py python/tests/test_distributed_ft.py python/tests/test_cuda.py \
				>"$OUT/pytest.log" 2>&1
			echo "rc=$?"
			grep -E "passed|failed|error|SKIPPED|^FAILED|^ERROR" "$OUT/pytest.log" | tail -20
			;;
		bench)
			echo "== 2. bench (2 GPUs)"
			timeout 150 torchrun --standalone --nproc_per_node 2 bench/torch_parallel_ftcomm.py >"$OUT/bench.log" 2>&1
			echo "rc=$?"
			grep "^|" "$OUT/bench.log" | tee "$OUT/bench.md"
			grep -E "Error|error:" "$OUT/bench.log" | head -5
			;;
		example)
			echo "== 3. examples/torch/train_hsdp.py --device cuda"
			timeout 400 "$PY" examples/torch/train_hsdp.py --device cuda ${HSDP_STEPS:+--steps "$HSDP_STEPS"} \
				--out "$OUT/hsdp-report" >"$OUT/hsdp.log" 2>&1
			echo "rc=$?"
			grep -v "^20..-" "$OUT/hsdp.log" | tail -25
			;;
		stress)
			ops="${STRESS_OPS:-10000}"
			if [ -n "${STRESS_MINUTES:-}" ] && [ -z "${STRESS_OPS:-}" ]; then
				ops=0 # the time bounds each run
			fi
			echo "== 4. python/tests/stream_stress.py: ${STRESS_RUNS:-5} runs of ${ops} ops${STRESS_MINUTES:+ or ${STRESS_MINUTES} min}"
			timeout "${STRESS_TIMEOUT:-3000}" "$PY" python/tests/stream_stress.py --runs "${STRESS_RUNS:-5}" --ops "$ops" \
				${STRESS_MINUTES:+--minutes "$STRESS_MINUTES"} ${STRESS_SEED:+--seed "$STRESS_SEED"} \
				${STRESS_NPROC:+--nproc "$STRESS_NPROC"} --stats >"$OUT/stress.log" 2>&1
			echo "rc=$?"
			grep -E "^stream_stress:|^  " "$OUT/stress.log" | tail -40
			;;
		esac
	done
	;;
*)
	echo "usage: $0 build|run" >&2
	exit 2
	;;
esac
