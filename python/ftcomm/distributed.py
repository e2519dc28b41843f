"""ftcomm as a torch.distributed backend.

``import ftcomm.distributed`` registers the backend ``"ftcomm"`` with
``torch.distributed.Backend.register_backend`` (importing it again, or
calling :func:`register`, does nothing more), so that::

    import torch.distributed as dist
    import ftcomm.distributed                      # registers "ftcomm"
    dist.init_process_group("ftcomm")              # or new_group(ranks, backend="ftcomm")
    model = DistributedDataParallel(model)         # DDP, FSDP, DTensor: unchanged

gives a :class:`ProcessGroupFtcomm`: a ``torch.distributed.ProcessGroup``
written in Python whose collectives run on ftcomm communicators — gloo for
CPU tensors (made with the group), NCCL for CUDA tensors (made at the first
collective on a CUDA device, as torch's NCCL backend does) — one group
serving both, as torch's ``"cpu:gloo,cuda:nccl"``. A group can also wrap
communicators made with :func:`ftcomm.new_comm` (:func:`process_group`,
and ftcomm.device_mesh).

What it promises:

- Work objects (``wait``, ``is_completed``, ``is_success``, ``exception``,
  ``get_future``, ``result``). On CPU an op runs asynchronously on the
  comm's worker; ``get_future()`` completes from a thread of the group when
  the op has ended (DDP's comm hooks chain on it).
- CUDA: the order of torch's NCCL backend. An async op runs on a stream of
  the group (one per device) that first waits for the caller's current
  stream; ``wait()`` makes the caller's current stream wait for the op,
  without blocking the host; ``get_future()`` is a CUDA future whose value
  is ready on the op's stream; the tensors are recorded on that stream for
  the caching allocator. An op torch issues with ``async_op=False``
  (``opts.asyncOp``, torch >= 2.7) is ordered with the current stream
  itself: behind the work queued there, ahead of what is queued next, and
  its Work is done at once. A failure of a CUDA op (a deadline, a dead peer)
  breaks the comm and is raised by the group's next call and by
  ``exception()``.
- Deadlines: every op runs under the group's timeout (init_process_group's
  ``timeout``); past it the op fails and its comm is broken.
- A call refused on one rank (an argument the group or the communicator
  finds invalid there, InvalidArgumentError) is refused on the group's
  comm for its tensors' device, in the op's place: on CPU (gloo) every
  other rank's matching call fails at once with ``PeerRefusedError`` (a
  ``DistBackendError``) naming that rank and its reason, and the group goes
  on; on CUDA (NCCL) the others wait for the op's deadline.
- Failures are torch's distributed errors: every ftcomm error leaves the
  group as an instance of ``torch.distributed.DistBackendError`` (on torch
  versions that have it; :class:`DistBackendError` here otherwise) that is
  also the ftcomm error it came from (``PeerFailedError``,
  ``CommTimeoutError``...), its message naming the failed peers by global
  rank (``.ranks``; ``.group_ranks`` their ranks in the group).
- Point-to-point ops (``isend``/``irecv``/``batch_isend_irecv``) are held
  until the next op of the group or until one of their Works is waited on
  (or tested), then issued as one ftcomm batch: run concurrently, in any
  order of the peers' calls.
- A ``PREMUL_SUM`` made by torch (``torch.distributed._make_nccl_premul_sum
  (factor)``; FSDP2's reduce-scatter under ``set_gradient_divide_factor``)
  on every reduction (all-reduce and its coalesced form, reduce,
  reduce-scatter of a list, of a tensor and coalesced), on CPU and CUDA
  tensors of a floating-point dtype, as torch's NCCL backend runs it: each
  rank's input is multiplied by the factor in its dtype, then summed. The
  factor (a number, or a one-element tensor of the data's dtype, read on
  its device; a tensor of another dtype is refused, as torch's NCCL
  refuses it) comes from the op's pickled state, which torch >= 2.0 has;
  on torch 1.13 such an op is refused with an ``InvalidArgumentError``
  that says so. On bfloat16 data torch's own NCCL backend (up to at least
  2.11) hands NCCL a wrong factor (pytorch/pytorch#190745; docs/python.md):
  there ftcomm's result is the right one, not torch's.

What it does not do (each raises a clear error, never hangs): receiving from
any source (``recv`` without ``src``), a ``PREMUL_SUM`` made by torch 1.13
(its factor cannot be read there: upgrade torch, or with FSDP2
``set_force_sum_reduction_for_comms(True)``), tensors of several devices in
one call, a first op on a new CUDA device that is point-to-point (the NCCL
comm is made by a collective of every rank of the group).

This module is the backend's public face: what users name is in
``__all__`` (``ProcessGroupFtcomm`` and ``DistBackendError`` are defined
in private modules and exported here under the names users import). The
rest is private: the group (_dist_group.py), its Works (_dist_works.py),
torch's reduce ops (_dist_reduce_ops.py), the errors (_dist_errors.py).
Every op runs on ftcomm's Communicator (ftcomm.comm), the one
implementation of the collectives.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ._dist_errors import DistBackendError, unsupported
from ._dist_group import BACKEND, ProcessGroupFtcomm, timeout_s
from .comm import Communicator, new_comm
from .store import through_torch_store

__all__ = ["BACKEND", "ProcessGroupFtcomm", "DistBackendError", "register", "process_group", "create_process_group"]


# ---------------------------------------------------------------- making groups

def _hints() -> Optional[Dict[str, str]]:
    addr = os.environ.get("FTCOMM_LISTEN_ADDR")
    return {"listen_addr": addr} if addr else None


def create_process_group(store, rank: int, size: int, timeout=None) -> ProcessGroupFtcomm:
    """torch.distributed's creator for "ftcomm" (store, rank, size,
    timeout): group rank 0 hosts an ftcomm store whose address goes through
    torch's store; the group's CPU comm is made now."""
    t = timeout_s(timeout)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    # The group's name: chosen by its rank 0, unique in the job.
    if rank == 0:
        name = "pg-" + secrets.token_hex(6)
        store.set("ftcomm/pg-name", name)
    else:
        name = store.get("ftcomm/pg-name").decode()
    fstore = through_torch_store(store, "ftcomm/pg-store", rank, host, max(t or 0, 60.0))
    try:
        cpu = new_comm("gloo", "cpu", name=name, store=fstore, rank=rank, size=size, timeout=t, hints=_hints())
    except BaseException:
        fstore.close()
        raise
    return ProcessGroupFtcomm(rank, size, comms={"cpu": cpu}, store=fstore, own_store=True, timeout=t, name=name,
                              hints=_hints())


def _create_extended(opts, backend_options=None) -> ProcessGroupFtcomm:
    """The creator with torch's extended API (torch >= 2.0)."""
    pg = create_process_group(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    gid = getattr(opts, "group_id", None)
    if gid:
        pg._set_group_name(gid)
    return pg


def process_group(comm: Communicator, *more: Communicator, name: Optional[str] = None,
                  own_comms: bool = False) -> ProcessGroupFtcomm:
    """A ProcessGroup over communicators made with ftcomm.new_comm (at most
    one per device type, the same ranks): ops on their devices' tensors run
    on them. The comms stay the caller's (finalize them after the group's
    last op) unless own_comms."""
    comms: Dict[str, Communicator] = {}
    for c in (comm,) + more:
        comms[str(torch.device(c.get_device()) if not isinstance(c.get_device(), torch.device) else c.get_device())] = c
        if c.get_size() != comm.get_size() or c.get_rank() != comm.get_rank():
            raise unsupported("process_group: comms of different ranks or sizes")
    pg = ProcessGroupFtcomm(comm.get_rank(), comm.get_size(), comms=comms, own_comms=own_comms,
                            name=name or comm.get_name())
    return pg


_registered = False


def register(name: str = BACKEND) -> None:
    """Register the backend with torch.distributed (import does it; safe to
    call again)."""
    global _registered
    if name.upper() in getattr(dist.Backend, "_plugins", {}):
        _registered = True
        return
    kw: Dict[str, Any] = {}
    import inspect
    params = inspect.signature(dist.Backend.register_backend).parameters
    if "devices" in params:
        kw["devices"] = ["cpu", "cuda"]
    if "extended_api" in params and "devices" in params:
        # torch 2.x: the extended API names the group (group_id), which
        # DeviceMesh and functional collectives resolve by.
        dist.Backend.register_backend(name, _create_extended, extended_api=True, **kw)
    else:
        dist.Backend.register_backend(name, create_process_group, **kw)
    _registered = True


register()
