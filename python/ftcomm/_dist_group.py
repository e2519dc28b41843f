"""ProcessGroupFtcomm, the process group of torch.distributed's "ftcomm"
backend: its ops, issued on the ftcomm communicator of their tensors'
device (ftcomm.comm), their Works (_dist_works), torch's reduce ops
(_dist_reduce_ops) and errors (_dist_errors). What it promises is in
ftcomm.distributed's docstring; that module makes and registers groups,
and is where users name this class.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _lib, _tensors
from ._completer import Completer
from ._dist_errors import dist_error, global_ranks, unsupported
from ._dist_reduce_ops import factor_tensor, from_torch
from ._dist_works import _CudaWork, _DoneWork, _Group, _HostWork, _SyncedCudaWork, _Work, hold_work
from ._refusal import c_rank, issuing, refusing
from .comm import Communicator, new_comm
from .errors import FtcommError, InvalidArgumentError
from .reduce_op import ReduceOp
from .store import Store

BACKEND = "ftcomm"


def timeout_s(timeout) -> Optional[float]:
    """A timeout (seconds, a timedelta or None) in seconds (or None)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


# ---------------------------------------------------------------- tensors

def _tensors_in(args) -> List[torch.Tensor]:
    """The torch tensors among args and the lists in them (one level)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    out.append(b)
                elif isinstance(b, (list, tuple)):
                    out.extend(x for x in b if isinstance(x, torch.Tensor))
    return out


def _dense(t: torch.Tensor, write: bool):
    """(a tensor ftcomm takes, what to run after the op): a contiguous view
    of t, or a contiguous copy (copied back after the op when write); a
    complex tensor as its real view."""
    post = None
    u = t
    if not u.is_contiguous():
        u = u.contiguous()
        if write:
            post = (lambda dst=t, src=u: dst.copy_(src))
    if u.is_complex():
        u = torch.view_as_real(u)
    return u, post


def _listed(tensors) -> List[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _device_of(tensors: Sequence[torch.Tensor]) -> torch.device:
    dev = None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError("ftcomm process group: %r is not a tensor" % (t,), kinds=("invalid_argument",))
        if dev is None:
            dev = t.device
        elif t.device != dev:
            raise unsupported("tensors on %s and %s in one call: one device per call" % (dev, t.device))
    if dev is None:
        raise unsupported("no tensors")
    return dev


def _refuse_op(pg: "ProcessGroupFtcomm", kind: int, exc: BaseException, args, kwargs) -> None:
    pg._refuse(kind, exc, _tensors_in(args) + _tensors_in(kwargs.values()))


def _refusing(kind: int):
    """Decorator of a ProcessGroupFtcomm collective: if it fails before the
    op reaches its communicator (the group's own checks, or anything else
    first), the op is refused on the comm of its tensors' device, so that
    the peers' matching call fails at once (PeerRefusedError) instead of
    waiting for its deadline. The communicator's own ops do the same for
    what they check: one mechanism, ftcomm._refusal."""
    return refusing(kind, _refuse_op)


# ---------------------------------------------------------------- the group

_names = iter(range(1 << 62))


class ProcessGroupFtcomm(dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose ops run on ftcomm communicators.

    Made by ``init_process_group("ftcomm")``/``new_group(backend="ftcomm")``
    (through the creator :func:`create_process_group`), or around existing
    communicators with :func:`process_group`. ``comms`` maps a device type
    ("cpu", "cuda") to the communicator of that device; with a ``store`` the
    group makes a device's comm when its first collective comes.
    """

    __module__ = "ftcomm.distributed"  # where users name it (reprs, tracebacks)

    def __init__(self, rank: int, size: int, *, comms: Optional[Dict[str, Communicator]] = None,
                 store: Optional[Store] = None, own_store: bool = False, timeout=None, name: Optional[str] = None,
                 own_comms: bool = True, hints: Optional[Dict[str, str]] = None):
        try:
            super().__init__(rank, size)
        except TypeError:  # a torch whose ProcessGroup takes a store first
            super().__init__(dist.HashStore(), rank, size)
        self._r, self._n = rank, size
        self._comms: Dict[Any, Communicator] = {}
        for k, c in (comms or {}).items():
            self._comms[self._key(torch.device(k) if isinstance(k, str) else k, c)] = c
        self._own_comms = own_comms
        self._store = store
        self._own_store = own_store
        self._timeout = timeout
        self._name = name or "ftcomm-pg-%d" % next(_names)
        self._hints = hints
        self._lock = threading.RLock()
        self._streams: Dict[Any, Any] = {}
        self._completers: Dict[int, Completer] = {}
        self._pending: List[Tuple[str, torch.Tensor, int, _Work]] = []
        self._coalescing: Optional[List[_Work]] = None
        self._group_name: Optional[str] = None
        self._group_desc: Optional[str] = None
        self._closed = False
        self._held: "collections.OrderedDict[int, _Work]" = collections.OrderedDict()

    def _hold(self, w: "_Work") -> None:
        hold_work(self._held, w)

    # ---- what it is ----

    def _describe(self) -> str:
        return repr(self._group_name or self._name)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def _get_backend_name(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return self._group_name or self._name

    @property
    def group_desc(self) -> str:
        return self._group_desc or self.group_name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def _get_backend(self, device=None) -> "_BackendView":
        """What torch asks of a group's per-device backend (and torchcomms'
        BackendWrapper: get_comm())."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return _BackendView(self, dev)

    def comm(self, device="cpu") -> Communicator:
        """The communicator of a device type ("cpu" or "cuda[:i]"), made if
        needed (a collective call: every rank of the group makes it)."""
        return self._comm_for(torch.device(device), True)

    def __repr__(self):
        return "ProcessGroupFtcomm(%s, rank %d of %d, %s)" % (self._describe(), self._r, self._n,
                                                             ", ".join(str(k) for k in self._comms) or "no comms")

    # ---- comms, streams, threads ----

    @staticmethod
    def _key(dev: torch.device, c: Optional[Communicator] = None):
        if dev.type == "cpu":
            return "cpu"
        idx = dev.index
        if idx is None and c is not None:
            idx = c._dev
        if idx is None:
            idx = torch.cuda.current_device()
        return (dev.type, idx)

    def _comm_for(self, dev: torch.device, collective: bool) -> Communicator:
        key = self._key(dev)
        c = self._comms.get(key)
        if c is not None:
            return c
        if self._closed:
            raise FtcommError("ftcomm: process group %s was shut down" % self._describe(), kinds=("closed",))
        if dev.type != "cuda":
            raise unsupported("tensors on %s: this group serves %s" % (dev, ", ".join(str(k) for k in self._comms)))
        if self._store is None:
            raise unsupported("tensors on %s: this group has no communicator for them (it was made from "
                               "communicators, and none runs on CUDA)" % (dev,))
        if not collective:
            raise unsupported("the first op on %s is point-to-point: the group makes its NCCL communicator at a "
                               "collective of all its ranks; run one (a barrier on a CUDA tensor, or "
                               "pg.comm('cuda')) first" % (dev,))
        with self._lock:
            c = self._comms.get(key)
            if c is None:
                # The name is the same at every rank (each runs its own
                # device: the ordinal is no part of it, or the ranks would
                # look for each other under different keys).
                c = new_comm("nccl", torch.device("cuda", key[1]), name=self._name + "-cuda",
                             store=self._store, rank=self._r, size=self._n, timeout=self._timeout, hints=self._hints)
                self._comms[key] = c
        return c

    def _stream(self, dev: torch.device):
        key = self._key(dev)
        s = self._streams.get(key)
        if s is None:
            with self._lock:
                s = self._streams.get(key)
                if s is None:
                    s = torch.cuda.Stream(device=torch.device("cuda", key[1]))
                    self._streams[key] = s
        return s

    def _completer(self, comm: Optional[Communicator]) -> Completer:
        k = id(comm)
        c = self._completers.get(k)
        if c is None:
            with self._lock:
                c = self._completers.get(k)
                if c is None:
                    c = Completer("ftcomm-pg-" + self._name)
                    self._completers[k] = c
        return c

    # ---- issuing ----

    def _issue(self, tensors: Sequence[torch.Tensor], run: Callable[[Communicator, bool], Any], result,
               posts=(), touched: Optional[Sequence[torch.Tensor]] = None, opts=None) -> _Work:
        """Run one op over the comm of the tensors' device: run(comm,
        async_op) issues it; posts run once it is done. opts are torch's
        options of the call: a CUDA op that torch issues with async_op=False
        (opts.asyncOp, torch >= 2.7) runs ordered with the current stream
        itself, as torch's NCCL backend runs such an op, not on the group's
        side stream."""
        dev = _device_of(tensors)
        try:
            if self._pending:
                self._flush_p2p()
                issuing.done = False  # that was the held sends and receives; this op is still to come
            comm = self._comm_for(dev, True)
            if dev.type == "cpu":
                w = run(comm, True)
                work: _Work = _HostWork(self, comm, [w], result, posts)
            elif getattr(opts, "asyncOp", True) is False:
                # The current stream waits for the op (StreamOrder), so
                # what torch queues there next, the posts' copies
                # included, sees its result; no side stream, event or
                # record_stream is needed, and the Work is done: a tensor
                # of the current stream (the copies of _dense included)
                # that the caller drops is reused only behind the op, as
                # under torch's NCCL backend, which runs such an op on the
                # current stream.
                run(comm, False)
                for p in posts:
                    if p is not None:
                        p()
                work = _DoneWork(self, result)
            else:
                work = self._cuda(comm, dev, lambda: run(comm, False), touched or tensors, posts, result)
        except FtcommError as e:
            err = self._op_failed(dist_error(e, self))
            if err is not None:
                raise err from None
            work = _DoneWork(self, result)  # a failure the group's owner took: the outputs are undefined
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _op_failed(self, err: BaseException) -> Optional[BaseException]:
        """What an op's failure raises: err, here. A group whose owner takes
        its failures (ftcomm.ft_torch.ShardGroup: the step's commit fails)
        returns None, and the op completes with its outputs undefined."""
        return err

    def _cuda(self, comm, dev, enqueue, touched, posts, result) -> _CudaWork:
        cur = torch.cuda.current_stream(dev)
        s = self._stream(dev)
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            enqueue()
            for p in posts:
                if p is not None:
                    p()
            for t in touched:
                t.record_stream(s)
            ev = torch.cuda.Event()
            ev.record(s)
        return _CudaWork(self, comm, dev, result, ev)

    def _refuse(self, kind: int, exc: BaseException, tensors: Sequence[torch.Tensor], peer: int = 0) -> None:
        """Refuse an op of kind that failed here before it reached a
        communicator, on the comm of its tensors' device (the CPU comm, or
        the only one, when no tensor says)."""
        c = None
        if tensors:
            c = self._comms.get(self._key(tensors[0].device))
        if c is None:
            c = self._comms.get("cpu") or (next(iter(self._comms.values())) if len(self._comms) == 1 else None)
        if c is not None:
            c._refuse(kind, exc, peer)

    # ---- point to point: held, then issued as one batch ----

    def _p2p(self, kind: str, tensors: List[torch.Tensor], peer: int) -> _Work:
        try:
            if len(tensors) != 1:
                raise unsupported("%s takes one tensor (got %d)" % (kind, len(tensors)))
            t = tensors[0]
            dev = _device_of([t])
            if not 0 <= peer < self._n or peer == self._r:
                raise unsupported("%s: peer %d (this is rank %d of %d)" % (kind, peer, self._r, self._n))
        except Exception as e:
            # After the sends and receives held before it, in their order.
            if self._pending:
                self._flush_p2p()
            self._refuse(_lib.OP_SEND if kind == "send" else _lib.OP_RECV, e, _tensors_in([tensors]),
                         c_rank(peer))
            raise
        try:
            comm = self._comm_for(dev, False)
        except FtcommError as e:
            err = self._op_failed(dist_error(e, self))
            if err is not None:
                raise err from None
            w0 = _DoneWork(self, [t])  # a failure the group's owner took
            if self._coalescing is not None:
                self._coalescing.append(w0)
            return w0
        u, post = _dense(t, kind == "recv")
        with self._lock:
            if self._pending and self._pending[0][4] is not comm:
                self._flush_p2p()
            if dev.type == "cpu":
                w: _Work = _HostWork(self, comm, [], [t], [post], p2p=True)
            else:
                w = _CudaWork(self, comm, dev, [t], None, p2p=True)
                w._post = post
            self._pending.append((kind, u, peer, w, comm))
        if self._coalescing is not None:
            self._coalescing.append(w)
        return w

    def _flush_p2p(self) -> None:
        with self._lock:
            ops, self._pending = self._pending, []
        if not ops:
            return
        comm = ops[0][4]
        dev = ops[0][1].device

        def enqueue(async_op):
            b = comm.batch_op_create()
            for kind, u, peer, _, _ in ops:
                (b.send if kind == "send" else b.recv)(u, peer)
            return b.issue(async_op=async_op)

        try:
            if dev.type == "cpu":
                fw = enqueue(True)
                for _, _, _, w, _ in ops:
                    w._works = [fw]
                    w._p2p = None
            else:
                posts = [w._post for _, _, _, w, _ in ops]
                cw = self._cuda(comm, dev, lambda: enqueue(False), [u for _, u, _, _, _ in ops], posts, [])
                for _, _, _, w, _ in ops:
                    w._event = cw._event
                    w._p2p = None
        except FtcommError as e:
            err = self._op_failed(dist_error(e, self))
            for _, _, _, w, _ in ops:
                if isinstance(w, _HostWork):
                    w._works, w._p2p, w._done, w._err = [], None, True, err
                else:
                    w._p2p = None  # nothing enqueued: its wait has no event to wait for
            if err is not None:
                raise err from None

    def send(self, tensors, dstRank, tag=0):  # noqa: N803 - torch's names
        return self._p2p("send", _listed(tensors), dstRank)

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803
        return self._p2p("recv", _listed(tensors), srcRank)

    def recv_anysource(self, tensors, tag=0):
        raise unsupported("recv without src (from any source) is not supported: name the source rank")

    # ---- coalescing (torch.distributed._coalescing_manager) ----

    def _start_coalescing(self, device=None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device=None) -> _Work:
        works, self._coalescing = self._coalescing or [], None
        if self._pending:
            self._flush_p2p()
        return _Group(self, works, [])

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing

    # ---- collectives (torch's ProcessGroup methods) ----

    def _reduction(self, opts, tensors: Sequence[torch.Tensor] = ()) -> ReduceOp:
        """ftcomm's ReduceOp for the options of a reduction (their reduceOp;
        opts may be torch's op itself), refused as torch's distributed
        error. A PREMUL_SUM's tensor factor is checked against every tensor
        of the call here, before any of its ops is issued (a coalesced call
        is several)."""
        try:
            op = from_torch(opts.reduceOp if hasattr(opts, "reduceOp") else opts)
            if op.factor is not None:
                for dt in {t.dtype for t in tensors}:
                    code = _tensors.torch_dtype_code(dt)
                    if code is not None:
                        _tensors.check_factor(op.factor, code)
            return op
        except FtcommError as e:
            raise dist_error(e, self) from None

    @_refusing(_lib.OP_ALL_REDUCE)
    def allreduce(self, tensors, opts=None):
        tensors = _listed(tensors)
        if len(tensors) == 1:
            op = self._reduction(opts, tensors)
            t = tensors[0]
            u, post = _dense(t, True)
            return self._issue([t], lambda c, a: c.all_reduce(u, op, async_op=a), [t], [post],
                               [u] + factor_tensor(op, t.device), opts)
        return self.allreduce_coalesced(tensors, opts)

    @_refusing(_lib.OP_ALL_REDUCE)
    def allreduce_coalesced(self, tensors, opts=None):
        op = self._reduction(opts, tensors)
        if not tensors:
            return _DoneWork(self, [])
        dev = _device_of(tensors)
        if len(tensors) == 1:
            t = tensors[0]
            u, post = _dense(t, True)
            return self._issue([t], lambda c, a: c.all_reduce(u, op, async_op=a), [t], [post],
                               [u] + factor_tensor(op, dev), opts)
        # One all-reduce per dtype over a flat copy, copied back after.
        works = []
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for ts in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in ts])

            def back(ts=ts, flat=flat):
                off = 0
                for t in ts:
                    n = t.numel()
                    t.copy_(flat[off:off + n].view_as(t))
                    off += n

            u, _ = _dense(flat, False)
            works.append(self._issue([flat], lambda c, a, u=u: c.all_reduce(u, op, async_op=a), [flat], [back],
                                     [u] + factor_tensor(op, dev), opts))
        return _Group(self, works, list(tensors))

    @_refusing(_lib.OP_BROADCAST)
    def broadcast(self, tensors, opts=None):
        tensors = _listed(tensors)
        root = opts if isinstance(opts, int) else getattr(opts, "rootRank", 0)
        if len(tensors) != 1:
            works = [self.broadcast([t], opts) for t in tensors]
            return _Group(self, works, list(tensors))
        t = tensors[0]
        u, post = _dense(t, True)
        return self._issue([t], lambda c, a: c.broadcast(u, root, async_op=a), [t], [post], [u], opts)

    @_refusing(_lib.OP_REDUCE)
    def reduce(self, tensors, opts=None):
        op = self._reduction(opts, tensors)
        root = getattr(opts, "rootRank", 0)
        if len(tensors) != 1:
            raise unsupported("reduce takes one tensor (got %d)" % len(tensors))
        t = tensors[0]
        u, post = _dense(t, True)
        return self._issue([t], lambda c, a: c.reduce(u, root, op, async_op=a), [t], [post],
                           [u] + factor_tensor(op, t.device), opts)

    @_refusing(_lib.OP_ALL_GATHER)
    def allgather(self, output_tensors, input_tensors, opts=None):
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise unsupported("allgather takes one input tensor and one output list (got %d, %d)" % (
                len(input_tensors), len(output_tensors)))
        outs, inp = list(output_tensors[0]), input_tensors[0]
        if len(outs) != self._n:
            raise unsupported("allgather: %d output tensors for %d ranks" % (len(outs), self._n))
        i, _ = _dense(inp, False)
        dense = [_dense(o, True) for o in outs]
        us = [d[0] for d in dense]
        return self._issue([inp] + outs, lambda c, a: c.all_gather(us, i, async_op=a), outs,
                           [d[1] for d in dense], us + [i], opts)

    @_refusing(_lib.OP_ALL_GATHER)
    def _allgather_base(self, output, input, opts=None):
        o, post = _dense(output, True)
        i, _ = _dense(input, False)
        return self._issue([output, input], lambda c, a: c.all_gather_single(o, i, async_op=a), [output], [post],
                           [o, i], opts)

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        works = [self.allgather([outs], [inp], opts) for outs, inp in zip(output_lists, input_list)]
        return _Group(self, works, [t for outs in output_lists for t in outs])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Group(self, works, list(outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_refusing(_lib.OP_REDUCE_SCATTER)
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = self._reduction(opts, list(output_tensors) + [t for ts in input_tensors for t in ts])
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise unsupported("reduce_scatter takes one output tensor and one input list")
        out, ins = output_tensors[0], list(input_tensors[0])
        if len(ins) != self._n:
            raise unsupported("reduce_scatter: %d input tensors for %d ranks" % (len(ins), self._n))
        o, post = _dense(out, True)
        us = [_dense(t, False)[0] for t in ins]
        return self._issue([out] + ins, lambda c, a: c.reduce_scatter(o, us, op, async_op=a), [out], [post],
                           [o] + us + factor_tensor(op, out.device), opts)

    @_refusing(_lib.OP_REDUCE_SCATTER)
    def _reduce_scatter_base(self, output, input, opts=None):
        op = self._reduction(opts, [output, input])
        o, post = _dense(output, True)
        i, _ = _dense(input, False)
        return self._issue([output, input], lambda c, a: c.reduce_scatter_single(o, i, op, async_op=a), [output],
                           [post], [o, i] + factor_tensor(op, output.device), opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        self._reduction(opts, list(outputs) + list(inputs))  # refused before any op is issued
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Group(self, works, list(outputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @_refusing(_lib.OP_ALL_TO_ALL)
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        o, post = _dense(output, True)
        i, _ = _dense(input, False)
        if output_split_sizes or input_split_sizes:
            ins, outs = list(input_split_sizes or []), list(output_split_sizes or [])
            run = lambda c, a: c.all_to_all_v_single(o, i, outs, ins, async_op=a)
        else:
            run = lambda c, a: c.all_to_all_single(o, i, async_op=a)
        return self._issue([output, input], run, [output], [post], [o, i], opts)

    all_to_all_single = alltoall_base

    @_refusing(_lib.OP_ALL_TO_ALL_V)
    def alltoall(self, output_tensors, input_tensors, opts=None):
        outs = [_dense(t, True) for t in output_tensors]
        ins = [_dense(t, False)[0] for t in input_tensors]
        uo = [d[0] for d in outs]
        return self._issue(list(output_tensors) + list(input_tensors), lambda c, a: c.all_to_all(uo, ins, async_op=a),
                           list(output_tensors), [d[1] for d in outs], uo + ins, opts)

    @_refusing(_lib.OP_GATHER)
    def gather(self, output_tensors, input_tensors, opts=None):
        root = getattr(opts, "rootRank", 0)
        if len(input_tensors) != 1:
            raise unsupported("gather takes one input tensor")
        inp = input_tensors[0]
        i, _ = _dense(inp, False)
        if self._r == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != self._n:
                raise unsupported("gather: the root passes one list of %d output tensors" % self._n)
            outs = list(output_tensors[0])
            dense = [_dense(o, True) for o in outs]
            us = [d[0] for d in dense]
            return self._issue([inp] + outs, lambda c, a: c.gather(us, i, root, async_op=a), outs,
                               [d[1] for d in dense], us + [i], opts)
        return self._issue([inp], lambda c, a: c.gather(None, i, root, async_op=a), [], (), [i], opts)

    @_refusing(_lib.OP_SCATTER)
    def scatter(self, output_tensors, input_tensors, opts=None):
        root = getattr(opts, "rootRank", 0)
        if len(output_tensors) != 1:
            raise unsupported("scatter takes one output tensor")
        out = output_tensors[0]
        o, post = _dense(out, True)
        if self._r == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != self._n:
                raise unsupported("scatter: the root passes one list of %d input tensors" % self._n)
            ins = [_dense(t, False)[0] for t in input_tensors[0]]
            return self._issue([out] + list(input_tensors[0]), lambda c, a: c.scatter(o, ins, root, async_op=a), [out],
                               [post], [o] + ins, opts)
        return self._issue([out], lambda c, a: c.scatter(o, None, root, async_op=a), [out], [post], [o], opts)

    def barrier(self, opts=None):
        """A barrier of the hosts: on the CPU comm when the group has one,
        else on its CUDA comm (whose wait() then waits for the device)."""
        if self._pending:
            self._flush_p2p()
        try:
            c = self._comms.get("cpu")
            if c is not None:
                w = _HostWork(self, c, [c.barrier(async_op=True)], [])
            else:
                key = next((k for k in self._comms if k != "cpu"), None)
                if key is None:
                    raise unsupported("barrier: the group has no communicator")
                c = self._comms[key]
                dev = torch.device("cuda", key[1])
                cw = self._cuda(c, dev, lambda: c.barrier(), [], [], [])
                w = _SyncedCudaWork(self, c, dev, [], cw._event)
        except FtcommError as e:
            err = self._op_failed(dist_error(e, self))
            if err is not None:
                raise err from None
            w = _DoneWork(self, [])  # a failure the group's owner took
        return w

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """gloo's health-checking barrier, through the group's store: every
        rank but 0 checks in, rank 0 waits for each until the deadline and
        raises a RuntimeError naming those that did not (the first one, or
        all with wait_all_ranks), then lets the others go. Nothing is
        broken by a straggler: the comms stay usable."""
        store = self._store
        if store is None:
            c = next(iter(self._comms.values()), None)
            store = c.store if c is not None else None
        if store is None:
            if self._n == 1:
                return None
            raise unsupported("monitored_barrier needs the group's store (this group has none)")
        t = timeout_s(timeout) or timeout_s(self._timeout) or 1800.0
        self._mb = getattr(self, "_mb", 0) + 1
        key = "ftcomm/%s/monitored_barrier/%d" % (self._name, self._mb)
        deadline = time.monotonic() + t
        if self._r != 0:
            store.set("%s/%d" % (key, self._r), "1")
            try:
                store.get(key + "/done", timeout=max(deadline - time.monotonic(), 0.001))
            except FtcommError as e:
                raise dist_error(FtcommError("ftcomm: rank %d: monitoredBarrier: rank 0 did not release it in %d ms "
                                             "(%s)" % (self._r, t * 1000, e.message), kinds=("timeout",)), self) from None
            return None
        missing = []
        for r in range(1, self._n):
            try:
                store.get("%s/%d" % (key, r), timeout=max(deadline - time.monotonic(), 0.001))
            except FtcommError:
                missing.append(r)
                if not wait_all_ranks:
                    break
        if missing:
            if len(missing) == 1 and not wait_all_ranks:
                msg = "Rank %d failed to pass monitoredBarrier in %d ms" % (missing[0], t * 1000)
            else:
                msg = "Ranks %s failed to pass monitoredBarrier in %d ms" % (", ".join(map(str, missing)), t * 1000)
            g = global_ranks(self) or {}
            err = dist_error(FtcommError("ftcomm: [Rank 0]: " + msg, kinds=("timeout",),
                                         ranks=[g.get(r, r) for r in missing]), self)
            raise err
        store.set(key + "/done", "1")
        return None

    # ---- lifetime ----

    def abort(self) -> None:
        for c in list(self._comms.values()):
            try:
                c.abort("process group aborted")
            except FtcommError:
                pass

    def shutdown(self) -> None:
        """Finalize the comms the group made, stop its threads; safe twice."""
        if self._closed:
            return
        self._closed = True
        for c in self._completers.values():
            c.close()
        if self._own_comms:
            for k in sorted(self._comms, key=lambda k: k == "cpu"):  # the CPU comm (its store's host) last
                try:
                    self._comms[k].finalize()
                except FtcommError:
                    pass
        if self._own_store and self._store is not None:
            self._store.close()

    _shutdown = shutdown

    def __del__(self):
        try:
            for c in self._completers.values():
                c.close()
        except Exception:
            pass


class _BackendView:
    """A ProcessGroupFtcomm seen as torch's per-device Backend."""

    supports_splitting = False
    supports_coalescing = False
    options = None

    def __init__(self, pg: ProcessGroupFtcomm, device: torch.device):
        self._pg, self._device = pg, device

    def name(self) -> str:
        return BACKEND

    def get_comm(self) -> Communicator:
        return self._pg._comm_for(self._device, True)

    def rank(self) -> int:
        return self._pg.rank()

    def size(self) -> int:
        return self._pg.size()

    def _set_sequence_number_for_group(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._pg, name)
