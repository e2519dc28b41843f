#!/usr/bin/env python3
"""Step times of PyTorch's parallelism stack on ftcomm next to torch's own
NCCL backend, in the same processes, interleaved rounds, medians: one
process per GPU (torchrun), the GPT of examples/torch (8 layers, d = 512,
16 x 256 bytes per rank), forward + backward + AdamW.

- DDP: ``init_process_group("ftcomm")`` against a ``new_group(backend="nccl")``;
- FSDP2: ``fully_shard`` over ftcomm.device_mesh (an ftcomm NCCL comm)
  against a DeviceMesh of torch's NCCL group;
- FT-HSDP without failures (each rank a replica group of one: FSDP2 on its
  own rank, the replicate all-reduce through ftcomm.ft.Comm's hook) against
  the same with the hook's all-reduce on torch's NCCL group.

    torchrun --nproc_per_node 2 bench/torch_parallel_ftcomm.py
    torchrun --nproc_per_node 2 bench/torch_parallel_ftcomm.py --device cpu --steps 3   # a dry run on gloo
"""

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples", "torch"))

import common  # noqa: E402

import ftcomm  # noqa: E402
import ftcomm.coordinator  # noqa: E402
import ftcomm.distributed  # noqa: E402
import ftcomm.ft  # noqa: E402


def timed(step, steps, sync):
    step()  # warm-up: buckets, allocator
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def trainer(model, device, args, rank):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 256, (1 << 16,))

    def step():
        x, y = common.batch(data, gen, args.batch, args.block, device)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--only", default="ddp,fsdp2,hsdp")
    ap.add_argument("--profile", default="", help="write a cProfile of rank 0's ftcomm steps (each row's) to this file")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dist.init_process_group("ftcomm", timeout=datetime.timedelta(seconds=120))
    ref = dist.new_group(backend="nccl" if cuda else "gloo")
    backend = "nccl" if cuda else "gloo"
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model():
        torch.manual_seed(0)
        return common.GPT(args.layers, args.d, 8, args.block).to(device)

    rows = []
    only = set(args.only.split(","))
    if "ddp" in only:
        mine = trainer(DDP(model(), device_ids=[device.index] if cuda else None), device, args, rank)
        theirs = trainer(DDP(model(), device_ids=[device.index] if cuda else None, process_group=ref), device, args,
                         rank)
        rows.append(("DDP", mine, theirs))
    if "fsdp2" in only or "hsdp" in only:
        from torch.distributed.device_mesh import DeviceMesh
        from ftcomm.ft_torch import apply_hsdp
        import ftcomm.device_mesh as fdm
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        store = dist.distributed_c10d._get_default_group().comm("cpu").store
        comm = ftcomm.new_comm(backend, device, name="bench-fsdp2", store=store, rank=rank, size=size)
        mesh = fdm.init_device_mesh(mesh_dim_comms=(comm,), mesh_dim_names=("dp",))
        ref_mesh = DeviceMesh.from_group(ref, args.device)

        def sharded(m_):
            m = model()
            for b in m.blocks:
                fully_shard(b, mesh=m_)
            fully_shard(m, mesh=m_)
            return m
        if "fsdp2" in only:
            rows.append(("FSDP2", trainer(sharded(mesh), device, args, rank), trainer(sharded(ref_mesh), device, args,
                                                                                       rank)))
        if "hsdp" in only:
            co = None
            if rank == 0:
                co = ftcomm.coordinator.serve(log_level="off")
                creds = co.credentials
                store.set("bench/creds", creds)
            else:
                creds = store.get("bench/creds").decode()
            ft = ftcomm.ft.Comm(job="bench-hsdp", group="g%d" % rank, backend=backend, device=device,
                                credentials=creds, secret="bench", min_replicas=size, timeout=60, log_level="error")
            # A group of one rank (its own store: torchrun's environment
            # names the world, not the group).
            one_store = ftcomm.Store.listen("127.0.0.1:0")
            one = ftcomm.new_comm(backend, device, name="bench-shard-%d" % rank, store=one_store, rank=0, size=1)
            one_mesh = fdm.init_device_mesh(mesh_dim_comms=(one,), mesh_dim_names=("shard%d" % rank,))
            m = apply_hsdp(model(), ft, one_mesh, blocks=None)
            m2 = model()
            for b in m2.blocks:
                fully_shard(b, mesh=one_mesh)
            fully_shard(m2, mesh=one_mesh)
            for mod in m2.modules():
                if hasattr(mod, "set_all_reduce_hook"):
                    mod.set_all_reduce_hook(lambda t: (dist.all_reduce(t, group=ref), t.div_(size)))
            ftstep = trainer(m, device, args, rank)

            def ft_step():
                ft.step()
                ftstep()
                ft.commit()
            rows.append(("FT-HSDP (2 x 1, no failure)", ft_step, trainer(m2, device, args, rank)))
    results = []
    for name, a, b in rows:
        ta, tb = [], []
        for _ in range(args.rounds):
            ta.append(timed(a, args.steps, sync))
            tb.append(timed(b, args.steps, sync))
        # Each round's ratio compares two timings taken seconds apart: the
        # host's drift (clocks, other tenants) cancels in it.
        ratios = sorted(x / y for x, y in zip(ta, tb))
        results.append((name, statistics.median(ta), statistics.median(tb), statistics.median(ratios), ratios[0],
                        ratios[-1]))
    if args.profile:
        profile(rows, args, sync, rank)
    if rank == 0:
        print("| what | ftcomm ms/step | torch %s ms/step | ftcomm / torch | per round: median (range), %d rounds |" % (
            "NCCL" if cuda else "gloo", args.rounds))
        print("|---|---|---|---|---|")
        for name, a, b, r, lo, hi in results:
            print("| %s | %.2f | %.2f | %.3fx | %.3fx (%.3f–%.3f) |" % (name, a * 1e3, b * 1e3, a / b, r, lo, hi))
    sync()
    os._exit(0)  # the groups' comms and the coordinator go with the process


def profile(rows, args, sync, rank) -> None:
    """Where the host's time goes in each row's ftcomm steps: every rank
    runs them (they are collective), rank 0 writes the functions with the
    most cumulative time."""
    import cProfile
    import io
    import pstats
    out = io.StringIO()
    for name, a, _ in rows:
        p = cProfile.Profile()
        p.enable()
        timed(a, args.steps, sync)
        p.disable()
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats("cumulative").print_stats(30)
        out.write("== %s: %d steps\n%s\n" % (name, args.steps + 1, s.getvalue()))
    if rank == 0:
        with open(args.profile, "w") as f:
            f.write(out.getvalue())


if __name__ == "__main__":
    main()
