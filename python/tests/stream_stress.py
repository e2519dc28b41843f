#!/usr/bin/env python3
"""A randomized stream-order stress of ftcomm, checked bit for bit against
torch's own backend (NCCL on CUDA; gloo on CPU, where there are no streams).

Every rank runs the same seeded random sequence of ops: every rank derives
the kind, the API, the dtype, the sizes, the root and the reduction of each
op from one seed, so all ranks issue matching ops. What a rank may choose
alone comes from a second generator seeded by the seed and the rank: the
memory layouts (contiguous, at an offset, strided, transposed; lists as one
buffer, reversed or separate), the stream an op is issued on (the current
one, a side stream, a pool stream), the kernels queued before it, sync or
async, and when and how an async op is completed (wait() at once or after
later ops, on another stream, through get_future(), by polling).

Each op runs twice on identical inputs: through ftcomm (its Communicator
API, or its torch.distributed backend, ProcessGroupFtcomm, through
torch.distributed's functions with a group made for ftcomm), and through
torch's backend (the reference). On CUDA the inputs of ftcomm's op are
written by the last kernel queued on the issuing stream before the op,
behind a busy kernel (torch.cuda._sleep or matmuls), and its outputs are
read (a copy) and modified (+1) by kernels queued right after it, so an op
that does not wait for the stream, or a stream that does not wait for the
op, leaves a wrong value. Inputs are small integers computed from the seed
(the reference reads those values, not ftcomm's tensors), exact in every
dtype, so no order of reduction can change a bit.

The ops run in windows of 8 to 64 (every rank draws the same lengths):
every op of a window through ftcomm, then, with all of them completed and
the device synchronized, the window's reference ops on a stream of their
own, then (synchronized again) the comparison with torch.equal. ftcomm's
NCCL kernels and torch's never run at once: two NCCL comms whose kernels
run in different orders on different ranks can deadlock (NCCL's rule for
comms used concurrently), and the busy kernels make the orders differ. For
the same reason ftcomm's two comms (the Communicator's, the group's) take
turns: an op switching from one to the other first completes the other's
ops and synchronizes. Now and then a comm is finalized (a process group
destroyed) right after a sync op, and made again. Ops that move no element
at all run on ftcomm only (there is nothing to compare, and torch's gloo
crashes on some).

    python3 python/tests/stream_stress.py --ops 10000 --runs 5 --seed 1   # one process per GPU
    python3 python/tests/stream_stress.py --minutes 10 --nproc 4
    torchrun --nproc_per_node 2 python/tests/stream_stress.py --ops 10000
    python3 python/tests/stream_stress.py --device cpu --ops 500         # ftcomm's gloo vs torch's gloo

One line per run (ops, mismatches, seed, time), and rank 0's progress
every --progress seconds (10); the exit status is nonzero
on any mismatch or error, and each rank's first mismatch is printed with
what reproduces it: seed, op index, the op, the rank, where values differ.
The same module is the GPU test test_cuda.py::test_cuda_stream_order_stress
and the CPU test test_stream_stress.py (rank_main).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import math
import os
import random
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))  # the package, when not installed

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ftcomm  # noqa: E402
import ftcomm.distributed  # noqa: E402,F401 - registers "ftcomm"
from ftcomm import ReduceOp, _dist_reduce_ops  # noqa: E402

_AG_TENSOR = getattr(dist, "all_gather_into_tensor", None) or getattr(dist, "_all_gather_base")
_RS_TENSOR = getattr(dist, "reduce_scatter_tensor", None) or getattr(dist, "_reduce_scatter_base")
_C10D = torch._C._distributed_c10d  # the options of the ProcessGroup methods (AllgatherOptions, ...)

# ---------------------------------------------------------------- choices

# Element counts (per rank, per block: an op's tensors hold up to size
# blocks of n): (weight, low, high). ~1M elements in about 1 op of 14, ~16M
# in about 1 of 350 (the costliest ops: their values, copies and checks);
# "large" is smaller on CPU, where torch's gloo and 2 shared cores are slow.
SIZES = {
    "cuda": [(5, 0, 0), (30, 1, 7), (15, 8, 300), (20, 900, 1100), (10, 30_000, 70_000),
             (6, 900_000, 1_100_000), (0.25, 15_000_000, 17_000_000)],
    "cpu": [(5, 0, 0), (30, 1, 7), (15, 8, 300), (25, 900, 1100), (8, 30_000, 70_000)],
}
DTYPES = [(30, torch.float32), (12, torch.float16), (12, torch.bfloat16), (12, torch.int32), (8, torch.int64),
          (10, torch.uint8), (4, torch.float64), (4, torch.int8)]
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
PREMUL_FACTORS = (0.5, 2.0, 0.25, 4.0)  # powers of two: every product exact
JUNK = -77  # what a tensor holds before an op writes it (201 in uint8): no op result can be it


_ITEMSIZE = {dt: torch.empty(0, dtype=dt).element_size() for _, dt in DTYPES}


def _junk(dtype) -> int:
    return 201 if dtype == torch.uint8 else JUNK


def _pick(rng: random.Random, weighted: Sequence[Tuple[int, Any]]):
    total = sum(w for w, _ in weighted)
    x = rng.uniform(0, total)
    for w, v in weighted:
        x -= w
        if x <= 0:
            return v
    return weighted[-1][1]


class Red:
    """A reduction: name (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM) and, for
    PREMUL_SUM, a factor (a number; as a one-element tensor of the data's
    dtype to the Communicator when tensor_factor)."""

    def __init__(self, name: str, factor: Optional[float] = None, tensor_factor: bool = False, dtype=None):
        self.name, self.factor, self.tensor_factor, self.dtype = name, factor, tensor_factor, dtype

    def comm(self, device) -> ReduceOp:
        if self.name == "PREMUL_SUM":
            f = torch.tensor([self.factor], dtype=self.dtype, device=device) if self.tensor_factor else self.factor
            return ReduceOp.PREMUL_SUM(f)
        return getattr(ReduceOp, self.name)

    def torch(self):
        if self.name == "PREMUL_SUM":
            return dist._make_nccl_premul_sum(self.factor)
        return getattr(dist.ReduceOp, self.name)

    def __repr__(self):
        if self.name == "PREMUL_SUM":
            return "PREMUL_SUM(%s%s)" % (self.factor, ", tensor" if self.tensor_factor else "")
        return self.name


def _value_range(dtype, red: Optional[Red]) -> Tuple[int, int]:
    """Input values that keep every result exact in dtype (and away from
    JUNK): sums of 8 ranks stay within bfloat16's 8 significant bits,
    products are of powers of two."""
    u = dtype == torch.uint8
    if red is None:
        return (0, 99) if u else (-9, 9)
    if red.name in ("MIN", "MAX"):
        return (0, 99) if u else (-50, 50)
    if red.name == "PRODUCT":
        return (0, 3) if u else (-2, 2)
    return (0, 9) if u else (-4, 4)


def _values(n: int, dtype, device, salt: int, lo: int, hi: int) -> torch.Tensor:
    """n integers in [lo, hi], a hash of the position and salt (no short
    period: a block moved to the wrong place shows)."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    v = (i * 2654435761 + salt * 40503 + 12345) % 1000003 % (hi - lo + 1) + lo
    return v.to(dtype)


def nccl_bf16_premul_ok(group=None, device=None) -> bool:
    """Whether torch's NCCL backend multiplies a bfloat16 PREMUL_SUM by its
    factor: a collective of the group's ranks (all get the same answer).
    torch up to at least 2.11 does not (pytorch/pytorch#190745): it holds
    the factor as a float32 and NCCL reads 2 bytes of it as the bfloat16
    factor, the float's low mantissa bits (0 for 2.0, so this all-reduce
    of ones gives 0, not 2 x the world size)."""
    make = getattr(dist, "_make_nccl_premul_sum", None)
    if make is None:
        return False
    t = torch.ones(4, dtype=torch.bfloat16, device=device)
    dist.all_reduce(t, op=make(2.0), group=group)
    return bool((t == 2.0 * dist.get_world_size(group)).all())


def torch_premul_supported() -> bool:
    """Whether ProcessGroupFtcomm takes a PREMUL_SUM made by torch (else
    such ops go through the Communicator's ReduceOp.PREMUL_SUM)."""
    make = getattr(dist, "_make_nccl_premul_sum", None)
    if make is None:
        return False
    try:
        _dist_reduce_ops.from_torch(make(2.0))
        return True
    except Exception:  # noqa: BLE001 - refused: not supported yet
        return False


