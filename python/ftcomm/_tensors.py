"""What ftcomm needs to know of a tensor: address, element count, dtype,
device; for torch tensors (CPU and CUDA) and numpy arrays (CPU)."""

from __future__ import annotations

import sys
from typing import Any, Tuple

from .errors import InvalidTypeError
from .errors import invalid_argument as _inv

# comm.DType values, and BOOL: torch.bool and numpy's bool_, which cross the
# ABI as UINT8 (their bytes are 0 or 1) with the reductions mapped (abi_dtype,
# and Communicator's reductions).
FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT8, UINT8, INT32, INT64 = range(1, 9)
BOOL = 100
DTYPE_NAMES = {FLOAT32: "float32", FLOAT64: "float64", FLOAT16: "float16", BFLOAT16: "bfloat16",
               INT8: "int8", UINT8: "uint8", INT32: "int32", INT64: "int64", BOOL: "bool"}
FLOATS = frozenset((FLOAT32, FLOAT64, FLOAT16, BFLOAT16))


def abi_dtype(dt: int) -> int:
    """The comm.DType a dtype crosses the ABI as."""
    return UINT8 if dt == BOOL else dt

_torch = None
_torch_dtypes: dict = {}
_np = None
_np_dtypes: dict = {}
_raw_stream = None


def _typ(msg: str) -> InvalidTypeError:
    return InvalidTypeError("ftcomm: " + msg, kinds=("invalid_argument",))


def _load_torch():
    global _torch, _torch_dtypes
    t = sys.modules.get("torch")
    if t is None:
        return None
    _torch_dtypes = {t.float32: FLOAT32, t.float64: FLOAT64, t.float16: FLOAT16, t.bfloat16: BFLOAT16,
                     t.int8: INT8, t.uint8: UINT8, t.int32: INT32, t.int64: INT64}
    _torch = t
    return t


def _load_numpy():
    global _np, _np_dtypes
    n = sys.modules.get("numpy")
    if n is None:
        return None
    _np_dtypes = {n.dtype(n.float32): FLOAT32, n.dtype(n.float64): FLOAT64, n.dtype(n.float16): FLOAT16,
                  n.dtype(n.int8): INT8, n.dtype(n.uint8): UINT8, n.dtype(n.int32): INT32, n.dtype(n.int64): INT64}
    try:  # bfloat16, where ml_dtypes provides it
        import ml_dtypes  # type: ignore
        _np_dtypes[n.dtype(ml_dtypes.bfloat16)] = BFLOAT16
    except ImportError:
        pass
    _np = n
    return n


_Tensor = None  # torch.Tensor, once torch is loaded
_ndarray = None
_np_ptrs: dict = {}  # id(array) → (weakref, address): numpy's .ctypes.data costs ~1 µs


def _fast_types():
    global _Tensor, _ndarray
    if _Tensor is None and (_torch or _load_torch()) is not None:
        _Tensor = _torch.Tensor
    if _ndarray is None and (_np or _load_numpy()) is not None:
        _ndarray = _np.ndarray


def host(t: Any):
    """(address, count, dtype) of a contiguous CPU torch.Tensor or writable
    C-contiguous numpy array of a supported dtype, found the fast way; None
    for anything else (describe then says what is wrong, if anything)."""
    tp = type(t)
    if tp is _Tensor:
        if t.is_cpu and t.is_contiguous():
            dt = _torch_dtypes.get(t.dtype)
            if dt is not None:
                return t.data_ptr(), t.numel(), dt
        return None
    if tp is _ndarray:
        fl = t.flags
        if fl.c_contiguous and fl.writeable:
            dt = _np_dtypes.get(t.dtype)
            if dt is not None:
                e = _np_ptrs.get(id(t))
                if e is None or e[0]() is not t or e[2] != t.size:
                    e = _np_entry(t)
                return e[1], t.size, dt
        return None
    if _Tensor is None or _ndarray is None:
        _fast_types()
        if type(t) in (_Tensor, _ndarray):
            return host(t)
    return None


def _np_entry(t):
    import weakref
    if len(_np_ptrs) > 4096:
        for k in [k for k, v in _np_ptrs.items() if v[0]() is None]:
            del _np_ptrs[k]
        if len(_np_ptrs) > 4096:
            _np_ptrs.clear()
    e = (weakref.ref(t), t.ctypes.data, t.size)
    _np_ptrs[id(t)] = e
    return e


def is_torch(t: Any) -> bool:
    torch = _torch or _load_torch()
    return torch is not None and isinstance(t, torch.Tensor)


