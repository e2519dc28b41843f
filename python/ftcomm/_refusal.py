"""Refusing an op that fails before it reaches the library: one mechanism for
the Communicator's ops, its batches and the torch.distributed backend's.

An op that one rank stops (its own checks raise InvalidArgumentError, or
anything else goes wrong first) is refused on its comm in its place in the
order (ftcomm_comm_refuse), so that the peers' matching op fails at once
with PeerRefusedError instead of waiting for its deadline; then the error
is raised as it was. ``issuing.done`` (per thread) says whether the op the
thread is in has reached the library, or been refused there: the code that
hands an op to the library sets it, and only a failure before that is
refused.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

# Whether the op the calling thread is in has reached the library (or has
# been refused there): a failure before that is refused on the comm.
issuing = threading.local()


def c_rank(x) -> int:
    """x as a C int32 if it is an int in range, else -1 (a rank no comm has)."""
    if isinstance(x, int) and not isinstance(x, bool) and -(1 << 31) <= x < (1 << 31):
        return x
    return -1


def refusing(kind: int, refuse: Callable[[Any, int, BaseException, tuple, dict], None]):
    """Decorator of an op (a method): if it fails before it reaches the
    library, refuse(self, kind, exc, args, kwargs) refuses it on the comm
    it concerns (it never raises), then the error is raised as it was."""

    def deco(f):
        @functools.wraps(f)
        def op(self, *args, **kwargs):
            issuing.done = False
            try:
                return f(self, *args, **kwargs)
            except Exception as e:
                if not getattr(issuing, "done", True):
                    refuse(self, kind, e, args, kwargs)
                raise

        return op

    return deco
