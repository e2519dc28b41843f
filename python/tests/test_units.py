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
