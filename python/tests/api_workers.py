"""Rank functions for test_torchcomms_api.py: torchcomms' API on ftcomm
(the behaviours torchcomms' own integration tests check, so that CI, which
cannot fetch torchcomms, guards them). Each takes the rank first and
returns what the test asserts on."""

from __future__ import annotations

import datetime

import numpy as np

import ftcomm
from ftcomm import ReduceOp, RedOpType, objcol
from workers import STATE, comm, finalize


def _t():
    import torch
    return torch


def _device(rank, backend):
    return "cuda:%d" % rank if backend == "nccl" else "cpu"


class _On:
    """torch's tensor constructors, on one device."""

    def __init__(self, device):
        self.torch, self.device = _t(), device

    def __getattr__(self, name):
        f = getattr(self.torch, name)
        if name in ("ones", "zeros", "full", "empty", "tensor", "arange"):
            return lambda *a, **k: f(*a, **k).to(self.device)
        return f


def zero_elements(rank, store, name, size=2, backend="gloo"):
    """Every op with 0-element tensors, on every rank: no error, no
    desync; the comm then still runs a collective. Returns the ops that
    raised."""
    torch = _On(_device(rank, backend))
    c = comm(rank, store, name, size, backend, _device(rank, backend))
    e = lambda: torch.empty(0)  # noqa: E731
    calls = {
        "all_reduce": lambda: c.all_reduce(e(), ReduceOp.SUM),
        "reduce": lambda: c.reduce(e(), 0, ReduceOp.SUM),
        "broadcast": lambda: c.broadcast(e(), 0),
        "all_gather": lambda: c.all_gather([e() for _ in range(size)], e()),
        "all_gather_single": lambda: c.all_gather_single(e(), e()),
        "all_gather_v": lambda: c.all_gather_v([e() for _ in range(size)], e()),
        "reduce_scatter": lambda: c.reduce_scatter(e(), [e() for _ in range(size)], ReduceOp.SUM),
        "reduce_scatter_single": lambda: c.reduce_scatter_single(e(), e(), ReduceOp.SUM),
        "reduce_scatter_v": lambda: c.reduce_scatter_v(e(), [e() for _ in range(size)], ReduceOp.SUM),
        "all_to_all_single": lambda: c.all_to_all_single(e(), e()),
        "all_to_all_v_single": lambda: c.all_to_all_v_single(e(), e(), [0] * size, [0] * size),
        "all_to_all": lambda: c.all_to_all([e() for _ in range(size)], [e() for _ in range(size)]),
        "scatter": lambda: c.scatter(e(), [e() for _ in range(size)] if rank == 0 else None, 0),
        "gather": lambda: c.gather([e() for _ in range(size)] if rank == 0 else None, e(), 0),
        "gather_single": lambda: c.gather_single(e(), e(), 0),
        "send/recv": lambda: c.send(e(), 1) if rank == 0 else (c.recv(e(), 0) if rank == 1 else None),
        "async all_gather_single": lambda: c.all_gather_single(e(), e(), async_op=True).wait(),
    }
    failed = []
    for what, f in calls.items():
        try:
            f()
        except Exception as ex:  # noqa: BLE001 - reported to the test
            failed.append("%s: %r" % (what, ex))
    x = torch.full((4,), float(rank + 1))
    c.all_reduce(x)
    finalize(rank, name)
    return failed, float(x[0].cpu())


def finalize_after_sync_op(rank, store, name, size=2, backend="gloo", rounds=3, late=0.0):
    """A sync all-reduce, then finalize at once, while the peer issues its
    all-reduce only after this rank has begun to finalize (told through
    the store): the result must still be the sum. NCCL only: there a sync
    op returns once enqueued, so a finalize that aborted the comm would
    cancel the kernel and leave the tensor wrong with no error (on gloo a
    sync op returns when done, so rank 0 would wait for rank 1 forever).
    With late > 0 the peer also arrives that many seconds after the
    signal (a slow rank, not a synchronisation): long after a finalize
    that aborted the comm would have cancelled the kernel. Returns the
    sums read, one per round."""
    torch = _On(_device(rank, backend))
    st = ftcomm.Store.connect(store)
    got = []
    for i in range(rounds):
        n = "%s-%d" % (name, i)
        c = comm(rank, store, n, size, backend, _device(rank, backend))
        x = torch.full((4,), float(rank + 1))
        if rank == 0:
            c.all_reduce(x)
            st.set(n + "/finalizing", b"1")
            finalize(rank, n)
        else:
            st.get(n + "/finalizing", timeout=datetime.timedelta(seconds=30))
            if late > 0:
                import time
                time.sleep(late)  # a slow peer: the fault injected, not a synchronisation
            c.all_reduce(x)
            finalize(rank, n)
        got.append(float(x[0].cpu()))
    st.close()
    return got


