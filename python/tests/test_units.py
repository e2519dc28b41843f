"""Pieces of the package that need no rank processes."""

import datetime

import pytest

import ftcomm
from ftcomm import _lib, errors
from ftcomm._devices import device_index as _device_index, device_type as _device_type


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


class _FakeWorkLib:
    """The library's Work calls, for InFlight without a comm: the ops in
    done have ended."""

    def __init__(self, log):
        self.done, self.log = set(), log

    def ftcomm_work_wait(self, h, timeout_ns):
        return 0 if h in self.done else _lib.PENDING

    def ftcomm_work_test(self, h, out):
        out._obj.value = int(h in self.done)
        return 0

    def ftcomm_work_free(self, h):
        self.log.append(("free", h))


def test_async_after_step_is_queued_on_the_issuing_stream(monkeypatch):
    """A list op's copy-out (its after step) goes to the stream the op was
    issued on, whichever stream is current where the op is seen to end (the
    next op's, here B); its tensors are recorded on that stream before they
    are released; wait() under any stream (C) makes that stream wait for
    the copy, also when the op was settled before; is_completed() is true
    once the copy has run. Streams and events are stand-ins: the logic
    without a GPU (test_cuda.py checks it on one)."""
    from ftcomm import _tensors, work
    log, cur, ran = [], ["B"], set()
    fake = _FakeWorkLib(log)
    monkeypatch.setattr(_lib, "lib", lambda: fake)

    def run_on_stream(stream, fn, tensors):
        prev, cur[0] = cur[0], stream
        try:
            fn()
            log.append(("record", stream, tensors))
        finally:
            cur[0] = prev
        return ("event", stream)

    monkeypatch.setattr(_tensors, "run_on_stream", run_on_stream)
    monkeypatch.setattr(_tensors, "stream_wait", lambda stream, ev: log.append(("wait", cur[0], ev)))
    monkeypatch.setattr(_tensors, "event_done", lambda ev: ev in ran)
    inflight = work.InFlight()

    # Settled by the next op (reap under stream B), then waited for under C.
    op = inflight.add(1, ("tmp", "outs"), lambda: log.append(("copy", cur[0])), "A")
    w = work.Work(op, inflight)
    inflight.reap()
    assert log == [] and not w.is_completed()
    fake.done.add(1)
    inflight.reap()
    assert log == [("copy", "A"), ("record", "A", ("tmp", "outs")), ("free", 1)]
    assert not inflight and not w.is_completed()  # the copy has not run yet
    ran.add(("event", "A"))
    assert w.is_completed()
    cur[0] = "C"
    assert w.wait()
    assert log[-1] == ("wait", "C", ("event", "A"))

    # Settled by its own wait() under C: the copy still goes to its stream.
    del log[:]
    op = inflight.add(2, "tmp2", lambda: log.append(("copy", cur[0])), "A2")
    fake.done.add(2)
    work.Work(op, inflight).wait()
    assert log == [("copy", "A2"), ("record", "A2", "tmp2"), ("free", 2), ("wait", "C", ("event", "A2"))]

    # On the host (no stream) the step runs where it is settled; no event.
    del log[:]
    op = inflight.add(3, None, lambda: log.append(("copy", cur[0])), None)
    fake.done.add(3)
    w = work.Work(op, inflight)
    assert w.is_completed() and w.wait()
    assert log == [("copy", "C"), ("free", 3)]

    # No after step: no stream kept, nothing queued.
    del log[:]
    op = inflight.add(4, None, None, "A")
    assert op.stream is None
    fake.done.add(4)
    assert work.Work(op, inflight).wait() and log == [("free", 4)]


def test_completer_goes_on_after_a_completion_raises(caplog):
    """A completion that raises is reported, and the ones after it still
    run in order (a dead thread would leave their futures waiting)."""
    import threading

    from ftcomm._completer import Completer

    c = Completer("test-completer")
    ran, done = [], threading.Event()

    def bad():
        ran.append("bad")
        raise ValueError("boom")

    c.add(lambda: ran.append(1))
    c.add(bad)
    c.add(lambda: ran.append(2))
    c.add(done.set)
    c.close()
    assert done.wait(30), ran
    assert ran == [1, "bad", 2]
    bad_logs = [r for r in caplog.records if "a completion raised" in r.getMessage()]
    assert len(bad_logs) == 1 and bad_logs[0].name == "ftcomm", caplog.records
    assert "ValueError: boom" in caplog.text, caplog.text


