"""Data that follows the quorum (Go's ft.Sampler; re-exported by ftcomm.ft).

Each step's global batch is the next ``samples`` of the epoch's permutation
of the dataset, cut among the step's participants; the position is
registered state, so it advances only when ``commit()`` returns True, a
returning replica heals it with the model, and a step that does not commit
gives its samples back. Across deaths, restarts, shrinks and grows the
committed steps read every sample of every epoch exactly once::

    c = ftcomm.ft.Comm(job="gpt", group=f"r{replica}", ...)
    sampler = ftcomm.ft.Sampler(c, size=len(dataset), batch=32, accum=2, seed=1)
    loader = ftcomm.ft.StepLoader(dataset, sampler)      # collated micro-batches of the step
    opt = OptimizerWrapper(c, torch.optim.AdamW(...), sampler=sampler)   # lr × plan.lr_scale
    register_state(c, model, opt)
    while c.committed_step < steps:
        opt.zero_grad()                                  # ft step: quorum, heal (the position too)
        for batch, weight in loader:                     # this rank's share of the step
            (loss_fn(model(batch)) * weight).backward()
        c.all_reduce(grads, ReduceOp.AVG)
        opt.step()                                       # commit; the position advances if it committed

Every replica makes its Sampler alike (same size, seed, batch, accum,
policy, ...) before its first step, with its registrations.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import pickle
import struct
from ctypes import byref, c_char, c_int64, c_uint64, create_string_buffer, string_at
from typing import Any, Callable, Iterator, List, Optional, Tuple

from . import _lib
from .errors import ClosedError, InvalidArgumentError, InvalidTypeError

try:
    import torch as _torch
    from torch.utils.data import Sampler as _TorchSampler
except ImportError:  # the sampler works without torch; the loaders need it
    _torch = None
    _TorchSampler = object

__all__ = ["Sampler", "Plan", "MicroBatch", "BatchSampler", "StepLoader", "register_stateful", "StatefulState",
           "StateCapacityError"]

POLICIES = ("replica", "global")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One forward and backward pass of this rank: ``indices`` (a list of
    Python ints, the dataset's samples in order; what DataLoader's
    batch_sampler yields) and ``weight``, the factor of the micro-batch's
    mean loss that makes the step's gradient, averaged over the participants
    (ReduceOp.AVG), the mean over the step's samples (1/accum when every
    rank takes accum full micro-batches). Every rank of a step takes as
    many micro-batches, none empty."""

    indices: List[int]
    weight: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """What this rank reads in the step in progress (Go's ft.Plan).

    ``step`` commits as committed_step ``step``; the step reads the job's
    positions ``position`` to ``position + samples - 1`` (``samples`` is
    the global batch, every rank's micro-batches) of dataset epoch
    ``epoch``; ``participants`` replica groups take part, ``target`` is the
    size the global batch is made for, ``policy`` the one in force
    ("replica" or "global"); ``lr_scale`` is samples over the global batch
    at the target size (OptimizerWrapper multiplies the learning rate by
    it); ``micro`` are this rank's micro-batches, in order (a tuple of
    MicroBatch)."""

    step: int
    position: int
    epoch: int
    samples: int
    participants: int
    target: int
    policy: str
    lr_scale: float
    micro: Tuple[MicroBatch, ...]

    @property
    def indices(self) -> List[int]:
        """All of this rank's samples of the step, in order."""
        return [i for m in self.micro for i in m.indices]


def _int(name: str, v: Any, lo: int = 0) -> int:
    try:
        n = operator.index(v)
    except TypeError:
        raise InvalidTypeError("ftcomm: sampler: %s %r is not an int" % (name, v), kinds=("invalid_argument",)) from None
    if isinstance(v, bool):
        raise InvalidTypeError("ftcomm: sampler: %s %r is not an int" % (name, v), kinds=("invalid_argument",))
    if n < lo:
        raise InvalidArgumentError("ftcomm: sampler: %s %d is below %d" % (name, n, lo), kinds=("invalid_argument",))
    return n


