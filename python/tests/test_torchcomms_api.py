"""torchcomms' Python API on ftcomm: what torchcomms' own integration tests
check (python/conformance runs those; CI cannot fetch them), each as a test
of its own here."""

import os
import signal
import subprocess
import sys

import pytest

import api_workers as w
from conftest import HERE, child_env, needs_torch
from test_torchrun import free_port


@needs_torch
def test_zero_element_tensors_are_accepted_by_every_op(three, store, name):
    for failed, after in three.run(w.zero_elements, store.address, name, size=3):
        assert failed == []
        assert after == 6.0


@needs_torch
def test_premul_sum_avg_on_integers_bitwise_and_bool(three, store, name):
    assert three.run(w.reductions, store.address, name, size=3) == [{}, {}, {}]


@needs_torch
def test_v_ops_and_list_ops_in_any_layout(three, store, name):
    assert three.run(w.v_and_list_ops, store.address, name, size=3) == [{}, {}, {}]


@needs_torch
def test_batched_send_recv(three, store, name):
    for rank, (got, empty) in enumerate(three.run(w.batch_p2p, store.address, name, size=3)):
        prev = (rank - 1) % 3
        assert got == [([float(prev)] * 3, [prev * 10] * 5, 4)] * 2
        assert empty == "InvalidArgumentError"


@needs_torch
def test_work_wait_blocking_and_status(two, store, name):
    for res in two.run(w.work_api, store.address, name):
        assert res == {"completed": True, "status": "COMPLETED", "exception": None, "x": 2.0, "barrier": True}


def test_split_refusals_are_raised_on_every_rank(three, store, name):
    for rank, out in enumerate(three.run(w.split_refusals, store.address, name, size=3)):
        assert out["duplicates"] == "InvalidArgumentError", (rank, out)
        assert out["without self"] == "InvalidArgumentError", (rank, out)
        # Only ranks 1 and 2 listed a rank twice: rank 0, whose list was
        # fine, fails too instead of waiting for them.
        assert out["one rank wrong"] == "InvalidArgumentError", (rank, out)
        assert out["lists differ"] == "InvalidArgumentError", (rank, out)
        assert out["good"] == (rank, 3, 6.0)
        assert out["not in any"] == (True if rank == 2 else 2)


def test_reconfigure_shrinks_grows_and_reforms(three, store, name):
    seen = three.run(w.reconfigure_cycle, store.address, name)
    for rank, s in enumerate(seen):
        assert s["unconfigured"] == "ClosedError"
        assert s["all"] == (rank, 3, 6.0)
        if rank < 2:
            assert s["shrunk"] == (rank, 2, 3.0)
        else:
            assert "shrunk" not in s
        assert s["alone"] == (0, 1, 1.0)
        assert s["grown"] == (rank, 3, 6.0)
        assert s["as a set"][1:] == (3, 6.0)
        assert s["aborted"] == (True, True)
    assert sorted(s["as a set"][0] for s in seen) == [0, 1, 2]


def test_abort_fails_later_ops(two, store, name):
    for res in two.run(w.abort_api, store.address, name):
        assert res == (True, False, True, "AbortedError")


@needs_torch
def test_object_collectives(two, store, name):
    res = two.run(w.object_collectives, store.address, name)
    for rank, r in enumerate(res):
        assert r["all_gather"] == [{"rank": 0, "s": ""}, {"rank": 1, "s": "x"}]
        assert r["gather"] == ([[0, "r0"], [1, "r1"]] if rank == 0 else None)
        assert r["broadcast"] == ["b", 123, {"k": [1, 2]}]
        assert r["scatter"] == "for %d" % rank
    assert res[1]["recv"] == ["hello", 7]


def test_get_options(two, store, name):
    for res in two.run(w.options_api, store.address, name):
        assert res == (name, 30.0, False, False, {"shared_memory": "0"}, "gloo", True)


def _ranks(script, n=2, extra=None, timeout=120):
    """Run script as n rank processes with torchrun's environment; returns
    their (returncode, output)."""
    port = free_port()
    procs = []
    for r in range(n):
        env = child_env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), **(extra or {}))
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    out = []
    try:
        for p in procs:
            o, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, o))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


_TWO_COMMS = """
import numpy as np, ftcomm
a = ftcomm.new_comm("gloo", "cpu", "first")
b = ftcomm.new_comm("gloo", "cpu", "second")   # while the first lives: rank 0 must not bind MASTER_PORT again
x, y = np.ones(2, dtype=np.float32), np.full(2, 2.0, dtype=np.float32)
a.all_reduce(x); b.all_reduce(y)
b.finalize()
c = ftcomm.new_comm("gloo", "cpu", "third")
z = np.ones(1, dtype=np.float32); c.all_reduce(z)
print("sums", x[0], y[0], z[0], flush=True)
a.finalize(); c.finalize()
"""


@needs_torch
def test_second_comm_from_the_environment(tmp_path):
    """Without a store, comms made one after another from MASTER_ADDR and
    MASTER_PORT (not under torchrun's agent) share the rank-0 store that
    holds the port."""
    for rc, out in _ranks(_TWO_COMMS):
        assert rc == 0, out
        assert "sums 2.0 4.0 2.0" in out, out


_TIMEOUT = """
import time, numpy as np, ftcomm
abort = %r
c = ftcomm.new_comm("gloo", "cpu", "t", abort_process_on_timeout_or_error=abort, timeout=1.0)
c.barrier()
if c.get_rank() == 0:
    time.sleep(3)  # the stall: rank 1 waits in the barrier past its 1 s deadline
try:
    c.barrier()
    print("no error", flush=True)
except ftcomm.CommTimeoutError as e:
    print("raised", type(e).__name__, flush=True)
"""


@pytest.mark.parametrize("abort", [True, False])
def test_abort_process_on_timeout_or_error(abort):
    """abort_process_on_timeout_or_error=True: a timeout aborts the process
    (SIGABRT, the reason on stderr), as torchcomms does; False (ftcomm's
    default): it is raised."""
    (_, out0), (rc1, out1) = _ranks(_TIMEOUT % abort)
    if abort:
        assert rc1 == -signal.SIGABRT, out1
        assert "Aborting process due to timeout" in out1, out1
    else:
        assert rc1 == 0, out1
        assert "raised CommTimeoutError" in out1, out1
