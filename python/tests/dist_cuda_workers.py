"""Functions the rank processes of test_cuda_distributed.py run: the
"ftcomm" torch.distributed backend on CUDA tensors against torch's own NCCL
backend (DDP, FSDP, FSDP2, DeviceMesh, DTensor, PREMUL_SUM made by torch and
FSDP2's gradient divide factor). Rank r uses cuda:r."""

from __future__ import annotations

import contextlib
import datetime
import math
import os

import torch
import torch.distributed as dist

import ftcomm
import ftcomm.distributed
from ftcomm import _dist_reduce_ops

STATE: dict = {}


def init(rank, path, size=2, timeout=60):
    torch.cuda.set_device(rank)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = dist.FileStore(path, size)
    dist.init_process_group("ftcomm", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout))
    STATE["nccl"] = dist.new_group(backend="nccl")
    return dist.get_backend(), torch.__version__


def shutdown(rank):
    if dist.is_initialized():
        pg = dist.distributed_c10d._get_default_group()
        dist.destroy_process_group()
        if isinstance(pg, ftcomm.distributed.ProcessGroupFtcomm):
            pg.shutdown()
    STATE.clear()
    return True


def _vals(rank, n, dtype=torch.float32):
    return (torch.arange(n, dtype=torch.float64, device="cuda") * 3 + rank + 1).remainder(7).add(1).to(dtype)


