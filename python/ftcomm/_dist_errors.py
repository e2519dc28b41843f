"""The errors of the torch.distributed backend: every ftcomm error leaves a
ProcessGroupFtcomm as an instance of torch.distributed.DistBackendError (of
DistBackendError here on a torch without one) that is also the ftcomm error
it came from, naming the failed peers by global rank. The combined classes
are made at import and kept in this module (as Dist<name>), where pickle
finds them. DistBackendError is public as ftcomm.distributed.DistBackendError.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch.distributed as dist

from . import errors
from .errors import FtcommError, InvalidArgumentError

if hasattr(dist, "DistBackendError"):
    DistBackendError = dist.DistBackendError
else:  # torch < 2.1: torch's own backends raise RuntimeError

    class DistBackendError(RuntimeError):
        """A failure of a collective (torch.distributed.DistBackendError on
        torch versions that have it)."""

        __module__ = "ftcomm.distributed"  # where users name it


_combined: Dict[type, Optional[type]] = {}


def _combined_class(cls: type) -> Optional[type]:
    """The class that is both cls (an FtcommError) and DistBackendError,
    made once and kept in this module as Dist<name>: pickle finds it there
    (a CUDA Future pickles an exception set on it to look for tensors)."""
    comb = _combined.get(cls, False)
    if comb is False:
        qual = "Dist" + cls.__name__
        try:
            comb = type(cls.__name__, (cls, DistBackendError), {"__module__": __name__, "__qualname__": qual})
        except TypeError:
            comb = None
        else:
            globals()[qual] = comb
        _combined[cls] = comb
    return comb


def _combine_all() -> None:
    """Every error class of ftcomm.errors combined at import, so that a
    process that unpickles one finds its class."""
    for v in list(vars(errors).values()):
        if isinstance(v, type) and issubclass(v, FtcommError):
            _combined_class(v)


_combine_all()


def global_ranks(pg) -> Optional[Dict[int, int]]:
    """group rank -> global rank of pg, when torch knows the group."""
    try:
        c10d = dist.distributed_c10d
        m = getattr(c10d, "_world", None)
        table = m.pg_group_ranks if m is not None else getattr(c10d, "_pg_group_ranks")
        g = table.get(pg)
        if g:
            return {v: k for k, v in g.items()}
    except Exception:
        pass
    return None


def dist_error(e: BaseException, pg=None) -> BaseException:
    """e as torch.distributed's error: an instance of DistBackendError and of
    e's own ftcomm class, naming the failed ranks by their global rank
    (those of pg, a ProcessGroupFtcomm, when given)."""
    if not isinstance(e, FtcommError) or isinstance(e, DistBackendError):
        return e
    comb = _combined_class(type(e))
    if comb is None:
        return e
    granks = list(e.ranks)
    where = ""
    if pg is not None:
        m = global_ranks(pg)
        if m:
            granks = [m.get(r, r) for r in e.ranks]
        where = "ftcomm process group %s (rank %d of %d): " % (pg._describe(), pg.rank(), pg.size())
    msg = where + e.message
    if granks:
        msg += " [failed: rank%s %s]" % ("s" if len(granks) > 1 else "", ", ".join(str(r) for r in granks))
    extra = {k: v for k, v in vars(e).items() if k not in ("message", "kinds", "ranks", "status")}
    out = comb(msg, kinds=e.kinds, ranks=granks, status=e.status, **extra)
    out.group_ranks = tuple(e.ranks)
    out.__cause__ = e
    return out


def unsupported(what: str) -> BaseException:
    """The error of a call the process group refuses (InvalidArgumentError)."""
    return InvalidArgumentError("ftcomm process group: %s" % what, kinds=("invalid_argument",))
