#!/usr/bin/env bash
# compare-gloo.sh — ftcomm's gloo backend (via cmd/ftbench) against Debian's
# libgloo ring allreduce, side by side in one run on this machine.
#
# For every round, rank count and size it runs libgloo's AllreduceOptions ring
# ("ring"), libgloo's older AllreduceRing ("legacy"), ftbench as it runs by
# default ("ftbench": ranks on one host exchange data through shared memory,
# with its raw TCP ring baseline) and ftbench with shared memory turned off
# ("ft-tcp": FTCOMM_GLOO_SHM=0, everything over TCP like libgloo) one after
# the other, alternating which goes first, so that the machine's noise hits
# all of them alike. It prints
# every table, then the medians over the rounds and the ratios the project's
# targets are stated in (for ftbench's default; ft-tcp is shown beside it):
#   - ftbench busbw / libgloo busbw at 16 MiB and 64 MiB, 2 and 4 ranks (>= 1.5)
#   - libgloo time / ftbench time at 4 KiB (>= 10)
#   - ftbench busbw / raw TCP busbw at 64 MiB (>= 0.8)
# Each ratio is given against both libgloo algorithms; a target counts as met
# only against the better of the two.
#
# Any failed run, wrong element or missing row stops the script with a
# non-zero status. Missed targets are reported loudly; with STRICT=1 they
# make the status non-zero too.
#
# Environment: ROUNDS (3), RANKS ("2 4"), OUT (a new temporary directory for
# binaries and raw outputs), STRICT (0), PROFILE (0; 1 = also profile one
# ftbench worker at 64 MiB, 2 ranks, and print the top of the profile).
set -euo pipefail

ROUNDS=${ROUNDS:-3}
RANKS=${RANKS:-"2 4"}
STRICT=${STRICT:-0}
PROFILE=${PROFILE:-0}
# size:warmup:iters — the timed part of a run lasts up to a few seconds for
# libgloo and ~50 ms or more for ftcomm. 4 KiB runs 3000 iterations: with
# 300, ftcomm's timed part was 4 ms, and one scheduling hiccup of this VM
# (a few ms) moved its mean by half.
PLAN="4096:100:3000 1048576:5:50 4194304:3:20 16777216:2:10 67108864:2:10"
LARGE_SIZES="1048576 4194304 16777216 67108864"
SMALL_SIZE=4096

die() { echo "compare-gloo: FAILED: $*" >&2; exit 1; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$(mktemp -d /tmp/compare-gloo.XXXXXX)}
mkdir -p "$OUT"

# --- dependencies ---------------------------------------------------------
need_apt=()
[ -f /usr/include/gloo/allreduce.h ] && [ -e /usr/lib/libgloo.so -o -e /usr/lib/x86_64-linux-gnu/libgloo.so ] || need_apt+=(libgloo-dev)
command -v g++ >/dev/null || need_apt+=(g++)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "compare-gloo: installing ${need_apt[*]}" >&2
  [ "$(id -u)" = 0 ] || die "need root to apt-get install ${need_apt[*]}"
  apt-get update -qq >&2 || die "apt-get update"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >&2 || die "apt-get install ${need_apt[*]}"
fi
command -v go >/dev/null || die "go is not installed"

# --- build ----------------------------------------------------------------
g++ -O2 -std=c++17 -Wall -o "$OUT/gloo_allreduce" bench/gloo/allreduce.cc -lgloo -lpthread || die "build bench/gloo/allreduce.cc"
go build -o "$OUT/ftbench" ./cmd/ftbench || die "build cmd/ftbench"

echo "# compare-gloo: $(date -u +%FT%TZ), host $(hostname), $(nproc) cores, $(go version | cut -d' ' -f3), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo -dirty)"
echo "# libgloo $(dpkg-query -W -f='${Version}' libgloo-dev 2>/dev/null || echo '?'); rounds $ROUNDS; ranks $RANKS; outputs in $OUT"
echo "# per size (bytes:warmup:iters): $PLAN; ftbench runs its raw TCP ring baseline at every size"
echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg) (other work on this machine adds noise to every figure)"

