"""Ctrl-C (SIGINT) ends a collective blocked in the library at once and
raises KeyboardInterrupt, with nothing left running."""

import os
import signal
import subprocess
import sys
import threading

import pytest

import ftcomm
from conftest import child_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigint_ends_blocked_collective(store, name, mode):
    # This process is rank 1 and never joins the all-reduce.
    peer = {}
    t = threading.Thread(target=lambda: peer.setdefault("c", ftcomm.new_comm(
        "gloo", "cpu", name=name, store=store.address, rank=1, size=2, timeout=60)))
    t.start()
    child = subprocess.Popen([sys.executable, os.path.join(HERE, "sigint_child.py"), store.address, name, mode],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        line = child.stdout.readline().strip()
        if line != "blocked":
            child.kill()
            pytest.fail("child: %r\n%s" % (line, child.communicate()[1]))
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        t.join(60)
    assert child.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("KeyboardInterrupt after"), out + err
    took = float(lines[0].split()[2].rstrip("s;"))
    assert took < 10, out  # not the comm's 60 s deadline
    assert "interrupted" in lines[0], out  # the op was ended inside the library, which aborted the comm
    assert "blocked calls left: 0" in lines[0], out
    assert lines[-1] == "live handles 0", out
    peer["c"].finalize()
