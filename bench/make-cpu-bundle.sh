#!/usr/bin/env bash
# make-cpu-bundle.sh DIR — builds bench/compare-cpu.sh's tools into DIR for a
# host that has no Go, no compiler and no package access (the GPU hosts'
# CPUs): ftbench, the libgloo and MPI timers, memcpy_bw, the
# PyTorch script, compare-cpu.sh itself, and Debian's shared libraries and
# Open MPI tree they need, unpacked from .debs (apt-get download) into
# DIR/root. Run it there as:  BIN=DIR RANKS="2 4 8" DIR/compare-cpu.sh
# (compare-cpu.sh points LD_LIBRARY_PATH, PATH and OPAL_PREFIX at DIR/root).
set -euo pipefail
DIR=${1:?usage: make-cpu-bundle.sh DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
cd "$ROOT"
# ftbench links the nccl backend, which needs cgo (it loads NCCL and CUDA
# at run time): it uses the host's glibc, as the C tools below do.
go build -trimpath -ldflags="-s -w" -o "$DIR/ftbench" ./cmd/ftbench
g++ -O2 -std=c++17 -o "$DIR/gloo_allreduce" bench/gloo/allreduce.cc -lgloo -lpthread
mpicc -O2 -o "$DIR/mpi_allreduce" bench/mpi/allreduce.c
gcc -O2 -mavx2 -pthread -o "$DIR/memcpy_bw" bench/memcpy/memcpy_bw.c
cp bench/torch_gloo_allreduce.py bench/compare-cpu.sh "$DIR/"
# Open MPI, libgloo and what they load (found with ldd over the binaries
# and Open MPI's components); glibc and libstdc++ are the host's.
pkgs="openmpi-bin openmpi-common libopenmpi3 libgloo0 ibverbs-providers libatomic1 libevent-core-2.1-7
  libevent-pthreads-2.1-7 libfabric1 libhiredis0.14 libhwloc15 libibverbs1 libmunge2 libnl-3-200
  libnl-route-3-200 libnuma1 libpmix2 libpsm-infinipath1 libpsm2-2 librdmacm1 libucx0 libudev1 libuuid1 zlib1g"
debs=$(mktemp -d)
(cd "$debs" && apt-get download $pkgs >/dev/null)
rm -rf "$DIR/root"
for d in "$debs"/*.deb; do dpkg-deb -x "$d" "$DIR/root"; done
rm -rf "$debs" "$DIR/root/usr/share/doc" "$DIR/root/usr/share/man" "$DIR/root/usr/share/lintian"
# libgloo lives in /usr/lib; Debian's openmpi-bin links mpirun through /etc/alternatives.
cp -a "$DIR"/root/usr/lib/libgloo.so* "$DIR/root/usr/lib/x86_64-linux-gnu/"
ln -sf orterun "$DIR/root/usr/bin/mpirun"
du -sh "$DIR"