def describe(t: Any, name: str = "tensor") -> Tuple[int, int, int, int]:
    """(address, element count, dtype, CUDA device or -1) of a contiguous
    torch tensor or numpy array; raises InvalidArgumentError or
    InvalidTypeError for anything else."""
    torch = _torch or _load_torch()
    if torch is not None and isinstance(t, torch.Tensor):
        dt = _torch_dtypes.get(t.dtype)
        if dt is None:
            if t.dtype is not torch.bool:
                raise _typ("%s: dtype %s is not supported (float32/64, float16, bfloat16, int8/32/64, uint8, bool)" % (
                    name, t.dtype))
            dt = BOOL
        if not t.is_contiguous():
            raise _inv("%s: not contiguous (call .contiguous() first)" % name)
        if t.is_cuda:
            return t.data_ptr(), t.numel(), dt, t.get_device()
        if t.layout is not torch.strided or t.is_meta or t.device.type != "cpu":
            raise _inv("%s: on %s; ftcomm takes CPU and CUDA tensors" % (name, t.device))
        return t.data_ptr(), t.numel(), dt, -1
    np = _np or _load_numpy()
    if np is not None and isinstance(t, np.ndarray):
        dt = _np_dtypes.get(t.dtype)
        if dt is None:
            if t.dtype != np.bool_:
                raise _typ("%s: dtype %s is not supported" % (name, t.dtype))
            dt = BOOL
        if not t.flags.c_contiguous:
            raise _inv("%s: not C-contiguous (use numpy.ascontiguousarray)" % name)
        if not t.flags.writeable:
            raise _inv("%s: read-only array" % name)
        return t.ctypes.data, t.size, dt, -1
    raise _typ("%s: %s is neither a torch.Tensor nor a numpy.ndarray" % (name, type(t).__name__))


def current_stream(device: int) -> int:
    """The raw cudaStream_t of PyTorch's current stream on device."""
    global _raw_stream
    if _raw_stream is None:
        torch = _torch or _load_torch()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream(device)


def stream_object(device: int):
    """PyTorch's current stream on device, as a torch.cuda.Stream: where an
    async op's after step is queued (run_on_stream)."""
    return _torch.cuda.current_stream(device)


def _record(x: Any, stream) -> None:
    """Record every CUDA tensor in x (nested tuples and lists) on stream for
    the caching allocator: its memory is not handed out again, once freed,
    before the work queued on stream so far has run."""
    if isinstance(x, (tuple, list)):
        for y in x:
            _record(y, stream)
    elif _torch is not None and isinstance(x, _torch.Tensor) and x.is_cuda:
        x.record_stream(stream)


def run_on_stream(stream, fn, tensors):
    """Run fn (an async op's after step, which queues CUDA work) with stream
    current, record tensors (what fn uses) on it, and return a CUDA event
    recorded behind what fn queued."""
    torch = _torch
    with torch.cuda.stream(stream):
        fn()
        _record(tensors, stream)
        ev = torch.cuda.Event()
        ev.record(stream)
    return ev


def stream_wait(stream, event) -> None:
    """Make the current stream of stream's device wait for event."""
    _torch.cuda.current_stream(stream.device).wait_event(event)


def event_done(event) -> bool:
    """Whether the work event was recorded behind has run."""
    return event.query()


def empty_like_flat(t: Any, n: int):
    """A new contiguous 1-D tensor (or array) of n elements, t's dtype and device."""
    if is_torch(t):
        return _torch.empty((n,), dtype=t.dtype, device=t.device)
    return _np.empty((n,), dtype=t.dtype)


def flat(t: Any):
    """t as a 1-D view (t is contiguous)."""
    return t.reshape(-1)


def concat(ts):
    if is_torch(ts[0]):
        return _torch.cat([x.reshape(-1) for x in ts])
    return _np.concatenate([x.reshape(-1) for x in ts])


def copy_into(dst: Any, src: Any) -> None:
    """dst[...] = src (shapes may differ, sizes equal)."""
    if is_torch(dst):
        dst.copy_(src.view(dst.shape))
    else:
        dst[...] = src.reshape(dst.shape)


def numel(t: Any) -> int:
    return t.numel() if is_torch(t) else int(t.size)


def shape(t: Any) -> tuple:
    return tuple(t.shape)


_ITEMSIZE = {FLOAT32: 4, FLOAT64: 8, FLOAT16: 2, BFLOAT16: 2, INT8: 1, UINT8: 1, INT32: 4, INT64: 8, BOOL: 1}


def itemsize(dt: int) -> int:
    return _ITEMSIZE[dt]


