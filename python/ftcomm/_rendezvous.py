"""How a communicator's ranks meet: the store they meet through, the key
prefix each comm of a name gets, and the call that forms one rank's comm
there (with the secret that authenticates its links). new_comm and a
Communicator's reconfigure() use it; nothing here is public.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import threading
from ctypes import byref, c_uint64
from typing import Any, Dict, Optional, Tuple

from . import _lib
from .errors import InvalidTypeError
from .errors import invalid_argument as _inv
from .store import Store, _is_torch_store, from_environment, through_torch_store

# The least time a rendezvous waits for the other ranks (processes start at
# different times), whatever the comm's op timeout.
RENDEZVOUS_FLOOR_S = 60.0


def as_timedelta(t) -> Optional[datetime.timedelta]:
    """A timeout (seconds, a timedelta or None) as a timedelta (or None)."""
    if t is None or isinstance(t, datetime.timedelta):
        return t
    return datetime.timedelta(seconds=float(t))


def seconds(timeout) -> float:
    """How long a rendezvous with this op timeout waits (default 300 s),
    at least RENDEZVOUS_FLOOR_S."""
    return max(as_timedelta(timeout).total_seconds() if timeout is not None else 300.0, RENDEZVOUS_FLOOR_S)


class _Generations:
    """How many comms of each name this process made: the n of each comm's
    key prefix ftcomm/<name>/<n> (ranks make their comms in the same order)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._n: Dict[str, int] = {}

    def next(self, name: str) -> int:
        with self._lock:
            g = self._n.get(name, 0)
            self._n[name] = g + 1
            return g


generations = _Generations()


def open_store(store, rank: int, size: int, prefix: str, timeout,
               enable_reconfigure: bool) -> Tuple[Optional[Store], bool, Optional[Store]]:
    """(the store the comm uses, whether the comm owns it, the bootstrap
    store at MASTER_PORT to release once the comm is formed) for new_comm's
    store argument: None (torchrun's MASTER_ADDR/MASTER_PORT; no store for
    a comm of one rank), an ftcomm.Store, "host:port" of an ftcomm store,
    or a torch.distributed.Store."""
    own = False
    boot = None  # the bootstrap store at MASTER_PORT, released once the comm is formed
    st: Optional[Store]
    if size == 1 and store is None and not enable_reconfigure:
        st = None
    elif isinstance(store, Store):
        st = store
    elif isinstance(store, str):
        st, own = Store.connect(store), True
    elif store is not None and _is_torch_store(store):
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        st, own = through_torch_store(store, prefix + "/store", rank, host, seconds(timeout)), True
    elif store is None:
        st, boot = from_environment(rank, size, prefix + "/store", seconds(timeout))
        if st is None:
            if not enable_reconfigure:
                raise _inv("no store: pass store= or set MASTER_ADDR and MASTER_PORT (torchrun does)")
        else:
            own = True
    else:
        raise InvalidTypeError("ftcomm: store %r: want an ftcomm.Store, 'host:port' or a torch.distributed.Store" % (store,),
                               kinds=("invalid_argument",))
    return st, own, boot


def connect(backend: str, name: str, rank: int, size: int, prefix: str, epoch: int, joining: bool,
            store: Optional[Store], options, device: Optional[int], log_level: Optional[str],
            timeout=None) -> int:
    """Make one rank's comm at prefix (its handle): rank 0 of a new comm
    writes the secret that authenticates its links; the others (and
    joiners) read it. options: the comm's CommOptions."""
    t = seconds(timeout if timeout is not None else options.timeout)
    secret = ""
    if store is not None:
        if rank == 0 and not joining:
            secret = secrets.token_hex(16)
            store.set(prefix + "/secret", secret, timeout=t)
        else:
            secret = store.get(prefix + "/secret", timeout=t).decode()
    settings: Dict[str, Any] = {"rank": rank, "size": size, "name": name, "prefix": prefix, "epoch": int(epoch),
                                "job_id": name, "secret": secret,
                                "timeout_s": options.timeout.total_seconds(), "rendezvous_timeout_s": t,
                                "abort_process_on_error": options.abort_process_on_timeout_or_error}
    if device is not None:
        settings["device"] = device
    if log_level:
        settings["log_level"] = log_level
    for k, v in options.hints.items():
        if k == "listen_addr":
            settings["listen_addr"] = v
        elif k == "shared_memory":
            settings["shared_memory"] = v not in ("0", "false", False, 0)
        elif k in ("revoke", "nccl_lib", "cudart_lib"):
            settings[k] = v
    h = c_uint64()
    _lib.check(_lib.lib().ftcomm_comm_new(backend.encode(), json.dumps(settings).encode(),
                                          store._h if store is not None else 0, byref(h)))
    return h.value
