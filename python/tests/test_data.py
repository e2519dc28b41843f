"""The quorum-aware sampler through Python (ftcomm.ft.Sampler, the loaders,
register_stateful, OptimizerWrapper's learning-rate scaling): its API and
errors on one replica, a mismatched sampler healing from a peer, and a job
of replica processes through a refused step, the batch policy switched at
run time, a SIGKILL and a restart, whose committed steps read every sample
of every epoch exactly once."""

import json
import os
import queue
import signal
import threading
import time
import urllib.request

import pytest

import ftcomm
import ftcomm.coordinator
import ftcomm.ft
from conftest import child_env, needs_torch
from test_ft import Replica

torch = pytest.importorskip("torch")

# ---------------------------------------------------------------- the plans, as Go makes them

M64 = (1 << 64) - 1


def mix64(x):
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


class Permutation:
    """ft's epoch permutation (a Feistel network walked until it lands
    inside), written again from its definition: the tests check Go's plans
    against it."""

    def __init__(self, size, seed, epoch, sequential=False):
        self.size, self.sequential = size, sequential
        b = (size - 1).bit_length()
        b = max(b + b % 2, 2)
        self.half, self.mask = b // 2, (1 << (b // 2)) - 1
        k = mix64(seed ^ mix64((epoch + 0x9E3779B97F4A7C15) & M64))
        self.keys = []
        for i in range(6):
            k = mix64((k + i + 1) & M64)
            self.keys.append(k)

    def at(self, i):
        if self.sequential:
            return i
        x = i
        while True:
            l, r = x >> self.half, x & self.mask
            for k in self.keys:
                l, r = r, l ^ (mix64(r ^ k) & self.mask)
            x = (l << self.half) | r
            if x < self.size:
                return x


