"""Rendezvous from torchrun's environment: the Quick Start under
`torchrun --nproc_per_node 2` (the agent's TCPStore bootstraps ftcomm's)."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import child_env, needs_torch

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_torch
@pytest.mark.parametrize("rdzv", ["static", "standalone"])
def test_quickstart_under_torchrun(rdzv):
    """static: torchrun's agent hosts a TCPStore on MASTER_PORT;
    standalone: rank 0 hosts one there, as torch.distributed's env:// does."""
    import torch
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    if rdzv == "static":
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    else:
        cmd += ["--standalone"]
    if torch.__version__.startswith("1."):
        # torch 1.13's launcher cannot parse "--redirects 0" on Python 3.11
        # (enum.IntFlag iteration changed); "1" works.
        cmd += ["--redirects", "1", "--tee", "1"]
    cmd.append(os.path.join(HERE, "quickstart_cpu.py"))
    # A session of its own, so that the launcher's workers go with it if
    # it has to be killed.
    p = subprocess.Popen(cmd, env=child_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, out
    for r in (0, 1):
        assert "Rank %d: After AllReduce: 3.0" % r in out, out
