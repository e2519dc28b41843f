"""ftcomm as a torch.distributed backend.

``import ftcomm.distributed`` registers the backend ``"ftcomm"`` with
``torch.distributed.Backend.register_backend`` (importing it again, or
calling :func:`register`, does nothing more), so that::

    import torch.distributed as dist
    import ftcomm.distributed                      # registers "ftcomm"
    dist.init_process_group("ftcomm")              # or new_group(ranks, backend="ftcomm")
    model = DistributedDataParallel(model)         # DDP, FSDP, DTensor: unchanged

gives a :class:`ProcessGroupFtcomm`: a ``torch.distributed.ProcessGroup``
written in Python whose collectives run on ftcomm communicators — gloo for
CPU tensors (made with the group), NCCL for CUDA tensors (made at the first
collective on a CUDA device, as torch's NCCL backend does) — one group
serving both, as torch's ``"cpu:gloo,cuda:nccl"``. A group can also wrap
communicators made with :func:`ftcomm.new_comm` (:func:`process_group`,
and ftcomm.device_mesh).

What it promises:

- Work objects (``wait``, ``is_completed``, ``is_success``, ``exception``,
  ``get_future``, ``result``). On CPU an op runs asynchronously on the
  comm's worker; ``get_future()`` completes from a thread of the group when
  the op has ended (DDP's comm hooks chain on it).
- CUDA: the order of torch's NCCL backend. An async op runs on a stream of
  the group (one per device) that first waits for the caller's current
  stream; ``wait()`` makes the caller's current stream wait for the op,
  without blocking the host; ``get_future()`` is a CUDA future whose value
  is ready on the op's stream; the tensors are recorded on that stream for
  the caching allocator. An op torch issues with ``async_op=False``
  (``opts.asyncOp``, torch >= 2.7) is ordered with the current stream
  itself: behind the work queued there, ahead of what is queued next, and
  its Work is done at once. A failure of a CUDA op (a deadline, a dead peer)
  breaks the comm and is raised by the group's next call and by
  ``exception()``.
- Deadlines: every op runs under the group's timeout (init_process_group's
  ``timeout``); past it the op fails and its comm is broken.
- A call refused on one rank (an argument the group or the communicator
  finds invalid there, InvalidArgumentError) is refused on the group's
  comm for its tensors' device, in the op's place: on CPU (gloo) every
  other rank's matching call fails at once with ``PeerRefusedError`` (a
  ``DistBackendError``) naming that rank and its reason, and the group goes
  on; on CUDA (NCCL) the others wait for the op's deadline.
- Failures are torch's distributed errors: every ftcomm error leaves the
  group as an instance of ``torch.distributed.DistBackendError`` (on torch
  versions that have it; :class:`DistBackendError` here otherwise) that is
  also the ftcomm error it came from (``PeerFailedError``,
  ``CommTimeoutError``...), its message naming the failed peers by global
  rank (``.ranks``; ``.group_ranks`` their ranks in the group).
- Point-to-point ops (``isend``/``irecv``/``batch_isend_irecv``) are held
  until the next op of the group or until one of their Works is waited on
  (or tested), then issued as one ftcomm batch: run concurrently, in any
  order of the peers' calls.
- A ``PREMUL_SUM`` made by torch (``torch.distributed._make_nccl_premul_sum
  (factor)``; FSDP2's reduce-scatter under ``set_gradient_divide_factor``)
  on every reduction (all-reduce and its coalesced form, reduce,
  reduce-scatter of a list, of a tensor and coalesced), on CPU and CUDA
  tensors of a floating-point dtype, as torch's NCCL backend runs it: each
  rank's input is multiplied by the factor in its dtype, then summed. The
  factor (a number, or a one-element tensor of the data's dtype, read on
  its device; a tensor of another dtype is refused, as torch's NCCL
  refuses it) comes from the op's pickled state, which torch >= 2.0 has;
  on torch 1.13 such an op is refused with an ``InvalidArgumentError``
  that says so. On bfloat16 data torch's own NCCL backend (up to at least
  2.11) hands NCCL a wrong factor (pytorch/pytorch#190745; docs/python.md):
  there ftcomm's result is the right one, not torch's.

What it does not do (each raises a clear error, never hangs): receiving from
any source (``recv`` without ``src``), a ``PREMUL_SUM`` made by torch 1.13
(its factor cannot be read there: upgrade torch, or with FSDP2
``set_force_sum_reduction_for_comms(True)``), tensors of several devices in
one call, a first op on a new CUDA device that is point-to-point (the NCCL
comm is made by a collective of every rank of the group).
"""

