"""An ftcoord coordinator (embedded etcd, quorums, API and dashboard) run in
this process through libftcomm: for examples, tests and single-host jobs.
Production jobs run ``ftcoord serve`` as a service."""

from __future__ import annotations

import json
from ctypes import byref, c_uint64
from typing import List, Optional

from . import _lib

__all__ = ["Coordinator", "serve"]


class Coordinator:
    """A running coordinator. ``endpoints`` are its etcd endpoints;
    ``credentials`` the trainer credentials file to pass to ft.Comm (or
    export as FTCOMM_CREDENTIALS); ``dashboard`` its web page. Stop it with
    close() (or a with block)."""

    def __init__(self, handle: int):
        self._h: Optional[int] = handle
        info = json.loads(_lib.get_bytes(_lib.lib().ftcomm_coordinator_info, handle))
        self.endpoints: List[str] = info["endpoints"]
        self.credentials: str = info.get("credentials", "")
        self.url: str = info["url"]
        self.dashboard: str = info["dashboard"]
        self.data_dir: str = info["data_dir"]

    def close(self) -> None:
        """Stop the coordinator (and remove its data folder if serve made it)."""
        h, self._h = self._h, None
        if h is not None and not _lib.forked:
            _lib.check(_lib.lib().ftcomm_coordinator_free(h))

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return "Coordinator(%s%s)" % (self.url, "" if self._h else ", closed")


def serve(data_dir: Optional[str] = None, *, listen: str = "127.0.0.1:0", insecure: bool = False,
          join_timeout: float = 0.5, session_ttl: float = 2.0, min_replicas: Optional[int] = None,
          gossip: bool = False, fsync: bool = False, log_level: Optional[str] = None) -> Coordinator:
    """Start a coordinator in this process and return once it serves.

    data_dir: etcd's data, certificates and credentials (default: a
    temporary folder removed at close). Secure by default, as `ftcoord
    serve` (TLS, etcd roles, signed quorums); insecure=True turns it off.
    join_timeout: how long a new quorum waits for stragglers (s);
    session_ttl: the coordinator's etcd session; gossip: failure detection
    by gossip (off: TCP errors, blame checks and lease expiry).
    """
    settings = {"listen": listen, "insecure": insecure, "join_timeout_s": join_timeout,
                "session_ttl_s": session_ttl, "gossip": gossip, "fsync": fsync}
    if data_dir:
        settings["data_dir"] = data_dir
    if min_replicas:
        settings["min_replicas"] = min_replicas
    if log_level:
        settings["log_level"] = log_level
    _lib.ensure_interrupt_chain()
    h = c_uint64()
    _lib.check(_lib.lib().ftcomm_coordinator_start(json.dumps(settings).encode(), byref(h)))
    return Coordinator(h.value)
