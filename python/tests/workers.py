"""Functions the rank processes run for the tests (see cluster.py). Each
takes the rank first."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np

import ftcomm
from ftcomm import ReduceOp

STATE: dict = {}

TORCH_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8"]
NUMPY_DTYPES = ["float32", "float64", "float16", "int8", "int32", "int64", "uint8"]
FLOATS = {"float32", "float64", "float16", "bfloat16"}


def comm(rank, store, name, size=2, backend="gloo", device="cpu", **kw):
    c = ftcomm.new_comm(backend, device, name=name, store=store, rank=rank, size=size, timeout=kw.pop("timeout", 30), **kw)
    STATE[name] = c
    return c


def finalize(rank, name):
    c = STATE.pop(name, None)
    if c is not None:
        c.finalize()
    return ftcomm.live_handles()


# ---- reference data ----

def vals(r, n, salt=0):
    """Rank r's input: small positive integers, exact in every dtype."""
    return (np.arange(n) * (3 + salt) + r + 1) % 5 + 1


class Lib:
    """Makes tensors of one library on one device."""

    def __init__(self, kind, device="cpu"):
        self.kind, self.device = kind, device
        if kind == "torch":
            import torch
            self.torch = torch

    def make(self, dtype, values):
        if self.kind == "torch":
            t = self.torch
            return t.tensor(np.asarray(values, dtype=np.float64), dtype=t.float64).to(getattr(t, dtype)).to(self.device)
        return np.asarray(values, dtype=np.float64).astype(dtype)

    def empty(self, dtype, n, fill=0):
        return self.make(dtype, np.full(n, fill))

    def host(self, x):
        if self.kind == "torch":
            return x.detach().to("cpu").double().numpy()
        return x.astype(np.float64)


def reduce_ref(op, parts, dtype):
    a = np.stack(parts).astype(np.float64)
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        f = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}[op]
        return f.reduce(a.astype(np.int64), axis=0).astype(dtype).astype(np.float64)
    if op == ReduceOp.SUM:
        r = a.sum(0)
    elif op == ReduceOp.PRODUCT:
        r = a.prod(0)
    elif op == ReduceOp.MIN:
        r = a.min(0)
    elif op == ReduceOp.MAX:
        r = a.max(0)
    else:
        r = a.sum(0)
        if dtype in FLOATS:
            r = r / len(parts)
        else:  # the sum wraps like the dtype, then divides truncating (ncclAvg)
            r = np.trunc(r.astype(np.int64).astype(dtype).astype(np.float64) / len(parts))
    if dtype in ("int8", "uint8"):  # the reduction wraps like the dtype
        r = r.astype(np.int64).astype(dtype).astype(np.float64)
    return r


def close(got, want, dtype):
    tol = {"float16": 1e-2, "bfloat16": 5e-2}.get(dtype, 1e-6)
    return np.allclose(got, want, rtol=tol, atol=tol)