from __future__ import annotations

import collections
import datetime
import os
import queue
import secrets
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _lib, _tensors
from ._refusal import c_rank, issuing, refusing
from .comm import Communicator, new_comm
from .errors import FtcommError, InvalidArgumentError
from .reduce_op import ReduceOp
from .store import Store, through_torch_store

__all__ = ["BACKEND", "ProcessGroupFtcomm", "DistBackendError", "register", "process_group", "create_process_group"]

BACKEND = "ftcomm"

_WorkBase = getattr(dist, "Work", None) or getattr(dist, "_Work")

if hasattr(dist, "DistBackendError"):
    DistBackendError = dist.DistBackendError
else:  # torch < 2.1: torch's own backends raise RuntimeError

    class DistBackendError(RuntimeError):
        """A failure of a collective (torch.distributed.DistBackendError on
        torch versions that have it)."""


# ---------------------------------------------------------------- errors

_combined: Dict[type, Optional[type]] = {}


def _combined_class(cls: type) -> Optional[type]:
    """The class that is both cls (an FtcommError) and DistBackendError,
    made once and kept in this module as Dist<name>: pickle finds it there
    (a CUDA Future pickles an exception set on it to look for tensors)."""
    comb = _combined.get(cls, False)
    if comb is False:
        qual = "Dist" + cls.__name__
        try:
            comb = type(cls.__name__, (cls, DistBackendError), {"__module__": __name__, "__qualname__": qual})
        except TypeError:
            comb = None
        else:
            globals()[qual] = comb
        _combined[cls] = comb
    return comb


def _combine_all() -> None:
    """Every error class of ftcomm.errors combined at import, so that a
    process that unpickles one finds its class."""
    from . import errors
    for v in list(vars(errors).values()):
        if isinstance(v, type) and issubclass(v, FtcommError):
            _combined_class(v)


_combine_all()


def _global_ranks(pg) -> Optional[Dict[int, int]]:
    """group rank -> global rank of pg, when torch knows the group."""
    try:
        c10d = dist.distributed_c10d
        m = getattr(c10d, "_world", None)
        table = m.pg_group_ranks if m is not None else getattr(c10d, "_pg_group_ranks")
        g = table.get(pg)
        if g:
            return {v: k for k, v in g.items()}
    except Exception:
        pass
    return None


def dist_error(e: BaseException, pg: Optional["ProcessGroupFtcomm"] = None) -> BaseException:
    """e as torch.distributed's error: an instance of DistBackendError and of
    e's own ftcomm class, naming the failed ranks by their global rank."""
    if not isinstance(e, FtcommError) or isinstance(e, DistBackendError):
        return e
    comb = _combined_class(type(e))
    if comb is None:
        return e
    granks = list(e.ranks)
    where = ""
    if pg is not None:
        m = _global_ranks(pg)
        if m:
            granks = [m.get(r, r) for r in e.ranks]
        where = "ftcomm process group %s (rank %d of %d): " % (pg._describe(), pg.rank(), pg.size())
    msg = where + e.message
    if granks:
        msg += " [failed: rank%s %s]" % ("s" if len(granks) > 1 else "", ", ".join(str(r) for r in granks))
    extra = {k: v for k, v in vars(e).items() if k not in ("message", "kinds", "ranks", "status")}
    out = comb(msg, kinds=e.kinds, ranks=granks, status=e.status, **extra)
    out.group_ranks = tuple(e.ranks)
    out.__cause__ = e
    return out


