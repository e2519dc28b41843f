"""The communicator, with torchcomms' names: new_comm, ReduceOp, Work and
Communicator's collectives, point-to-point ops and reconfiguration."""

from __future__ import annotations

import datetime
import enum
import json
import os
import secrets
import threading
from ctypes import byref, c_int32, c_int64, c_uint64
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import _lib, _tensors
from ._tensors import describe
from .errors import ClosedError, CommTimeoutError, FtcommError, InvalidArgumentError, InvalidTypeError
from .store import Store, _is_torch_store, from_environment, through_torch_store


class ReduceOp(enum.IntEnum):
    """Reductions of all_reduce, reduce and reduce_scatter. AVG divides by
    the number of ranks and is defined for floating-point dtypes only."""

    SUM = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    AVG = 5


_VALID_OPS = frozenset(int(o) for o in ReduceOp)

_WAIT_SLICE_NS = 200_000_000  # a blocked wait returns to Python this often (signals)


def _inv(msg: str) -> InvalidArgumentError:
    return InvalidArgumentError("ftcomm: " + msg, kinds=("invalid_argument",))


class Work:
    """The handle of an async op (``async_op=True``).

    ``wait(timeout=None)`` blocks until the op is done and raises its error
    if it failed (a timeout raises CommTimeoutError and leaves the op
    running); ``is_completed()`` says whether it is done. The tensors passed
    to the op must stay untouched until then; the Work keeps them alive.
    Ctrl-C in ``wait`` cancels the op (its communicator is aborted: a
    collective cannot be left half-way) and raises KeyboardInterrupt.
    For CUDA tensors, ``wait`` also blocks the host until the op is done;
    work queued on the current stream afterwards sees the result.
    """

    __slots__ = ("_h", "_keep", "_after", "_done", "_err", "__weakref__")

    def __init__(self, handle: int = 0, keep: Any = None, after: Optional[Callable[[], None]] = None):
        self._h = handle
        self._keep = keep
        self._after = after
        self._done = handle == 0
        self._err: Optional[BaseException] = None

    def _finish(self, err: Optional[BaseException]) -> None:
        self._done, self._err = True, err
        h, self._h = self._h, 0
        if h and not _lib.forked:
            _lib.lib().ftcomm_work_free(h)
        if err is None and self._after is not None:
            after, self._after = self._after, None
            after()
        self._keep = None

    def is_completed(self) -> bool:
        if self._done:
            return True
        done = c_int32()
        _lib.check(_lib.lib().ftcomm_work_test(self._h, byref(done)))
        return bool(done.value)

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._wait(None if timeout is None else _lib.timeout_ns(timeout))
        if self._err is not None:
            raise self._err
        return True

    def _wait(self, limit_ns: Optional[int]) -> None:
        L = _lib.lib()
        import time
        deadline = None if limit_ns is None else time.monotonic_ns() + limit_ns
        try:
            while True:
                s = _WAIT_SLICE_NS
                if deadline is not None:
                    s = min(s, max(deadline - time.monotonic_ns(), 1))
                st = L.ftcomm_work_wait(self._h, s)
                if st == _lib.OK:
                    self._finish(None)
                    return
                if st < 0:
                    try:
                        _lib.fail(st)
                    except FtcommError as e:
                        self._finish(e)
                        return
                if deadline is not None and time.monotonic_ns() >= deadline:
                    raise CommTimeoutError("ftcomm: wait timed out; the op is still running", kinds=("timeout",))
        except KeyboardInterrupt:
            # Cancel the op (it cannot be abandoned half-way, so its comm
            # is aborted), wait for it to end, then let Ctrl-C through.
            L.ftcomm_work_cancel(self._h)
            st = L.ftcomm_work_wait(self._h, -1)
            self._finish(_lib.last_error(st) if st < 0 else None)
            raise

    def __del__(self):
        h = self._h
        if h and not _lib.forked:
            try:
                _lib.lib().ftcomm_work_free(h)
            except Exception:
                pass

    def __repr__(self):
        return "Work(%s)" % ("done" if self._done else "pending")


