"""Functions the rank processes of test_distributed.py run (see cluster.py):
torch.distributed over the "ftcomm" backend, on CPU tensors. Each takes the
rank first; a rank's process group lives across calls in STATE."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

import ftcomm
import ftcomm.distributed  # registers "ftcomm"

STATE: dict = {}


def init(rank, path, size=2, timeout=20):
    """The default group over ftcomm, and a torch gloo group of the same
    ranks (the reference), through one FileStore."""
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.FileStore(path, size)
    dist.init_process_group("ftcomm", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout))
    STATE["gloo"] = dist.new_group(backend="gloo")
    return dist.get_backend(), type(dist.distributed_c10d._get_default_group()).__name__


def shutdown(rank):
    if dist.is_initialized():
        pg = dist.distributed_c10d._get_default_group()
        dist.destroy_process_group()
        if isinstance(pg, ftcomm.distributed.ProcessGroupFtcomm):
            pg.shutdown()
    STATE.clear()
    return ftcomm.live_handles()


def _vals(rank, n, dtype=torch.float32):
    return (torch.arange(n, dtype=torch.float64) * 3 + rank + 1).remainder(7).add(1).to(dtype)


def ops(rank):
    """Every op DDP, FSDP and the rest of torch.distributed call, against
    torch's gloo backend on the same inputs. Returns the names that differ."""
    size = dist.get_world_size()
    gloo = STATE["gloo"]
    bad = []

    def both(name, fn, make, ref=None):
        """fn(tensor, None) on ftcomm against fn(tensor, gloo), or
        ref(tensor, gloo) for ops torch's gloo lacks."""
        a, b = make(), make()
        ra = fn(a, None)
        rb = (ref or fn)(b, gloo)
        for x, y in zip(_flat(ra if ra is not None else a), _flat(rb if rb is not None else b)):
            if not torch.equal(x, y):
                bad.append("%s: %s != %s" % (name, x, y))
                return

    def wait(w):
        if w is not None:
            w.wait()

    n = 6
    for dt in (torch.float32, torch.float64, torch.int64, torch.int32, torch.float16, torch.bfloat16):
        for op in ("SUM", "MAX", "MIN", "PRODUCT"):
            # torch's gloo reduces neither float16 nor bfloat16: the
            # reference reduces the same values in float32.
            ref = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
            both("all_reduce %s %s" % (dt, op),
                 lambda t, g: dist.all_reduce(t if g is None else t.to(ref), getattr(dist.ReduceOp, op), group=g)
                 if g is None else (lambda u: (dist.all_reduce(u, getattr(dist.ReduceOp, op), group=g), [u.to(dt)])[1])(
                     t.to(ref)), lambda: _vals(rank, n, dt))
    # AVG: torch's gloo has none; against the sum divided.
    t = _vals(rank, n)
    dist.all_reduce(t, dist.ReduceOp.AVG)
    s = _vals(rank, n)
    dist.all_reduce(s, group=gloo)
    if not torch.allclose(t, s / size):
        bad.append("AVG")
    both("all_reduce async", lambda t, g: wait(dist.all_reduce(t, group=g, async_op=True)), lambda: _vals(rank, n))
    # (torch's gloo reduces a non-contiguous tensor wrong: the reference
    # reduces a contiguous copy.)
    both("all_reduce non-contiguous", lambda t, g: dist.all_reduce(t[:, 1], group=g),
         lambda: _vals(rank, 12).view(6, 2), ref=lambda t, g: (lambda c: (dist.all_reduce(c, group=g), t[:, 1].copy_(c), t)[2])(
             t[:, 1].contiguous()))
    both("broadcast", lambda t, g: dist.broadcast(t, 1, group=g), lambda: _vals(rank, n))
    both("reduce", lambda t, g: (dist.reduce(t, 0, group=g), [t] if rank == 0 else [])[1], lambda: _vals(rank, n))
    both("all_gather", lambda t, g: (lambda out: (dist.all_gather(out, t, group=g), out)[1])(
        [torch.zeros(n) for _ in range(size)]), lambda: _vals(rank, n))
    both("all_gather_into_tensor", lambda t, g: (lambda out: (_ag_base(out, t, g), out)[1])(torch.zeros(size * n)),
         lambda: _vals(rank, n), ref=lambda t, g: (lambda out: (dist.all_gather(out, t, group=g), torch.cat(out))[1])(
             [torch.zeros(n) for _ in range(size)]))
    both("all_gather_object", lambda t, g: (lambda out: (dist.all_gather_object(out, {"r": rank}, group=g),
                                                         [torch.tensor([o["r"] for o in out])])[1])([None] * size),
         lambda: None)
    rs_ref = lambda t, g: (dist.all_reduce(t, group=g), t.chunk(size)[rank])[1]  # noqa: E731
    both("reduce_scatter", lambda t, g: (lambda out: (dist.reduce_scatter(out, list(t.chunk(size)), group=g), out)[1])(
        torch.zeros(n // size)), lambda: _vals(rank, n), ref=rs_ref)
    both("reduce_scatter_tensor", lambda t, g: (lambda out: (_rs_base(out, t, g), out)[1])(torch.zeros(n // size)),
         lambda: _vals(rank, n), ref=rs_ref)
    both("all_to_all_single", lambda t, g: (lambda out: (dist.all_to_all_single(out, t, group=g), out)[1])(
        torch.zeros(n)), lambda: _vals(rank, n))
    both("all_to_all_single uneven", lambda t, g: (lambda out: (dist.all_to_all_single(
        out, t, [2, 1] if rank == 0 else [3, 0], [2, 3] if rank == 0 else [1, 0], group=g), out)[1])(
        torch.zeros(3)), lambda: _vals(rank, 5 if rank == 0 else 1))
    both("gather", lambda t, g: (lambda out: (dist.gather(t, out, dst=0, group=g), out or [t])[1])(
        [torch.zeros(n) for _ in range(size)] if rank == 0 else None), lambda: _vals(rank, n))
    both("scatter", lambda t, g: (lambda out: (dist.scatter(out, list(t.chunk(size)) if rank == 1 else None, src=1,
                                                            group=g), out)[1])(torch.zeros(n // size)),
         lambda: _vals(rank, n))
    both("broadcast_object_list", lambda t, g: (lambda objs: (dist.broadcast_object_list(objs, src=0, group=g),
                                                              [torch.tensor(objs[0])])[1])([[rank, 7]]), lambda: None)
    both("all_reduce_coalesced", lambda t, g: (dist.all_reduce_coalesced(t, group=g), t)[1],
         lambda: [_vals(rank, 3), _vals(rank, 4), _vals(rank, 2)])
    both("send/recv", lambda t, g: _sendrecv(rank, t, g), lambda: _vals(rank, n))
    both("batch_isend_irecv", lambda t, g: _batch(rank, size, t, g), lambda: _vals(rank, 1 << 20))
    dist.barrier()
    w = dist.barrier(async_op=True)
    w.wait()
    # gloo's health-checking barrier (torch's dist.monitored_barrier accepts
    # only its gloo backend: the group's method).
    dist.distributed_c10d._get_default_group().monitored_barrier(datetime.timedelta(seconds=20), wait_all_ranks=True)
    # A Work's future, and the Work's state after it.
    t = _vals(rank, n)
    w = dist.all_reduce(t, async_op=True)
    f = w.get_future()
    v = f.wait()
    if not (w.is_completed() and w.is_success() and w.exception() is None and torch.equal(v[0], t)):
        bad.append("future")
    return bad


def _ag_base(out, t, g):
    f = getattr(dist, "all_gather_into_tensor", None) or dist._all_gather_base
    return f(out, t, group=g)


def _rs_base(out, t, g):
    f = getattr(dist, "reduce_scatter_tensor", None) or dist._reduce_scatter_base
    return f(out, t, group=g)


def _sendrecv(rank, t, g):
    peer = 1 - rank
    out = torch.zeros_like(t)
    if rank == 0:
        dist.send(t, peer, group=g)
        dist.recv(out, peer, group=g)
    else:
        dist.recv(out, peer, group=g)
        dist.send(t, peer, group=g)
    return [out]


def _batch(rank, size, t, g):
    """Every rank sends 4 MiB to each other rank and receives as much, the
    ops posted in the same order everywhere (sends first): held and issued
    as one batch, they do not wait for one another."""
    outs = [torch.zeros_like(t) for _ in range(size)]
    ops = []
    for p in range(size):
        if p != rank:
            ops.append(dist.P2POp(dist.isend, t, p, group=g))
    for p in range(size):
        if p != rank:
            ops.append(dist.P2POp(dist.irecv, outs[p], p, group=g))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    outs[rank] = t
    return outs


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    out = []
    for y in x:
        out.extend(_flat(y))
    return out


# ---- PREMUL_SUM made by torch ----

# torch >= 2.0's ReduceOp pickles as (RedOpType, factor); 1.13's does not.
TORCH_OPS_PICKLE = isinstance(dist.ReduceOp(dist.ReduceOp.RedOpType.SUM).__getstate__(), tuple)


class StateOp:
    """An op that pickles as torch >= 2.0's PREMUL_SUM does, whose == and
    hash say nothing about it (torch's see only the type): what a group
    must decode on torch 1.13, where a real one hides its factor."""

    def __init__(self, factor, kind=None):
        self._state = (kind if kind is not None else dist.ReduceOp.RedOpType.PREMUL_SUM, factor)

    def __getstate__(self):
        return self._state

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


def premul_op(factor):
    """torch's PREMUL_SUM of factor where torch shows its factor, else a
    StateOp (torch 1.13)."""
    if not TORCH_OPS_PICKLE:
        return StateOp(factor)
    make = getattr(dist, "_make_nccl_premul_sum", None)
    return make(factor) if make is not None else dist.ReduceOp.PREMUL_SUM(factor)


class Opts:
    """torch's options of a reduction, as a ProcessGroup reads them."""

    def __init__(self, op, root=0):
        self.reduceOp, self.rootRank = op, root


def premul(rank):
    """A PREMUL_SUM built by torch on every reduction of the group, called
    as torch calls a ProcessGroup (its methods with options) and, on torch
    >= 2.0, through torch.distributed: each result is the sum over ranks of
    the rank's input times the factor, inputs that are only read are left
    as they were. Integer-valued data and factors that are powers of two:
    exact in every dtype. Returns what differs."""
    pg = dist.distributed_c10d._get_default_group()
    size = dist.get_world_size()
    n = 6 * size
    bad = []

    def check(what, got, want):
        if not torch.equal(got, want):
            bad.append("%s: %s != %s" % (what, got.tolist(), want.tolist()))

    def done(w):
        if w is not None:
            w.wait()

    # Numbers, and tensors of the data's dtype ([1] and 0-d), which is what
    # torch's NCCL takes (premul_factor_dtype_refused: any other dtype).
    for fv, shape in ((2.0, None), (0.5, None), (0.25, (1,)), (0.5, ())):
        for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            f = fv if shape is None else torch.full(shape, fv, dtype=dt)
            name = "%s %s" % (dt, "tensor %s" % fv if isinstance(f, torch.Tensor) else fv)
            op = premul_op(f)
            mine = lambda k=n: _vals(rank, k, dt)  # noqa: E731
            want = lambda k=n: sum(_vals(r, k, torch.float64) * fv for r in range(size)).to(dt)  # noqa: E731
            t = mine()
            done(pg.allreduce([t], Opts(op)))
            check("allreduce " + name, t, want())
            ts = [mine(3), mine(5)]
            done(pg.allreduce(ts, Opts(op)))
            check("allreduce of 2 tensors " + name, torch.cat(ts), torch.cat([want(3), want(5)]))
            # Two dtypes in one call take a number (a tensor factor has one dtype).
            other = torch.float32 if shape is None else dt
            ts = [mine(3), mine(4).to(other)]
            done(pg.allreduce_coalesced(ts, Opts(op)))
            check("allreduce_coalesced " + name, torch.cat([ts[0].double(), ts[1].double()]),
                  torch.cat([want(3).double(), want(4).to(other).double()]))
            for root in range(size):
                t = mine()
                done(pg.reduce([t], Opts(op, root)))
                check("reduce to %d %s" % (root, name), t, want() if rank == root else mine())
            ins, out = list(mine().chunk(size)), torch.zeros(n // size, dtype=dt)
            done(pg.reduce_scatter([out], [ins], Opts(op)))
            check("reduce_scatter " + name, out, want().chunk(size)[rank])
            check("reduce_scatter input " + name, torch.cat(ins), mine())
            inp, out = mine(), torch.zeros(n // size, dtype=dt)
            done(pg._reduce_scatter_base(out, inp, Opts(op)))
            check("_reduce_scatter_base " + name, out, want().chunk(size)[rank])
            check("_reduce_scatter_base input " + name, inp, mine())
            ins, outs = [mine(), mine(2 * size)], [torch.zeros(n // size, dtype=dt), torch.zeros(2, dtype=dt)]
            done(pg.reduce_scatter_tensor_coalesced(outs, ins, Opts(op)))
            check("reduce_scatter_tensor_coalesced " + name, torch.cat(outs),
                  torch.cat([want().chunk(size)[rank], want(2 * size).chunk(size)[rank]]))
            if not TORCH_OPS_PICKLE:
                continue
            # torch.distributed's own calls, with torch's op.
            t = mine()
            dist.all_reduce(t, op=op)
            check("dist.all_reduce " + name, t, want())
            t = mine()
            done(dist.all_reduce(t, op=op, async_op=True))
            check("dist.all_reduce async " + name, t, want())
            t = mine()
            dist.reduce(t, 1, op=op)
            check("dist.reduce " + name, t, want() if rank == 1 else mine())
            out = torch.zeros(n // size, dtype=dt)
            dist.reduce_scatter(out, list(mine().chunk(size)), op=op)
            check("dist.reduce_scatter " + name, out, want().chunk(size)[rank])
            out = torch.zeros(n // size, dtype=dt)
            dist.reduce_scatter_tensor(out, mine(), op=op)
            check("dist.reduce_scatter_tensor " + name, out, want().chunk(size)[rank])
    return bad


def premul_factor_dtype_refused(rank):
    """A PREMUL_SUM whose tensor factor is of another dtype than the data's
    (or not one element), on every reduction of the group: refused on every
    rank before anything is issued, as torch's NCCL refuses it, with an
    InvalidArgumentError that is torch's distributed error and names both
    dtypes; the tensors untouched and the group usable after. Returns what
    was not so."""
    pg = dist.distributed_c10d._get_default_group()
    size = dist.get_world_size()
    n = 2 * size
    bad = []
    bf, f32, f64 = torch.bfloat16, torch.float32, torch.float64

    def refused(what, call, tensors, want_in_msg):
        before = [t.clone() for t in tensors]
        try:
            w = call()
            if w is not None and hasattr(w, "wait"):
                w.wait()
            bad.append("%s: not refused" % what)
            return
        except Exception as e:  # noqa: B902
            if not (isinstance(e, ftcomm.distributed.DistBackendError) and isinstance(e, ftcomm.InvalidArgumentError)):
                bad.append("%s: %s: %s" % (what, type(e).__name__, e))
            elif any(m not in str(e) for m in want_in_msg):
                bad.append("%s: message %r does not name %s" % (what, str(e), want_in_msg))
        for t, b in zip(tensors, before):
            if not torch.equal(t, b):
                bad.append("%s: a tensor changed" % what)

    for fdt, dt in ((f32, bf), (f64, f32), (bf, torch.float16), (f32, f64)):
        op = premul_op(torch.tensor([0.5], dtype=fdt))
        names = ["a %s tensor for %s data" % (str(fdt)[6:], str(dt)[6:])]
        name = "factor %s, data %s" % (fdt, dt)
        t = _vals(rank, n).to(dt)
        refused("allreduce " + name, lambda: pg.allreduce([t], Opts(op)), [t], names)
        refused("reduce " + name, lambda: pg.reduce([t], Opts(op, 1)), [t], names)
        out, ins = torch.zeros(2, dtype=dt), list(t.chunk(size))
        refused("reduce_scatter " + name, lambda: pg.reduce_scatter([out], [ins], Opts(op)), [out, t], names)
        refused("_reduce_scatter_base " + name, lambda: pg._reduce_scatter_base(out, t, Opts(op)), [out, t], names)
        # The factor's own dtype first, then another: nothing is issued at all.
        a = _vals(rank, n).to(fdt)
        refused("allreduce_coalesced " + name, lambda: pg.allreduce_coalesced([a, t], Opts(op)), [a, t], names)
        oa = torch.zeros(2, dtype=fdt)
        refused("reduce_scatter_tensor_coalesced " + name,
                lambda: pg.reduce_scatter_tensor_coalesced([oa, out], [a, t], Opts(op)), [oa, out, a, t], names)
        if TORCH_OPS_PICKLE:
            refused("dist.all_reduce " + name, lambda: dist.all_reduce(t, op=op), [t], names)
            refused("dist.reduce_scatter_tensor " + name, lambda: dist.reduce_scatter_tensor(out, t, op=op),
                    [out, t], names)
    try:
        op = premul_op(torch.tensor([0.5, 0.5]))
    except Exception:  # noqa: B902 - a torch that refuses to make such an op itself
        op = None
    if op is not None:
        t = _vals(rank, n)
        refused("allreduce, a factor of 2 elements", lambda: pg.allreduce([t], Opts(op)), [t], ["2 elements"])
    t = _vals(rank, 4)
    dist.all_reduce(t)
    if not torch.equal(t, sum(_vals(r, 4) for r in range(size))):
        bad.append("SUM after the refusals: %s" % t.tolist())
    return bad


def premul_refused(rank):
    """A PREMUL_SUM built by torch 1.13 (whose factor cannot be read): the
    error every rank gets, and a SUM on the group after it."""
    t = _vals(rank, 4)
    try:
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        got = {"ok": True}
    except Exception as e:  # noqa: B902
        got = {"ok": False, "dist": isinstance(e, ftcomm.distributed.DistBackendError),
               "invalid": isinstance(e, ftcomm.InvalidArgumentError), "msg": str(e)}
    got["untouched"] = torch.equal(t, _vals(rank, 4))
    dist.all_reduce(t)
    got["sum_after"] = torch.equal(t, sum(_vals(r, 4) for r in range(dist.get_world_size())))
    return got


# ---- DDP ----

def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def ddp_grads(rank, steps=3, bucket_mb=0.001):
    """DDP on the ftcomm group and on torch's gloo group, the same seed and
    batches: the gradients and parameters after each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = {}
    for which, g in (("ftcomm", None), ("gloo", STATE["gloo"])):
        torch.manual_seed(0)
        m = _model()
        with torch.no_grad():  # ranks start apart: DDP's broadcast must align them
            for p in m.parameters():
                p.add_(rank * 0.5)
        ddp = DDP(m, process_group=g, bucket_cap_mb=bucket_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        grads = []
        for _ in range(steps):
            x = torch.randn(5, 8, generator=gen)
            loss = ddp(x).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            grads.append([p.grad.clone() for p in ddp.parameters()])
            opt.step()
        out[which] = (grads, [p.detach().clone() for p in ddp.parameters()])
    diff = 0.0
    for (ga, pa), (gb, pb) in [(out["ftcomm"], out["gloo"])]:
        for sa, sb in zip(ga, gb):
            for a, b in zip(sa, sb):
                diff = max(diff, (a - b).abs().max().item())
        for a, b in zip(pa, pb):
            diff = max(diff, (a - b).abs().max().item())
    return diff


def ddp_comm_hook(rank):
    """DDP with a comm hook that chains on the group's futures."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    ddp = DDP(_model(), bucket_cap_mb=0.001)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    gen = torch.Generator().manual_seed(100 + rank)
    ddp(torch.randn(5, 8, generator=gen)).sum().backward()
    g = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
    other = g.clone()
    dist.all_reduce(other, dist.ReduceOp.MAX)
    return (other - g).abs().max().item()


# ---- failures ----

def blocked_all_reduce(rank, addr, key):
    """Enter an all-reduce that a dead peer never joins (key is set in the
    test's store first): the error and how long it took."""
    t = torch.ones(1 << 16)
    s = ftcomm.Store.connect(addr)
    s.set(key, "1")
    s.close()
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        return {"ok": True}
    except Exception as e:  # noqa: B902
        return {"ok": False, "type": type(e).__name__, "dist": isinstance(e, ftcomm.distributed.DistBackendError),
                "peer_failed": isinstance(e, ftcomm.PeerFailedError), "ranks": list(getattr(e, "ranks", ())),
                "msg": str(e), "took": time.monotonic() - t0}


def refused(rank):
    """One rank's call is refused (a bad argument there), the other's is
    valid: for each step, what each rank's call raised, and the sum of an
    all-reduce right after (the group goes on)."""
    size = dist.get_world_size()
    out = []

    def outcome(f):
        t0 = time.monotonic()
        try:
            f()
            return {"kind": "ok"}
        except ftcomm.PeerRefusedError as e:
            return {"kind": "PeerRefusedError", "rank": e.rank, "ranks": list(e.ranks), "reason": e.reason,
                    "dist": isinstance(e, ftcomm.distributed.DistBackendError), "took": time.monotonic() - t0}
        except ftcomm.InvalidArgumentError as e:
            return {"kind": "InvalidArgumentError", "msg": str(e), "took": time.monotonic() - t0}

    t = lambda v=1.0: torch.full((4,), float(v))  # noqa: E731
    steps = [
        ("broadcast from a rank outside the group", 1,
         lambda: dist.broadcast(t(), src=size + 3 if rank == 1 else 0)),
        ("all_reduce with a bitwise op on floats", 0,
         lambda: dist.all_reduce(t(), op=dist.ReduceOp.BAND if rank == 0 else dist.ReduceOp.SUM)),
        ("all_gather into a list of the wrong length", 1,
         lambda: dist.all_gather([t() for _ in range(size + (1 if rank == 1 else 0))], t())),
        ("send to a rank outside the group", 0,
         lambda: dist.send(t(), size + 1) if rank == 0 else dist.recv(t(0), 0)),
    ]
    for what, culprit, call in steps:
        res = outcome(call)
        y = torch.full((8,), float(rank + 1))
        dist.all_reduce(y)
        out.append({"step": what, "culprit": culprit, "res": res, "after": float(y[0])})
    return out
