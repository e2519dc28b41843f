"""ft.Comm.fail_step: a training loop fails its step for a reason found
outside ft (a NaN loss, its own shard communicator failing). No replica
commits that step, and the job goes on committing, the step redone; outside
a started step fail_step is refused and changes nothing."""

import queue

import pytest

import ftcomm
import ftcomm.coordinator
import ftcomm.ft
from conftest import child_env, needs_torch
from test_ft import Replica


def test_fail_step_outside_a_step_is_refused():
    with ftcomm.coordinator.serve(log_level="off") as co:
        c = ftcomm.ft.Comm(job="pytest-fail-step-misuse", group="r0", min_replicas=1, credentials=co.credentials,
                           secret="s", log_level="off", timeout=10)
        try:
            with pytest.raises(ftcomm.InvalidArgumentError):
                c.fail_step("before the step")
            c.step(timeout=30)
            assert c.commit(timeout=30), "the refused fail_step failed the next step"
            with pytest.raises(ftcomm.InvalidArgumentError):
                c.fail_step("after the commit")

            c.step(timeout=30)
            c.fail_step("loss is NaN")
            assert not c.commit(timeout=30)
            failed = [e for e in c.events() if e.kind == "commit failed"]
            assert failed and "loss is NaN" in failed[-1].text, failed
            committed = c.committed_step
            for _ in range(5):  # the next step is a new epoch's
                c.step(timeout=30)
                if c.commit(timeout=30):
                    break
            assert c.committed_step == committed + 1
        finally:
            c.close()
        with pytest.raises(ftcomm.ClosedError):
            c.fail_step("after close")


def lockstep(reps, out, cmds):
    """One step at every replica (cmds[i] for reps[i]); their results."""
    for r, cmd in zip(reps, cmds):
        r.step(cmd)
    got = {}
    while len(got) < len(reps):
        try:
            r, msg = out.get(timeout=60)
        except queue.Empty:
            raise AssertionError("no result in 60s; stderr:\n" + "\n".join(r.group + ": " + r.stderr() for r in reps))
        assert msg is not None, "%s exited: %s" % (r.group, r.stderr())
        r.pending = False
        got[r] = msg
    return [got[r] for r in reps]


@needs_torch
def test_fail_step_at_one_replica_fails_it_at_every_replica():
    with ftcomm.coordinator.serve(log_level="off") as co:
        env = child_env(FTCOMM_CREDENTIALS=co.credentials, FTCOMM_SECRET="pytest-secret")
        out = queue.Queue()
        reps = [Replica("r%d" % i, env, out) for i in range(2)]
        try:
            for _ in range(20):
                res = lockstep(reps, out, ["step", "step"])
                if all(x["committed"] and x["participants"] == 2 for x in res):
                    break
            else:
                raise AssertionError("the replicas never committed together: %s" % res)
            before = res[0]["step"]
            assert res[1]["step"] == before

            # r0's loop finds a NaN before the gradient's all-reduce: neither
            # replica commits the step; r0's all-reduce after fail_step fails
            # at once, r1's for want of r0's part.
            failed = lockstep(reps, out, ["fail", "step"])
            assert [x["committed"] for x in failed] == [False, False], failed
            assert [x["step"] for x in failed] == [before, before], failed
            assert "revoked" in failed[0]["after_fail_step"], failed[0]
            assert "commit failed" in failed[0]["events"] and "commit failed" in failed[1]["events"], failed

            # The job goes on: the step is redone, in a new epoch, with one
            # state and no NaN in it.
            for _ in range(10):
                res = lockstep(reps, out, ["step", "step"])
                if all(x["committed"] for x in res):
                    break
            else:
                raise AssertionError("no step committed at both replicas after the failed one: %s" % res)
            assert [x["step"] for x in res] == [before + 1, before + 1], res
            assert res[0]["state"] == res[1]["state"] and res[0]["finite"] and res[1]["finite"], res
            assert res[0]["epoch"] > failed[0]["epoch"], (failed, res)
        finally:
            for r in reps:
                r.stop()
