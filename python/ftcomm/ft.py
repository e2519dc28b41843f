"""ftcomm.ft: the fault-tolerant training loop (Go's ft.Comm).

::

    with ftcomm.ft.Comm(job="gpt", group="r0", secret=s, credentials=path) as c:
        c.register("params", flat_params)          # what a healing replica receives
        for batch in data:
            c.step()                                # quorum; reconfigure; heal if behind
            loss = model(batch); loss.backward()
            c.all_reduce(grads, ReduceOp.AVG)       # a failure here is recorded, not raised
            if c.commit():                          # True: the step is part of the job's history
                optimizer.step()

Each replica is a process: the coordinator (``ftcomm.coordinator.serve`` in
Python, or ``ftcoord serve``) forms a quorum of the live replicas every
time one dies or comes back; the survivors shrink their communicator and go
on, and a returning replica copies the committed state from its peers
before its first step.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
from ctypes import POINTER, byref, c_int32, c_int64, c_uint64, c_void_p
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import _devices, _lib, _tensors
from ._tensors import describe
from .errors import ClosedError, FtcommError, InvalidArgumentError, InvalidTypeError, RolledBackError
from .reduce_op import ReduceOp, as_reduce_op
from .work import InFlight, Work

_DATA = frozenset(["Sampler", "Plan", "MicroBatch", "BatchSampler", "StepLoader", "register_stateful",
                   "StatefulState", "StateCapacityError"])

__all__ = ["Comm", "Event", "Settings", "Work", "ANY_RANK"] + sorted(_DATA)

# group_rank of a slot spare (Go's ft.AnyRank): with spare=True, Comm()
# waits until a rank of its group dies and takes that rank's place.
ANY_RANK = -1

# The events after which a step's registered state is not the one this
# process last wrote: register_stateful reloads its objects.
_STATE_REPLACED = frozenset(("healed", "rolled back", "restored"))


def __getattr__(name: str):
    # The data API (ftcomm.data) is imported on first use: it imports torch
    # when there is one, which ``import ftcomm`` does not.
    if name in _DATA:
        from . import data
        return getattr(data, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


@dataclasses.dataclass(frozen=True)
class Event:
    """Something that happened to this replica (ft.Event): kind is
    "reconfigured", "sat out", "healed", "rolled back", "commit failed",
    "waiting", "settings" (the job's settings version ``version`` is in
    force from step ``from_step``, at every replica of ``epoch`` alike),
    "promoted" (this spare takes part from ``epoch``; ``reason`` says whose
    place it takes) or "restored" (with ``snapshot_every``: the replica
    group restored its peer snapshot of step ``step`` after one of its ranks
    was replaced; this rank held ``from_step``, and ``bytes`` came from its
    buddy's copy — the replacement's — or 0 from its own; a rank whose
    ``from_step`` was newer also reports "rolled back")."""

    kind: str
    time: float
    epoch: int
    step: int
    participants: int
    how: str = ""
    from_step: int = 0
    to_step: int = 0
    bytes: int = 0
    took_s: float = 0.0
    reason: str = ""
    text: str = ""
    version: int = 0

    def __str__(self) -> str:
        return self.text or self.kind


@dataclasses.dataclass(frozen=True)
class Settings:
    """The job's settings in force for this replica's step (ft.Comm.Settings):
    a document the operator changes while the job runs (``ftcoord job set``),
    version ``version``, in force from step ``from_step`` (the first of
    ``epoch``) at every replica of that epoch alike. ``values`` maps each key
    to its value, typed (int, float, bool, str; durations in seconds)."""

    version: int = 0
    epoch: int = 0
    from_step: int = 0
    values: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


def _setting_value(typ: str, value: str) -> Any:
    if typ == "int":
        return int(value)
    if typ == "float":
        return float(value)
    if typ == "bool":
        return value == "true"
    if typ == "duration":
        return _duration_s(value)
    return value


def _duration_s(s: str) -> float:
    """A Go duration string ("1m30s", "250ms") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    total, num, sign = 0.0, "", 1.0
    i = 0
    if s.startswith("-"):
        sign, i = -1.0, 1
    while i < len(s):
        c = s[i]
        if c.isdigit() or c == ".":
            num += c
            i += 1
            continue
        unit = c
        i += 1
        while i < len(s) and not (s[i].isdigit() or s[i] == "."):
            unit += s[i]
            i += 1
        total += float(num) * units[unit]
        num = ""
    return sign * total