def _unsupported(what: str) -> BaseException:
    return InvalidArgumentError("ftcomm process group: %s" % what, kinds=("invalid_argument",))


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


# ---------------------------------------------------------------- reduce ops

# torch's reductions that ftcomm's ReduceOp has under the same name.
_REDUCTIONS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def _op_state(op) -> Optional[tuple]:
    """torch's op as its pickled state, (RedOpType, factor): the factor of a
    PREMUL_SUM (a float, or a one-element tensor), None for the others.
    None where the op has no such state: torch 1.13's ReduceOp does not
    pickle (object.__getstate__ gives None), a RedOpType pickles as its
    number, and torch >= 2.0 refuses to pickle a PREMUL_SUM built without
    its factor."""
    get = getattr(op, "__getstate__", None)
    if get is None:
        return None
    try:
        st = get()
    except Exception:  # noqa: BLE001 - torch's check of a PREMUL_SUM without a factor
        return None
    return st if isinstance(st, tuple) and len(st) == 2 else None


def _ops_pickle() -> bool:
    """Whether this torch's ReduceOp pickles (torch >= 2.0; 1.13's does not)."""
    try:
        return _op_state(dist.ReduceOp(dist.ReduceOp.RedOpType.SUM)) is not None
    except (AttributeError, TypeError):
        return False


def _type_name(kind) -> Optional[str]:
    """The name of a RedOpType ("SUM", "PREMUL_SUM", …), or None."""
    name = getattr(kind, "name", None)
    if isinstance(name, str):
        return name
    members = getattr(getattr(dist.ReduceOp, "RedOpType", None), "__members__", {})
    if isinstance(kind, int):
        return next((n for n, v in members.items() if int(v) == kind), None)
    # A ReduceOp that names no type: == compares the type alone, which is
    # all that is asked here (never use it to tell two PREMUL_SUMs apart).
    return next((n for n, v in members.items() if kind == v), None)


def _reduce_op(op) -> ReduceOp:
    """ftcomm's ReduceOp for torch's: an opts.reduceOp (a torch ReduceOp),
    a dist.ReduceOp.X or a RedOpType.

    A PREMUL_SUM made by torch (``_make_nccl_premul_sum(factor)``, FSDP2's
    gradient divide factor) becomes ``ReduceOp.PREMUL_SUM(factor)`` with the
    factor read from the op's pickled state, the one place torch exposes it
    (torch >= 2.0). torch's ReduceOp.__eq__ and __hash__ see only the type,
    so ops are never compared or used as keys here: every PREMUL_SUM would
    look like every other."""
    if op is None:
        return ReduceOp.SUM
    st = _op_state(op)
    name = _type_name(st[0] if st is not None else getattr(op, "op", op))
    if name == "PREMUL_SUM":
        if st is None:
            if not _ops_pickle():
                raise _unsupported(
                    "PREMUL_SUM made by torch %s: its factor cannot be read (torch's ReduceOp shows it to Python only "
                    "by pickling, from torch 2.0 on); upgrade torch, or keep the factor out of the op: with FSDP2 "
                    "set_force_sum_reduction_for_comms(True), elsewhere scale the tensor and reduce with SUM"
                    % torch.__version__)
            raise _unsupported("PREMUL_SUM without a factor: make it with "
                               "torch.distributed._make_nccl_premul_sum(factor)")
        return ReduceOp.PREMUL_SUM(_premul_factor(st[1]))
    if name in _REDUCTIONS:
        return getattr(ReduceOp, name)
    raise _unsupported("reduce op %r" % (op,))


def _premul_factor(f):
    """A PREMUL_SUM factor from torch's op: a number, or a one-element
    floating-point tensor (on any device; a CUDA one is read on the device,
    never by the host)."""
    if isinstance(f, torch.Tensor):
        if f.numel() != 1 or not f.is_floating_point():
            raise _unsupported("PREMUL_SUM factor %s tensor of %d elements: want one floating-point element"
                               % (f.dtype, f.numel()))
        return f
    if isinstance(f, (int, float)) and not isinstance(f, bool):
        return float(f)
    raise _unsupported("PREMUL_SUM factor %r: want a number or a one-element tensor" % (f,))


