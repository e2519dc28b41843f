"""The ops of the stream-order stress (stream_stress.py): the choices every
rank draws alike (sizes, dtypes, reductions) and those each draws alone,
one op's tensors and checks (Op), and the op kinds (KINDS), each issuing
its op through ftcomm's Communicator or its torch.distributed backend and
queueing the reference op. stream_stress.py runs them and holds the
harness, the streams, the references and the entry points.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ftcomm import ReduceOp, _dist_reduce_ops

if TYPE_CHECKING:
    from stream_stress import Harness, TorchRef

AG_TENSOR = getattr(dist, "all_gather_into_tensor", None) or getattr(dist, "_all_gather_base")
RS_TENSOR = getattr(dist, "reduce_scatter_tensor", None) or getattr(dist, "_reduce_scatter_base")
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


def junk_value(dtype) -> int:
    return 201 if dtype == torch.uint8 else JUNK


def pick(rng: random.Random, weighted: Sequence[Tuple[int, Any]]):
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
        self.dt = pick(S, DTYPES)
        self.finalize_after = S.random() < 1.0 / max(h.cfg.finalize_every, 1) if h.cfg.finalize_every else False
        self.moved = 0  # elements the op moves, over all ranks (from the shared choices)
        self.bufs: List[Buf] = []
        self.checks: List[Check] = []
        self.ref_run: Optional[Callable[[TorchRef], None]] = None  # the reference op, run at the window's end
        self.recreated = False
        self.stream_name, self.stream = "", None
        # sync, or async and completed now or after later ops; how: wait(),
        # get_future() (torch.distributed's Work), or polling is_completed().
        when = pick(L, [(45, "sync"), (25, "now"), (30, "later")])
        if self.finalize_after:
            when = "sync"
        self.when = when
        self.how = pick(L, [(70, "wait"), (15, "future"), (15, "poll")])
        self.delay = L.randint(1, 6)

    # ---- shared choices ----

    def _size_class(self) -> Tuple[int, int]:
        return pick(self.h.shared, [(w, (lo, hi)) for w, lo, hi in self.h.sizes])

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
            return pick(L, opts)
        return pick(L, [(75, "contig"), (25, "offset")])

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
            t.fill_(junk_value(self.dt))  # overwritten with vals right before the op
        want = None
        if role == "inout":
            want = vals.clone()
        elif role == "out":
            want = torch.full(shape, junk_value(self.dt), dtype=self.dt, device=self.dev)
        b = Buf(name, role, vals, t, want, layout or "view")
        self.bufs.append(b)
        if layout not in (None, "contig", "view"):
            self.local_desc.append("%s=%s" % (name, layout))
        return b

    def bufs_list(self, name: str, counts: Sequence[int], role: str, red: Optional[Red] = None) -> List[Buf]:
        """A list of 1-D tensors: views of one buffer in order (adjacent),
        in reverse order, or separate tensors (this rank's choice)."""
        L = self.h.local
        how = pick(L, [(40, "buffer"), (20, "reversed"), (40, "separate")])
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
                b.t.fill_(junk_value(self.dt))
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
            dist_=lambda g, a: AG_TENSOR(out.t, x.t, group=g, async_op=a))
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
            dist_=lambda g, a: RS_TENSOR(out.t, x.t, red.torch(), group=g, async_op=a))
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
