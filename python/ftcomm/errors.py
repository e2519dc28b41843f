"""Exceptions of ftcomm, one per kind of failure the Go core reports.

Every error raised by a call into the library is an :class:`FtcommError`
subclass. An error can be of several kinds at once (a peer's death seen at
an op's deadline is both a peer failure and a timeout); its class then
derives from each (``except TimeoutError`` and ``except PeerFailedError``
both catch it), and ``.kinds`` lists them all. FtcommError is a
RuntimeError, as torchcomms' and torch.distributed's errors are, so code
written for them catches ftcomm's.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple, Type


class FtcommError(RuntimeError):
    """A failure reported by ftcomm.

    Attributes: ``kinds`` (the Go sentinels the error matches, e.g.
    ``["peer_failed", "timeout"]``), ``ranks`` (the ranks it names: the
    failed peers), ``status`` (the ABI status code).
    """

    kinds: Tuple[str, ...] = ()
    ranks: Tuple[int, ...] = ()
    status: int = 0

    def __init__(self, message: str = "", kinds=(), ranks=(), status: int = 0, **extra):
        super().__init__(message)
        self.message = message
        self.kinds = tuple(kinds)
        self.ranks = tuple(ranks)
        self.status = status
        for k, v in extra.items():
            setattr(self, k, v)


class InvalidArgumentError(FtcommError, ValueError):
    """A caller error found before anything was sent (comm.ErrInvalidArgument);
    the communicator stays usable."""


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (not a tensor, an unsupported dtype)."""


class CommTimeoutError(FtcommError, TimeoutError):
    """An op passed its deadline (comm.ErrTimeout); the communicator was aborted."""


class RevokedError(FtcommError):
    """The communicator was revoked, here or at a peer (comm.ErrRevoked)."""


class PeerFailedError(FtcommError):
    """A peer died or its connection broke (comm.ErrPeerFailed); ``ranks`` names it."""


class MismatchError(FtcommError):
    """Ranks disagree on an op's kind, dtype, count or root (comm.ErrMismatch)."""


class PeerRefusedError(FtcommError):
    """A peer refused its side of the op: its arguments were invalid there
    (it raised InvalidArgumentError). The op moved no data, and the
    communicator stays usable: the next op runs as usual (gloo; see
    docs/python.md for nccl). Attributes ``rank`` (the rank that refused;
    also ``ranks``), ``op`` (its op, e.g. ``"broadcast"``) and ``reason``
    (what it found wrong)."""

    rank: int = -1
    op: str = ""
    reason: str = ""


class AbortedError(FtcommError):
    """The communicator was aborted (comm.ErrAborted)."""


class ClosedError(FtcommError):
    """The communicator (or ft.Comm) was closed."""


class BackendUnavailableError(FtcommError):
    """The backend cannot run here: no NCCL or CUDA, unknown name."""


class RolledBackError(FtcommError):
    """Committed steps turned out not to be part of the job's history
    (ft.RollbackError): the replica healed to the job's state of ``step`` and
    the step has started; rewind what you keep outside the registered state.
    Attributes ``from_step``, ``to_step``, ``step``, ``epoch``, and
    ``snapshot``: True when the replica group restored its peer snapshot of
    ``step`` after one of its ranks was replaced (ft.Comm's
    ``snapshot_every``), so steps ``from_step``..``to_step`` are lost to
    every rank of the group alike."""

    snapshot: bool = False


class FinishedError(FtcommError):
    """A replica ended the run (ft.Comm.finish): no replica takes another
    step. Attributes ``final`` (the run's last step) and ``step`` (this
    replica's committed step). End the training loop and close."""


class GroupDivergedError(FtcommError):
    """The replica group's shards stand at different steps (ft.ErrGroupDiverged)."""


class SnapshotLostError(FtcommError):
    """The replica group cannot restore a peer snapshot (ft.ErrSnapshotLost):
    a rank was replaced and both copies of its shard are gone (the rank and
    its buddy died together), or no snapshot was complete yet. Every rank of
    the group gets it from step(), before anything was written: the state
    stays as the rank last committed it. Restore the job from a checkpoint."""


class NotParticipatingError(FtcommError):
    """This replica is not in the current epoch (ft.ErrNotParticipating)."""


class NoStepError(FtcommError):
    """A sampler's plan was asked for outside a step: before step(), after
    commit(), or after a step() that failed (ft.ErrNoStep)."""