def test_shard_group_takes_faults_and_raises_the_callers_errors():
    """ShardGroup._op_failed: a fault (revoked, a peer's death, the comm ft
    closed, a timeout) fails the step once and is not raised; the caller's
    errors (wrong arguments, sizes across ranks) are; a fault outside a
    step (fail_step refuses) is still taken (ft's commit fails anyway)."""
    pytest.importorskip("torch")
    from ftcomm.ft_torch import ShardGroup

    class FakeFT:
        group, group_rank, group_size, epoch, committed_step = "g", 1, 3, 4, 10
        fails = []

        def fail_step(self, reason):
            self.fails.append(reason)
            if len(self.fails) > 2:
                raise errors.InvalidArgumentError("not in a step", kinds=("invalid_argument",))

    ft = FakeFT()
    pg = ShardGroup(ft)
    assert (pg.rank(), pg.size(), pg.failure) == (1, 3, None)
    bad = errors.InvalidArgumentError("all_gather: output of 5 elements", kinds=("invalid_argument",))
    assert pg._op_failed(bad) is bad
    mismatch = errors.MismatchError("sizes differ", kinds=("mismatch",))
    assert pg._op_failed(mismatch) is mismatch
    assert ft.fails == [] and pg.failure is None
    dead = errors.PeerFailedError("rank 2: connection reset", kinds=("peer_failed",))
    assert pg._op_failed(dead) is None
    assert pg._op_failed(errors.RevokedError("revoked", kinds=("revoked",))) is None
    assert len(ft.fails) == 1 and "connection reset" in ft.fails[0] and pg.failure is dead
    ft.committed_step = 11  # the next step: its first fault fails it again
    assert pg.failure is None
    closed = errors.ClosedError("closed", kinds=("closed",))
    assert pg._op_failed(closed) is None and pg.failure is closed and len(ft.fails) == 2
    ft.epoch = 5
    assert pg._op_failed(errors.CommTimeoutError("timeout", kinds=("timeout",))) is None  # fail_step refused
    assert len(ft.fails) == 3
    with pytest.raises(errors.InvalidArgumentError, match="nothing to shard"):
        ShardGroup(type("Solo", (FakeFT,), {"group_size": 1})())


def test_shard_group_takes_a_fault_in_every_kind_of_op():
    """A fault met before an op reaches a comm (ft's group comm revoked or
    closed when the op asks for it) fails the step for a collective, a
    send, a receive and a barrier alike: a done Work, no exception; a
    caller's error there (no group comm outside a step) still raises."""
    torch = pytest.importorskip("torch")
    from ftcomm.ft_torch import ShardGroup

    class FaultyFT:
        group, group_rank, group_size, epoch, committed_step = "g", 0, 2, 3, 7
        fails = []
        error = errors.RevokedError("revoked: a rank of the group died", kinds=("revoked",))

        def group_comm(self):
            raise self.error

        def fail_step(self, reason):
            self.fails.append(reason)

    ft = FaultyFT()
    pg = ShardGroup(ft)
    t = torch.zeros(4)
    for op in (lambda: pg.allreduce([t]), lambda: pg.send([t], 1, 0), lambda: pg.recv([t], 1, 0), lambda: pg.barrier()):
        w = op()
        assert w.wait() and w.is_completed()
    assert len(ft.fails) == 1 and "a rank of the group died" in ft.fails[0]
    assert isinstance(pg.failure, errors.RevokedError)
    ft.error = errors.InvalidArgumentError("ft: no group comm", kinds=("invalid_argument",))
    with pytest.raises(errors.InvalidArgumentError, match="no group comm"):
        pg.send([t], 1, 0)


def test_shard_group_counts_a_fault_once_per_step_call():
    """With the Comm's count of step() calls, a step taken again at the
    same epoch and committed step (its first try's commit failed) is a new
    step: its first fault fails it again; failure() stays the step's until
    the next step()."""
    pytest.importorskip("torch")
    from ftcomm.ft_torch import ShardGroup

    class FT:
        group, group_rank, group_size, epoch, committed_step, _steps = "g", 0, 2, 4, 9, 1
        fails = []

        def fail_step(self, reason):
            self.fails.append(reason)

    ft = FT()
    pg = ShardGroup(ft)
    first = errors.CommTimeoutError("a slow peer", kinds=("timeout",))
    assert pg._op_failed(first) is None and pg._op_failed(errors.RevokedError("r", kinds=("revoked",))) is None
    assert len(ft.fails) == 1 and pg.failure is first
    ft._steps = 2  # the same epoch and committed step, another try
    assert pg.failure is None
    again = errors.CommTimeoutError("a slow peer again", kinds=("timeout",))
    assert pg._op_failed(again) is None and len(ft.fails) == 2 and pg.failure is again