class Sampler:
    """The ft.Comm's quorum-aware sampler of a dataset of ``size`` samples
    (Go's ft.NewSampler); make it before the first step, alike on every
    replica. Between ``comm.step()`` and ``comm.commit()``, ``plan()`` says
    which samples this rank reads: ``accum`` micro-batches of ``batch``
    samples at the target size. ``policy`` (None: "replica", or the job
    setting ``ftcomm.batch_policy`` when set, which overrides this at run
    time): "replica" keeps every rank's micro-batches, so the global batch
    follows the participants (``plan.lr_scale`` says by how much); "global"
    keeps the global batch, the survivors taking more micro-batches each,
    up to ``max_accum`` (default 4 × accum), beyond which it shrinks.
    ``replicas`` is the size in replica groups the global batch is made for
    (default: the quorum's target). ``seed`` and the epoch make each
    epoch's permutation (``sequential=True``: in order). ``position`` is
    where a run restored from a checkpoint resumes (this sampler's
    ``position`` at the checkpoint). ``name`` tells samplers of one Comm
    apart (default "data").

    The position is registered as the replica's state
    ("ftcomm.sampler/<name>"): it advances only when commit() returns
    True, and a replica that heals takes its peers' position.
    """

    def __init__(self, comm, size: int, batch: int, *, seed: int = 0, accum: int = 1, policy: Optional[str] = None,
                 max_accum: Optional[int] = None, replicas: Optional[int] = None, position: int = 0,
                 sequential: bool = False, name: str = "data"):
        self._h: Optional[int] = None
        self._cached: Optional[Tuple[int, Plan]] = None  # (comm._gen, the plan of that step)
        if not isinstance(name, str):
            raise InvalidTypeError("ftcomm: sampler: name %r is not a str" % (name,), kinds=("invalid_argument",))
        if policy is not None and policy not in POLICIES:
            raise InvalidArgumentError("ftcomm: sampler: policy %r: want 'replica' or 'global'" % (policy,),
                                       kinds=("invalid_argument",))
        settings = {"name": name, "size": _int("size", size, 1), "batch": _int("batch", batch, 1),
                    "seed": _int("seed", seed), "accum": _int("accum", accum, 1), "position": _int("position", position),
                    "sequential": bool(sequential), "policy": policy or ""}
        if max_accum is not None:
            settings["max_accum"] = _int("max_accum", max_accum, 1)
        if replicas is not None:
            settings["replicas"] = _int("replicas", replicas, 1)
        h = c_uint64()
        _lib.check(_lib.lib().ftcomm_ft_sampler_new(comm._handle(), json.dumps(settings).encode(), byref(h)))
        self._h = h.value
        self.comm = comm
        self.name, self.size, self.batch, self.accum = name, settings["size"], settings["batch"], settings["accum"]
        # The most indices a rank reads in one step: batch × max(accum, max_accum).
        self._grow(settings["batch"] * max(settings["accum"], settings.get("max_accum", 4 * settings["accum"])), 512)

    def _grow(self, indices: int, meta: int) -> None:
        self._buf = bytearray(8 * max(indices, 1))
        self._ptr = (c_char * len(self._buf)).from_buffer(self._buf)
        self._idx = memoryview(self._buf).cast("q")
        self._meta = create_string_buffer(max(meta, 64))

    def _handle(self) -> int:
        if _lib.forked:
            raise _lib._fork_error()
        if self._h is None:
            raise ClosedError("ftcomm: sampler %r is closed" % self.name, kinds=("closed",))
        return self._h

    def plan(self) -> Plan:
        """This rank's plan for the step in progress (the same object for
        every call of the step: do not change its index lists). Raises NoStepError
        outside a step (before step(), after commit(), after a step() that
        failed), NotParticipatingError while this replica sits out, and
        SamplerMismatchError (an InvalidArgumentError) when the state healed
        from the job's replicas came from a sampler configured otherwise."""
        h = self._handle()
        gen = self.comm._gen
        if self._cached is not None and self._cached[0] == gen:
            return self._cached[1]
        fn = _lib.lib().ftcomm_sampler_plan
        nm, ni = c_int64(), c_int64()
        while True:
            st = fn(h, self._meta, len(self._meta), byref(nm), self._ptr, len(self._idx), byref(ni))
            if st != _lib.ERR_SHORT_BUFFER:
                break
            _lib.last_error(st)  # clear it
            self._grow(max(ni.value, len(self._idx)), max(nm.value + 1, len(self._meta)))
        _lib.check(st)
        d = json.loads(string_at(self._meta, nm.value))
        idx = self._idx[:ni.value].tolist()
        micro, at = [], 0
        for m in d["micro"]:
            micro.append(MicroBatch(idx[at:at + m["size"]], m["weight"]))
            at += m["size"]
        p = Plan(step=d["step"], position=d["position"], epoch=d["epoch"], samples=d["samples"],
                 participants=d["participants"], target=d["target"], policy=d["policy"], lr_scale=d["lr_scale"],
                 micro=tuple(micro))
        self._cached = (gen, p)
        return p

    def _position(self) -> Tuple[int, int]:
        p, e = c_int64(), c_int64()
        _lib.check(_lib.lib().ftcomm_sampler_position(self._handle(), byref(p), byref(e)))
        return p.value, e.value

    @property
    def position(self) -> int:
        """The job's position as this replica holds it: the samples its
        committed steps consumed since the run began (healed with the
        model). Save it with a checkpoint; pass it back as ``position``."""
        return self._position()[0]

    @property
    def epoch(self) -> int:
        """The dataset epoch of the next sample (position // size)."""
        return self._position()[1]

    def close(self) -> None:
        """Free the handle (the position stays registered with the Comm).
        Safe to call twice."""
        h, self._h = self._h, None
        self._cached = None
        if h is not None and not _lib.forked:
            _lib.check(_lib.lib().ftcomm_sampler_free(h))

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        if self._h is None:
            return "Sampler(%r, closed)" % self.name
        p, e = self._position()
        return "Sampler(%r, %d samples, batch %d x %d, position %d, epoch %d)" % (
            self.name, self.size, self.batch, self.accum, p, e)


