"""SoloProcessGroup: a torch.distributed process group of this process alone,
DDP's own group under FT-DDP (its collectives have nothing to exchange;
the replicas' exchange is the ft.Comm's comm hook). Its Works are the
"ftcomm" backend's done Works.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from ._dist_works import _DoneWork, hold_work


class SoloProcessGroup(dist.ProcessGroup):
    """A process group of this process alone (DDP's own group under FT-DDP:
    its collectives have nothing to exchange)."""

    __module__ = "ftcomm.ft_torch"  # where users name it

    def __init__(self):
        super().__init__(0, 1)
        self._held = collections.OrderedDict()

    def _hold(self, w) -> None:
        hold_work(self._held, w)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "ftcomm-solo"

    def _get_backend_name(self) -> str:
        return "ftcomm-solo"

    def _done(self, result):
        return _DoneWork(self, result)

    def allreduce(self, tensors, opts=None):
        return self._done(list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors])

    def allreduce_coalesced(self, tensors, opts=None):
        return self._done(list(tensors))

    def broadcast(self, tensors, opts=None):
        return self._done(list(tensors) if not isinstance(tensors, torch.Tensor) else [tensors])

    def allgather(self, output_tensors, input_tensors, opts=None):
        for outs, i in zip(output_tensors, input_tensors):
            outs[0].copy_(i)
        return self._done([o for outs in output_tensors for o in outs])

    def _allgather_base(self, output, input, opts=None):
        output.copy_(input.reshape(output.shape))
        return self._done([output])

    def barrier(self, opts=None):
        return self._done([])