class Reference:
    """The plans of a sampler configuration (ft.Sampler's semantics)."""

    def __init__(self, size, batch, accum=1, seed=0, max_accum=None, sequential=False):
        self.size, self.batch, self.accum, self.seed = size, batch, accum, seed
        self.max_accum, self.sequential = max_accum or 4 * accum, sequential
        self.perms = {}

    def index(self, pos):
        e = pos // self.size
        if e not in self.perms:
            self.perms[e] = Permutation(self.size, self.seed, e, self.sequential)
        return self.perms[e].at(pos % self.size)

    def slot(self, position, participants, target, policy, slot, group_size=1):
        """The micro-batches (index lists) of rank slot ``slot`` and the step's samples."""
        p, g, t = participants, group_size, max(target, 1)
        full = t * g * self.accum * self.batch
        if policy == "global":
            per = min(max(full // (p * g), 1), self.max_accum * self.batch)
        else:
            per = self.accum * self.batch
        samples, k = per * p * g, -(-per // self.batch)
        off, n = slot * per, per
        ids = [self.index(position + off + i) for i in range(n)]
        micro = []
        for m in range(k):
            lo, hi = m * n // k, (m + 1) * n // k
            micro.append(ids[lo:hi])
        return micro, samples


def test_reference_permutation_is_a_bijection():
    for size in (1, 2, 3, 7, 64, 65, 200, 1000):
        for epoch in (0, 1):
            p = Permutation(size, 7, epoch)
            assert sorted(p.at(i) for i in range(size)) == list(range(size))


# ---------------------------------------------------------------- one replica

@pytest.fixture(scope="module")
def coord():
    with ftcomm.coordinator.serve(log_level="off") as co:
        yield co


_jobs = iter(range(1 << 30))


def solo(co, **kw):
    """A job of one replica that commits on its own."""
    return ftcomm.ft.Comm(job="pytest-data-%d-%d" % (os.getpid(), next(_jobs)), group="r0", min_replicas=1,
                          credentials=co.credentials, secret="s", log_level="off", **kw)


def refuse_step(c):
    """Fail the step: an op this replica refuses is recorded for the commit."""
    with pytest.raises(ftcomm.InvalidArgumentError):
        c.all_reduce(torch.zeros(1, dtype=torch.bool), ftcomm.ReduceOp.AVG)


@needs_torch
def test_plans_read_each_epoch_once_and_a_failed_step_gives_its_samples_back(coord):
    with solo(coord) as c:
        s = ftcomm.ft.Sampler(c, size=37, batch=4, accum=2, seed=5)
        ref = Reference(37, 4, 2, seed=5)
        assert (s.position, s.epoch) == (0, 0)
        with pytest.raises(ftcomm.NoStepError):
            s.plan()
        read = []
        for i in range(12):
            c.step()
            p = s.plan()
            assert p is s.plan(), "the step's plan is computed once"
            assert (p.step, p.position, p.samples, p.participants, p.policy) == (i + 1, 8 * i, 8, 1, "replica")
            assert p.epoch == p.position // 37 and p.lr_scale == 1.0
            assert [m.indices for m in p.micro] == ref.slot(p.position, 1, p.target, "replica", 0)[0]
            assert [m.weight for m in p.micro] == [0.5, 0.5]
            assert all(type(i) is int for i in p.indices)
            if i == 4:
                refuse_step(c)
                assert not c.commit()
                assert s.position == p.position, "a failed step advanced the position"
                with pytest.raises(ftcomm.NoStepError):
                    s.plan()
                c.step()
                again = s.plan()
                assert (again.step, again.position, again.indices) == (p.step, p.position, p.indices)
            read += p.indices
            assert c.commit()
            assert s.position == 8 * (i + 1)
        with pytest.raises(ftcomm.NoStepError):
            s.plan()
        # Epochs 0 and 1 whole, each sample once; epoch 2 begun, none twice.
        assert sorted(read[:37]) == list(range(37)) and sorted(read[37:74]) == list(range(37))
        assert len(set(read[74:])) == len(read[74:]) and s.epoch == 2
        assert read[:37] != list(range(37)), "not shuffled"


@needs_torch
def test_bad_settings_raise_and_register_nothing(coord):
    with solo(coord) as c:
        bad = [
            (dict(size=0, batch=1), ftcomm.InvalidArgumentError, "size 0"),
            (dict(size=10, batch=0), ftcomm.InvalidArgumentError, "batch 0"),
            (dict(size="10", batch=1), ftcomm.InvalidTypeError, "size '10'"),
            (dict(size=10, batch=1.5), ftcomm.InvalidTypeError, "batch 1.5"),
            (dict(size=10, batch=True), ftcomm.InvalidTypeError, "batch True"),
            (dict(size=10, batch=1, seed=-1), ftcomm.InvalidArgumentError, "seed -1"),
            (dict(size=10, batch=1, policy="sometimes"), ftcomm.InvalidArgumentError, "policy 'sometimes'"),
            (dict(size=10, batch=1, accum=4, max_accum=2), ftcomm.InvalidArgumentError, "MaxAccum 2 is below Accum 4"),
            (dict(size=10, batch=1, position=-1), ftcomm.InvalidArgumentError, "position -1"),
            (dict(size=10, batch=1, name=3), ftcomm.InvalidTypeError, "name 3"),
            (dict(size=10, batch=1, seed=1 << 64), ftcomm.InvalidArgumentError, "seed"),
        ]
        for kw, cls, says in bad:
            with pytest.raises(cls) as e:
                ftcomm.ft.Sampler(c, **kw)
            assert says in str(e.value), (kw, str(e.value))
        s = ftcomm.ft.Sampler(c, size=10, batch=2, position=25)  # "data" was not taken
        assert (s.position, s.epoch) == (25, 2)
        with pytest.raises(ftcomm.InvalidArgumentError, match="registered twice"):
            ftcomm.ft.Sampler(c, size=10, batch=2)
        c.step()
        with pytest.raises(ftcomm.InvalidArgumentError, match="after the first Step"):
            ftcomm.ft.Sampler(c, size=10, batch=2, name="late")
        assert s.plan().position == 25
        assert c.commit()
        s.close()
        s.close()
        with pytest.raises(ftcomm.ClosedError):
            s.plan()
    with pytest.raises(ftcomm.FtcommError, match="closed"):
        ftcomm.ft.Sampler(c, size=10, batch=2)


class Dataset:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)])