def _factor_tensor(op: ReduceOp, dev: torch.device) -> List[torch.Tensor]:
    """op's factor when it is a tensor on dev: the group's stream reads it,
    so it is recorded there for the caching allocator."""
    f = op.factor
    return [f] if isinstance(f, torch.Tensor) and f.device == dev and f.is_cuda else []


# ---------------------------------------------------------------- tensors

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
            raise _unsupported("tensors on %s and %s in one call: one device per call" % (dev, t.device))
    if dev is None:
        raise _unsupported("no tensors")
    return dev


# ---------------------------------------------------------------- works

# Torch's C++ calls a Python Work's wait()/get_future() through the Python
# object; torch versions without PyWorkHolder (1.13) keep only the C++ half
# of a Work returned to C++, so a group holds each of its Works until it has
# been waited for or its future has completed (at most HOLD of them: a Work
# nobody waits for goes after HOLD younger ones).
HOLD = 4096


def hold_work(held: "collections.OrderedDict", w) -> None:
    held[id(w)] = w
    while len(held) > HOLD:
        held.popitem(last=False)


class _Completer:
    """One thread per communicator that completes the futures of its host
    ops in issue order (ops end in issue order). It starts with the first
    future asked for and exits when the group shuts down."""

    def __init__(self, name: str):
        self._q: "queue.Queue[Optional[_HostWork]]" = queue.Queue()
        self._t = threading.Thread(target=self._run, name="ftcomm-pg-" + name, daemon=True)
        self._t.start()

    def add(self, w: "_HostWork") -> None:
        self._q.put(w)

    def _run(self) -> None:
        while True:
            w = self._q.get()
            if w is None:
                return
            w._finish(None)

    def close(self) -> None:
        self._q.put(None)


class _Work(_WorkBase):
    """The Work of an op of a ProcessGroupFtcomm (torch.distributed.Work)."""

    def __init__(self, pg: "ProcessGroupFtcomm", result: List[torch.Tensor]):
        super().__init__()
        self._pg = pg
        self._result = result
        self._fut: Optional[torch.futures.Future] = None
        pg._hold(self)

    def _release(self) -> None:
        """Torch's C++ no longer needs this Python object (see _hold)."""
        self._pg._held.pop(id(self), None)

    def result(self) -> List[torch.Tensor]:
        return self._result

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def source_rank(self) -> int:
        raise _unsupported("source_rank: receiving from any source is not supported")

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, "done" if self.is_completed() else "pending")


class _HostWork(_Work):
    """An op on CPU tensors: ftcomm Works (async ops of one comm), and what
    runs after them (copies back into non-contiguous outputs)."""

    def __init__(self, pg, comm: Optional[Communicator], works: list, result, posts=(), p2p=None):
        super().__init__(pg, result)
        self._comm = comm
        self._works = works
        self._posts = [p for p in posts if p is not None]
        self._p2p = p2p  # the pending batch this Work waits for (isend/irecv)
        self._lock = threading.Lock()
        self._done = False
        self._err: Optional[BaseException] = None

    def _issue(self) -> None:
        if self._p2p is not None:
            self._pg._flush_p2p()

    def _finish(self, timeout) -> bool:
        """Wait for the op (at most timeout seconds; None: its deadline);
        False if it is still running then."""
        self._issue()
        with self._lock:
            if self._done:
                return True
            err = None
            try:
                for w in self._works:
                    w.wait(timeout)
                for p in self._posts:
                    p()
            except FtcommError as e:
                if timeout is not None and str(e).endswith("still running"):
                    return False  # Work.wait's own bound, not the op's deadline
                err = dist_error(e, self._pg)
            except BaseException as e:  # noqa: B902 - a KeyboardInterrupt ends the op too
                err = e
            self._done, self._err = True, err
            self._works = []
            self._posts = []
        fut = self._fut
        if fut is not None:
            self._release()
            if err is None:
                fut.set_result(self._result)
            else:
                fut.set_exception(err)
        return True

    def wait(self, timeout=None) -> bool:
        t = None
        if isinstance(timeout, datetime.timedelta):
            t = timeout.total_seconds() or None
        elif timeout:
            t = float(timeout)
        if not self._finish(t):
            raise dist_error(FtcommError("ftcomm: wait timed out after %ss; the op is still running" % t,
                                         kinds=("timeout",)), self._pg)
        self._release()
        if self._err is not None:
            raise self._err
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        self._issue()
        if all(w.is_completed() for w in self._works):
            self._finish(None)
        return self._done

    def exception(self) -> Optional[BaseException]:
        return self._err if self.is_completed() else None

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._fut is None:
                self._fut = torch.futures.Future()
                if self._done:
                    self._release()
                    if self._err is None:
                        self._fut.set_result(self._result)
                    else:
                        self._fut.set_exception(self._err)
                    return self._fut
            else:
                return self._fut
        self._issue()
        self._pg._completer(self._comm).add(self)
        return self._fut