def torch_dtype_code(dtype) -> Any:
    """The dtype code of a torch dtype (None for one ftcomm does not move)."""
    if _torch is None:
        _load_torch()
    return _torch_dtypes.get(dtype)


def check_factor(factor: Any, dt: int) -> None:
    """Refuse a PREMUL_SUM tensor factor that is not one element of the
    data's dtype dt (a number is taken for every floating-point dtype).

    NCCL reads a PreMulSum factor as a value of the data's type, so torch's
    NCCL backend reads a tensor factor as its data's type T
    (``const_data_ptr<T>()``, which raises for any other dtype) and so does
    torchcomms' (an assertion). ftcomm refuses the same tensors rather
    than convert the factor silently: code that runs on ftcomm then runs on
    those backends, and no factor is rounded where the caller did not see
    it. (torch's NCCL up to at least 2.11 is the exception that proves the
    rule: it reads a bfloat16 op's factor as float32, asks a float32
    tensor and hands NCCL the wrong two bytes of it, pytorch/pytorch#190745;
    docs/python.md.)"""
    torch = _torch or _load_torch()
    np = _np or _load_numpy()
    if torch is not None and isinstance(factor, torch.Tensor):
        fdt, name, n = _torch_dtypes.get(factor.dtype), str(factor.dtype).replace("torch.", ""), factor.numel()
    elif np is not None and isinstance(factor, np.ndarray):
        fdt, name, n = _np_dtypes.get(factor.dtype), str(factor.dtype), int(factor.size)
    else:
        return
    if n != 1:
        raise _inv("PREMUL_SUM factor: a tensor of %d elements; want one element (or a number)" % n)
    if fdt != dt:
        hint = ""
        if dt == BFLOAT16 and fdt == FLOAT32:
            hint = (" (torch's NCCL up to 2.11 asks float32 for bfloat16 data, then reads the wrong half of it: "
                    "pytorch/pytorch#190745)")
        want = DTYPE_NAMES[dt]
        raise _inv("PREMUL_SUM factor: a %s tensor for %s data; a tensor factor must be of the data's dtype, as "
                   "torch's NCCL and torchcomms require it: make it with dtype=%s, or pass a number%s"
                   % (name, want, want, hint))


def _factor_for(t: Any, factor: Any):
    """A PREMUL_SUM factor as NCCL applies it to t: in t's dtype. NCCL takes
    the factor as a value of the data's type T (torch's NCCL backend passes
    T(factor): a double reaches float16 and bfloat16 through float) and
    multiplies each element by it in T, rounding once. So a number becomes
    the nearest value of t's dtype, and a tensor factor (one element of
    t's dtype: check_factor) becomes a scalar on t's device, or a CPU
    scalar, which torch passes to a CUDA kernel by value: a CUDA factor
    costs no host sync. Multiplying by that value rounds once to t's
    dtype, as NCCL does (the exact product of two float16 or bfloat16
    values fits in float32, where torch multiplies them)."""
    if is_torch(t):
        torch = _torch
        if is_torch(factor):
            f = factor.reshape(())
            if f.device != t.device and f.device.type != "cpu":
                f = f.to(t.device)
            return f.to(t.dtype)
        f = float(factor)
        if t.dtype == torch.float64:
            return f
        v = torch.tensor(f, dtype=torch.float32)
        return float(v if t.dtype == torch.float32 else v.to(t.dtype))
    if is_torch(factor):
        factor = factor.reshape(-1)[0].item()
    np = _np or _load_numpy()
    f = np.float64(factor)
    if t.dtype != f.dtype:
        f = f.astype(np.float32).astype(t.dtype)
    return f


def scale_(t: Any, factor: Any) -> None:
    """t *= factor, in t's dtype (on the current stream, for CUDA)."""
    f = _factor_for(t, factor)
    if is_torch(t):
        t.mul_(f)
    else:
        _np.multiply(t, f, out=t, casting="unsafe")


def scaled(t: Any, factor: Any):
    """A new contiguous copy of t multiplied by factor, in t's dtype."""
    f = _factor_for(t, factor)
    if is_torch(t):
        return (t * f).to(t.dtype).contiguous()
    return _np.ascontiguousarray(_np.multiply(t, f).astype(t.dtype))


def copy_blocks(buf: Any, tensors, counts) -> None:
    """Copy consecutive blocks of the flat buf (counts[i] elements) into
    tensors[i] (on the current stream, for CUDA)."""
    off = 0
    for t, k in zip(tensors, counts):
        if k:
            copy_into(t, buf[off:off + k])
        off += k