def ops(rank):
    """The ops DDP, FSDP and DTensor call, on ftcomm and on torch's NCCL;
    names of those that differ."""
    size = dist.get_world_size()
    nccl = STATE["nccl"]
    bad = []

    def both(name, fn, make):
        a, b = make(), make()
        ra, rb = fn(a, None), fn(b, nccl)
        torch.cuda.synchronize()
        xa = ra if ra is not None else a
        xb = rb if rb is not None else b
        for x, y in zip(xa if isinstance(xa, (list, tuple)) else [xa], xb if isinstance(xb, (list, tuple)) else [xb]):
            if not torch.equal(x, y):
                bad.append(name)
                return

    n = 1 << 12
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for op in ("SUM", "MAX", "MIN", "AVG") if dt.is_floating_point else ("SUM", "MAX", "MIN"):
            both("all_reduce %s %s" % (dt, op), lambda t, g: dist.all_reduce(t, getattr(dist.ReduceOp, op), group=g),
                 lambda: _vals(rank, n, dt))
    both("all_reduce async", lambda t, g: dist.all_reduce(t, group=g, async_op=True).wait() and None,
         lambda: _vals(rank, n))
    both("broadcast", lambda t, g: dist.broadcast(t, 1, group=g), lambda: _vals(rank, n))
    both("all_gather_into_tensor", lambda t, g: (lambda o: (dist.all_gather_into_tensor(o, t, group=g), o)[1])(
        torch.zeros(size * n, device="cuda")), lambda: _vals(rank, n))
    both("all_gather", lambda t, g: (lambda o: (dist.all_gather(o, t, group=g), o)[1])(
        [torch.zeros(n, device="cuda") for _ in range(size)]), lambda: _vals(rank, n))
    both("reduce_scatter_tensor", lambda t, g: (lambda o: (dist.reduce_scatter_tensor(o, t, group=g), o)[1])(
        torch.zeros(n // size, device="cuda")), lambda: _vals(rank, n))
    both("all_to_all_single", lambda t, g: (lambda o: (dist.all_to_all_single(o, t, group=g), o)[1])(
        torch.zeros(n, device="cuda")), lambda: _vals(rank, n))

    def sendrecv(t, g):
        out = torch.zeros_like(t)
        ops_ = [dist.P2POp(dist.isend, t, 1 - rank, group=g), dist.P2POp(dist.irecv, out, 1 - rank, group=g)]
        for w in dist.batch_isend_irecv(ops_):
            w.wait()
        return out

    both("batch_isend_irecv", sendrecv, lambda: _vals(rank, n))
    dist.barrier()
    return bad


def stream_order(rank):
    """torch's NCCL order: an async op issued behind work on the current
    stream sees that work's result; wait() makes the current stream wait
    (the host does not); the Work's future is ready on the op's stream."""
    t = torch.zeros(1 << 20, device="cuda")
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        a = a @ a / 2048
    t.fill_(rank + 1.0)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    t.mul_(2)  # queued after the all-reduce on the current stream
    fut = w.get_future()
    want = 2.0 * sum(range(1, dist.get_world_size() + 1))
    ok_value = float(t[0].item()) == want
    # A sync op (torch >= 2.7 passes asyncOp=False) is ordered with the
    # current stream itself, as torch's NCCL backend orders it: behind the
    # work queued there, and ahead of what is queued next, on a side stream
    # as on the default one; a non-contiguous tensor is copied back in
    # that order too.
    for _ in range(20):
        a = a @ a / 2048
    v = torch.zeros(1 << 12, 4, device="cuda")[:, 1]
    v.fill_(rank + 1.0)
    dist.all_reduce(v)
    v.mul_(2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(20):
            a = a @ a / 2048
        u = torch.full((1 << 20,), rank + 1.0, device="cuda")
        dist.all_reduce(u)
        u.mul_(2)
    torch.cuda.current_stream().wait_stream(side)
    ok_sync = float(v.sum().item()) == want * v.numel() and float(u.sum().item()) == want * u.numel()
    return ok_value and fut.wait()[0].is_cuda and ok_sync


def _model(device="cuda"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 16)).to(device)


def ddp(rank, steps=3):
    """DDP over ftcomm and over torch's NCCL: gradients and parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    res = {}
    for which, g in (("ftcomm", None), ("nccl", STATE["nccl"])):
        m = DDP(_model(), device_ids=[rank], process_group=g, bucket_cap_mb=0.01)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            x = torch.randn(8, 64, generator=gen).cuda()
            opt.zero_grad()
            m(x).pow(2).sum().backward()
            opt.step()
        res[which] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    return (res["ftcomm"] - res["nccl"]).abs().max().item()


def fsdp1(rank, steps=3):
    """FSDP (1) over ftcomm and over torch's NCCL: the same losses."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    res = {}
    for which, g in (("ftcomm", dist.distributed_c10d._get_default_group()), ("nccl", STATE["nccl"])):
        m = FSDP(_model(), process_group=g, device_id=rank)
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(steps):
            loss = m(torch.randn(8, 64, generator=gen).cuda()).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        res[which] = losses
    return max(abs(a - b) for a, b in zip(res["ftcomm"], res["nccl"]))


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def fsdp2_device_mesh(rank, addr, steps=3):
    """FSDP2 over ftcomm.device_mesh (a mesh from an ftcomm NCCL comm) and
    over a mesh of torch's NCCL group: the same losses; then a DTensor
    resharded across the ftcomm mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    import ftcomm.device_mesh as fdm
    fully_shard = _fully_shard()
    comm = ftcomm.new_comm("nccl", torch.device("cuda", rank), name="fsdp2", store=addr, rank=rank, size=2)
    STATE["fsdp2_comm"] = comm
    mesh = _mesh_of(comm)
    ref_mesh = DeviceMesh.from_group(STATE["nccl"], "cuda")
    res = {}
    for which, m_ in (("ftcomm", mesh), ("nccl", ref_mesh)):
        m = _model()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=m_)
        fully_shard(m, mesh=m_)
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(steps):
            loss = m(torch.randn(8, 64, generator=gen).cuda()).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        res[which] = losses
    loss_diff = max(abs(a - b) for a, b in zip(res["ftcomm"], res["nccl"]))
    # DTensor over the ftcomm mesh: shard, then replicate.
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor
    torch.manual_seed(5)
    full = torch.randn(16, 8, device="cuda")
    dt = distribute_tensor(full, mesh, [Shard(0)])
    back = dt.redistribute(mesh, [Replicate()]).to_local()
    summed = (dt * 2).full_tensor()
    dtensor_ok = torch.equal(back, full) and torch.equal(summed, full * 2)
    torch.cuda.synchronize()
    return loss_diff, dtensor_ok


# ---- PREMUL_SUM made by torch, FSDP2's gradient divide factor ----

def _premul(factor):
    """torch's PREMUL_SUM of factor (a float, or a one-element tensor)."""
    make = getattr(dist, "_make_nccl_premul_sum", None)
    return make(factor) if make is not None else dist.ReduceOp.PREMUL_SUM(factor)


def premul_ops(rank):
    """A PREMUL_SUM built by torch on every reduction, on ftcomm and on
    torch's NCCL: all-reduce (sync, async, coalesced, through the coalescing
    manager), reduce to each root, reduce-scatter of a list, of a tensor
    (sync, async) and coalesced; float32, bfloat16, float16, float64;
    scalar factors and tensor factors (of the data's dtype on its device,
    as torch's NCCL takes them, 0-d and [1]).

    Integer-valued inputs. With factors that are powers of two every
    product is exact, so ftcomm's results must equal NCCL's bit for bit
    (``bad`` names those that do not). With 1/3 the products round, and
    ftcomm's result must equal, bit for bit, what NCCL's PreMulSum computes
    on 2 ranks: each rank's input times the factor in the dtype, rounded,
    then the sum rounded. NCCL's own result may differ from that by one
    rounding of a product where its kernel fuses the multiply into the sum
    (one fma); ``near`` names the results that differ from NCCL's, and
    ``bad`` those that differ by more than 1 ulp. A tensor factor is read
    on the device: the calls run in torch's sync debug mode "error". A
    tensor factor of another dtype than the data's is refused.

    bfloat16 on a torch whose NCCL misreads a bfloat16 PREMUL_SUM's factor
    (torch <= 2.11: it hands NCCL 2 bytes of a float32, 0 for a power of
    two; its tensor factor must be float32: pytorch/pytorch#190745; see
    stream_stress.nccl_bf16_premul_ok): the reference is what NCCL's
    PreMulSum kernel computes, run on torch's NCCL — each input multiplied
    by the factor's bfloat16 value in bfloat16 (NCCL's __hmul2: the exact
    product rounded once), then a SUM — and ``notes`` says so.

    Returns (bad, near, notes)."""
    from stream_stress import nccl_bf16_premul_ok
    size = dist.get_world_size()
    nccl = STATE["nccl"]
    bad, near, notes = [], [], []
    n = 96 * size
    dev = torch.device("cuda", rank)
    third = 1 / 3
    warm = torch.ones(4, device=dev)
    dist.all_reduce(warm)  # the group's NCCL comm is made outside the sync checks
    cm = getattr(dist, "_coalescing_manager", None)
    bf16_ok = nccl_bf16_premul_ok(nccl, dev)
    if not bf16_ok:
        notes.append("torch %s's NCCL misreads a bfloat16 PREMUL_SUM's factor (pytorch/pytorch#190745): bfloat16 "
                     "checked against NCCL's PreMulSum arithmetic on torch's NCCL (inputs x factor in bfloat16, "
                     "then SUM)" % torch.__version__)

    def vals(r, k, dt):
        return _vals(r, k, torch.float64).to(dt)

    def want(dt, fT, k):
        # NCCL's PreMulSum on 2 ranks: products rounded to dt, their sum rounded once.
        parts = [(vals(r, k, dt) * fT).to(dt) for r in range(size)]
        return sum(p.double() for p in parts).to(dt)

    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        fdt = torch.float64 if dt == torch.float64 else torch.float32
        factors = [
            ("2.0", 2.0, True),
            ("tensor 0.25", torch.full((1,), 0.25, dtype=dt, device=dev), True),
            ("1/3", third, False),
            ("tensor 1/3", torch.tensor(third, dtype=dt, device=dev), False),
        ]
        by_hand = dt == torch.bfloat16 and not bf16_ok
        for fname, f, exact in factors:
            fT = f.reshape(()) if isinstance(f, torch.Tensor) else torch.tensor(f, dtype=fdt, device=dev).to(dt)
            op = _premul(f)
            name = "%s %s" % (dt, fname)

            def both(what, fn, make, expect=None, sync_check=False, root=None):
                """fn(tensors, group, op) on ftcomm (group None) and on
                torch's NCCL; root: a reduce's, whose other ranks' tensors
                are only read."""
                a, b = make(), make()
                try:
                    if sync_check:
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        ra = fn(a, None, op)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                except RuntimeError as e:
                    bad.append("%s %s: %s" % (what, name, e))
                    return
                try:
                    if by_hand:
                        b = [x * fT for x in b] if isinstance(b, list) else b * fT
                        rb = fn(b, nccl, dist.ReduceOp.SUM)
                    else:
                        rb = fn(b, nccl, op)
                except RuntimeError as e:  # torch's NCCL refused the op (on every rank): no reference
                    bad.append("%s %s: torch's NCCL raised %s" % (what, name, e))
                    return
                torch.cuda.synchronize()
                xs = ra if ra is not None else a
                ys = rb if rb is not None else b
                xs = xs if isinstance(xs, (list, tuple)) else [xs]
                ys = ys if isinstance(ys, (list, tuple)) else [ys]
                es = expect() if expect is not None else [None] * len(xs)
                for x, y, e in zip(xs, ys, es):
                    if e is not None and not torch.equal(x, e):
                        bad.append("%s %s: not NCCL's PreMulSum formula" % (what, name))
                        return
                    if by_hand and root is not None and rank != root:
                        continue  # the reference read a multiplied copy; x is checked against e
                    if torch.equal(x, y):
                        continue
                    d = (x.double() - y.double()).abs()
                    ulp = torch.finfo(dt).eps * y.double().abs()
                    if exact or by_hand or not bool((d <= ulp).all()):
                        bad.append("%s %s: max diff %g" % (what, name, d.max().item()))
                        return
                    near.append("%s %s" % (what, name))
                    return

            mine = lambda k=n: vals(rank, k, dt)  # noqa: E731
            full = lambda k=n: want(dt, fT, k)  # noqa: E731
            block = lambda k=n: full(k).chunk(size)[rank]  # noqa: E731
            both("all_reduce", lambda t, g, o: dist.all_reduce(t, op=o, group=g), mine, lambda: [full()], True)
            both("all_reduce async", lambda t, g, o: dist.all_reduce(t, op=o, group=g, async_op=True).wait() and None,
                 mine, lambda: [full()], True)
            for root in range(size):
                both("reduce to %d" % root, lambda t, g, o: dist.reduce(t, root, op=o, group=g), mine,
                     lambda: [full() if rank == root else mine()], root=root)
            both("reduce_scatter",
                 lambda t, g, o: (lambda out: (dist.reduce_scatter(out, list(t.chunk(size)), op=o, group=g),
                                               out)[1])(torch.zeros(n // size, dtype=dt, device=dev)),
                 mine, lambda: [block()])
            both("reduce_scatter_tensor",
                 lambda t, g, o: (lambda out: (dist.reduce_scatter_tensor(out, t, op=o, group=g),
                                               out)[1])(torch.zeros(n // size, dtype=dt, device=dev)),
                 mine, lambda: [block()], True)
            both("reduce_scatter_tensor async",
                 lambda t, g, o: (lambda out: (dist.reduce_scatter_tensor(out, t, op=o, group=g, async_op=True).wait(),
                                               out)[1])(torch.zeros(n // size, dtype=dt, device=dev)),
                 mine, lambda: [block()], True)
            if hasattr(dist, "all_reduce_coalesced"):
                both("all_reduce_coalesced", lambda ts, g, o: (dist.all_reduce_coalesced(ts, op=o, group=g), ts)[1],
                     lambda: [mine(), mine(2 * size)], lambda: [full(), full(2 * size)])
            if cm is not None:
                def coalesced_all_reduce(ts, g, o):
                    with cm(group=g, async_ops=True) as c:
                        for t in ts:
                            dist.all_reduce(t, op=o, group=g)
                    c.wait()
                    return ts

                def coalesced_reduce_scatter(ts, g, o):
                    outs = [torch.zeros(t.numel() // size, dtype=dt, device=dev) for t in ts]
                    with cm(group=g, async_ops=True) as c:
                        for out, t in zip(outs, ts):
                            dist.reduce_scatter_tensor(out, t, op=o, group=g)
                    c.wait()
                    return outs

                both("coalesced all_reduce", coalesced_all_reduce, lambda: [mine(), mine(2 * size)],
                     lambda: [full(), full(2 * size)])
                both("coalesced reduce_scatter_tensor", coalesced_reduce_scatter, lambda: [mine(), mine(2 * size)],
                     lambda: [block(), block(2 * size)])
    # A tensor factor of another dtype than the data's (what torch <= 2.11's
    # NCCL asks for bfloat16 data) is refused, never converted silently.
    for fdt, dt in ((torch.float32, torch.bfloat16), (torch.float64, torch.float32)):
        t = vals(rank, n, dt)
        try:
            dist.all_reduce(t, op=_premul(torch.full((1,), 0.5, dtype=fdt, device=dev)))
            bad.append("a %s factor for %s data: not refused" % (fdt, dt))
        except Exception as e:  # noqa: B902
            if not isinstance(e, ftcomm.InvalidArgumentError) or "for %s data" % str(dt)[6:] not in str(e):
                bad.append("a %s factor for %s data: %s: %s" % (fdt, dt, type(e).__name__, e))
        if not torch.equal(t, vals(rank, n, dt)):
            bad.append("a %s factor for %s data: the tensor changed" % (fdt, dt))
    dist.barrier()
    return bad, near, notes


def _fsdp2_api():
    """fully_shard, MixedPrecisionPolicy (None where this torch has none)."""
    fully_shard = _fully_shard()
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy
        except ImportError:
            MixedPrecisionPolicy = None
    return fully_shard, MixedPrecisionPolicy


@contextlib.contextmanager
def _bf16_premul_by_hand(group, calls: list):
    """While inside, torch.distributed.reduce_scatter_tensor on group with
    a bfloat16 PREMUL_SUM (FSDP2's reduce-scatter with reduce_dtype
    bfloat16 and a divide factor) runs as NCCL's PreMulSum kernel computes
    it: the input multiplied by the factor's bfloat16 value in bfloat16
    (__hmul2: the exact product rounded once), then a SUM on torch's NCCL.
    For a torch whose NCCL misreads that factor (pytorch/pytorch#190745).
    Each such call's factor is appended to calls, so a reference that never
    went through here is seen."""
    orig = dist.reduce_scatter_tensor

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
        st = _dist_reduce_ops.op_state(op)
        if group is not want_group or input.dtype != torch.bfloat16 or st is None or \
                _dist_reduce_ops.type_name(st[0]) != "PREMUL_SUM":
            return orig(output, input, op=op, group=group, async_op=async_op)
        f = st[1]
        if isinstance(f, torch.Tensor):
            fT = f.reshape(()).to(device=input.device, dtype=torch.bfloat16)
        else:
            fT = torch.tensor(float(f), dtype=torch.float32).to(torch.bfloat16).to(input.device)
        calls.append(float(fT))
        return orig(output, input * fT, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

    want_group = group
    dist.reduce_scatter_tensor = reduce_scatter_tensor
    try:
        yield
    finally:
        dist.reduce_scatter_tensor = orig


def fsdp2_divide_factor(rank, addr):
    """FSDP2 over ftcomm.device_mesh and over a mesh of torch's NCCL group,
    the same model and batches, with set_gradient_divide_factor(f) on every
    FSDP module (FSDP2 reduce-scatters with PREMUL_SUM(1/f), or AVG where f
    is the world size; on any backend: FSDP2 does not look at it) for
    several f, in float32 and with bfloat16 reduction, and with
    set_force_sum_reduction_for_comms(True) (SUM, then a division): every
    local gradient shard after backward.

    Returns {case: {"ref": what the reference is, "params": [(max |ftcomm -
    ref|, tolerance, max |ftcomm|, max |ref|) per parameter]}} (a tolerance
    of 0 asks bit for bit), or {case: "skipped: why"}, or {case: "error:
    why"}. Where 1/f is a power of two, or every op is a SUM, each product
    is exact and both must agree bit for bit. With f = 3 the products
    round; ftcomm rounds each product, then the sum, while NCCL's kernel
    may fuse its multiply into the sum (one fma), which moves a result by
    at most half an ulp of one rank's product plus the sum's own rounding:
    under 4 eps of the largest product. The tolerance is 8 eps(reduce
    dtype) B / f per parameter, B the largest |local gradient| of any rank
    (measured on an unsharded copy of the model, hence the margin of 2).

    bfloat16 reduction on a torch whose NCCL misreads a bfloat16 PREMUL_SUM's
    factor (torch <= 2.11: 0 for 1/4, -3.0e-13 for 1/3, so its gradients
    are zeros or near it; pytorch/pytorch#190745): the reference is FSDP2
    over torch's NCCL with its reduce-scatter run as NCCL's PreMulSum
    computes it (_bf16_premul_by_hand), and the tolerance is 0: ftcomm does
    that same arithmetic (each rank's bfloat16 gradient times the same
    bfloat16 factor, the exact product rounded once, then NCCL's SUM of 2
    ranks, one rounding of a commutative sum)."""
    from torch.distributed.device_mesh import DeviceMesh
    from stream_stress import nccl_bf16_premul_ok
    import ftcomm.device_mesh as fdm
    fully_shard, MixedPrecisionPolicy = _fsdp2_api()
    size = dist.get_world_size()
    dev = torch.device("cuda", rank)
    comm = ftcomm.new_comm("nccl", dev, name="fsdp2-premul", store=addr, rank=rank, size=size)
    STATE["fsdp2_comm"] = comm
    mesh = _mesh_of(comm)
    ref_group = STATE["nccl"]
    ref_mesh = DeviceMesh.from_group(ref_group, "cuda")
    bf16_ok = nccl_bf16_premul_ok(ref_group, dev)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 64, generator=gen).cuda()

    # B: the largest |local gradient| of each parameter over the ranks.
    plain = _model()
    plain(x).pow(2).sum().backward()
    bound = torch.stack([p.grad.abs().max() for p in plain.parameters()])
    dist.all_reduce(bound, op=dist.ReduceOp.MAX, group=ref_group)

    cases = [("f=%g" % f, f, False, None) for f in sorted({1.0, 2.0, float(size), 3.0, 4.0})]
    cases += [("f=3 bf16 reduce", 3.0, False, torch.bfloat16), ("f=4 bf16 reduce", 4.0, False, torch.bfloat16),
              ("force sum", None, True, None), ("force sum f=3", 3.0, True, None)]
    out = {}
    for case, f, force, reduce_dtype in cases:
        grads = {}
        # FSDP2 reduce-scatters with PREMUL_SUM(1/f) unless f is the world size (AVG) or every op is a SUM.
        premul = f is not None and not force and f != size
        by_hand = premul and reduce_dtype == torch.bfloat16 and not bf16_ok
        calls: list = []
        for which, m_ in (("ftcomm", mesh), ("nccl", ref_mesh)):
            m = _model()
            kw = {}
            if reduce_dtype is not None:
                if MixedPrecisionPolicy is None:
                    break
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=reduce_dtype, reduce_dtype=reduce_dtype)
            for layer in m:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=m_, **kw)
            fully_shard(m, mesh=m_, **kw)
            mods = [mod for mod in m.modules() if hasattr(mod, "reshard")]  # the FSDP modules
            if f is not None:
                if not hasattr(m, "set_gradient_divide_factor"):
                    break
                for mod in mods:
                    mod.set_gradient_divide_factor(f)
            if force:
                if not hasattr(m, "set_force_sum_reduction_for_comms"):
                    break
                for mod in mods:
                    mod.set_force_sum_reduction_for_comms(True)
            ctx = _bf16_premul_by_hand(ref_group, calls) if which == "nccl" and by_hand else contextlib.nullcontext()
            with ctx:
                m(x).pow(2).sum().backward()
                torch.cuda.synchronize()
            grads[which] = [p.grad.to_local().detach().clone() for p in m.parameters()]
        if len(grads) < 2:
            out[case] = "skipped: this torch's FSDP2 lacks MixedPrecisionPolicy, set_gradient_divide_factor or " \
                        "set_force_sum_reduction_for_comms"
            continue
        if by_hand and not calls:
            out[case] = "error: torch %s's NCCL misreads a bfloat16 PREMUL_SUM's factor, and FSDP2's reduce-scatter " \
                        "did not go through torch.distributed.reduce_scatter_tensor, where the reference computes " \
                        "it by hand: no reference" % torch.__version__
            continue
        if by_hand:
            ref = "FSDP2 over torch's NCCL, its bfloat16 PREMUL_SUM run by hand (torch's NCCL misreads the factor, " \
                  "pytorch/pytorch#190745): %d reduce-scatters by %s" % (len(calls), sorted(set(calls)))
        else:
            ref = "FSDP2 over torch's NCCL"
        exact = force or f is None or (1 / f) == 2.0 ** round(math.log2(1 / f))
        eps = torch.finfo(reduce_dtype or torch.float32).eps
        params = []
        for a, b, bi in zip(grads["ftcomm"], grads["nccl"], bound.tolist()):
            amax = lambda t: t.abs().max().item() if t.numel() else 0.0  # noqa: E731
            params.append(((a - b).abs().max().item() if a.numel() else 0.0,
                           0.0 if exact or by_hand else 8 * eps * bi / f, amax(a), amax(b)))
        out[case] = {"ref": ref, "params": params}
    torch.cuda.synchronize()
    return out


def _mesh_of(comm):
    """ftcomm.device_mesh's mesh over comm (dimension "dp"). Its group
    becomes torch.distributed's WORLD, as torchcomms' init_device_mesh
    makes it: the worker's own default group is kept for finalize_fsdp2 to
    put back, or the tests after this one would run on a finalized comm."""
    import ftcomm.device_mesh as fdm
    STATE.setdefault("world", dist.distributed_c10d.GroupMember.WORLD)
    return fdm.init_device_mesh(mesh_dim_comms=(comm,), mesh_dim_names=("dp",))


def finalize_fsdp2(rank):
    c = STATE.pop("fsdp2_comm", None)
    if c is not None:
        torch.cuda.synchronize()
        if "world" in STATE:
            dist.distributed_c10d.GroupMember.WORLD = STATE.pop("world")
        # The mesh's group, registered under "dp": unregistered, so the
        # next mesh can take the name.
        w = dist.distributed_c10d._world
        for pg in [g for g, n in w.pg_names.items() if n == "dp"]:
            for table in (w.pg_map, w.pg_names, w.pg_group_ranks, w.pg_backend_config, w.pg_to_tag):
                table.pop(pg, None)
            for pgs in w.tags_to_pg.values():
                if pg in pgs:
                    pgs.remove(pg)
        unreg = getattr(dist.distributed_c10d, "_unregister_process_group", None)
        if unreg is not None:
            try:
                unreg("dp")
            except Exception:  # noqa: B902 - a torch that never registered it
                pass
        c.finalize()
    return True
