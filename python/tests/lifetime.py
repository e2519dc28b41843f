"""Rank functions for test_lifetime.py: async ops whose Work (and tensors)
the caller drops at once. Each takes the rank first."""

from __future__ import annotations

import gc

import numpy as np

import ftcomm
from ftcomm import ReduceOp
from workers import comm, finalize

# 4 MiB of float32: above glibc's mmap threshold, so a buffer freed while
# an op still writes into it is unmapped (a crash at once), and smaller
# ones come from malloc's arenas (a corrupted heap).
BIG = 1 << 20
SMALL = 1 << 14


def _churn():
    """Allocate and free, so that memory freed too early is reused."""
    junk = [bytearray(SMALL * 4) for _ in range(8)] + [bytearray(BIG * 4)]
    del junk
    gc.collect()


def _issue_dropped(c, rank, size, n, kind, lib, device="cpu"):
    """Issue one async op of `kind` on fresh tensors and keep nothing but
    the tensor that receives the result (returned with what it must hold
    once a later op on the comm has completed)."""
    if lib == "torch":
        import torch
        full = lambda v, k: torch.full((k,), float(v), dtype=torch.float32, device=device)  # noqa: E731
    else:
        full = lambda v, k: np.full(k, v, dtype=np.float32)  # noqa: E731
    if kind == "all_reduce":
        x = full(rank + 1, n)
        c.all_reduce(x, ReduceOp.SUM, async_op=True)
        return x, float(size * (size + 1) // 2)
    if kind == "broadcast":
        x = full(rank + 1, n)
        c.broadcast(x, 0, async_op=True)
        return x, 1.0
    if kind == "reduce":
        x = full(rank + 1, n)
        c.reduce(x, 0, ReduceOp.MAX, async_op=True)
        return x, float(size if rank == 0 else rank + 1)
    if kind == "all_gather_single":
        out = full(-1, n * size)
        c.all_gather_single(out, full(7, n), async_op=True)  # the input is dropped too
        return out, 7.0
    if kind == "all_gather":
        outs = [full(-1, n) for _ in range(size)]
        c.all_gather(outs, full(5, n), async_op=True)
        return outs[size - 1], 5.0
    if kind == "reduce_scatter_single":
        out = full(-1, n)
        c.reduce_scatter_single(out, full(2, n * size), ReduceOp.SUM, async_op=True)
        return out, 2.0 * size
    if kind == "reduce_scatter":
        out = full(-1, n)
        c.reduce_scatter(out, [full(3, n) for _ in range(size)], ReduceOp.SUM, async_op=True)
        return out, 3.0 * size
    if kind == "all_to_all_single":
        out = full(-1, n * size)
        c.all_to_all_single(out, full(rank + 1, n * size), async_op=True)
        return out[n * (size - 1):], float(size)
    if kind == "all_to_all":
        outs = [full(-1, n) for _ in range(size)]
        c.all_to_all(outs, [full(rank + 10, n) for _ in range(size)], async_op=True)
        return outs[0], 10.0
    if kind == "scatter":
        out = full(-1, n)
        c.scatter(out, [full(4, n) for _ in range(size)] if rank == 0 else None, 0, async_op=True)
        return out, 4.0
    if kind == "gather":
        outs = [full(-1, n) for _ in range(size)] if rank == 0 else None
        c.gather(outs, full(rank + 1, n), 0, async_op=True)
        return (outs[size - 1], float(size)) if rank == 0 else (None, None)
    if kind == "send_recv":
        if rank == 0:
            c.send(full(9, n), 1, async_op=True)
            return None, None
        if rank == 1:
            out = full(-1, n)
            c.recv(out, 0, async_op=True)
            return out, 9.0
        return None, None
    raise ValueError(kind)



KINDS = ["all_reduce", "broadcast", "reduce", "all_gather_single", "all_gather", "reduce_scatter_single",
         "reduce_scatter", "all_to_all_single", "all_to_all", "scatter", "gather", "send_recv"]


def dropped_works(rank, store, name, size=2, rounds=6, lib="torch", kinds=KINDS, device="cpu"):
    """Every op, async, its Work dropped at once and its inputs with it,
    BIG and SMALL, with memory churn in between; after a sync barrier each
    kept output must hold its result. Returns the wrong results. With
    device="cuda", on NCCL (each rank on cuda:rank), the barrier's
    completion is awaited on the host."""
    backend = "gloo"
    if device == "cuda":
        import torch
        device, backend = "cuda:%d" % rank, "nccl"
    c = comm(rank, store, name, size, backend, device)
    bad = []
    for rnd in range(rounds):
        for kind in kinds:
            n = BIG if rnd % 2 == 0 else SMALL
            kept = [_issue_dropped(c, rank, size, n, kind, lib, device) for _ in range(3)]
            _churn()
            if backend == "nccl":
                torch.cuda.empty_cache()  # freed blocks go back: reuse would corrupt
                c.barrier(async_op=True).wait()
            else:
                c.barrier()  # ops run in issue order: every op above is done now
            for out, want in kept:
                got = np.asarray(out[:8].cpu()) if hasattr(out, "cpu") else np.asarray(out[:8]) if out is not None else None
                if out is not None and not (got == want).all():
                    bad.append("%s n=%d: %s, want %s" % (kind, n, got.tolist(), want))
    finalize(rank, name)
    return bad


def dropped_then_finalized(rank, store, name, size=2):
    """Async ops dropped and the comm finalized before they are waited for:
    finalize waits for them (or fails them) before their tensors go."""
    c = comm(rank, store, name, size)
    for _ in range(4):
        c.all_reduce(np.ones(BIG, dtype=np.float32), ReduceOp.SUM, async_op=True)
    _churn()
    finalize(rank, name)
    _churn()
    return ftcomm.live_handles()
