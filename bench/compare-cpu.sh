#!/usr/bin/env bash
# compare-cpu.sh — ftcomm's gloo backend against the CPU all-reduces a user
# of one host would otherwise reach for, side by side in one run:
#   ftcomm     cmd/ftbench as it runs by default (ranks on one host move data
#              through shared memory; TCP for control and liveness)
#   ft-tcp     the same with FTCOMM_GLOO_SHM=0 (TCP loopback only)
#   gloo       Debian's libgloo, AllreduceOptions RING (what PyTorch calls),
#              timed by bench/gloo/allreduce.cc, TCP loopback
#   mpi        Open MPI's MPI_Allreduce over its shared-memory transport
#              (--mca pml ob1 --mca btl self,vader), timed by bench/mpi/allreduce.c
#   ft-base    another build of cmd/ftbench, $BIN/ftbench-base, where it
#              exists (TOOLS="ftcomm ft-base" compares two commits side by side)
#   torch      PyTorch torch.distributed gloo on CPU tensors
#              (bench/torch_gloo_allreduce.py), where python3 has torch
# and the host's single-process all-core memcpy bandwidth (bench/memcpy), the
# ceiling the large-message busbw is stated against, and for each rank count
# the all-reduce bound (memcpy_bw -r N: the least memory traffic an N-rank
# all-reduce can make on one memory system, on every core; see its source).
#
# Every tool uses one method: per size, one checked op on exact float32 data
# (#wrong), warm-up, barrier, timed back-to-back iterations; time is the
# slowest rank's mean; busbw = algbw x 2(n-1)/n, GB = 1e9. Rounds are
# interleaved (every tool at one rank count, then the next; the order of the
# tools alternates), and the summary gives medians over the rounds.
#
#   bench/compare-cpu.sh                       # builds what is missing, 3 rounds, ranks "2 4"
#   ROUNDS=5 RANKS="2 4 8" bench/compare-cpu.sh
#   BIN=/path/to/bundle bench/compare-cpu.sh   # prebuilt: $BIN/ftbench, gloo_allreduce,
#                                              # mpi_allreduce, memcpy_bw, torch_gloo_allreduce.py,
#                                              # and Open MPI under $BIN/root (see make-cpu-bundle.sh)
#
# Environment: ROUNDS (3), RANKS ("2 4"), SMALL (4096), SMALL_ITERS (20000
# for ftcomm and mpi; ft-tcp runs a quarter of that, gloo and torch a
# fortieth: each tool's timed part then lasts about as long), LARGE_ITERS
# (10, at 16 and 64 MiB), TOOLS (all that exist), OUT (a new temporary
# directory for raw outputs), NICE (empty; e.g. "nice -n -19" on a shared
# machine, applied to every tool alike).
set -uo pipefail

ROUNDS=${ROUNDS:-3}
RANKS=${RANKS:-"2 4"}
SMALL=${SMALL:-4096}
SMALL_ITERS=${SMALL_ITERS:-20000}
LARGE_ITERS=${LARGE_ITERS:-10}
NICE=${NICE:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$(mktemp -d /tmp/compare-cpu.XXXXXX)}
mkdir -p "$OUT"
die() { echo "compare-cpu: FAILED: $*" >&2; exit 1; }

# --- binaries ---------------------------------------------------------------
if [ -n "${BIN:-}" ]; then
  B=$BIN
  if [ -d "$B/root" ]; then # a bundle (make-cpu-bundle.sh): Debian's libraries and Open MPI's tree
    export LD_LIBRARY_PATH="$B/root/usr/lib/x86_64-linux-gnu:$B/root/usr/lib/x86_64-linux-gnu/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export OPAL_PREFIX="$B/root/usr" PATH="$B/root/usr/bin:$PATH"
  fi
else
  B=$OUT/bin; mkdir -p "$B"
  cd "$ROOT"
  go build -o "$B/ftbench" ./cmd/ftbench || die "build cmd/ftbench"
  if [ -f /usr/include/gloo/allreduce.h ]; then
    g++ -O2 -std=c++17 -o "$B/gloo_allreduce" bench/gloo/allreduce.cc -lgloo -lpthread || die "build bench/gloo/allreduce.cc"
  fi
  if command -v mpicc >/dev/null; then mpicc -O2 -o "$B/mpi_allreduce" bench/mpi/allreduce.c || die "build bench/mpi/allreduce.c"; fi
  gcc -O2 -mavx2 -pthread -o "$B/memcpy_bw" bench/memcpy/memcpy_bw.c || die "build bench/memcpy/memcpy_bw.c"
  cp bench/torch_gloo_allreduce.py "$B/"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
