"""Loading libftcomm.so and calling it: signatures, statuses, fork guard.

Everything that touches ctypes lives here, so the rest of the package reads
as Python.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import signal
import threading
from ctypes import POINTER, byref, c_char_p, c_int32, c_int64, c_uint64, c_void_p
from typing import Optional

from . import errors

ABI_VERSION = 9

# Statuses (libftcomm.h).
OK = 0
PENDING = 1
ERR_BAD_HANDLE = -1
ERR_INTERRUPTED = -3
ERR_SHORT_BUFFER = -16

# Ops and flags.
OP_ALL_REDUCE = 1
OP_REDUCE_SCATTER = 2
OP_ALL_GATHER = 3
OP_BROADCAST = 4
OP_REDUCE = 5
OP_SCATTER = 6
OP_GATHER = 7
OP_ALL_TO_ALL = 8
OP_BARRIER = 9
OP_SEND = 10
OP_RECV = 11
OP_ALL_GATHER_V = 12  # ftcomm_comm_opv
OP_REDUCE_SCATTER_V = 13
OP_ALL_TO_ALL_V = 14
OP_BATCH = 100  # ftcomm_comm_refuse
P2P_SEND = 1  # ftcomm_comm_batch
P2P_RECV = 2
ASYNC = 1

_u64, _i64, _i32, _vp, _cp = c_uint64, c_int64, c_int32, c_void_p, c_char_p
_pu64, _pi64, _pi32 = POINTER(c_uint64), POINTER(c_int64), POINTER(c_int32)
_buf = [_vp, _i64, _pi64]
_opargs = [_u64, _i32, _vp, _i64, _vp, _i64, _i32, _i32, _i32, _i32, _u64, _i64, _i32, _pu64]

_SIGNATURES = {
    "ftcomm_abi_version": ([], _i32),
    "ftcomm_last_error": ([_vp, _i64], _i64),
    "ftcomm_interrupt": ([], _i32),
    "ftcomm_interrupt_install": ([], _i32),
    "ftcomm_interrupt_installed": ([], _i32),
    "ftcomm_live_handles": ([], _i64),
    "ftcomm_blocked_calls": ([], _i64),
    "ftcomm_comm_new": ([_cp, _cp, _u64, _pu64], _i32),
    "ftcomm_comm_free": ([_u64], _i32),
    "ftcomm_quiesce": ([_i64], _i32),
    "ftcomm_comm_info": ([_u64] + _buf, _i32),
    "ftcomm_comm_dump": ([_u64] + _buf, _i32),
    "ftcomm_comm_op": (_opargs, _i32),
    "ftcomm_comm_opv": ([_u64, _i32, _vp, _i64, _vp, _i64, _i32, _i32, _i32, _pi64, _i64, _pi64, _i64, _u64, _i64,
                         _i32, _pu64], _i32),
    "ftcomm_comm_batch": ([_u64, _i64, _pi32, POINTER(c_void_p), _pi64, _pi32, _pi32, _i32, _u64, _i64, _i32, _pu64],
                          _i32),
    "ftcomm_nccl_info": (_buf, _i32),
    "ftcomm_comm_run": ([_u64, _u64, _vp, _i64], _i32),
    "ftcomm_comm_loop": ([_u64, _vp, _i64, _i32, _i32, _i64, _pi64], _i32),
    "ftcomm_comm_refuse": ([_u64, _i32, _i32, _i64, _pi32, _pi32, _cp], _i32),
    "ftcomm_comm_revoke": ([_u64, _cp], _i32),
    "ftcomm_comm_abort": ([_u64, _cp], _i32),
    "ftcomm_comm_shrink": ([_u64, _pi64, _i64, _i64, _i64, _pu64], _i32),
    "ftcomm_comm_grow": ([_u64, _i64, _i64, _i64, _pu64], _i32),
    "ftcomm_comm_split": ([_u64, _i64, _i64, _i64, _pu64], _i32),
    "ftcomm_work_wait": ([_u64, _i64], _i32),
    "ftcomm_work_test": ([_u64, _pi32], _i32),
    "ftcomm_work_cancel": ([_u64], _i32),
    "ftcomm_work_free": ([_u64], _i32),
    "ftcomm_store_listen": ([_cp, _cp, _pu64], _i32),
    "ftcomm_store_connect": ([_cp, _cp, _pu64], _i32),
    "ftcomm_store_addr": ([_u64] + _buf, _i32),
    "ftcomm_store_set": ([_u64, _cp, _vp, _i64, _i64], _i32),
    "ftcomm_store_get": ([_u64, _cp, _vp, _i64, _pi64, _i64], _i32),
    "ftcomm_store_add": ([_u64, _cp, _i64, _pi64, _i64], _i32),
    "ftcomm_store_free": ([_u64], _i32),
    "ftcomm_ft_new": ([_cp, _pu64], _i32),
    "ftcomm_ft_register": ([_u64, _cp, _vp, _i64, _i32, _i32], _i32),
    "ftcomm_ft_step": ([_u64, _i64], _i32),
    "ftcomm_ft_commit": ([_u64, _i64, _pi32], _i32),
    "ftcomm_ft_finish": ([_u64, _i64], _i32),
    "ftcomm_ft_op": (_opargs, _i32),
    "ftcomm_ft_refuse": ([_u64, _i32, _i32, _cp], _i32),
    "ftcomm_ft_fail_step": ([_u64, _cp], _i32),
    "ftcomm_ft_info": ([_u64, _pu64, _pi64, _pi64, _pi64], _i32),
    "ftcomm_ft_group_rank": ([_u64, _pi64], _i32),
    "ftcomm_ft_group_comm": ([_u64, _pu64], _i32),
    "ftcomm_ft_events": ([_u64] + _buf, _i32),
    "ftcomm_ft_free": ([_u64], _i32),
    "ftcomm_ft_sampler_new": ([_u64, _cp, _pu64], _i32),
    "ftcomm_sampler_plan": ([_u64, _vp, _i64, _pi64, _vp, _i64, _pi64], _i32),
    "ftcomm_sampler_position": ([_u64, _pi64, _pi64], _i32),
    "ftcomm_sampler_free": ([_u64], _i32),
    "ftcomm_coordinator_start": ([_cp, _pu64], _i32),
    "ftcomm_coordinator_info": ([_u64] + _buf, _i32),
    "ftcomm_coordinator_free": ([_u64], _i32),
}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None
_pid = os.getpid()
forked = False  # set in a child forked after the library was loaded


def _after_fork_in_child() -> None:
    global forked
    if _lib is not None:
        forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def library_path() -> str:
    """Where libftcomm.so is taken from: $FTCOMM_LIBRARY, else the package."""
    p = os.environ.get("FTCOMM_LIBRARY")
    if p:
        return p
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libftcomm.so")


def _fork_error() -> errors.ForkError:
    return errors.ForkError(
        "ftcomm: this process was forked from the one that loaded libftcomm (pid %d); the Go runtime does not "
        "exist in a forked child. Use ftcomm only in the parent, or start workers with the 'spawn' method "
        "(multiprocessing_context='spawn' for DataLoader)" % _pid, kinds=("fork",))


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use)."""
    if forked:
        raise _fork_error()
    if _lib is not None:
        return _lib
    return _load()


