#!/usr/bin/env python3
"""Fault-tolerant fully sharded data parallelism with no replica: the GPT
of train_gpt.py trained by N ranks that form ONE ftcomm.ft.Comm replica
group (group_size N), each holding 1/N of the parameters and of AdamW's
state and nothing else holding a copy — so a rank's death would lose its
shard, were it not for peer snapshots (``snapshot_every=K``): every K
committed steps each rank copies its shard into its own host memory and
into a buddy rank's. A slot spare (``group_rank=ftcomm.ft.ANY_RANK``,
``spare=True``) waits beside the job; one rank is SIGKILLed after 40 % of
the steps, the spare takes its place and restores its shard from the
buddy's copy, the survivors roll back to the same snapshot (their step()
raises RolledBackError with ``snapshot`` True), the data position with
them (ftcomm.ft.Sampler's position is registered state), and the group
trains on at full size. The killed rank is restarted as the next slot
spare. protect_shards registers each rank's shard, AdamW's moments and
step count.

Each step on the CPU (gloo; torch 1.13 is enough): all-gather the flat
parameters from the shards over the group's shard communicator (an
ftcomm communicator, ftcomm.new_comm, rebuilt for each epoch of the
ft.Comm under a name that carries the epoch, and closed after a failed
step, before the next step() may restore into the shards), forward and
backward on this rank's micro-batches of the step's plan, reduce-scatter
the gradient (average), and after a commit update this rank's slice with
its AdamW. A failed collective fails the step's commit at every rank (the
loop tells its ft.Comm with fail_step: the shard communicator is its own).

With --device cuda (torch >= 2.4, one rank per GPU) the ranks run FSDP2
instead: fully_shard on each block and the root over
ftcomm.ft_torch.shard_mesh(c), a ShardGroup on ft's NCCL group comm of the
current epoch (group_backend "nccl"), torch's AdamW on the DTensor shards,
all of it registered with protect_shards. A death fails the step instead
of raising into FSDP (ShardGroup), the spare takes the place, and the same
process group runs the next epoch on the new comm. The host waits for the
step's GPU work before the commit, so a step whose collectives a death cut
short is never committed. The slot spare has run FSDP2 and AdamW once on
a copy of the model before it waits (the first fully_shard of a process
costs seconds), and waits on the GPU of the rank it will replace (on 4
GPUs: 3 ranks, the spare on the fourth GPU).

One command runs the job twice: without snapshots and without a failure
(the baseline, so the snapshots' overhead shows), then with both:

    python3 examples/torch/train_fsdp_ft.py                       # 3 ranks + 1 slot spare on the CPU
    python3 examples/torch/train_fsdp_ft.py --snapshot-every 5 --ranks 4
    python3 examples/torch/train_fsdp_ft.py --device cuda         # FSDP2 on 2 GPUs + a slot spare (docs/snapshots.md)

Writes fsdp-report/loss.svg (kill and restore marked) and summary.txt: the
final validation loss of both runs and their difference, the steps the
survivors lost, kill → the group committing again at full size, the
snapshots' overhead per step, the restore's throughput, the snapshots'
memory, and the samples the committed steps read (each once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

import common


# ---------------------------------------------------------------- a rank

class ShardComm:
    """The group's shard communicator of the ft.Comm's current epoch: made
    at the first step of each epoch (all ranks of the group are then alive
    and in it), under a name that carries the epoch, so no op of an old
    epoch meets one of a new; closed after a failed step."""

    def __init__(self, store: str, rank: int, size: int, timeout: float):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.comm, self.epoch = None, None

    def of(self, epoch: int):
        import ftcomm
        if epoch != self.epoch:
            self.close("epoch %s ended" % self.epoch)
            self.comm = ftcomm.new_comm("gloo", "cpu", name="shard-e%d" % epoch, store=self.store, rank=self.rank,
                                        size=self.size, timeout=self.timeout)
            self.epoch = epoch
        return self.comm

    def close(self, why: str = "") -> None:
        """Close the comm; with a reason, abort it first (an op still
        running at a peer ends now)."""
        if self.comm is not None:
            if why:
                self.comm.abort(why)
            self.comm.finalize()
        self.comm, self.epoch = None, None


def begin_step(c, sampler):
    """ft's step() and this rank's plan of it: (out, plan, ended). out is
    the step's record so far (a rollback in it), None when the loop ends
    here (ended: the run finished; else the snapshot was lost, said);
    plan is None while the rank sits out (the commit fails)."""
    import ftcomm
    out = {}
    try:
        c.step()
    except ftcomm.RolledBackError as e:
        out["rollback"] = dict(from_step=e.from_step, to_step=e.to_step, step=e.step, snapshot=e.snapshot)
    except ftcomm.FinishedError:
        return None, None, True
    except ftcomm.SnapshotLostError as e:
        common.emit(error=str(e), kind="snapshot_lost")
        return None, None, False
    try:
        plan = sampler.plan()
    except ftcomm.NotParticipatingError:
        plan = None
    return out, plan, False


def emit_step(c, out, plan, ok: bool, loss: float, t0: float, ranks: int) -> None:
    """The launcher's record of a step: its outcome, loss and time, this
    rank's part of the data, and ft's events."""
    i = c.group_rank
    out.update(id="fsdp.%d" % i, step=c.committed_step, committed=ok, loss=loss, epoch=c.epoch, t=time.time(),
               dt=time.monotonic() - t0)
    if plan is not None:
        out["plan"] = dict(position=plan.position, samples=plan.samples, slot=c.rank * ranks + i, ix=plan.indices)
    evs = [{"kind": e.kind, "text": e.text, "bytes": e.bytes, "took": e.took_s, "step": e.step,
            "from_step": e.from_step, "time": e.time} for e in c.events()]
    if evs:
        out["events"] = evs
    common.emit(**out)


def place(args):
    """This process's ft.Comm: a rank's (--rank r), or a slot spare's
    (--rank -1), which says it waits and waits for a place; None when the
    launcher ended the wait."""
    if args.rank >= 0:
        return comm_of(args, args.rank)
    common.emit(waiting=True)
    return wait_for_place(args)


def wait_for_place(args):
    """A slot spare's ft.Comm: it waits in the constructor until a rank of
    the group dies. The launcher ends the wait by closing stdin."""
    import ftcomm
    import ftcomm.ft

    def interrupt_at_eof():
        while sys.stdin.readline():
            pass
        # Until the constructor returns: an interrupt ends only a wait in
        # progress, and this one may not have begun yet.
        while not placed.wait(0.05):
            ftcomm.interrupt()

    placed = threading.Event()
    threading.Thread(target=interrupt_at_eof, daemon=True).start()
    try:
        return comm_of(args, ftcomm.ft.ANY_RANK)
    except ftcomm.InterruptedOpError:
        return None
    finally:
        placed.set()


def comm_of(args, group_rank: int):
    import ftcomm.ft
    gpu = {}
    if args.device == "cuda":
        # ft's data comm and the group's comm (FSDP2's, through
        # ShardGroup) on this process's GPU.
        gpu = dict(backend="nccl", device=torch.device("cuda", torch.cuda.current_device()), group_backend="nccl")
    return ftcomm.ft.Comm(job=args.job, group="fsdp", group_rank=group_rank, group_size=args.ranks,
                          spare=group_rank == ftcomm.ft.ANY_RANK, snapshot_every=args.snapshot_every, min_replicas=1,
                          timeout=args.op_timeout, lease_ttl=2, heartbeat=1, gossip=args.gossip,
                          log_level=os.environ.get("FTCOMM_LOG_LEVEL", "error"), **gpu)


def gpu_of(args, rank: int) -> int:
    """The GPU of a rank (rank -1: a slot spare). With a GPU to spare (4
    GPUs, 3 ranks) the spare has its own; otherwise it waits on the GPU of
    the rank the launcher kills (the last), whose place it takes."""
    n = torch.cuda.device_count()
    if rank >= 0:
        return rank % n
    return args.ranks % n if args.ranks < n else (args.ranks - 1) % n


def rank_main_fsdp2(args) -> None:
    """A rank of the CUDA mode: FSDP2 (fully_shard on each block and the
    root) over ftcomm.ft_torch.shard_mesh, ft's group comm of each epoch;
    torch's AdamW on the DTensor shards, all of it registered with
    protect_shards."""
    import torch.distributed as dist

    import ftcomm
    import ftcomm.ft
    from ftcomm.ft_torch import local_tensor, protect_shards, register_state, shard_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4, 2.5

    torch.cuda.set_device(gpu_of(args, args.rank))
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(args.seed)  # the same initial model on every rank: FSDP keeps each rank's shard of it
    train, val = common.load_corpus(args.corpus, args.corpus_bytes)
    model = common.GPT(args.layers, args.d, args.heads, args.block).to(device)
    params = sum(p.numel() for p in model.parameters())
    spare = args.rank < 0
    if spare:
        # Warm: the process, its CUDA context and the model are ready, and
        # FSDP2, a forward and backward and AdamW over DTensors have run
        # once (common.warm_spare); the shards come from the buddy of the
        # rank whose place it takes.
        common.warm_spare(model, fully_shard, args.lr, args.batch, args.block)
    c = place(args)
    if c is None:
        common.emit(done=True)
        return
    setup = [("placed", time.monotonic())]
    i = c.group_rank
    mesh = shard_mesh(c)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    pg = mesh.get_group()
    setup.append(("fully_shard", time.monotonic()))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sampler = ftcomm.ft.Sampler(c, size=common.sequences(train, args.block), batch=args.batch, seed=args.seed)
    if c.snapshot_every:
        protect_shards(c, model, opt)
    else:  # the baseline: no snapshots, nothing to protect with
        register_state(c, model, opt)
    torch.cuda.synchronize()
    setup.append(("registered", time.monotonic()))
    state = [local_tensor(p) for p in model.parameters()] + [
        local_tensor(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in state)
    common.emit(ready=True, id="fsdp.%d" % i, bytes=nbytes, params=params, claimed=spare, t=time.time(),
                setup={k: round(t - setup[0][1], 4) for k, t in setup[1:]})
    if not spare:
        sys.stdin.readline()  # the launcher's go: every rank is registered
    ended = False
    while c.committed_step < args.steps:
        t0 = time.monotonic()
        out, plan, ended = begin_step(c, sampler)
        if out is None:
            break
        s = c.committed_step
        lr = common.lr_at(s, args.steps, args.lr) * (plan.lr_scale if plan else 1.0)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        loss_sum = torch.zeros((), device=device)
        samples = 0
        for m in plan.micro if plan else ():
            x, y = common.sample_batch(train, m.indices, args.block, device)
            loss = model(x, y)
            (loss * m.weight).backward()  # FSDP reduce-scatters: the group's mean gradient, this rank's shard
            loss_sum += loss.detach() * len(m.indices)
            samples += len(m.indices)
        # The global gradient norm (the shards' squares, all-reduced over
        # the group), clipped at 1.
        grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        sq = torch.zeros((), device=device)
        for g in grads:
            sq += g.pow(2).sum()
        dist.all_reduce(sq, group=pg)
        coef = torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        # The host waits for the step's GPU work (FSDP's collectives
        # included) before it votes: a step whose collective a death cut
        # short is never committed.
        loss_v = float(loss_sum / samples) if samples else float("nan")
        # A fault in any of FSDP's collectives failed the step (ShardGroup):
        # the commit says so at every rank, and nothing of it is applied.
        ok = c.commit()
        if ok:
            opt.step()
        else:
            out["failed"] = type(pg.failure).__name__ if pg.failure is not None else "the commit failed"
        if ok and (c.committed_step % args.eval_every == 0 or c.committed_step == args.steps):
            # Every rank evaluates (FSDP gathers the layers); the victim too,
            # before it waits for its kill.
            with torch.no_grad():
                out["val"], out["val_step"] = common.evaluate(model, val, args.batch, args.block, device,
                                                              args.eval_batches), c.committed_step
        emit_step(c, out, plan, ok, loss_v, t0, args.ranks)
        if args.die_after is not None and ok and c.committed_step >= args.die_after:
            sys.stdin.readline()  # the victim waits for its SIGKILL (see rank_main)
    if c.committed_step >= args.steps and not ended:
        try:  # (the evaluation of the last step is the final one)
            c.finish()
        except ftcomm.FtcommError:
            pass
    common.emit(finished=True)
    torch.cuda.synchronize()
    pg.shutdown()
    c.close()
    common.emit(done=True)


def rank_main(args) -> None:
    import ftcomm
    import ftcomm.ft
    from ftcomm import ReduceOp
    from ftcomm.ft_torch import protect_shards

    torch.manual_seed(args.seed)  # the same initial model on every rank: each keeps its slice
    torch.set_num_threads(max(1, args.threads))
    N = args.ranks
    train, val = common.load_corpus(args.corpus, args.corpus_bytes)
    model = common.GPT(args.layers, args.d, args.heads, args.block)
    flat = common.Flat(model, "cpu", multiple=N)  # the gathered parameters, padded to N equal shards
    S = flat.n // N
    spare = args.rank < 0
    c = place(args)
    if c is None:
        common.emit(done=True)
        return
    i = c.group_rank
    shard = flat.params[i * S:(i + 1) * S].clone()  # this rank's parameters: what it updates and snapshots
    grad = torch.zeros(S)
    opt = common.AdamW(S, "cpu", lr=args.lr)
    state = {"shard": shard, "adam.m": opt.m, "adam.v": opt.v, "adam.t": opt.t}
    # The data follows the group: each step reads the next sequences of the
    # epoch's permutation, cut among the ranks; its position is registered
    # state, restored with the shards.
    sampler = ftcomm.ft.Sampler(c, size=common.sequences(train, args.block), batch=args.batch, seed=args.seed)
    if c.snapshot_every:
        protect_shards(c, tensors=state)
    else:  # the baseline: no snapshots, nothing to protect with
        for name, t in state.items():
            c.register(name, t)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    common.emit(ready=True, id="fsdp.%d" % i, bytes=nbytes, params=flat.used, claimed=spare, t=time.time())
    if not spare:
        sys.stdin.readline()  # the launcher's go: every rank is registered
    shards = ShardComm(args.store, i, N, args.op_timeout)
    ended = False
    while c.committed_step < args.steps:
        t0 = time.monotonic()
        out, plan, ended = begin_step(c, sampler)
        if out is None:
            break
        s = c.committed_step
        stats = torch.zeros(3)  # loss sum, samples, |grad|² of the shard
        try:
            sc = shards.of(c.epoch)
            sc.all_gather_single(flat.params, shard)  # the committed parameters of step s
            if i == 0 and s % args.eval_every == 0 and s > 0:
                out["val"], out["val_step"] = common.evaluate(model, val, args.batch, args.block, "cpu",
                                                              args.eval_batches), s
            flat.grads.zero_()
            for m in plan.micro if plan else ():
                x, y = common.sample_batch(train, m.indices, args.block, "cpu")
                loss = model(x, y)
                (loss * m.weight).backward()  # the rank's share of the step's mean gradient
                stats[0] += loss.item() * len(m.indices)
                stats[1] += len(m.indices)
            sc.reduce_scatter_single(grad, flat.grads, ReduceOp.AVG)  # the group's mean, this rank's slice
            stats[2] = grad.pow(2).sum()
            sc.all_reduce(stats, ReduceOp.SUM)
        except ftcomm.FtcommError as e:  # a peer died, or an op timed out: the step cannot count
            shards.close("the step failed: %s" % type(e).__name__)
            # The shard communicator is not the ft.Comm's: its failure is
            # not on the ft.Comm's record unless the loop says so (any
            # rank's no fails the group's vote).
            c.fail_step("shard communicator: %s" % e)
            out["failed"] = type(e).__name__
        ok = c.commit()
        if ok:
            clip = min(1.0, 1.0 / (float(stats[2].sqrt()) + 1e-6))  # the global gradient norm, clipped at 1
            opt.step(shard, grad.mul_(clip), common.lr_at(s, args.steps, args.lr) * (plan.lr_scale if plan else 1.0))
        else:
            # The next step is a new epoch: nothing of this one may touch
            # what its step() restores.
            shards.close("the step failed")
        emit_step(c, out, plan, ok, float(stats[0] / stats[1]) if stats[1] else float("nan"), t0, N)
        if args.die_after is not None and ok and c.committed_step >= args.die_after:
            # The victim: it waits here for the launcher's SIGKILL, so the
            # death comes after this step whatever the launcher's lag
            # (a fast group would otherwise end the run first); its peers
            # wait for it in their next step, as for a rank that died.
            sys.stdin.readline()
    if c.committed_step >= args.steps and not ended:
        try:  # the final parameters, for the final evaluation
            shards.of(c.epoch).all_gather_single(flat.params, shard)
            if i == 0:
                common.emit(final_val=common.evaluate(model, val, args.batch, args.block, "cpu", args.eval_batches),
                            step=c.committed_step, id="fsdp.%d" % i, t=time.time())
            c.finish()
        except ftcomm.FtcommError:
            pass
    common.emit(finished=True)
    shards.close()
    c.close()
    common.emit(done=True)


# ---------------------------------------------------------------- launcher

def run_job(args, co, job: str, kill: bool, out_dir: str) -> dict:
    import ftcomm
    N = args.ranks
    store = ftcomm.Store.listen("127.0.0.1:0")  # where each epoch's shard communicator meets
    env = common.replica_env({"FTCOMM_CREDENTIALS": co.credentials, "FTCOMM_SECRET": "train-fsdp-" + job,
                              "OMP_NUM_THREADS": str(max(1, args.threads))})
    every = args.snapshot_every if kill else 0  # the baseline takes no snapshots
    base = [sys.executable, os.path.abspath(__file__)] + args.passthrough + [
        "--job", job, "--store", store.address, "--snapshot-every", str(every)]

    kill_step = int(args.steps * args.kill_at)
    victim = "fsdp.%d" % (N - 1)

    def launch(label, rank):
        die = ["--die-after", str(kill_step)] if kill and label == victim else []
        return common.Proc(label, base + ["--rank", str(rank)] + die, env, os.path.join(out_dir, "%s-%s.log" % (job, label)))

    def started(p):
        m = p.q.get(timeout=300)
        if not m or not (m.get("ready") or m.get("waiting")):
            raise SystemExit("%s of %s did not start; see %s" % (p.name, job, p.log.name))
        return m

    # ranks: the process that holds each rank now; spares: those waiting
    # for a place (only where a rank dies: elsewhere they would wait to the end).
    ranks = {"fsdp.%d" % r: launch("fsdp.%d" % r, r) for r in range(N)}
    spares = [launch("spare.%d" % k, -1) for k in range(args.spares if kill else 0)]
    ready = {name: started(p) for name, p in ranks.items()}
    for p in spares:
        started(p)
    for p in ranks.values():
        p.send("go")
    res = {"loss": {}, "val": {}, "dt": {}, "events": [], "rollbacks": {}, "kill_step": None, "killed_at": None,
           "state_bytes": ready["fsdp.0"]["bytes"], "params": ready["fsdp.0"]["params"], "commits": []}
    train, _ = common.load_corpus(args.corpus, args.corpus_bytes)
    cover = common.Coverage(common.sequences(train, args.block))
    t_start = last_heard = time.time()
    ended = set()  # processes that ended (the killed one too)
    finishing = False  # a rank finished: the run is ending
    late = []  # spares that took a place a finishing rank left: the run is over for them
    while not all(p in ended for p in list(ranks.values()) + late):
        if time.time() - last_heard > args.stall:
            raise SystemExit("%s: no rank said anything for %d s; see the logs in %s" % (job, args.stall, out_dir))
        for p in list(ranks.values()) + spares + late:
            while p not in ended:
                try:
                    m = p.q.get(timeout=0.02)
                except Exception:
                    break
                last_heard = time.time()
                if m is None or m.get("done"):
                    ended.add(p)
                    break
                if m.get("claimed"):  # a slot spare took a place: it is that rank now
                    spares.remove(p)
                    if finishing or ranks[m["id"]] not in ended:
                        # A place a finishing rank left, not a dead one's:
                        # the spare's first step ends the run for it, and
                        # the rank's last lines (its last step, the final
                        # evaluation) are still to be read from the rank.
                        late.append(p)
                        continue
                    ranks[m["id"]] = p
                    res.setdefault("claimed", {"who": p.name, "as": m["id"], "after_kill_s": m["t"] - res["killed_at"],
                                               "setup": m.get("setup")})
                    print("  %s: %s took the place of %s, %.2f s after the kill" % (
                        job, p.name, m["id"], m["t"] - res["killed_at"]), flush=True)
                    continue
                if m.get("finished") and not finishing:
                    finishing = True
                    for q in spares:
                        q.close()  # their wait ends: the places the ranks leave now are no one's
                if "error" in m:
                    print("  %s: %s: %s" % (job, p.name, m["error"]), flush=True)
                    continue
                if "final_val" in m:
                    res["final_val"] = res["val"][m["step"]] = m["final_val"]
                    continue
                if "step" not in m:
                    continue
                res["commits"].append({"who": m["id"], "step": m["step"], "committed": m["committed"], "t": m["t"]})
                if "failed" in m and res["killed_at"] is not None and "first_failure" not in res:
                    # A survivor's step that the death failed: when it knew.
                    res["first_failure"] = {"who": m["id"], "step": m["step"], "error": m["failed"],
                                            "after_kill_s": m["t"] - res["killed_at"]}
                if "rollback" in m:
                    res["rollbacks"][m["id"]] = dict(m["rollback"], t=m["t"])
                for e in m.get("events", []):
                    res["events"].append(dict(e, who=m["id"], t=m["t"] - t_start, at=m["t"]))
                if m["committed"] and "plan" in m:
                    pl = m["plan"]
                    cover.add(m["step"], pl["position"], pl["samples"], pl["slot"], pl["ix"])
                if m["id"] == "fsdp.0" and m["committed"]:
                    res["loss"][m["step"]] = m["loss"]
                    # A step's time before any rollback redid it (a step
                    # taken again after the kill spans the recovery); steps
                    # with an evaluation are left out of the step times.
                    if "val" not in m:
                        res["dt"].setdefault(m["step"], m["dt"])
                    if "val" in m:
                        res["val"][m["val_step"]] = m["val"]
                    if m["step"] % 50 == 0:
                        print("  %s: step %d loss %.3f" % (job, m["step"], m["loss"]), flush=True)
                if (kill and p is ranks[victim] and res["killed_at"] is None and m["committed"]
                        and m["step"] >= kill_step):
                    res["killed_at"] = time.time()  # the signal, not the end of the process's teardown
                    p.kill()
                    # The process is reaped once the kernel has torn it down
                    # (its memory unmapped, then its sockets closed: what
                    # its peers on other hosts can first see).
                    res["reaped_s"] = time.time() - res["killed_at"]
                    ended.add(p)
                    res["kill_step"] = m["step"]
                    print("  %s: %s SIGKILLed after committing step %d" % (job, victim, m["step"]), flush=True)
                    if args.restart_spare:  # the killed rank comes back as the next slot spare
                        spares.append(launch("spare.r", -1))
                    break
    for p in spares:
        p.close()  # a spare still waiting: its stdin closes, its wait ends
    for p in list(ranks.values()) + late:
        p.close()
    store.close()
    res["seconds"] = time.time() - t_start
    res["coverage"] = cover.summary()
    if "final_val" not in res and args.steps in res["val"]:
        res["final_val"] = res["val"][args.steps]  # the CUDA mode's evaluation of its last step
    return res


FAILURE = "snapshots, one rank killed"
BASELINE = "no snapshots, no failure"


def figures(args, runs: dict) -> dict:
    """The summary's numbers, from the runs' records."""
    f, b = runs.get(FAILURE), runs.get(BASELINE)
    out = {}
    if f and b and f.get("final_val") and b.get("final_val"):
        out["final_diff_pct"] = 100 * (f["final_val"] - b["final_val"]) / b["final_val"]
    if f and f["killed_at"] is not None:
        after = [c for c in f["commits"] if c["committed"] and c["t"] > f["killed_at"]]
        out["resumed_s"] = min(c["t"] for c in after) - f["killed_at"] if after else None
        rb = f["rollbacks"]
        out["steps_lost"] = {w: r["to_step"] - r["step"] for w, r in sorted(rb.items())}
        out["restored_step"] = next((r["step"] for r in rb.values()), None)
        new = [e for e in f["events"] if e["kind"] == "restored" and e["bytes"] > 0]
        if new:
            e = new[0]
            out["restore"] = {"who": e["who"], "bytes": e["bytes"], "took_s": e["took"],
                              "mb_s": e["bytes"] / e["took"] / 1e6 if e["took"] else None,
                              "after_kill_s": e["time"] - f["killed_at"]}
    if f and b:
        # The mean step time before the kill (the baseline: the same
        # steps), past the first few and without the steps rank 0
        # evaluated in: a mean, as one step in K takes the snapshot.
        upto = f["kill_step"] or args.steps

        def mean(r):
            xs = [dt for s, dt in r["dt"].items() if 5 < s <= upto]
            return statistics.mean(xs) if xs else None
        out["step_s"] = {"snapshots": mean(f), "baseline": mean(b)}
        if all(out["step_s"].values()):
            out["overhead_pct"] = 100 * (out["step_s"]["snapshots"] / out["step_s"]["baseline"] - 1)
    if f:
        # Within the run with snapshots, which a loaded machine disturbs
        # less than two runs apart: the steps that take a snapshot (the
        # step after a snapshot step) against the others.
        K, upto = args.snapshot_every, f["kill_step"] or args.steps
        xs = [(s, dt) for s, dt in f["dt"].items() if 5 < s <= upto]
        taking = [dt for s, dt in xs if (s - 1) % K == 0]
        other = [dt for s, dt in xs if (s - 1) % K]
        if taking and other:
            out["snapshot_step_s"] = {"taking": statistics.mean(taking), "other": statistics.mean(other)}
    return out


def report(args, runs: dict, out_dir: str) -> None:
    colours = {BASELINE: "#1f77b4", FAILURE: "#d62728"}
    series = []
    for name, r in runs.items():
        st, vs = sorted(r["loss"]), sorted(r["val"])
        series.append(("%s: training loss (EMA)" % name, st, common.ema([r["loss"][s] for s in st]), colours[name],
                       False))
        series.append(("%s: validation loss" % name, vs, [r["val"][s] for s in vs], colours[name], True))
    fig = figures(args, runs)
    f = runs.get(FAILURE)
    vlines = []
    if f and f["kill_step"] is not None:
        vlines.append((f["kill_step"], "kill"))
        if fig.get("restored_step") is not None:
            vlines.append((fig["restored_step"], "restored: step %d" % fig["restored_step"]))
    common.svg_plot(os.path.join(out_dir, "loss.svg"), series, vlines,
                    title="GPT (%d layers, d=%d), FSDP over %d ranks, one group, snapshots every %d steps" % (
                        args.layers, args.d, args.ranks, args.snapshot_every),
                    xlabel="committed step", ylabel="loss (nats/byte)")
    any_run = runs[next(iter(runs))]
    kb = any_run["state_bytes"] / 1e3
    lines = ["train_fsdp_ft: %d ranks in one replica group (no replica) + %d slot spare(s), %d steps, %d parameters "
             "(%.1f KB of state per rank), batch %d x %d bytes per rank, snapshots every %d steps" % (
                 args.ranks, args.spares, args.steps, any_run["params"], kb, args.batch, args.block,
                 args.snapshot_every)]
    for name, r in runs.items():
        lines.append("%-28s final validation loss %.4f  (%.1f s)" % (
            name, r.get("final_val") or float("nan"), r["seconds"]))
        lines.append("%-28s %s" % ("", common.Coverage.line(r["coverage"])))
    if "final_diff_pct" in fig:
        same = " (the same loss: the group redid the lost steps from the snapshot, with the same data)"
        lines.append("difference: %+.4f %%%s" % (fig["final_diff_pct"], same if fig["final_diff_pct"] == 0 else ""))
    if f and f["kill_step"] is not None:
        lines.append("killed fsdp.%d after its step %d:" % (args.ranks - 1, f["kill_step"]))
        if f.get("reaped_s") is not None:
            lines.append("  its process torn down            %.3f s after the kill" % f["reaped_s"])
        if f.get("first_failure"):
            ff = f["first_failure"]
            lines.append("  %s's step %d failed (%s)  %.3f s after the kill" % (
                ff["who"], ff["step"], ff["error"], ff["after_kill_s"]))
        if f.get("claimed"):
            lines.append("  a slot spare took its place     %.3f s after the kill" % f["claimed"]["after_kill_s"])
        rs = fig.get("restore")
        if rs:
            lines.append("  %s restored from its buddy  %.3f s after the kill: %.1f KB in %.4f s (%.1f MB/s)" % (
                rs["who"], rs["after_kill_s"], rs["bytes"] / 1e3, rs["took_s"], rs["mb_s"] or 0))
        lines.append("  training resumed at full size   %s after the kill" % common.fmt_s(fig.get("resumed_s")))
        lines.append("  steps lost (the survivors rolled back to the snapshot of step %s): %s" % (
            fig.get("restored_step"), ", ".join("%s %d" % kv for kv in fig["steps_lost"].items()) or "none"))
    if fig.get("step_s"):
        st = fig["step_s"]
        lines.append("step time before the kill (mean): %s with snapshots, %s without: overhead %s" % (
            common.fmt_s(st["snapshots"]), common.fmt_s(st["baseline"]),
            "%+.1f %%" % fig["overhead_pct"] if "overhead_pct" in fig else "n/a"))
    if fig.get("snapshot_step_s") and args.snapshot_every > 1:
        st = fig["snapshot_step_s"]
        per = 100 * (st["taking"] - st["other"]) / args.snapshot_every / st["other"]
        lines.append("  within the run with snapshots: the steps that take one %s, the others %s: %+.1f %% a step" % (
            common.fmt_s(st["taking"]), common.fmt_s(st["other"]), per))
    lines.append("snapshot memory per rank: at most 2 copies of its own state and 2 of its source's (the newest "
                 "complete and the one in flight): 4 x %.1f KB = %.1f KB of host memory" % (kb, 4 * kb))
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(text + "\n")
        kept = {k: {kk: vv for kk, vv in v.items() if kk not in ("loss", "commits", "val")}
                for k, v in runs.items()}
        fh.write(json.dumps({"figures": fig, "runs": kept}) + "\n")
    print(text)
    print("plot: %s" % os.path.join(out_dir, "loss.svg"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=None,
                    help="ranks of the one replica group (the world); default 3 on the CPU, on GPUs 3 with 4 GPUs or "
                         "more (the spare on a GPU of its own), else 2 (the spare beside the rank it replaces)")
    ap.add_argument("--snapshot-every", type=int, default=10,
                    help="committed steps between peer snapshots (10: a snapshot cost about 50 ms, a third of a "
                         "step, on a 2-core VM; every 10 steps about 3 %%; see docs/python.md)")
    ap.add_argument("--steps", type=int, default=None,
                    help="committed steps (default 200; 800 with --device cuda, whose model is larger: 8 layers, "
                         "d=512, batch 16 x 256 bytes per rank)")
    ap.add_argument("--kill-at", type=float, default=0.4, help="kill the last rank after this fraction of the steps")
    ap.add_argument("--spares", type=int, default=1, help="slot spares started with the job")
    ap.add_argument("--no-restart-spare", dest="restart_spare", action="store_false",
                    help="do not restart the killed rank as the next slot spare")
    ap.add_argument("--no-gossip", dest="gossip", action="store_false")
    ap.add_argument("--no-baseline", action="store_true", help="only the run with snapshots and the failure")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: a flat shard over gloo (torch 1.13 is enough); cuda: FSDP2 (torch >= 2.4) over the "
                         "GPUs' NCCL, one rank per GPU")
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank and step")
    ap.add_argument("--block", type=int, default=None, help="bytes per sequence")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--d", type=int, default=None, help="model width")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--op-timeout", type=float, default=20)
    ap.add_argument("--stall", type=float, default=300, help="give up when no rank says anything for this long (s)")
    ap.add_argument("--corpus", default=common.repo_root())
    ap.add_argument("--corpus-bytes", type=int, default=2 << 20)
    ap.add_argument("--out", default="fsdp-report")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # -1: a slot spare
    ap.add_argument("--die-after", type=int, default=None, help=argparse.SUPPRESS)  # the victim: wait for the kill
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--job", default="fsdp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    for k, cpu, gpu in (("ranks", 3, 2 if torch.cuda.device_count() < 4 else 3), ("steps", 200, 800),
                        ("batch", 8, 16), ("block", 64, 256), ("layers", 2, 8), ("d", 64, 512), ("heads", 4, 8),
                        ("lr", 3e-3, 1e-3), ("eval_every", 25, 100), ("threads", 1, 4)):
        if getattr(args, k) is None:
            setattr(args, k, gpu if cuda else cpu)
    if args.rank is not None:
        (rank_main_fsdp2 if cuda else rank_main)(args)
        return
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs 2 GPUs or more; %d here" % torch.cuda.device_count())
    if cuda and torch.cuda.device_count() < args.ranks:
        raise SystemExit("%d ranks need %d GPUs; %d here" % (args.ranks, args.ranks, torch.cuda.device_count()))
    if args.ranks < 2 or args.snapshot_every < 1:
        raise SystemExit("--ranks must be at least 2 and --snapshot-every at least 1")
    if args.spares < 1 and not args.restart_spare:
        raise SystemExit("with no slot spare and no restart, no process would take the killed rank's place")
    import ftcomm.coordinator
    args.passthrough = list(sys.argv[1:])
    for k in ("ranks", "steps", "batch", "block", "layers", "d", "heads", "lr", "eval_every", "threads"):
        args.passthrough += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    with ftcomm.coordinator.serve(join_timeout=2, gossip=args.gossip, log_level="off") as co:
        if not args.no_baseline:
            print("job 1: %s" % BASELINE, flush=True)
            runs[BASELINE] = run_job(args, co, "fsdp-baseline", False, args.out)
        print("job 2: snapshots every %d steps, fsdp.%d killed after %d%% of the steps, %d slot spare(s)" % (
            args.snapshot_every, args.ranks - 1, 100 * args.kill_at, args.spares), flush=True)
        runs[FAILURE] = run_job(args, co, "fsdp-failure", True, args.out)
    report(args, runs, args.out)


if __name__ == "__main__":
    main()