@needs_torch
def test_loaders_yield_the_steps_micro_batches(coord):
    with solo(coord) as c:
        s = ftcomm.ft.Sampler(c, size=50, batch=3, accum=3, seed=2)
        ds = Dataset(50)
        dl = torch.utils.data.DataLoader(ds, batch_sampler=ftcomm.ft.BatchSampler(s))
        step_loader = ftcomm.ft.StepLoader(ds, s)
        workers = ftcomm.ft.StepLoader(ds, s, num_workers=1)
        assert isinstance(dl.batch_sampler, torch.utils.data.Sampler)
        with pytest.raises(ftcomm.NoStepError):
            list(step_loader)
        for _ in range(3):
            c.step()
            p = s.plan()
            want = [m.indices for m in p.micro]
            assert [b.flatten().long().tolist() for b in dl] == want
            got = list(step_loader)
            assert [b.flatten().long().tolist() for b, _ in got] == want
            assert [w for _, w in got] == [m.weight for m in p.micro]
            assert [(b.flatten().long().tolist(), w) for b, w in workers] == [(b.flatten().long().tolist(), w)
                                                                            for b, w in got]
            assert c.commit()
        del workers


class Counter:
    def __init__(self, blob=0):
        self.n, self.blob = 0, blob

    def state_dict(self):
        return {"n": self.n, "pad": b"x" * self.blob}

    def load_state_dict(self, sd):
        self.n = sd["n"]


@needs_torch
def test_stateful_saves_on_commit_and_rewinds_a_failed_step(coord):
    with solo(coord) as c:
        with pytest.raises(ftcomm.ft.StateCapacityError, match="over the capacity of 100"):
            ftcomm.ft.register_stateful(c, "counter", Counter(blob=200), capacity=100)
        with pytest.raises(ftcomm.InvalidTypeError):
            ftcomm.ft.register_stateful(c, "counter", object())
        obj = Counter()
        st = ftcomm.ft.register_stateful(c, "counter", obj, capacity=100)  # the failures registered nothing
        for i in range(3):
            c.step()
            obj.n += 1
            assert c.commit()
            assert st.version[0] == c.committed_step == i + 1
        c.step()
        obj.n += 1
        refuse_step(c)
        assert not c.commit()
        assert obj.n == 3 and st.loads == 1, "a failed step's state was kept"
        c.step()
        obj.n += 1
        obj.blob = 500
        with pytest.raises(ftcomm.ft.StateCapacityError) as e:
            c.commit()
        assert e.value.committed and c.committed_step == 4
        assert isinstance(e.value, ftcomm.InvalidArgumentError)
    with solo(coord) as c:
        c.step()
        with pytest.raises(ftcomm.InvalidArgumentError, match="after the first Step"):
            ftcomm.ft.register_stateful(c, "late", Counter())
        assert c._after_step == [] and c._after_commit == []


