"""Spares through the Python API (ftcomm.ft.Comm(spare=True)): two replica
processes and a spare. The spare's first step waits while the job is at its
target size; a replica is SIGKILLed; the spare is promoted ("promoted"
event), heals from the survivor and the job commits at full size again with
the survivor's state. The spare commits nothing before its promotion."""

import queue
import signal
import time

import ftcomm
import ftcomm.coordinator
from conftest import child_env, needs_torch
from test_ft import Replica


def drive(reps, out, until, seen, timeout=120):
    """Keep each replica of reps stepping (one step in flight each) until
    until(replica, msg) holds for a message; every message goes to seen
    (step -> state of its commits: two states for one step fail)."""
    deadline = time.monotonic() + timeout
    while True:
        for r in reps:
            if not r.pending:
                r.step()
        try:
            r, msg = out.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError("condition not reached in %ss; stderr:\n%s" % (
                timeout, "\n".join(x.group + ": " + x.stderr() for x in reps)))
        if msg is None:
            if r in reps:
                raise AssertionError("%s exited: %s" % (r.group, r.stderr()))
            continue  # the replica the test killed
        r.pending = False
        r.msgs.append(msg)
        if msg["committed"]:
            prev = seen.setdefault(msg["step"], msg["state"])
            assert prev == msg["state"], "step %d committed with two states: %s" % (msg["step"], msg)
        if until(r, msg):
            return


@needs_torch
def test_spare_takes_the_dead_replicas_place():
    with ftcomm.coordinator.serve(log_level="off") as co:
        env = child_env(FTCOMM_CREDENTIALS=co.credentials, FTCOMM_SECRET="pytest-secret",
                        FTCOMM_TEST_MIN_REPLICAS="1")
        out, seen = queue.Queue(), {}
        reps = [Replica("r0", env, out), Replica("r1", env, out),
                Replica("s2", dict(env, FTCOMM_TEST_SPARE="1"), out)]
        for r in reps:
            r.msgs = []
        r0, r1, spare = reps
        try:
            # The job at its target (2): the replicas commit together, the
            # spare's first step waits.
            full2 = {"r0": 0, "r1": 0}

            def at_target(r, msg):
                assert r is not spare, "the spare's step returned while the job was at its target: %s" % msg
                if msg["committed"] and msg["participants"] == 2:
                    full2[r.group] += 1
                return min(full2.values()) >= 5

            drive(reps, out, at_target, seen)
            assert spare.pending and not spare.msgs

            r1.p.send_signal(signal.SIGKILL)
            t0 = time.time()
            r1.p.wait()
            figures = {}

            def back_to_full(r, msg):
                if r is r0 and msg["committed"] and msg["participants"] == 1:
                    figures.setdefault("survivor", msg["t"] - t0)
                if r is spare and msg["committed"] and msg["participants"] == 2:
                    figures.setdefault("full", msg["t"] - t0)
                return "full" in figures and r0.msgs[-1]["participants"] == 2 and r0.msgs[-1]["committed"]

            drive([r0, spare], out, back_to_full, seen)
            first = spare.msgs[0]
            assert first["t"] > t0, "the spare stepped before the death: %s" % first
            assert "promoted" in first["events"], "the spare's first step lacks its promotion: %s" % first
            assert "healed" in first["events"], "the promoted spare did not heal: %s" % first
            assert not spare.msgs[-1]["spare"] and first["epoch"] > 0
            # Both at full size with one state, the same step.
            drive([r0, spare], out, lambda r, m: (r0.msgs[-1]["step"] == spare.msgs[-1]["step"]
                                                  and r0.msgs[-1]["committed"] and spare.msgs[-1]["committed"]
                                                  and r0.msgs[-1]["participants"] == 2
                                                  and spare.msgs[-1]["participants"] == 2), seen)
            assert r0.msgs[-1]["state"] == spare.msgs[-1]["state"]
            print("SIGKILL of r1, one spare: survivor's next commit %s, capacity back (first commit at full size) "
                  "%.3f s" % ("%.3f s" % figures["survivor"] if "survivor" in figures else "none (promoted with the loss)",
                              figures["full"]))
        finally:
            for r in reps:
                r.stop()
