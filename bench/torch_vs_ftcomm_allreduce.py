#!/usr/bin/env python3
"""all_reduce through ftcomm's Python API next to torch.distributed's, in the
same processes and the same run: one process per GPU (torchrun), float32 sum,
8 B to 1 GiB, interleaved rounds, medians; nccl-tests' busbw
(algbw × 2(n−1)/n). Both calls are stream-ordered (the host does not wait),
so a loop of them measures what a training step sees; each timing ends with
a synchronize.

    export NCCL_NVLS_ENABLE=0
    torchrun --nproc_per_node 2 bench/torch_vs_ftcomm_allreduce.py
    torchrun --nproc_per_node 2 bench/torch_vs_ftcomm_allreduce.py --device cpu   # the same on gloo (a dry run)
"""

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist

import ftcomm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--min-bytes", type=int, default=8)
    ap.add_argument("--max-bytes", type=int, default=1 << 30)
    ap.add_argument("--factor", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=dev) if "device_id" in dist.init_process_group.__code__.co_varnames \
            else dist.init_process_group("nccl")
        fc = ftcomm.new_comm("nccl", dev, name="bench")
        sync = lambda: torch.cuda.synchronize(dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
        fc = ftcomm.new_comm("gloo", dev, name="bench")
        sync = lambda: None
    if rank == 0:
        print("# %s, %d ranks on %s; torch %s; ftcomm NCCL: %s" % (
            datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), size, args.device, torch.__version__,
            ftcomm.nccl_info() if cuda else "-"), flush=True)
        print("| bytes | torch.distributed µs | ftcomm µs | torch busbw GB/s | ftcomm busbw GB/s | ftcomm / torch busbw |")
        print("|---|---|---|---|---|---|", flush=True)
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        n = max(1, nbytes // 4)
        x = torch.ones(n, dtype=torch.float32, device=dev)
        iters = max(5, min(1000, int(2e9 / max(nbytes, 1) ** 1.0) if cuda else 200))
        if nbytes >= 64 << 20:
            iters = 20 if cuda else 3
        elif nbytes >= 4 << 20:
            iters = 50 if cuda else 10

        def t_torch():
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            sync()
            return (time.perf_counter() - t0) / iters

        def t_ftcomm():
            fc.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                fc.all_reduce(x)
            sync()
            return (time.perf_counter() - t0) / iters

        t_torch(), t_ftcomm()  # warm up
        a, b = [], []
        for r in range(args.rounds):
            if r % 2:
                b.append(t_ftcomm())
                a.append(t_torch())
            else:
                a.append(t_torch())
                b.append(t_ftcomm())
        ta, tb = statistics.median(a), statistics.median(b)
        bus = lambda t: nbytes / t * 2 * (size - 1) / size / 1e9
        if rank == 0:
            print("| %d | %.1f | %.1f | %.2f | %.2f | %.1f %% |" % (nbytes, ta * 1e6, tb * 1e6, bus(ta), bus(tb),
                                                                100 * bus(tb) / bus(ta)), flush=True)
        del x
        nbytes *= args.factor
    fc.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