have() {
  case $1 in
    ftcomm|ft-tcp) [ -x "$B/ftbench" ] ;;
    ft-base) [ -x "$B/ftbench-base" ] ;;
    gloo)  [ -x "$B/gloo_allreduce" ] ;;
    mpi)   [ -x "$B/mpi_allreduce" ] && command -v mpirun >/dev/null ;;
    torch) python3 -c 'import torch.distributed' 2>/dev/null ;;
  esac
}
TOOLS=${TOOLS:-"ftcomm ft-tcp gloo mpi torch"}
avail=""; for t in $TOOLS; do if have "$t"; then avail="$avail $t"; else echo "# compare-cpu: $t not available here; left out"; fi; done
[ -n "$avail" ] || die "no tool to run"

echo "# compare-cpu: $(date -u +%FT%TZ), host $(hostname), $(nproc) cpus, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "# tools:$avail; rounds $ROUNDS; ranks $RANKS; small $SMALL B x $SMALL_ITERS iters; large 16 MiB, 64 MiB x $LARGE_ITERS iters; outputs in $OUT"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)${NICE:+; every tool runs under '$NICE'}"

# run TOOL NP B E F WARM ITERS TAG: one invocation; appends "tool np size time busbw" to $OUT/results.
run() {
  local tool=$1 np=$2 b=$3 e=$4 f=$5 w=$6 n=$7 tag=$8 log rc=0
  log="$OUT/$tool-np$np-$tag.txt"
  case $tool in
    ftcomm) $NICE timeout 300 "$B/ftbench" -np "$np" -b "$b" -e "$e" -f "$f" -w "$w" -n "$n" -raw=false >"$log" 2>&1 || rc=$? ;;
    ft-base) $NICE timeout 300 "$B/ftbench-base" -np "$np" -b "$b" -e "$e" -f "$f" -w "$w" -n "$n" -raw=false >"$log" 2>&1 || rc=$? ;;
    ft-tcp) FTCOMM_GLOO_SHM=0 $NICE timeout 300 "$B/ftbench" -np "$np" -b "$b" -e "$e" -f "$f" -w "$w" -n "$n" -raw=false >"$log" 2>&1 || rc=$? ;;
    gloo)   $NICE timeout 300 "$B/gloo_allreduce" -np "$np" -b "$b" -e "$e" -f "$f" -w "$w" -n "$n" -algo ring >"$log" 2>&1 || rc=$? ;;
    mpi)    $NICE timeout 300 mpirun -np "$np" --mca pml ob1 --mca btl self,vader "$B/mpi_allreduce" -b "$b" -e "$e" -f "$f" -w "$w" -n "$n" >"$log" 2>&1 || rc=$? ;;
    torch)  # one start of the ranks (seconds of imports) for every size: -plan
            $NICE timeout 300 python3 "$B/torch_gloo_allreduce.py" -np "$np" -w 2 \
              -plan "$SMALL:$((SMALL_ITERS / 40)),16M:$LARGE_ITERS,64M:$LARGE_ITERS" >"$log" 2>&1 || rc=$? ;;
  esac
  if [ $rc -ne 0 ]; then echo "# compare-cpu: $tool -np $np $tag exited $rc (see $log):"; tail -5 "$log" | sed 's/^/#   /'; return; fi
  awk -v t="$tool" -v np="$np" -v r="${tag##*-r}" '$1 ~ /^[0-9]+$/ && NF == 9 { if ($9 != 0) print "# WRONG " t " " $0 > "/dev/stderr"; print t, np, $1, $6, $8, r }' "$log" >>"$OUT/results"
}

: >"$OUT/results"
turn=0
for round in $(seq 1 "$ROUNDS"); do
  echo "# round $round: memcpy ceiling: $($NICE "$B/memcpy_bw" | sed 's/^# memcpy_bw: //')" | tee -a "$OUT/memcpy"
  for np in $RANKS; do
    echo "# round $round: $($NICE "$B/memcpy_bw" -r "$np" | sed 's/^# //')" | tee -a "$OUT/bound"
    turn=$((turn + 1)); order=$avail
    if [ $((turn % 2)) -eq 0 ]; then order=$(echo $avail | tr ' ' '\n' | tac | tr '\n' ' '); fi
    for tool in $order; do
      it=$SMALL_ITERS
      case $tool in ft-tcp) it=$((SMALL_ITERS / 4)) ;; gloo|torch) it=$((SMALL_ITERS / 40)) ;; esac
      run "$tool" "$np" "$SMALL" "$SMALL" 2 $((it / 20 + 1)) "$it" "small-r$round"
      [ "$tool" = torch ] || run "$tool" "$np" 16M 64M 4 2 "$LARGE_ITERS" "large-r$round"
    done
  done
