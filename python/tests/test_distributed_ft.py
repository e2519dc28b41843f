"""FT-DDP (ftcomm.ft_torch): torch's DDP with its gradient buckets averaged
across replicas by ftcomm.ft.Comm, an OptimizerWrapper, register_state.
One of two replica processes is SIGKILLed: the survivor commits without it;
the restarted replica heals the parameters and Adam's state from it; both
then commit every step with the same state."""

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

from conftest import child_env, needs_torch
from test_ft import Replica, steps

import ftcomm
import ftcomm.coordinator

HERE = os.path.dirname(os.path.abspath(__file__))


class DDPReplica(Replica):
    """test_ft's replica process, running ft_ddp_replica.py."""

    def __init__(self, group, env, out):
        self.group, self.out = group, out
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "ft_ddp_replica.py"), group], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.ready = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            ok = self.ready.get(timeout=120)
        except queue.Empty:
            raise AssertionError("%s: not ready in 120s; its stderr:\n%s" % (group, self.stderr()))
        assert ok, "%s exited: %s" % (group, self.stderr())
        self.pending = False


@needs_torch
def test_ft_ddp_kill_commit_restart_heal():
    with ftcomm.coordinator.serve(log_level="off") as co:
        env = child_env(FTCOMM_CREDENTIALS=co.credentials, FTCOMM_SECRET="pytest-ft-ddp")
        out, seen = queue.Queue(), {}
        reps = [DDPReplica("r%d" % i, env, out) for i in range(2)]
        try:
            full = lambda res: all(x["committed"] and x["participants"] == 2 for x in res)
            steps(reps, out, full, seen)
            reps[1].p.send_signal(signal.SIGKILL)
            reps[1].p.wait()
            t0 = time.monotonic()
            steps(reps[:1], out, lambda res: res[0]["committed"] and res[0]["participants"] == 1, seen)
            after_kill = time.monotonic() - t0
            reps[1] = DDPReplica("r1", env, out)
            healed = []

            def joined(res):
                healed.append("healed" in res[1]["events"])
                return full(res)

            steps(reps, out, joined, seen)
            assert any(healed), "the restarted replica did not heal"
            res = steps(reps, out, lambda res: full(res) and len({x["step"] for x in res}) == 1, seen)
            assert len({(x["step"], x["state"]) for x in res}) == 1, res
            print("survivor committed %.2fs after the kill" % after_kill)
        finally:
            for r in reps:
                r.stop()
