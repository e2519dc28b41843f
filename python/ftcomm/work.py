"""Work: the handle of an async op, and what keeps an op's tensors alive.

An op reads and writes its tensors until it completes, whatever the caller
does with the Work: ``comm.all_reduce(t, op, async_op=True)`` with the Work
dropped at once, or ``del t`` before ``wait``, must not free memory the op
still uses. So each async op is recorded in its communicator's ``InFlight``
(issue order), holding the Work's library handle and every tensor the op
touches, until the op is seen to end: by ``wait``/``is_completed``, by the
comm issuing its next op or finishing a sync one (ops complete in issue
order, so the oldest are checked first), or by ``finalize`` (which closes
the comm: every op ends before it returns). Only then are the tensors
released and the handle freed. An op may carry an ``after`` step, run once
when it is seen to have succeeded (the list collectives copy a scratch
buffer into the caller's tensors there). A dropped Work's op still runs to
the end; its outputs are complete once a later op on the same comm has
completed, or the comm is finalized.

On CUDA the after step is queued on the stream the op was issued on, not
on whatever stream is current where the op happens to be seen to end (the
next op's, or the stream a ``wait`` runs under), and an event is recorded
behind it: ``wait`` makes the caller's current stream wait for that event
(also when the op was settled before, by another op), ``is_completed`` is
true once it has passed, and the tensors the step uses (the scratch buffer,
the caller's tensors) are recorded on that stream for PyTorch's caching
allocator, so the scratch buffer is not handed out again while the copy
may still read it. For a dropped Work, the copy is ordered on the issuing
stream behind the call that saw the op end.
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from ctypes import byref, c_int32
from typing import Any, Callable, Optional

from . import _lib, _tensors
from .errors import CommTimeoutError

_WAIT_SLICE_NS = 200_000_000  # a blocked wait returns to Python this often (signals)


class WorkStatus(enum.Enum):
    """What a Work's op is doing (torchcomms' WorkStatus)."""

    NOT_STARTED = 1
    INPROGRESS = 2
    COMPLETED = 3
    TIMEDOUT = 4
    ERROR = 5


class _Op:
    """One async op in flight: its library handle (0 once settled), what
    keeps its tensors alive, what to run once it has succeeded, the CUDA
    stream it was issued on (None on the host, or with no after step), and
    its outcome once settled: err, and event, the CUDA event recorded behind
    the after step on that stream (None when nothing was queued there)."""

    __slots__ = ("h", "keep", "after", "stream", "done", "err", "event")

    def __init__(self, h: int, keep: Any, after: Optional[Callable[[], None]] = None, stream: Any = None):
        self.h, self.keep, self.after, self.stream = h, keep, after, stream
        self.done, self.err, self.event = False, None, None


class InFlight:
    """The async ops of one communicator not yet seen to end, in issue order.
    Safe for concurrent use."""

    __slots__ = ("_q", "_lock", "_settled")

    def __init__(self):
        self._q: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # an op became done

    def __bool__(self) -> bool:
        return bool(self._q)

    def add(self, h: int, keep: Any, after: Optional[Callable[[], None]] = None, stream: Any = None) -> _Op:
        """Record an async op; stream: the CUDA stream (a torch.cuda.Stream)
        its after step is to be queued on, the one it was issued on."""
        op = _Op(h, keep, after, stream if after is not None else None)
        with self._lock:
            self._q.append(op)
        return op

    def settle(self, op: _Op, status: int) -> None:
        """Record the outcome of op, which has ended (status of a wait on
        it, on this thread), run its after step if it succeeded (on CUDA:
        queued on the op's stream, an event recorded behind it), free its
        handle and release its tensors."""
        err = _lib.last_error(status) if status < 0 else None
        with self._lock:
            if op.done or not op.h:
                return  # settled, or being settled by another thread
            h, keep, after = op.h, op.keep, op.after
            op.h, op.keep, op.after = 0, None, None
            try:
                self._q.remove(op)
            except ValueError:
                pass
        event = None
        if err is None and after is not None:
            try:
                if op.stream is not None:
                    event = _tensors.run_on_stream(op.stream, after, keep)
                else:
                    after()
            except Exception as e:  # noqa: BLE001 - the op's error now
                err = e
        del keep
        if not _lib.forked:
            _lib.lib().ftcomm_work_free(h)
        with self._lock:
            op.err, op.event, op.done = err, event, True
            self._settled.notify_all()

    def await_settled(self, op: _Op) -> None:
        """Wait until another thread has finished settling op."""
        with self._lock:
            while not op.done:
                self._settled.wait()

    def reap(self) -> None:
        """Settle the oldest ops that have ended (the rest are younger)."""
        L = _lib.lib()
        while True:
            with self._lock:
                if not self._q:
                    return
                op = self._q[0]
                h = op.h
            if not h:  # being settled by another thread (it leaves the queue)
                self.await_settled(op)
                continue
            st = L.ftcomm_work_wait(h, 0)
            if st == _lib.PENDING:
                return
            self.settle(op, st)

    def release(self) -> None:
        """Settle every op: their comm is closed, so all of them have ended
        (an op that completed before the close still runs its after step)."""
        with self._lock:
            ops = list(self._q)
        for op in ops:
            h = op.h
            if _lib.forked:
                op.h, op.keep, op.after, op.done = 0, None, None, True
            elif h:
                self.settle(op, _lib.lib().ftcomm_work_wait(h, 0))


class Work:
    """The handle of an op (torchcomms' TorchWork).

    ``wait(timeout=None)`` blocks until the op is done and raises its error
    if it failed (a timeout raises CommTimeoutError and leaves the op
    running); ``wait_blocking()`` is the same (the host always waits here,
    also for CUDA ops: work queued on the current stream afterwards sees the
    result, the copy into the caller's tensors of a list op included, which
    is queued on the stream the op was issued on); ``is_completed()`` says
    whether it is done (that copy included); ``exception()`` is
    the error of a completed op, or None. Dropping a Work does not cancel or
    orphan its op: the communicator keeps the op's tensors alive until it
    ends. Ctrl-C in ``wait`` cancels the op (its communicator is aborted: a
    collective cannot be left half-way) and raises KeyboardInterrupt.
    """

    __slots__ = ("_op", "_inflight", "__weakref__")

    def __init__(self, op: Optional[_Op] = None, inflight: Optional[InFlight] = None):
        self._op, self._inflight = op, inflight

    @property
    def _done(self) -> bool:
        return self._op is None or self._op.done

    @property
    def _err(self) -> Optional[BaseException]:
        return None if self._op is None else self._op.err

    def is_completed(self) -> bool:
        op = self._op
        if op is None:
            return True
        if not op.done:
            h = op.h
            if h:  # (0: being settled by another thread; done soon)
                done = c_int32()
                st = _lib.lib().ftcomm_work_test(h, byref(done))
                if st == 0 and done.value:
                    self._inflight.settle(op, _lib.lib().ftcomm_work_wait(h, 0))
            if not op.done:
                return False
        ev = op.event  # the copy into the caller's tensors, queued on the op's stream
        return ev is None or _tensors.event_done(ev)

    def is_success(self) -> bool:
        """True once the op has completed without an error."""
        return self.is_completed() and self._err is None

    def exception(self) -> Optional[BaseException]:
        """The op's error once it has completed with one, else None."""
        return self._err if self.is_completed() else None

    def status(self) -> WorkStatus:
        if not self.is_completed():
            return WorkStatus.INPROGRESS
        err = self._err
        if err is None:
            return WorkStatus.COMPLETED
        return WorkStatus.TIMEDOUT if isinstance(err, TimeoutError) else WorkStatus.ERROR

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._wait(None if timeout is None else _lib.timeout_ns(timeout))
        err = self._err
        if err is not None:
            raise err
        op = self._op
        if op is not None and op.event is not None:
            # Settled here or earlier (by another op, under another stream):
            # the copy into the caller's tensors is queued on the op's
            # stream; what the caller queues next waits for it.
            _tensors.stream_wait(op.stream, op.event)
        return True

    def wait_blocking(self, timeout=None) -> bool:
        """Block the host until the op is done (as ``wait``)."""
        return self.wait(timeout)

    def _wait(self, limit_ns: Optional[int]) -> None:
        op, L = self._op, _lib.lib()
        deadline = None if limit_ns is None else time.monotonic_ns() + limit_ns
        try:
            while not op.done:
                h = op.h
                if not h:
                    self._inflight.await_settled(op)  # being settled by another thread
                    return
                s = _WAIT_SLICE_NS
                if deadline is not None:
                    s = min(s, max(deadline - time.monotonic_ns(), 1))
                st = L.ftcomm_work_wait(h, s)
                if st != _lib.PENDING:
                    if st == _lib.ERR_BAD_HANDLE and not op.h:
                        _lib.last_error(st)  # settled meanwhile; clear this thread's error
                        self._inflight.await_settled(op)
                        return
                    self._inflight.settle(op, st)
                    return
                if deadline is not None and time.monotonic_ns() >= deadline:
                    raise CommTimeoutError("ftcomm: wait timed out; the op is still running", kinds=("timeout",))
        except KeyboardInterrupt:
            # Cancel the op (it cannot be abandoned half-way, so its comm
            # is aborted), wait for it to end, then let Ctrl-C through.
            h = op.h
            if h:
                L.ftcomm_work_cancel(h)
                self._inflight.settle(op, L.ftcomm_work_wait(h, -1))
            raise

    def __repr__(self):
        if not self._done:
            return "Work(pending)"
        return "Work(done)" if self._err is None else "Work(failed: %s)" % (self._err,)


DONE = Work()