@needs_torch
def test_optimizer_wrapper_scales_the_lr_for_its_step_only(coord):
    from ftcomm.ft_torch import OptimizerWrapper
    with solo(coord) as c:
        # A job of one replica made for two: under "replica" each step reads
        # half the global batch, lr_scale 0.5.
        s = ftcomm.ft.Sampler(c, size=100, batch=2, replicas=2)
        w = torch.nn.Parameter(torch.zeros(1))
        sgd = torch.optim.SGD([w], lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
        opt = OptimizerWrapper(c, sgd, sampler=s)
        assert opt.lr_scaling == "linear"
        lrs = []
        for i in range(3):
            opt.zero_grad()
            assert opt.plan.lr_scale == 0.5 and opt.plan.samples == 2
            lr = sgd.param_groups[0]["lr"]
            lrs.append(lr)
            before = w.item()
            w.grad = torch.ones(1)
            assert opt.step()
            assert w.item() == pytest.approx(before - lr * 0.5)
            assert sgd.param_groups[0]["lr"] is lr, "the lr was not put back exactly"
            sched.step()
        assert lrs == [1.0, 0.5, 0.25], "the scheduler did not compose"
        none = OptimizerWrapper(c, sgd, sampler=s, lr_scaling="none")
        none.zero_grad()
        before, lr = w.item(), sgd.param_groups[0]["lr"]
        w.grad = torch.ones(1)
        assert none.step() and w.item() == pytest.approx(before - lr)
    with pytest.raises(ftcomm.InvalidArgumentError):
        OptimizerWrapper(c, sgd, sampler=s, lr_scaling="sqrt")
    with pytest.raises(ftcomm.InvalidArgumentError):
        OptimizerWrapper(c, sgd, lr_scaling="linear")


@needs_torch
def test_global_policy_keeps_the_global_batch(coord):
    with solo(coord) as c:
        # One replica of a job made for three: "global" takes 3 micro-batches
        # (max_accum allows 4), the global batch stays 3 × 2 samples.
        s = ftcomm.ft.Sampler(c, size=100, batch=2, policy="global", replicas=3)
        c.step()
        p = s.plan()
        assert (p.policy, p.samples, p.lr_scale, len(p.micro)) == ("global", 6, 1.0, 3)
        assert sum(m.weight for m in p.micro) == pytest.approx(1.0)
        assert c.commit()


# ---------------------------------------------------------------- a mismatched replica

@needs_torch
def test_a_replica_configured_otherwise_gets_a_mismatch(coord):
    job = "pytest-data-mismatch-%d" % os.getpid()
    stop, errs = threading.Event(), []

    def run_a(c, s):
        try:
            while not stop.is_set():
                c.step()
                s.plan()
                c.commit()
        except BaseException as e:  # noqa: B902 - the test reports it
            errs.append(e)

    with ftcomm.ft.Comm(job=job, group="a", min_replicas=1, credentials=coord.credentials, secret="s",
                        log_level="off") as a:
        sa = ftcomm.ft.Sampler(a, size=100, batch=2, seed=1)
        a.step()
        a.commit()
        t = threading.Thread(target=run_a, args=(a, sa))
        t.start()
        try:
            with ftcomm.ft.Comm(job=job, group="b", min_replicas=1, credentials=coord.credentials, secret="s",
                                log_level="off") as b:
                sb = ftcomm.ft.Sampler(b, size=100, batch=2, seed=2)  # another seed
                b.step()  # heals from a
                with pytest.raises(ftcomm.SamplerMismatchError, match='sampler "data"') as e:
                    sb.plan()
                assert isinstance(e.value, ftcomm.InvalidArgumentError) and "invalid_argument" in e.value.kinds
                b.commit()
        finally:
            stop.set()
            t.join(60)
        assert not errs, errs


# ---------------------------------------------------------------- a job of processes

SIZE = 200  # 24 samples a step at full size: an epoch ends inside a step


def post_settings(co, job, *changes):
    """`ftcoord job set` through the coordinator's API."""
    req = urllib.request.Request(co.url + "/api/v1/jobs/%s/settings" % job, method="POST",
                                 data=json.dumps({"changes": list(changes), "by": "pytest"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def drive(reps, out, until, log, cmd=lambda r: "step", timeout=60):
    """Keep each replica of reps stepping, one step in flight each, until
    until(replica, msg) holds; every message goes to log."""
    deadline = time.monotonic() + timeout
    while True:
        for r in reps:
            if not r.pending:
                r.step(cmd(r))
        try:
            r, msg = out.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError("condition not reached in %ss; last: %s; stderr:\n%s" % (
                timeout, log[-6:], "\n".join(x.group + ": " + x.stderr() for x in reps)))
        if msg is None:
            if r in reps:
                raise AssertionError("%s exited: %s" % (r.group, r.stderr()))
            continue  # the replica the test killed
        r.pending = False
        log.append(msg)
        if until(r, msg):
            return


def check_history(log, ref, group_size=1):
    """The job's committed steps: 1, 2, … with none missing, each starting
    where the one before ended, every replica that committed a step agreeing
    on it and having read its slot's share as Go's semantics make it; the
    slots of a step together read its positions; so each finished epoch is
    read exactly once and the one in progress with no sample twice.
    Returns the steps' shapes and the history's end."""
    steps = {}
    for m in log:
        if not m["committed"]:
            continue
        p = m["plan"]
        assert p is not None and p["step"] == m["step"], m
        shape = (p["position"], p["samples"], p["participants"], p["target"], p["policy"])
        got = steps.setdefault(p["step"], {"shape": shape, "slots": {}})
        assert got["shape"] == shape, "step %d committed as %s and %s" % (p["step"], got["shape"], shape)
        want, samples = ref.slot(p["position"], p["participants"], p["target"], p["policy"], m["rank"], group_size)
        assert p["micro"] == want, "step %d slot %d read %s, its share is %s" % (p["step"], m["rank"], p["micro"], want)
        assert samples == p["samples"]
        assert sum(p["weights"]) == pytest.approx(sum(len(x) for x in want) * p["participants"] / samples)
        got["slots"][m["rank"]] = [i for x in p["micro"] for i in x]
    pos, seen = 0, {}
    for s in range(1, max(steps) + 1):
        assert s in steps, "no replica committed step %d" % s
        position, samples, participants, target, policy = steps[s]["shape"]
        assert position == pos, "step %d starts at %d, the one before ended at %d" % (s, position, pos)
        read = []
        for slot in range(participants * group_size):
            ids = [i for x in ref.slot(position, participants, target, policy, slot, group_size)[0] for i in x]
            assert steps[s]["slots"].get(slot, ids) == ids
            read += ids
        assert read == [ref.index(position + i) for i in range(samples)]
        for i, x in enumerate(read):
            key = ((position + i) // ref.size, x)
            seen[key] = seen.get(key, 0) + 1
        pos += samples
    assert all(n == 1 for n in seen.values()), [k for k, n in seen.items() if n > 1]
    for e in range(pos // ref.size):
        assert sorted(x for (ep, x) in seen if ep == e) == list(range(ref.size)), "epoch %d not read whole" % e
    return steps, pos


@needs_torch
def test_job_reads_each_sample_once_through_a_kill_a_failure_and_a_policy_switch():
    with ftcomm.coordinator.serve(log_level="off") as co:
        job = "pytest-data-%d" % os.getpid()
        env = child_env(FTCOMM_CREDENTIALS=co.credentials, FTCOMM_SECRET="pytest-secret", FTCOMM_TEST_JOB=job,
                        FTCOMM_TEST_SIZE=str(SIZE))
        out, log = queue.Queue(), []
        reps = [Replica("r%d" % i, env, out, script="data_replica.py") for i in range(3)]
        r0, r1, r2 = reps
        t_start = time.monotonic()
        try:
            def full(n):
                counts = {}

                def until(r, m):
                    if m["committed"] and m["participants"] == 3:
                        counts[r.group] = counts.get(r.group, 0) + 1
                    return len(counts) == 3 and min(counts.values()) >= n
                return until

            drive(reps, out, full(3), log)

            # A step refused by r0: it fails everywhere and gives its samples back.
            fail = {"sent": False}

            def cmd(r):
                if r is r0 and not fail["sent"]:
                    fail["sent"] = True
                    return "step fail"
                return "step"

            drive(reps, out, lambda r, m: m.get("refused"), log, cmd=cmd)
            failed = log[-1]["plan"]
            drive(reps, out, lambda r, m: r is r0 and m["committed"], log)
            redo = log[-1]["plan"]
            assert (redo["step"], redo["position"]) == (failed["step"], failed["position"])

            # KeepGlobalBatch from the job setting, at run time.
            posted = queue.Queue()
            threading.Thread(target=lambda: posted.put(post_settings(co, job, "ftcomm.batch_policy=global")),
                             daemon=True).start()
            drive(reps, out, lambda r, m: m["committed"] and m["plan"]["policy"] == "global"
                  and m["participants"] == 3, log)
            assert posted.get(timeout=30)["settings"]["version"] >= 1
            drive(reps, out, full(2), log)

            # r2 SIGKILLed while stepping; r0 and r1 go on with the global batch.
            r2.p.send_signal(signal.SIGKILL)
            r2.p.wait()
            drive([r0, r1], out, lambda r, m: r is r1 and m["committed"] and m["participants"] == 2, log)
            two = log[-1]["plan"]
            assert (two["policy"], two["samples"], len(two["micro"]), two["lr_scale"]) == ("global", 24, 3, 1.0), two
            drive([r0, r1], out, lambda r, m: r is r0 and m["committed"] and m["participants"] == 2, log)

            # r2 restarted (r0 and r1 stepping while it starts, as a
            # launcher's restart would find them): it heals the position
            # and the stateful object.
            started = queue.Queue()

            def start():
                try:
                    started.put(Replica("r2", env, out, script="data_replica.py"))
                except BaseException as e:  # noqa: B902 - raised below
                    started.put(e)

            threading.Thread(target=start, daemon=True).start()
            drive([r0, r1], out, lambda r, m: not started.empty(), log)
            r2 = started.get()
            if isinstance(r2, BaseException):
                raise r2
            reps[2] = r2
            r2.msgs = []

            def healed(r, m):
                if r is r2:
                    r2.msgs.append(m)
                return r is r2 and m["committed"] and m["participants"] == 3

            drive(reps, out, healed, log)
            first = r2.msgs[0]
            assert "healed" in first["events"], first
            assert first["loads"] >= 1, "the stateful object was not loaded after the heal"
            back = log[-1]

            def peers_of_back():
                return [m for m in log if m["group"] != "r2" and m["committed"] and m["step"] == back["step"]]

            if len(peers_of_back()) < 2:  # their answers of the step may come after r2's
                drive(reps, out, lambda r, m: len(peers_of_back()) == 2, log)
            peers = peers_of_back()
            assert all(m["progress"] == back["progress"] and m["state"] == back["state"] for m in peers), (
                back, peers)
            assert back["progress"]["steps"] == back["step"] and back["progress"]["position"] == back["position"]

            # On until two epochs are read, with r2 back.
            drive(reps, out, lambda r, m: m["committed"] and m["position"] >= 2 * SIZE + 10, log)
        finally:
            for r in reps:
                r.stop()
        took = time.monotonic() - t_start
        steps, end = check_history(log, Reference(SIZE, 4, 2, seed=7))
        # Every replica's committed steps agree with the job's, and its
        # stateful object followed the job's steps.
        for m in log:
            if m["committed"]:
                assert m["progress"]["steps"] == m["step"] and m["progress"]["position"] == m["position"], m
                assert m["position"] == m["plan"]["position"] + m["plan"]["samples"]
        kinds = {(s["shape"][2], s["shape"][4]) for s in steps.values()}
        assert (3, "replica") in kinds and (3, "global") in kinds and (2, "global") in kinds, kinds
        print("%d committed steps, %d samples (%.1f epochs) read exactly once, participants/policy %s; %.1f s" % (
            len(steps), end, end / SIZE, sorted(kinds), took))