class _CudaWork(_Work):
    """An op on CUDA tensors, enqueued on the group's stream for the device;
    done when the event recorded after it is."""

    def __init__(self, pg, comm: Optional[Communicator], device: torch.device, result, event=None, p2p=None):
        super().__init__(pg, result)
        self._comm = comm
        self._device = device
        self._event = event
        self._p2p = p2p

    def _issue(self) -> None:
        if self._p2p is not None and self._event is None:
            self._pg._flush_p2p()

    def _failure(self) -> Optional[BaseException]:
        c = self._comm
        if c is None:
            return None
        try:
            why = c.error()
        except FtcommError as e:
            return dist_error(e, self._pg)
        if why:
            return dist_error(FtcommError("ftcomm: " + why, kinds=("other",)), self._pg)
        return None

    def wait(self, timeout=None) -> bool:
        """Make the current stream wait for the op (the host does not)."""
        self._issue()
        err = self._failure()
        if err is not None:
            raise err
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        self._release()
        return True

    def is_completed(self) -> bool:
        self._issue()
        return self._event is None or self._event.query() or self._failure() is not None

    def exception(self) -> Optional[BaseException]:
        return self._failure()

    def get_future(self) -> torch.futures.Future:
        self._issue()
        if self._fut is None:
            fut = torch.futures.Future(devices=[self._device])
            s = self._pg._stream(self._device)
            with torch.cuda.stream(s):
                fut.set_result(self._result)
            self._fut = fut
            self._release()
        return self._fut


class _Group(_Work):
    """Several Works as one (coalesced ops)."""

    def __init__(self, pg, works: List[_Work], result):
        super().__init__(pg, result)
        self._works = works

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait(timeout)
        self._release()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def exception(self) -> Optional[BaseException]:
        for w in self._works:
            e = w.exception()
            if e is not None:
                return e
        return None

    def get_future(self) -> torch.futures.Future:
        self._release()
        futs = [w.get_future() for w in self._works]
        if len(futs) == 1:
            return futs[0].then(lambda f: self._result)
        return torch.futures.collect_all(futs).then(lambda f: [x.wait() for x in f.wait()] and self._result)


