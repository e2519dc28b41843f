"""State registration with an ftcomm.ft.Comm (ftcomm.ft_torch's first piece):
register_state registers a module's parameters and buffers and an
optimizer's state (made now), as what a returning replica heals from its
peers; protect_shards registers a rank's whole state for its group's peer
snapshots. A DTensor (FSDP2's sharded parameter) registers as its local
shard (local_tensor).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .data import register_stateful
from .errors import FtcommError, InvalidArgumentError, InvalidTypeError


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The memory of t that this rank holds: a DTensor's local shard (a
    view of FSDP2's sharded storage), else t's data."""
    lt = getattr(t, "_local_tensor", None)
    if lt is not None:
        return lt.detach()
    if hasattr(t, "to_local"):
        return t.to_local().detach()
    return t.detach()


def _materialize(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's per-parameter state now, as a fresh state:
    one step with zero gradients, then the parameters put back and every
    state tensor zeroed (for Adam, AdamW, SGD with momentum, ...: the state
    of an optimizer that has not stepped). The tensors made here are the
    ones the optimizer updates in place from then on."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all(len(optimizer.state.get(p, {})) > 0 for p in params):
        return
    saved = []
    with torch.no_grad():
        for p in params:
            saved.append((p, p.detach().clone(), p.grad))
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p, data, grad in saved:
            p.copy_(data)
            p.grad = grad
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.zero_()


def register_state(comm, module: Optional[torch.nn.Module] = None, optimizer: Optional[Any] = None,
                   prefix: str = "") -> List[str]:
    """Register module's parameters and buffers and optimizer's state with
    an ftcomm.ft.Comm (before its first step), as what a healing replica
    receives. Returns the names registered, in order.

    The optimizer (a torch optimizer, or an OptimizerWrapper) gets its state
    made now (see _materialize). Every tensor is registered as its local
    memory (a DTensor's shard); empty shards are skipped. Every replica (and
    the same shard rank of every replica group) registers the same names in
    the same order: build the model and optimizer the same way everywhere.
    State that is not a tensor (a Python number in an optimizer's state) is
    refused: it cannot be healed.
    """
    names: List[str] = []

    def reg(name: str, t: torch.Tensor) -> None:
        lt = local_tensor(t)
        if lt.numel() == 0:
            return
        if not lt.is_contiguous():
            raise FtcommError("ftcomm: register_state: %s is not contiguous: its memory cannot be healed in place" % name,
                              kinds=("invalid_argument",))
        comm.register(prefix + name, lt)
        names.append(prefix + name)

    fqn: Dict[int, str] = {}
    if module is not None:
        for n, p in module.named_parameters():
            fqn[id(p)] = n
            reg("param/" + n, p)
        for n, b in module.named_buffers():
            if b is not None:
                reg("buffer/" + n, b)
    if optimizer is not None:
        opt = getattr(optimizer, "optim", optimizer)
        _materialize(opt)
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                st = opt.state.get(p)
                if not st:
                    continue
                pname = fqn.get(id(p), "group%d.%d" % (gi, pi))
                for k, v in sorted(st.items()):
                    if isinstance(v, torch.Tensor):
                        reg("optim/%s/%s" % (pname, k), v)
                    elif v is not None:
                        raise FtcommError("ftcomm: register_state: the optimizer's state %r of %s is a %s, not a "
                                          "tensor: it cannot be healed" % (k, pname, type(v).__name__),
                                          kinds=("invalid_argument",))
    return names


def protect_shards(comm, module: Optional[torch.nn.Module] = None, optimizer: Optional[Any] = None, *,
                   stateful: Optional[Dict[str, Any]] = None,
                   tensors: Optional[Dict[str, torch.Tensor]] = None) -> List[str]:
    """Register everything a rank of a replica group with no replica holds
    with its ftcomm.ft.Comm (before its first step), so that the group's
    peer snapshots (``snapshot_every``) carry it: when the rank dies, its
    replacement (a slot spare, or its restarted process) restores it from
    the buddy's copy and the other ranks roll back to the same step.
    Returns the names registered, in order.

    - module and optimizer: register_state's — the module's parameters and
      buffers as this rank's local shards (FSDP2's DTensors), the
      optimizer's state made now;
    - stateful: name -> an object with ``state_dict()`` and
      ``load_state_dict()`` (a data loader's reader, an RNG), each through
      register_stateful with its default capacity (loaded back after a
      restore; call register_stateful for another capacity);
      ftcomm.ft.Sampler registers its position itself;
    - tensors: name -> a tensor this rank keeps besides (a flat parameter
      shard, a hand-written optimizer's state), registered as its local
      memory.

    Every rank registers the same names with the same shapes in the same
    order (a replacement's state must have the dead rank's layout: pad
    shards to one size). Raises InvalidArgumentError when the Comm takes no
    peer snapshots (``snapshot_every`` 0) or its group has one rank, where
    nothing would keep a copy of the state registered here.
    """
    if comm.group_size < 2:
        raise InvalidArgumentError("ftcomm: protect_shards: the Comm's replica group has %d rank: peer snapshots keep "
                                   "a rank's state on another rank of its group (a group of one heals from its "
                                   "replicas: use register_state)" % comm.group_size, kinds=("invalid_argument",))
    if comm.snapshot_every <= 0:
        raise InvalidArgumentError("ftcomm: protect_shards: the Comm takes no peer snapshots: make it with "
                                   "snapshot_every=K (a copy of every rank's state every K committed steps)",
                                   kinds=("invalid_argument",))
    names = register_state(comm, module, optimizer)
    for name, t in (tensors or {}).items():
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError("ftcomm: protect_shards: tensors[%r] is a %s, not a tensor" % (
                name, type(t).__name__), kinds=("invalid_argument",))
        lt = local_tensor(t)
        if not lt.is_contiguous():
            raise InvalidArgumentError("ftcomm: protect_shards: tensors[%r] is not contiguous: its memory cannot be "
                                       "restored in place" % name, kinds=("invalid_argument",))
        comm.register("tensor/" + name, lt)
        names.append("tensor/" + name)
    for name, obj in (stateful or {}).items():
        register_stateful(comm, name, obj)
        names.append("ftcomm.stateful/" + name)
    return names
