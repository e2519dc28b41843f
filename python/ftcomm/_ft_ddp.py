"""FT-DDP (ftcomm.ft_torch's data-parallel piece for one process per
replica): torch's DistributedDataParallel over SoloProcessGroup, its
gradient buckets reduced across the replicas by an ftcomm.ft.Comm through
a comm hook. Each bucket's future completes, in issue order, on the hook's
Completer once its collective has ended; a failure is recorded by the
ft.Comm for the step's commit, not raised.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ._completer import Completer
from ._solo_group import SoloProcessGroup
from .errors import FtcommError
from .reduce_op import ReduceOp


class _HookState:
    def __init__(self, comm, op: ReduceOp):
        self.comm = comm
        self.op = op
        self.completer: Optional[Completer] = None
        self.failures = 0


def _bucket_tensor(bucket) -> torch.Tensor:
    for name in ("buffer", "get_tensor"):
        f = getattr(bucket, name, None)
        if f is not None:
            return f()
    raise TypeError("ftcomm: DDP's GradBucket has neither buffer() nor get_tensor()")


def _complete(work, fut: torch.futures.Future, value) -> None:
    """Complete a bucket's future once its ft collective has ended (its
    Completer runs this in issue order)."""
    try:
        work.wait()  # False on failure: recorded for the commit
    except BaseException:  # noqa: B902 - the commit fails; the future must complete
        pass
    fut.set_result(value)


def _ft_hook(state, bucket):  # (no annotations: DDP checks them against its own types)
    t = _bucket_tensor(bucket)
    fut: torch.futures.Future = torch.futures.Future(devices=[t.device]) if t.is_cuda else torch.futures.Future()
    try:
        w = state.comm.all_reduce(t, state.op, async_op=True)
    except FtcommError:
        # Not taking part in this step (sitting out): the commit fails.
        state.failures += 1
        fut.set_result(t)
        return fut
    if state.completer is None:
        state.completer = Completer("ftcomm-ft-hook")
    state.completer.add(functools.partial(_complete, w, fut, t))
    return fut


def ddp_comm_hook(comm, op: ReduceOp = ReduceOp.AVG):
    """(state, hook) for DistributedDataParallel.register_comm_hook: each
    gradient bucket is reduced (averaged by default) across the replicas by
    the ft.Comm; a failure is recorded for the step's commit."""
    return _HookState(comm, op), _ft_hook


def ft_ddp(module: torch.nn.Module, comm, op: ReduceOp = ReduceOp.AVG, **ddp_kwargs):
    """module in torch's DistributedDataParallel, its gradients averaged
    across the replicas by the ft.Comm (DDP's buckets, overlapped with the
    backward pass; DDP's own group is this process alone). Start every
    replica from the same parameters (the same seed), or heal them: DDP
    broadcasts nothing across replicas."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    # Every replica must cut its gradients into the same buckets, in the
    # same order, at every step. DDP rebuilds its buckets once, after its
    # first iteration, in the order the gradients became ready: a replica
    # that (re)starts while its peers run would all-reduce its first
    # step's buckets against their rebuilt ones. find_unused_parameters
    # keeps the first layout (parameter order: the same everywhere) for
    # good, at the cost of a walk of the autograd graph per forward.
    if ddp_kwargs.get("static_graph"):
        raise FtcommError("ftcomm: ft_ddp: static_graph rebuilds DDP's buckets after the first iteration; a replica "
                          "that restarts would cut its gradients differently from its peers", kinds=("invalid_argument",))
    ddp_kwargs["find_unused_parameters"] = True
    ddp = DDP(module, process_group=SoloProcessGroup(), **ddp_kwargs)
    state, hook = ddp_comm_hook(comm, op)
    ddp.register_comm_hook(state, hook)
    ddp._ftcomm_hook_state = state
    return ddp
