"""ftcomm.ft.Comm across replica processes with an in-process coordinator:
one replica SIGKILLed, the survivors commit without it, its restart heals
from them, and every replica ends with the same state."""

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import ftcomm
import ftcomm.coordinator
from conftest import child_env, needs_torch

HERE = os.path.dirname(os.path.abspath(__file__))


class Replica:
    def __init__(self, group, env):
        self.group = group
        # stderr to a file: a pipe nobody reads would block the replica
        # once its logs filled it.
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "ft_replica.py"), group], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next(60).get("ready"), self.group

    def _read(self):
        for line in self.p.stdout:
            self.q.put(json.loads(line))
        self.q.put(None)

    def next(self, timeout=60):
        try:
            v = self.q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("%s: no answer in %ss; its stderr:\n%s" % (self.group, timeout, self.stderr()))
        if v is None:
            raise AssertionError("%s exited: %s" % (self.group, self.stderr()))
        return v

    def stderr(self):
        self.err.seek(0)
        return self.err.read()[-4000:]

    def step(self):
        self.p.stdin.write("step\n")
        self.p.stdin.flush()

    def stop(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
            except OSError:
                pass
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def steps(reps, until, limit=40):
    """Step every replica until until(results) holds; returns the last results."""
    for _ in range(limit):
        for r in reps:
            r.step()
        res = [r.next() for r in reps]
        if until(res):
            return res
    raise AssertionError("condition not reached in %d steps: %s" % (limit, res))


@needs_torch
def test_kill_commit_restart_heal():
    with ftcomm.coordinator.serve(log_level="off") as co:
        env = child_env(FTCOMM_CREDENTIALS=co.credentials, FTCOMM_SECRET="pytest-secret")
        reps = [Replica("r%d" % i, env) for i in range(3)]
        try:
            full = lambda res: all(x["committed"] and x["participants"] == 3 for x in res)
            steps(reps, full)
            reps[2].p.send_signal(signal.SIGKILL)
            reps[2].p.wait()
            t0 = time.monotonic()
            res = steps(reps[:2], lambda res: all(x["committed"] and x["participants"] == 2 for x in res))
            after_kill = time.monotonic() - t0
            assert res[0]["state"] == res[1]["state"] and res[0]["step"] == res[1]["step"]
            reps[2] = Replica("r2", env)
            healed = []

            def joined(res):
                healed.extend("healed" in x["events"] for x in res[2:])
                return full(res)

            res = steps(reps, joined)
            assert any(healed), "the restarted replica did not heal"
            res = steps(reps, full)
            assert len({(x["step"], x["state"]) for x in res}) == 1, res
            print("survivors committed %.2fs after the kill" % after_kill)
        finally:
            for r in reps:
                r.stop()


def test_interrupt_ends_a_step_waiting_for_its_quorum():
    """A step that waits for a quorum (too few replicas) ends at once when
    another thread calls ftcomm.interrupt()."""
    import ftcomm.ft
    with ftcomm.coordinator.serve(log_level="off") as co:
        with ftcomm.ft.Comm(job="pytest-intr", group="r0", min_replicas=2, credentials=co.credentials,
                            secret="s", log_level="off") as c:
            def interrupt_when_blocked():
                deadline = time.monotonic() + 30
                while ftcomm._lib.blocked_calls() == 0 and time.monotonic() < deadline:
                    time.sleep(0.001)
                ftcomm.interrupt()

            t = threading.Thread(target=interrupt_when_blocked)
            t.start()
            t0 = time.monotonic()
            with pytest.raises(ftcomm.InterruptedOpError):
                c.step(timeout=60)
            assert time.monotonic() - t0 < 30
            t.join()
