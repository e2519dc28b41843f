"""Stores ranks rendezvous through: ftcomm's own (comm/httpstore: one process
hosts it, the others connect), reached directly or bootstrapped through a
torch.distributed store (torchrun's)."""

from __future__ import annotations

import ctypes
import os
import socket
import time
from ctypes import byref, c_int64, c_uint64

from . import _lib, errors
from .errors import InvalidArgumentError


class Store:
    """A key-value store for rendezvous. ``Store.listen(addr)`` hosts one
    (rank 0, say); ``Store.connect(addr)`` reaches it. Keys are strings,
    values bytes; ``get`` waits until the key exists."""

    def __init__(self, handle: int, hosted: bool):
        self._h = handle
        self.hosted = hosted
        self.address = _lib.get_bytes(_lib.lib().ftcomm_store_addr, handle).decode()

    @classmethod
    def listen(cls, addr: str = "127.0.0.1:0", token: str = "") -> "Store":
        """Host a store on addr ("host:port"; port 0 picks a free one, see
        ``.address``)."""
        h = c_uint64()
        _lib.check(_lib.lib().ftcomm_store_listen(addr.encode(), token.encode(), byref(h)))
        return cls(h.value, True)

    @classmethod
    def connect(cls, addr: str, token: str = "") -> "Store":
        """Reach the store hosted at addr; requests retry until it is up."""
        h = c_uint64()
        _lib.check(_lib.lib().ftcomm_store_connect(addr.encode(), token.encode(), byref(h)))
        return cls(h.value, False)

    def _handle(self) -> int:
        if self._h is None:
            raise InvalidArgumentError("ftcomm: store is closed", kinds=("invalid_argument",))
        return self._h

    def set(self, key: str, value, timeout=None) -> None:
        if isinstance(value, str):
            value = value.encode()
        v = bytes(value)
        _lib.check(_lib.lib().ftcomm_store_set(self._handle(), key.encode(), v, len(v), _lib.timeout_ns(timeout)))

    def get(self, key: str, timeout=None) -> bytes:
        """The value of key, waiting for it (up to timeout; interruptible)."""
        L = _lib.lib()
        size, n = 256, c_int64()
        t = _lib.timeout_ns(timeout)
        while True:
            buf = ctypes.create_string_buffer(size)
            st = L.ftcomm_store_get(self._handle(), key.encode(), buf, size, byref(n), t)
            if st == _lib.ERR_SHORT_BUFFER:
                _lib.last_error(st)
                size = n.value + 1
                continue
            _lib.check(st)
            return buf.raw[: n.value]

    def add(self, key: str, delta: int = 1, timeout=None) -> int:
        out = c_int64()
        _lib.check(_lib.lib().ftcomm_store_add(self._handle(), key.encode(), int(delta), byref(out), _lib.timeout_ns(timeout)))
        return out.value

    def close(self) -> None:
        """Close the store (a hosted one stops serving). Safe to call twice."""
        h, self._h = self._h, None
        if h is not None and not _lib.forked:
            _lib.check(_lib.lib().ftcomm_store_free(h))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return "Store(%s%s)" % (self.address, ", hosted" if self.hosted else "")


def _is_torch_store(s) -> bool:
    import sys
    dist = sys.modules.get("torch.distributed")
    return dist is not None and hasattr(dist, "Store") and isinstance(s, dist.Store)


def _bind_host(master_addr: str) -> str:
    """Where rank 0 binds its store: MASTER_ADDR when it is an address of
    this host (it is, on the node that runs rank 0), else all interfaces."""
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((master_addr, 0))
            return master_addr
        finally:
            s.close()
    except OSError:
        return "0.0.0.0"


def through_torch_store(tstore, key: str, rank: int, advertise: str, timeout) -> Store:
    """Rank 0 hosts an ftcomm store and publishes its address under key in
    the torch.distributed store tstore; the other ranks read it there."""
    if rank == 0:
        s = Store.listen("%s:0" % _bind_host(advertise))
        port = s.address.rsplit(":", 1)[1]
        try:
            tstore.set(key, "%s:%s" % (advertise, port))
        except BaseException:
            s.close()
            raise
        return s
    if timeout is not None:
        import datetime
        tstore.set_timeout(datetime.timedelta(seconds=_lib.timeout_ns(timeout) / 1e9))
    addr = tstore.get(key).decode()
    return Store.connect(addr)


def from_environment(rank: int, size: int, key: str, timeout):
    """The store named by torchrun's environment (MASTER_ADDR, MASTER_PORT),
    as (store, bootstrap): rank 0 hosts an ftcomm store on a free port and
    publishes its address under key in a bootstrap store at MASTER_PORT,
    where the other ranks read it:

    - under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the bootstrap is
      the agent's TCPStore;
    - otherwise rank 0 hosts an ftcomm store there, for this comm's
      rendezvous only.

    The caller closes the bootstrap once its comm is formed and then runs a
    barrier on the comm (torchcomms does the same), so MASTER_PORT is free
    again for the next comm made this way before any rank makes it.
    (None, None) when MASTER_ADDR or MASTER_PORT is unset.
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None, None
    secs = (_lib.timeout_ns(timeout) / 1e9) if timeout is not None else 300
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        import datetime
        import torch.distributed as dist
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        t = datetime.timedelta(seconds=secs)
        tstore = dist.PrefixStore("/worker/attempt_%s" % attempt, dist.TCPStore(addr, int(port), size, False, t))
        return through_torch_store(tstore, key, rank, addr, None), _Dropped(tstore)
    # MASTER_PORT may still be held for a moment by a server of a store made
    # just before (the caller's own TCPStore, or the bootstrap of a comm
    # made just before: a rank lets go of it only after its comm formed),
    # and a rank can reach that server instead of rank 0's new one. So rank
    # 0 retries its bind, and the others look for the key with short waits,
    # each on a new connection, with a backoff, until the timeout.
    deadline = time.monotonic() + secs
    pause = 0.01
    while True:
        boot = None
        try:
            if rank == 0:
                boot = Store.listen("%s:%s" % (_bind_host(addr), port))
                s = Store.listen("%s:0" % _bind_host(addr))
                try:
                    boot.set(key, "%s:%s" % (addr, s.address.rsplit(":", 1)[1]))
                except BaseException:
                    s.close()
                    raise
                return s, boot
            boot = Store.connect("%s:%s" % (addr, port))
            left = deadline - time.monotonic()
            return Store.connect(boot.get(key, timeout=max(min(left, 2.0), 0.1)).decode()), boot
        except errors.FtcommError as e:
            if boot is not None:
                boot.close()
            if time.monotonic() + pause >= deadline or isinstance(e, errors.InvalidArgumentError):
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


class _Dropped:
    """A torch store to let go of: its server (rank 0's) stops when the
    last reference does."""

    def __init__(self, tstore):
        self.tstore = tstore

    def close(self) -> None:
        self.tstore = None
