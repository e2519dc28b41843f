"""The quorum-aware sampler through Python (ftcomm.ft.Sampler, the loaders,
register_stateful, OptimizerWrapper's learning-rate scaling): its API and
errors on one replica, and a mismatched sampler healing from a peer."""

import os
import threading

import pytest

import ftcomm
import ftcomm.coordinator
import ftcomm.ft
from conftest import needs_torch

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
            k = min(self.max_accum, max(1, (t * self.accum + p - 1) // p))
            samples = min(full, p * g * k * self.batch)
        else:
            k = self.accum
            samples = p * g * k * self.batch
        per, extra = divmod(samples, p * g)
        off, n = slot * per + min(slot, extra), per + (1 if slot < extra else 0)
        ids = [self.index(position + off + i) for i in range(n)]
        micro = []
        for m in range(k):
            if policy == "global":
                lo, hi = m * n // k, (m + 1) * n // k
            else:
                lo, hi = min(m * self.batch, n), min((m + 1) * self.batch, n)
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