# ---------------------------------------------------------------- streams

class Streams:
    """The streams of one rank (CUDA) or none (CPU): where an op is
    issued, the busy kernels queued before it, the reference's stream."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.side = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
            self.ref = torch.cuda.Stream(device)
            self.rogue = torch.cuda.Stream(device)
            self.mat = torch.randn(1024, 1024, device=device)

    def pick(self, rng: random.Random) -> Tuple[str, Any]:
        if not self.cuda:
            return "host", None
        k = _pick(rng, [(40, "current"), (25, "side0"), (25, "side1"), (10, "pool")])
        if k == "current":
            return k, None
        if k == "pool":
            return k, torch.cuda.Stream()
        return k, self.side[int(k[-1])]

    def ctx(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def busy(self, rng: random.Random, force_cycles: int = 0) -> str:
        """Queue a kernel that keeps the current stream busy for a while."""
        if not self.cuda:
            return ""
        if force_cycles:
            torch.cuda._sleep(force_cycles)
            return "sleep(%d)" % force_cycles
        k = _pick(rng, [(30, "none"), (48, "sleep"), (5, "long sleep"), (17, "matmul")])
        if k in ("sleep", "long sleep"):
            # ~0.5 µs to 1 ms; now and then 1 to 5 ms, so that a copy
            # queued behind it still waits when later ops look at the
            # results (cycles at ~2 GHz). A collective waits for the
            # slowest rank: each rank's long sleeps add to every op's time.
            lo, hi = (1e3, 2e6) if k == "sleep" else (2e6, 1e7)
            cycles = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            torch.cuda._sleep(cycles)
            return "sleep(%d)" % cycles
        if k == "matmul":
            m = rng.randint(1, 4)
            a = self.mat
            for _ in range(m):
                a = a @ self.mat
            return "matmul x%d" % m
        return ""

    def reference(self):
        """Where the reference ops run: a stream of their own (they run
        after ftcomm's ops of their window have completed, device
        synchronized; their inputs are values computed from the seed)."""
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.ref)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


# ---------------------------------------------------------------- the reference

class TorchRef:
    """The reference: torch's own backend through torch.distributed, one
    method per op; ops torch.distributed lacks (the v-ops, gather into one
    tensor) are built from its primitives."""

    def __init__(self, group, rank: int, size: int):
        self.g, self.rank, self.size = group, rank, size
        self.bf16_premul = True  # False where torch's NCCL misreads a bfloat16 PREMUL_SUM's factor

    def _prep(self, red: Red, ts: List[torch.Tensor]) -> Tuple[Any, List[torch.Tensor]]:
        """torch's op for red, and the inputs: a bfloat16 PREMUL_SUM on a
        torch whose NCCL misreads its factor (nccl_bf16_premul_ok) is run
        as NCCL's PreMulSum computes it, each input multiplied by the factor
        in bfloat16 (exact: the factors are powers of two), then a SUM."""
        if red.name == "PREMUL_SUM" and not self.bf16_premul and ts and ts[0].dtype == torch.bfloat16:
            return dist.ReduceOp.SUM, [t * red.factor for t in ts]
        return red.torch(), ts

    def all_reduce(self, t, red: Red):
        op, (u,) = self._prep(red, [t])
        dist.all_reduce(u, op, group=self.g)
        if u is not t:
            t.copy_(u)

    def reduce(self, t, root: int, red: Red):
        op, (u,) = self._prep(red, [t])
        dist.reduce(u, root, op, group=self.g)
        if u is not t and self.rank == root:
            t.copy_(u)

    def broadcast(self, t, root: int):
        dist.broadcast(t, root, group=self.g)

    def all_gather(self, outs, x):
        dist.all_gather(outs, x, group=self.g)

    def all_gather_tensor(self, out, x):
        _AG_TENSOR(out, x, group=self.g)

    def all_gather_v(self, outs, x):
        outs[self.rank].copy_(x)
        for r in range(self.size):
            self.broadcast(outs[r], r)

    def reduce_scatter(self, out, ins, red: Red):
        op, ins = self._prep(red, list(ins))
        dist.reduce_scatter(out, ins, op, group=self.g)

    def reduce_scatter_tensor(self, out, x, red: Red):
        op, (x,) = self._prep(red, [x])
        _RS_TENSOR(out, x, op, group=self.g)

    def reduce_scatter_v(self, out, ins, red: Red):
        flat = torch.cat([t.reshape(-1) for t in ins])
        self.all_reduce(flat, red)
        off = sum(t.numel() for t in ins[:self.rank])
        out.copy_(flat[off:off + out.numel()].view_as(out))

    def all_to_all_single(self, out, x, out_splits=None, in_splits=None):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=self.g)

    def all_to_all(self, outs, ins):
        dist.all_to_all(list(outs), list(ins), group=self.g)

    def gather(self, x, outs, root: int):
        dist.gather(x, outs if self.rank == root else None, root, group=self.g)

    def gather_tensor(self, out, x, root: int):
        self.gather(x, list(out.chunk(self.size)) if self.rank == root else None, root)

    def scatter(self, out, ins, root: int):
        dist.scatter(out, list(ins) if self.rank == root else None, root, group=self.g)

    def p2p(self, ops: List[Tuple[str, torch.Tensor, int]]):
        """Sends and receives (kind, tensor, peer) as one batch; empty ones
        are left out (both sides know the counts)."""
        ops = [(k, t, p) for k, t, p in ops if t.numel()]
        if ops:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend if k == "send" else dist.irecv, t, p, group=self.g)
                                             for k, t, p in ops]):
                w.wait()


def _bits(t):
    """bfloat16 as float16 bits (torch 1.13's gloo moves no bfloat16, and no
    int16; a move does no arithmetic, so the bits arrive as sent)."""
    if isinstance(t, (list, tuple)):
        return [_bits(x) for x in t]
    return t.view(torch.float16) if t is not None and t.dtype == torch.bfloat16 else t


class GlooRef(TorchRef):
    """torch's gloo (torch 1.13) as the reference: what it lacks (AVG,
    PREMUL_SUM, bfloat16, the base and reduce-scatter ops, list
    all-to-all) is computed from what it has, exactly for these inputs; a
    reduce leaves non-roots' tensors alone (as NCCL does)."""

    def broadcast(self, t, root: int):
        super().broadcast(_bits(t), root)

    # gloo's all-gather, gather and scatter of 0 elements end the process
    # (SIGFPE); their sizes are the same at every rank, so all skip them.

    def all_gather(self, outs, x):
        if x.numel():
            super().all_gather(_bits(outs), _bits(x))

    def all_to_all_single(self, out, x, out_splits=None, in_splits=None):
        super().all_to_all_single(_bits(out), _bits(x), out_splits, in_splits)

    def gather(self, x, outs, root: int):
        if x.numel():
            super().gather(_bits(x), _bits(outs), root)

    def scatter(self, out, ins, root: int):
        if out.numel():
            super().scatter(_bits(out), _bits(ins), root)

    def p2p(self, ops):
        super().p2p([(k, _bits(t), p) for k, t, p in ops])

    def _reduced(self, t, red: Red, run: Callable[[torch.Tensor, Any], None], root: Optional[int] = None):
        u = t.to(torch.float32) if t.dtype == torch.bfloat16 else t.clone()
        if red.name == "PREMUL_SUM":
            u.mul_(red.factor)
        run(u, dist.ReduceOp.SUM if red.name in ("AVG", "PREMUL_SUM") else red.torch())
        if red.name == "AVG":
            u = u / self.size if u.dtype.is_floating_point else torch.div(u, self.size, rounding_mode="trunc")
        if root is None or self.rank == root:
            t.copy_(u)

    def all_reduce(self, t, red: Red):
        self._reduced(t, red, lambda u, op: dist.all_reduce(u, op, group=self.g))

    def reduce(self, t, root: int, red: Red):
        self._reduced(t, red, lambda u, op: dist.reduce(u, root, op, group=self.g), root)

    def all_gather_tensor(self, out, x):
        self.all_gather(list(out.chunk(self.size)), x)

    def reduce_scatter(self, out, ins, red: Red):
        self.reduce_scatter_v(out, ins, red)

    def reduce_scatter_tensor(self, out, x, red: Red):
        self.reduce_scatter_v(out, list(x.chunk(self.size)), red)

    def all_to_all(self, outs, ins):
        flat_out = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype)
        self.all_to_all_single(flat_out, torch.cat([t.reshape(-1) for t in ins]),
                               [t.numel() for t in outs], [t.numel() for t in ins])
        off = 0
        for t in outs:
            t.copy_(flat_out[off:off + t.numel()].view_as(t))
            off += t.numel()


