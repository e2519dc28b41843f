"""The Works of the torch.distributed backend's ops (torch.distributed.Work
written in Python): an op on CPU tensors is ftcomm Works of its comm
(_HostWork; its future is completed in issue order by the group's
Completer of that comm); an op on CUDA tensors is an event on the group's
stream (_CudaWork); coalesced ops are one _Group. SoloProcessGroup
(ftcomm.ft_torch) uses _DoneWork and hold_work too.
"""

from __future__ import annotations

import collections
import datetime
import threading
from typing import List, Optional

import torch
import torch.distributed as dist

from ._dist_errors import dist_error, unsupported
from .comm import Communicator
from .errors import FtcommError

_WorkBase = getattr(dist, "Work", None) or getattr(dist, "_Work")

# Torch's C++ calls a Python Work's wait()/get_future() through the Python
# object; torch versions without PyWorkHolder (1.13) keep only the C++ half
# of a Work returned to C++, so a group holds each of its Works until it has
# been waited for or its future has completed (at most HOLD of them: a Work
# nobody waits for goes after HOLD younger ones).
HOLD = 4096


def hold_work(held: "collections.OrderedDict", w) -> None:
    held[id(w)] = w
    while len(held) > HOLD:
        held.popitem(last=False)


class _Work(_WorkBase):
    """The Work of an op of a ProcessGroupFtcomm (torch.distributed.Work).
    pg, the group that made it (a SoloProcessGroup's too), holds it (pg._hold,
    pg._held) until torch's C++ no longer needs it."""

    def __init__(self, pg, result: List[torch.Tensor]):
        super().__init__()
        self._pg = pg
        self._result = result
        self._fut: Optional[torch.futures.Future] = None
        pg._hold(self)

    def _release(self) -> None:
        """Torch's C++ no longer needs this Python object (see _hold)."""
        self._pg._held.pop(id(self), None)

    def result(self) -> List[torch.Tensor]:
        return self._result

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def source_rank(self) -> int:
        raise unsupported("source_rank: receiving from any source is not supported")

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, "done" if self.is_completed() else "pending")


class _HostWork(_Work):
    """An op on CPU tensors: ftcomm Works (async ops of one comm), and what
    runs after them (copies back into non-contiguous outputs)."""

    def __init__(self, pg, comm: Optional[Communicator], works: list, result, posts=(), p2p=None):
        super().__init__(pg, result)
        self._comm = comm
        self._works = works
        self._posts = [p for p in posts if p is not None]
        self._p2p = p2p  # the pending batch this Work waits for (isend/irecv)
        self._lock = threading.Lock()
        self._done = False
        self._err: Optional[BaseException] = None

    def _issue(self) -> None:
        if self._p2p is not None:
            self._pg._flush_p2p()

    def _finish(self, timeout) -> bool:
        """Wait for the op (at most timeout seconds; None: its deadline);
        False if it is still running then."""
        self._issue()
        with self._lock:
            if self._done:
                return True
            err = None
            try:
                for w in self._works:
                    w.wait(timeout)
                for p in self._posts:
                    p()
            except FtcommError as e:
                if timeout is not None and str(e).endswith("still running"):
                    return False  # Work.wait's own bound, not the op's deadline
                err = dist_error(e, self._pg)
            except BaseException as e:  # noqa: B902 - a KeyboardInterrupt ends the op too
                err = e
            if isinstance(err, FtcommError):
                err = self._pg._op_failed(err)
            self._done, self._err = True, err
            self._works = []
            self._posts = []
        fut = self._fut
        if fut is not None:
            self._release()
            if err is None:
                fut.set_result(self._result)
            else:
                fut.set_exception(err)
        return True

    def wait(self, timeout=None) -> bool:
        t = None
        if isinstance(timeout, datetime.timedelta):
            t = timeout.total_seconds() or None
        elif timeout:
            t = float(timeout)
        if not self._finish(t):
            raise dist_error(FtcommError("ftcomm: wait timed out after %ss; the op is still running" % t,
                                         kinds=("timeout",)), self._pg)
        self._release()
        if self._err is not None:
            raise self._err
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        self._issue()
        if all(w.is_completed() for w in self._works):
            self._finish(None)
        return self._done

    def exception(self) -> Optional[BaseException]:
        return self._err if self.is_completed() else None

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._fut is None:
                self._fut = torch.futures.Future()
                if self._done:
                    self._release()
                    if self._err is None:
                        self._fut.set_result(self._result)
                    else:
                        self._fut.set_exception(self._err)
                    return self._fut
            else:
                return self._fut
        self._issue()
        self._pg._completer(self._comm).add(lambda: self._finish(None))
        return self._fut


class _CudaWork(_Work):
    """An op on CUDA tensors, enqueued on the group's stream for the device;
    done when the event recorded after it is."""

    def __init__(self, pg, comm: Optional[Communicator], device: torch.device, result, event=None, p2p=None):
        super().__init__(pg, result)
        self._comm = comm
        self._device = device
        self._event = event
        self._p2p = p2p

    def _issue(self) -> None:
        if self._p2p is not None and self._event is None:
            self._pg._flush_p2p()

    def _failure(self) -> Optional[BaseException]:
        c = self._comm
        if c is None:
            return None
        try:
            why = c.error()
        except FtcommError as e:
            return self._pg._op_failed(dist_error(e, self._pg))
        if why:
            return self._pg._op_failed(dist_error(FtcommError("ftcomm: " + why, kinds=("other",)), self._pg))
        return None

    def wait(self, timeout=None) -> bool:
        """Make the current stream wait for the op (the host does not)."""
        self._issue()
        err = self._failure()
        if err is not None:
            raise err
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        self._release()
        return True

    def is_completed(self) -> bool:
        self._issue()
        return self._event is None or self._event.query() or self._failure() is not None

    def exception(self) -> Optional[BaseException]:
        return self._failure()

    def get_future(self) -> torch.futures.Future:
        self._issue()
        if self._fut is None:
            fut = torch.futures.Future(devices=[self._device])
            s = self._pg._stream(self._device)
            with torch.cuda.stream(s):
                fut.set_result(self._result)
            self._fut = fut
            self._release()
        return self._fut


class _Group(_Work):
    """Several Works as one (coalesced ops)."""

    def __init__(self, pg, works: List[_Work], result):
        super().__init__(pg, result)
        self._works = works

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait(timeout)
        self._release()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def exception(self) -> Optional[BaseException]:
        for w in self._works:
            e = w.exception()
            if e is not None:
                return e
        return None

    def get_future(self) -> torch.futures.Future:
        self._release()
        futs = [w.get_future() for w in self._works]
        if len(futs) == 1:
            return futs[0].then(lambda f: self._result)
        return torch.futures.collect_all(futs).then(lambda f: [x.wait() for x in f.wait()] and self._result)


class _DoneWork(_Work):
    def wait(self, timeout=None) -> bool:
        self._release()
        return True

    def is_completed(self) -> bool:
        return True

    def exception(self):
        return None

    def get_future(self):
        self._release()
        f = torch.futures.Future()
        f.set_result(self._result)
        return f


class _SyncedCudaWork(_CudaWork):
    """A barrier on a CUDA comm: wait() waits for the device too."""

    def wait(self, timeout=None) -> bool:
        super().wait(timeout)
        if self._event is not None:
            self._event.synchronize()
        err = self._failure()
        if err is not None:
            raise err
        return True
