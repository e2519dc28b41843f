"""DeviceMesh from ftcomm communicators, with torchcomms' signature::

    comm = ftcomm.new_comm("nccl", torch.device("cuda"), name="main")
    mesh = init_device_mesh(mesh_dim_comms=(comm,), mesh_dim_names=("main",))
    fully_shard(model, mesh=mesh)                 # FSDP2, DTensor: unchanged

Each dimension's process group is a ftcomm.distributed.ProcessGroupFtcomm
over that dimension's communicator (ops on its device's tensors run on it),
registered with torch.distributed under the dimension's name (so
``mesh.get_group(name)``, functional collectives and DTensor resolve it).
Needs torch's DeviceMesh (torch >= 2.2; the private constructor arguments
used here are those of torch >= 2.10, with fallbacks for older ones). The
names torchcomms' own tests import from torchcomms.device_mesh are here.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from .comm import Communicator
from .distributed import BACKEND, ProcessGroupFtcomm, process_group

__all__ = ["init_device_mesh", "_create_torchcomm_process_group", "_flatten_with_comm", "process_group_of"]


def _device_type(comm: Communicator) -> str:
    d = comm.get_device()
    return d.type if isinstance(d, torch.device) else str(d).split(":", 1)[0]


def _create_torchcomm_process_group(comm: Communicator, group_name: str, backend_str: str = BACKEND,
                                    global_ranks_mapping: Optional[Dict[int, int]] = None) -> ProcessGroupFtcomm:
    """A ProcessGroup over comm, registered with torch.distributed as
    group_name (global rank -> group rank: global_ranks_mapping, default the
    identity)."""
    pg = process_group(comm, name=group_name)
    return _register_group(pg, group_name, backend_str, global_ranks_mapping)


def _register_group(pg: ProcessGroupFtcomm, group_name: str, backend_str: str = BACKEND,
                    global_ranks_mapping: Optional[Dict[int, int]] = None) -> ProcessGroupFtcomm:
    """Register pg with torch.distributed as group_name (global rank ->
    group rank: global_ranks_mapping, default the identity)."""
    c10d = dist.distributed_c10d
    pg._set_group_name(group_name)
    store = dist.HashStore()
    backend = backend_str if backend_str.upper() in getattr(dist.Backend, "_plugins", {}) else BACKEND
    ranks = dict(global_ranks_mapping) if global_ranks_mapping is not None else {i: i for i in range(pg.size())}
    w = getattr(c10d, "_world", None)
    if w is None:  # torch < 2.0: module-level tables
        c10d._pg_map[pg] = (backend, store)
        c10d._pg_names[pg] = group_name
        c10d._pg_group_ranks[pg] = ranks
        return pg
    w.pg_map[pg] = (backend, store)
    w.pg_names[pg] = group_name
    try:
        w.pg_backend_config[pg] = str(dist.BackendConfig(dist.Backend(BACKEND)))
    except Exception:  # noqa: B902 - a torch without BackendConfig
        w.pg_backend_config[pg] = BACKEND
    reg = getattr(c10d, "_register_process_group", None)
    if reg is not None:
        reg(group_name, pg)
    w.pg_group_ranks[pg] = ranks
    tag = "ptd:%s" % group_name
    w.tags_to_pg.setdefault(tag, []).append(pg)
    w.pg_to_tag[pg] = tag
    return pg


def process_group_of(comm: Communicator, group_name: Optional[str] = None) -> ProcessGroupFtcomm:
    """The registered ProcessGroup of comm (made once per comm)."""
    pg = getattr(comm, "_ftcomm_pg", None)
    if pg is None:
        pg = _create_torchcomm_process_group(comm, group_name or comm.get_name())
        comm._ftcomm_pg = pg
    return pg


def _make_mesh(device_type: str, mesh: torch.Tensor, names: Sequence[str], rank: int, **kw):
    """dist.DeviceMesh without making process groups, across torch versions."""
    DeviceMesh = dist.DeviceMesh if hasattr(dist, "DeviceMesh") else None
    if DeviceMesh is None:
        from torch.distributed.device_mesh import DeviceMesh  # type: ignore
    try:
        return DeviceMesh(device_type=device_type, mesh=mesh, mesh_dim_names=tuple(names), _init_backend=False,
                          _rank=rank, **kw)
    except TypeError as e:
        if "_rank" not in str(e):
            raise
        # torch < 2.10: the rank comes from the default group (set first).
        return DeviceMesh(device_type=device_type, mesh=mesh, mesh_dim_names=tuple(names), _init_backend=False, **kw)


def init_device_mesh(mesh_dim_comms: Sequence[Communicator], mesh_dim_names: Sequence[str],
                     _global_comm: Optional[Communicator] = None):
    """A DeviceMesh whose dimension i is mesh_dim_comms[i] (named
    mesh_dim_names[i]); its shape is the comms' sizes, and this rank's
    coordinates their ranks. With several dimensions, _global_comm (the comm
    of every rank of the mesh) becomes the default group; with one, that
    dimension's group does."""
    if not hasattr(dist, "DeviceMesh") and not _has_device_mesh():
        raise RuntimeError("ftcomm.device_mesh: this torch (%s) has no DeviceMesh (torch >= 2.2)" % torch.__version__)
    comms = tuple(mesh_dim_comms)
    names = tuple(mesh_dim_names)
    if len(comms) != len(names) or not comms:
        raise ValueError("ftcomm.device_mesh: %d comms for %d names" % (len(comms), len(names)))
    device_type = _device_type(comms[0])
    shape = tuple(c.get_size() for c in comms)
    world = math.prod(shape)
    mesh = torch.arange(world, dtype=torch.int, device="cpu").view(shape)
    coords = tuple(c.get_rank() for c in comms)
    global_rank = int(mesh[coords].item())
    global_pg = None
    if _global_comm is not None:
        global_pg = _create_torchcomm_process_group(_global_comm, _global_comm.get_name())
    elif len(comms) != 1:
        raise RuntimeError("ftcomm.device_mesh: %d dimensions and no _global_comm (the comm of every rank of the "
                           "mesh): pass one" % len(comms))
    group_names = []
    for i, (comm, name) in enumerate(zip(comms, names)):
        rows = mesh.transpose(i, -1).reshape(-1, mesh.size(i))
        row = rows[int(torch.where(rows == global_rank)[0].item())].tolist()
        pg = _create_torchcomm_process_group(comm, name, global_ranks_mapping={g: j for j, g in enumerate(row)})
        if global_pg is None:
            global_pg = pg
        group_names.append(name)
    dist.distributed_c10d.GroupMember.WORLD = global_pg
    dm = _make_mesh(device_type, mesh, names, global_rank)
    dm._dim_group_names = group_names
    return dm


