"""FSDP with no replica: the shard group is the ft.Comm's replica group
(group_size ranks, peer snapshots), and its torch.distributed process group
runs on ft's group comm of the current epoch (ft.Comm.group_comm()), which
ft revokes when a rank of the group dies, closes when the group is formed
again, and watches for the step's commit.

ShardGroup is that process group; shard_mesh makes the one-dimensional
DeviceMesh of it that FSDP2's ``fully_shard`` takes. An op that fails for a
fault (a dead or silent peer, the revocation, the comm ft closed) does not
raise into FSDP, whose state an exception half-way through a forward or a
backward would leave wrong: the op completes with its outputs undefined,
the step is failed (ft.Comm.fail_step) and its commit returns False, and
the next step() restores what the step may have written (peer snapshots
roll every rank back). Errors of the caller (wrong sizes, types, devices)
still raise.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.distributed as dist

from ._dist_errors import dist_error, unsupported
from ._dist_group import ProcessGroupFtcomm
from ._dist_works import _DoneWork
from .errors import (BackendUnavailableError, BadHandleError, FtcommError, InternalError, InterruptedOpError,
                     InvalidArgumentError, MismatchError)

# What a ShardGroup still raises: the caller's errors, not faults.
_RAISED = (InvalidArgumentError, MismatchError, BackendUnavailableError, InterruptedOpError, BadHandleError,
           InternalError)


class ShardGroup(ProcessGroupFtcomm):
    """A torch.distributed ProcessGroup of an ft.Comm's replica group (rank
    group_rank of group_size) over ft's group comm of the current epoch: at
    the first op of each epoch it takes ``comm.group_comm()``, so the same
    group object (FSDP2's, a DeviceMesh's) serves every epoch, the ranks a
    slot spare brings in included. The ft.Comm must be made with
    ``group_backend="nccl"`` for CUDA tensors (FSDP2 on GPUs); the default
    group comm takes CPU tensors.

    Use it between step() and commit(). An op failed by a fault completes
    with undefined outputs and fails the step (see the module); ``failure``
    is the first such error of the current step, or None.
    """

    def __init__(self, comm, name: Optional[str] = None):
        if comm.group_size < 2:
            raise InvalidArgumentError("ftcomm: ShardGroup: the Comm's replica group has %d rank: there is nothing to "
                                       "shard over" % comm.group_size, kinds=("invalid_argument",))
        super().__init__(comm.group_rank, comm.group_size, name=name or "ft-shard-%s" % comm.group, own_comms=False)
        self._ft = comm
        self._epoch: Optional[int] = None
        self._flock = threading.Lock()
        self._failed: Optional[tuple] = None  # (the step's key, the first error of that step)

    def _step_key(self):
        """Names the step in progress (or the last one, until the next
        step()): the Comm's count of step() calls; for a stand-in without
        one, its epoch and committed step."""
        steps = getattr(self._ft, "_steps", None)
        if steps is not None:
            return steps
        return (self._ft.epoch, self._ft.committed_step)

    @property
    def failure(self) -> Optional[BaseException]:
        """The first fault of the ops of the step in progress (or of the
        last step, until the next step()), or None."""
        f = self._failed
        if f is None:
            return None
        try:
            key = self._step_key()
        except FtcommError:
            return f[1]
        return f[1] if f[0] == key else None

    def _refresh(self) -> None:
        """Take ft's group comm of the current epoch, if it changed."""
        e = self._ft.epoch
        if e == self._epoch and self._comms:
            return
        with self._lock:
            c = self._ft.group_comm()
            dev = c.get_device()
            dev = torch.device(dev) if not isinstance(dev, torch.device) else dev
            self._comms = {self._key(dev, c): c}
            self._epoch = e

    def _comm_for(self, dev: torch.device, collective: bool):
        self._refresh()
        c = self._comms.get(self._key(dev))
        if c is None:
            raise unsupported("tensors on %s: ft's group comm of this Comm takes %s tensors (group_backend \"nccl\" "
                              "for CUDA tensors)" % (dev, ", ".join(str(k) for k in self._comms)))
        return c

    def barrier(self, opts=None):
        try:
            self._refresh()
        except FtcommError as e:
            err = self._op_failed(dist_error(e, self))
            if err is not None:
                raise err from None
            return _DoneWork(self, [])  # the step failed: nothing to wait for
        return super().barrier(opts)

    def _op_failed(self, err: BaseException) -> Optional[BaseException]:
        if isinstance(err, _RAISED) or not isinstance(err, FtcommError):
            return err
        with self._flock:
            try:
                key = self._step_key()
                _ = self._ft.epoch  # raises once the Comm is closed
            except FtcommError:
                return err  # the Comm is closed: nothing to fail
            if self._failed is not None and self._failed[0] == key:
                return None
            self._failed = (key, err)
        try:
            self._ft.fail_step("shard group: %s" % err)
        except FtcommError:
            # Outside a step, or a step()/commit() in progress on the
            # loop's thread: ft watches its group comm, and the commit of
            # a step whose op failed fails all the same.
            pass
        return None

    def shutdown(self) -> None:
        """Drop the group's hold on ft's comm (the comm stays ft's)."""
        with self._lock:
            self._comms = {}
            self._epoch = None


def shard_mesh(comm, name: str = "shard"):
    """A one-dimensional DeviceMesh (named name) over a ShardGroup of comm:
    pass it to FSDP2's ``fully_shard(module, mesh=...)``. The group is
    registered with torch.distributed as name and becomes its default
    group; ``mesh.get_group()`` returns it. Needs torch with DeviceMesh
    (>= 2.2; FSDP2 >= 2.4)."""
    from . import device_mesh as _dm
    if not hasattr(dist, "DeviceMesh") and not _dm._has_device_mesh():
        raise BackendUnavailableError("ftcomm: shard_mesh: this torch (%s) has no DeviceMesh (torch >= 2.2)" %
                                      torch.__version__, kinds=("backend_unavailable",))
    pg = ShardGroup(comm, name="ft-shard-%s" % comm.group)
    _dm._register_group(pg, name)
    dist.distributed_c10d.GroupMember.WORLD = pg
    device_type = "cuda" if comm._group_backend == "nccl" else "cpu"
    mesh = torch.arange(comm.group_size, dtype=torch.int, device="cpu")
    dm = _dm._make_mesh(device_type, mesh, (name,), comm.group_rank)
    dm._dim_group_names = [name]
    return dm
