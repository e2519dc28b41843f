#!/usr/bin/env python3
"""PyTorch torch.distributed all_reduce (NCCL) over the sizes ncclbench uses,
printed in nccl-tests' table layout, so ftcomm's nccl backend can be compared
with PyTorch on the same machine in the same run.

    python3 bench/torch_allreduce.py                 # 2 GPUs, 8 B .. 1 GiB x8
    python3 bench/torch_allreduce.py -g 2 -b 8 -e 1G -f 8 -n 20 -w 5

One process per GPU (torch.multiprocessing.spawn), float32 sum. Two modes,
each its own table:
  stream:   n all_reduce calls back to back, then one synchronize (how
            nccl-tests and a training loop issue them); time = total / n.
  blocking: each all_reduce followed by torch.cuda.synchronize() before the
            next (what ftcomm's blocking comm contract does per op).
time is the slowest rank's mean; busbw = algbw * 2(n-1)/n; GB = 1e9 bytes.
#wrong counts wrong elements of one checked all_reduce per size (inputs are
small integers, so the sum is exact).

NVLink multicast stays off: NCCL_NVLS_ENABLE=0 is set before NCCL starts.
"""
import argparse
import os
import time

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[k] = v  # forced, also for the spawned ranks

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def worker(rank, args, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.g, device_id=torch.device("cuda", rank))
    n = args.g
    sizes = []
    s = parse_size(args.b)
    while s <= parse_size(args.e):
        sizes.append(s)
        s *= args.f
    maxn = max(sizes) // 4
    buf = torch.empty(maxn, dtype=torch.float32, device="cuda")
    idx = torch.arange(maxn, device="cuda", dtype=torch.int64)
    rows = {"stream": [], "blocking": []}
    for size in sizes:
        count = size // 4
        if count == 0:
            continue
        x = buf[:count]
        # check once: element i of rank r is i%7 + r
        x.copy_((idx[:count] % 7 + rank).to(torch.float32))
        dist.all_reduce(x)
        want = (idx[:count] % 7 * n + n * (n - 1) // 2).to(torch.float32)
        wrong = torch.tensor([int((x != want).sum().item())], device="cuda")
        dist.all_reduce(wrong)
        for mode in ("stream", "blocking"):
            for _ in range(args.w):
                dist.all_reduce(x)
            torch.cuda.synchronize()
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.n):
                dist.all_reduce(x)
                if mode == "blocking":
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            t = torch.tensor([(time.perf_counter() - t0) / args.n], device="cuda", dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows[mode].append((size, count, t.item(), int(wrong.item())))
    if rank == 0:
        print(f"# torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
              f"{n} processes, one per GPU, float32 sum")
        for mode in ("stream", "blocking"):
            print(f"# mode {mode}")
            print(f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>6} {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>7}")
            print(f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>6} {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}")
            for size, count, t, wrong in rows[mode]:
                algbw = size / t / 1e9
                busbw = algbw * 2 * (n - 1) / n
                print(f"  {size:>10} {count:>12} {'float':>8} {'sum':>6} {-1:>6} {t * 1e6:>9.2f} {algbw:>7.2f} {busbw:>7.2f} {wrong:>7}")
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-g", type=int, default=2, help="GPUs (one process each)")
    p.add_argument("-b", default="8", help="smallest size in bytes (K/M/G)")
    p.add_argument("-e", default="1G", help="largest size in bytes")
    p.add_argument("-f", type=int, default=8, help="size factor")
    p.add_argument("-n", type=int, default=20, help="timed iterations")
    p.add_argument("-w", type=int, default=5, help="warm-up iterations")
    args = p.parse_args()
    import socket
    with socket.socket() as s:  # a free port for the rendezvous, chosen by the OS
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, port), nprocs=args.g, join=True)


if __name__ == "__main__":
    main()
