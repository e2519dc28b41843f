"""Rank processes for the tests: long-lived workers (spawned once per test
module) that run functions of workers.py on request, so each test pays for
no interpreter start or import; a test that kills one restarts it."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import sys
import traceback
from typing import Any, Callable, List, Optional

_CTX = mp.get_context("spawn")
_HERE = os.path.dirname(os.path.abspath(__file__))


class RemoteError(Exception):
    """A function raised in a rank process; the message holds its traceback."""

    def __init__(self, rank: int, kind: str, tb: str):
        super().__init__("rank %d raised %s:\n%s" % (rank, kind, tb))
        self.rank, self.kind, self.tb = rank, kind, tb


def _serve(conn, rank: int) -> None:
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        mod, fn, args, kwargs = msg
        try:
            res = getattr(importlib.import_module(mod), fn)(*args, **kwargs)
            conn.send(("ok", res, None))
        except BaseException as e:  # noqa: B902 - report everything, KeyboardInterrupt too
            conn.send(("err", "".join(traceback.format_exception(type(e), e, e.__traceback__)), type(e).__name__))


class Pending:
    def __init__(self, cluster: "Cluster", rank: int):
        self.cluster, self.rank = cluster, rank

    def result(self, timeout: float = 120) -> Any:
        conn = self.cluster.conns[self.rank]
        if not conn.poll(timeout):
            raise TimeoutError("rank %d: no answer within %ss" % (self.rank, timeout))
        status, val, kind = conn.recv()
        if status == "err":
            raise RemoteError(self.rank, kind, val)
        return val


class Cluster:
    """n rank processes; run(fn, ...) calls fn in each and returns the results."""

    def __init__(self, n: int):
        self.n = n
        self.procs: List[Optional[mp.Process]] = [None] * n
        self.conns: List[Any] = [None] * n
        for r in range(n):
            self.start(r)

    def start(self, rank: int) -> None:
        parent, child = _CTX.Pipe()
        # Not a daemon: a rank may start processes of its own (DataLoader workers).
        p = _CTX.Process(target=_serve, args=(child, rank), daemon=False)
        p.start()
        child.close()
        self.procs[rank], self.conns[rank] = p, parent

    def submit(self, rank: int, fn: Callable, *args, **kwargs) -> Pending:
        self.conns[rank].send((fn.__module__, fn.__name__, args, kwargs))
        return Pending(self, rank)

    def run(self, fn: Callable, *args, ranks=None, timeout: float = 120, **kwargs) -> List[Any]:
        """fn(rank, *args, **kwargs) on every rank (or those listed), at once."""
        ranks = list(range(self.n)) if ranks is None else ranks
        pend = [self.submit(r, fn, r, *args, **kwargs) for r in ranks]
        out, errs = [], []
        for p in pend:
            try:
                out.append(p.result(timeout))
            except (RemoteError, TimeoutError) as e:
                errs.append(e)
                out.append(None)
        if errs:
            raise errs[0]
        return out

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def kill(self, rank: int, sig=signal.SIGKILL) -> None:
        p = self.procs[rank]
        os.kill(p.pid, sig)
        p.join(30)
        self.conns[rank].close()

    def restart(self, rank: int) -> None:
        p = self.procs[rank]
        if p is not None and p.is_alive():
            self.kill(rank)
        self.start(rank)

    def close(self) -> None:
        for r, p in enumerate(self.procs):
            if p is None:
                continue
            try:
                self.conns[r].send(None)
            except (OSError, BrokenPipeError):
                pass
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
