#!/usr/bin/env python3
"""PyTorch torch.distributed all_reduce on CPU tensors with the gloo backend,
with the method and table of cmd/ftbench (one process per rank, float32 sum;
per size: one checked op, warm-up, barrier, timed iterations; time is the
slowest rank's mean; busbw = algbw * 2(n-1)/n; GB = 1e9), so that it can
stand beside ftcomm, libgloo and Open MPI in bench/compare-cpu.sh.

    python3 bench/torch_gloo_allreduce.py -np 4 -b 4K -e 64M -f 4 -w 5 -n 20
    python3 bench/torch_gloo_allreduce.py -np 4 -plan 4K:500,16M:10,64M:10

-plan SIZE:ITERS,... runs those sizes with their own iteration counts (and
-w warm-ups each) in one start of the ranks, which costs seconds.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def worker(rank, a, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=a.np)
    n = a.np
    if rank == 0:
        print(f"# torch {torch.__version__} gloo all_reduce, {n} ranks, float32 sum, warmup {a.w}, iters {a.n}\n#")
        print("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s" % ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"), flush=True)
    if a.plan:
        plan = [(parse_size(x.split(":")[0]), int(x.split(":")[1])) for x in a.plan.split(",")]
    else:
        plan, size = [], parse_size(a.b)
        while size <= parse_size(a.e):
            plan.append((size, a.n))
            size = int(size * a.f)
    total = 0
    for size, iters in plan:
        count = size // 4
        idx = torch.arange(count, dtype=torch.int64)
        buf = ((idx * 7 + rank * 13) % 16).to(torch.float32)
        dist.all_reduce(buf)
        want = sum(((idx * 7 + r * 13) % 16) for r in range(n)).to(torch.float32)
        wrong = torch.tensor([int((buf != want).sum())], dtype=torch.float64)
        for _ in range(a.w):
            dist.all_reduce(buf)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        us = torch.tensor([(time.perf_counter() - t0) * 1e6 / iters], dtype=torch.float64)
        dist.all_reduce(us, op=dist.ReduceOp.MAX)
        dist.all_reduce(wrong)
        if rank == 0:
            alg = size / (us.item() * 1e-6) / 1e9
            print("  %10d  %12d  %8s  %6s  %6d  %7.2f  %6.2f  %6.2f  %6d" % (size, count, "float", "sum", -1, us.item(), alg, alg * 2 * (n - 1) / n, int(wrong.item())), flush=True)
        total += int(wrong.item())
    dist.barrier()
    dist.destroy_process_group()
    if total:
        raise SystemExit(1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-np", type=int, default=2)
    p.add_argument("-b", default="4K")
    p.add_argument("-e", default="64M")
    p.add_argument("-f", type=float, default=4)
    p.add_argument("-w", type=int, default=5)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-plan", default="", help="SIZE:ITERS,... instead of -b/-e/-f/-n")
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(a, port), nprocs=a.np, join=True)


if __name__ == "__main__":
    main()