_DONE = Work()


def _device_index(device) -> Optional[int]:
    """The CUDA ordinal device names, None if it names no index."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        return int(device.split(":", 1)[1]) if ":" in device else None
    return getattr(device, "index", None)


def _device_type(device) -> str:
    if isinstance(device, int):
        return "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0]
    t = getattr(device, "type", None)
    return t if t is not None else str(device).split(":", 1)[0]


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


_generations: Dict[str, int] = {}
_gen_lock = threading.Lock()


class Communicator:
    """One rank's communicator (comm.Comm over gloo or nccl). Make it with
    :func:`new_comm`. Safe to use from several threads; ops run in issue
    order. Every blocking call releases the GIL."""

    def __init__(self, handle: int, store: Optional[Store], own_store: bool, device, backend: str, prefix: str,
                 timeout, log_level: Optional[str]):
        self._h = handle
        self._store = store
        self._own_store = own_store
        self._device = device
        self._backend = backend
        self._prefix = prefix
        self._timeout = timeout
        self._log_level = log_level
        info = json.loads(_lib.get_bytes(_lib.lib().ftcomm_comm_info, handle))
        self._rank, self._size, self._epoch, self._name = info["rank"], info["size"], info["epoch"], info["name"]
        self._dev = info["device"]  # CUDA ordinal, -1 for host memory
        self._children: List["Communicator"] = []

    # ---- what it is ----

    def get_rank(self) -> int:
        return self._rank

    def get_size(self) -> int:
        return self._size

    def get_device(self):
        return self._device

    def get_name(self) -> str:
        return self._name

    def get_backend(self) -> str:
        return self._backend

    def get_epoch(self) -> int:
        """The membership generation: 0 at creation, raised by shrink and grow."""
        return self._epoch

    @property
    def prefix(self) -> str:
        """Where this comm's keys live in the store (joiners of a grow pass it)."""
        return self._prefix

    @property
    def store(self) -> Optional[Store]:
        return self._store

    def error(self) -> Optional[str]:
        """Why the comm refuses ops (it broke, was revoked or closed), or None."""
        return json.loads(_lib.get_bytes(_lib.lib().ftcomm_comm_info, self._handle())).get("error")

    def flight_record(self) -> dict:
        """The last ops of this comm (sequence, op, dtype, count, state, times)."""
        return json.loads(_lib.get_bytes(_lib.lib().ftcomm_comm_dump, self._handle()))

    def _handle(self) -> int:
        h = self._h
        if h is None:
            raise ClosedError("ftcomm: communicator %r was finalized" % self._name, kinds=("closed",))
        return h

    # ---- ops ----

    def _check_tensor(self, t, name):
        ptr, n, dt, dev = describe(t, name)
        if dev != self._dev:
            if self._dev < 0:
                raise _inv("%s is on cuda:%d; this %s communicator takes CPU tensors" % (name, dev, self._backend))
            raise _inv("%s is %s; this communicator runs on cuda:%d" % (name, "on the CPU" if dev < 0 else "on cuda:%d" % dev, self._dev))
        return ptr, n, dt

    def _op(self, kind: int, out, inp, dtype_of, op: int, root: int, async_op: bool, timeout, keep, after=None):
        """Issue one op: out/in are (ptr, count) pairs already checked."""
        if _lib.forked:
            raise _lib._fork_error()
        h = self._h
        if h is None:
            self._handle()
        optr, on = out
        iptr, inn = inp if inp is not None else (None, 0)
        dev = self._dev
        stream = _tensors.current_stream(dev) if dev >= 0 else 0
        t = _lib.timeout_ns(timeout) if timeout is not None else 0
        L = _lib._lib
        if not async_op:
            st = L.ftcomm_comm_op(h, kind, optr, on, iptr, inn, dtype_of, dev, op, root, stream, t, 0, None)
            if st:
                _lib.fail(st)
            if after is not None:
                after()
            return _DONE
        w = c_uint64()
        st = L.ftcomm_comm_op(h, kind, optr, on, iptr, inn, dtype_of, dev, op, root, stream, t, _lib.ASYNC, byref(w))
        if st:
            _lib.fail(st)
        return Work(w.value, keep, after)

    def _redop(self, op, dt) -> int:
        o = int(op) if isinstance(op, (int, ReduceOp)) else getattr(op, "value", op)
        if o not in _VALID_OPS:
            raise InvalidTypeError("ftcomm: reduce op %r: want a ReduceOp" % (op,), kinds=("invalid_argument",))
        if o == ReduceOp.AVG and dt not in _tensors.FLOATS:
            raise _inv("AVG is defined for floating-point tensors only (got %s)" % _tensors.DTYPE_NAMES[dt])
        return o

    def _root(self, root, what="root") -> int:
        if not isinstance(root, int) or not 0 <= root < self._size:
            raise _inv("%s %r outside [0, %d)" % (what, root, self._size))
        return root

    def _run(self, kind: int, d, op: int, root: int):
        """The fast path: a sync op on one host tensor, comm timeout."""
        if op not in _VALID_OPS or (op == 5 and d[2] not in _tensors.FLOATS):
            return False
        h = self._h
        if h is None or _lib.forked:
            return False
        st = _lib._lib.ftcomm_comm_run(h, kind | d[2] << 8 | op << 16 | (root & 0xffffffff) << 24, d[0], d[1])
        if st:
            _lib.fail(st)
        return True

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op: bool = False, hints=None, timeout=None):
        """Reduce tensor across all ranks, in place."""
        # The fast path (a sync op on a plain CPU tensor or array), written
        # out: each Python call it saves is ~0.1 µs of a ~4 µs op.
        if not async_op and timeout is None and self._dev < 0:
            tp = type(tensor)
            d = None
            if tp is _tensors._Tensor:
                if tensor.is_cpu and tensor.is_contiguous():
                    dt = _tensors._torch_dtypes.get(tensor.dtype)
                    if dt is not None:
                        d = (tensor.data_ptr(), tensor.numel(), dt)
            else:
                d = _tensors.host(tensor)
            if d is not None and op in _VALID_OPS and (op != 5 or d[2] in _tensors.FLOATS) and self._h is not None \
                    and not _lib.forked:
                st = _lib._lib.ftcomm_comm_run(self._h, 1 | d[2] << 8 | op << 16, d[0], d[1])
                if st:
                    _lib.fail(st)
                return _DONE
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        return self._op(_lib.OP_ALL_REDUCE, (ptr, n), None, dt, self._redop(op, dt), 0, async_op, timeout, tensor)

    def reduce(self, tensor, root: int, op=ReduceOp.SUM, async_op: bool = False, hints=None, timeout=None):
        """Reduce tensor into root's tensor; other ranks' tensors are unchanged."""
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        return self._op(_lib.OP_REDUCE, (ptr, n), None, dt, self._redop(op, dt), self._root(root), async_op, timeout, tensor)

    def broadcast(self, tensor, root: int, async_op: bool = False, hints=None, timeout=None):
        """Copy root's tensor into every rank's tensor."""
        if not async_op and timeout is None and self._dev < 0 and type(root) is int and 0 <= root < self._size:
            d = _tensors.host(tensor)
            if d is not None and self._run(4, d, 1, root):
                return _DONE
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        return self._op(_lib.OP_BROADCAST, (ptr, n), None, dt, ReduceOp.SUM, self._root(root), async_op, timeout, tensor)

    def _pair(self, output, input, what):
        optr, on, odt = self._check_tensor(output, "output")
        iptr, inn, idt = self._check_tensor(input, "input")
        if odt != idt:
            raise _inv("%s: output is %s, input %s" % (what, _tensors.DTYPE_NAMES[odt], _tensors.DTYPE_NAMES[idt]))
        return (optr, on), (iptr, inn), odt

    def all_gather_single(self, output, input, async_op: bool = False, hints=None, timeout=None):
        """Gather every rank's input into output (size × input elements) in rank order."""
        o, i, dt = self._pair(output, input, "all_gather_single")
        if o[1] != i[1] * self._size:
            raise _inv("all_gather_single: output has %d elements, want %d × %d" % (o[1], self._size, i[1]))
        return self._op(_lib.OP_ALL_GATHER, o, i, dt, ReduceOp.SUM, 0, async_op, timeout, (output, input))

    def all_gather(self, tensor_list: Sequence, tensor, async_op: bool = False, hints=None, timeout=None):
        """Gather every rank's tensor into tensor_list[rank]."""
        if len(tensor_list) != self._size:
            raise _inv("all_gather: %d output tensors for %d ranks" % (len(tensor_list), self._size))
        _, n, dt = self._check_tensor(tensor, "tensor")
        for i, t in enumerate(tensor_list):
            _, tn, tdt = self._check_tensor(t, "tensor_list[%d]" % i)
            if tn != n or tdt != dt:
                raise _inv("all_gather: tensor_list[%d] differs from tensor in size or dtype" % i)
        buf = _tensors.empty_like_flat(tensor, n * self._size)

        def scatter_out():
            for r, t in enumerate(tensor_list):
                _tensors.copy_into(t, buf[r * n:(r + 1) * n])

        o, i, _ = self._pair(buf, tensor, "all_gather")
        return self._op(_lib.OP_ALL_GATHER, o, i, dt, ReduceOp.SUM, 0, async_op, timeout, (buf, tensor, tensor_list), scatter_out)

    def reduce_scatter_single(self, output, input, op=ReduceOp.SUM, async_op: bool = False, hints=None, timeout=None):
        """Reduce input (size × output elements) and leave block rank in output."""
        o, i, dt = self._pair(output, input, "reduce_scatter_single")
        if i[1] != o[1] * self._size:
            raise _inv("reduce_scatter_single: input has %d elements, want %d × %d" % (i[1], self._size, o[1]))
        return self._op(_lib.OP_REDUCE_SCATTER, o, i, dt, self._redop(op, dt), 0, async_op, timeout, (output, input))

    def reduce_scatter(self, output, input_list: Sequence, op=ReduceOp.SUM, async_op: bool = False, hints=None, timeout=None):
        """Reduce input_list[r] across ranks into rank r's output."""
        if len(input_list) != self._size:
            raise _inv("reduce_scatter: %d input tensors for %d ranks" % (len(input_list), self._size))
        _, n, dt = self._check_tensor(output, "output")
        for i, t in enumerate(input_list):
            _, tn, tdt = self._check_tensor(t, "input_list[%d]" % i)
            if tn != n or tdt != dt:
                raise _inv("reduce_scatter: input_list[%d] differs from output in size or dtype" % i)
        return self.reduce_scatter_single(output, _tensors.concat(input_list), op, async_op, hints, timeout)

    def all_to_all_single(self, output, input, async_op: bool = False, hints=None, timeout=None):
        """Send block r of input to rank r; receive rank r's block into block r of output."""
        o, i, dt = self._pair(output, input, "all_to_all_single")
        if o[1] != i[1] or i[1] % self._size:
            raise _inv("all_to_all_single: %d and %d elements; want equal counts divisible by %d" % (o[1], i[1], self._size))
        return self._op(_lib.OP_ALL_TO_ALL, o, i, dt, ReduceOp.SUM, 0, async_op, timeout, (output, input))

    def scatter(self, output_tensor, input_tensor_list: Optional[Sequence], root: int, async_op: bool = False, hints=None, timeout=None):
        """Send input_tensor_list[r] of root to rank r's output_tensor."""
        optr, n, dt = self._check_tensor(output_tensor, "output_tensor")
        root = self._root(root)
        if self._rank == root:
            if input_tensor_list is None or len(input_tensor_list) != self._size:
                raise _inv("scatter: root needs %d input tensors" % self._size)
            src = _tensors.concat(input_tensor_list)
            o, i, dt = self._pair(output_tensor, src, "scatter")
            if i[1] != n * self._size:
                raise _inv("scatter: input tensors differ from output_tensor in size")
            keep = (output_tensor, src)
        else:
            o, i, keep = (optr, n), None, output_tensor
        return self._op(_lib.OP_SCATTER, o, i, dt, ReduceOp.SUM, root, async_op, timeout, keep)

    def gather(self, output_tensor_list: Optional[Sequence], input_tensor, root: int, async_op: bool = False, hints=None, timeout=None):
        """Collect every rank's input_tensor into root's output_tensor_list."""
        iptr, n, dt = self._check_tensor(input_tensor, "input_tensor")
        root = self._root(root)
        after, keep = None, input_tensor
        if self._rank == root:
            if output_tensor_list is None or len(output_tensor_list) != self._size:
                raise _inv("gather: root needs %d output tensors" % self._size)
            buf = _tensors.empty_like_flat(input_tensor, n * self._size)

            def after():
                for r, t in enumerate(output_tensor_list):
                    _tensors.copy_into(t, buf[r * n:(r + 1) * n])

            o, i, _ = self._pair(buf, input_tensor, "gather")
            keep = (buf, input_tensor, output_tensor_list)
        else:
            o, i = (0, 0), (iptr, n)
        return self._op(_lib.OP_GATHER, o, i, dt, ReduceOp.SUM, root, async_op, timeout, keep, after)

    def barrier(self, async_op: bool = False, hints=None, timeout=None):
        """Return once every rank has entered the barrier."""
        return self._op(_lib.OP_BARRIER, (None, 0), None, _tensors.FLOAT32, ReduceOp.SUM, 0, async_op, timeout, None)

    def send(self, tensor, dst: int, async_op: bool = False, hints=None, timeout=None):
        """Send tensor to rank dst, which posts a matching recv."""
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        return self._op(_lib.OP_SEND, (ptr, n), None, dt, ReduceOp.SUM, self._peer(dst), async_op, timeout, tensor)

    def recv(self, tensor, src: int, async_op: bool = False, hints=None, timeout=None):
        """Receive into tensor from rank src."""
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        return self._op(_lib.OP_RECV, (ptr, n), None, dt, ReduceOp.SUM, self._peer(src), async_op, timeout, tensor)

    def _peer(self, p) -> int:
        p = self._root(p, "peer")
        if p == self._rank:
            raise _inv("peer %d is this rank" % p)
        return p

    # ---- failure handling and reconfiguration ----

    def revoke(self, reason: str = "") -> None:
        """Revoke the comm (MPI ULFM semantics): every pending and later op
        fails with RevokedError, here and, as it propagates, at every rank.
        shrink and finalize still work."""
        _lib.check(_lib.lib().ftcomm_comm_revoke(self._handle(), reason.encode()))

    def abort(self, reason: str = "") -> None:
        """Abort the comm: the running op fails at once; no more collectives."""
        _lib.check(_lib.lib().ftcomm_comm_abort(self._handle(), reason.encode()))

    def _derived(self, h: int, store, own, prefix=None) -> "Communicator":
        c = Communicator(h, store, own, self._device, self._backend, prefix or self._prefix, self._timeout, self._log_level)
        return c

    def _move_to(self, h: int) -> "Communicator":
        """The comm a shrink or grow returned; this one is closed and freed,
        and the new one takes over the store."""
        c = self._derived(h, self._store, self._own_store)
        self._own_store = False
        self._free()
        return c

    def shrink(self, exclude: Sequence[int], epoch: Optional[int] = None, timeout=None) -> "Communicator":
        """The survivors (every rank but exclude, which every survivor passes
        alike) form a new comm at epoch (default: this epoch + 1), renumbered
        in old-rank order; this comm is finalized. Excluded ranks do not call
        it."""
        ex = sorted(set(int(r) for r in exclude))
        arr = (c_int64 * max(len(ex), 1))(*ex)
        out = c_uint64()
        _lib.check(_lib.lib().ftcomm_comm_shrink(self._handle(), arr, len(ex), -1 if epoch is None else int(epoch),
                                                 _lib.timeout_ns(timeout), byref(out)))
        return self._move_to(out.value)

    def grow(self, size: int, epoch: Optional[int] = None, timeout=None) -> "Communicator":
        """This comm's ranks and (size - get_size()) joiners form a comm of
        size ranks at epoch (default: this epoch + 1); the ranks keep theirs.
        Joiners call new_comm(..., rank=r, size=size, epoch=epoch,
        store=<this store's address>, prefix=this.prefix). This comm is
        finalized."""
        out = c_uint64()
        _lib.check(_lib.lib().ftcomm_comm_grow(self._handle(), int(size), -1 if epoch is None else int(epoch),
                                               _lib.timeout_ns(timeout), byref(out)))
        return self._move_to(out.value)

    def split(self, ranks: Sequence[int], name: Optional[str] = None, hints=None, timeout=None) -> Optional["Communicator"]:
        """A new comm of the listed ranks, numbered in list order. Every rank
        calls it, each with the ranks of its own new comm (disjoint lists);
        a rank in no list passes [] and gets None. This comm stays usable."""
        ranks = [int(r) for r in ranks]
        if self._rank in ranks:
            color, key = min(ranks), ranks.index(self._rank)
        else:
            color, key = -1, 0
        out = c_uint64()
        _lib.check(_lib.lib().ftcomm_comm_split(self._handle(), color, key, _lib.timeout_ns(timeout), byref(out)))
        if not out.value:
            return None
        c = self._derived(out.value, self._store, False)
        if name:
            c._name = name
        self._children.append(c)
        return c

    def _free(self) -> None:
        h, self._h = self._h, None
        if h is not None and not _lib.forked:
            _lib.check(_lib.lib().ftcomm_comm_free(h))

    def finalize(self) -> None:
        """Close the comm (a pending op fails with ClosedError) and release
        what it holds; the store it hosted stops after the comms split from
        it are finalized too. Safe to call twice."""
        if self._h is None:
            return
        self._free()
        if self._own_store and self._store is not None and not any(c._h is not None for c in self._children):
            self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()

    def __del__(self):
        try:
            if self._h is not None and not _lib.forked:
                _lib.lib().ftcomm_comm_free(self._h)
                self._h = None
        except Exception:
            pass

    def __repr__(self):
        return "Communicator(%s, %s, rank %d/%d, epoch %d%s)" % (
            self._name, self._backend, self._rank, self._size, self._epoch, "" if self._h else ", finalized")