class _DoneWork(_Work):
    def wait(self, timeout=None) -> bool:
        self._release()
        return True

    def is_completed(self) -> bool:
        return True

    def exception(self):
        return None

    def get_future(self):
        self._release()
        f = torch.futures.Future()
        f.set_result(self._result)
        return f


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
        self._completers: Dict[int, _Completer] = {}
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
            raise _unsupported("tensors on %s: this group serves %s" % (dev, ", ".join(str(k) for k in self._comms)))
        if self._store is None:
            raise _unsupported("tensors on %s: this group has no communicator for them (it was made from "
                               "communicators, and none runs on CUDA)" % (dev,))
        if not collective:
            raise _unsupported("the first op on %s is point-to-point: the group makes its NCCL communicator at a "
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

    def _completer(self, comm: Optional[Communicator]) -> _Completer:
        k = id(comm)
        c = self._completers.get(k)
        if c is None:
            with self._lock:
                c = self._completers.get(k)
                if c is None:
                    c = _Completer(self._name)
                    self._completers[k] = c
        return c

    # ---- issuing ----

    def _timeout_s(self):
        return None  # the comm's own deadline (the group's timeout)

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
            raise dist_error(e, self) from None
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

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
                raise _unsupported("%s takes one tensor (got %d)" % (kind, len(tensors)))
            t = tensors[0]
            dev = _device_of([t])
            if not 0 <= peer < self._n or peer == self._r:
                raise _unsupported("%s: peer %d (this is rank %d of %d)" % (kind, peer, self._r, self._n))
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
            raise dist_error(e, self) from None
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
            err = dist_error(e, self)
            for _, _, _, w, _ in ops:
                if isinstance(w, _HostWork):
                    w._works, w._p2p, w._done, w._err = [], None, True, err
            raise err from None

    def send(self, tensors, dstRank, tag=0):  # noqa: N803 - torch's names
        return self._p2p("send", _listed(tensors), dstRank)

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803
        return self._p2p("recv", _listed(tensors), srcRank)

    def recv_anysource(self, tensors, tag=0):
        raise _unsupported("recv without src (from any source) is not supported: name the source rank")

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
            op = _reduce_op(opts.reduceOp if hasattr(opts, "reduceOp") else opts)
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
                               [u] + _factor_tensor(op, t.device), opts)
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
                               [u] + _factor_tensor(op, dev), opts)
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
                                     [u] + _factor_tensor(op, dev), opts))
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
            raise _unsupported("reduce takes one tensor (got %d)" % len(tensors))
        t = tensors[0]
        u, post = _dense(t, True)
        return self._issue([t], lambda c, a: c.reduce(u, root, op, async_op=a), [t], [post],
                           [u] + _factor_tensor(op, t.device), opts)

    @_refusing(_lib.OP_ALL_GATHER)
    def allgather(self, output_tensors, input_tensors, opts=None):
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise _unsupported("allgather takes one input tensor and one output list (got %d, %d)" % (
                len(input_tensors), len(output_tensors)))
        outs, inp = list(output_tensors[0]), input_tensors[0]
        if len(outs) != self._n:
            raise _unsupported("allgather: %d output tensors for %d ranks" % (len(outs), self._n))
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
            raise _unsupported("reduce_scatter takes one output tensor and one input list")
        out, ins = output_tensors[0], list(input_tensors[0])
        if len(ins) != self._n:
            raise _unsupported("reduce_scatter: %d input tensors for %d ranks" % (len(ins), self._n))
        o, post = _dense(out, True)
        us = [_dense(t, False)[0] for t in ins]
        return self._issue([out] + ins, lambda c, a: c.reduce_scatter(o, us, op, async_op=a), [out], [post],
                           [o] + us + _factor_tensor(op, out.device), opts)

    @_refusing(_lib.OP_REDUCE_SCATTER)
    def _reduce_scatter_base(self, output, input, opts=None):
        op = self._reduction(opts, [output, input])
        o, post = _dense(output, True)
        i, _ = _dense(input, False)
        return self._issue([output, input], lambda c, a: c.reduce_scatter_single(o, i, op, async_op=a), [output],
                           [post], [o, i] + _factor_tensor(op, output.device), opts)

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
            raise _unsupported("gather takes one input tensor")
        inp = input_tensors[0]
        i, _ = _dense(inp, False)
        if self._r == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != self._n:
                raise _unsupported("gather: the root passes one list of %d output tensors" % self._n)
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
            raise _unsupported("scatter takes one output tensor")
        out = output_tensors[0]
        o, post = _dense(out, True)
        if self._r == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != self._n:
                raise _unsupported("scatter: the root passes one list of %d input tensors" % self._n)
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
                    raise _unsupported("barrier: the group has no communicator")
                c = self._comms[key]
                dev = torch.device("cuda", key[1])
                cw = self._cuda(c, dev, lambda: c.barrier(), [], [], [])
                w = _SyncedCudaWork(self, c, dev, [], cw._event)
        except FtcommError as e:
            raise dist_error(e, self) from None
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
            raise _unsupported("monitored_barrier needs the group's store (this group has none)")
        t = _timeout_s(timeout) or _timeout_s(self._timeout) or 1800.0
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
            g = _global_ranks(self) or {}
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