def _load() -> ctypes.CDLL:
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        # NVML resolves globally if it exists, so GPU health works (the
        # library carries stand-ins for it otherwise).
        try:
            ctypes.CDLL("libnvidia-ml.so.1", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
        path = library_path()
        try:
            L = ctypes.CDLL(path)
        except OSError as e:
            raise errors.BackendUnavailableError(
                "ftcomm: cannot load %s: %s (build it: pip install ./python, or go build -buildmode=c-shared "
                "-o libftcomm.so ./capi and set FTCOMM_LIBRARY)" % (path, e), kinds=("backend_unavailable",)) from None
        for name, (args, res) in _SIGNATURES.items():
            f = getattr(L, name)
            f.argtypes, f.restype = args, res
        v = L.ftcomm_abi_version()
        if v != ABI_VERSION:
            raise errors.BackendUnavailableError(
                "ftcomm: %s speaks ABI %d, this package ABI %d: rebuild the library" % (path, v, ABI_VERSION),
                kinds=("backend_unavailable",))
        _path = path
        _lib = L
        atexit.register(_quiesce)
        return L


def _quiesce() -> None:
    """At exit: wait (30 s at most) until every freed comm has released its
    device resources. An NCCL comm frees its NCCL comms in the background
    after its free; CUDA torn down under that release crashed the process
    (SIGSEGV in ncclCommAbort at the end of a spare's run)."""
    if _lib is not None and not forked:
        _lib.ftcomm_quiesce(30000)


def last_error(status: int) -> errors.FtcommError:
    """The exception for a failed call on this thread."""
    L = _lib
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = L.ftcomm_last_error(buf, size)
        if n <= size:
            return errors.from_json(buf.raw[:n], status) if n else errors.FtcommError(
                "ftcomm: status %d" % status, status=status)
        size = n + 1


_check_signals = ctypes.pythonapi.PyErr_CheckSignals
_check_signals.argtypes, _check_signals.restype = [], ctypes.c_int


def fail(status: int):
    """Raise what a negative status means. A call ended by Ctrl-C runs the
    pending signal handler first, so KeyboardInterrupt (or the program's
    own handler) wins."""
    err = last_error(status)
    if status == ERR_INTERRUPTED:
        _check_signals()  # raises KeyboardInterrupt if SIGINT is pending
    raise err


def check(status: int) -> int:
    if status < 0:
        fail(status)
    return status


def get_bytes(fn, *args) -> bytes:
    """Call fn(*args, buf, cap, &n), growing buf until the result fits."""
    size = 1024
    n = c_int64()
    while True:
        buf = ctypes.create_string_buffer(size)
        st = fn(*args, buf, size, byref(n))
        if st == ERR_SHORT_BUFFER:
            last_error(st)  # clear it
            size = n.value + 1
            continue
        check(st)
        return buf.raw[: n.value]


def timeout_ns(timeout) -> int:
    """A timeout (seconds, or a timedelta; None: the default) in ns."""
    if timeout is None:
        return 0
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    try:
        t = float(timeout)
    except (TypeError, ValueError):
        raise errors.InvalidTypeError("ftcomm: timeout %r: want seconds or a timedelta" % (timeout,),
                                      kinds=("invalid_argument",)) from None
    if t <= 0:
        raise errors.InvalidArgumentError("ftcomm: timeout %r is not positive" % (timeout,), kinds=("invalid_argument",))
    return int(t * 1e9)


def ensure_interrupt_chain() -> bool:
    """Chain ftcomm's SIGINT handler in front of Python's default one, so
    Ctrl-C ends a blocked call at once (see docs/python.md). Left alone when
    the program installed its own SIGINT handler, or FTCOMM_NO_SIGINT=1."""
    if os.environ.get("FTCOMM_NO_SIGINT") == "1":
        return False
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
    except (ValueError, TypeError):
        return False
    return check(lib().ftcomm_interrupt_install()) >= 0


def interrupt() -> int:
    """End every blocking ftcomm call in progress in this process (other
    threads' too) with InterruptedOpError; the comms they ran on are
    aborted. Returns how many objects had one."""
    return lib().ftcomm_interrupt()


def blocked_calls() -> int:
    """How many blocking calls are inside the library now (tests)."""
    return lib().ftcomm_blocked_calls()


def live_handles() -> int:
    """How many library objects are alive (for leak checks)."""
    return lib().ftcomm_live_handles()
