"""Which device a communicator runs on: device names ("cpu", "cuda:1", a
torch.device, an ordinal) read without importing torch, and the CUDA
device an nccl comm takes under torchrun. Used by new_comm and ft.Comm.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

from .errors import invalid_argument as _inv


def device_index(device) -> Optional[int]:
    """The CUDA ordinal device names, None if it names no index."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        return int(device.split(":", 1)[1]) if ":" in device else None
    return getattr(device, "index", None)


def device_type(device) -> str:
    """"cpu" or "cuda" (an ordinal is a CUDA device)."""
    if isinstance(device, int):
        return "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0]
    t = getattr(device, "type", None)
    return t if t is not None else str(device).split(":", 1)[0]


def env_int(name: str) -> Optional[int]:
    """The environment variable name as an int; None when unset or empty."""
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def choose(backend: str, device: Any, rank: int) -> Tuple[Any, Optional[int]]:
    """(the device of a comm of backend, its CUDA ordinal or None): an nccl
    comm takes a CUDA device, cuda:LOCAL_RANK (else cuda:rank, modulo the
    devices there are) when it names no index, and makes it the current
    device; a gloo comm takes "cpu"."""
    if backend == "nccl":
        if device_type(device) != "cuda":
            raise _inv("backend nccl takes a CUDA device, got %r" % (device,))
        idx = device_index(device)
        import torch
        if idx is None:
            local = env_int("LOCAL_RANK")
            idx = local if local is not None else rank
            if torch.cuda.device_count() > 0:
                idx %= torch.cuda.device_count()
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx), idx
    if device_type(device) != "cpu":
        raise _inv("backend gloo takes device 'cpu', got %r" % (device,))
    return device, None