def new_comm(backend: str, device: Any = "cpu", *, name: Optional[str] = None, timeout=None, store=None,
             rank: Optional[int] = None, size: Optional[int] = None, epoch: int = 0, prefix: Optional[str] = None,
             hints: Optional[Dict[str, str]] = None, abort_process_on_timeout_or_error: Optional[bool] = None,
             log_level: Optional[str] = None, **_ignored) -> Communicator:
    """This rank's communicator, as torchcomms.new_comm.

    backend: "gloo" (CPU tensors, numpy arrays) or "nccl" (CUDA tensors).
    device: "cpu", or a CUDA device; a CUDA device without an index means
    cuda:LOCAL_RANK (torchrun's), and becomes the current device.
    rank, size: default RANK and WORLD_SIZE from the environment (one rank
    when neither is set and no store is given).
    store: where the ranks meet: None (torchrun's MASTER_ADDR/MASTER_PORT),
    an ftcomm.Store, "host:port" of an ftcomm store, or a
    torch.distributed.Store.
    timeout: each op's default deadline (seconds or timedelta; default
    60 s), also the bound of the rendezvous.
    epoch, prefix: for joiners of a grow (see Communicator.grow).
    hints: backend settings: "listen_addr" (gloo, for ranks on several
    hosts), "shared_memory" ("0" off), "revoke" (nccl: "native").
    """
    if _lib.forked:
        raise _lib._fork_error()
    backend = {"ncclx": "nccl", "cuda": "nccl"}.get(backend, backend)
    if backend not in ("gloo", "nccl"):
        raise _inv("backend %r: want 'gloo' or 'nccl'" % (backend,))
    name = name or "main"
    if rank is None:
        rank = _env_int("RANK")
    if size is None:
        size = _env_int("WORLD_SIZE")
    if rank is None and size is None and store is None:
        rank, size = 0, 1
    if rank is None or size is None:
        raise _inv("rank and size: pass them or set RANK and WORLD_SIZE")
    dev_settings: Optional[int] = None
    if backend == "nccl":
        if _device_type(device) != "cuda":
            raise _inv("backend nccl takes a CUDA device, got %r" % (device,))
        idx = _device_index(device)
        if idx is None:
            local = _env_int("LOCAL_RANK")
            idx = local if local is not None else rank
            import torch
            if torch.cuda.device_count() > 0:
                idx %= torch.cuda.device_count()
        import torch
        torch.cuda.set_device(idx)
        device = torch.device("cuda", idx)
        dev_settings = idx
    elif _device_type(device) != "cpu":
        raise _inv("backend gloo takes device 'cpu', got %r" % (device,))
    _lib.ensure_interrupt_chain()

    with _gen_lock:
        gen = _generations.get(name, 0)
        _generations[name] = gen + 1
    joining = prefix is not None
    pfx = prefix or "ftcomm/%s/%d" % (name, gen)
    own = False
    st: Optional[Store]
    if size == 1 and store is None:
        st = None
    elif isinstance(store, Store):
        st = store
    elif isinstance(store, str):
        st, own = Store.connect(store), True
    elif store is not None and _is_torch_store(store):
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        st, own = through_torch_store(store, pfx + "/store", rank, host, timeout), True
    elif store is None:
        st = from_environment(rank, size, pfx + "/store", timeout)
        if st is None:
            raise _inv("no store: pass store= or set MASTER_ADDR and MASTER_PORT (torchrun does)")
        own = True
    else:
        raise InvalidTypeError("ftcomm: store %r: want an ftcomm.Store, 'host:port' or a torch.distributed.Store" % (store,),
                               kinds=("invalid_argument",))
    try:
        secret = ""
        if st is not None:
            if rank == 0 and not joining:
                secret = secrets.token_hex(16)
                st.set(pfx + "/secret", secret, timeout=timeout)
            else:
                secret = st.get(pfx + "/secret", timeout=timeout or 300).decode()
        settings: Dict[str, Any] = {"rank": rank, "size": size, "name": name, "prefix": pfx, "epoch": int(epoch),
                                    "job_id": name, "secret": secret}
        if timeout is not None:
            settings["timeout_s"] = _lib.timeout_ns(timeout) / 1e9
        if dev_settings is not None:
            settings["device"] = dev_settings
        if log_level:
            settings["log_level"] = log_level
        for k, v in (hints or {}).items():
            if k == "listen_addr":
                settings["listen_addr"] = v
            elif k == "shared_memory":
                settings["shared_memory"] = v not in ("0", "false", False, 0)
            elif k in ("revoke", "nccl_lib", "cudart_lib"):
                settings[k] = v
        h = c_uint64()
        _lib.check(_lib.lib().ftcomm_comm_new(backend.encode(), json.dumps(settings).encode(),
                                              st._h if st is not None else 0, byref(h)))
    except BaseException:
        if own and st is not None:
            st.close()
        raise
    return Communicator(h.value, st, own, device, backend, pfx, timeout, log_level)
