#!/usr/bin/env python3
"""Fault-tolerant HSDP of the GPT of train_gpt.py on this repository's own
text: replica groups of G ranks, FSDP2 (``fully_shard``) within each group
over the group's own ftcomm communicator (ftcomm.device_mesh), the
replicate dimension across groups through ftcomm.ft.Comm (FSDP2's all-reduce
hook, ftcomm.ft_torch.apply_hsdp), the data read through the quorum-aware
sampler (ftcomm.ft.Sampler: each committed step reads the next sequences of
the epoch's permutation; --batch-policy replica or global), an
OptimizerWrapper that steps only on committed steps with the learning rate
scaled by the step's global batch, and register_state for the sharded
parameters and AdamW's state. A spare group (--spares, default 1; 0: none) starts with the job:
G processes that build their model, FSDP2 and optimizer and wait in their
first step. One rank of the last group is SIGKILLed after 40 % of the
steps; the launcher ends the rest of that group and restarts it whole as a
plain replica group. The coordinator promotes the spare group in its place
(its ranks heal their shards from the same shard rank of a live group) and
the restarted group waits as the next spare; without spares the restarted
group heals and rejoins. One command runs the job twice, without and with
the failure, and plots both:

    python3 examples/torch/train_hsdp.py --device cuda     # 2 groups x 2 GPUs on 4 GPUs (2 x 1 on 2 GPUs); the spare on the last group's GPUs
    python3 examples/torch/train_hsdp.py                   # CPU: FT-DDP (torch DDP through ft.Comm), 2 replicas + 1 spare

The CPU mode runs on torch 1.13 (no FSDP2 there): each replica is one
process, its model in torch's DistributedDataParallel with the gradient
buckets averaged by ft.Comm (ftcomm.ft_torch.ft_ddp). Writes
hsdp-report/loss.svg (kill and promotion marked), capacity.svg (groups per
step, both runs) and summary.txt: the samples of the epoch the committed
steps covered (checked to be each read once), the surviving groups' first commit,
capacity back (kill → the first step committed at full size again) and the
GPU-seconds the kill cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import common


# ---------------------------------------------------------------- a rank

def rank_main(args) -> None:
    import ftcomm
    import ftcomm.ft
    from ftcomm.ft_torch import OptimizerWrapper, apply_hsdp, ft_ddp, register_state

    torch.manual_seed(args.seed)  # the same initial model in every group
    torch.set_num_threads(max(1, args.threads))
    cuda = args.device == "cuda"
    G, g, i = args.group_size, args.group, args.group_rank
    # A spare group waits on the GPUs of the group the launcher kills (the
    # last): the GPUs its death frees.
    slot = args.groups - 1 if args.spare else g
    device = torch.device("cuda", (slot * G + i) % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    train, val = common.load_corpus(args.corpus, args.corpus_bytes)
    model = common.GPT(args.layers, args.d, args.heads, args.block).to(device)
    if args.spare and cuda and args.mode == "hsdp" and args.warm_spare:
        # Warm before it waits: FSDP2, a forward and backward and AdamW have
        # run once on a copy of the model sharded over this process alone
        # (common.warm_spare), not in the survivors' first full-size step.
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard  # torch 2.4, 2.5
        common.warm_spare(model, fully_shard, args.lr, args.batch, args.block)
    name = "s%d" % (g - args.groups) if args.spare else "g%d" % g
    c = ftcomm.ft.Comm(job=args.job, group=name, group_rank=i, group_size=G, backend=backend, device=device,
                       min_replicas=1, timeout=args.op_timeout, lease_ttl=2, heartbeat=1, gossip=args.gossip,
                       log_level=os.environ.get("FTCOMM_LOG_LEVEL", "error"), spare=args.spare)
    shard = None
    if args.mode == "hsdp":
        import ftcomm.device_mesh
        # The shard dimension: this group's own comm (a new store per
        # incarnation of the group, from the launcher).
        shard = ftcomm.new_comm(backend, device, name="shard", store=args.group_store, rank=i, size=G,
                                timeout=args.op_timeout)
        mesh = ftcomm.device_mesh.init_device_mesh(mesh_dim_comms=(shard,), mesh_dim_names=("shard",))
        model = apply_hsdp(model, c, mesh, blocks=list(model.blocks))
        net = model
    else:
        net = ft_ddp(model, c)
    # The data follows the quorum (ftcomm.ft.Sampler): each step reads the
    # next sequences of the epoch's permutation, cut among the step's groups
    # and a group's ranks; the wrapper scales the learning rate by the
    # step's global batch (lr_scaling "linear").
    sampler = ftcomm.ft.Sampler(c, size=common.sequences(train, args.block), batch=args.batch, seed=args.seed,
                                policy=args.batch_policy, replicas=args.groups)
    opt = OptimizerWrapper(c, torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01),
                           sampler=sampler)
    names = register_state(c, model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in _registered(model, opt))
    common.emit(ready=True, registered=len(names), bytes=nbytes)
    sys.stdin.readline()  # the launcher's go: every rank is registered
    while c.committed_step < args.steps:
        t0 = time.monotonic()
        try:
            opt.zero_grad()  # the ft step: quorum, reconfiguration, healing (a spare waits here)
        except ftcomm.FinishedError:
            break
        s = c.committed_step
        lr = common.lr_at(s, args.steps, args.lr)
        for pg in opt.param_groups:
            pg["lr"] = lr
        plan = opt.plan  # None while this group sits out: the commit fails
        loss_sum, n = 0.0, 0
        for m in plan.micro if plan else ():
            if not m.indices:
                continue
            x, y = common.sample_batch(train, m.indices, args.block, device)
            loss = net(x, y)
            (loss * m.weight).backward()  # each backward's all-reduce is linear: the step's mean gradient
            loss_sum, n = loss_sum + loss.item() * len(m.indices), n + len(m.indices)
        rank = c.rank
        ok = opt.step()  # commit; AdamW (lr × plan.lr_scale) only if the step counts
        out = dict(step=c.committed_step, committed=ok, loss=loss_sum / n if n else float("nan"),
                   participants=c.participants, epoch=c.epoch, rank=c.rank, t=time.time(), dt=time.monotonic() - t0)
        if plan is not None:
            out["plan"] = dict(position=plan.position, samples=plan.samples, slot=rank * G + i, ix=plan.indices,
                               policy=plan.policy, lr_scale=plan.lr_scale)
        evs = [{"kind": e.kind, "text": e.text, "bytes": e.bytes, "took": e.took_s} for e in c.events()]
        if evs:
            out["events"] = evs
        if ok and (c.committed_step % args.eval_every == 0 or c.committed_step == args.steps):
            # Every rank of a group evaluates (FSDP gathers the layers).
            out["val"] = common.evaluate(net, val, args.batch, args.block, device, args.eval_batches)
        common.emit(**out)
    if c.committed_step >= args.steps:
        try:
            c.finish()
        except ftcomm.FtcommError:
            pass
    common.emit(finished=True)
    if cuda:
        torch.cuda.synchronize()
    c.close()
    if shard is not None:
        shard.finalize()
    common.emit(done=True)


def _registered(model, opt):
    from ftcomm.ft_torch import local_tensor
    out = [local_tensor(p) for p in model.parameters()]
    for st in opt.state.values():
        out += [local_tensor(v) for v in st.values() if isinstance(v, torch.Tensor)]
    return out


# ---------------------------------------------------------------- launcher

class Job:
    """The rank processes of one run: groups × group_size, by (group, rank)."""

    def __init__(self, args, co, job: str, out_dir: str):
        self.args, self.job, self.out_dir = args, job, out_dir
        self.env = common.replica_env({"FTCOMM_CREDENTIALS": co.credentials, "FTCOMM_SECRET": "train-hsdp-" + job,
                                       "OMP_NUM_THREADS": str(max(1, args.threads))})
        self.procs = {}
        self.stores = {}

    def name(self, g: int) -> str:
        """Group g's name: g0, g1, … for the replica groups, s0, … for the spares."""
        return "s%d" % (g - self.args.groups) if g >= self.args.groups else "g%d" % g

    def label(self, k) -> str:
        return "%s.%d" % (self.name(k[0]), k[1])

    def start_group(self, g: int, go: bool = True) -> None:
        """Start group g's ranks (a spare group's for g >= groups) and wait
        until each is ready."""
        import ftcomm
        a = self.args
        if g in self.stores:
            self.stores[g].close()
        st = self.stores[g] = ftcomm.Store.listen("127.0.0.1:0")  # the group's rendezvous, new each start
        base = [sys.executable, os.path.abspath(__file__), "--job", self.job, "--group", str(g),
                "--group-store", st.address] + a.passthrough + (["--spare"] if g >= a.groups else [])
        for i in range(a.group_size):
            self.procs[(g, i)] = common.Proc(self.label((g, i)), base + ["--group-rank", str(i)], self.env,
                                             os.path.join(self.out_dir, "%s-%s.log" % (self.job, self.label((g, i)))))
        for i in range(a.group_size):
            p = self.procs[(g, i)]
            msg = p.q.get(timeout=600)
            if not msg or not msg.get("ready"):
                raise SystemExit("rank %d of group %s (%s) did not start; see %s" % (i, self.name(g), self.job, p.log.name))
            self.ready_bytes = msg.get("bytes", 0)
        if go:
            self.go(g)

    def go(self, g: int) -> None:
        for i in range(self.args.group_size):
            self.procs[(g, i)].send("go")

    def kill_group(self, g: int, first: int) -> None:
        """SIGKILL rank first of group g, then the rest of the group."""
        self.procs[(g, first)].kill()
        for i in range(self.args.group_size):
            if i != first:
                self.procs[(g, i)].kill()

    def close(self) -> None:
        for p in self.procs.values():
            p.close()
        for s in self.stores.values():
            s.close()