class SamplerMismatchError(InvalidArgumentError):
    """The sampler's state healed from the job's replicas was made by a
    sampler configured otherwise (size, seed, sequential, batch, accum,
    policy, max_accum or replicas differ: ft.SamplerMismatchError); its
    plans would read other samples than its peers'. Configure every replica
    alike."""


class TooManyCommitFailuresError(FtcommError):
    """Too many commits in a row failed (ft.ErrTooManyCommitFailures)."""


class MembershipLostError(FtcommError):
    """The registration with the coordinator ended (ft.ErrMembershipLost)."""


class BadHandleError(FtcommError):
    """An object used after it was freed (finalize, close)."""


class InternalError(FtcommError):
    """A bug in ftcomm (a Go panic, caught at the ABI)."""


class InterruptedOpError(FtcommError, InterruptedError):
    """A blocking call ended by ftcomm.interrupt() (Ctrl-C raises KeyboardInterrupt instead)."""


class ForkError(FtcommError, RuntimeError):
    """ftcomm was called in a process forked from the one that loaded it
    (a DataLoader worker, say): the Go runtime's threads do not exist there."""


_BY_KIND: Dict[str, Type[FtcommError]] = {
    "bad_handle": BadHandleError,
    "invalid_argument": InvalidArgumentError,
    "interrupted": InterruptedOpError,
    "rolled_back": RolledBackError,
    "finished": FinishedError,
    "group_diverged": GroupDivergedError,
    "snapshot_lost": SnapshotLostError,
    "peer_refused": PeerRefusedError,
    "peer_failed": PeerFailedError,
    "mismatch": MismatchError,
    "revoked": RevokedError,
    "timeout": CommTimeoutError,
    "closed": ClosedError,
    "not_participating": NotParticipatingError,
    "no_step": NoStepError,
    "sampler_mismatch": SamplerMismatchError,
    "too_many_commit_failures": TooManyCommitFailuresError,
    "membership_lost": MembershipLostError,
    "backend_unavailable": BackendUnavailableError,
    "aborted": AbortedError,
    "internal": InternalError,
}

_combined: Dict[Tuple[type, ...], type] = {}


def _class_for(kinds: List[str]) -> Type[FtcommError]:
    bases = []
    for k in kinds:
        c = _BY_KIND.get(k)
        if c is not None and c not in bases:
            bases.append(c)
    # An abort that comes with a more telling kind says nothing more, nor
    # does a kind that another refines (invalid_argument, sampler_mismatch).
    if len(bases) > 1 and AbortedError in bases:
        bases.remove(AbortedError)
    bases = [b for b in bases if not any(o is not b and issubclass(o, b) for o in bases)]
    if not bases:
        return FtcommError
    if len(bases) == 1:
        return bases[0]
    key = tuple(bases)
    cls = _combined.get(key)
    if cls is None:
        try:
            cls = type("".join(b.__name__.replace("Error", "") for b in bases) + "Error", key, {})
        except TypeError:  # incompatible layouts: keep the first kind
            cls = bases[0]
        _combined[key] = cls
    return cls


def invalid_argument(msg: str) -> InvalidArgumentError:
    """The error of an argument ftcomm refuses before calling the library:
    msg, prefixed "ftcomm: "."""
    return InvalidArgumentError("ftcomm: " + msg, kinds=("invalid_argument",))


def from_json(text: bytes, status: int) -> FtcommError:
    """The exception for a failed call's last-error JSON."""
    try:
        info = json.loads(text)
    except ValueError:
        info = {"message": text.decode(errors="replace"), "kinds": ["other"]}
    kinds = info.get("kinds") or ["other"]
    extra = {}
    rb: Optional[dict] = info.get("rollback")
    if rb:
        extra = {"from_step": rb["from_step"], "to_step": rb["to_step"], "step": rb["step"], "epoch": rb["epoch"],
                 "snapshot": bool(rb.get("snapshot", False))}
    fin: Optional[dict] = info.get("finished")
    if fin:
        extra = {"final": fin["final"], "step": fin["step"]}
    ref: Optional[dict] = info.get("refused")
    if ref:
        extra = {"rank": ref["rank"], "op": ref["op"], "reason": ref["reason"]}
    cls = _class_for(kinds)
    return cls(info.get("message", ""), kinds=kinds, ranks=info.get("ranks") or (), status=info.get("status", status), **extra)
