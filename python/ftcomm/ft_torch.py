"""Fault-tolerant data parallelism for torch modules, through ftcomm.ft.Comm.

Three pieces, each usable alone:

- :func:`register_state` — one call that registers a module's parameters
  and buffers and an optimizer's state (made now, as zeros) with an
  ft.Comm, so that a returning replica heals them from its peers. Sharded
  parameters (FSDP2's DTensors) register their local shard: with replica
  groups, shard rank i heals from shard rank i of a live group.
  :func:`protect_shards` is its form for a group with no replica (FSDP over
  every rank, ft.Comm's ``snapshot_every``): it registers a rank's shards,
  optimizer state, data position and extra tensors for its peer
  snapshots, and refuses a Comm that takes none.
- :class:`OptimizerWrapper` — ``zero_grad()`` starts the ft step (quorum,
  reconfiguration, healing), ``step()`` commits it and steps the optimizer
  only if the step committed.
- the data-parallel collectives through ft.Comm:

  - FT-DDP: :func:`ft_ddp` wraps a module in torch's DistributedDataParallel
    whose gradient buckets are averaged across replicas by ft.Comm (a comm
    hook); DDP's own group is this process alone. One process per replica.
  - FT-HSDP (torch >= 2.6, FSDP2): :func:`hsdp_all_reduce_hook` gives
    ``fully_shard``'s all-reduce hook: the reduce-scattered gradient shard
    is averaged across the replica groups by ft.Comm (FT comm i joins
    shard rank i of every group); the shard dimension runs on the group's
    own process group (ftcomm.device_mesh, or any).
  - FSDP with no replica (peer snapshots): :class:`ShardGroup` is the
    process group of the ft.Comm's replica group over ft's group comm of
    the current epoch (``group_backend="nccl"`` on GPUs), and
    :func:`shard_mesh` its DeviceMesh for ``fully_shard``: a rank's death
    fails the step instead of raising into FSDP, and the group follows the
    epochs (a slot spare's place included).

A failure in a collective is recorded by ft.Comm, not raised; the step's
commit says whether it counts::

    c = ftcomm.ft.Comm(job="j", group="r0", ...)
    model = ft_ddp(model, c)
    opt = OptimizerWrapper(c, torch.optim.AdamW(model.parameters()))
    register_state(c, model, opt)
    while c.committed_step < steps:
        opt.zero_grad()                   # ft step: quorum, heal if behind
        model(batch(c.committed_step)).backward()
        opt.step()                        # commit; optimizer step if committed

This module is the face of those pieces, one module each: _ft_state.py
(register_state, protect_shards, local_tensor), _ft_optimizer.py
(OptimizerWrapper), _ft_ddp.py (ft_ddp, ddp_comm_hook), _solo_group.py
(SoloProcessGroup), _ft_hsdp.py (hsdp_all_reduce_hook, apply_hsdp),
_ft_fsdp.py (ShardGroup, shard_mesh). Import
them from here.
"""

from ._ft_ddp import ddp_comm_hook, ft_ddp
from ._ft_fsdp import ShardGroup, shard_mesh
from ._ft_hsdp import apply_hsdp, hsdp_all_reduce_hook
from ._ft_optimizer import OptimizerWrapper
from ._ft_state import local_tensor, protect_shards, register_state
from ._solo_group import SoloProcessGroup

__all__ = ["register_state", "protect_shards", "OptimizerWrapper", "ft_ddp", "ddp_comm_hook", "hsdp_all_reduce_hook",
           "apply_hsdp", "SoloProcessGroup", "local_tensor", "ShardGroup", "shard_mesh"]