def _index(name: str, v: Any) -> int:
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise InvalidTypeError("ftcomm: %s %r is not an int" % (name, v), kinds=("invalid_argument",)) from None


def _settings_fn():
    fn = _lib.lib().ftcomm_ft_settings
    fn.argtypes = [c_uint64, c_void_p, c_int64, POINTER(c_int64)]
    fn.restype = c_int32
    return fn


class FTWork(Work):
    """An ft collective's Work. A failed op does not raise: ft records it,
    and the step's commit returns False. ``wait`` returns True if the op
    succeeded; ``exception()`` says why it did not."""

    __slots__ = ()

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._wait(None if timeout is None else _lib.timeout_ns(timeout))
        return self._err is None

    def exception(self) -> Optional[BaseException]:
        if not self._done:
            self.wait()
        return self._err


class Comm:
    """A replica's fault-tolerant communicator. Settings mirror Go's
    ft.Config (see docs/python.md): job and group name this replica;
    coordinator lists etcd endpoints, or credentials names a trainer
    credentials file (default $FTCOMM_CREDENTIALS) that also carries them;
    secret (default $FTCOMM_SECRET) authenticates the replicas; backend
    "gloo" (CPU tensors) or "nccl" (CUDA tensors, on device). timeout is
    each collective's deadline (seconds; default 30). on_event, if given,
    is called with each Event after step() and commit() return.
    stall_factor and stall_min make the stall bound (ft.Config.StallFactor,
    StallMin: a peer that stops stepping is left out after that long);
    initial_step is the step of a restored state this replica registers
    (ft.Config.InitialStep). settings() is the job's settings in force.

    spare=True makes this process a warm standby (ft.Config.Spare): it
    registers as a spare (every rank of a spare group does, with its
    group_size), and its first step() blocks, costing the job nothing,
    until the coordinator promotes it because the job runs below its
    target size; it then heals from its peers like a returning replica, and
    step() returns with a "promoted" event (spare becomes False). host is
    where this process runs (default the machine's host name): the
    coordinator promotes the spare on the host of the replica the job lost
    first. A dead replica restarted as a plain replica after a spare took
    its place waits as a spare by itself.

    snapshot_every=K turns on peer snapshots (ft.Config.SnapshotEvery), for
    a replica group with no replica — an FSDP job whose one group spans
    every rank (group_size > 1; not with durable_commit): every K committed
    steps each rank copies its registered state into its own host memory
    and into a buddy rank's. When a rank of the group is replaced (its
    restarted process, or a slot spare), the group restores the newest
    complete snapshot before the step starts: the new rank receives the
    dead rank's state from the buddy's copy, every other rank rolls back to
    the same step (step() raises RolledBackError with ``snapshot`` True),
    and each reports a "restored" event; at most K steps are lost. When a
    rank and its buddy die together their copies go with them: step()
    raises SnapshotLostError at every rank. ftcomm.ft_torch.protect_shards
    registers a rank's shards, optimizer state and data position in one
    call.

    group_rank=ANY_RANK with spare=True makes a slot spare: Comm() itself
    waits — unbounded; ftcomm.interrupt() or Ctrl-C ends it — until a rank
    of the group dies, then takes that rank's place as its restarted
    process would (``group_rank`` says which; ``spare`` is False from then
    on). It asks to take part as it takes the place, so the group waits for
    its first step(): build the expensive parts (imports, model, optimizer)
    before Comm(), and what depends on the rank (its shard) and the
    registrations right after.

    group_backend="nccl" gives the replica group (group_size > 1) a data
    comm on this process's GPU (device) beside the host comm that carries
    ft's group messages: group_comm() returns it, the shard group of an FSDP
    job with no replica, which ft revokes when a rank of the group dies (so
    an op on it never waits for the dead) and forms again at each epoch of
    the group. ftcomm.ft_torch.shard_mesh makes FSDP2's mesh of it. By
    default group_comm() returns the group's host comm (CPU tensors).

    Making a Comm registers the replica with the coordinator; it asks to
    take part at its first step(): build the model, shard it and register
    its state after this call, the job does not wait for it meanwhile.
    """

    def __init__(self, job: str, group: str, *, backend: str = "gloo", device: Any = None,
                 coordinator: Optional[Sequence[str]] = None, credentials: Optional[str] = None,
                 secret: Optional[str] = None, group_rank: int = 0, group_size: int = 1, min_replicas: int = 1,
                 timeout=None, max_commit_failures: Optional[int] = None, recovery_addr: Optional[str] = None,
                 heal_chunk_size: Optional[int] = None, heal_streams: Optional[int] = None,
                 durable_commit: bool = False, disable_health_watch: bool = False, lease_ttl=None,
                 heartbeat=None, gossip: bool = False, control_backend: Optional[str] = None,
                 log_level: Optional[str] = None, on_event: Optional[Callable[[Event], None]] = None,
                 stall_factor: Optional[float] = None, stall_min=None, initial_step: int = 0,
                 spare: bool = False, host: Optional[str] = None, snapshot_every: int = 0,
                 group_backend: Optional[str] = None):
        if _lib.forked:
            raise _lib._fork_error()
        group_rank, group_size = _index("group_rank", group_rank), _index("group_size", group_size)
        snapshot_every = _index("snapshot_every", snapshot_every)
        if group_rank == ANY_RANK and not spare:
            raise InvalidArgumentError("ftcomm: group_rank ANY_RANK makes a slot spare: it needs spare=True",
                                       kinds=("invalid_argument",))
        if snapshot_every and group_size < 2:
            raise InvalidArgumentError(
                "ftcomm: snapshot_every %d with group_size %d: peer snapshots keep a rank's state on another rank of "
                "its replica group, and a group of one rank has none (replicas heal from each other)" % (
                    snapshot_every, group_size), kinds=("invalid_argument",))
        self._h: Optional[int] = None
        self._keep: List[Any] = []
        self._inflight = InFlight()
        self._on_event = on_event
        # What register_stateful hooks in: called after a step() that
        # started the step, with whether the step replaced the registered
        # state (healed, rolled back, restored), and after a commit() with
        # its outcome.
        self._after_step: List[Callable[[bool], None]] = []
        # Events taken from the library for the hooks, not yet handed out.
        self._events: List[Event] = []
        self._after_commit: List[Callable[[bool], None]] = []
        # Counts the calls that change what a sampler reports (step,
        # commit, close): a Sampler's plan is cached for one value.
        self._gen = 0
        self._steps = 0  # step() calls
        backend = {"cuda": "nccl"}.get(backend, backend)
        group_backend = {"cuda": "nccl", "gloo": None, "cpu": None}.get(group_backend, group_backend)
        if group_backend not in (None, "nccl"):
            raise InvalidArgumentError("ftcomm: group_backend %r: want None (the group's host comm) or \"nccl\"" % (
                group_backend,), kinds=("invalid_argument",))
        secret = secret if secret is not None else os.environ.get("FTCOMM_SECRET", "")
        settings = {"job": job, "group": group, "group_rank": group_rank, "group_size": group_size,
                    "secret": secret, "backend": backend, "min_replicas": min_replicas,
                    "durable_commit": durable_commit, "disable_health_watch": disable_health_watch,
                    "gossip": gossip, "device": -1, "spare": bool(spare)}
        self._dev = -1
        if group_backend is not None:
            settings["group_backend"] = group_backend
        if backend == "nccl" or group_backend == "nccl":
            import torch
            idx = _devices.device_index(device) if device is not None else None
            if idx is None:
                idx = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
            torch.cuda.set_device(idx)
            settings["device"] = self._dev = idx
            self.device = torch.device("cuda", idx)
            if backend != "nccl":
                self._dev = -1  # the FT comm's tensors stay on the host; the group's are on the device
        else:
            if device is not None and _devices.device_type(device) != "cpu":
                raise InvalidArgumentError("ftcomm: backend %s takes CPU tensors; device %r" % (backend, device),
                                           kinds=("invalid_argument",))
            self.device = "cpu"
        for key, val in (("coordinator", list(coordinator) if coordinator else None), ("credentials", credentials),
                         ("max_commit_failures", max_commit_failures), ("recovery_addr", recovery_addr),
                         ("heal_chunk_size", heal_chunk_size), ("heal_streams", heal_streams),
                         ("control_backend", control_backend), ("log_level", log_level),
                         ("stall_factor", stall_factor), ("initial_step", initial_step or None), ("host", host),
                         ("snapshot_every", snapshot_every or None)):
            if val is not None:
                settings[key] = val
        for key, val in (("timeout_s", timeout), ("lease_ttl_s", lease_ttl), ("heartbeat_s", heartbeat),
                         ("stall_min_s", stall_min)):
            if val is not None:
                settings[key] = _lib.timeout_ns(val) / 1e9
        _lib.ensure_interrupt_chain()
        h = c_uint64()
        _lib.check(_lib.lib().ftcomm_ft_new(json.dumps(settings).encode(), byref(h)))
        self._h = h.value
        self.job, self.group = job, group
        self._group_size, self._snapshot_every = group_size, snapshot_every
        self._spare = bool(spare) and group_rank != ANY_RANK  # a slot spare holds its place now
        self._group_backend = group_backend or "gloo"
        self._timeout = timeout
        self._group_comm: Optional[Any] = None  # group_comm()'s, while it is the group's current comm

    def _handle(self) -> int:
        if _lib.forked:
            raise _lib._fork_error()
        if self._h is None:
            raise ClosedError("ftcomm: ft.Comm is closed", kinds=("closed",))
        return self._h

    def register(self, name: str, tensor) -> None:
        """Name memory of this replica's state: what a healing replica
        receives. Before the first step, in the same order on every replica;
        written only after a successful commit. The tensor must outlive the
        Comm (it is kept alive here)."""
        ptr, n, dt, dev = describe(tensor, name)
        _lib.check(_lib.lib().ftcomm_ft_register(self._handle(), name.encode(), ptr, n, dt, dev))
        self._keep.append(tensor)

    def _deliver(self) -> None:
        if self._on_event is not None:
            for e in self.events():
                self._on_event(e)

    def step(self, timeout=None) -> None:
        """Start a step: join the epoch's quorum, reconfigure, heal if behind.
        Raises RolledBackError (with the step started) if this replica's
        committed steps were rolled back (``snapshot`` True: its group
        restored a peer snapshot), SnapshotLostError when its group cannot
        restore one, FinishedError once a replica ended the run. A spare's
        first step waits until it is promoted (or the run ends:
        FinishedError)."""
        self._gen += 1
        self._steps += 1  # ShardGroup: the faults of one step are counted once
        started = False
        try:
            try:
                _lib.check(_lib.lib().ftcomm_ft_step(self._handle(), _lib.timeout_ns(timeout)))
            except RolledBackError:
                started = True
                raise
            started = True
        finally:
            if started:  # a participant now; the hooks see the step's events before on_event takes them
                self._spare = False
                self._started()
            self._deliver()

    def _started(self) -> None:
        if not self._after_step:
            return
        # Whether the step replaced the registered state, from its events
        # (kept for events() and on_event).
        new = self._take_events()
        self._events.extend(new)
        replaced = any(e.kind in _STATE_REPLACED for e in new)
        for f in self._after_step:
            f(replaced)

    @property
    def spare(self) -> bool:
        """True while this process waits as a spare (spare=True, not yet
        promoted); False once a step() returned: a spare's first step
        returns only when it was promoted."""
        return self._spare

    def commit(self, timeout=None) -> bool:
        """Vote on the step: True if it committed (apply the optimizer step),
        False if it rolled back (skip it; the next step reconfigures)."""
        ok = c_int32()
        self._gen += 1
        try:
            _lib.check(_lib.lib().ftcomm_ft_commit(self._handle(), _lib.timeout_ns(timeout), byref(ok)))
        except BaseException:
            for f in self._after_commit:
                f(False)  # it did not commit
            raise
        finally:
            self._deliver()
        for f in self._after_commit:
            f(bool(ok.value))
        return bool(ok.value)

    def fail_step(self, reason: str = "") -> None:
        """Fail the step in progress for a reason found outside ft: a NaN
        loss, an error on a communicator of the loop's own (an FSDP shard
        comm), a data loader's failure. Between step() and commit(); then
        call commit() as usual: it returns False, with reason in the "commit
        failed" event. This replica's FT comms are revoked at once, so every
        other replica's ft op of the step that still needs this replica's
        part fails, and its commit with it (with group_size > 1 the group's
        vote tells the rest of the group); this replica's later ft ops of the
        step fail at once. A replica whose ft ops of the step all completed
        before the revocation reached it commits the step: call fail_step
        before the ft collective that would carry what is wrong. Raises
        InvalidArgumentError outside a started step (changing nothing),
        ClosedError once closed."""
        _lib.check(_lib.lib().ftcomm_ft_fail_step(self._handle(), str(reason).encode("utf-8", "replace")))

    def finish(self, timeout=None) -> None:
        """End the run at this replica's committed step: the other replicas'
        next step() raises FinishedError instead of going on without it.
        Call it when the training loop is done, between commit() and
        step(), then close()."""
        _lib.check(_lib.lib().ftcomm_ft_finish(self._handle(), _lib.timeout_ns(timeout)))

    def _op(self, kind: int, out, inp, op, root: int, async_op: bool, timeout, keep) -> FTWork:
        h = self._handle()
        if self._inflight:
            self._inflight.reap()
        try:
            optr, on, dt, dev = describe(out, "output" if inp is not None else "tensor")
            if dev != self._dev:
                raise InvalidArgumentError("ftcomm: tensor on %s; this ft.Comm's data backend takes %s tensors" % (
                    "cpu" if dev < 0 else "cuda:%d" % dev, "CPU" if self._dev < 0 else "cuda:%d" % self._dev),
                    kinds=("invalid_argument",))
            iptr, inn = None, 0
            if inp is not None:
                iptr, inn, idt, idev = describe(inp, "input")
                if idt != dt or idev != dev:
                    raise InvalidArgumentError("ftcomm: input and output differ in dtype or device",
                                               kinds=("invalid_argument",))
            r = as_reduce_op(op)
            if r.factor is not None or dt == _tensors.BOOL:
                raise InvalidArgumentError("ftcomm: ft collectives take SUM, PRODUCT, MIN, MAX, AVG or a bitwise op on "
                                           "non-bool tensors (got %r on %s)" % (r, _tensors.DTYPE_NAMES[dt]),
                                           kinds=("invalid_argument",))
            stream = _tensors.current_stream(dev) if dev >= 0 else 0
            t = _lib.timeout_ns(timeout)
        except Exception as e:
            # Refused here: refused on the FT comm too, in the op's place,
            # so the other replicas' op fails at once (PeerRefusedError).
            reason = e.message if isinstance(e, FtcommError) else "%s: %s" % (type(e).__name__, e)
            try:
                st = _lib.lib().ftcomm_ft_refuse(h, kind, root if isinstance(root, int) else -1,
                                                 reason.encode("utf-8", "replace"))
                if st:
                    _lib.last_error(st)
            except Exception:
                pass
            raise
        w = c_uint64()
        st = _lib.lib().ftcomm_ft_op(h, kind, optr, on, iptr, inn, dt, dev, r._code, root, stream, t, _lib.ASYNC,
                                     byref(w))
        if st < 0:
            _lib.fail(st)  # refused before it ran: a bad argument
        work = FTWork(self._inflight.add(w.value, keep), self._inflight)
        if not async_op:
            work.wait()
        return work

    def all_reduce(self, tensor, op=ReduceOp.AVG, async_op: bool = False, timeout=None) -> FTWork:
        """Reduce tensor across the participating replicas (AVG divides by
        this step's participants). A failure is recorded for commit."""
        return self._op(_lib.OP_ALL_REDUCE, tensor, None, op, 0, async_op, timeout, tensor)

    def reduce_scatter_single(self, output, input, op=ReduceOp.AVG, async_op: bool = False, timeout=None) -> FTWork:
        return self._op(_lib.OP_REDUCE_SCATTER, output, input, op, 0, async_op, timeout, (output, input))

    def all_gather_single(self, output, input, async_op: bool = False, timeout=None) -> FTWork:
        return self._op(_lib.OP_ALL_GATHER, output, input, ReduceOp.SUM, 0, async_op, timeout, (output, input))

    def broadcast(self, tensor, root: int, async_op: bool = False, timeout=None) -> FTWork:
        return self._op(_lib.OP_BROADCAST, tensor, None, ReduceOp.SUM, int(root), async_op, timeout, tensor)

    def all_to_all_single(self, output, input, async_op: bool = False, timeout=None) -> FTWork:
        return self._op(_lib.OP_ALL_TO_ALL, output, input, ReduceOp.SUM, 0, async_op, timeout, (output, input))

    def _info(self):
        e, p, r, s = c_uint64(), c_int64(), c_int64(), c_int64()
        _lib.check(_lib.lib().ftcomm_ft_info(self._handle(), byref(e), byref(p), byref(r), byref(s)))
        return e.value, p.value, r.value, s.value

    @property
    def epoch(self) -> int:
        """The epoch of the current configuration."""
        return self._info()[0]

    @property
    def participants(self) -> int:
        """Replica groups in the current FT comm (0 while sitting out)."""
        return self._info()[1]

    @property
    def rank(self) -> int:
        """This replica's rank in the FT comm, -1 while sitting out."""
        return self._info()[2]

    @property
    def committed_step(self) -> int:
        """Steps this replica has committed (or healed to)."""
        return self._info()[3]

    @property
    def group_rank(self) -> int:
        """This process's rank in its replica group: the group_rank it was
        made with, or the place a slot spare (ANY_RANK) took."""
        r = c_int64()
        _lib.check(_lib.lib().ftcomm_ft_group_rank(self._handle(), byref(r)))
        return r.value

    @property
    def group_size(self) -> int:
        """The ranks of this replica group (the shard dimension)."""
        return self._group_size

    def group_comm(self):
        """The replica group's data comm of the current epoch (an
        ftcomm.Communicator of group_size ranks, rank group_rank): the shard
        group of an FSDP job with no replica. Its backend is group_backend's:
        "nccl" (CUDA tensors on this Comm's device), or by default the host
        comm that also carries ft's group messages (CPU tensors).

        The comm is ft's. ft revokes it when a rank of the group dies or
        fails its step, so an op on it never waits for a dead rank: it
        raises (RevokedError), and a failed op fails the group's commit (ft
        watches the comm; call fail_step all the same if the loop goes on
        past it). ft closes it when the group is formed again; the next
        step's call returns the new one. Use it between step() and commit(),
        and from the loop's thread. finalize() releases this handle only.
        Raises InvalidArgumentError when there is no group comm (group_size
        1, a spare, outside a step before the group is formed).
        ftcomm.ft_torch.ShardGroup makes a torch.distributed process group
        of it that follows the epochs (FSDP2's mesh)."""
        from .comm import CommOptions, Communicator
        h = c_uint64()
        _lib.check(_lib.lib().ftcomm_ft_group_comm(self._handle(), byref(h)))
        c = Communicator(h.value, None, False, self.device if self._group_backend == "nccl" else "cpu",
                         self._group_backend, "", CommOptions(timeout=self._timeout, name="ft-group"), None, "ft-group")
        old = self._group_comm
        if old is not None and not old._finalized and (old.get_name(), old._epoch) == (
                c.get_name(), c._epoch) and old.get_rank() == c.get_rank():
            c._free()  # the same comm: keep the handle already given out
            return old
        self._group_comm = c
        return c

    @property
    def snapshot_every(self) -> int:
        """The committed steps between peer snapshots (0: off)."""
        return self._snapshot_every

    def settings(self) -> Settings:
        """The job's settings in force for this replica's current step. They
        change only inside step(), at the first step of an epoch that every
        replica of it agreed on; a "settings" event says so. Version 0 and
        no values before any were set."""
        d = json.loads(_lib.get_bytes(_settings_fn(), self._handle()))
        vals = {k: _setting_value(v["type"], v["value"]) for k, v in d["values"].items()}
        return Settings(version=d["version"], epoch=d["epoch"], from_step=d["from_step"], values=vals)

    def events(self) -> List[Event]:
        """The events since the last call (reconfigurations, heals, rollbacks,
        restores, failed commits), oldest first."""
        out, self._events = self._events, []
        return out + self._take_events()

    def _take_events(self) -> List[Event]:
        d = json.loads(_lib.get_bytes(_lib.lib().ftcomm_ft_events, self._handle()))
        return [Event(**e) for e in d["events"]]

    def close(self) -> None:
        """Leave the job and release everything (with CUDA data: once no GPU
        work of this Comm uses the registered tensors). Safe to call twice."""
        h, self._h = self._h, None
        self._gen += 1
        g, self._group_comm = getattr(self, "_group_comm", None), None
        if g is not None and not _lib.forked:
            g._free()  # the handle group_comm() gave out (ft closes the comm itself)
        if h is not None and not _lib.forked:
            st = _lib.lib().ftcomm_ft_free(h)
            self._inflight.release()  # its comms are closed: every op has ended
            _lib.check(st)
        self._keep = []

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        if self._h is None:
            return "ft.Comm(%s/%s, closed)" % (self.job, self.group)
        e, p, r, s = self._info()
        return "ft.Comm(%s/%s, epoch %d, rank %d of %d, step %d)" % (self.job, self.group, e, r, p, s)
