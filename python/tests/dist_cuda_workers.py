"""Functions the rank processes of test_cuda_distributed.py run: the
"ftcomm" torch.distributed backend on CUDA tensors against torch's own NCCL
backend (DDP, FSDP, FSDP2, DeviceMesh, DTensor). Rank r uses cuda:r."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import ftcomm
import ftcomm.distributed

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
    mesh = fdm.init_device_mesh(mesh_dim_comms=(comm,), mesh_dim_names=("dp",))
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


def finalize_fsdp2(rank):
    c = STATE.pop("fsdp2_comm", None)
    if c is not None:
        torch.cuda.synchronize()
        c.finalize()
    return True
