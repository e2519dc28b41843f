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
    """A replica process (script: ft_replica.py, or one of its protocol).
    Its step results go to the test's shared queue (out): replicas step on
    their own, as training loops do, so that one replica's reconfiguration
    never waits for another the test holds back."""

    def __init__(self, group, env, out, script="ft_replica.py"):
        self.group = group
        self.out = out
        # stderr to a file: a pipe nobody reads would block the replica
        # once its logs filled it.
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, script), group], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.ready = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            ok = self.ready.get(timeout=60)
        except queue.Empty:
            raise AssertionError("%s: not ready in 60s; its stderr:\n%s" % (group, self.stderr()))
        assert ok, "%s exited: %s" % (group, self.stderr())
        self.pending = False

    def _read(self):
        for line in self.p.stdout:
            msg = json.loads(line)
            if msg.get("ready"):
                self.ready.put(True)
            else:
                self.out.put((self, msg))
        self.ready.put(False)
        self.out.put((self, None))

    def stderr(self):
        self.err.seek(0)
        return self.err.read()[-4000:]

    def step(self, cmd="step"):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        self.pending = True

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


def steps(reps, out, until, seen, timeout=120):
    """Keep every replica of reps stepping until until(latest results) holds;
    returns the latest results. seen maps (step) -> state of every commit, and
    a step committed with two states fails the test."""
    latest = {r: None for r in reps}
    deadline = time.monotonic() + timeout
    while True:
        for r in reps:
            if not r.pending:
                r.step()
        try:
            r, msg = out.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError("condition not reached in %ss: %s; stderr:\n%s" % (
                timeout, [latest[r] for r in reps], "\n".join(r.group + ": " + r.stderr() for r in reps)))
        if msg is None:
            if r in latest:
                raise AssertionError("%s exited: %s" % (r.group, r.stderr()))
            continue  # a replica the test killed
        r.pending = False
        if r not in latest:
            continue  # the answer of a replica no longer stepping here
        latest[r] = msg
        if msg["committed"]:
            prev = seen.setdefault(msg["step"], msg["state"])
            assert prev == msg["state"], "step %d committed with two states: %s" % (msg["step"], msg)
        res = [latest[r] for r in reps]
        if all(x is not None for x in res) and until(res):
            return res


@needs_torch
def test_kill_commit_restart_heal():
    with ftcomm.coordinator.serve(log_level="off") as co:
        env = child_env(FTCOMM_CREDENTIALS=co.credentials, FTCOMM_SECRET="pytest-secret")
        out, seen = queue.Queue(), {}
        reps = [Replica("r%d" % i, env, out) for i in range(3)]
        try:
            full = lambda res: all(x["committed"] and x["participants"] == 3 for x in res)
            steps(reps, out, full, seen)
            reps[2].p.send_signal(signal.SIGKILL)
            reps[2].p.wait()
            t0 = time.monotonic()
            steps(reps[:2], out, lambda res: all(x["committed"] and x["participants"] == 2 for x in res), seen)
            after_kill = time.monotonic() - t0
            reps[2] = Replica("r2", env, out)
            healed = []

            def joined(res):
                healed.append("healed" in res[2]["events"])
                return full(res)

            steps(reps, out, joined, seen)
            assert any(healed), "the restarted replica did not heal"
            res = steps(reps, out, lambda res: full(res) and len({x["step"] for x in res}) == 1, seen)
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