class BatchSampler(_TorchSampler):
    """A batch sampler for ``DataLoader(dataset, batch_sampler=...)``: each
    iteration yields the step in progress's micro-batches (index lists;
    every rank of the step yields as many, none empty), taking the plan
    when its first batch is asked for. Iterate the DataLoader anew after every ``comm.step()``: one pass
    is one step.

    DataLoader workers (and its prefetching) cannot read ahead into the
    next step: which samples a step reads depends on the quorum that
    step() forms — how many replicas take part and this replica's rank
    among them — and on whether the step before committed (a step that
    does not commit gives its samples back), neither known before step()
    returns. Within a step they prefetch as usual."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __iter__(self) -> Iterator[List[int]]:
        for m in self.sampler.plan().micro:
            yield m.indices

    def __len__(self) -> int:
        return len(self.sampler.plan().micro)


class StepLoader:
    """The step's data: iterated after ``comm.step()``, it yields
    ``(batch, weight)`` for each of this rank's micro-batches of the step,
    where batch is ``collate_fn([dataset[i] for i in indices])`` and weight
    the micro-batch's factor of the mean loss (MicroBatch.weight); every
    rank of the step yields as many (a loop that all-reduces per backward
    stays in step with its peers). With ``num_workers`` > 0 (and any other DataLoader
    argument) the samples are loaded by a torch DataLoader over a
    BatchSampler, its workers kept between steps (persistent_workers);
    within a step they prefetch, across steps they cannot (BatchSampler
    says why)."""

    def __init__(self, dataset, sampler: Sampler, collate_fn: Optional[Callable] = None, num_workers: int = 0,
                 **dataloader_kwargs):
        self.dataset, self.sampler = dataset, sampler
        if collate_fn is None:
            if _torch is None:
                raise InvalidArgumentError("ftcomm: StepLoader: give a collate_fn (torch's default_collate needs torch)",
                                           kinds=("invalid_argument",))
            from torch.utils.data import default_collate
            collate_fn = default_collate
        self.collate_fn = collate_fn
        self.loader = None
        if num_workers or dataloader_kwargs:
            if _torch is None:
                raise InvalidArgumentError("ftcomm: StepLoader: DataLoader arguments need torch",
                                           kinds=("invalid_argument",))
            if num_workers:
                dataloader_kwargs.setdefault("persistent_workers", True)
            self.loader = _torch.utils.data.DataLoader(dataset, batch_sampler=BatchSampler(sampler),
                                                       collate_fn=collate_fn, num_workers=num_workers,
                                                       **dataloader_kwargs)

    def __iter__(self) -> Iterator[Tuple[Any, float]]:
        micro = self.sampler.plan().micro
        if self.loader is None:
            for m in micro:
                yield self.collate_fn([self.dataset[i] for i in m.indices]), m.weight
            return
        # The DataLoader's BatchSampler takes the same plan (one per step).
        for m, batch in zip(micro, self.loader):
            yield batch, m.weight

    def __len__(self) -> int:
        return len(self.sampler.plan().micro)


# ---------------------------------------------------------------- stateful objects

class StateCapacityError(InvalidArgumentError):
    """An object registered with register_stateful serialized to more than
    its capacity. ``committed`` says whether the step committed (its state
    was then not saved: what the replica serves to a healing peer is the
    state of an earlier step); raise the capacity."""

    committed: bool = False


_MAGIC = b"ftcmst01"
_HEADER = struct.Struct("<8sQqQ")  # magic, payload length, committed step, writer's tag


class StatefulState:
    """An object's state registered with an ft.Comm (register_stateful)."""

    def __init__(self, comm, name: str, obj, capacity: int):
        import numpy as np
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise InvalidTypeError("ftcomm: register_stateful: %r has no state_dict() and load_state_dict()" % (obj,),
                                   kinds=("invalid_argument",))
        self.comm, self.name, self.obj = comm, name, obj
        self.capacity = _int("capacity", capacity, 1)
        self.loads = 0  # how many times the object was loaded from the registered state
        self.buf = np.zeros(_HEADER.size + self.capacity, dtype=np.uint8)
        self._header = b""
        self._write(self._dump(False), comm.committed_step)  # refused here if over capacity: nothing registered
        comm.register("ftcomm.stateful/" + name, self.buf)
        comm._after_step.append(self._after_step)
        comm._after_commit.append(self._after_commit)

    def _dump(self, committed: bool) -> bytes:
        b = pickle.dumps(self.obj.state_dict(), protocol=pickle.HIGHEST_PROTOCOL)
        if len(b) > self.capacity:
            e = StateCapacityError("ftcomm: register_stateful %r: the state is %d bytes, over the capacity of %d%s: "
                                   "register it with a larger capacity" % (
                                       self.name, len(b), self.capacity,
                                       " (the step committed; its state was not saved)" if committed else ""),
                                   kinds=("invalid_argument",))
            e.committed = committed
            raise e
        return b

    def _write(self, payload: bytes, step: int) -> None:
        h = _HEADER.pack(_MAGIC, len(payload), step, int.from_bytes(os.urandom(8), "little"))
        self.buf[_HEADER.size:_HEADER.size + len(payload)] = memoryview(payload)
        self.buf[:_HEADER.size] = memoryview(h)
        self._header = h

    def _load(self) -> None:
        h = self.buf[:_HEADER.size].tobytes()
        magic, n, _, _ = _HEADER.unpack(h)
        if magic != _MAGIC or n > self.capacity:
            raise InvalidArgumentError("ftcomm: register_stateful %r: the state healed from the job's replicas is not "
                                       "one register_stateful wrote (register it alike on every replica, with the "
                                       "same capacity)" % self.name, kinds=("invalid_argument",))
        self.obj.load_state_dict(pickle.loads(self.buf[_HEADER.size:_HEADER.size + n].tobytes()))
        self._header = h
        self.loads += 1

    @property
    def version(self) -> Tuple[int, int]:
        """(committed step, writer's tag) of the registered state."""
        _, _, step, tag = _HEADER.unpack(self.buf[:_HEADER.size].tobytes())
        return step, tag

    def _after_step(self, replaced: bool) -> None:
        # A heal, a rollback or a peer-snapshot restore wrote the
        # registered state: the step's events say so, and a header this
        # object did not write shows it too.
        if replaced or self.buf[:_HEADER.size].tobytes() != self._header:
            self._load()

    def _after_commit(self, ok: bool) -> None:
        if ok:
            self._write(self._dump(True), self.comm.committed_step)
        else:
            self._load()  # the step rolled back: so does the object