def post_settings(co, job: str, *changes: str) -> dict:
    """`ftcoord job set` through the coordinator's API."""
    import urllib.request
    req = urllib.request.Request(co.url + "/api/v1/jobs/%s/settings" % job, method="POST",
                                 data=json.dumps({"changes": list(changes), "by": "train_hsdp"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def run_job(args, co, job: str, kill: bool, out_dir: str) -> dict:
    j = Job(args, co, job, out_dir)
    # The spare groups only in the run with the failure: in the other they
    # would wait, idle, to the end.
    spares = args.spares if kill else 0
    for g in range(args.groups + spares):
        j.start_group(g, go=False)
    for g in range(args.groups + spares):  # every group registered: they start together
        j.go(g)
    victim_group, victim_rank = args.groups - 1, args.group_size - 1
    kill_step = int(args.steps * args.kill_at)
    res = {"loss": {}, "val": {}, "events": [], "kill_step": None, "restart_step": None, "r0": [], "recs": [],
           "promoted": None, "spares": spares, "state_bytes": j.ready_bytes, "policies": {}}
    train, _ = common.load_corpus(args.corpus, args.corpus_bytes)
    cover = common.Coverage(common.sequences(train, args.block))
    killed_at = restarted = None
    killed = set()  # Proc objects the launcher killed: their end is no one's done
    done, finished = set(), set()
    first_finished = None
    t_start = time.time()
    while len(done) < len(j.procs):
        if first_finished is not None and time.time() - first_finished > 180:
            for k, p in j.procs.items():
                if k not in finished and k not in done:
                    print("  %s: rank %s still running after the job ended; stopping it" % (job, j.label(k)), flush=True)
                    p.kill()
                    done.add(k)
            first_finished = None
        for k, p in list(j.procs.items()):
            while True:
                try:
                    m = p.q.get(timeout=0.02)
                except Exception:
                    break
                if m is None:
                    if p not in killed:
                        done.add(k)
                    break
                if m.get("finished"):
                    finished.add(k)
                    first_finished = first_finished or time.time()
                    continue
                if m.get("done"):
                    done.add(k)
                    continue
                if "step" not in m:
                    continue
                res["recs"].append({"who": j.label(k), "step": m["step"], "committed": m["committed"],
                                    "participants": m["participants"], "t": m["t"]})
                if m["committed"] and "plan" in m:
                    pl = m["plan"]
                    cover.add(m["step"], pl["position"], pl["samples"], pl["slot"], pl["ix"])
                    if pl["slot"] == 0:
                        key = "%s/%d" % (pl["policy"], m["participants"])
                        res["policies"][key] = res["policies"].get(key, 0) + 1
                for e in m.get("events", []):
                    res["events"].append(dict(e, rank=j.label(k), step=m["step"], t=m["t"] - t_start))
                    if e["kind"] == "promoted" and res["promoted"] is None:
                        res["promoted"] = {"who": j.name(k[0]), "step": m["step"],
                                           "after_kill_s": m["t"] - killed_at if killed_at else None}
                        print("  %s: %s, committing from step %d" % (job, e["text"], m["step"]), flush=True)
                if m.get("rank") == 0 and k[1] == 0:  # the step's first group (g0 until the job changes) speaks
                    res["r0"].append([m["step"], m["committed"], m["participants"], m["epoch"],
                                      round(m["t"] - t_start, 4)])
                    if m["committed"]:
                        res["loss"][m["step"]] = m["loss"]
                        if "val" in m:
                            res["val"][m["step"]] = m["val"]
                        if m["step"] % 100 == 0:
                            print("  %s: step %d loss %.3f (%d groups)%s" % (
                                job, m["step"], m["loss"], m["participants"],
                                "  val %.3f" % m["val"] if "val" in m else ""), flush=True)
                if (kill and k == (victim_group, victim_rank) and killed_at is None and m["committed"]
                        and m["step"] >= kill_step):
                    killed_at = time.time()
                    killed.update(j.procs[(victim_group, r)] for r in range(args.group_size))
                    j.kill_group(victim_group, victim_rank)
                    res["kill_step"] = m["step"]
                    res["killed_at"] = killed_at
                    print("  %s: rank %d of group %d SIGKILLed after committing step %d; the rest of its group "
                          "ended" % (job, victim_rank, victim_group, m["step"]), flush=True)
                    if args.restart_delay < 0:
                        done.update((victim_group, r) for r in range(args.group_size))
                    else:
                        time.sleep(args.restart_delay)  # the launcher's pace, not a synchronisation
                        j.start_group(victim_group)  # plain replicas: they wait as a spare if one took their place
                        restarted = time.time()
                        res["restart_step"] = max([x[0] for x in res["r0"]] or [0])
                        print("  %s: group %d restarted (%.1f s after the kill)%s" % (
                            job, victim_group, restarted - killed_at,
                            "; it waits as a spare if one took its place" if spares else ""), flush=True)
                    break
        if len(finished | done) == len(j.procs):
            for p in j.procs.values():
                p.send("exit")
    j.close()
    res["seconds"] = time.time() - t_start
    res["final_val"] = res["val"].get(args.steps)
    res["coverage"] = cover.summary()
    if killed_at is not None:
        survivors = ["g%d.%d" % (g, i) for g in range(args.groups - 1) for i in range(args.group_size)]
        res["capacity"] = common.capacity(res["recs"], killed_at, args.groups, survivors, args.group_size)
        victim = "g%d." % victim_group
        res["restart_stepped"] = any(r["who"].startswith(victim) and r["t"] > (restarted or killed_at)
                                     for r in res["recs"])
    return res


FAILURE = "one rank killed, its group restarted"


def report(args, runs: dict, out_dir: str) -> None:
    colours = {"no failure": "#1f77b4", FAILURE: "#d62728"}
    series = []
    for name, r in runs.items():
        st = sorted(r["loss"])
        series.append(("%s: training loss (EMA)" % name, st, common.ema([r["loss"][s] for s in st]), colours[name], False))
        vs = sorted(r["val"])
        series.append(("%s: validation loss" % name, vs, [r["val"][s] for s in vs], colours[name], True))
    f = runs.get(FAILURE)
    vlines = []
    if f and f["kill_step"] is not None:
        vlines = [(f["kill_step"], "kill")]
        if f["promoted"]:
            vlines.append((f["promoted"]["step"], "%s promoted" % f["promoted"]["who"]))
        else:
            vlines.append((f["restart_step"] or f["kill_step"], "restart"))
    what = "FT-HSDP (FSDP2 in %d-rank groups)" % args.group_size if args.mode == "hsdp" else "FT-DDP"
    common.svg_plot(os.path.join(out_dir, "loss.svg"), series, vlines,
                    title="GPT (%d layers, d=%d), %s, %d groups, %s" % (args.layers, args.d, what, args.groups,
                                                                        args.device),
                    xlabel="committed step", ylabel="loss (nats/byte)")
    cap = []
    for name, r in runs.items():
        rows = [(x[0], x[2]) for x in r["r0"] if x[1]]
        cap.append(("%s: groups in the step" % name, [a for a, _ in rows], [b for _, b in rows], colours[name],
                    name != FAILURE))
    common.svg_plot(os.path.join(out_dir, "capacity.svg"), cap, vlines,
                    title="Capacity: replica groups per committed step, %d groups + %d spare group(s)" % (
                        args.groups, args.spares),
                    xlabel="committed step", ylabel="replica groups")
    lines = ["train_hsdp: %s, %d groups x %d ranks + %d spare group(s) on %s, %d steps, batch %d x %d bytes per rank, "
             "batch policy %s" % (what, args.groups, args.group_size, args.spares, args.device, args.steps, args.batch,
                                  args.block, args.batch_policy)]
    for name, r in runs.items():
        lines.append("%-38s final validation loss %.4f  (%.1f s)" % (name, r["final_val"] or float("nan"), r["seconds"]))
        lines.append("%-38s %s" % ("", common.Coverage.line(r["coverage"])))
        lines.append("%-38s steps by batch policy/groups: %s" % ("", ", ".join(
            "%s %d" % kv for kv in sorted(r["policies"].items()))))
    if f and "no failure" in runs and runs["no failure"]["final_val"] and f["final_val"]:
        a, b = runs["no failure"]["final_val"], f["final_val"]
        lines.append("difference: %+.2f %% (target: within 2 %%)" % (100 * (b - a) / a))
    if f and f["kill_step"] is not None:
        c = f["capacity"]
        lines.append("killed rank %d of group %d after its step %d (the rest of its group ended):" % (
            args.group_size - 1, args.groups - 1, f["kill_step"]))
        lines.append("  surviving groups' first commit without it  %s after the kill" % common.fmt_s(c["survivor_commit_s"]))
        lines.append("  capacity back (full size committed)        %s after the kill" % common.fmt_s(c["capacity_back_s"]))
        lines.append("  GPU-seconds lost                           %s (survivors' stalls %s + %d GPU(s) missing "
                     "until full size)" % ("n/a" if c["gpu_s_lost"] is None else "%.3f" % c["gpu_s_lost"],
                                           ", ".join("%s %s + grow %s" % (w, common.fmt_s(v), common.fmt_s(c["grow_stall_s"].get(w))) for w, v in sorted(c["stall_s"].items())),
                                           args.group_size))
        if f["promoted"]:
            lines.append("  spare group %s promoted in its place, first commit at step %d; the restarted g%d %s" % (
                f["promoted"]["who"], f["promoted"]["step"], args.groups - 1,
                "took part later" if f.get("restart_stepped") else "waited as a spare to the end"))
        else:
            alone = [x[0] for x in f["r0"] if x[1] and x[2] < args.groups]
            lines.append("  no spare: the group restarted at once and rejoined %d steps later" % len(alone))
        heals = [e for e in f["events"] if e["kind"] == "healed"]
        for e in heals:
            gbps = e["bytes"] / e["took"] / 1e9 if e["took"] else float("nan")
            lines.append("  %s healed %.1f MB in %.3f s (%.2f GB/s) at step %d" % (
                e["rank"], e["bytes"] / 1e6, e["took"], gbps, e["step"]))
        for e in f["events"]:
            if (e["kind"] in ("reconfigured", "rolled back", "commit failed") and e["rank"] == "g0.0"
                    or e["kind"] == "promoted"):
                lines.append("  %s step %d: %s" % (e["rank"], e["step"], e["text"]))
    lines.append("capacity timeline (committed step: replica groups):")
    for name, r in runs.items():
        lines.append("  %-38s %s" % (name, common.timeline([(x[0], x[2]) for x in r["r0"] if x[1]])))
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(text + "\n")
        fh.write(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("loss", "r0", "recs")}
                             for k, v in runs.items()}) + "\n")
    print(text)
    print("plots: %s, %s" % (os.path.join(out_dir, "loss.svg"), os.path.join(out_dir, "capacity.svg")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--groups", type=int, default=2, help="replica groups")
    ap.add_argument("--group-size", type=int, default=None,
                    help="ranks per group (CUDA: 2 with 4 GPUs, else 1; CPU: 1, FT-DDP)")
    ap.add_argument("--mode", choices=["hsdp", "ddp"], default=None, help="hsdp on CUDA, ddp on CPU (default)")
    ap.add_argument("--steps", type=int, default=None, help="committed steps (200 CPU, 1500 CUDA)")
    ap.add_argument("--kill-at", type=float, default=0.4, help="kill a rank of the last group after this fraction")
    ap.add_argument("--restart-delay", type=float, default=0, help="seconds between the kill and the restart (<0: never)")
    ap.add_argument("--spares", type=int, default=1,
                    help="spare groups started with the job, promoted when a group dies (0: none; the restart rejoins)")
    ap.add_argument("--no-gossip", dest="gossip", action="store_false")
    ap.add_argument("--no-prepared-grow", dest="prepared_grow", action="store_false",
                    help="job setting ftcomm.prepared_grow=false: a grow stops the survivors while its comms are made")
    ap.add_argument("--no-baseline", action="store_true", help="only the run with the failure")
    ap.add_argument("--no-warm-spare", dest="warm_spare", action="store_false",
                    help="a CUDA spare waits without its warm-up step (common.warm_spare), for comparison")
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank and step (8 CPU, 16 CUDA)")
    ap.add_argument("--block", type=int, default=None, help="bytes per sequence (64 CPU, 256 CUDA)")
    ap.add_argument("--layers", type=int, default=None, help="2 CPU, 8 CUDA")
    ap.add_argument("--d", type=int, default=None, help="model width (64 CPU, 512 CUDA)")
    ap.add_argument("--heads", type=int, default=None, help="4 CPU, 8 CUDA")
    ap.add_argument("--batch-policy", choices=["replica", "global"], default="replica",
                    help="with fewer groups: keep each rank's batch (the lr scaled by the global batch) or the global "
                         "batch (the survivors take more micro-batches)")
    ap.add_argument("--lr", type=float, default=None, help="3e-3 CPU, 1e-3 CUDA")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=None, help="25 CPU, 100 CUDA")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--op-timeout", type=float, default=30)
    ap.add_argument("--corpus", default=common.repo_root())
    ap.add_argument("--corpus-bytes", type=int, default=4 << 20)
    ap.add_argument("--out", default="hsdp-report")
    ap.add_argument("--group", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--group-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--group-store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="hsdp", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if args.group_size is None:
        args.group_size = (2 if torch.cuda.device_count() >= 2 * args.groups else 1) if cuda else 1
    if args.mode is None:
        args.mode = "hsdp" if cuda else "ddp"
    if args.mode == "ddp" and args.group_size != 1:
        raise SystemExit("--mode ddp runs one rank per replica (--group-size 1)")
    for k, cpu, gpu in (("eval_every", 25, 100), ("steps", 200, 1500), ("batch", 8, 16), ("block", 64, 256),
                        ("layers", 2, 8), ("d", 64, 512), ("heads", 4, 8), ("lr", 3e-3, 1e-3)):
        if getattr(args, k) is None:
            setattr(args, k, gpu if cuda else cpu)
    if args.group is not None:
        rank_main(args)
        return
    if cuda and torch.cuda.device_count() < args.groups * args.group_size:
        raise SystemExit("%d groups x %d ranks need %d GPUs; %d here" % (
            args.groups, args.group_size, args.groups * args.group_size, torch.cuda.device_count()))
    import ftcomm.coordinator
    args.passthrough = [a for a in sys.argv[1:]]
    for k in ("steps", "batch", "block", "layers", "d", "heads", "lr", "eval_every", "group_size", "mode"):
        args.passthrough += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    with ftcomm.coordinator.serve(join_timeout=2, gossip=args.gossip, log_level="off") as co:
        print("coordinator: %s (dashboard %s)" % (co.endpoints[0], co.dashboard), flush=True)
        if not args.no_baseline:
            print("job 1: no failure", flush=True)
            runs["no failure"] = run_job(args, co, "hsdp-baseline", False, args.out)
        print("job 2: a rank of group %d killed after %d%% of the steps, its group restarted; %d spare group(s)" % (
            args.groups - 1, 100 * args.kill_at, args.spares), flush=True)
        if not args.prepared_grow:
            post_settings(co, "hsdp-failure", "ftcomm.prepared_grow=false")
            print("  prepared grows off (ftcomm.prepared_grow=false)", flush=True)
        runs[FAILURE] = run_job(args, co, "hsdp-failure", True, args.out)
    report(args, runs, args.out)


if __name__ == "__main__":
    main()
