#!/usr/bin/env bash
# Membership at scale on a device host's CPUs, in one call of under nine
# minutes (docs/capacity.md): before vs after at 10,000 members with the
# flags of capacity.md's 10K row (the no-regression comparison), then
# after at 100,000 ranks (12,500 replica groups of 8 on group leases, the
# leaders forwarding the quorum) with every phase: forming, steady, one
# death, a group leader's death, 1 % of the ranks dying at once, 100
# epochs for etcd's database size.
#
# Usage: cmd/ftload/device.sh BIN_DIR
#   BIN_DIR holds two static binaries built on a machine with Go:
#     ftload-before   cmd/ftload of the commit to compare with (main at
#                     18ea6c5: before issue 35; 79b86d3: before the
#                     decisions that cost what changed, scale-100k-3)
#     ftload          cmd/ftload of this branch
#   each by: CGO_ENABLED=0 go build -ldflags='-s -w' -o BIN_DIR/NAME ./cmd/ftload
#   (stripped, the two are ~53 MB: within what the device tool carries).
#   Logs and one JSON line per run go to $OUT (default ./ftload-out):
#     machine.txt, before-10k.{log,json}, after-10k.{log,json},
#     after-100k.{log,json}, summary.txt.
# Nothing else is needed on the host: no Go, no network beyond loopback.
# The 100K run prints each etcd member's load every 5 s (etcd-stats lines in
# its log: apply's lag, unsynced watchers, lease renewals and revocations);
# FTLOAD_PROFILE=1 writes CPU profiles of every process beside the logs.
# FTLOAD_SHARDS overrides the number of member processes at 100K (default:
# enough for the open-file limit, at least 16); FTLOAD_SKIP_10K=1 runs the
# 100K run alone (with its whole budget); FTLOAD_LIMIT caps that run's
# seconds; FTLOAD_SMALL and FTLOAD_LARGE
# change the two sizes (10000 and 100000: for a try on a small machine).
#
# FTLOAD_MASS_RUNS=N runs instead N runs at 100K back to back (only
# BIN_DIR/ftload needed), each started as soon as the one before returned
# (as a user runs them: the next starts while the host still carries the
# last one's teardown), each through the mass death (forming, one death, a
# leader's death, 1 % at once; a steady spell of 1 s, no 100 epochs), with
# the members' warnings in the logs (mass-K.log), and a tally in
# mass-summary.txt: how many converged, and each run's epochs, decided and
# all-seen times. The runs share FTLOAD_BUDGET seconds (default 540, within
# one call of the device tool); those that do not fit are named (run the
# rest in another call). A failed run's log ends with the members its last
# wait still waited for, what each held, and what the coordinator's record
# held.
set -u
bin=${1:?usage: $0 BIN_DIR (holding ftload-before and ftload)}
bin=$(cd "$bin" && pwd)
out=${OUT:-$PWD/ftload-out}
mkdir -p "$out"
need="ftload-before ftload"
[ -n "${FTLOAD_MASS_RUNS:-}" ] && need=ftload # no before/after comparison
for b in $need; do
	[ -x "$bin/$b" ] || { echo "$0: no executable $bin/$b" >&2; exit 2; }
done

# Every member holds sockets (its group link and listener): take the hard
# limit of open files (each process raises its own soft limit as well).
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
nofile=$(ulimit -n)
{
	echo "date: $(date -u +%FT%TZ)"
	echo "cpus: $(nproc)"
	grep -m1 'model name' /proc/cpuinfo
	free -g | head -2
	echo "load: $(cat /proc/loadavg)"
	echo "open files: soft $(ulimit -Sn) hard $(ulimit -Hn)"
	echo "ephemeral ports: $(cat /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null)"
	uname -a
} >"$out/machine.txt"
cat "$out/machine.txt"

# settle waits (at most 120 s) for an earlier run's processes to exit: a
# run's processes (100,000 members closing) may outlive it by a while, and
# a run started beside them measures them too (a 100K run started at load
# 173 after another collapsed, docs/capacity.md).
settle() {
	local waited=0
	while pgrep -f "$bin/ftload" >/dev/null && [ "$waited" -lt 120 ]; do
		sleep 1
		waited=$((waited + 1))
	done
	[ "$waited" -gt 0 ] && echo "   waited ${waited}s for an earlier run's processes to exit"
}

# run NAME LIMIT_S CMD...: one run, its log and its JSON line.
run() {
	local name=$1 limit=$2
	shift 2
	settle
	echo "== $name ($(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg), limit ${limit}s): $*"
	(cd "$out" && timeout -k 15 "$limit" "$@") >"$out/$name.log" 2>&1
	local rc=$?
	echo "rc $rc" >>"$out/$name.log"
	grep '^json ' "$out/$name.log" | sed 's/^json //' >"$out/$name.json"
	grep -v '^json ' "$out/$name.log" | grep -E '^(ftload|[a-z_]+\.[a-z_0-9-]+ |rc |ftload:)' | tail -n 60
	echo "   $name: rc $rc after $SECONDS s in all"
}

