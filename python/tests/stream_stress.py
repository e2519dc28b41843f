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
and the CPU test test_stream_stress.py (rank_main). The ops (the choices,
Op, the op kinds) are in stress_ops.py; the harness, streams, references
and entry points here.
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
from stress_ops import (  # noqa: E402 - the ops the harness runs
    AG_TENSOR, KIND_NAMES, KINDS, RS_TENSOR, SIZES, Check, Op, Red, junk_value, nccl_bf16_premul_ok, pick,
    torch_premul_supported)


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
        k = pick(rng, [(40, "current"), (25, "side0"), (25, "side1"), (10, "pool")])
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
        k = pick(rng, [(30, "none"), (48, "sleep"), (5, "long sleep"), (17, "matmul")])
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
        AG_TENSOR(out, x, group=self.g)

    def all_gather_v(self, outs, x):
        outs[self.rank].copy_(x)
        for r in range(self.size):
            self.broadcast(outs[r], r)

    def reduce_scatter(self, out, ins, red: Red):
        op, ins = self._prep(red, list(ins))
        dist.reduce_scatter(out, ins, op, group=self.g)

    def reduce_scatter_tensor(self, out, x, red: Red):
        op, (x,) = self._prep(red, [x])
        RS_TENSOR(out, x, op, group=self.g)

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
        kind = pick(self.shared, [(k.weight, k) for k in self.kinds])
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
    junk = junk_value(got.dtype) + c.plus
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