def register_stateful(comm, name: str, obj, capacity: int = 65536) -> StatefulState:
    """Register obj's state (anything with ``state_dict()`` and
    ``load_state_dict()``: a StatefulDataLoader, a tokenizer's buffer, an
    augmentation RNG) with an ft.Comm, before its first step, as state that
    heals with the model: it is pickled into a registered buffer of
    ``capacity`` bytes after every committed step (never between step and
    commit, when ft serves registered state to healing peers), loaded back
    into obj after a step() that healed this replica, rolled it back or
    restored its group's peer snapshot (ft.Comm's snapshot_every), and
    after a commit() that failed (the step's data is given back, so is
    the object's). A state over capacity raises StateCapacityError (here,
    or from the commit() that made it).

    The state must be job-global: every replica's object holds the same
    state at every committed step (the job's position, not a replica's
    own), as a restarted replica resumes from its peers' state, never its
    own. Under peer snapshots, in a group with no replica, each rank's
    object may hold a state of its own (its data shard's reader): a rank's
    replacement restores the dead rank's copy. Returns the StatefulState
    (``version``, ``loads``)."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("ftcomm: register_stateful: name %r: want a non-empty str" % (name,),
                                   kinds=("invalid_argument",))
    return StatefulState(comm, name, obj, capacity)