# ---------------------------------------------------------------- one op

class Buf:
    """One tensor of an op. vals: its values before the op (contiguous,
    never changed); t: ftcomm's tensor, in this rank's layout; want: the
    reference's tensor (the reference op writes it; None for an input,
    whose reference is vals). role: "in" (read; must be unchanged), "out"
    (written; JUNK before the op) or "inout" (in place)."""

    __slots__ = ("name", "role", "vals", "t", "want", "layout", "check")

    def __init__(self, name, role, vals, t, want, layout, check=True):
        self.name, self.role, self.vals, self.t, self.want = name, role, vals, t, want
        self.layout, self.check = layout, check


class Check:
    __slots__ = ("label", "got", "want", "plus")

    def __init__(self, label, got, want, plus=0):
        self.label, self.got, self.want, self.plus = label, got, want, plus


class Op:
    """One op of the sequence: its shared choices (drawn from h.shared in
    the same order on every rank), this rank's choices (h.local), its
    tensors, and the checks on them."""

    def __init__(self, h: "Harness", index: int, kind: "Kind"):
        self.h, self.i, self.kind = h, index, kind
        self.rank, self.size, self.dev = h.rank, h.size, h.device
        S, L = h.shared, h.local
        self.desc: List[str] = [kind.name]
        self.local_desc: List[str] = []
        # The API (shared): mostly the previous op's, so that async ops
        # complete later across several ops of one comm (ops switching
        # between the Communicator and the process group, two NCCL comms,
        # first let the other's complete: Harness.use_api).
        if len(kind.apis) == 1:
            self.api = kind.apis[0]
        elif h.last_api in kind.apis and S.random() < 0.8:
            self.api = h.last_api
        else:
            self.api = S.choice(kind.apis)
        if h.only_api and h.only_api in kind.apis:
            self.api = h.only_api
        self.dt = _pick(S, DTYPES)
        self.finalize_after = S.random() < 1.0 / max(h.cfg.finalize_every, 1) if h.cfg.finalize_every else False
        self.moved = 0  # elements the op moves, over all ranks (from the shared choices)
        self.bufs: List[Buf] = []
        self.checks: List[Check] = []
        self.ref_run: Optional[Callable[[TorchRef], None]] = None  # the reference op, run at the window's end
        self.recreated = False
        self.stream_name, self.stream = "", None
        # sync, or async and completed now or after later ops; how: wait(),
        # get_future() (torch.distributed's Work), or polling is_completed().
        when = _pick(L, [(45, "sync"), (25, "now"), (30, "later")])
        if self.finalize_after:
            when = "sync"
        self.when = when
        self.how = _pick(L, [(70, "wait"), (15, "future"), (15, "poll")])
        self.delay = L.randint(1, 6)

    # ---- shared choices ----

    def _size_class(self) -> Tuple[int, int]:
        return _pick(self.h.shared, [(w, (lo, hi)) for w, lo, hi in self.h.sizes])

    def count(self, blocks: int = 1) -> int:
        """n, drawn from a size class; the op's tensors hold blocks blocks
        of n (the description says so: n=4x1094118)."""
        lo, hi = self._size_class()
        n = self.h.shared.randint(lo, hi)
        self.desc.append("n=%s%d" % ("%dx" % blocks if blocks > 1 else "", n))
        self.moved += n
        return n

    def counts(self, k: int) -> List[int]:
        """k counts (per rank or block) of one size class, some 0; their sum
        stays within twice the class's bound."""
        _, hi = self._size_class()
        cap = max(hi * 2 // k, min(hi, 1))
        c = [self.h.shared.randint(0, cap) if self.h.shared.random() < 0.8 else 0 for _ in range(k)]
        self.desc.append("counts=%s" % _short(c))
        self.moved += sum(c)
        return c

    def root(self) -> int:
        r = self.h.shared.randrange(self.size)
        self.desc.append("root=%d" % r)
        return r

    def reduction(self, dist_only: bool = False) -> Red:
        """A reduction for the op's dtype. PREMUL_SUM goes through the
        Communicator when the backend does not take torch's (yet), and a
        kind only torch.distributed has gets it only when it does."""
        S, dt = self.h.shared, self.dt
        names = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
        if dt in FLOATS:
            if self.size & (self.size - 1):
                names.remove("AVG")  # x / 3 is not exact
            if self.h.torch_premul or not dist_only:
                names.append("PREMUL_SUM")
        name = S.choice(names)
        red = Red(name)
        if name == "PREMUL_SUM":
            red = Red(name, S.choice(PREMUL_FACTORS), not dist_only and S.random() < 0.3, dt)
            if self.api == "dist" and (red.tensor_factor or not self.h.torch_premul):
                self.api = "comm"  # torch's PREMUL_SUM is not taken by the backend (yet): the Communicator's
        self.desc.append(repr(red))
        return red

    # ---- tensors ----

    def _salt(self) -> int:
        return (self.h.seed * 1000003 + self.i * 8191 + self.rank * 131 + len(self.bufs)) & 0xffffff

    def _layout(self, shape: Tuple[int, ...]) -> str:
        L = self.h.local
        if self.api == "dist":  # the backend copies a non-contiguous tensor (the Communicator refuses it)
            opts = [(40, "contig"), (15, "offset"), (25, "strided")]
            if len(shape) == 2 and shape[0] > 1 and shape[1] > 1:
                opts.append((20, "transposed"))
            return _pick(L, opts)
        return _pick(L, [(75, "contig"), (25, "offset")])

    def _alloc(self, shape: Tuple[int, ...], layout: str) -> torch.Tensor:
        n = math.prod(shape)
        kw = {"dtype": self.dt, "device": self.dev}
        if layout == "offset":
            return torch.empty(n + 7, **kw)[3:3 + n].view(shape)
        if layout == "strided":
            if len(shape) == 1:
                return torch.empty(2 * n, **kw)[1::2]
            return torch.empty(shape[0], 2 * shape[1], **kw)[:, 1::2]
        if layout == "transposed":
            return torch.empty(shape[1], shape[0], **kw).t()
        return torch.empty(shape, **kw)

    def shape(self, n: int) -> Tuple[int, ...]:
        """A shape of n elements, 1-D or (this rank's choice) 2-D."""
        divs = [a for a in range(2, min(n, 64)) if n % a == 0]
        if divs and self.h.local.random() < 0.3:
            a = self.h.local.choice(divs)
            return (a, n // a)
        return (n,)

    def buf(self, name: str, shape: Tuple[int, ...], role: str, red: Optional[Red] = None,
            layout: Optional[str] = None, t: Optional[torch.Tensor] = None) -> Buf:
        lo, hi = _value_range(self.dt, red)
        n = math.prod(shape)
        vals = _values(n, self.dt, self.dev, self._salt(), lo, hi).view(shape)
        if t is None:
            layout = layout or self._layout(shape)
            t = self._alloc(shape, layout)
        if role != "out":
            t.fill_(_junk(self.dt))  # overwritten with vals right before the op
        want = None
        if role == "inout":
            want = vals.clone()
        elif role == "out":
            want = torch.full(shape, _junk(self.dt), dtype=self.dt, device=self.dev)
        b = Buf(name, role, vals, t, want, layout or "view")
        self.bufs.append(b)
        if layout not in (None, "contig", "view"):
            self.local_desc.append("%s=%s" % (name, layout))
        return b

    def bufs_list(self, name: str, counts: Sequence[int], role: str, red: Optional[Red] = None) -> List[Buf]:
        """A list of 1-D tensors: views of one buffer in order (adjacent),
        in reverse order, or separate tensors (this rank's choice)."""
        L = self.h.local
        how = _pick(L, [(40, "buffer"), (20, "reversed"), (40, "separate")])
        self.local_desc.append("%s=%s" % (name, how))
        if how == "separate":
            return [self.buf("%s[%d]" % (name, i), (k,), role, red) for i, k in enumerate(counts)]
        base = self._alloc((sum(counts),), "contig")
        offs, off = [], 0
        order = list(range(len(counts)))
        if how == "reversed":
            order.reverse()
        for i in order:
            offs.append((i, off))
            off += counts[i]
        at = dict(offs)
        return [self.buf("%s[%d]" % (name, i), (k,), role, red, t=base[at[i]:at[i] + k]) for i, k in enumerate(counts)]

    # ---- running ----

    def issue(self, comm: Optional[Callable] = None, dist_: Optional[Callable] = None) -> None:
        """Run the op through ftcomm: busy kernels, the writes of its
        tensors, the op (through the Communicator, comm(c, async_op), or
        torch.distributed, dist_(group, async_op)), then its completion now
        or later, and what is queued after it."""
        h = self.h
        h.use_api(self.api)
        if self.api == "comm" and self.how == "future":
            self.how = "wait"  # the Communicator's Work has no future
        self.local_desc.append(h.streams.busy(h.local, h.busy_cycles))
        for b in self.bufs:  # the last kernels before the op write its tensors
            if b.role == "out":
                b.t.fill_(_junk(self.dt))
        for b in self.bufs:
            if b.role != "out":
                b.t.copy_(b.vals)
        async_op = self.when != "sync"
        rogue = h.streams.ctx(h.streams.rogue) if h.cfg.inject == "unordered" else contextlib.nullcontext()
        with rogue:
            if self.api == "comm":
                w = comm(h.comm, async_op)
            else:
                w = dist_(h.group, async_op)
        works = [] if w is None or not async_op else (list(w) if isinstance(w, (list, tuple)) else [w])
        if self.when == "sync":
            if self.finalize_after:
                h.recreate(self.api)
                self.recreated = True
            self.after()
        elif self.when == "now":
            self.complete(works)
            self.after()
        else:
            h.pending.append((self.i + self.delay, self, works))

    def complete(self, works) -> None:
        """Complete an async op: wait(), get_future().wait() or polling
        is_completed(), on the current stream."""
        for w in works:
            if self.how == "future" and hasattr(w, "get_future"):
                w.get_future().wait()
            elif self.how == "poll":
                deadline = time.monotonic() + self.h.cfg.timeout_s
                while not w.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError("stream_stress: op %d never completed (polled is_completed())" % self.i)
                    time.sleep(0.0002)
                w.wait()
            else:
                w.wait()

    def after(self) -> None:
        """Queue what reads and modifies the results right after the op
        (on the current stream) and record the checks."""
        for b in self.bufs:
            if not b.check:
                continue
            if b.role == "in":
                self.checks.append(Check("%s (input, unchanged)" % b.name, b.t, b.vals))
                continue
            snap = b.t.clone()  # reads the result right after the op
            b.t.add_(1)  # modifies it right after the op
            self.checks.append(Check(b.name, snap, b.want))
            self.checks.append(Check("%s after +1" % b.name, b.t, b.want, 1))
        h = self.h
        if h.corrupt_at is not None and self.i >= h.corrupt_at and self.rank == 0:
            for b in self.bufs:  # the harness's self-test: a wrong result it must report
                if b.role != "in" and b.check and b.t.numel():
                    b.t[(0,) * b.t.dim()] += 1
                    h.corrupt_at = None
                    self.local_desc.append("CORRUPTED %s (inject)" % b.name)
                    break

    def reference(self, run: Callable[[TorchRef], None]) -> None:
        """The op through torch's backend, run(ref), on the inputs' values
        (vals: computed from the seed, never changed): kept for the end of
        the window, when every ftcomm op of the window has completed (two
        NCCL comms must not have kernels on a GPU at once in orders that
        differ between ranks). Not when the op moves no element at all
        (every rank knows)."""
        if self.moved:
            self.ref_run = run

    def bytes(self) -> int:
        """About what the op's tensors hold at any rank until it is checked
        (values, ftcomm's, the reference's, the copy after), from the
        shared choices only: every rank ends a window at the same op."""
        return self.moved * _ITEMSIZE[self.dt] * (self.size + 1) * 4

    def describe(self) -> str:
        local = [d for d in self.local_desc if d]
        mode = self.when if self.when == "sync" else "async %s%s" % (
            self.how, "" if self.when == "now" else " after %d ops" % self.delay)
        return "op %d: %s via %s (%s; rank %d: %s, %s%s)" % (
            self.i, " ".join(self.desc[:1] + [str(self.dt).replace("torch.", "")] + self.desc[1:]),
            self.api, "then finalized" if self.finalize_after else "kept", self.rank, mode,
            "stream " + self.stream_name, (", " + ", ".join(local)) if local else "")


def _short(xs: Sequence[int]) -> str:
    s = ",".join(str(x) for x in xs)
    return "[" + (s if len(s) < 60 else s[:57] + "...") + "]"


# ---------------------------------------------------------------- the op kinds
# One function per kind: it draws the op's shared choices, makes its
# tensors, issues it through ftcomm (both APIs where both have it) and
# through the reference.

def k_all_reduce(o: Op):
    red = o.reduction()
    x = o.buf("x", o.shape(o.count()), "inout", red)
    o.issue(comm=lambda c, a: c.all_reduce(x.t, red.comm(o.dev), async_op=a),
            dist_=lambda g, a: dist.all_reduce(x.t, red.torch(), group=g, async_op=a))
    o.reference(lambda r: r.all_reduce(x.want, red))


def k_reduce(o: Op):
    red = o.reduction()
    root = o.root()
    x = o.buf("x", o.shape(o.count()), "inout", red)
    o.issue(comm=lambda c, a: c.reduce(x.t, root, red.comm(o.dev), async_op=a),
            dist_=lambda g, a: dist.reduce(x.t, root, red.torch(), group=g, async_op=a))
    o.reference(lambda r: r.reduce(x.want, root, red))


def k_broadcast(o: Op):
    root = o.root()
    x = o.buf("x", o.shape(o.count()), "inout")
    o.issue(comm=lambda c, a: c.broadcast(x.t, root, async_op=a),
            dist_=lambda g, a: dist.broadcast(x.t, root, group=g, async_op=a))
    o.reference(lambda r: r.broadcast(x.want, root))


def k_all_gather(o: Op):
    n = o.count()
    x = o.buf("x", (n,), "in")
    outs = o.bufs_list("out", [n] * o.size, "out")
    o.issue(comm=lambda c, a: c.all_gather([b.t for b in outs], x.t, async_op=a),
            dist_=lambda g, a: dist.all_gather([b.t for b in outs], x.t, group=g, async_op=a))
    o.reference(lambda r: r.all_gather([b.want for b in outs], x.vals))


def k_all_gather_single(o: Op):
    n = o.count(o.size)
    out = o.buf("out", (o.size * n,), "out")
    if out.layout == "contig" and o.h.local.random() < 0.3:
        # In place (FSDP2's): the input is this rank's block of the output.
        x = o.buf("x", (n,), "in", t=out.t[o.rank * n:(o.rank + 1) * n])
        x.check = False
        o.local_desc.append("in place")
    else:
        x = o.buf("x", (n,), "in")
    o.issue(comm=lambda c, a: c.all_gather_single(out.t, x.t, async_op=a),
            dist_=lambda g, a: _AG_TENSOR(out.t, x.t, group=g, async_op=a))
    o.reference(lambda r: r.all_gather_tensor(out.want, x.vals))


def k_all_gather_v(o: Op):
    counts = o.counts(o.size)
    x = o.buf("x", (counts[o.rank],), "in")
    outs = o.bufs_list("out", counts, "out")
    o.issue(comm=lambda c, a: c.all_gather_v([b.t for b in outs], x.t, async_op=a))
    o.reference(lambda r: r.all_gather_v([b.want for b in outs], x.vals))


def k_reduce_scatter(o: Op):
    red = o.reduction()
    n = o.count()
    ins = o.bufs_list("in", [n] * o.size, "in", red)
    out = o.buf("out", (n,), "out")
    o.issue(comm=lambda c, a: c.reduce_scatter(out.t, [b.t for b in ins], red.comm(o.dev), async_op=a),
            dist_=lambda g, a: dist.reduce_scatter(out.t, [b.t for b in ins], red.torch(), group=g, async_op=a))
    o.reference(lambda r: r.reduce_scatter(out.want, [b.vals for b in ins], red))


def k_reduce_scatter_single(o: Op):
    red = o.reduction()
    n = o.count(o.size)
    x = o.buf("x", (o.size * n,), "in", red)
    out = o.buf("out", (n,), "out")
    o.issue(comm=lambda c, a: c.reduce_scatter_single(out.t, x.t, red.comm(o.dev), async_op=a),
            dist_=lambda g, a: _RS_TENSOR(out.t, x.t, red.torch(), group=g, async_op=a))
    o.reference(lambda r: r.reduce_scatter_tensor(out.want, x.vals, red))


def k_reduce_scatter_v(o: Op):
    red = o.reduction()
    counts = o.counts(o.size)
    ins = o.bufs_list("in", counts, "in", red)
    out = o.buf("out", (counts[o.rank],), "out")
    o.issue(comm=lambda c, a: c.reduce_scatter_v(out.t, [b.t for b in ins], red.comm(o.dev), async_op=a))
    o.reference(lambda r: r.reduce_scatter_v(out.want, [b.vals for b in ins], red))


def k_all_to_all_single(o: Op):
    n = o.count(o.size)
    x = o.buf("x", (o.size * n,), "in")
    out = o.buf("out", (o.size * n,), "out")
    o.issue(comm=lambda c, a: c.all_to_all_single(out.t, x.t, async_op=a),
            dist_=lambda g, a: dist.all_to_all_single(out.t, x.t, group=g, async_op=a))
    o.reference(lambda r: r.all_to_all_single(out.want, x.vals))


def _matrix(o: Op) -> List[List[int]]:
    """m[src][dst]: how much rank src sends rank dst (shared)."""
    flat = o.counts(o.size * o.size)
    return [flat[s * o.size:(s + 1) * o.size] for s in range(o.size)]


def k_all_to_all_v_single(o: Op):
    m = _matrix(o)
    w = o.h.shared.randint(1, 3)  # rows of w elements; splits count rows
    o.desc.append("w=%d" % w)
    m = [[k // w for k in row] for row in m]
    o.moved = sum(map(sum, m)) * w
    ins_rows, outs_rows = m[o.rank], [m[s][o.rank] for s in range(o.size)]
    x = o.buf("x", (sum(ins_rows), w), "in")
    out = o.buf("out", (sum(outs_rows), w), "out")
    o.issue(comm=lambda c, a: c.all_to_all_v_single(out.t, x.t, outs_rows, ins_rows, async_op=a),
            dist_=lambda g, a: dist.all_to_all_single(out.t, x.t, outs_rows, ins_rows, group=g, async_op=a))
    o.reference(lambda r: r.all_to_all_single(out.want, x.vals, outs_rows, ins_rows))


def k_all_to_all(o: Op):
    m = _matrix(o)
    ins = o.bufs_list("in", m[o.rank], "in")
    outs = o.bufs_list("out", [m[s][o.rank] for s in range(o.size)], "out")
    o.issue(comm=lambda c, a: c.all_to_all([b.t for b in outs], [b.t for b in ins], async_op=a),
            dist_=lambda g, a: dist.all_to_all([b.t for b in outs], [b.t for b in ins], group=g, async_op=a))
    o.reference(lambda r: r.all_to_all([b.want for b in outs], [b.vals for b in ins]))


def k_gather(o: Op):
    root = o.root()
    n = o.count()
    x = o.buf("x", (n,), "in")
    outs = o.bufs_list("out", [n] * o.size, "out") if o.rank == root else None
    ts = [b.t for b in outs] if outs else None
    o.issue(comm=lambda c, a: c.gather(ts, x.t, root, async_op=a),
            dist_=lambda g, a: dist.gather(x.t, ts, root, group=g, async_op=a))
    o.reference(lambda r: r.gather(x.vals, [b.want for b in outs] if outs else None, root))


def k_gather_single(o: Op):
    root = o.root()
    n = o.count(o.size)
    x = o.buf("x", (n,), "in")
    out = o.buf("out", (o.size * n,), "out") if o.rank == root else None
    o.issue(comm=lambda c, a: c.gather_single(out.t if out else None, x.t, root, async_op=a))
    o.reference(lambda r: r.gather_tensor(out.want if out else None, x.vals, root))


def k_scatter(o: Op):
    root = o.root()
    n = o.count()
    ins = o.bufs_list("in", [n] * o.size, "in") if o.rank == root else None
    out = o.buf("out", (n,), "out")
    ts = [b.t for b in ins] if ins else None
    o.issue(comm=lambda c, a: c.scatter(out.t, ts, root, async_op=a),
            dist_=lambda g, a: dist.scatter(out.t, ts, root, group=g, async_op=a))
    o.reference(lambda r: r.scatter(out.want, [b.vals for b in ins] if ins else None, root))


def k_send_recv(o: Op):
    src = o.h.shared.randrange(o.size)
    dst = (src + o.h.shared.randrange(1, o.size)) % o.size
    o.desc.append("%d->%d" % (src, dst))
    n = o.count()
    if o.rank == src:
        x = o.buf("x", o.shape(n), "in")
        o.issue(comm=lambda c, a: c.send(x.t, dst, async_op=a),
                dist_=lambda g, a: dist.isend(x.t, dst, group=g) if a else dist.send(x.t, dst, group=g))
        o.reference(lambda r: r.p2p([("send", x.vals, dst)]))
    elif o.rank == dst:
        y = o.buf("y", o.shape(n), "out")
        o.issue(comm=lambda c, a: c.recv(y.t, src, async_op=a),
                dist_=lambda g, a: dist.irecv(y.t, src, group=g) if a else dist.recv(y.t, src, group=g))
        o.reference(lambda r: r.p2p([("recv", y.want, src)]))


def k_batch_p2p(o: Op):
    """Sends to rank+k and receives from rank-k for some shifts k, several
    messages each, issued in an order of this rank's choosing (the order
    per peer and direction kept)."""
    S, L = o.h.shared, o.h.local
    shifts = sorted(S.sample(range(1, o.size), S.randint(1, o.size - 1)))
    msgs = {k: o.counts(S.randint(1, 3)) for k in shifts}
    o.desc.append("shifts=%s" % shifts)
    sends = [("send", (o.rank + k) % o.size, k, j, c) for k in shifts for j, c in enumerate(msgs[k])]
    recvs = [("recv", (o.rank - k) % o.size, k, j, c) for k in shifts for j, c in enumerate(msgs[k])]
    order = []
    while sends or recvs:  # a random merge: each list keeps its order
        src = sends if sends and (not recvs or L.random() < 0.5) else recvs
        order.append(src.pop(0))
    items = []
    for kind, peer, k, j, c in order:
        b = o.buf("%s%d.%d" % (kind, peer, j), (c,), "in" if kind == "send" else "out")
        items.append((kind, peer, b))

    def comm(c, a):
        batch = c.batch_op_create()
        for kind, peer, b in items:
            (batch.send if kind == "send" else batch.recv)(b.t, peer)
        return batch.issue(async_op=a)

    def dist_(g, a):
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, b.t, peer, group=g)
                                        for kind, peer, b in items])
        if not a:  # torch has no sync batch: "sync" is every Work waited for at once
            for w in works:
                w.wait()
        return works

    o.issue(comm=comm, dist_=dist_)
    o.reference(lambda r: r.p2p([(kind, b.vals if kind == "send" else b.want, peer) for kind, peer, b in items]))


def k_barrier(o: Op):
    o.issue(comm=lambda c, a: c.barrier(async_op=a),
            dist_=lambda g, a: dist.barrier(group=g, async_op=a))


def k_coalesced(o: Op):
    """The coalesced methods torch calls in _coalescing_manager (FSDP2's
    all-gathers and reduce-scatters), on the group itself."""
    variant = o.h.shared.choice(["allreduce_coalesced", "allgather_into_tensor_coalesced",
                                 "reduce_scatter_tensor_coalesced"])
    o.desc.append(variant)
    red = o.reduction(dist_only=True) if variant != "allgather_into_tensor_coalesced" else None
    counts = o.counts(o.h.shared.randint(1, 4))
    pg = o.h.group
    if variant == "allreduce_coalesced":
        xs = [o.buf("x%d" % i, (k,), "inout", red) for i, k in enumerate(counts)]
        opts = _C10D.AllreduceCoalescedOptions()
        opts.reduceOp = red.torch()
        run = lambda g, a: pg.allreduce_coalesced([b.t for b in xs], _async(opts, a))  # noqa: E731
        ref = lambda r: [r.all_reduce(b.want, red) for b in xs]  # noqa: E731
    elif variant == "allgather_into_tensor_coalesced":
        xs = [o.buf("x%d" % i, (k,), "in") for i, k in enumerate(counts)]
        outs = [o.buf("out%d" % i, (o.size * k,), "out") for i, k in enumerate(counts)]
        run = lambda g, a: pg.allgather_into_tensor_coalesced([b.t for b in outs], [b.t for b in xs],  # noqa: E731
                                                              _async(_C10D.AllgatherOptions(), a))
        ref = lambda r: [r.all_gather_tensor(ob.want, xb.vals) for ob, xb in zip(outs, xs)]  # noqa: E731
    else:
        xs = [o.buf("x%d" % i, (o.size * k,), "in", red) for i, k in enumerate(counts)]
        outs = [o.buf("out%d" % i, (k,), "out") for i, k in enumerate(counts)]
        opts = _C10D.ReduceScatterOptions()
        opts.reduceOp = red.torch()
        run = lambda g, a: pg.reduce_scatter_tensor_coalesced([b.t for b in outs], [b.t for b in xs],  # noqa: E731
                                                              _async(opts, a))
        ref = lambda r: [r.reduce_scatter_tensor(ob.want, xb.vals, red) for ob, xb in zip(outs, xs)]  # noqa: E731

    def issue(g, a):
        w = run(g, a)
        if not a:
            w.wait()  # what torch.distributed's functions do for async_op=False
        return w

    o.issue(dist_=issue)
    o.reference(ref)


def _async(opts, a: bool):
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = a
    return opts


class Kind:
    """An op kind: its function, how often it comes, the ftcomm APIs that
    offer it, whether its torch.distributed form completes at once
    (ProcessGroupFtcomm holds isend/irecv until the group's next op or a
    wait, so a peer waiting on its receive would wait for this rank's next
    op), and the ranks it needs."""

    def __init__(self, name: str, run: Callable[[Op], None], weight: int, apis=("comm", "dist"),
                 dist_now: bool = False, min_size: int = 1):
        self.name, self.run, self.weight, self.apis = name, run, weight, apis
        self.dist_now, self.min_size = dist_now, min_size


KINDS = [
    Kind("all_reduce", k_all_reduce, 12),
    Kind("reduce", k_reduce, 4),
    Kind("broadcast", k_broadcast, 5),
    Kind("all_gather", k_all_gather, 4),
    Kind("all_gather_single", k_all_gather_single, 6),
    Kind("all_gather_v", k_all_gather_v, 2, apis=("comm",)),
    Kind("reduce_scatter", k_reduce_scatter, 3),
    Kind("reduce_scatter_single", k_reduce_scatter_single, 6),
    Kind("reduce_scatter_v", k_reduce_scatter_v, 2, apis=("comm",)),
    Kind("all_to_all_single", k_all_to_all_single, 3),
    Kind("all_to_all_v_single", k_all_to_all_v_single, 3),
    Kind("all_to_all", k_all_to_all, 3),
    Kind("gather", k_gather, 2),
    Kind("gather_single", k_gather_single, 1, apis=("comm",)),
    Kind("scatter", k_scatter, 2),
    Kind("send_recv", k_send_recv, 3, dist_now=True, min_size=2),
    Kind("batch_p2p", k_batch_p2p, 3, dist_now=True, min_size=2),
    Kind("barrier", k_barrier, 1),
    Kind("coalesced", k_coalesced, 2, apis=("dist",)),
]
KIND_NAMES = [k.name for k in KINDS]


# ---------------------------------------------------------------- one rank

class StressError(RuntimeError):
    """An op raised (ftcomm's or the reference's): the run cannot go on
    (ranks may now be out of step)."""


class Config:
    def __init__(self, ops: int = 1000, device: str = "cuda", minutes: float = 0.0,
                 kinds: Optional[Sequence[str]] = None,
                 api: str = "", finalize_every: int = 150, checkpoint_every: Tuple[int, int] = (8, 64),
                 max_held_bytes: int = 0, timeout_s: float = 120.0, stall_s: float = 300.0, stall_exit: bool = False,
                 inject: str = "", verbose: bool = False, huge: bool = True, progress_s: float = 0.0):
        self.ops, self.device, self.minutes = ops, device, minutes
        self.kinds = list(kinds) if kinds else list(KIND_NAMES)
        unknown = set(self.kinds) - set(KIND_NAMES)
        if unknown:
            raise ValueError("unknown op kinds %s (kinds: %s)" % (sorted(unknown), ", ".join(KIND_NAMES)))
        self.api = api  # "comm" or "dist": only that API where a kind has it
        self.finalize_every = finalize_every
        self.checkpoint_every = checkpoint_every  # a window's ops: (least, most)
        self.max_held_bytes = max_held_bytes or ((8 << 30) if device == "cuda" else (256 << 20))
        self.timeout_s, self.stall_s, self.stall_exit = timeout_s, stall_s, stall_exit
        self.inject = inject  # "corrupt:I" (a result changed after op I, rank 0) or "unordered" (CUDA)
        self.verbose, self.huge = verbose, huge
        self.progress_s = progress_s  # rank 0 prints where the run is this often (0: never)


class Harness:
    """One rank's stress: its comms (an ftcomm Communicator, an ftcomm
    process group, torch's reference group), its streams, and the ops of
    the current window.

    The ops run in windows of 8 to 64 (a length every rank draws alike):
    first every op of the window through ftcomm, with every stream, sync,
    async, busy-kernel and finalize choice, then (every async op completed,
    the device synchronized) the window's reference ops through torch's
    backend, on their own stream, then (synchronized again) the checks.
    ftcomm's NCCL kernels and torch's never share the GPU: two NCCL comms
    whose kernels a GPU runs in different orders on different ranks (one
    rank's ftcomm op behind a long busy kernel while its torch op runs,
    another's the other way round) may deadlock, as NCCL documents for
    comms used concurrently. For the same reason ftcomm's own two comms
    take turns: an op of the Communicator after ops of the process group
    (or the other way round) first completes those and synchronizes."""

    def __init__(self, cfg: Config, rank: int, size: int, store, device: torch.device):
        self.cfg, self.rank, self.size, self.store, self.device = cfg, rank, size, store, device
        self.cuda = device.type == "cuda"
        self.backend = "nccl" if self.cuda else "gloo"
        self.sizes = [s for s in SIZES["cuda" if self.cuda else "cpu"] if cfg.huge or s[2] < 10_000_000]
        self.kinds = [k for k in KINDS if k.name in cfg.kinds and size >= k.min_size]
        if cfg.api:
            self.kinds = [k for k in self.kinds if cfg.api in k.apis]
        self.only_api = cfg.api
        self.torch_premul = torch_premul_supported()
        self.streams = Streams(device)
        self.ref = (TorchRef if self.cuda else GlooRef)(None, rank, size)
        if self.cuda:
            self.ref.bf16_premul = nccl_bf16_premul_ok(None, device)
            if not self.ref.bf16_premul and rank == 0:
                print("note: torch %s's NCCL misreads a bfloat16 PREMUL_SUM's factor (pytorch/pytorch#190745): "
                      "bfloat16 PREMUL_SUM is checked against its inputs multiplied in bfloat16, then summed by "
                      "torch's NCCL" % torch.__version__, file=sys.stderr, flush=True)
        self.busy_cycles = 20_000_000 if cfg.inject == "unordered" else 0
        self.comm = self._new_comm()
        self.group = self._new_group()
        self.pending: List[Tuple[int, Op, list]] = []
        self.window: List[Op] = []
        self.window_bytes = 0
        self.last_api = ""  # the API of the last op (shared: every rank's is the same)
        self.active_api = ""  # the ftcomm comm that may have work on the device ("": none)
        self.progress = (time.monotonic(), -1, "setup")
        self.corrupt_at: Optional[int] = None

    # ---- comms ----

    def _new_comm(self):
        return ftcomm.new_comm(self.backend, self.device, name="stress", store=self.store, rank=self.rank,
                               size=self.size, timeout=self.cfg.timeout_s)

    def _new_group(self):
        g = dist.new_group(backend="ftcomm", timeout=datetime.timedelta(seconds=self.cfg.timeout_s))
        if self.cuda:
            g.comm(self.device)  # its NCCL comm is made by a collective: before any point-to-point op
        return g

    def recreate(self, api: str) -> None:
        """Finalize the comm (destroy the group) the last op ran on, right
        after that op returned, and make a new one (once the device has
        finished with the old one: one NCCL comm at work at a time)."""
        if api == "comm":
            self.comm.finalize()
            self.streams.synchronize()
            self.comm = self._new_comm()
        else:
            g = self.group
            dist.destroy_process_group(g)
            g.shutdown()
            self.streams.synchronize()
            self.group = self._new_group()

    def use_api(self, api: str) -> None:
        """Before an op through api ("comm": the Communicator; "dist": the
        process group): if the other comm may still have work on the
        device, complete its async ops and synchronize."""
        if self.active_api and self.active_api != api:
            self.drain()
            self.streams.synchronize()
        self.active_api = api

    def close(self) -> None:
        self.drain()
        self.streams.synchronize()
        self.comm.finalize()
        dist.destroy_process_group(self.group)
        self.group.shutdown()

    # ---- the run ----

    def run(self, seed: int) -> dict:
        """cfg.ops ops from seed (with cfg.minutes, until that long has
        passed too), in windows; this rank's counts, and its first
        mismatch."""
        ops, minutes = self.cfg.ops, self.cfg.minutes
        self.seed = seed
        self.shared = random.Random(seed)
        self.local = random.Random("%d/%d" % (seed, self.rank))
        self.last_api = ""
        self.corrupt_at = None
        if self.cfg.inject.startswith("corrupt:"):
            self.corrupt_at = int(self.cfg.inject.split(":", 1)[1])
        res = {"rank": self.rank, "seed": seed, "ops": 0, "mismatches": 0, "checks": 0, "first": None,
               "kinds": {}, "apis": {}, "modes": {}, "recreated": 0, "windows": 0,
               "ftcomm_s": 0.0, "reference_s": 0.0, "check_s": 0.0}
        self.res = res
        t0 = last_print = time.monotonic()
        i = 0
        while not ops or i < ops:
            # Between windows nothing is in flight: rank 0's word on the
            # time goes through the reference group.
            if minutes and self._agree_stop(t0, minutes):
                break
            end = i + self.shared.randint(*self.cfg.checkpoint_every)
            if ops:
                end = min(end, ops)
            self.window, self.window_bytes = [], 0
            tw = time.monotonic()
            while i < end and self.window_bytes <= self.cfg.max_held_bytes:
                self.step(i)
                i += 1
            self.end_window(tw)
            res["ops"] = i
            now = time.monotonic()
            if self.cfg.progress_s and self.rank == 0 and now - last_print >= self.cfg.progress_s:
                last_print = now
                print("stream_stress: seed %d: %d%s ops, %.1f s (ftcomm %.1f s, reference %.1f s, checks %.1f s), "
                      "%d mismatches at rank 0" % (seed, i, "/%d" % ops if ops else "", now - t0, res["ftcomm_s"],
                                                   res["reference_s"], res["check_s"], res["mismatches"]),
                      flush=True)
        res["ops"] = i
        res["seconds"] = time.monotonic() - t0
        return res

    def _agree_stop(self, t0: float, minutes: float) -> bool:
        """Rank 0's word on whether the time is up (every rank stops at
        the same op)."""
        flag = torch.tensor([1 if time.monotonic() - t0 >= minutes * 60 else 0], device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def step(self, i: int) -> None:
        """Op i through ftcomm (its reference waits for the window's end)."""
        kind = _pick(self.shared, [(k.weight, k) for k in self.kinds])
        o = Op(self, i, kind)
        if o.api == "dist" and kind.dist_now and o.when == "later":
            o.when = "now"
        if o.finalize_after:
            self.drain()  # no async op in flight on the comm finalized after this one
        else:
            self.complete_due(i)
        o.stream_name, o.stream = self.streams.pick(self.local)
        self.progress = (time.monotonic(), i, kind.name)
        try:
            with self.streams.ctx(o.stream):
                kind.run(o)
            if o.finalize_after and not o.recreated:
                self.recreate(o.api)  # a rank the op did not involve (send_recv) remakes it too
                o.recreated = True
        except Exception as e:  # noqa: BLE001 - reported with the op
            raise StressError("rank %d, seed %d: %s raised %s: %s\n%s" % (
                self.rank, self.seed, o.describe(), type(e).__name__, e, traceback.format_exc())) from e
        self.last_api = o.api
        if self.cfg.verbose:
            print("[r%d] %s" % (self.rank, o.describe()), file=sys.stderr, flush=True)
        self.window.append(o)
        self.window_bytes += o.bytes()
        r = self.res
        r["kinds"][kind.name] = r["kinds"].get(kind.name, 0) + 1
        r["apis"][o.api] = r["apis"].get(o.api, 0) + 1
        mode = o.when if o.when == "sync" else "%s/%s" % (o.when, o.how)
        r["modes"][mode] = r["modes"].get(mode, 0) + 1
        r["recreated"] += int(o.recreated)

    def complete_due(self, i: int) -> None:
        due = [p for p in self.pending if p[0] <= i]
        if due:
            self.pending = [p for p in self.pending if p[0] > i]
            self.local.shuffle(due)
            for _, o, works in due:
                self._finish(o, works)

    def drain(self) -> None:
        pend, self.pending = self.pending, []
        for _, o, works in pend:
            self._finish(o, works)

    def _finish(self, o: Op, works) -> None:
        """Complete a deferred async op on a stream of this rank's choosing
        (not always the one it was issued on) and queue its after-kernels
        there."""
        name, s = self.streams.pick(self.local)
        o.local_desc.append("completed on stream " + name)
        try:
            with self.streams.ctx(s):
                o.complete(works)
                o.after()
        except Exception as e:  # noqa: BLE001
            raise StressError("rank %d, seed %d: completing %s raised %s: %s\n%s" % (
                self.rank, self.seed, o.describe(), type(e).__name__, e, traceback.format_exc())) from e

    def end_window(self, t_start: float) -> None:
        """Complete every ftcomm op of the window and wait for the device;
        then run the window's reference ops, in op order, and wait again;
        then compare."""
        ops, self.window = self.window, []
        self.drain()
        self.streams.synchronize()
        self.active_api = ""
        t1 = time.monotonic()
        with self.streams.reference():
            for o in ops:
                if o.ref_run is None:
                    continue
                self.progress = (time.monotonic(), o.i, "the reference of " + o.kind.name)
                try:
                    o.ref_run(self.ref)
                except Exception as e:  # noqa: BLE001
                    raise StressError("rank %d, seed %d: the reference (torch's %s) of %s raised %s: %s\n%s" % (
                        self.rank, self.seed, self.backend, o.describe(), type(e).__name__, e,
                        traceback.format_exc())) from e
        self.streams.synchronize()
        t2 = time.monotonic()
        self.check(ops)
        r = self.res
        r["windows"] += 1
        r["ftcomm_s"] += t1 - t_start
        r["reference_s"] += t2 - t1
        r["check_s"] += time.monotonic() - t2

    def check(self, ops: List[Op]) -> None:
        """Compare the results of ops (every one completed, device
        synchronized) with the reference's."""
        for o in ops:
            bad = None
            for c in o.checks:
                self.res["checks"] += 1
                why = _differ(c)
                if why and bad is None:
                    bad = (c, why)
            if bad is not None:
                self.res["mismatches"] += 1
                if self.res["first"] is None:
                    self.res["first"] = {"op": o.i, "report": "rank %d, seed %d: %s\n  %s: %s" % (
                        self.rank, self.seed, o.describe(), bad[0].label, bad[1])}
                    print("stream_stress: MISMATCH " + self.res["first"]["report"], file=sys.stderr, flush=True)


def _differ(c: Check) -> Optional[str]:
    """Why c.got is not c.want (+ c.plus), bit for bit; None if it is."""
    want = c.want + c.plus if c.plus else c.want
    got = c.got
    if got.shape == want.shape and torch.equal(got, want):
        return None
    g, w = got.reshape(-1), want.reshape(-1)
    if g.numel() != w.numel():
        return "shape %s, want %s" % (tuple(got.shape), tuple(want.shape))
    ne = (g != w).nonzero().reshape(-1)
    k = int(ne[0])
    junk = _junk(got.dtype) + c.plus
    gv, wv = g[k].item(), w[k].item()
    hint = ""
    if gv == junk:
        hint = " (the value written before the op: the op had not written it yet, or never did)"
    elif c.plus and gv == wv - 1:
        hint = " (the +1 queued right after the op was lost: the op wrote after it)"
    elif not c.plus and c.label.endswith("unchanged)"):
        hint = " (the op changed its input)"
    lo, hi = max(k - 2, 0), min(k + 3, g.numel())
    return "%d of %d elements differ; first at flat index %d: got %r, want %r%s; got[%d:%d]=%s want[%d:%d]=%s" % (
        ne.numel(), g.numel(), k, gv, wv, hint, lo, hi, g[lo:hi].tolist(), lo, hi, w[lo:hi].tolist())


def _watchdog(h: Harness, stop: threading.Event) -> None:
    """If no op starts for cfg.stall_s, say where the rank is and dump every
    thread's stack (and exit, when cfg.stall_exit)."""
    while not stop.wait(5.0):
        t, i, what = h.progress
        if time.monotonic() - t > h.cfg.stall_s:
            print("stream_stress: rank %d: no progress for %.0f s at op %d (%s), %d async ops pending" % (
                h.rank, time.monotonic() - t, i, what, len(h.pending)), file=sys.stderr, flush=True)
            faulthandler.dump_traceback(all_threads=True)
            if h.cfg.stall_exit:
                os._exit(3)
            h.progress = (time.monotonic(), i, what)


# ---------------------------------------------------------------- entry points

def setup(rank: int, size: int, device: str, store=None, timeout_s: float = 120.0):
    """The reference group (the default group: torch's nccl or gloo) and
    the torch store every comm meets through; dev is this rank's device."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if device == "cuda":
        n = torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local % n)
        dev = torch.device("cuda", local % n)
    else:
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    backend = "nccl" if device == "cuda" else "gloo"
    kw = {"timeout": datetime.timedelta(seconds=max(timeout_s * 5, 600))}
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kw)
    else:
        dist.init_process_group(backend, **kw)  # torchrun's environment
        store = dist.distributed_c10d._get_default_store()
    # A collective first: torch's NCCL group then has its comm before a
    # send/recv that not every rank takes part in. Done before ftcomm's
    # comms are made (torch's and ftcomm's kernels never run at once).
    dist.all_reduce(torch.zeros(1, device=dev))
    if device == "cuda":
        torch.cuda.synchronize(dev)
    return store, dev


def rank_main(rank: int, path: str, size: int = 2, ops: int = 1000, seed: int = 1, device: str = "cuda", runs: int = 1,
              **cfg) -> List[dict]:
    """One rank of a stress through a FileStore at path (the tests' entry:
    cluster.py's rank processes call it); each run's counts (mismatches,
    and the first one's report). Raises StressError if an op raised."""
    store, dev = setup(rank, size, device, dist.FileStore(path, size), cfg.get("timeout_s", 120.0))
    c = Config(ops=ops, device=device, **cfg)
    h = Harness(c, rank, size, store, dev)
    stop = threading.Event()
    threading.Thread(target=_watchdog, args=(h, stop), daemon=True).start()
    try:
        out = [h.run(seed + r) for r in range(runs)]
        h.close()
    finally:
        stop.set()
        if dist.is_initialized():
            dist.destroy_process_group()
    return out


def describe(res: dict) -> str:
    """One rank's run, for a test's message."""
    s = "rank %d, seed %d: %d ops, %d checks, %d mismatches; kinds %s; apis %s; modes %s; %d comms recreated" % (
        res["rank"], res["seed"], res["ops"], res["checks"], res["mismatches"], res["kinds"], res["apis"],
        res["modes"], res["recreated"])
    if res["first"]:
        s += "\nfirst mismatch: " + res["first"]["report"]
    return s


def seed_from_env(default: Optional[int] = None) -> int:
    """FTCOMM_STRESS_SEED, else default, else a fresh seed (printed by the
    run's report, so that a failure can be replayed)."""
    v = os.environ.get("FTCOMM_STRESS_SEED")
    if v:
        return int(v)
    return default if default is not None else random.SystemRandom().randrange(1 << 31)


def _main_rank(rank: int, size: int, args, store=None) -> int:
    faulthandler.enable()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    store, dev = setup(rank, size, args.device, store, args.timeout)
    cfg = Config(ops=args.ops, device=args.device, minutes=args.minutes,
                 kinds=args.kinds.split(",") if args.kinds else None,
                 api=args.api, finalize_every=args.finalize_every, timeout_s=args.timeout, stall_s=args.stall,
                 stall_exit=True, inject=args.inject, verbose=args.verbose, huge=not args.no_huge,
                 progress_s=args.progress)
    h = Harness(cfg, rank, size, store, dev)
    stop = threading.Event()
    threading.Thread(target=_watchdog, args=(h, stop), daemon=True).start()
    failed = False
    for r in range(args.runs):
        seed = args.seed + r
        try:
            res = h.run(seed)
        except StressError as e:
            print("stream_stress: ERROR %s" % e, file=sys.stderr, flush=True)
            os._exit(2)  # the others may wait in an op this rank never issues: the launcher ends them
        every = [None] * size
        dist.all_gather_object(every, res)
        bad = sum(x["mismatches"] for x in every)
        failed = failed or bad > 0
        if rank == 0:
            for x in sorted((x for x in every if x["first"]), key=lambda x: x["first"]["op"]):
                print("stream_stress: first mismatch of " + x["first"]["report"], flush=True)
            print("stream_stress: run %d/%d seed %d: %d ops, %d mismatches, %d checks, %d ranks "
                  "(%s: ftcomm vs torch %s), %d comms recreated, %.1f s" % (
                      r + 1, args.runs, seed, res["ops"], bad, sum(x["checks"] for x in every), size, args.device,
                      h.backend, res["recreated"], res["seconds"]), flush=True)
            if args.stats:
                print("stream_stress:   kinds %s; apis %s; modes %s" % (res["kinds"], res["apis"], res["modes"]),
                      flush=True)
                print("stream_stress:   rank 0: %d windows; ftcomm %.1f s, reference %.1f s, checks %.1f s" % (
                    res["windows"], res["ftcomm_s"], res["reference_s"], res["check_s"]), flush=True)
    h.close()
    stop.set()
    dist.destroy_process_group()
    return 1 if failed else 0


def _child(rank: int, size: int, path: str, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["LOCAL_RANK"] = str(rank)
    code = _main_rank(rank, size, args, dist.FileStore(path, size))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=None, help="ops per run (default 10,000; with --minutes, no bound)")
    ap.add_argument("--minutes", type=float, default=0.0, help="end each run after this long")
    ap.add_argument("--runs", type=int, default=1, help="runs, with seeds seed, seed+1, ...")
    ap.add_argument("--seed", type=int, default=None, help="the first run's seed (default: a fresh one, printed)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: every GPU; 2 on CPU); ignored under torchrun")
    ap.add_argument("--kinds", default="", help="only these op kinds, comma-separated: " + ",".join(KIND_NAMES))
    ap.add_argument("--api", choices=["", "comm", "dist"], default="", help="only this ftcomm API where a kind has it")
    ap.add_argument("--finalize-every", type=int, default=150, help="about one finalize and remake per this many ops")
    ap.add_argument("--timeout", type=float, default=120.0, help="ftcomm's op deadline, s")
    ap.add_argument("--stall", type=float, default=300.0,
                    help="dump stacks and exit after this long without progress, s")
    ap.add_argument("--inject", default="",
                    help="test the harness: corrupt:I (rank 0 changes a result after op I) or unordered (ops "
                         "issued on a stream that did not wait for the kernels writing their inputs)")
    ap.add_argument("--no-huge", action="store_true", help="no ~16M-element ops")
    ap.add_argument("--stats", action="store_true", help="print what each run covered and where its time went")
    ap.add_argument("--progress", type=float, default=10.0,
                    help="print where a run is about this often, s (0: never)")
    ap.add_argument("--verbose", action="store_true", help="print every op (stderr)")
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = seed_from_env()
    if args.ops is None:
        args.ops = 0 if args.minutes else 10_000
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        return _main_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    n = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if n < 2:
        print("stream_stress: needs 2 ranks (found %d GPUs)" % n, file=sys.stderr)
        return 2
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="stream-stress-") as tmp:
        path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(r, n, path, args)) for r in range(n)]
        for p in procs:
            p.start()
        codes: Dict[int, int] = {}
        grace = None
        while len(codes) < n:
            for r, p in enumerate(procs):
                if r not in codes and not p.is_alive():
                    p.join()
                    codes[r] = p.exitcode
                    if p.exitcode and grace is None:
                        grace = time.monotonic() + 30  # the others may wait for it: let them report, then end them
            if grace is not None and time.monotonic() > grace:
                for r, p in enumerate(procs):
                    if r not in codes:
                        p.kill()
                        p.join()
                        codes[r] = -9
            time.sleep(0.2)
    rc = max((abs(c) for c in codes.values()), default=0)
    if rc:
        print("stream_stress: exit codes by rank %s" % [codes[r] for r in range(n)], file=sys.stderr)
    return 1 if rc else 0


if __name__ == "__main__":
    sys.exit(main())