class _SyncedCudaWork(_CudaWork):
    """A barrier on a CUDA comm: wait() waits for the device too."""

    def wait(self, timeout=None) -> bool:
        super().wait(timeout)
        if self._event is not None:
            self._event.synchronize()
        err = self._failure()
        if err is not None:
            raise err
        return True


# ---------------------------------------------------------------- making groups

def _timeout_s(timeout) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout)


def _hints() -> Optional[Dict[str, str]]:
    addr = os.environ.get("FTCOMM_LISTEN_ADDR")
    return {"listen_addr": addr} if addr else None


def create_process_group(store, rank: int, size: int, timeout=None) -> ProcessGroupFtcomm:
    """torch.distributed's creator for "ftcomm" (store, rank, size,
    timeout): group rank 0 hosts an ftcomm store whose address goes through
    torch's store; the group's CPU comm is made now."""
    t = _timeout_s(timeout)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    # The group's name: chosen by its rank 0, unique in the job.
    if rank == 0:
        name = "pg-" + secrets.token_hex(6)
        store.set("ftcomm/pg-name", name)
    else:
        name = store.get("ftcomm/pg-name").decode()
    fstore = through_torch_store(store, "ftcomm/pg-store", rank, host, max(t or 0, 60.0))
    try:
        cpu = new_comm("gloo", "cpu", name=name, store=fstore, rank=rank, size=size, timeout=t, hints=_hints())
    except BaseException:
        fstore.close()
        raise
    return ProcessGroupFtcomm(rank, size, comms={"cpu": cpu}, store=fstore, own_store=True, timeout=t, name=name,
                              hints=_hints())


def _create_extended(opts, backend_options=None) -> ProcessGroupFtcomm:
    """The creator with torch's extended API (torch >= 2.0)."""
    pg = create_process_group(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    gid = getattr(opts, "group_id", None)
    if gid:
        pg._set_group_name(gid)
    return pg


def process_group(comm: Communicator, *more: Communicator, name: Optional[str] = None,
                  own_comms: bool = False) -> ProcessGroupFtcomm:
    """A ProcessGroup over communicators made with ftcomm.new_comm (at most
    one per device type, the same ranks): ops on their devices' tensors run
    on them. The comms stay the caller's (finalize them after the group's
    last op) unless own_comms."""
    comms: Dict[str, Communicator] = {}
    for c in (comm,) + more:
        comms[str(torch.device(c.get_device()) if not isinstance(c.get_device(), torch.device) else c.get_device())] = c
        if c.get_size() != comm.get_size() or c.get_rank() != comm.get_rank():
            raise _unsupported("process_group: comms of different ranks or sizes")
    pg = ProcessGroupFtcomm(comm.get_rank(), comm.get_size(), comms=comms, own_comms=own_comms,
                            name=name or comm.get_name())
    return pg


_registered = False


def register(name: str = BACKEND) -> None:
    """Register the backend with torch.distributed (import does it; safe to
    call again)."""
    global _registered
    if name.upper() in getattr(dist.Backend, "_plugins", {}):
        _registered = True
        return
    kw: Dict[str, Any] = {}
    import inspect
    params = inspect.signature(dist.Backend.register_backend).parameters
    if "devices" in params:
        kw["devices"] = ["cpu", "cuda"]
    if "extended_api" in params and "devices" in params:
        # torch 2.x: the extended API names the group (group_id), which
        # DeviceMesh and functional collectives resolve by.
        dist.Backend.register_backend(name, _create_extended, extended_api=True, **kw)
    else:
        dist.Backend.register_backend(name, create_process_group, **kw)
    _registered = True


register()
