"""The communicator, with torchcomms' names: new_comm, ReduceOp, Work and
TorchComm's collectives, point-to-point ops (single and batched),
split, reconfigure, and ftcomm's shrink, grow and revoke.

Every argument is checked before anything is sent. A call refused on one
rank (InvalidArgumentError, or anything else that stops it before the op
reaches the library) is refused on the communicator too, in the op's place
in its order: on gloo the other ranks' matching op then fails at once with
PeerRefusedError naming this rank and its reason, and the communicator
stays usable everywhere (see docs/python.md; nccl cannot tell its peers,
which wait for the op's deadline).

This module is ftcomm's own API: its names are those below (``__all__``),
also exported by ``ftcomm``. The batch classes are defined in _batch.py,
how ranks meet in _rendezvous.py, the refusal of an op in _refusal.py;
torch.distributed's ``"ftcomm"`` backend (ftcomm.distributed) runs its ops
on these communicators.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import secrets
import socket
from ctypes import byref, c_int32, c_int64, c_uint64, c_void_p
from typing import Any, Dict, List, Optional, Sequence, Set, Union

from . import _devices, _lib, _rendezvous, _tensors
from ._batch import BatchP2POptions, BatchSendRecv, P2POp, P2POpType
from ._refusal import c_rank, issuing, refusing
from ._tensors import BOOL, FLOATS, abi_dtype, describe
from .errors import ClosedError, FtcommError
from .errors import invalid_argument as _inv
from .reduce_op import RedOpType, ReduceOp, as_reduce_op
from .store import Store
from .work import DONE, InFlight, Work

__all__ = ["new_comm", "Communicator", "TorchComm", "CommOptions", "BatchSendRecv", "BatchP2POptions", "P2POp",
           "P2POpType"]

_SUM = 1


def _refusing(kind: int, peer: Optional[str] = None, at: int = 1):
    """Decorator of a Communicator op: refused on the comm if it fails
    before it reaches the library (see ftcomm._refusal). peer names the
    argument (keyword, or positional index at after self) that holds the
    peer of a send or receive."""

    def refuse(self, kind, e, args, kwargs):
        p = kwargs.get(peer, args[at] if len(args) > at else -1) if peer else 0
        self._refuse(kind, e, c_rank(p))

    return refusing(kind, refuse)


class CommOptions:
    """A communicator's options (torchcomms' CommOptions), as get_options()
    reports them."""

    def __init__(self, abort_process_on_timeout_or_error: bool = False, timeout=None, store=None, name: str = "",
                 enable_reconfigure: bool = False, hints: Optional[Dict[str, str]] = None):
        self.abort_process_on_timeout_or_error = bool(abort_process_on_timeout_or_error)
        self.timeout = _rendezvous.as_timedelta(timeout) if timeout is not None else datetime.timedelta(seconds=60)
        self.store = store
        self.name = name
        self.enable_reconfigure = bool(enable_reconfigure)
        self.hints = dict(hints or {})

    def __repr__(self):
        return "CommOptions(name=%r, timeout=%s, abort_process_on_timeout_or_error=%s, enable_reconfigure=%s, hints=%r)" % (
            self.name, self.timeout, self.abort_process_on_timeout_or_error, self.enable_reconfigure, self.hints)


def _adjacent(parts: Sequence[tuple], es: int) -> bool:
    """Whether buffers (ptr, count) follow each other in memory, in order."""
    for (p, n), (q, _) in zip(parts, parts[1:]):
        if p + n * es != q:
            return False
    return True


def _rows(t, splits: Optional[Sequence[int]], size: int, what: str) -> List[int]:
    """Element counts of the blocks of t cut along dim 0 by splits (rows);
    an empty or missing splits cuts t in size equal blocks."""
    n = _tensors.numel(t)
    shape = _tensors.shape(t)
    rows = shape[0] if shape else 1
    inner = n // rows if rows else 0
    if not splits:
        if rows % size:
            raise _inv("%s: %d rows do not divide into %d equal blocks" % (what, rows, size))
        return [rows // size * inner] * size
    if len(splits) != size:
        raise _inv("%s: %d split sizes for %d ranks" % (what, len(splits), size))
    s = [int(x) for x in splits]
    if any(x < 0 for x in s) or sum(s) != rows:
        raise _inv("%s: split sizes %s do not cut %d rows" % (what, s, rows))
    return [x * inner for x in s]


class Communicator:
    """One rank's communicator (torchcomms' TorchComm; comm.Comm over gloo
    or nccl). Make it with :func:`new_comm`. Safe to use from several
    threads; ops run in issue order. Every blocking call releases the GIL.

    Each op takes ``async_op`` (return at once with a pending Work),
    ``hints`` (accepted; ftcomm's ops take none) and ``timeout`` (this op's
    deadline: seconds or a timedelta; default the comm's).
    """

    def __init__(self, handle: Optional[int], store: Optional[Store], own_store: bool, device, backend: str,
                 prefix: str, options: CommOptions, log_level: Optional[str], name: str,
                 init_handle: Optional[str] = None):
        self._h = handle
        self._store = store
        self._own_store = own_store
        self._device = device
        self._backend = backend
        self._prefix = prefix
        self._options = options
        self._log_level = log_level
        self._name = name
        self._children: List["Communicator"] = []
        self._inflight = InFlight()
        self._aborted = False
        self._init_handle = init_handle or "%s:%d:%s:%s" % (socket.gethostname(), os.getpid(), name,
                                                             secrets.token_hex(8))
        self._members: Optional[List[str]] = None  # init handles, by rank, of a reconfigurable comm
        self._rank, self._size, self._epoch, self._dev = 0, 0, 0, -1
        if handle is not None:
            self._load_info()
        elif _devices.device_type(device) == "cuda":
            self._dev = _devices.device_index(device)

    def _load_info(self) -> None:
        info = json.loads(_lib.get_bytes(_lib.lib().ftcomm_comm_info, self._h))
        self._rank, self._size, self._epoch = info["rank"], info["size"], info["epoch"]
        self._dev = info["device"]  # CUDA ordinal, -1 for host memory

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

    def get_backend_version(self) -> str:
        if self._backend == "nccl":
            return "nccl " + str(json.loads(_lib.get_bytes(_lib.lib().ftcomm_nccl_info)).get("nccl", "?"))
        return "ftcomm gloo"

    def get_options(self) -> CommOptions:
        return self._options

    def get_epoch(self) -> int:
        """The membership generation: 0 at creation, raised by shrink, grow
        and reconfigure."""
        return self._epoch

    def get_init_handle(self) -> str:
        """This comm's handle for reconfigure(): unique to it, the same on
        every call. Every rank of a reconfiguration passes the list of the
        members' handles."""
        return self._init_handle

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
        if _lib.forked:
            raise _lib._fork_error()
        h = self._h
        if h is None:
            if self._members is None and self._options.enable_reconfigure and not self._finalized:
                raise ClosedError("ftcomm: communicator %r is not configured yet: call reconfigure() first" % self._name,
                                  kinds=("closed",))
            raise ClosedError("ftcomm: communicator %r was finalized" % self._name, kinds=("closed",))
        return h

    _finalized = False
    _boot = None  # a reconfigurable comm's bootstrap store (see new_comm)

    # ---- checking arguments ----

    def _check_tensor(self, t, name):
        ptr, n, dt, dev = describe(t, name)
        if dev != self._dev:
            if self._dev < 0:
                raise _inv("%s is on cuda:%d; this %s communicator takes CPU tensors" % (name, dev, self._backend))
            raise _inv("%s is %s; this communicator runs on cuda:%d" % (
                name, "on the CPU" if dev < 0 else "on cuda:%d" % dev, self._dev))
        return ptr, n, dt

    def _same(self, ts: Sequence, what: str, n: Optional[int] = None, dt: Optional[int] = None):
        """(ptr, count) of each tensor of a list, all of dtype dt (and n
        elements each, when n is given)."""
        out = []
        for i, t in enumerate(ts):
            p, k, d = self._check_tensor(t, "%s[%d]" % (what, i))
            if dt is not None and d != dt:
                raise _inv("%s[%d] is %s, want %s" % (what, i, _tensors.DTYPE_NAMES[d], _tensors.DTYPE_NAMES[dt]))
            if n is not None and k != n:
                raise _inv("%s[%d] has %d elements, want %d" % (what, i, k, n))
            dt = d
            out.append((p, k))
        return out

    def _list(self, ts, what: str) -> Sequence:
        if ts is None or isinstance(ts, (str, bytes)) or not hasattr(ts, "__len__"):
            raise _inv("%s: want a list of %d tensors" % (what, self._size))
        if len(ts) != self._size:
            raise _inv("%s: %d tensors for %d ranks" % (what, len(ts), self._size))
        return ts

    def _root(self, root, what="root") -> int:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self._size:
            raise _inv("%s %r outside [0, %d)" % (what, root, self._size))
        return root

    def _peer(self, p) -> int:
        p = self._root(p, "peer")
        if p == self._rank:
            raise _inv("peer %d is this rank" % p)
        return p

    def _reduction(self, op, dt: int):
        """(comm.ReduceOp code, PREMUL_SUM factor or None) of op on dt."""
        r = as_reduce_op(op)
        t = r._type
        name = _tensors.DTYPE_NAMES[dt]
        if dt == BOOL:
            if t in (RedOpType.SUM, RedOpType.MAX, RedOpType.BOR):
                return 4, None  # logical or
            if t in (RedOpType.PRODUCT, RedOpType.MIN, RedOpType.BAND):
                return 3, None  # logical and
            if t is RedOpType.BXOR:
                return 8, None
            raise _inv("%s is not defined for bool tensors" % t.name)
        if t is RedOpType.PREMUL_SUM:
            if dt not in FLOATS:
                raise _inv("PREMUL_SUM is defined for floating-point tensors only (got %s)" % name)
            _tensors.check_factor(r._factor, dt)
            return _SUM, r._factor
        if t in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
            if dt in FLOATS:
                raise _inv("%s is defined for integer and bool tensors only (got %s)" % (t.name, name))
            if self._backend == "nccl":
                raise _inv("%s: NCCL has no bitwise reductions (use the gloo backend)" % t.name)
        return r._code, None

    # ---- issuing ----

    def _op(self, kind: int, out, inp, dt: int, redop: int, root: int, async_op: bool, timeout, keep,
            after=None) -> Work:
        """Issue one op: out/inp are (ptr, count) pairs already checked.
        after runs once the op has succeeded: at once after a sync op (for
        CUDA, stream-ordered behind it), when the op is seen to end after an
        async one."""
        h = self._handle()
        if self._inflight._q:
            self._inflight.reap()
        optr, on = out
        iptr, inn = inp if inp is not None else (None, 0)
        dev = self._dev
        stream = _tensors.current_stream(dev) if dev >= 0 else 0
        t = _lib.timeout_ns(timeout)
        L = _lib._lib
        adt = abi_dtype(dt)
        issuing.done = True
        if not async_op:
            st = L.ftcomm_comm_op(h, kind, optr, on, iptr, inn, adt, dev, redop, root, stream, t, 0, None)
            if st:
                _lib.fail(st)
            return self._synced(after)
        w = c_uint64()
        st = L.ftcomm_comm_op(h, kind, optr, on, iptr, inn, adt, dev, redop, root, stream, t, _lib.ASYNC, byref(w))
        if st:
            _lib.fail(st)
        return Work(self._inflight.add(w.value, keep, after, self._after_stream(after)), self._inflight)

    def _after_stream(self, after):
        """The stream an async op's after step is queued on: the one it is
        issued on (CUDA), not the one current where it is seen to end."""
        if after is None or self._dev < 0:
            return None
        return _tensors.stream_object(self._dev)

    def _synced(self, after) -> Work:
        """A sync op has returned: run its after step (on CUDA, on the
        current stream, which waits for the op), and settle the async ops
        before it (ops end in issue order; their after steps go to their
        own streams)."""
        if after is not None:
            after()
        if self._inflight._q:
            self._inflight.reap()
        return DONE

    def _opv(self, kind: int, out, inp, dt: int, redop: int, counts: Sequence[int], in_counts: Optional[Sequence[int]],
             async_op: bool, timeout, keep, after=None) -> Work:
        h = self._handle()
        if self._inflight._q:
            self._inflight.reap()
        c = (c_int64 * len(counts))(*counts)
        ic = (c_int64 * len(in_counts))(*in_counts) if in_counts is not None else None
        dev = self._dev
        stream = _tensors.current_stream(dev) if dev >= 0 else 0
        w = c_uint64()
        issuing.done = True
        st = _lib.lib().ftcomm_comm_opv(h, kind, out[0], out[1], inp[0], inp[1], abi_dtype(dt), dev, redop, c,
                                        len(counts), ic, len(in_counts) if in_counts is not None else 0, stream,
                                        _lib.timeout_ns(timeout), _lib.ASYNC if async_op else 0,
                                        byref(w) if async_op else None)
        if st:
            _lib.fail(st)
        if async_op:
            return Work(self._inflight.add(w.value, keep, after, self._after_stream(after)), self._inflight)
        return self._synced(after)

    def _batch(self, entries: List[tuple], async_op: bool, timeout, keep) -> Work:
        """Run sends and receives (kind, ptr, count, dtype, peer) together;
        empty ones are skipped (both sides know the count)."""
        h = self._handle()
        entries = [e for e in entries if e[2] > 0]
        if not entries:
            issuing.done = True  # nothing to send or receive, at either end
            return DONE
        if self._inflight._q:
            self._inflight.reap()
        n = len(entries)
        kinds = (c_int32 * n)(*[e[0] for e in entries])
        ptrs = (c_void_p * n)(*[e[1] for e in entries])
        counts = (c_int64 * n)(*[e[2] for e in entries])
        dtypes = (c_int32 * n)(*[abi_dtype(e[3]) for e in entries])
        peers = (c_int32 * n)(*[e[4] for e in entries])
        dev = self._dev
        stream = _tensors.current_stream(dev) if dev >= 0 else 0
        w = c_uint64()
        issuing.done = True
        st = _lib.lib().ftcomm_comm_batch(h, n, kinds, ptrs, counts, dtypes, peers, dev, stream, _lib.timeout_ns(timeout),
                                          _lib.ASYNC if async_op else 0, byref(w) if async_op else None)
        if st:
            _lib.fail(st)
        return Work(self._inflight.add(w.value, keep), self._inflight) if async_op else self._synced(None)

    def _run(self, kind: int, d, op: int, root: int):
        """The fast path: a sync op on one host tensor, comm timeout."""
        h = self._h
        if h is None or _lib.forked:
            return False
        q = self._inflight._q
        if q:
            self._inflight.reap()
        issuing.done = True
        st = _lib._lib.ftcomm_comm_run(h, kind | d[2] << 8 | op << 16 | (root & 0xffffffff) << 24, d[0], d[1])
        if st:
            _lib.fail(st)
        if q:
            self._inflight.reap()
        return True

    def _refuse(self, kind: int, exc: BaseException, root: int = 0, entries: Sequence[tuple] = ()) -> None:
        """Refuse an op of kind that failed here before it reached the
        library (see _refusing): in its place in the comm's order, the peers
        it concerns learn why. Never raises: the caller's error is what the
        caller sees."""
        issuing.done = True
        h = self._h
        if h is None or _lib.forked or self._finalized:
            return
        reason = exc.message if isinstance(exc, FtcommError) else "%s: %s" % (type(exc).__name__, exc)
        if reason.startswith("ftcomm: "):
            reason = reason[len("ftcomm: "):]
        n = len(entries)
        kinds = (c_int32 * n)(*[k for k, _ in entries]) if n else None
        peers = (c_int32 * n)(*[p for _, p in entries]) if n else None
        try:
            st = _lib.lib().ftcomm_comm_refuse(h, kind, root, n, kinds, peers, reason.encode("utf-8", "replace"))
            if st:
                _lib.last_error(st)  # clear it: the caller's error is the one raised
        except Exception:
            pass

    # ---- collectives ----

    def all_reduce(self, tensor, op=ReduceOp.SUM, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Reduce tensor across all ranks, in place."""
        # The fast path (a sync op on a plain CPU tensor or array), written
        # out: each Python call it saves is ~0.1 µs of a ~4 µs op.
        if not async_op and timeout is None and self._dev < 0 and type(op) is ReduceOp and op._factor is None:
            tp = type(tensor)
            d = None
            if tp is _tensors._Tensor:
                if tensor.is_cpu and tensor.is_contiguous():
                    dt = _tensors._torch_dtypes.get(tensor.dtype)
                    if dt is not None:
                        d = (tensor.data_ptr(), tensor.numel(), dt)
            else:
                d = _tensors.host(tensor)
            if d is not None and self._h is not None and not _lib.forked:
                q = self._inflight._q
                if q:
                    self._inflight.reap()
                st = _lib._lib.ftcomm_comm_run(self._h, 1 | d[2] << 8 | op._code << 16, d[0], d[1])
                if st:
                    _lib.fail(st)
                if q:
                    self._inflight.reap()
                return DONE
        return self._all_reduce(tensor, op, async_op, timeout)

    @_refusing(_lib.OP_ALL_REDUCE)
    def _all_reduce(self, tensor, op, async_op, timeout) -> Work:
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        code, factor = self._reduction(op, dt)
        if factor is not None:
            _tensors.scale_(tensor, factor)
        return self._op(_lib.OP_ALL_REDUCE, (ptr, n), None, dt, code, 0, async_op, timeout, tensor)

    @_refusing(_lib.OP_REDUCE)
    def reduce(self, tensor, root: int, op=ReduceOp.SUM, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Reduce tensor into root's tensor; other ranks' tensors are unchanged."""
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        code, factor = self._reduction(op, dt)
        root = self._root(root)
        keep = tensor
        if factor is not None:
            if self._rank == root:
                _tensors.scale_(tensor, factor)
            else:  # only read here, and left as it was: a scaled copy
                keep = _tensors.scaled(tensor, factor)
                ptr = self._check_tensor(keep, "tensor")[0]
        return self._op(_lib.OP_REDUCE, (ptr, n), None, dt, code, root, async_op, timeout, keep)

    def broadcast(self, tensor, root: int, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Copy root's tensor into every rank's tensor."""
        if not async_op and timeout is None and self._dev < 0 and type(root) is int and 0 <= root < self._size:
            d = _tensors.host(tensor)
            if d is not None and self._run(_lib.OP_BROADCAST, d, _SUM, root):
                return DONE
        return self._broadcast(tensor, root, async_op, timeout)

    @_refusing(_lib.OP_BROADCAST)
    def _broadcast(self, tensor, root, async_op, timeout) -> Work:
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        return self._op(_lib.OP_BROADCAST, (ptr, n), None, dt, _SUM, self._root(root), async_op, timeout, tensor)

    def _pair(self, output, input, what):
        optr, on, odt = self._check_tensor(output, "output")
        iptr, inn, idt = self._check_tensor(input, "input")
        if odt != idt:
            raise _inv("%s: output is %s, input %s" % (what, _tensors.DTYPE_NAMES[odt], _tensors.DTYPE_NAMES[idt]))
        return (optr, on), (iptr, inn), odt

    @_refusing(_lib.OP_ALL_GATHER)
    def all_gather_single(self, output, input, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Gather every rank's input into output (size × input elements) in rank order."""
        o, i, dt = self._pair(output, input, "all_gather_single")
        if o[1] != i[1] * self._size:
            raise _inv("all_gather_single: output has %d elements, want %d × %d" % (o[1], self._size, i[1]))
        return self._op(_lib.OP_ALL_GATHER, o, i, dt, _SUM, 0, async_op, timeout, (output, input))

    def _landing(self, outs: List[tuple], tensors: Sequence, dt: int, like):
        """Where a collective writes a list of output tensors: straight into
        them when they are one buffer ((ptr, count) of it, no after step),
        else into a scratch buffer copied into each tensor once the op has
        succeeded. The op is the same either way: a layout is one rank's
        own business and must not change what its peers see."""
        total = sum(k for _, k in outs)
        if outs and _adjacent(outs, _tensors.itemsize(dt)):
            return (outs[0][0], total), None, tensors
        buf = _tensors.empty_like_flat(like, total)
        counts = [k for _, k in outs]
        return (self._check_tensor(buf, "output")[0], total), lambda: _tensors.copy_blocks(buf, tensors, counts), \
            (buf, tensors)

    @_refusing(_lib.OP_ALL_GATHER)
    def all_gather(self, tensor_list: Sequence, tensor, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Gather every rank's tensor into tensor_list[rank]."""
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        outs = self._same(self._list(tensor_list, "all_gather: tensor_list"), "tensor_list", n, dt)
        out, after, kept = self._landing(outs, tensor_list, dt, tensor)
        return self._op(_lib.OP_ALL_GATHER, out, (ptr, n), dt, _SUM, 0, async_op, timeout, (tensor, kept), after)

    @_refusing(_lib.OP_ALL_GATHER_V)
    def all_gather_v(self, tensor_list: Sequence, tensor, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Gather every rank's tensor into tensor_list[rank]; the ranks'
        tensors may differ in size (tensor_list[r] has rank r's size)."""
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        outs = self._same(self._list(tensor_list, "all_gather_v: tensor_list"), "tensor_list", None, dt)
        if outs[self._rank][1] != n:
            raise _inv("all_gather_v: tensor has %d elements, tensor_list[%d] %d" % (n, self._rank, outs[self._rank][1]))
        out, after, kept = self._landing(outs, tensor_list, dt, tensor)
        return self._opv(_lib.OP_ALL_GATHER_V, out, (ptr, n), dt, _SUM, [k for _, k in outs], None, async_op, timeout,
                         (tensor, kept), after)

    @_refusing(_lib.OP_REDUCE_SCATTER)
    def reduce_scatter_single(self, output, input, op=ReduceOp.SUM, async_op: bool = False, hints=None,
                              timeout=None) -> Work:
        """Reduce input (size × output elements) and leave block rank in output."""
        o, i, dt = self._pair(output, input, "reduce_scatter_single")
        if i[1] != o[1] * self._size:
            raise _inv("reduce_scatter_single: input has %d elements, want %d × %d" % (i[1], self._size, o[1]))
        code, factor = self._reduction(op, dt)
        keep = (output, input)
        if factor is not None:
            keep = (output, _tensors.scaled(input, factor))
            i = (self._check_tensor(keep[1], "input")[0], i[1])
        return self._op(_lib.OP_REDUCE_SCATTER, o, i, dt, code, 0, async_op, timeout, keep)

    def _joined(self, ins: List[tuple], input_list: Sequence, factor, dt: int):
        """(ptr, count) of the input list as one buffer, and what keeps it:
        the list itself when its tensors are adjacent, else a copy (scaled
        by a PREMUL_SUM factor, which is never applied to the caller's
        tensors)."""
        total = sum(k for _, k in ins)
        if factor is None and _adjacent(ins, _tensors.itemsize(dt)) and ins:
            return (ins[0][0], total), input_list
        buf = _tensors.concat(input_list) if total else _tensors.empty_like_flat(input_list[0], 0)
        if factor is not None:
            _tensors.scale_(buf, factor)
        return (self._check_tensor(buf, "input_list")[0], total), buf

    @_refusing(_lib.OP_REDUCE_SCATTER)
    def reduce_scatter(self, output, input_list: Sequence, op=ReduceOp.SUM, async_op: bool = False, hints=None,
                       timeout=None) -> Work:
        """Reduce input_list[r] across ranks into rank r's output."""
        optr, n, dt = self._check_tensor(output, "output")
        ins = self._same(self._list(input_list, "reduce_scatter: input_list"), "input_list", n, dt)
        code, factor = self._reduction(op, dt)
        joined, kept = self._joined(ins, input_list, factor, dt)
        return self._op(_lib.OP_REDUCE_SCATTER, (optr, n), joined, dt, code, 0, async_op, timeout, (output, kept))

    @_refusing(_lib.OP_REDUCE_SCATTER_V)
    def reduce_scatter_v(self, output, input_list: Sequence, op=ReduceOp.SUM, async_op: bool = False, hints=None,
                         timeout=None) -> Work:
        """Reduce input_list[r] across ranks into rank r's output; the blocks
        may differ in size (input_list[r] has rank r's output size)."""
        optr, n, dt = self._check_tensor(output, "output")
        ins = self._same(self._list(input_list, "reduce_scatter_v: input_list"), "input_list", None, dt)
        if ins[self._rank][1] != n:
            raise _inv("reduce_scatter_v: output has %d elements, input_list[%d] %d" % (n, self._rank, ins[self._rank][1]))
        code, factor = self._reduction(op, dt)
        joined, kept = self._joined(ins, input_list, factor, dt)
        return self._opv(_lib.OP_REDUCE_SCATTER_V, (optr, n), joined, dt, code, [k for _, k in ins], None, async_op,
                         timeout, (output, kept))

    @_refusing(_lib.OP_ALL_TO_ALL)
    def all_to_all_single(self, output, input, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Send block r of input to rank r; receive rank r's block into block r of output."""
        o, i, dt = self._pair(output, input, "all_to_all_single")
        if o[1] != i[1] or i[1] % self._size:
            raise _inv("all_to_all_single: %d and %d elements; want equal counts divisible by %d" % (o[1], i[1], self._size))
        return self._op(_lib.OP_ALL_TO_ALL, o, i, dt, _SUM, 0, async_op, timeout, (output, input))

    @_refusing(_lib.OP_ALL_TO_ALL_V)
    def all_to_all_v_single(self, output, input, output_split_sizes: Optional[Sequence[int]],
                            input_split_sizes: Optional[Sequence[int]], async_op: bool = False, hints=None,
                            timeout=None) -> Work:
        """all_to_all_single with blocks of different sizes: input is cut
        along dim 0 by input_split_sizes (rows; block r goes to rank r),
        output by output_split_sizes (block r comes from rank r). An empty
        or None list cuts in equal blocks."""
        o, i, dt = self._pair(output, input, "all_to_all_v_single")
        out_counts = _rows(output, output_split_sizes, self._size, "all_to_all_v_single: output")
        in_counts = _rows(input, input_split_sizes, self._size, "all_to_all_v_single: input")
        return self._opv(_lib.OP_ALL_TO_ALL_V, o, i, dt, _SUM, out_counts, in_counts, async_op, timeout, (output, input))

    @_refusing(_lib.OP_ALL_TO_ALL_V)
    def all_to_all(self, output_tensor_list: Sequence, input_tensor_list: Sequence, async_op: bool = False, hints=None,
                   timeout=None) -> Work:
        """Send input_tensor_list[r] to rank r and receive rank r's tensor
        into output_tensor_list[r]; sizes may differ per peer."""
        ins = self._same(self._list(input_tensor_list, "all_to_all: input_tensor_list"), "input_tensor_list")
        dt = self._check_tensor(input_tensor_list[0], "input_tensor_list[0]")[2]
        outs = self._same(self._list(output_tensor_list, "all_to_all: output_tensor_list"), "output_tensor_list", None,
                          dt)
        joined, kept_in = self._joined(ins, input_tensor_list, None, dt)
        out, after, kept_out = self._landing(outs, output_tensor_list, dt, input_tensor_list[0])
        return self._opv(_lib.OP_ALL_TO_ALL_V, out, joined, dt, _SUM, [k for _, k in outs], [k for _, k in ins],
                         async_op, timeout, (kept_in, kept_out), after)

    @_refusing(_lib.OP_SCATTER)
    def scatter(self, output_tensor, input_tensor_list: Optional[Sequence], root: int, async_op: bool = False,
                hints=None, timeout=None) -> Work:
        """Send input_tensor_list[r] of root to rank r's output_tensor."""
        optr, n, dt = self._check_tensor(output_tensor, "output_tensor")
        root = self._root(root)
        if self._rank != root:
            return self._op(_lib.OP_SCATTER, (optr, n), None, dt, _SUM, root, async_op, timeout, output_tensor)
        ins = self._same(self._list(input_tensor_list, "scatter: input_tensor_list"), "input_tensor_list", n, dt)
        joined, kept = self._joined(ins, input_tensor_list, None, dt)
        return self._op(_lib.OP_SCATTER, (optr, n), joined, dt, _SUM, root, async_op, timeout, (output_tensor, kept))

    @_refusing(_lib.OP_GATHER)
    def gather(self, output_tensor_list: Optional[Sequence], input_tensor, root: int, async_op: bool = False,
               hints=None, timeout=None) -> Work:
        """Collect every rank's input_tensor into root's output_tensor_list."""
        iptr, n, dt = self._check_tensor(input_tensor, "input_tensor")
        root = self._root(root)
        if self._rank != root:
            return self._op(_lib.OP_GATHER, (None, 0), (iptr, n), dt, _SUM, root, async_op, timeout, input_tensor)
        outs = self._same(self._list(output_tensor_list, "gather: output_tensor_list"), "output_tensor_list", n, dt)
        out, after, kept = self._landing(outs, output_tensor_list, dt, input_tensor)
        return self._op(_lib.OP_GATHER, out, (iptr, n), dt, _SUM, root, async_op, timeout, (input_tensor, kept), after)

    @_refusing(_lib.OP_GATHER)
    def gather_single(self, output, input, root: int, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Collect every rank's input into root's output (size × input
        elements, rank order); output is ignored off root."""
        iptr, n, dt = self._check_tensor(input, "input")
        root = self._root(root)
        if self._rank != root:
            return self._op(_lib.OP_GATHER, (None, 0), (iptr, n), dt, _SUM, root, async_op, timeout, input)
        o, i, dt = self._pair(output, input, "gather_single")
        if o[1] != n * self._size:
            raise _inv("gather_single: output has %d elements, want %d × %d" % (o[1], self._size, n))
        return self._op(_lib.OP_GATHER, o, i, dt, _SUM, root, async_op, timeout, (output, input))

    @_refusing(_lib.OP_BARRIER)
    def barrier(self, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Return once every rank has entered the barrier."""
        return self._op(_lib.OP_BARRIER, (None, 0), None, _tensors.FLOAT32, _SUM, 0, async_op, timeout, None)

    @_refusing(_lib.OP_SEND, "dst")
    def send(self, tensor, dst: int, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Send tensor to rank dst, which posts a matching recv."""
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        return self._op(_lib.OP_SEND, (ptr, n), None, dt, _SUM, self._peer(dst), async_op, timeout, tensor)

    @_refusing(_lib.OP_RECV, "src")
    def recv(self, tensor, src: int, async_op: bool = False, hints=None, timeout=None) -> Work:
        """Receive into tensor from rank src."""
        ptr, n, dt = self._check_tensor(tensor, "tensor")
        return self._op(_lib.OP_RECV, (ptr, n), None, dt, _SUM, self._peer(src), async_op, timeout, tensor)

    def batch_op_create(self) -> BatchSendRecv:
        """A batch of sends and receives to issue together."""
        return BatchSendRecv(self)

    # ---- failure handling and reconfiguration ----

    def revoke(self, reason: str = "") -> None:
        """Revoke the comm (MPI ULFM semantics): every pending and later op
        fails with RevokedError, here and, as it propagates, at every rank.
        shrink and finalize still work."""
        _lib.check(_lib.lib().ftcomm_comm_revoke(self._handle(), reason.encode()))

    def abort(self, reason: str = "") -> None:
        """Abort the comm: the running op fails at once; no more collectives
        (shrink, reconfigure and finalize still work)."""
        if self._h is not None:
            _lib.check(_lib.lib().ftcomm_comm_abort(self._h, reason.encode()))
        self._aborted = True

    def is_abort_supported(self) -> bool:
        return True

    def is_aborted(self) -> bool:
        return self._aborted

    def _derived(self, h: int, store, own, name=None, prefix=None, members=None) -> "Communicator":
        c = Communicator(h, store, own, self._device, self._backend, prefix or self._prefix, self._options,
                         self._log_level, name or self._name)
        c._members = members
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
        calls it, each with the ranks of its own new comm (disjoint lists); a
        rank in no new comm passes [] and gets None. This comm stays usable.

        A list with duplicates, or without the calling rank, raises
        InvalidArgumentError (a RuntimeError). A rank that refuses its list
        still takes part in the exchange (as a rank in no comm), so ranks
        that listed it fail too instead of waiting: the members of a new
        comm each check that every rank of their list made the same list.
        """
        h = self._handle()
        bad = None
        try:
            ranks = [int(r) for r in ranks]
        except (TypeError, ValueError):
            bad, ranks = _inv("split: ranks %r: want a list of ints" % (ranks,)), []
        if bad is None and len(set(ranks)) != len(ranks):
            bad = _inv("split: ranks %s list a rank twice" % ranks)
        if bad is None and ranks and self._rank not in ranks:
            bad = _inv("split: ranks %s do not include this rank (%d); a rank in no new comm passes []" % (
                ranks, self._rank))
        if bad is None and any(not 0 <= r < self._size for r in ranks):
            bad = _inv("split: ranks %s outside [0, %d)" % (ranks, self._size))
        color, key = -1, 0
        if bad is None and ranks:
            # The color names the list itself: only ranks that made exactly
            # this list end up in the same comm.
            # (31 bits: NCCL's colors are non-negative C ints.)
            digest = hashlib.blake2b(json.dumps(ranks).encode(), digest_size=4).digest()
            color, key = int.from_bytes(digest, "little") & 0x7fffffff, ranks.index(self._rank)
        out = c_uint64()
        _lib.check(_lib.lib().ftcomm_comm_split(h, color, key, _lib.timeout_ns(timeout), byref(out)))
        if bad is not None:
            raise bad
        if not out.value:
            return None
        c = self._derived(out.value, self._store, False, name=name or "%s.split" % self._name)
        if c._size != len(ranks) or c._rank != key:
            c._free()
            raise _inv("split: ranks %s: only %d of them passed this same list (every rank of a new comm must)" % (
                ranks, c._size))
        self._children.append(c)
        return c

    def reconfigure(self, uuid: int, init_handles: Union[Sequence[str], Set[str]], timeout=None,
                    hints=None) -> Work:
        """Make this comm the comm of the ranks whose init handles are listed
        (torchcomms' reconfigure; the comm must come from new_comm(...,
        enable_reconfigure=True)). A list gives the ranks in its order, a set
        in sorted order; every member passes the same handles and uuid. When
        the members are a subset of this comm's, in the same order, this is
        a shrink (the others are left out: dead or gone ranks need not take
        part); when this comm's members keep their ranks and others join, a
        grow; otherwise a new comm. Runs to completion before it returns
        (the Work is done)."""
        if not self._options.enable_reconfigure:
            raise _inv("reconfigure: this communicator was made without enable_reconfigure=True")
        if isinstance(init_handles, (set, frozenset)):
            members = sorted(str(x) for x in init_handles)
        else:
            members = [str(x) for x in init_handles]
        if not members or len(set(members)) != len(members):
            raise _inv("reconfigure: init_handles %r: want distinct handles" % (members,))
        if self._init_handle not in members:
            raise _inv("reconfigure: this comm's init handle is not among init_handles")
        if self._finalized:
            raise ClosedError("ftcomm: communicator %r was finalized" % self._name, kinds=("closed",))
        digest = hashlib.blake2b("\n".join(members).encode(), digest_size=8).hexdigest()
        key = "ftcomm/%s/reconfigure/%d/%s" % (self._name, int(uuid), digest)
        old = self._members if self._h is not None else None
        if old is not None and len(members) < len(old) and members == [m for m in old if m in set(members)]:
            # Every member is in this comm, in its order: all of them decide
            # the same (they share this comm's member list). The same
            # members again make a new comm (below): that repairs a broken
            # one.
            nc, prefix = self._shrunk([r for r, m in enumerate(old) if m not in set(members)], timeout), self._prefix
        elif old is not None and len(members) > len(old) and members[:len(old)] == old:
            nc, prefix = self._grown(len(members), key, timeout), self._prefix  # this comm's rank 0 is the new one's
        elif members[0] == self._init_handle:
            nc, prefix = self._fresh(members, key, timeout), key  # rank 0 of a comm that is neither
        elif self._store_get(key + "/how") == b"grow":  # rank 0 decided
            nc, prefix = self._join(members, key, timeout)
        else:
            nc, prefix = self._fresh(members, key, timeout), key
        self._prefix = prefix
        self._adopt(nc, members)
        return DONE

    def _store_get(self, key: str) -> bytes:
        return self._store.get(key, timeout=_rendezvous.seconds(self._options.timeout))

    def _shrunk(self, exclude: List[int], timeout) -> int:
        out = c_uint64()
        arr = (c_int64 * max(len(exclude), 1))(*exclude)
        _lib.check(_lib.lib().ftcomm_comm_shrink(self._h, arr, len(exclude), -1, _lib.timeout_ns(timeout), byref(out)))
        return out.value

    def _grown(self, size: int, key: str, timeout) -> int:
        if self._rank == 0 and self._store is not None:
            self._store.set(key + "/grow", json.dumps({"prefix": self._prefix, "epoch": self._epoch + 1}))
            self._store.set(key + "/how", "grow")
        out = c_uint64()
        _lib.check(_lib.lib().ftcomm_comm_grow(self._h, int(size), self._epoch + 1, _lib.timeout_ns(timeout), byref(out)))
        return out.value

    def _join(self, members: List[str], key: str, timeout):
        g = json.loads(self._store_get(key + "/grow"))
        h = self._connect(members.index(self._init_handle), len(members), g["prefix"], g["epoch"], True, timeout)
        return h, g["prefix"]

    def _fresh(self, members: List[str], key: str, timeout) -> int:
        rank = members.index(self._init_handle)
        if rank == 0 and self._store is not None:
            self._store.set(key + "/how", "new")
        # Epoch 0 at a prefix of its own: members may come from comms of
        # different epochs.
        return self._connect(rank, len(members), key, 0, False, timeout)

    def _connect(self, rank: int, size: int, prefix: str, epoch: int, joining: bool, timeout) -> int:
        if size > 1 and self._store is None:
            raise _inv("reconfigure: %d members need a store (pass store= to new_comm)" % size)
        return _rendezvous.connect(self._backend, self._name, rank, size, prefix, epoch, joining, self._store,
                                   self._options, self._dev if self._dev >= 0 else None, self._log_level, timeout)

    def _adopt(self, h: int, members: List[str]) -> None:
        """Become the comm of handle h (the old one, if any, is closed)."""
        old, self._h = self._h, h
        if old is not None and old != h and not _lib.forked:
            _lib.lib().ftcomm_comm_free(old)
            self._inflight.release()
        self._members = members
        self._aborted = False
        self._load_info()

    # ---- ending ----

    def _free(self) -> None:
        h, self._h = self._h, None
        self._finalized = True
        if h is not None and not _lib.forked:
            st = _lib.lib().ftcomm_comm_free(h)
            self._inflight.release()  # the comm is closed: every op has ended
            _lib.check(st)

    def finalize(self) -> None:
        """Close the comm (a pending op fails with ClosedError) and release
        what it holds; the store it hosted stops after the comms split from
        it are finalized too. Safe to call twice."""
        if self._finalized:
            return
        self._free()
        if self._own_store and self._store is not None and not any(c._h is not None for c in self._children):
            self._store.close()
        if self._boot is not None:
            self._boot.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.finalize()

    def __del__(self):
        try:
            if self._h is not None and not _lib.forked:
                _lib.lib().ftcomm_comm_free(self._h)
                self._h = None
                self._inflight.release()
        except Exception:
            pass

    def __repr__(self):
        return "Communicator(%s, %s, rank %d/%d, epoch %d%s)" % (
            self._name, self._backend, self._rank, self._size, self._epoch, "" if self._h else ", finalized")


TorchComm = Communicator


def new_comm(backend: str, device: Any = "cpu", name: Optional[str] = None,
             abort_process_on_timeout_or_error: Optional[bool] = None, timeout=None,
             is_high_priority_stream: Optional[bool] = None, store=None, enable_reconfigure: bool = False,
             hints: Optional[Dict[str, str]] = None, *, rank: Optional[int] = None, size: Optional[int] = None,
             epoch: int = 0, prefix: Optional[str] = None, log_level: Optional[str] = None) -> Communicator:
    """This rank's communicator, as torchcomms.new_comm (same arguments, in
    the same order).

    backend: "gloo" (CPU tensors, numpy arrays) or "nccl" (CUDA tensors).
    device: "cpu", or a CUDA device; a CUDA device without an index means
    cuda:LOCAL_RANK (torchrun's), and becomes the current device.
    name: the comm's name (default "main"); its keys in the store are
    ftcomm/<name>/<n>, n counting this process's comms of that name.
    abort_process_on_timeout_or_error: a timeout or failure that breaks the
    comm aborts the process (SIGABRT), as torchcomms does by default. Default
    False here: the error is raised, and the comm can be shrunk, regrown or
    reconfigured (ftcomm's point).
    timeout: each op's default deadline (seconds or timedelta; default
    60 s), also the bound of the rendezvous (which waits at least 60 s:
    processes start at different times).
    is_high_priority_stream: accepted; ftcomm's NCCL streams have the
    default priority.
    store: where the ranks meet: None (torchrun's MASTER_ADDR/MASTER_PORT),
    an ftcomm.Store, "host:port" of an ftcomm store, or a
    torch.distributed.Store.
    enable_reconfigure: make the comm unconnected, to be formed by
    reconfigure() from the members' init handles (torchcomms' fault
    tolerance API).
    hints: backend settings: "listen_addr" (gloo, for ranks on several
    hosts), "shared_memory" ("0" off), "revoke" (nccl: "native"); others are
    accepted and ignored.
    rank, size: default RANK and WORLD_SIZE from the environment (one rank
    when neither is set and no store is given).
    epoch, prefix: for joiners of a grow (see Communicator.grow).
    """
    if _lib.forked:
        raise _lib._fork_error()
    # torchcomms' other names of an NCCL comm: ncclx (Meta's NCCL) and
    # nccl-lazy (pair comms made at the first send or receive; ftcomm's NCCL
    # comm serves point to point from the start).
    backend = {"ncclx": "nccl", "cuda": "nccl", "nccl-lazy": "nccl"}.get(backend, backend)
    if backend not in ("gloo", "nccl"):
        raise _inv("backend %r: want 'gloo' or 'nccl'" % (backend,))
    name = name or "main"
    if rank is None:
        rank = _devices.env_int("RANK")
    if size is None:
        size = _devices.env_int("WORLD_SIZE")
    if rank is None and size is None and (store is None or enable_reconfigure):
        rank, size = 0, 1  # a reconfigurable comm's members are named by reconfigure()
    if rank is None or size is None:
        raise _inv("rank and size: pass them or set RANK and WORLD_SIZE")
    options = CommOptions(abort_process_on_timeout_or_error=bool(abort_process_on_timeout_or_error), timeout=timeout,
                          name=name, enable_reconfigure=enable_reconfigure, hints=hints)
    device, dev_settings = _devices.choose(backend, device, rank)
    _lib.ensure_interrupt_chain()

    gen = _rendezvous.generations.next(name)
    joining = prefix is not None
    pfx = prefix or "ftcomm/%s/%d" % (name, gen)
    st, own, boot = _rendezvous.open_store(store, rank, size, pfx, timeout, enable_reconfigure)
    # The options name the store the comm uses (an ftcomm.Store), not a
    # torch store it was bootstrapped through: holding that would keep its
    # server (MASTER_PORT, often) for as long as the comm lives.
    options.store = st
    if enable_reconfigure:
        # Unconnected until reconfigure() names its members; the bootstrap
        # (peers may still read it) goes with the comm.
        c = Communicator(None, st, own, device, backend, pfx, options, log_level, name)
        c._boot = boot
        return c
    try:
        h = _rendezvous.connect(backend, name, rank, size, pfx, epoch, joining, st, options, dev_settings, log_level)
    except BaseException:
        if own and st is not None:
            st.close()
        if boot is not None:
            boot.close()
        raise
    c = Communicator(h, st, own, device, backend, pfx, options, log_level, name)
    if boot is not None:
        # MASTER_PORT is free again once every rank has let go of it.
        boot.close()
        c.barrier()
    return c