small=${FTLOAD_SMALL:-10000}
large=${FTLOAD_LARGE:-100000}
start=$SECONDS

# shards: the member processes at 100K (about 4 open files a member).
shards=${FTLOAD_SHARDS:-}
if [ -z "$shards" ]; then
	shards=$(((large * 4 + nofile - 2049) / (nofile - 2048)))
	[ "$shards" -lt 16 ] && shards=16
fi

if [ -n "${FTLOAD_MASS_RUNS:-}" ]; then
	runs=$FTLOAD_MASS_RUNS
	budget=${FTLOAD_BUDGET:-540}
	export FTLOAD_MEMBER_LOGS=${FTLOAD_MEMBER_LOGS:-1} # info: every removal, takeover and publication too
	ran=0
	for k in $(seq 1 "$runs"); do
		settle # before the budget is read: the wait is the run's time too
		left=$((budget - (SECONDS - start)))
		if [ "$left" -lt 75 ]; then
			echo "== out of budget: runs $k-$runs not started (FTLOAD_MASS_RUNS=$((runs - k + 1)) in another call)"
			break
		fi
		[ "$left" -gt 200 ] && left=200
		run "mass-$k" "$left" "$bin/ftload" -members "$large" -group-size 8 -group-lease -shards "$shards" -clients 8 \
			-parallel 16 -lease-ttl 15s -link-interval 1s -link-timeout 5s -steady 1s -epochs 0 -wait-timeout 60s \
			-timeout $((left - 10))s -etcd-stats 5s
		ran=$k
	done
	{
		echo "mass deaths at $large ranks: $ran of $runs runs made, back to back"
		ok=0
		for k in $(seq 1 "$ran"); do
			f="$out/mass-$k.log"
			ep=$(awk '$1 == "mass_death.epochs" {print $2}' "$f")
			dec=$(awk '$1 == "mass_death.decided" {print $2}' "$f")
			seen=$(awk '$1 == "mass_death.all_seen" {print $2}' "$f")
			load=$(grep -m1 -o 'load [0-9.]* [0-9.]* [0-9.]*' "$f")
			if [ -n "$seen" ]; then
				ok=$((ok + 1))
				echo "mass-$k: converged: $ep epoch(s), decided $dec s, all on it $seen s ($load at the start)"
			else
				echo "mass-$k: did not converge ($load at the start): $(grep -m1 '^ftload: ' "$f" | cut -c1-400)"
			fi
		done
		echo "converged: $ok of $ran"
	} | tee "$out/mass-summary.txt"
	echo "== done in $((SECONDS - start)) s; $out:"
	ls -la "$out"
	exit 0
fi

if [ "${FTLOAD_SKIP_10K:-}" != 1 ]; then
	# capacity.md's 10K row: one job of 10,000 members in this process.
	run before-10k 120 "$bin/ftload-before" -members "$small" -steady 10s -timeout 105s
	run after-10k 120 "$bin/ftload" -members "$small" -steady 10s -timeout 105s
fi

# 100,000 ranks: 12,500 groups of 8 on group leases (12,500 leases at TTL
# 15 s: 2,500 renewals/s), the members in child processes (about 3 open
# files each), the victims in processes of their own. The group links ping
# every second (silence of 5 s is a death) instead of 200 ms: 87,500 links
# on one host at 200 ms are 875,000 pings a second, the simulation's cost,
# and an overloaded host's late pings end registrations; a killed
# process's links reset at once either way. 16 joins in flight per process.
left=$((530 - (SECONDS - start)))
[ "$left" -gt 400 ] && left=400
[ -n "${FTLOAD_LIMIT:-}" ] && left=$FTLOAD_LIMIT # a shorter call: the phases that fit report as they end
run after-100k "$left" "$bin/ftload" -members "$large" -group-size 8 -group-lease -shards "$shards" -clients 8 \
	-parallel 16 -lease-ttl 15s -link-interval 1s -link-timeout 5s -steady 10s -epochs 100 -timeout $((left - 20))s \
	-etcd-stats 5s ${FTLOAD_PROFILE:+-profile "$out"}

{
	for f in before-10k after-10k after-100k; do
		[ -s "$out/$f.json" ] && echo "$f $(cat "$out/$f.json")"
	done
} >"$out/summary.txt"
echo "== done in $((SECONDS - start)) s; $out:"
ls -la "$out"