done

median() { # TOOL NP SIZE FIELD
  awk -v t="$1" -v n="$2" -v s="$3" -v f="$4" '$1==t && $2==n && $3==s { print $f }' "$OUT/results" | sort -g |
    awk '{ v[NR] = $1 } END { if (NR == 0) { print "-"; exit } if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2] + v[NR/2+1]) / 2 }'
}
ceil=$(awk '{ for (i = 1; i <= NF; i++) if ($i == "GB/s" && $(i-1) ~ /^[0-9.]+$/ && $(i+1) == "copied") print $(i-1) }' "$OUT/memcpy" | sort -g |
  awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2] + v[NR/2+1]) / 2 }')
echo
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# ===== medians over $ROUNDS rounds: time (us) at $SMALL B, busbw (GB/s) at 16 and 64 MiB ====="
echo "# memcpy ceiling (all cores, one process): $ceil GB/s"
bound() { # NP: median over the rounds of the all-reduce bound's busbw
  awk -v n="$1" '$5 == n && $6 == "ranks," { for (i = 1; i <= NF; i++) if ($i == "busbw") print $(i+1) }' "$OUT/bound" | sort -g |
    awk '{ v[NR] = $1 } END { if (NR == 0) { print "-"; exit } if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2] + v[NR/2+1]) / 2 }'
}
for np in $RANKS; do echo "# all-reduce bound at $np ranks (least traffic, all cores, streaming stores; busbw): $(bound "$np") GB/s"; done
printf "# %5s %9s" ranks size; for t in $avail; do printf " %9s" "$t"; done; printf " %12s %12s\n" "ftcomm/ceil" "ftcomm/bound"
for np in $RANKS; do
  for size in $SMALL 16777216 67108864; do
    f=5; [ "$size" = "$SMALL" ] && f=4
    printf "  %5s %9s" "$np" "$size"
    for t in $avail; do printf " %9s" "$(median "$t" "$np" "$size" $f)"; done
    if [ "$size" = "$SMALL" ]; then printf " %12s %12s\n" "" ""; else
      printf " %12s %12s\n" "$(awk -v a="$(median ftcomm "$np" "$size" 5)" -v c="$ceil" 'BEGIN { if (a != "-" && c > 0) printf "%.0f%%", 100 * a / c }')" \
        "$(awk -v a="$(median ftcomm "$np" "$size" 5)" -v c="$(bound "$np")" 'BEGIN { if (a != "-" && c != "-" && c > 0) printf "%.0f%%", 100 * a / c }')"; fi
  done
done
echo "# columns: 4 KiB rows give the time in us (lower is better), the others busbw in GB/s (higher is better)"
echo
echo "# ===== ftcomm's busbw against the all-reduce bound measured in the same round (memory bandwidth moves between rounds) ====="
for np in $RANKS; do
  for size in 16777216 67108864; do
    line="  ranks $np size $size:"
    for round in $(seq 1 "$ROUNDS"); do
      a=$(awk -v n="$np" -v s="$size" -v r="$round" '$1=="ftcomm" && $2==n && $3==s && $6==r { print $5 }' "$OUT/results")
      c=$(awk -v n="$np" -v r="$round" '$3 == r":" && $5 == n && $6 == "ranks," { for (i = 1; i <= NF; i++) if ($i == "busbw") print $(i+1) }' "$OUT/bound")
      line="$line $(awk -v a="$a" -v c="$c" 'BEGIN { if (a != "" && c > 0) printf "%.2f/%.2f=%.0f%%", a, c, 100 * a / c; else print "-" }')"
    done
    echo "$line"
  done
done
echo
echo "# ===== ftcomm against the others (ratios of medians; > 1 means ftcomm is better) ====="
for np in $RANKS; do
  for size in $SMALL 16777216 67108864; do
    line="  ranks $np size $size:"
    for t in $avail; do
      [ "$t" = ftcomm ] && continue
      if [ "$size" = "$SMALL" ]; then r=$(awk -v a="$(median "$t" "$np" "$size" 4)" -v b="$(median ftcomm "$np" "$size" 4)" 'BEGIN { if (a != "-" && b != "-" && b > 0) printf "%.2f", a / b; else print "-" }')
      else r=$(awk -v a="$(median ftcomm "$np" "$size" 5)" -v b="$(median "$t" "$np" "$size" 5)" 'BEGIN { if (a != "-" && b != "-" && b > 0) printf "%.2f", a / b; else print "-" }'); fi
      line="$line $t $r"
    done
    echo "$line"
  done
done
