"""Pieces of the package that need no rank processes."""

import datetime

import pytest

import ftcomm
from ftcomm import _lib, errors
from ftcomm.comm import _device_index, _device_type


def test_device_names():
    assert (_device_index("cuda:1"), _device_type("cuda:1")) == (1, "cuda")
    assert (_device_index("cuda"), _device_type("cuda")) == (None, "cuda")
    assert (_device_index("cpu"), _device_type("cpu")) == (None, "cpu")
    assert (_device_index(2), _device_type(2)) == (2, "cuda")
    torch = pytest.importorskip("torch")
    assert (_device_index(torch.device("cuda", 1)), _device_type(torch.device("cuda", 1))) == (1, "cuda")
    assert (_device_index(torch.device("cpu")), _device_type(torch.device("cpu"))) == (None, "cpu")


def test_error_classes_follow_every_kind():
    e = errors.from_json(b'{"status": -6, "kinds": ["peer_failed", "timeout", "aborted"], "message": "m", "ranks": [2]}', -6)
    assert isinstance(e, ftcomm.PeerFailedError) and isinstance(e, TimeoutError) and isinstance(e, ftcomm.CommTimeoutError)
    assert not isinstance(e, ftcomm.AbortedError)  # a plain abort adds nothing to a more telling kind
    assert e.ranks == (2,) and e.kinds == ("peer_failed", "timeout", "aborted")
    e = errors.from_json(b'{"status": -2, "kinds": ["invalid_argument"], "message": "m"}', -2)
    assert isinstance(e, ValueError) and isinstance(e, ftcomm.FtcommError)
    e = errors.from_json(b'{"status": -4, "kinds": ["rolled_back"], "message": "m", "rollback": '
                         b'{"from_step": 3, "to_step": 4, "step": 5, "epoch": 7}}', -4)
    assert isinstance(e, ftcomm.RolledBackError) and (e.from_step, e.to_step, e.step, e.epoch) == (3, 4, 5, 7)


def test_timeouts():
    assert _lib.timeout_ns(None) == 0
    assert _lib.timeout_ns(1.5) == 1_500_000_000
    assert _lib.timeout_ns(datetime.timedelta(milliseconds=20)) == 20_000_000
    with pytest.raises(ValueError):
        _lib.timeout_ns(0)
    with pytest.raises(TypeError):
        _lib.timeout_ns("soon")


def test_double_free_is_an_error_not_a_crash():
    s = ftcomm.Store.listen("127.0.0.1:0")
    h = s._h
    s.close()
    st = _lib.lib().ftcomm_store_free(h)
    with pytest.raises(ftcomm.BadHandleError):
        _lib.check(st)
    s.close()  # the object knows it is closed


def test_premul_factor_in_the_tensor_dtype():
    """A PREMUL_SUM factor is applied as NCCL applies it: as a value of the
    tensor's dtype (a number through float32, as torch's T(double) does; a
    tensor factor, which torch's NCCL takes only in the data's dtype, of
    any shape with one element), the product rounded once."""
    torch = pytest.importorskip("torch")
    from ftcomm import _tensors

    third = 1 / 3
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.arange(1, 65, dtype=dt)
        for factor in (third, torch.tensor([third], dtype=dt), torch.tensor(third, dtype=dt)):
            if isinstance(factor, torch.Tensor):
                f = factor.reshape(())
            else:
                f = torch.tensor(third, dtype=torch.float64 if dt == torch.float64 else torch.float32).to(dt)
            want = (x.double() * f.double()).to(dt)  # the exact product, rounded once
            y = x.clone()
            _tensors.scale_(y, factor)
            assert torch.equal(y, want), (dt, factor)
            assert torch.equal(_tensors.scaled(x, factor), want), (dt, factor)
    z = torch.tensor(3.0)  # a 0-d tensor, a [1] factor
    _tensors.scale_(z, torch.tensor([0.5]))
    assert z.item() == 1.5
    np = pytest.importorskip("numpy")
    for dt in (np.float16, np.float32, np.float64):
        x = np.arange(1, 65, dtype=dt)
        f = np.float64(third) if dt == np.float64 else np.float32(third).astype(dt)
        want = (x.astype(np.float64) * np.float64(f)).astype(dt)
        y = x.copy()
        _tensors.scale_(y, third)
        assert (y == want).all() and (_tensors.scaled(x, third) == want).all(), dt
