"""One rank of test_snapshots.py's job: a replica group with no replica
("fsdp", FTCOMM_TEST_GROUP_SIZE ranks) under peer snapshots
(FTCOMM_TEST_EVERY). Its state (RankState) is a shard of its own, a small
module with an SGD-with-momentum optimizer and a stateful step counter, all
registered with protect_shards; every committed step changes them by a
function of the step and the rank alone, so the test can say what each
rank's state must be after every committed step (RankState.replay).

argv[1] is the group rank, or "any" for a slot spare. The rank steps on
its own until its stdin closes, and writes one JSON line per happening:
"claimed" (a slot spare took a place), "rollback", "restored", "error",
and a commit (kind "") with the state's digest."""

import hashlib
import json
import os
import sys
import threading
import time

import torch

N = 4096  # shard elements


class Counter:
    """The rank's committed steps, as a data loader's position would be."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


class RankState:
    """Slot's state, and the one deterministic change per step."""

    def __init__(self, slot: int):
        from ftcomm._ft_state import _materialize
        torch.manual_seed(100 + slot)
        self.slot = slot
        self.shard = torch.full((N,), float(slot + 1))
        self.module = torch.nn.Linear(4, 4)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.1, momentum=0.9)
        _materialize(self.opt)  # what protect_shards makes; replay makes it alike
        self.counter = Counter()
        self.ramp = torch.arange(N)

    def advance(self) -> None:
        """The step's data: read before the commit (rewound if it fails)."""
        self.counter.n += 1

    @torch.no_grad()
    def apply(self, step: int) -> None:
        """The optimizer's part of committed step ``step`` (0-based)."""
        contrib = ((self.ramp + step * 7 + self.slot) % 13).float() / 8
        self.shard.mul_(0.999).sub_(contrib, alpha=0.01)
        for i, p in enumerate(self.module.parameters()):
            p.grad = torch.full_like(p, ((step + self.slot + i) % 5 - 2) * 0.1)
        self.opt.step()

    def nbytes(self) -> int:
        """What the rank registers: the tensors and the counter's buffer
        (register_stateful's header and default capacity)."""
        from ftcomm.data import _HEADER
        ts = [self.shard] + list(self.module.parameters()) + [self.opt.state[p]["momentum_buffer"]
                                                               for p in self.module.parameters()]
        return sum(t.numel() * t.element_size() for t in ts) + _HEADER.size + 65536

    def digest(self) -> str:
        h = hashlib.sha1(self.shard.numpy().tobytes())
        for p in self.module.parameters():
            h.update(p.detach().numpy().tobytes())
            h.update(self.opt.state[p]["momentum_buffer"].numpy().tobytes())
        h.update(str(self.counter.n).encode())
        return h.hexdigest()[:16]

    @staticmethod
    def replay(slot: int, upto: int) -> list:
        """Slot's digests after committed steps 0..upto of a run without failures."""
        s = RankState(slot)
        out = [s.digest()]
        for step in range(upto):
            s.advance()
            s.apply(step)
            out.append(s.digest())
        return out