def suite(rank, store, name, size=2, kinds=("torch", "numpy"), backend="gloo", device="cpu", n=6):
    """Every collective, for each dtype, against a host reference; returns
    the failures."""
    c = comm(rank, store, name, size, backend, device)
    bad = []

    def expect(what, got, want, dtype):
        if not close(got, want, dtype):
            bad.append("%s %s: got %s want %s" % (what, dtype, got.tolist(), np.asarray(want).tolist()))

    for kind in kinds:
        L = Lib(kind, device)
        for dt in (TORCH_DTYPES if kind == "torch" else NUMPY_DTYPES):
            tag = "%s/%s" % (kind, dt)
            ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
            if dt not in FLOATS and backend == "gloo":
                ops += [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
            for op in ops:
                salt = op.type.value
                for async_op in (False, True):
                    x = L.make(dt, vals(rank, n, salt))
                    w = c.all_reduce(x, op, async_op=async_op)
                    if async_op:
                        w.wait()
                    expect("%s all_reduce %s async=%s" % (tag, op.name, async_op), L.host(x),
                           reduce_ref(op, [vals(r, n, salt) for r in range(size)], dt), dt)
            root = size - 1
            x = L.make(dt, vals(rank, n))
            c.reduce(x, root, ReduceOp.MAX)
            want = reduce_ref(ReduceOp.MAX, [vals(r, n) for r in range(size)], dt) if rank == root else vals(rank, n)
            expect(tag + " reduce", L.host(x), want, dt)
            x = L.make(dt, vals(rank, n))
            c.broadcast(x, root)
            expect(tag + " broadcast", L.host(x), vals(root, n), dt)
            x, out = L.make(dt, vals(rank, n)), L.empty(dt, n * size)
            c.all_gather_single(out, x)
            expect(tag + " all_gather_single", L.host(out), np.concatenate([vals(r, n) for r in range(size)]), dt)
            outs = [L.empty(dt, n) for _ in range(size)]
            c.all_gather(outs, x, async_op=True).wait()
            for r in range(size):
                expect(tag + " all_gather[%d]" % r, L.host(outs[r]), vals(r, n), dt)
            big = L.make(dt, vals(rank, n * size))
            out = L.empty(dt, n)
            c.reduce_scatter_single(out, big, ReduceOp.SUM)
            full = reduce_ref(ReduceOp.SUM, [vals(r, n * size) for r in range(size)], dt)
            expect(tag + " reduce_scatter_single", L.host(out), full[rank * n:(rank + 1) * n], dt)
            ins = [L.make(dt, vals(rank, n * size)[k * n:(k + 1) * n]) for k in range(size)]
            out = L.empty(dt, n)
            c.reduce_scatter(out, ins, ReduceOp.SUM)
            expect(tag + " reduce_scatter", L.host(out), full[rank * n:(rank + 1) * n], dt)
            out = L.empty(dt, n * size)
            c.all_to_all_single(out, big)
            want = np.concatenate([vals(r, n * size)[rank * n:(rank + 1) * n] for r in range(size)])
            expect(tag + " all_to_all_single", L.host(out), want, dt)
            if rank == 0:
                c.send(L.make(dt, vals(0, n, 7)), 1)
            elif rank == 1:
                y = L.empty(dt, n)
                c.recv(y, 0)
                expect(tag + " send/recv", L.host(y), vals(0, n, 7), dt)
            out = L.empty(dt, n)
            lst = [L.make(dt, vals(r, n, 9)) for r in range(size)] if rank == 0 else None
            c.scatter(out, lst, 0)
            expect(tag + " scatter", L.host(out), vals(rank, n, 9), dt)
            outs = [L.empty(dt, n) for _ in range(size)] if rank == 0 else None
            c.gather(outs, L.make(dt, vals(rank, n, 4)), 0)
            if rank == 0:
                for r in range(size):
                    expect(tag + " gather[%d]" % r, L.host(outs[r]), vals(r, n, 4), dt)
            c.barrier()
    finalize(rank, name)
    return bad


# ---- helpers for orchestration through the test's store ----

def _store(addr):
    s = STATE.get(("store", addr))
    if s is None:
        s = STATE[("store", addr)] = ftcomm.Store.connect(addr)
    return s


def mark(addr, key, value=b"1"):
    _store(addr).set(key, value)


def wait_mark(addr, key, timeout=60):
    return _store(addr).get(key, timeout=timeout)


# ---- async, timeouts, revoke ----

def async_ops(rank, store, name):
    c = comm(rank, store, name)
    x = np.full(1024, rank + 1, dtype=np.float32)
    ws = [c.all_reduce(x, async_op=True) for _ in range(4)]
    for w in ws:
        assert w.wait() is True and w.is_completed()
    assert x[0] == 3 * 2 ** 3, x[0]
    # A wait that times out leaves the op running; it completes later.
    y = np.ones(8, dtype=np.float64)
    if rank == 1:
        wait_mark(store, name + "/go")
    w = c.all_reduce(y, async_op=True)
    timed_out = False
    if rank == 0:
        try:
            w.wait(timeout=0.2)
        except TimeoutError:
            timed_out = True
        assert not w.is_completed()
        mark(store, name + "/go")
    w.wait()
    assert y[0] == 2
    finalize(rank, name)
    return timed_out


def op_timeout(rank, store, name):
    """Rank 0 all-reduces alone with a 0.5 s deadline: CommTimeoutError,
    promptly, and the comm refuses ops afterwards."""
    c = comm(rank, store, name)
    res = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            c.all_reduce(np.ones(4, dtype=np.float32), timeout=0.5)
        except ftcomm.CommTimeoutError as e:
            res["error"] = type(e).__name__
        res["took"] = time.monotonic() - t0
        mark(store, name + "/done")
    else:
        wait_mark(store, name + "/done")
    try:
        c.all_reduce(np.ones(4, dtype=np.float32), timeout=5)
        res["after"] = "ok"
    except ftcomm.FtcommError as e:
        res["after"] = type(e).__name__
    finalize(rank, name)
    return res


def revoke(rank, store, name):
    c = comm(rank, store, name)
    x = np.ones(16, dtype=np.float32)
    if rank == 1:
        mark(store, name + "/entering")
        try:
            c.all_reduce(x)
            return "completed"
        except ftcomm.RevokedError as e:
            return "revoked: %s" % e
        finally:
            finalize(rank, name)
    wait_mark(store, name + "/entering")
    c.revoke("test")
    try:
        c.all_reduce(x)
        out = "completed"
    except ftcomm.RevokedError:
        out = "revoked"
    finalize(rank, name)
    return out


# ---- a killed peer; shrink and grow ----

def start(rank, store, name, size):
    comm(rank, store, name, size)
    return os.getpid()


def blocked_all_reduce(rank, store, name):
    c = STATE[name]
    mark(store, "%s/entering/%d" % (name, rank))
    x = np.ones(1 << 16, dtype=np.float32)
    try:
        c.all_reduce(x)
        return ("completed",)
    except ftcomm.PeerFailedError as e:
        return ("peer_failed", list(e.ranks), isinstance(e, ftcomm.FtcommError), str(e))


def shrink_and_use(rank, store, name, exclude):
    c = STATE[name].shrink(exclude)
    STATE[name] = c
    x = np.full(4, c.get_rank() + 1, dtype=np.int64)
    c.all_reduce(x)
    return c.get_rank(), c.get_size(), c.get_epoch(), int(x[0]), c.prefix


def grow_and_use(rank, store, name, size):
    c = STATE[name].grow(size)
    STATE[name] = c
    x = np.full(4, c.get_rank() + 1, dtype=np.int64)
    c.all_reduce(x)
    r = (c.get_rank(), c.get_size(), c.get_epoch(), int(x[0]))
    finalize(rank, name)
    return r


def join_and_use(rank, store, name, size, epoch, prefix):
    c = comm(rank, store, name, size, epoch=epoch, prefix=prefix)
    x = np.full(4, c.get_rank() + 1, dtype=np.int64)
    c.all_reduce(x)
    r = (c.get_rank(), c.get_size(), c.get_epoch(), int(x[0]))
    finalize(rank, name)
    return r


def split(rank, store, name):
    c = comm(rank, store, name, 3)
    groups = [[0, 2], [1]]
    mine = next(g for g in groups if rank in g)
    sub = c.split(mine, name=name + "-sub")
    x = np.full(4, rank + 1, dtype=np.int32)
    sub.all_reduce(x)
    y = np.full(4, rank + 1, dtype=np.int32)
    c.all_reduce(y)  # the parent is still usable
    out = (sub.get_rank(), sub.get_size(), int(x[0]), int(y[0]))
    sub.finalize()
    finalize(rank, name)
    return out


# ---- threads, memory, fork, bad input ----

def thread_runs_while_blocked(rank, store, name):
    c = comm(rank, store, name)
    if rank == 1:
        wait_mark(store, name + "/go")
        c.all_reduce(np.ones(4, dtype=np.float32))
        finalize(rank, name)
        return None
    err = []
    t = threading.Thread(target=lambda: err.append(c.all_reduce(np.ones(4, dtype=np.float32))))
    t.start()
    deadline = time.monotonic() + 30
    while ftcomm._lib.blocked_calls() == 0:  # until the thread is inside the library
        assert time.monotonic() < deadline, "the collective never blocked"
        time.sleep(0.001)
    n = 0
    for _ in range(200_000):  # needs the GIL; the blocked thread must not hold it
        n += 1
    alive = t.is_alive()
    mark(store, name + "/go")
    t.join(30)
    finalize(rank, name)
    return n, alive, not t.is_alive()


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(rank, store, name, ops=10_000):
    c = comm(rank, store, name)
    x = np.ones(1024, dtype=np.float32)  # 4 KiB
    import torch
    t = torch.ones(1024)
    for _ in range(2000):
        c.all_reduce(x)
    handles0, rss0 = ftcomm.live_handles(), _rss()
    for i in range(ops):
        if i % 10 == 0:
            c.all_reduce(t, async_op=True).wait()
        else:
            c.all_reduce(x, ReduceOp.MAX)
    rss1, handles1 = _rss(), ftcomm.live_handles()
    finalize(rank, name)
    return rss1 - rss0, handles1 - handles0


def fork_child(rank, store, name):
    c = comm(rank, store, name)
    x = np.ones(4, dtype=np.float32)
    res = {}
    if rank == 0:
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                c.all_reduce(x)
                code = 1
            except ftcomm.ForkError:
                code = 0
            except BaseException:
                code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        res["child"] = os.waitstatus_to_exitcode(status)
        # A DataLoader's forked workers leave the comm alone and work.
        import torch.utils.data as tud
        dl = tud.DataLoader(list(range(64)), batch_size=8, num_workers=2, multiprocessing_context="fork")
        res["batches"] = sum(1 for _ in dl)
    c.all_reduce(x)
    res["after"] = float(x[0])
    finalize(rank, name)
    return res


def bad_input(rank, store, name):
    """Each bad call raises the right error and sends nothing: the comm then
    still runs a collective with its peer."""
    import torch
    c = comm(rank, store, name)
    cases = {
        "non-contiguous": lambda: c.all_reduce(torch.ones(4, 4).t()),
        "meta tensor": lambda: c.all_reduce(torch.ones(4, device="meta")),
        "complex dtype": lambda: c.all_reduce(torch.ones(4, dtype=torch.complex64)),
        "not a tensor": lambda: c.all_reduce([1.0, 2.0]),
        "bitwise on floats": lambda: c.all_reduce(torch.ones(4), ReduceOp.BOR),
        "premul on ints": lambda: c.all_reduce(torch.ones(4, dtype=torch.int32), ReduceOp.PREMUL_SUM(2.0)),
        # A tensor factor of another dtype than the data's (torch's NCCL and
        # torchcomms refuse it too), or of two elements.
        "premul factor dtype": lambda: c.all_reduce(torch.ones(4, dtype=torch.bfloat16),
                                                    ReduceOp.PREMUL_SUM(torch.tensor([0.5]))),
        "premul factor dtype, reduce_scatter": lambda: c.reduce_scatter_single(
            torch.ones(2), torch.ones(4), ReduceOp.PREMUL_SUM(torch.tensor(0.5, dtype=torch.float64))),
        "premul factor of 2 elements": lambda: c.all_reduce(torch.ones(4), ReduceOp.PREMUL_SUM(torch.ones(2))),
        "avg on bool": lambda: c.all_reduce(torch.ones(4, dtype=torch.bool), ReduceOp.AVG),
        "split duplicates": lambda: c.split([0, 1, 0]),
        "split without self": lambda: c.split([1 - rank]),
        "reduce_scatter_v sizes": lambda: c.reduce_scatter_v(torch.ones(3), [torch.ones(2), torch.ones(2)]),
        "all_to_all_v splits": lambda: c.all_to_all_v_single(torch.ones(4), torch.ones(4), [1, 2], [3, 1]),
        "bad op": lambda: c.all_reduce(torch.ones(4), 17),
        "dtype mismatch": lambda: c.all_gather_single(torch.ones(8), torch.ones(4, dtype=torch.float64)),
        "size mismatch": lambda: c.all_gather_single(torch.ones(7), torch.ones(4)),
        "reduce_scatter size": lambda: c.reduce_scatter_single(torch.ones(4), torch.ones(4)),
        "all_to_all size": lambda: c.all_to_all_single(torch.ones(4), torch.ones(3)),
        "root out of range": lambda: c.broadcast(torch.ones(4), 5),
        "send to self": lambda: c.send(torch.ones(4), rank),
        "read-only array": lambda: c.all_reduce(np.frombuffer(b"\0" * 16, dtype=np.float32)),
        "list length": lambda: c.all_gather([torch.ones(4)], torch.ones(4)),
        "bad timeout": lambda: c.all_reduce(torch.ones(4), timeout=-1),
    }
    got = {}
    for what, f in cases.items():
        try:
            f()
            got[what] = "no error"
        except (ValueError, TypeError) as e:
            got[what] = ("TypeError" if isinstance(e, TypeError) else "ValueError", isinstance(e, ftcomm.FtcommError))
    # Go validates too: calls that bypass the Python checks.
    L = ftcomm._lib.lib()
    x = np.ones(4, dtype=np.float32)
    for what, args in {"go: dtype 0": (1, x.ctypes.data, 4, None, 0, 0, -1, 1, 0),
                       "go: negative count": (1, x.ctypes.data, -4, None, 0, 1, -1, 1, 0),
                       "go: op kind 99": (99, x.ctypes.data, 4, None, 0, 1, -1, 1, 0),
                       "go: reduce op 0": (1, x.ctypes.data, 4, None, 0, 1, -1, 0, 0),
                       "go: peer out of range": (10, x.ctypes.data, 4, None, 0, 1, -1, 1, 9)}.items():
        st = L.ftcomm_comm_op(c._h, *args, 0, 0, 0, None)
        err = ftcomm._lib.last_error(st) if st < 0 else None
        got[what] = (type(err).__name__, isinstance(err, ValueError))
    y = torch.full((4,), float(rank + 1))
    c.all_reduce(y)
    got["after"] = float(y[0])
    finalize(rank, name)
    return got


def indivisible_all_to_all(rank, store, name, size=3):
    """all_to_all_single of a count that does not divide by the number of
    ranks (7 elements on 3): every rank refuses it alike and at once with
    InvalidArgumentError (the check reads only what every rank passes), sync
    or async, through the Python API and through the C ABI (Go's check);
    nothing is sent, and the comm then runs an all_to_all_single of 9."""
    import torch
    c = comm(rank, store, name, size)
    L = ftcomm._lib.lib()
    o7, i7 = np.zeros(7, dtype=np.float32), np.ones(7, dtype=np.float32)
    cases = {
        "sync": lambda: c.all_to_all_single(torch.zeros(7), torch.ones(7)),
        "async": lambda: c.all_to_all_single(torch.zeros(7), torch.ones(7), async_op=True).wait(),
        "numpy": lambda: c.all_to_all_single(np.zeros(7, dtype=np.float32), np.ones(7, dtype=np.float32)),
        "v with equal splits": lambda: c.all_to_all_v_single(torch.zeros(7), torch.ones(7), None, None),
        "go": lambda: ftcomm._lib.check(L.ftcomm_comm_op(c._h, ftcomm._lib.OP_ALL_TO_ALL, o7.ctypes.data, 7,
                                                         i7.ctypes.data, 7, 1, -1, 1, 0, 0, 0, 0, None)),
    }
    got, slowest = {}, 0.0
    for what, f in cases.items():
        t0 = time.monotonic()
        try:
            f()
            got[what] = "no error"
        except Exception as e:  # noqa: BLE001 - the kind is the result
            got[what] = type(e).__name__
        slowest = max(slowest, time.monotonic() - t0)
    x = torch.arange(9, dtype=torch.float32) + 10 * rank
    y = torch.full((9,), -1.0)
    c.all_to_all_single(y, x)
    got["after"] = y.tolist()
    got["slowest_s"] = slowest
    finalize(rank, name)
    return got


# ---- CUDA (nccl) ----

def cuda_suite(rank, store, name):
    bad = suite(rank, store, name, 2, kinds=("torch",), backend="nccl", device="cuda:%d" % rank)
    return bad, ftcomm.nccl_info()


def cuda_stream_order(rank, store, name):
    """An op on CUDA tensors runs after the work queued on the caller's
    stream, and work queued there afterwards sees its result; the call does
    not wait on the host."""
    import torch
    dev = torch.device("cuda", rank)
    c = comm(rank, store, name, 2, "nccl", dev)
    s = torch.cuda.Stream(dev)
    a = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(s):
        x = torch.zeros(1 << 20, device=dev)
        for _ in range(30):  # tens of ms of work queued ahead of the fill
            a = a @ a
            a = a / a.norm()
        x.fill_(rank + 1)
        t0 = time.monotonic()
        c.all_reduce(x)  # sync: stream-ordered
        call = time.monotonic() - t0
        busy = not s.query()  # the matmuls still run: the call did not wait for them
        y = x * 2
    s.synchronize()
    out = {"x": x[0].item(), "y": y[0].item(), "call_s": call, "stream_busy_after_call": busy}
    z = torch.full((8,), float(rank + 1), device=dev)  # the default stream
    c.all_reduce(z, ReduceOp.MAX)
    out["z"] = (z + 0)[0].item()
    w = torch.full((1 << 16,), float(rank + 1), device=dev)
    work = c.all_reduce(w, async_op=True)
    work.wait()
    out["async"] = w[0].item()
    finalize(rank, name)
    return out


def cuda_timeout(rank, store, name):
    """A stream-ordered op whose peer never comes: the call returns, the
    stream moves on at the deadline (the comm is aborted), and the next op
    raises CommTimeoutError."""
    import torch
    dev = torch.device("cuda", rank)
    c = comm(rank, store, name, 2, "nccl", dev)
    out = {}
    if rank == 0:
        x = torch.ones(1024, device=dev)
        t0 = time.monotonic()
        c.all_reduce(x, timeout=2)
        out["call_s"] = time.monotonic() - t0
        torch.cuda.current_stream().synchronize()
        out["stream_free_s"] = time.monotonic() - t0
        try:
            c.all_reduce(x)
            out["next"] = "ok"
        except ftcomm.FtcommError as e:
            out["next"] = type(e).__name__
            out["timeout"] = isinstance(e, TimeoutError)
        mark(store, name + "/done")
    else:
        wait_mark(store, name + "/done")
    finalize(rank, name)
    return out


def cuda_list_copy_order(rank, store, name, n=1 << 20):
    """An async list op whose outputs are not one buffer (all_gather and
    all_to_all into two reversed views of one buffer: the op lands in a
    scratch buffer, copied into the outputs once it is seen to end), seen to
    end by the next op, which is issued on another stream (b) behind a
    ~0.2 s kernel. The copy must go to the issuing stream (a): wait(), or
    is_completed() turning true, under a third stream (s3) must leave that
    stream ordered after the copy (read at once there: the values), and the
    scratch buffer, freed once the op settles, must not be handed out on a
    (allocated there and filled with -5) before the copy has read it (the
    values after a device synchronize). Before the fix the copy went to b,
    behind the kernel: the read on s3 saw -1 (the outputs' fill) and the
    final values were -5."""
    import torch
    from ctypes import byref, c_int32
    dev = torch.device("cuda", rank)
    c = comm(rank, store, name, 2, "nccl", dev)
    L = ftcomm._lib.lib()
    a, b, s3 = torch.cuda.Stream(dev), torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    out = {}
    for kind in ("all_gather", "all_to_all"):
        for how in ("wait", "is_completed"):
            with torch.cuda.stream(a):
                base = torch.full((2 * n,), -1.0, device=dev)
                outs = [base[n:], base[:n]]  # rank 0's block, then rank 1's: reversed, not one buffer
                if kind == "all_gather":
                    x = torch.full((n,), float(rank + 1), device=dev)
                    w = c.all_gather(outs, x, async_op=True)
                else:
                    ins = [torch.full((n,), float(10 * rank + r + 1), device=dev) for r in range(2)]
                    w = c.all_to_all(outs, ins, async_op=True)
            assert w._op.after is not None, "the outputs were one buffer: no copy to order"
            done = c_int32()
            deadline = time.monotonic() + 60
            while not done.value:  # the op ends; nothing here sees it (no settle)
                assert L.ftcomm_work_test(w._op.h, byref(done)) == 0
                assert time.monotonic() < deadline, "the op never ended"
                time.sleep(0.001)
            with torch.cuda.stream(b):
                torch.cuda._sleep(400_000_000)  # ~0.2 s
                y = torch.ones(8, device=dev)
                c.all_reduce(y)  # sees the list op end (settles it) under b
            with torch.cuda.stream(a):
                junk = torch.empty(2 * n, device=dev)  # the scratch buffer's size, on its stream
                junk.fill_(-5.0)
            with torch.cuda.stream(s3):
                if how == "wait":
                    w.wait()
                else:
                    while not w.is_completed():
                        time.sleep(0.001)
                read = torch.cat([o.clone() for o in outs])
            torch.cuda.synchronize(dev)
            key = "%s/%s" % (kind, how)
            if kind == "all_gather":
                want = [1.0, 2.0]  # outs[r] = rank r's x
            else:
                want = [float(10 * r + rank + 1) for r in range(2)]  # outs[r] = rank r's ins[rank]
            out[key] = {"read": [sorted(set(read[:n].tolist())), sorted(set(read[n:].tolist()))],
                        "final": [sorted(set(t.tolist())) for t in outs], "want": [[v] for v in want]}
            del junk, y
    finalize(rank, name)
    return out


def cuda_memory(rank, store, name, ops=10_000):
    import torch
    dev = torch.device("cuda", rank)
    c = comm(rank, store, name, 2, "nccl", dev)
    x = torch.ones(1024, device=dev)
    # A warm-up as long as the measured run: what ops in flight at once
    # need at their peak (the stream runs behind the calls) is reached
    # here, so that only what the measured run keeps shows as growth.
    for _ in range(ops):
        c.all_reduce(x, ReduceOp.MAX)
    torch.cuda.synchronize(dev)
    gc.collect()
    h0, rss0 = ftcomm.live_handles(), _rss()
    t0 = time.monotonic()
    for i in range(ops):
        c.all_reduce(x, ReduceOp.MAX)
    torch.cuda.synchronize(dev)
    took = time.monotonic() - t0
    rss1, h1 = _rss(), ftcomm.live_handles()
    finalize(rank, name)
    return rss1 - rss0, h1 - h0, took / ops
