"""Batched point-to-point, with torchcomms' names: a Communicator's
``batch_op_create()`` gives a BatchSendRecv; its sends and receives are
issued together and run concurrently. The classes are public through
ftcomm.comm and ftcomm (this module is not).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from . import _lib, _tensors
from ._refusal import c_rank, refusing
from .errors import invalid_argument as _inv
from .work import Work


class BatchP2POptions:
    """Options of BatchSendRecv.issue."""

    __module__ = "ftcomm.comm"  # where users name it

    def __init__(self, timeout=None, hints: Optional[Dict[str, str]] = None):
        self.timeout = timeout
        self.hints = dict(hints or {})


class P2POpType:
    __module__ = "ftcomm.comm"  # where users name it

    SEND = "send"
    RECV = "recv"


class P2POp:
    """One send or receive of a batch."""

    __module__ = "ftcomm.comm"  # where users name it

    __slots__ = ("type", "tensor", "peer")

    def __init__(self, type: str, tensor: Any, peer: int):
        self.type, self.tensor, self.peer = type, tensor, peer

    def __repr__(self):
        return "P2POp(%s, peer %d)" % (self.type, self.peer)


def _refuse_batch(b: "BatchSendRecv", kind: int, exc: BaseException, args, kwargs) -> None:
    b._comm._refuse(kind, exc, 0, b._refused_entries())


class BatchSendRecv:
    """Sends and receives issued together and run concurrently
    (torchcomms' batched point-to-point): ``b = comm.batch_op_create()``,
    ``b.send(t, dst)``, ``b.recv(t, src)``, then ``b.issue(async_op)``.
    Every peer posts the matching counterparts in its own batch."""

    __module__ = "ftcomm.comm"  # where users name it

    def __init__(self, comm):
        self._comm = comm  # a Communicator
        self.ops: List[P2POp] = []

    def send(self, tensor, dst: int) -> None:
        self.ops.append(P2POp(P2POpType.SEND, tensor, dst))

    def recv(self, tensor, src: int) -> None:
        self.ops.append(P2POp(P2POpType.RECV, tensor, src))

    @refusing(_lib.OP_BATCH, _refuse_batch)
    def issue(self, async_op: bool = False, options: Optional[BatchP2POptions] = None, timeout=None) -> Work:
        c = self._comm
        if options is not None and timeout is None:
            timeout = options.timeout
        if not self.ops:
            raise _inv("batch: no sends or receives")
        entries = []
        for i, p in enumerate(self.ops):
            ptr, n, dt = c._check_tensor(p.tensor, "batch[%d]" % i)
            entries.append((_lib.P2P_SEND if p.type == P2POpType.SEND else _lib.P2P_RECV, ptr, n, dt, c._peer(p.peer)))
        return c._batch(entries, async_op, timeout, [p.tensor for p in self.ops])

    def _refused_entries(self) -> List[tuple]:
        """(kind, peer) of the entries a refused batch concerns: all but
        those known to be empty, which neither side sends (see
        Communicator._batch)."""
        out = []
        for p in self.ops:
            try:
                if _tensors.numel(p.tensor) == 0:
                    continue
            except Exception:
                pass
            out.append((_lib.P2P_SEND if p.type == P2POpType.SEND else _lib.P2P_RECV, c_rank(p.peer)))
        return out