# run TOOL NP SIZE WARMUP ITERS ROUND: runs one benchmark of one size, keeps
# its output, prints its table, and appends "tool np size time busbw" lines to
# $OUT/results.
run() {
  local tool=$1 np=$2 size=$3 warm=$4 iters=$5 round=$6 log rc=0
  local args=(-b "$size" -e "$size" -w "$warm" -n "$iters")
  log="$OUT/$tool-np$np-$size-r$round.txt"
  case $tool in
    gloo-ring)   timeout 600 "$OUT/gloo_allreduce" -np "$np" "${args[@]}" -algo ring   >"$log" 2>"$log.err" || rc=$? ;;
    gloo-legacy) timeout 600 "$OUT/gloo_allreduce" -np "$np" "${args[@]}" -algo legacy >"$log" 2>"$log.err" || rc=$? ;;
    ftbench)     timeout 600 "$OUT/ftbench" -np "$np" "${args[@]}" >"$log" 2>"$log.err" || rc=$? ;;
    ft-tcp)      FTCOMM_GLOO_SHM=0 timeout 600 "$OUT/ftbench" -np "$np" "${args[@]}" -raw=false >"$log" 2>"$log.err" || rc=$? ;;
  esac
  # Every row, prefixed with who measured it (headers stay in $log).
  awk -v tool="$tool" -v np="$np" -v round="$round" '
    {
      t = tool
      if (substr($0, 1, 1) == "#") { if ($0 !~ / rawtcp /) next; sub(/^#/, " "); t = "rawtcp" }
      printf "%-11s %2d %5d%s\n", t, np, round, $0
    }' "$log"
  if [ $rc -ne 0 ]; then
    sed 's/^/    stderr: /' "$log.err" | tail -20
    die "$tool -np $np at $size bytes (round $round) exited with status $rc"
  fi
  # Rows: size count type redop root time algbw busbw wrong. Baseline rows
  # are comments whose type is rawtcp.
  awk -v tool="$tool" -v np="$np" -v file="$log" '
    {
      t = tool
      if (substr($0, 1, 1) == "#") { sub(/^#/, " "); if ($3 != "rawtcp") next; t = "rawtcp" }
      if (NF != 9 || $1 !~ /^[0-9]+$/) next
      if ($9 != 0) { printf "wrong elements: %s in %s\n", $0, file > "/dev/stderr"; bad = 1 }
      print t, np, $1, $6, $8; n++
    }
    END { if (bad) exit 2; if (n == 0) exit 3 }
' "$log" >>"$OUT/results" || die "$tool -np $np at $size bytes (round $round): wrong results or no rows (see $log)"
}

: >"$OUT/results"
echo
echo "# tool       np round        size         count      type   redop    root     time   algbw   busbw  #wrong"
echo "#                                (B)    (elements)                               (us)  (GB/s)  (GB/s)"
turn=0
for round in $(seq 1 "$ROUNDS"); do
  for np in $RANKS; do
    for step in $PLAN; do
      IFS=: read -r size warm iters <<<"$step"
      turn=$((turn + 1))
      if [ $((turn % 2)) -eq 1 ]; then order="gloo-ring gloo-legacy ftbench ft-tcp"; else order="ft-tcp ftbench gloo-legacy gloo-ring"; fi
      for tool in $order; do run "$tool" "$np" "$size" "$warm" "$iters" "$round"; done
    done
  done
done

# Every (tool, np, size) must have a row from every round.
for np in $RANKS; do
  for tool in gloo-ring gloo-legacy ftbench ft-tcp; do
    for size in $SMALL_SIZE $LARGE_SIZES; do
      c=$(awk -v t="$tool" -v n="$np" -v s="$size" '$1==t && $2==n && $3==s' "$OUT/results" | wc -l)
      [ "$c" -eq "$ROUNDS" ] || die "$tool -np $np size $size: $c rows for $ROUNDS rounds"
    done
  done
  for size in $SMALL_SIZE $LARGE_SIZES; do
    c=$(awk -v n="$np" -v s="$size" '$1=="rawtcp" && $2==n && $3==s' "$OUT/results" | wc -l)
    [ "$c" -eq "$ROUNDS" ] || die "raw baseline -np $np size $size: $c rows for $ROUNDS rounds"
  done
done

# median TOOL NP SIZE FIELD(4=time, 5=busbw)
median() {
  awk -v t="$1" -v n="$2" -v s="$3" -v f="$4" '$1==t && $2==n && $3==s { print $f }' "$OUT/results" |
    sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) exit 1; if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2] + v[NR/2+1]) / 2 }'
}
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "inf" }'; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a >= b) }'; }

echo
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# ===== medians over $ROUNDS rounds (time us, busbw GB/s) ====="
printf "# %5s %10s | %10s %8s | %10s %8s | %10s %8s | %10s %8s | %10s %8s | %8s %8s %8s %8s\n" ranks size \
  "ring us" busbw "legacy us" busbw "ftbench us" busbw "ft-tcp us" busbw "raw us" busbw "ft/ring" "ft/leg" "ft/raw" "tcp/best"
