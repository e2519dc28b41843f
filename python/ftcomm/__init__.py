"""ftcomm: fault-tolerant collective communication for PyTorch, over ftcomm's
Go core (libftcomm.so, through ctypes).

Two APIs:

- the communicator, with torchcomms' names (torchcomms' own integration
  tests run against it: python/conformance)::

      from ftcomm import new_comm, ReduceOp
      comm = new_comm("nccl", torch.device("cuda"), name="main")   # under torchrun
      comm.all_reduce(t, ReduceOp.SUM)
      comm.finalize()

- ``ftcomm.ft.Comm``, the fault-tolerant training loop: per-step quorum,
  shrink and grow around failed replicas, live healing, commit (and
  ``ftcomm.ft_torch``: its state registration, optimizer wrapper, FT-DDP
  and FT-HSDP for torch modules).

torch.distributed code has its own entry: ``import ftcomm.distributed``
registers the backend ``"ftcomm"`` (``dist.init_process_group("ftcomm")``),
whose groups run their ops on these communicators. Modules whose names
start with an underscore are private.

See docs/python.md in the repository.
"""

from . import _lib, errors
from ._lib import interrupt, library_path, live_handles
from .comm import (
    BatchP2POptions,
    BatchSendRecv,
    CommOptions,
    Communicator,
    P2POp,
    P2POpType,
    TorchComm,
    new_comm,
)
from .reduce_op import RedOpType, ReduceOp
from .work import Work, WorkStatus
from .errors import (
    AbortedError,
    BackendUnavailableError,
    BadHandleError,
    ClosedError,
    CommTimeoutError,
    ForkError,
    FtcommError,
    GroupDivergedError,
    InternalError,
    InterruptedOpError,
    InvalidArgumentError,
    InvalidTypeError,
    MembershipLostError,
    MismatchError,
    NoStepError,
    NotParticipatingError,
    PeerFailedError,
    PeerRefusedError,
    RevokedError,
    RolledBackError,
    FinishedError,
    SamplerMismatchError,
    SnapshotLostError,
    TooManyCommitFailuresError,
)
from .store import Store
from . import coordinator, ft, objcol

TorchWork = Work

__version__ = "0.1.0"


def nccl_info() -> dict:
    """Which NCCL and CUDA runtime ftcomm's nccl comms use (chosen at the
    first nccl comm: the newest NCCL on the machine — the system's, the
    process's, a Python environment's nvidia-nccl wheel — unless one is
    named; "nccl_source", "candidates" and "recovery" say which and why),
    and the libraries mapped into this process."""
    import json
    info = json.loads(_lib.get_bytes(_lib.lib().ftcomm_nccl_info))
    maps = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if "libnccl" in p or "libcudart" in p:
                    maps.add(p)
    except OSError:
        pass
    info["mapped"] = sorted(maps)
    return info

def is_backend_built(backend: str) -> bool:
    """Whether new_comm takes this backend name (torchcomms' check)."""
    return backend in ("gloo", "nccl", "ncclx", "cuda")


def built_backends() -> list:
    return ["gloo", "nccl"]


__all__ = [
    "new_comm", "nccl_info", "Communicator", "TorchComm", "ReduceOp", "RedOpType", "Work", "TorchWork", "WorkStatus",
    "CommOptions", "BatchSendRecv", "BatchP2POptions", "P2POp", "P2POpType", "objcol", "is_backend_built",
    "built_backends", "Store", "interrupt", "live_handles", "library_path",
    "errors", "FtcommError", "InvalidArgumentError", "InvalidTypeError", "CommTimeoutError", "RevokedError",
    "PeerFailedError", "PeerRefusedError", "MismatchError", "AbortedError", "ClosedError", "BackendUnavailableError",
    "RolledBackError", "FinishedError", "GroupDivergedError", "NotParticipatingError", "TooManyCommitFailuresError",
    "NoStepError", "SamplerMismatchError", "SnapshotLostError", "MembershipLostError", "BadHandleError", "InternalError",
    "InterruptedOpError", "ForkError",
]