class ShardOps:
    """With FTCOMM_TEST_SHARD_OPS: each step runs collectives over the
    group's ftcomm.ft_torch.ShardGroup (torch.distributed's calls, sync and
    async) whose results the step and the ranks decide; run() returns what
    came out wrong. A fault fails the step instead of raising."""

    def __init__(self, c):
        from ftcomm.device_mesh import _register_group
        from ftcomm.ft_torch import ShardGroup
        self.pg = ShardGroup(c)
        _register_group(self.pg, "shard-%d" % os.getpid())
        self.c, self.n, self.r = c, c.group_size, c.group_rank

    def check_comm(self) -> list:
        """ft's group comm of the step: this rank's place in the group, and
        the same Communicator for every call within an epoch."""
        g = self.c.group_comm()
        wrong = []
        if (g.get_size(), g.get_rank()) != (self.n, self.r):
            wrong.append("group comm rank %d of %d" % (g.get_rank(), g.get_size()))
        if self.c.group_comm() is not g:
            wrong.append("a second group_comm() gave another Communicator")
        # A handle of ft's comm freed: the handle only (the ops that
        # follow run on the same comm through g).
        from ctypes import byref, c_uint64

        from ftcomm import _lib
        from ftcomm.comm import CommOptions, Communicator
        h = c_uint64()
        _lib.check(_lib.lib().ftcomm_ft_group_comm(self.c._handle(), byref(h)))
        Communicator(h.value, None, False, "cpu", "gloo", "", CommOptions(), None, "extra").finalize()
        return wrong

    def run(self, step: int) -> list:
        import torch.distributed as dist
        n, r, wrong = self.n, self.r, self.check_comm()
        x = torch.full((8,), float((r + 1) * (step + 1)))
        dist.all_reduce(x, group=self.pg)
        if not torch.equal(x, torch.full((8,), float((step + 1) * n * (n + 1) // 2))):
            wrong.append("all_reduce %s" % x[:2].tolist())
        g = torch.empty(2 * n)
        dist.all_gather_into_tensor(g, torch.tensor([float(r), float(step)]), group=self.pg)
        want = torch.tensor([v for i in range(n) for v in (float(i), float(step))])
        if not torch.equal(g, want):
            wrong.append("all_gather %s" % g.tolist())
        y = torch.empty(3)
        w = dist.reduce_scatter_tensor(y, torch.arange(3 * n, dtype=torch.float32) + step, group=self.pg,
                                       async_op=True)
        w.wait()
        if not torch.equal(y, n * (torch.arange(3 * r, 3 * r + 3, dtype=torch.float32) + step)):
            wrong.append("reduce_scatter %s" % y.tolist())
        return wrong


def emit(**kw) -> None:
    kw.setdefault("pid", os.getpid())
    kw.setdefault("t", time.time())
    print(json.dumps(kw), flush=True)


def main() -> int:
    import ftcomm
    import ftcomm.ft
    from ftcomm.ft_torch import protect_shards

    torch.set_num_threads(1)

    def exit_at_eof():
        for _ in sys.stdin:
            pass
        os._exit(0)

    threading.Thread(target=exit_at_eof, daemon=True).start()
    spare = sys.argv[1] == "any"
    c = ftcomm.ft.Comm(job=os.environ["FTCOMM_TEST_JOB"], group="fsdp",
                       group_rank=ftcomm.ft.ANY_RANK if spare else int(sys.argv[1]),
                       group_size=int(os.environ["FTCOMM_TEST_GROUP_SIZE"]), spare=spare,
                       snapshot_every=int(os.environ["FTCOMM_TEST_EVERY"]), min_replicas=1, timeout=10, lease_ttl=2,
                       heartbeat=0.5, host="one-host", log_level="error")
    slot = c.group_rank
    who = "fsdp.%d" % slot
    if spare:
        emit(kind="claimed", id=who, spare=c.spare)
    st = RankState(slot)
    protect_shards(c, st.module, st.opt, stateful={"counter": st.counter}, tensors={"shard": st.shard})
    ops = ShardOps(c) if os.environ.get("FTCOMM_TEST_SHARD_OPS") else None
    while True:
        try:
            c.step()
        except ftcomm.RolledBackError as e:
            emit(kind="rollback", id=who, from_step=e.from_step, to_step=e.to_step, step=e.step, snapshot=e.snapshot,
                 counter=st.counter.n)
        except ftcomm.FtcommError as e:
            emit(kind="error", id=who, cls=type(e).__name__, kinds=list(e.kinds), err=str(e),
                 step=c.committed_step, digest=st.digest())
            return 1
        for e in c.events():
            if e.kind == "restored":
                emit(kind="restored", id=who, step=e.step, from_step=e.from_step, bytes=e.bytes)
        step = c.committed_step
        if st.counter.n != step:
            emit(kind="error", id=who, cls="counter", err="the counter says %d at step %d" % (st.counter.n, step))
            return 1
        st.advance()
        wrong = ops.run(step) if ops is not None else None
        failure = ops.pg.failure if ops is not None else None
        if c.commit():
            if failure is not None or wrong:
                emit(kind="error", id=who, cls="shard_ops", err="step %d committed with its shard group's ops %s" % (
                    step, "failed: %r" % failure if failure is not None else "wrong: %s" % wrong))
                return 1
            st.apply(step)
            emit(kind="", id=who, step=c.committed_step, epoch=c.epoch, digest=st.digest(), ops=ops is not None)
        elif failure is not None:
            emit(kind="ops_failed", id=who, step=step, cls=type(failure).__name__, err=str(failure)[:300])


if __name__ == "__main__":
    sys.exit(main())
