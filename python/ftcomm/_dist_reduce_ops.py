"""torch's reduce ops as ftcomm's, for the torch.distributed backend: each
reduction by its type, a PREMUL_SUM with the factor of its pickled state
(torch >= 2.0; refused on 1.13, naming the fix). torch's ReduceOp compares
and hashes by type alone, so ops are never compared or used as keys here.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from ._dist_errors import unsupported
from .reduce_op import ReduceOp

# torch's reductions that ftcomm's ReduceOp has under the same name.
_REDUCTIONS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


def op_state(op) -> Optional[tuple]:
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


def ops_pickle() -> bool:
    """Whether this torch's ReduceOp pickles (torch >= 2.0; 1.13's does not)."""
    try:
        return op_state(dist.ReduceOp(dist.ReduceOp.RedOpType.SUM)) is not None
    except (AttributeError, TypeError):
        return False


def type_name(kind) -> Optional[str]:
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


def from_torch(op) -> ReduceOp:
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
    st = op_state(op)
    name = type_name(st[0] if st is not None else getattr(op, "op", op))
    if name == "PREMUL_SUM":
        if st is None:
            if not ops_pickle():
                raise unsupported(
                    "PREMUL_SUM made by torch %s: its factor cannot be read (torch's ReduceOp shows it to Python only "
                    "by pickling, from torch 2.0 on); upgrade torch, or keep the factor out of the op: with FSDP2 "
                    "set_force_sum_reduction_for_comms(True), elsewhere scale the tensor and reduce with SUM"
                    % torch.__version__)
            raise unsupported("PREMUL_SUM without a factor: make it with "
                               "torch.distributed._make_nccl_premul_sum(factor)")
        return ReduceOp.PREMUL_SUM(_premul_factor(st[1]))
    if name in _REDUCTIONS:
        return getattr(ReduceOp, name)
    raise unsupported("reduce op %r" % (op,))


def _premul_factor(f):
    """A PREMUL_SUM factor from torch's op: a number, or a one-element
    floating-point tensor (on any device; a CUDA one is read on the device,
    never by the host)."""
    if isinstance(f, torch.Tensor):
        if f.numel() != 1 or not f.is_floating_point():
            raise unsupported("PREMUL_SUM factor %s tensor of %d elements: want one floating-point element"
                               % (f.dtype, f.numel()))
        return f
    if isinstance(f, (int, float)) and not isinstance(f, bool):
        return float(f)
    raise unsupported("PREMUL_SUM factor %r: want a number or a one-element tensor" % (f,))


def factor_tensor(op: ReduceOp, dev: torch.device) -> List[torch.Tensor]:
    """op's factor when it is a tensor on dev: the group's stream reads it,
    so it is recorded there for the caching allocator."""
    f = op.factor
    return [f] if isinstance(f, torch.Tensor) and f.device == dev and f.is_cuda else []
