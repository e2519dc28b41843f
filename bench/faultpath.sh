#!/bin/bash
# Every figure of the GPU fault path (issue 43; docs/measurements.md, "The
# fault path, phase by phase" and what follows it) in one run, on any GPU
# machine, with the previous build's path beside the new one.
#
#   bench/faultpath.sh build [PREV]       # here: binaries into .gpu/faultpath (PREV: the
#                                         # commit whose ftbench is the steady state's baseline,
#                                         # default the last commit before the shrink's data comm)
#   bash .gpu/faultpath/faultpath.sh run [PART...]   # there, from the checkout root
#
# PARTs (default all, in this order; a session can run them one call each
# within the device tool's 10 minutes; on 8 GPUs split phases too, e.g.
# FAULTPATH_SIZES="2 3 4" in one call and FAULTPATH_SIZES=8 in another):
#   phases  TestGPUKillCycles at every size from 2 to the machine's GPUs (2, 3, 4, 8
#           where there are that many), 6 cycles each, NCCL's init timers on: the
#           shrink's data comm made by the shrink (default) and split off the
#           shrunk control comm (FTCOMM_NCCL_SHRINK=split, the path before),
#           alternated; at 2 GPUs the lone survivor's two paths instead
#           (FTCOMM_NCCL_ONE_RANK=nccl is the one before). FAULTPATH_SIZES and
#           FAULTPATH_RUNS (default 2 per path) choose what runs.
#   ft      ft's kill cycles over NCCL, one replica per GPU: 20 SIGKILLs, 5 of them
#           two at once (3+ GPUs), the new path and then the one before (at 2
#           GPUs the lone survivor's NCCL comm of one rank).
#   hsdp    FT-HSDP in ft's kill cycles: groups of two ranks, a GPU each (2 x 2 on 4
#           GPUs, 4 x 2 on 8), 10 SIGKILLs of a rank, each path.
#   steady  8 B latency and busbw 8 B .. 1 GiB (ftbench -async, nccl-tests' method),
#           the previous build's ftbench and this one alternated, twice.
#   tests   every NCCL GPU test (TestGPUNCCL* are the NCCL behaviours the shrink
#           relies on), with the library search's choice and with the system's NCCL.
#
# Logs go to $OUT (default /tmp); the FIGURE lines are printed. NVLink
# multicast stays off.
set -u

case "${1:-}" in
build)
	root="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
	cd "$root" || exit 1
	prev="${2:-03c7bee}"
	dst="$root/.gpu/faultpath"
	rm -rf "$dst" && mkdir -p "$dst"
	tmp="$(mktemp -d)"
	git worktree add -f "$tmp/prev" "$prev" >/dev/null || exit 1
	(cd "$tmp/prev" && CGO_ENABLED=1 go build -ldflags="-s -w" -o "$dst/ftbench.prev" ./cmd/ftbench) &&
		CGO_ENABLED=1 go test -c -ldflags="-s -w" -o "$dst/nccl.test" ./backends/nccl &&
		CGO_ENABLED=1 go test -c -ldflags="-s -w" -o "$dst/ft.test" ./ft &&
		CGO_ENABLED=1 go build -ldflags="-s -w" -o "$dst/ftbench" ./cmd/ftbench || exit 1
	git worktree remove -f "$tmp/prev"
	rm -rf "$tmp"
	# gzip: four binaries of ~30 MB each, under the device tool's 64 MiB carry.
	gzip -f "$dst/nccl.test" "$dst/ft.test" "$dst/ftbench" "$dst/ftbench.prev"
	cp bench/faultpath.sh "$dst/"
	echo "built into $dst (previous build: $prev): $(du -sh "$dst" | cut -f1)"
	;;