def reductions(rank, store, name, size=2, backend="gloo"):
    """PREMUL_SUM (scalar and tensor factors), AVG on integers, bitwise ops
    (gloo; NCCL refuses them), bool; returns {case: (got, want)} for the
    cases that differ."""
    torch = _On(_device(rank, backend))
    c = comm(rank, store, name, size, backend, _device(rank, backend))
    bad = {}

    def check(what, got, want):
        got, want = got.cpu(), want.cpu()
        if not torch.equal(got, want):
            bad[what] = (got.tolist(), want.tolist())

    s = size * (size + 1) // 2
    for dt in (torch.float16, torch.float32, torch.float64, torch.bfloat16):
        for factor in (2.0, torch.ones(1, dtype=dt) * 2.0):
            x = torch.ones(5, dtype=dt) * (rank + 1)
            c.all_reduce(x, ReduceOp.PREMUL_SUM(factor))
            check("premul all_reduce %s %s" % (dt, type(factor).__name__), x, torch.full((5,), 2.0 * s, dtype=dt))
    # reduce: the non-root's tensor is left as it was; reduce_scatter's
    # input is never scaled.
    x = torch.ones(3) * (rank + 1)
    c.reduce(x, 0, ReduceOp.PREMUL_SUM(3.0))
    check("premul reduce", x, torch.full((3,), 3.0 * s) if rank == 0 else torch.full((3,), float(rank + 1)))
    inp = torch.ones(2 * size) * (rank + 1)
    out = torch.zeros(2)
    c.reduce_scatter_single(out, inp, ReduceOp.PREMUL_SUM(0.5))
    check("premul reduce_scatter output", out, torch.full((2,), 0.5 * s))
    check("premul reduce_scatter input untouched", inp, torch.ones(2 * size) * (rank + 1))
    # AVG on integers truncates (ncclAvg): (1 + … + size) / size.
    for dt in (torch.int8, torch.int32, torch.int64, torch.uint8):
        x = torch.ones(4, dtype=dt) * (rank + 1)
        c.all_reduce(x, ReduceOp.AVG)
        check("avg %s" % dt, x, torch.full((4,), s // size, dtype=dt))
    # Bitwise (gloo).
    v = torch.tensor([0b1100, 0b1010, 0b0001], dtype=torch.int32) << rank
    want = {}
    parts = [torch.tensor([0b1100, 0b1010, 0b0001], dtype=torch.int32) << r for r in range(size)]
    want[RedOpType.BAND] = parts[0].clone()
    want[RedOpType.BOR] = parts[0].clone()
    want[RedOpType.BXOR] = parts[0].clone()
    for p in parts[1:]:
        want[RedOpType.BAND] &= p
        want[RedOpType.BOR] |= p
        want[RedOpType.BXOR] ^= p
    for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        x = v.clone()
        if backend == "nccl":
            try:
                c.all_reduce(x, op)
                bad["bitwise %s on nccl" % op.name] = ("no error", "InvalidArgumentError")
            except ftcomm.InvalidArgumentError:
                pass
            continue
        c.all_reduce(x, op)
        check("bitwise %s" % op.name, x, want[op.type])
    # bool: SUM and MAX are or, PRODUCT and MIN are and.
    b = torch.tensor([rank == 0, False, True])
    for op, w in ((ReduceOp.SUM, [True, False, True]), (ReduceOp.MAX, [True, False, True]),
                  (ReduceOp.PRODUCT, [size == 1, False, True]), (ReduceOp.MIN, [size == 1, False, True]),
                  (ReduceOp.BXOR, [True, False, size % 2 == 1])):
        if backend == "nccl" and op == ReduceOp.BXOR:
            continue
        x = b.clone()
        c.all_reduce(x, op)
        check("bool %s" % op.name, x, torch.tensor(w))
    x = torch.tensor([True, rank == 1])
    out = torch.zeros(2 * size, dtype=torch.bool)
    c.all_gather_single(out, x)
    check("bool all_gather_single", out, torch.tensor(sum(([True, r == 1] for r in range(size)), [])))
    finalize(rank, name)
    return bad


def v_and_list_ops(rank, store, name, size=2, backend="gloo"):
    """all_gather_v, reduce_scatter_v, all_to_all (lists, sizes per peer),
    all_to_all_v_single (rows of a 2-D tensor), gather_single and the list
    ops on tensors that are not adjacent in memory; returns what differs."""
    torch = _On(_device(rank, backend))
    c = comm(rank, store, name, size, backend, _device(rank, backend))
    bad = {}

    def check(what, got, want):
        got, want = got.cpu(), want.cpu()
        if not torch.equal(got, want):
            bad[what] = (got.tolist(), want.tolist())

    counts = [r + 1 for r in range(size)]
    outs = [torch.full((counts[r],), -1.0) for r in range(size)]
    c.all_gather_v(outs, torch.full((counts[rank],), float(rank)))
    for r in range(size):
        check("all_gather_v[%d]" % r, outs[r], torch.full((counts[r],), float(r)))
    ins = [torch.full((counts[r],), float(rank + 1)) for r in range(size)]
    out = torch.zeros(counts[rank])
    c.reduce_scatter_v(out, ins, ReduceOp.SUM)
    check("reduce_scatter_v", out, torch.full((counts[rank],), float(size * (size + 1) // 2)))
    # all_to_all: rank q sends q+p+1 elements of value 10q+p to p.
    ins = [torch.full((rank + p + 1,), float(10 * rank + p)) for p in range(size)]
    outs = [torch.full((q + rank + 1,), -1.0) for q in range(size)]
    c.all_to_all(outs, ins)
    for q in range(size):
        check("all_to_all[%d]" % q, outs[q], torch.full((q + rank + 1,), float(10 * q + rank)))
    # all_to_all_v_single on rows of 2 columns.
    in_rows = [p + 1 for p in range(size)]
    out_rows = [rank + 1] * size
    inp = torch.cat([torch.full((in_rows[p], 2), float(100 * rank + p)) for p in range(size)])
    out = torch.full((sum(out_rows), 2), -1.0)
    c.all_to_all_v_single(out, inp, out_rows, in_rows)
    check("all_to_all_v_single", out, torch.cat([torch.full((rank + 1, 2), float(100 * q + rank)) for q in range(size)]))
    # gather_single, and gather/scatter/all_gather into tensors scattered in memory.
    out = torch.full((3 * size,), -1.0)
    c.gather_single(out if rank == 0 else None, torch.full((3,), float(rank)), 0)
    if rank == 0:
        check("gather_single", out, torch.cat([torch.full((3,), float(r)) for r in range(size)]))
    big = torch.full((4 * size,), -1.0)
    views = [big[4 * r + 1:4 * r + 3] for r in range(size)]  # gaps between them
    c.all_gather(views, torch.full((2,), float(rank)))
    for r in range(size):
        check("all_gather into views[%d]" % r, views[r], torch.full((2,), float(r)))
    check("all_gather leaves the gaps", big[0:1], torch.tensor([-1.0]))
    outs = [torch.full((2,), -1.0) for _ in range(size)] if rank == 0 else None
    c.gather(outs, torch.full((2,), float(rank)), 0)
    if rank == 0:
        for r in range(size):
            check("gather[%d]" % r, outs[r], torch.full((2,), float(r)))
    out = torch.full((2,), -1.0)
    c.scatter(out, [torch.full((2,), float(7 + r)) for r in range(size)] if rank == 0 else None, 0)
    check("scatter", out, torch.full((2,), float(7 + rank)))
    finalize(rank, name)
    return bad


def batch_p2p(rank, store, name, size=2, backend="gloo"):
    """A ring exchange through batch_op_create, sync and async."""
    torch = _On(_device(rank, backend))
    c = comm(rank, store, name, size, backend, _device(rank, backend))
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    got = []
    for async_op in (False, True):
        b = c.batch_op_create()
        recvs = [torch.zeros(3), torch.zeros(5, dtype=torch.int64)]
        b.send(torch.full((3,), float(rank)), nxt)
        b.recv(recvs[0], prv)
        b.send(torch.full((5,), rank * 10, dtype=torch.int64), nxt)
        b.recv(recvs[1], prv)
        w = b.issue(async_op)
        w.wait()
        got.append((recvs[0].cpu().tolist(), recvs[1].cpu().tolist(), len(b.ops)))
    try:
        c.batch_op_create().issue(False)
        empty = "no error"
    except ValueError as e:
        empty = type(e).__name__
    finalize(rank, name)
    return got, empty


def work_api(rank, store, name):
    """wait_blocking, is_completed, status, exception, dropped Works."""
    torch = _t()
    c = comm(rank, store, name)
    x = torch.ones(1 << 16)
    w = c.all_reduce(x, ReduceOp.SUM, True)
    w.wait_blocking()
    res = {"completed": w.is_completed(), "status": w.status().name, "exception": w.exception(), "x": float(x[0])}
    w = c.barrier(async_op=True)
    res["barrier"] = w.wait()
    finalize(rank, name)
    return res


def split_refusals(rank, store, name, size=2):
    """Refused split lists raise RuntimeError on every rank, also when only
    one rank's list is wrong (it still takes part, so the others do not
    wait); the comm keeps working."""
    c = comm(rank, store, name, size)
    out = {}
    for what, ranks in {"duplicates": list(range(size)) * 2,
                        "without self": [r for r in range(size) if r != rank],
                        # rank 0 lists everyone; the others list a rank twice
                        "one rank wrong": list(range(size)) if rank == 0 else list(range(size)) + [0],
                        "lists differ": list(range(size)) if rank == 0 else list(reversed(range(size)))}.items():
        try:
            child = c.split(ranks, name=what)
            out[what] = "no error (size %d)" % child.get_size()
        except RuntimeError as e:
            out[what] = type(e).__name__
    child = c.split(list(range(size)), name="good")
    x = np.full(4, float(rank + 1), dtype=np.float32)
    child.all_reduce(x)
    out["good"] = (child.get_rank(), child.get_size(), float(x[0]))
    none = c.split([] if rank == size - 1 else [r for r in range(size - 1)], name="partial")
    out["not in any"] = none is None if rank == size - 1 else none.get_size()
    child.finalize()
    if none is not None:
        none.finalize()
    finalize(rank, name)
    return out


def reconfigure_cycle(rank, store, name, size=3):
    """torchcomms' reconfigure: all ranks from their init handles, a shrink
    that leaves the last rank out (it does not take part), each rank alone,
    then all again (a grow); an all-reduce after each. Returns what each
    step saw."""
    from ftcomm import Store
    st = Store.connect(store)
    c = ftcomm.new_comm("gloo", "cpu", name, enable_reconfigure=True, store=st, timeout=30)
    h = c.get_init_handle()
    assert h == c.get_init_handle()
    try:
        c.all_reduce(np.ones(1, dtype=np.float32))
        unconfigured = "no error"
    except RuntimeError as e:
        unconfigured = type(e).__name__

    def handles(tag):
        st.set("%s/%s/%d" % (name, tag, rank), c.get_init_handle())
        return [st.get("%s/%s/%d" % (name, tag, r)).decode() for r in range(size)]

    def total():
        x = np.full(2, float(c.get_rank() + 1), dtype=np.float32)
        c.all_reduce(x)
        return c.get_rank(), c.get_size(), float(x[0])

    seen = {"unconfigured": unconfigured}
    all_h = handles("a")
    assert c.reconfigure(uuid=1, init_handles=all_h).is_completed()
    seen["all"] = total()
    if rank < size - 1:
        c.reconfigure(uuid=2, init_handles=all_h[:-1])
        seen["shrunk"] = total()
    c.reconfigure(uuid=3, init_handles=[c.get_init_handle()])
    seen["alone"] = total()
    c.reconfigure(uuid=4, init_handles=handles("b"))
    seen["grown"] = total()
    c.reconfigure(uuid=5, init_handles=set(handles("c")))
    seen["as a set"] = total()
    handles("d")  # every rank is done with the comm: an abort now fails no peer's op
    c.abort()
    seen["aborted"] = (c.is_abort_supported(), c.is_aborted())
    c.finalize()
    st.close()
    return seen


def abort_api(rank, store, name):
    """abort() fails the next op and is_aborted() says so."""
    c = comm(rank, store, name)
    before = c.is_aborted()
    c.abort()
    try:
        c.all_reduce(np.ones(2, dtype=np.float32))
        after = "no error"
    except RuntimeError as e:
        after = type(e).__name__
    res = (c.is_abort_supported(), before, c.is_aborted(), after)
    finalize(rank, name)
    return res


def object_collectives(rank, store, name, size=2):
    """ftcomm.objcol: every function."""
    c = comm(rank, store, name, size)
    t = datetime.timedelta(seconds=30)
    res = {}
    out = [None] * size
    objcol.all_gather_object(c, out, {"rank": rank, "s": "x" * rank}, timeout=t)
    res["all_gather"] = out
    g = [None] * size if rank == 0 else None
    objcol.gather_object(c, [rank, "r%d" % rank], 0, g, timeout=t)
    res["gather"] = g
    objs = ["b", 123, {"k": [1, 2]}] if rank == 0 else [None, None, None]
    objcol.broadcast_object_list(c, objs, 0, timeout=t)
    res["broadcast"] = objs
    so = [None]
    objcol.scatter_object_list(c, so, ["for %d" % r for r in range(size)] if rank == 0 else None, 0, timeout=t)
    res["scatter"] = so[0]
    if rank == 0:
        objcol.send_object_list(c, ["hello", 7], 1, timeout=t)
    elif rank == 1:
        got = [None, None]
        objcol.recv_object_list(c, got, 0, timeout=t)
        res["recv"] = got
    finalize(rank, name)
    return res


def options_api(rank, store, name):
    c = comm(rank, store, name, hints={"shared_memory": "0"})
    o = c.get_options()
    res = (o.name, o.timeout.total_seconds(), o.abort_process_on_timeout_or_error, o.enable_reconfigure,
           o.hints, c.get_backend(), isinstance(c.get_backend_version(), str))
    finalize(rank, name)
    return res