def _has_device_mesh() -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh  # noqa: F401
        return True
    except ImportError:
        return False


def _flatten_with_comm(mesh, mesh_dim_name: str, comm: Communicator, global_ranks: Sequence[int], layout: Any):
    """Register comm as the flattened dimension mesh_dim_name of mesh (the
    ranks global_ranks, in order; layout: the flattened dimensions' mesh
    layout) and return the flattened mesh (torch >= 2.10's _MeshLayout)."""
    _create_torchcomm_process_group(comm, mesh_dim_name, global_ranks_mapping={g: i for i, g in enumerate(global_ranks)})
    if hasattr(layout, "coalesce"):
        flat_layout = layout.coalesce()
    else:
        from torch.distributed._mesh_layout import _MeshLayout  # type: ignore
        flat_layout = _MeshLayout([layout.collapse()])
    DeviceMesh = dist.DeviceMesh
    device_type = _device_type(comm)
    if hasattr(mesh, "_rank_map"):
        flat = DeviceMesh(device_type=device_type, mesh_dim_names=(mesh_dim_name,), _init_backend=False,
                          _rank=comm.get_rank(), _layout=flat_layout, _rank_map=mesh._rank_map, _root_mesh=mesh)
    else:
        flat = DeviceMesh(device_type=device_type, mesh=torch.tensor(list(global_ranks), device="cpu"),
                          mesh_dim_names=(mesh_dim_name,), _init_backend=False, _rank=comm.get_rank(),
                          _layout=flat_layout)
    flat._dim_group_names = [mesh_dim_name]
    try:
        root = mesh._get_root_mesh()
        flat._root_mesh = root
        root._flatten_mapping[mesh_dim_name] = flat
    except Exception:  # noqa: B902 - older DeviceMesh bookkeeping
        from torch.distributed.device_mesh import _mesh_resources  # type: ignore
        if hasattr(_mesh_resources, "flatten_name_to_root_dims"):
            raise NotImplementedError("ftcomm.device_mesh: flattening needs torch's mesh layouts (torch >= 2.10)")
        root = _mesh_resources.get_root_mesh(mesh)
        _mesh_resources.child_to_root_mapping[flat] = root
        _mesh_resources.root_to_flatten_mapping.setdefault(root, {})[mesh_dim_name] = flat
    return flat
