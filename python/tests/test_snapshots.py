"""Peer snapshots and slot spares through Python (ftcomm.ft.Comm's
snapshot_every and group_rank=ANY_RANK, ftcomm.ft_torch.protect_shards): a
replica group of three rank processes with no replica (snapshot_rank.py),
each holding a state of its own that every committed step changes by a
function of the step and the rank, so the test knows what each state must
be at every step.

What holds: a rank SIGKILLed is replaced by a slot spare that restores its
state from the buddy's copy while the survivors roll back to the same
snapshot, and every state any rank committed — before, during and after —
is the one of the run without the failure, bit for bit (register_stateful's
objects included); when a rank and its buddy die together every rank of the
group fails with SnapshotLostError and keeps the state it committed; wrong
arguments are refused before anything registers."""

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
import ftcomm.ft
from conftest import child_env, needs_torch

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE = 3  # ranks of the group; on one host rank r's copy is held by rank r+1 mod 3


class Rank:
    """A snapshot_rank.py process (slot "any": a slot spare). Its lines go
    to the job's queue as (Rank, message); None when it ended."""

    def __init__(self, slot, env, out):
        self.slot = slot
        self.err = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads would fill
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "snapshot_rank.py"), str(slot)], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.out = out
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.out.put((self, json.loads(line)))
        self.out.put((self, None))

    def stderr(self):
        self.err.seek(0)
        return self.err.read()[-3000:]

    def kill(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def stop(self):
        """Close its stdin (it exits at once), or kill it."""
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
            except OSError:
                pass
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class Job:
    """The rank processes of one job and everything they said."""

    def __init__(self, co, every, **env):
        self.env = child_env(FTCOMM_CREDENTIALS=co.credentials, FTCOMM_SECRET="pytest-snapshots",
                             FTCOMM_TEST_JOB="pytest-snap-%d-%d" % (os.getpid(), time.monotonic_ns()),
                             FTCOMM_TEST_EVERY=str(every), FTCOMM_TEST_GROUP_SIZE=str(SIZE), OMP_NUM_THREADS="1",
                             **env)
        self.out = queue.Queue()
        self.ranks = []
        self.log = []
        self.failed = set()  # ranks that reported an error

    def start(self, slot):
        r = Rank(slot, self.env, self.out)
        self.ranks.append(r)
        return r

    def wait(self, what, cond, timeout=90, errors=False):
        """The first message from now on for which cond(rank, msg) holds.
        A rank that ends unkilled fails, and so does an error it reports,
        unless errors (then a rank may end after its error)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                r, m = self.out.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("%s: not within %ss; last messages %s; stderr:\n%s" % (
                    what, timeout, self.log[-6:], "\n".join("%s: %s" % (x.slot, x.stderr()) for x in self.ranks)))
            if m is None:
                if r.p.wait() != -signal.SIGKILL and not (errors and r in self.failed):
                    raise AssertionError("rank %s ended (%s) while waiting for %s: %s" % (
                        r.slot, r.p.returncode, what, r.stderr()))
                continue
            self.log.append(m)
            if m["kind"] == "error":
                if not errors:
                    raise AssertionError("%s: %s" % (what, m))
                self.failed.add(r)
            if cond(r, m):
                return r, m

    def every_rank_at(self, step):
        """Wait until every rank has committed step or later; returns each
        rank's step then (slot -> step)."""
        at = {}
        self.wait("every rank at step %d" % step, lambda r, m: m["kind"] == "" and at.update({r.slot: m["step"]}) is None
                  and len(at) == SIZE and min(at.values()) >= step)
        return at

    def commits(self):
        return [m for m in self.log if m["kind"] == ""]

    def check_states(self):
        """Every commit any rank reported holds the state of the run
        without failures at that step, bit for bit."""
        while True:  # what came after the last wait
            try:
                _, m = self.out.get_nowait()
            except queue.Empty:
                break
            if m is not None:
                self.log.append(m)
        from snapshot_rank import RankState
        top = max(m["step"] for m in self.commits())
        want = [RankState.replay(s, top) for s in range(SIZE)]
        wrong = [m for m in self.commits() if m["digest"] != want[int(m["id"].split(".")[1])][m["step"]]]
        assert not wrong, "commits whose state differs from the run without failures: %s" % wrong[:5]
        assert self.commits()

    def close(self):
        for r in self.ranks:
            r.stop()


@pytest.fixture(scope="module")
def coord():
    with ftcomm.coordinator.serve(log_level="off") as co:
        yield co


@needs_torch
def test_slot_spare_restores_the_dead_ranks_state_and_the_survivors_roll_back(coord):
    every = 4
    job = Job(coord, every)
    try:
        for s in range(SIZE):
            job.start(s)
        spare = job.start("any")
        job.every_rank_at(3 * every)
        victim = job.ranks[1]
        victim.kill()
        t0 = time.time()
        r, claimed = job.wait("the spare to take the place", lambda r, m: m["kind"] == "claimed")
        assert r is spare and claimed["id"] == "fsdp.1" and not claimed["spare"], claimed

        restored, rollbacks = {}, {}

        def back(r, m):
            if m["kind"] == "restored":
                restored[m["id"]] = m
            if m["kind"] == "rollback":
                rollbacks[m["id"]] = m
            return len(restored) == SIZE and m["kind"] == "" and m["t"] > t0
        _, first = job.wait("every rank to restore and the group to commit", back)
        steps = {m["step"] for m in restored.values()}
        assert len(steps) == 1, "the ranks restored different steps: %s" % restored
        step = steps.pop()
        last = max(m["step"] for m in job.commits() if m["id"] != "fsdp.1" and m["t"] < t0)
        # The newest complete snapshot: a snapshot step, before the
        # survivors' last commit (how far before depends on the copies'
        # pace: the group skips snapshot steps while one is in flight).
        assert step % every == 0 and step < last, "restored step %d: want a snapshot step (every %d) before %d" % (
            step, every, last)
        from snapshot_rank import RankState
        assert restored["fsdp.1"]["bytes"] == RankState(1).nbytes(), "the spare did not restore its whole state " \
            "from the buddy: %s" % restored["fsdp.1"]
        assert all(restored[i]["bytes"] == 0 for i in ("fsdp.0", "fsdp.2")), "survivors restore their own copy"
        # The survivors had committed past the snapshot: they roll back to it.
        assert set(rollbacks) == {"fsdp.0", "fsdp.2"}, rollbacks
        for m in rollbacks.values():
            assert m["snapshot"] and m["step"] == step and m["to_step"] > step, m
            assert m["counter"] == step, "register_stateful's object was not reloaded: %s" % m

        # The group trains on at full size.
        done = set()
        job.wait("every rank 2 snapshots past the restore", lambda r, m: m["kind"] == ""
                 and m["step"] >= step + 2 * every and done.add(m["id"]) is None and len(done) == SIZE)
        print("kill → group committing again %.2f s; restored step %d (the survivors were at %d)" % (
            first["t"] - t0, step, last))
    finally:
        job.close()
    job.check_states()


@needs_torch
def test_shard_group_fails_the_step_and_follows_the_epochs(coord):
    """ftcomm.ft_torch.ShardGroup (FSDP's process group with no replica):
    every step runs torch.distributed's collectives over it (snapshot_rank
    ShardOps). A rank SIGKILLed: the survivors' ops of that step do not
    raise, the group's state says why, and the step does not commit; the
    group then runs on ft's group comm of the new epoch, the slot spare in
    the dead rank's place, and every result of a committed step is right
    (a rank reports an error otherwise, which fails the wait)."""
    every = 3
    job = Job(coord, every, FTCOMM_TEST_SHARD_OPS="1")
    try:
        for s in range(SIZE):
            job.start(s)
        spare = job.start("any")
        at = job.every_rank_at(2 * every)
        assert all(m["ops"] for m in job.commits())
        job.ranks[2].kill()
        t0 = time.time()
        failed = {}
        done = set()

        def trains_on(r, m):
            if m["kind"] == "ops_failed":
                failed[m["id"]] = m
            if m["kind"] == "" and m["t"] > t0 and m["step"] >= max(at.values()) + 2 * every:
                done.add(m["id"])
            return len(done) == SIZE
        job.wait("the group with the spare 2 snapshots past the kill", trains_on)
        assert spare.slot == "any" and any(m["id"] == "fsdp.2" and m["t"] > t0 for m in job.commits())
        # A survivor whose ops of the step met the death says what failed
        # them (not every survivor need: its ops may have completed before).
        assert failed, "no survivor's op failed: the kill came between steps"
        for m in failed.values():
            assert m["id"] in ("fsdp.0", "fsdp.1") and m["cls"] in (
                "PeerFailedError", "RevokedError", "ClosedError", "AbortedError", "CommTimeoutError",
                "PeerRefusedError"), m
        print("ops failed for the kill: %s" % {k: v["cls"] for k, v in failed.items()})
    finally:
        job.close()
    job.check_states()


@needs_torch
def test_a_rank_and_its_buddy_lost_together_fail_every_rank(coord):
    every = 3
    job = Job(coord, every)
    try:
        for s in range(SIZE):
            job.start(s)
        job.every_rank_at(4 * every)
        survivor = job.ranks[0]
        # Rank 1 and the rank that holds its copy (2) die together; their
        # processes restart. (Restarts, not two slot spares: a spare that
        # loses the race for the first place waits for a vacancy to come,
        # and the second place was free before it looked again.)
        job.ranks[1].kill()
        job.ranks[2].kill()
        restarted = [job.start(1), job.start(2)]
        failed = {}

        def every_rank_failed(r, m):
            assert m["kind"] != "restored", "%s restored step %d with slot 1's copies gone" % (m["id"], m["step"])
            if m["kind"] == "error":
                failed[r] = m
            return len(failed) == SIZE
        job.wait("every rank to fail", every_rank_failed, errors=True)
        assert set(failed) == {survivor} | set(restarted)
        for m in failed.values():
            assert m["cls"] == "SnapshotLostError" and "snapshot_lost" in m["kinds"], m
            assert "ranks [1]" in m["err"], m["err"]
        # The survivor keeps the state of its last commit.
        mine = [m for m in job.commits() if m["id"] == "fsdp.0"]
        assert failed[survivor]["step"] == mine[-1]["step"] and failed[survivor]["digest"] == mine[-1]["digest"]
    finally:
        job.close()
    job.check_states()


@needs_torch
def test_arguments_are_checked(coord):
    import torch
    from ftcomm.ft_torch import protect_shards

    kw = dict(job="pytest-snap-args-%d" % os.getpid(), credentials=coord.credentials, secret="s", log_level="off")
    with pytest.raises(ftcomm.InvalidArgumentError, match="needs spare=True"):
        ftcomm.ft.Comm(group="g", group_rank=ftcomm.ft.ANY_RANK, group_size=3, **kw)
    with pytest.raises(ftcomm.InvalidArgumentError, match="snapshot_every 5 with group_size 1"):
        ftcomm.ft.Comm(group="g", snapshot_every=5, **kw)
    with pytest.raises(ftcomm.InvalidArgumentError, match="GroupSize > 1"):  # Go's check
        ftcomm.ft.Comm(group="g", group_rank=ftcomm.ft.ANY_RANK, spare=True, **kw)
    with pytest.raises(ftcomm.InvalidArgumentError, match="DurableCommit"):
        ftcomm.ft.Comm(group="g", group_size=2, snapshot_every=5, durable_commit=True, **kw)
    with pytest.raises(ftcomm.InvalidTypeError):
        ftcomm.ft.Comm(group="g", group_size=2, snapshot_every=2.5, **kw)
    with pytest.raises(ftcomm.InvalidArgumentError, match="group_backend 'mpi'"):
        ftcomm.ft.Comm(group="g", group_size=2, group_backend="mpi", **kw)
    with ftcomm.ft.Comm(group="solo", **kw) as c:
        with pytest.raises(ftcomm.InvalidArgumentError, match="group has 1 rank"):
            protect_shards(c, tensors={"x": torch.zeros(4)})
        with pytest.raises(ftcomm.InvalidArgumentError, match="no group comm"):
            c.group_comm()
        from ftcomm.ft_torch import ShardGroup
        with pytest.raises(ftcomm.InvalidArgumentError, match="nothing to shard over"):
            ShardGroup(c)
    with ftcomm.ft.Comm(group="off", group_rank=1, group_size=2, **kw) as c:
        assert (c.group_rank, c.group_size, c.snapshot_every) == (1, 2, 0)
        with pytest.raises(ftcomm.InvalidArgumentError, match="snapshot_every=K"):
            protect_shards(c, tensors={"x": torch.zeros(4)})
    with ftcomm.ft.Comm(group="on", group_rank=1, group_size=2, snapshot_every=4, **kw) as c:
        assert (c.group_rank, c.snapshot_every, c.spare) == (1, 4, False)
        m = torch.nn.Linear(2, 2)
        with pytest.raises(ftcomm.InvalidTypeError):
            protect_shards(c, tensors={"x": [1.0]})
        names = protect_shards(c, m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                               stateful={"pos": Counter()}, tensors={"flat": torch.zeros(8)})
        assert names == ["param/weight", "param/bias", "optim/weight/momentum_buffer", "optim/bias/momentum_buffer",
                         "tensor/flat", "ftcomm.stateful/pos"], names


class Counter:
    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


def test_a_slot_spare_waits_in_comm_until_interrupted(coord):
    """A slot spare's Comm() waits for a place (unbounded) and ends at
    ftcomm.interrupt()."""
    def interrupt_when_blocked():
        deadline = time.monotonic() + 30
        while ftcomm._lib.blocked_calls() == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # polls the library's state: nothing to wait on
        ftcomm.interrupt()

    t = threading.Thread(target=interrupt_when_blocked)
    t.start()
    try:
        with pytest.raises(ftcomm.InterruptedOpError):
            ftcomm.ft.Comm(job="pytest-snap-wait-%d" % os.getpid(), group="g", group_rank=ftcomm.ft.ANY_RANK,
                           group_size=2, spare=True, snapshot_every=2, credentials=coord.credentials, secret="s",
                           log_level="off")
    finally:
        t.join()


def test_group_comm_is_the_groups_and_released_at_close(coord):
    """group_comm() between step and commit: the replica group's comm
    (rank group_rank of group_size, the same object within an epoch); the
    Comm's close releases the handle it gave out (ft closes the comm)."""
    from ftcomm import _lib
    kw = dict(job="pytest-groupcomm-%d" % os.getpid(), group="g", group_size=2, credentials=coord.credentials,
              secret="s", min_replicas=1, log_level="off")
    comms, got, errs = [None, None], [None, None], []

    def run(r, f):
        try:
            f(r)
        except Exception as e:  # noqa: B902 - reported below
            errs.append(e)

    def make(r):
        comms[r] = ftcomm.ft.Comm(group_rank=r, **kw)

    def step(r):
        c = comms[r]
        c.step()
        got[r] = c.group_comm()
        assert c.group_comm() is got[r]
        c.commit()

    for f in (make, step):
        ts = [threading.Thread(target=run, args=(r, f)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errs, errs
    assert [(g.get_rank(), g.get_size()) for g in got] == [(0, 2), (1, 2)]
    # ft reconfigures its comm itself: a shrink or a split of it is refused
    # before anything happens (the peer takes no part).
    with pytest.raises(ftcomm.InvalidArgumentError, match="ft's group comm"):
        got[0].shrink([1])
    with pytest.raises(ftcomm.InvalidArgumentError, match="ft's group comm"):
        got[1].split([1])
    live = _lib.live_handles()
    for c in comms:
        c.close()
    assert all(g._h is None for g in got)
    assert _lib.live_handles() == live - 4  # two ft handles and the two group comms' handles
