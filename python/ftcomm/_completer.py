"""Completer: one thread that completes futures in the order their ops were
issued (a comm's ops end in issue order), so that nobody blocks in torch's
C++ on an op that has not ended. The torch.distributed backend has one per
communicator of a group (its Works' get_future); FT-DDP's comm hook one per
hook (its buckets' futures).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Optional

_log = logging.getLogger("ftcomm")


class Completer:
    """Runs the completions added to it, one after the other, in the order
    added, on a thread of its own. The thread starts with the Completer and
    exits at close() (after the completions added before it), or with the
    process (a daemon). A completion waits for its op and sets its future;
    it should not raise: one that does is logged (logger "ftcomm", with
    its traceback), and the next one runs (a raise that ended the thread would
    leave every later future waiting for good)."""

    def __init__(self, name: str):
        self._q: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._t = threading.Thread(target=self._run, name=name, daemon=True)
        self._t.start()

    def add(self, complete: Callable[[], None]) -> None:
        self._q.put(complete)

    def _run(self) -> None:
        while True:
            complete = self._q.get()
            if complete is None:
                return
            try:
                complete()
            except BaseException:  # noqa: B902 - the later completions must still run
                _log.exception("ftcomm: %s: a completion raised; the next ones run", threading.current_thread().name)

    def close(self) -> None:
        """Let the thread exit once what was added before has run; safe twice."""
        self._q.put(None)
