"""FT-HSDP (FSDP2, torch >= 2.6): FSDP over a replica group's own ranks, the
reduce-scattered gradient shard reduced across the replica groups by an
ftcomm.ft.Comm (FT comm i joins shard rank i of every group) through
FSDP's all-reduce hook; a failure is recorded for the step's commit.
"""

from __future__ import annotations

from typing import Callable

import torch

from .errors import FtcommError
from .reduce_op import ReduceOp


def hsdp_all_reduce_hook(comm, op: ReduceOp = ReduceOp.AVG) -> Callable[[torch.Tensor], None]:
    """FSDP2's all-reduce hook (``FSDPModule.set_all_reduce_hook``) for
    HSDP through ft.Comm: the reduce-scattered gradient shard of this rank
    is reduced across the replica groups (FT comm i joins shard rank i of
    every group). The call returns once the op is done (ft's collectives on
    CUDA tensors wait on the host), so FSDP's later work on the stream sees
    the result; a failure is recorded for the commit."""

    def hook(reduce_output: torch.Tensor) -> None:
        try:
            comm.all_reduce(reduce_output, op)
        except FtcommError:
            pass  # sitting out: the commit fails

    return hook


def apply_hsdp(model: torch.nn.Module, comm, shard_mesh, *, blocks=None, op: ReduceOp = ReduceOp.AVG,
               **fully_shard_kwargs) -> torch.nn.Module:
    """FT-HSDP: FSDP2 (``fully_shard``) over shard_mesh (this replica
    group's ranks) for each of blocks (e.g. a transformer's layers) and the
    root, and the all-reduce across replica groups through ft.Comm on every
    FSDP module. Needs torch with FSDP2 and set_all_reduce_hook (>= 2.6)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # type: ignore
        except ImportError:
            raise FtcommError("ftcomm: FT-HSDP needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.4); this "
                              "torch is %s" % torch.__version__, kinds=("backend_unavailable",)) from None
    for b in blocks or []:
        fully_shard(b, mesh=shard_mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=shard_mesh, **fully_shard_kwargs)
    hook = hsdp_all_reduce_hook(comm, op)
    n = 0
    for m in model.modules():
        if hasattr(m, "set_all_reduce_hook"):
            m.set_all_reduce_hook(hook)
            n += 1
    if n == 0:
        raise FtcommError("ftcomm: FT-HSDP needs FSDPModule.set_all_reduce_hook (torch >= 2.6); this torch is %s" %
                          torch.__version__, kinds=("backend_unavailable",))
    return model