for np in $RANKS; do
  for size in $SMALL_SIZE $LARGE_SIZES; do
    rt=$(median gloo-ring "$np" "$size" 4); rb=$(median gloo-ring "$np" "$size" 5)
    lt=$(median gloo-legacy "$np" "$size" 4); lb=$(median gloo-legacy "$np" "$size" 5)
    ft=$(median ftbench "$np" "$size" 4); fb=$(median ftbench "$np" "$size" 5)
    tt=$(median ft-tcp "$np" "$size" 4); tb=$(median ft-tcp "$np" "$size" 5)
    wt=$(median rawtcp "$np" "$size" 4); wb=$(median rawtcp "$np" "$size" 5)
    if [ "$size" = $SMALL_SIZE ]; then  # latency: libgloo (or raw) time / ftbench time
      a=$(ratio "$rt" "$ft"); b=$(ratio "$lt" "$ft"); fr=$(ratio "$wt" "$ft")
      tr=$(ratio "$(awk -v a="$rt" -v b="$lt" 'BEGIN { print (a < b ? a : b) }')" "$tt")
    else                               # bandwidth: ftbench busbw / libgloo (or raw) busbw
      a=$(ratio "$fb" "$rb"); b=$(ratio "$fb" "$lb"); fr=$(ratio "$fb" "$wb")
      tr=$(ratio "$tb" "$(awk -v a="$rb" -v b="$lb" 'BEGIN { print (a > b ? a : b) }')")
    fi
    printf "  %5s %10s | %10s %8s | %10s %8s | %10s %8s | %10s %8s | %10s %8s | %8s %8s %8s %8s\n" "$np" "$size" "$rt" "$rb" "$lt" "$lb" "$ft" "$fb" "$tt" "$tb" "$wt" "$wb" "$a" "$b" "$fr" "$tr"
  done
done
echo "# ft/ring, ft/leg, ft/raw: busbw ratio ftbench / libgloo ring, legacy, raw TCP ring; at 4096 B time ratio libgloo (or raw) / ftbench"
echo "# tcp/best: the same for ft-tcp (shared memory off) against the better libgloo algorithm"
echo "# (the raw ring's 4096 B time is one exchange with the neighbours over plain TCP: about the least a 2-rank allreduce can take here)"

echo
echo "# ===== targets (against the better libgloo algorithm) ====="
missed=0
check() { # NAME VALUE TARGET
  if ge "$2" "$3"; then echo "  met     $1: $2 (target >= $3)"; else echo "  MISSED  $1: $2 (target >= $3)"; missed=$((missed+1)); fi
}
for np in $RANKS; do
  for size in 16777216 67108864; do
    fb=$(median ftbench "$np" "$size" 5)
    best=$(awk -v a="$(median gloo-ring "$np" "$size" 5)" -v b="$(median gloo-legacy "$np" "$size" 5)" 'BEGIN { print (a > b ? a : b) }')
    check "allreduce busbw ftbench/libgloo, $np ranks, $((size >> 20)) MiB" "$(ratio "$fb" "$best")" 1.5
  done
  ft=$(median ftbench "$np" $SMALL_SIZE 4)
  best=$(awk -v a="$(median gloo-ring "$np" $SMALL_SIZE 4)" -v b="$(median gloo-legacy "$np" $SMALL_SIZE 4)" 'BEGIN { print (a < b ? a : b) }')
  check "allreduce 4 KiB latency libgloo/ftbench, $np ranks" "$(ratio "$best" "$ft")" 10
  check "allreduce busbw ftbench/raw TCP, $np ranks, 64 MiB" "$(ratio "$(median ftbench "$np" 67108864 5)" "$(median rawtcp "$np" 67108864 5)")" 0.8
done

if [ "$PROFILE" = 1 ]; then
  echo
  echo "# ===== CPU profile of ftbench rank 0, allreduce 64 MiB, 2 ranks ====="
  "$OUT/ftbench" -np 2 -b 64M -e 64M -w 3 -n 40 -raw=false -cpuprofile "$OUT/cpu.pprof" >"$OUT/profile-run.txt" 2>&1 || die "profile run failed (see $OUT/profile-run.txt)"
  go tool pprof -top -nodecount=25 "$OUT/ftbench" "$OUT/cpu.pprof.rank0" 2>/dev/null | sed 's/^/  /'
fi

echo
if [ "$missed" -gt 0 ]; then
  echo "# compare-gloo: all runs correct; $missed TARGET(S) MISSED"
  if [ "$STRICT" = 1 ]; then exit 1; fi
else
  echo "# compare-gloo: all runs correct; all targets met"
fi
