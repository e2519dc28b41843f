"""Rank functions for test_refused.py: one rank's call is refused (a bad
argument there), the others' are valid. Each takes the rank first and
returns what the test asserts on."""

from __future__ import annotations

import time

import ftcomm
from workers import comm, finalize


def _t():
    import torch
    return torch


def _outcome(f):
    """(error class name or "ok", rank, op, reason, seconds) of calling f."""
    t0 = time.monotonic()
    try:
        w = f()
        if w is not None and hasattr(w, "wait"):
            w.wait()
        return ("ok", None, None, None, time.monotonic() - t0)
    except ftcomm.PeerRefusedError as e:
        return ("PeerRefusedError", e.rank, e.op, e.reason, time.monotonic() - t0, list(e.ranks),
                isinstance(e, RuntimeError))
    except ftcomm.FtcommError as e:
        return (type(e).__name__, None, None, str(e), time.monotonic() - t0)


def steps(rank, size):
    """The refusal steps: (name, culprit, {rank: call}); a rank not listed
    does nothing in that step."""
    torch = _t()
    x = lambda n=4, v=1.0: torch.full((n,), float(v))  # noqa: E731
    n = size
    everyone = range(n)
    return [
        ("broadcast root outside", 1,
         {r: (lambda r=r: ftcomm_op("broadcast", x(), root=n if r == 1 else 0)) for r in everyone}),
        ("all_reduce of a list", 0,
         {r: (lambda r=r: ftcomm_op("all_reduce", [1.0, 2.0] if r == 0 else x())) for r in everyone}),
        ("reduce_scatter with too few inputs", 2,
         {r: (lambda r=r: ftcomm_op("reduce_scatter", x(2), [x(2)] * (n - 1 if r == 2 else n))) for r in everyone}),
        ("all_gather_v with a wrong dtype", 0,
         {r: (lambda r=r: ftcomm_op("all_gather_v", [x(i + 1) for i in range(n - 1)]
                                    + [torch.zeros(n, dtype=torch.int32 if r == 0 else torch.float32)], x(r + 1)))
          for r in everyone}),
        ("all_to_all_v_single with bad splits", 1,
         {r: (lambda r=r: ftcomm_op("all_to_all_v_single", x(n), x(n), [1] * n, [2] * n if r == 1 else [1] * n))
          for r in everyone}),
        ("gather, the root's outputs wrong", 0,
         {r: (lambda r=r: ftcomm_op("gather", [x(2) for _ in range(n - 1)] if r == 0 else None, x(2), root=0))
          for r in everyone}),
        ("scatter, the root's inputs wrong", 1,
         {r: (lambda r=r: ftcomm_op("scatter", x(2), [x(3) for _ in range(n)] if r == 1 else None, root=1))
          for r in everyone}),
        ("barrier with a bad timeout", 2,
         {r: (lambda r=r: ftcomm_op("barrier", timeout=-1 if r == 2 else None)) for r in everyone}),
        ("async, behind a valid async op", 0,
         {r: (lambda r=r: async_pair(r == 0, x)) for r in everyone}),
        ("send to a rank outside the comm", 0,
         {0: lambda: ftcomm_op("send", x(3), n), 1: lambda: ftcomm_op("recv", x(3, 0), 0)}),
        ("recv into a non-contiguous tensor", 1,
         {0: lambda: ftcomm_op("send", x(3), 1), 1: lambda: ftcomm_op("recv", torch.zeros(3, 2).t()[0], 0)}),
        ("batch with a complex tensor", 2,
         {2: lambda: batch([("send", torch.zeros(3, dtype=torch.complex64), 0)]),
          0: lambda: batch([("recv", x(3, 0), 2)])}),
    ]


_C = {}


def ftcomm_op(op, *args, **kwargs):
    return getattr(_C["c"], op)(*args, **kwargs)


def batch(ops):
    b = _C["c"].batch_op_create()
    for kind, t, peer in ops:
        (b.send if kind == "send" else b.recv)(t, peer)
    return b.issue()


def async_pair(bad, x):
    c = _C["c"]
    y = x(4, 1.0)
    w1 = c.all_reduce(y, async_op=True)
    try:
        w2 = c.broadcast(x(), 7 if bad else 0, async_op=True)
    finally:
        w1.wait()
    if float(y[0]) != c.get_size():
        raise AssertionError("the valid op before the refused one summed to %s" % float(y[0]))
    return w2


def refused_ops(rank, store, name, size=3):
    """Every step of steps(), then an all-reduce and a message along each
    pair that must carry the right values."""
    torch = _t()
    c = comm(rank, store, name, size)
    _C["c"] = c
    out = []
    for i, (what, culprit, calls) in enumerate(steps(rank, size)):
        call = calls.get(rank)
        res = _outcome(call) if call is not None else ("idle",)
        y = torch.full((8,), float(rank + 1))
        c.all_reduce(y)
        after = float(y[0])
        # A message 0 → 1 and 1 → 2 (never 2 → 0 or 0 → 2: rank 2 keeps
        # rank 0's stray refusal of step "send to a rank outside the comm"
        # for its next receive from 0).
        got = None
        for src, dst in ((0, 1), (1, 2)):
            if rank == src:
                c.send(torch.arange(5, dtype=torch.float32) + i, dst)
            elif rank == dst:
                buf = torch.zeros(5)
                c.recv(buf, src)
                got = [float(v) for v in buf]
        out.append({"step": what, "culprit": culprit, "res": res, "after": after, "got": got, "error": c.error()})
    finalize(rank, name)
    return out
