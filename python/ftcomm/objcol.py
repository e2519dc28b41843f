"""Collectives of picklable Python objects over a communicator, with
torchcomms' names (``torchcomms.objcol``): all_gather_object,
gather_object, broadcast_object_list, scatter_object_list,
send_object_list and recv_object_list.

Objects travel as bytes in uint8 tensors on the comm's device (CUDA for
nccl, CPU for gloo), their sizes first. They are written with torch.save
and read with ``torch.load(weights_only=weights_only)``: with
weights_only=True (the default) only tensors and plain containers and
scalars load, so a peer cannot make this rank run code. With
TORCHCOMMS_SERIALIZATION=pickle (torchcomms' switch) they are pickled; a
weights_only load then accepts only builtin scalars and containers. Without
torch (a numpy-only program), pickle.

Every call is a collective (or a matched send/recv) on the comm, in issue
order with its other ops, and blocks until it is done.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from typing import Any, List, Optional

from .errors import InvalidArgumentError

__all__ = ["all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "send_object_list",
           "recv_object_list"]

_SAFE_BUILTINS = {"set", "frozenset", "complex", "bytearray", "slice", "range"}


class _BuiltinsOnly(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError("ftcomm.objcol: %s.%s is not allowed with weights_only=True" % (module, name))


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def _pickled() -> bool:
    return os.environ.get("TORCHCOMMS_SERIALIZATION") == "pickle" or _torch() is None


def _dumps(obj: Any) -> bytes:
    if _pickled():
        return pickle.dumps(obj)
    f = io.BytesIO()
    _torch().save(obj, f)
    return f.getvalue()


def _loads(b: bytes, weights_only: bool) -> Any:
    if _pickled():
        if weights_only:
            return _BuiltinsOnly(io.BytesIO(b)).load()
        return pickle.loads(b)
    return _torch().load(io.BytesIO(b), weights_only=weights_only, map_location="cpu")


class _Bufs:
    """uint8 and int64 buffers on the comm's device, read back as bytes and ints."""

    def __init__(self, comm):
        self.torch = _torch()
        self.device = comm.get_device() if comm.get_backend() == "nccl" else "cpu"

    def u8(self, data: bytes, n: Optional[int] = None):
        n = len(data) if n is None else n
        if self.torch is not None:
            t = self.torch.zeros(n, dtype=self.torch.uint8)
            if data:
                t[:len(data)] = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8)
            return t.to(self.device)
        import numpy as np
        a = np.zeros(n, dtype=np.uint8)
        a[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        return a

    def i64(self, vals: List[int]):
        if self.torch is not None:
            return self.torch.tensor(vals, dtype=self.torch.int64).to(self.device)
        import numpy as np
        return np.asarray(vals, dtype=np.int64)

    @staticmethod
    def host(t):
        return t.cpu().numpy() if hasattr(t, "cpu") else t


def _sizes_everywhere(comm, n: int, timeout) -> List[int]:
    b = _Bufs(comm)
    out = b.i64([0] * comm.get_size())
    comm.all_gather_single(out, b.i64([n]), timeout=timeout)
    return [int(x) for x in b.host(out)]


def all_gather_object(comm, object_list: List[Any], obj: Any, timeout=None, weights_only: bool = True) -> None:
    """object_list[r] = rank r's obj, on every rank (object_list has one
    entry per rank)."""
    size = comm.get_size()
    if len(object_list) != size:
        raise InvalidArgumentError("ftcomm: all_gather_object: object_list has %d entries for %d ranks" % (
            len(object_list), size), kinds=("invalid_argument",))
    data = _dumps(obj)
    sizes = _sizes_everywhere(comm, len(data), timeout)
    b, m = _Bufs(comm), max(sizes)
    out = b.u8(b"", m * size)
    comm.all_gather_single(out, b.u8(data, m), timeout=timeout)
    raw = b.host(out).tobytes()
    for r in range(size):
        object_list[r] = _loads(raw[r * m:r * m + sizes[r]], weights_only)


def gather_object(comm, obj: Any, root: int, object_gather_list: Optional[List[Any]] = None, timeout=None,
                  weights_only: bool = True) -> None:
    """object_gather_list[r] = rank r's obj, at root (which passes a list
    with one entry per rank; the others may pass None)."""
    size = comm.get_size()
    if comm.get_rank() == root and (object_gather_list is None or len(object_gather_list) != size):
        raise InvalidArgumentError("ftcomm: gather_object: root needs object_gather_list of %d entries" % size,
                                   kinds=("invalid_argument",))
    data = _dumps(obj)
    sizes = _sizes_everywhere(comm, len(data), timeout)
    b, m = _Bufs(comm), max(sizes)
    out = b.u8(b"", m * size) if comm.get_rank() == root else None
    comm.gather_single(out, b.u8(data, m), root, timeout=timeout)
    if comm.get_rank() == root:
        raw = b.host(out).tobytes()
        for r in range(size):
            object_gather_list[r] = _loads(raw[r * m:r * m + sizes[r]], weights_only)


def _frame(objs: List[Any]):
    blobs = [_dumps(o) for o in objs]
    return [len(x) for x in blobs], b"".join(blobs)


def _unframe(object_list: List[Any], sizes: List[int], raw: bytes, weights_only: bool) -> None:
    off = 0
    for i, n in enumerate(sizes):
        object_list[i] = _loads(raw[off:off + n], weights_only)
        off += n


def broadcast_object_list(comm, object_list: List[Any], root: int = 0, timeout=None, weights_only: bool = True) -> None:
    """Root's objects into every rank's object_list (the same length on
    every rank)."""
    b = _Bufs(comm)
    if comm.get_rank() == root:
        sizes, data = _frame(object_list)
    else:
        sizes, data = [0] * len(object_list), b""
    st = b.i64(sizes)
    comm.broadcast(st, root, timeout=timeout)
    sizes = [int(x) for x in b.host(st)]
    buf = b.u8(data, sum(sizes))
    comm.broadcast(buf, root, timeout=timeout)
    if comm.get_rank() != root:
        _unframe(object_list, sizes, b.host(buf).tobytes(), weights_only)


def scatter_object_list(comm, scatter_object_output_list: List[Any], scatter_object_input_list: Optional[List[Any]],
                        root: int = 0, timeout=None, weights_only: bool = True) -> None:
    """scatter_object_output_list[0] = root's scatter_object_input_list[r],
    at each rank r."""
    size, b = comm.get_size(), _Bufs(comm)
    if not scatter_object_output_list:
        raise InvalidArgumentError("ftcomm: scatter_object_list: the output list needs one entry",
                                   kinds=("invalid_argument",))
    if comm.get_rank() == root:
        if scatter_object_input_list is None or len(scatter_object_input_list) != size:
            raise InvalidArgumentError("ftcomm: scatter_object_list: root needs %d input objects" % size,
                                       kinds=("invalid_argument",))
        blobs = [_dumps(o) for o in scatter_object_input_list]
        m = max(len(x) for x in blobs) + 8
    else:
        blobs, m = [], 0
    mt = b.i64([m])
    comm.broadcast(mt, root, timeout=timeout)
    m = int(b.host(mt)[0])
    out = b.u8(b"", m)
    src = b.u8(b"".join(struct.pack("<q", len(x)) + x.ljust(m - 8, b"\0") for x in blobs)) if blobs else None
    comm.scatter(out, None if src is None else [src[r * m:(r + 1) * m] for r in range(size)], root, timeout=timeout)
    raw = b.host(out).tobytes()
    n = struct.unpack("<q", raw[:8])[0]
    scatter_object_output_list[0] = _loads(raw[8:8 + n], weights_only)


def send_object_list(comm, object_list: List[Any], dst: int, timeout=None) -> None:
    """Send object_list to rank dst, which calls recv_object_list with a
    list of the same length."""
    b = _Bufs(comm)
    sizes, data = _frame(object_list)
    comm.send(b.i64(sizes), dst, timeout=timeout)
    if data:
        comm.send(b.u8(data), dst, timeout=timeout)


def recv_object_list(comm, object_list: List[Any], src: int, timeout=None, weights_only: bool = True) -> None:
    """Fill object_list (its length: how many objects src sends) from rank src."""
    b = _Bufs(comm)
    st = b.i64([0] * len(object_list))
    comm.recv(st, src, timeout=timeout)
    sizes = [int(x) for x in b.host(st)]
    buf = b.u8(b"", sum(sizes))
    if sum(sizes):
        comm.recv(buf, src, timeout=timeout)
    _unframe(object_list, sizes, b.host(buf).tobytes(), weights_only)