run)
	shift
	cd "$(dirname "$0")" || exit 1
	export NCCL_NVLS_ENABLE=0 FTCOMM_NCCL_GPU=1
	for f in *.gz; do [ -e "$f" ] && gunzip -kf "$f"; done
	chmod +x nccl.test ft.test ftbench ftbench.prev
	OUT="${OUT:-/tmp}"
	mkdir -p "$OUT" || exit 1
	n=$(nvidia-smi -L | wc -l)
	parts="${*:-phases ft hsdp steady tests}"
	# killcycles LABEL LOG BEFORE VAR=VALUE...: ft's kill cycles over NCCL
	# with the settings given, the new path and then the one before
	# (BEFORE, a VAR=VALUE, added).
	killcycles() {
		local label=$1 name=$2 before=$3 path extra
		shift 3
		for path in new before; do
			extra=""
			[ "$path" = before ] && extra=$before
			env $extra FTCOMM_FT_KILL_BACKEND=nccl "$@" \
				timeout 280 ./ft.test -test.run '^TestKillCycles$' -test.v -test.count=1 -test.timeout 270s >"$OUT/$name-$path.log" 2>&1
			echo "-- $label, $path path: rc=$?"
			grep -E 'killcycles_test.go:[0-9]+: (NCCL|FIGURE)' "$OUT/$name-$path.log" | cut -c1-240
		done
	}
	echo "== $n GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ)"
	for part in $parts; do
		echo "== $part ($(date -u +%T))"
		case $part in
		phases)
			for k in ${FAULTPATH_SIZES:-2 3 4 8}; do
				[ "$k" -le "$n" ] || continue
				for i in $(seq "${FAULTPATH_RUNS:-2}"); do
					for path in before new; do
						env=""
						if [ "$path" = before ]; then
							env="FTCOMM_NCCL_SHRINK=split"
							[ "$k" = 2 ] && env="FTCOMM_NCCL_ONE_RANK=nccl"
						fi
						log="$OUT/phases-$k-$path-$i.log"
						env $env FTCOMM_NCCL_RANKS=$k FTCOMM_NCCL_CYCLES=6 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT \
							timeout 200 ./nccl.test -test.run '^TestGPUKillCycles$' -test.v -test.timeout 190s >"$log" 2>&1
						echo "-- $k ranks, $path path, run $i: rc=$?"
						grep -E 'FIGURE' "$log" | cut -c1-220
						grep -E 'Init timings' "$log" | sed -E 's/.*Init timings - //' | sort | uniq -c | sort -rn | head -6 | cut -c1-220
					done
				done
			done
			;;
		ft)
			[ "$n" -ge 2 ] || continue
			before=FTCOMM_FT_NCCL_SHRINK=split
			[ "$n" = 2 ] && before=FTCOMM_FT_NCCL_ONE_RANK=nccl
			dbl=0
			[ "$n" -ge 3 ] && dbl=5
			killcycles "ft, $n replicas" ft "$before" FTCOMM_FT_KILL_CYCLES=20 FTCOMM_FT_KILL_DOUBLE=$dbl FTCOMM_FT_KILL_REPLICAS=$n
			;;
		hsdp)
			[ "$n" -ge 4 ] || { echo "(needs 4 GPUs)"; continue; }
			killcycles "FT-HSDP $((n / 2)) x 2" hsdp FTCOMM_FT_NCCL_SHRINK=split \
				FTCOMM_FT_KILL_CYCLES=10 FTCOMM_FT_KILL_GROUP_SIZE=2 FTCOMM_FT_KILL_REPLICAS=$((n / 2))
			;;
		steady)
			for i in 1 2; do
				for b in ftbench.prev ftbench; do
					timeout 120 ./$b -backend nccl -np "$n" -b 8 -e 1G -f 8 -n 50 -async >"$OUT/steady-$b-$i.log" 2>&1
					echo "-- $b, run $i: rc=$?"
					grep -E '^ +(8|16777216|134217728|1073741824) ' "$OUT/steady-$b-$i.log"
				done
			done
			;;
		tests)
			for lib in "" libnccl.so.2; do
				log="$OUT/tests-${lib:-search}.log"
				FTCOMM_NCCL_LIB=$lib FTCOMM_NCCL_RANKS=$n FTCOMM_NCCL_CYCLES=5 timeout 400 ./nccl.test -test.run GPU -test.v -test.timeout 390s >"$log" 2>&1
				echo "-- every NCCL GPU test, FTCOMM_NCCL_LIB=${lib:-unset, the search chooses}: rc=$?"
				grep -E '^(--- |FAIL|ok|PASS)|    gpu_facts_test.go:[0-9]+:' "$log" | grep -v -- '--- PASS: .*/' | cut -c1-240
			done
			;;
		*)
			echo "unknown part $part" >&2
			exit 2
			;;
		esac
	done
	;;
*)
	echo "usage: $0 build [PREV] | run [phases|ft|hsdp|steady|tests ...]" >&2
	exit 2
	;;
esac
