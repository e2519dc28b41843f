#!/usr/bin/env python3
"""Data-parallel training of a small GPT on this repository's own text through
ftcomm.ft.Comm, with one replica SIGKILLed midway. A spare (--spares, default
1: a process started with the job, its model and optimizer built, waiting in
its first step) is promoted in its place, heals from its peers, and the job
is back at full size; the killed replica, restarted by the launcher as a
plain replica, waits as the next spare. With --spares 0 the restarted
replica heals and rejoins instead. The data follows the quorum
(ftcomm.ft.Sampler): each committed step reads the next sequences of the
epoch's permutation of the text, so the committed steps read each one once;
--batch-policy says what a step of fewer replicas does: "replica" keeps each
replica's batch (the learning rate scaled by the global batch, the linear
rule), "global" keeps the global batch (the survivors take more
micro-batches). One command runs the job twice, without and with the
failure, and plots both losses:

    python3 examples/torch/train_gpt.py                 # CPU, 2 replicas (gloo) + 1 spare
    python3 examples/torch/train_gpt.py --device cuda   # one replica per GPU (nccl); the spare on the last one's GPU

Writes torch-report/loss.svg, capacity.svg (replicas per step, both runs)
and summary.txt (besides the losses: the samples of the epoch the committed
steps covered, checked to be each read once, the survivors' first commit,
capacity back — kill → the first step committed at full size again — and the
GPU-seconds the kill cost).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import common

# ---------------------------------------------------------------- replica


def replica(args) -> None:
    import ftcomm
    import ftcomm.ft
    from ftcomm import ReduceOp

    torch.manual_seed(args.seed)  # the same initial parameters on every replica
    torch.set_num_threads(max(1, args.threads))
    cuda = args.device == "cuda"
    # A spare waits on the GPU of the replica the launcher kills (the last):
    # the GPU its death frees.
    gpu = args.replicas - 1 if args.spare else args.replica
    device = torch.device("cuda", gpu % torch.cuda.device_count()) if cuda else torch.device("cpu")
    train, val = common.load_corpus(args.corpus, args.corpus_bytes)
    model = common.GPT(args.layers, args.d, args.heads, args.block).to(device)
    flat = common.Flat(model, device)
    opt = common.AdamW(flat.n, device, lr=args.lr)
    name = "s%d" % (args.replica - args.replicas) if args.spare else "r%d" % args.replica
    c = ftcomm.ft.Comm(job=args.job, group=name, backend="nccl" if cuda else "gloo", device=device,
                       min_replicas=1, timeout=args.op_timeout, lease_ttl=2, heartbeat=1, gossip=args.gossip,
                       log_level="error", spare=args.spare)
    c.register("params", flat.params)
    c.register("adam.m", opt.m)
    c.register("adam.v", opt.v)
    c.register("adam.t", opt.t)
    # The data follows the quorum: each step reads the next samples of the
    # epoch's permutation, its position healed with the model.
    sampler = ftcomm.ft.Sampler(c, size=common.sequences(train, args.block), batch=args.batch, seed=args.seed,
                                policy=args.batch_policy, replicas=args.replicas)
    common.emit(ready=True, params=flat.n)
    sys.stdin.readline()  # the launcher's go: every replica is registered
    ended = False
    while c.committed_step < args.steps:
        t0 = time.monotonic()
        try:
            c.step()  # a spare's first step waits here until it is promoted
        except ftcomm.RolledBackError:
            pass  # healed to the job's history; the step has started
        except ftcomm.FinishedError:
            ended = True
            break  # another replica ended the run: no one steps again
        s = c.committed_step
        try:
            plan = sampler.plan()
        except ftcomm.NotParticipatingError:
            plan = None  # sitting out: the commit fails
        flat.grads.zero_()
        loss_sum, n = 0.0, 0
        for m in plan.micro if plan else ():
            if not m.indices:
                continue
            x, y = common.sample_batch(train, m.indices, args.block, device)
            loss = model(x, y)
            (loss * m.weight).backward()  # the step's gradient: the mean over its samples
            loss_sum, n = loss_sum + loss.item() * len(m.indices), n + len(m.indices)
        c.all_reduce(flat.grads, ReduceOp.AVG)
        ok = c.commit()
        if ok:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            # OptimizerWrapper's lr_scaling="linear" for this flat AdamW:
            # the learning rate follows the step's global batch.
            opt.step(flat.params, flat.grads, common.lr_at(s, args.steps, args.lr) * (plan.lr_scale if plan else 1.0))
        out = dict(step=c.committed_step, committed=ok, loss=loss_sum / n if n else float("nan"),
                   participants=c.participants, epoch=c.epoch, rank=c.rank, t=time.time(), dt=time.monotonic() - t0)
        if plan is not None:
            out["plan"] = dict(position=plan.position, samples=plan.samples, slot=c.rank, ix=plan.indices,
                               policy=plan.policy, lr_scale=plan.lr_scale)
        evs = [{"kind": e.kind, "text": e.text, "bytes": e.bytes, "took": e.took_s} for e in c.events()]
        if evs:
            out["events"] = evs
        # Rank 0 of the step evaluates: r0 at first, whoever has its rank
        # once the job changed.
        if ok and c.rank == 0 and (c.committed_step % args.eval_every == 0 or c.committed_step == args.steps):
            out["val"] = common.evaluate(model, val, args.batch, args.block, device, args.eval_batches)
        common.emit(**out)
    # The end of the run, agreed: a peer still in its last step ends it,
    # and one behind stops (FinishedError) instead of waiting for us.
    if c.committed_step >= args.steps and not ended:
        try:
            c.finish()
        except ftcomm.FtcommError:
            pass
    common.emit(finished=True)
    c.close()
    common.emit(done=True)


# ---------------------------------------------------------------- launcher


def run_job(args, co, job: str, kill: bool, out_dir: str) -> dict:
    env = common.replica_env({"FTCOMM_CREDENTIALS": co.credentials, "FTCOMM_SECRET": "train-gpt-" + job,
                              "OMP_NUM_THREADS": str(max(1, args.threads))})
    base = [sys.executable, os.path.abspath(__file__), "--job", job] + args.passthrough

    def start(name):
        i = int(name[1:]) + (args.replicas if name[0] == "s" else 0)
        extra = ["--spare"] if name[0] == "s" else []
        p = common.Proc(name, base + ["--replica", str(i)] + extra, env, os.path.join(out_dir, "%s-%s.log" % (job, name)))
        msg = p.q.get(timeout=300)
        if not msg or not msg.get("ready"):
            raise SystemExit("%s of %s did not start; see %s" % (name, job, p.log.name))
        return p

    # The spares only in the run with the failure: in the other they would
    # wait, idle, to the end.
    names = ["r%d" % i for i in range(args.replicas)] + ["s%d" % k for k in range(args.spares if kill else 0)]
    procs = {n: start(n) for n in names}
    for p in procs.values():
        p.send("go")
    victim = "r%d" % (args.replicas - 1)
    kill_step = int(args.steps * args.kill_at)
    res = {"loss": {}, "val": {}, "events": [], "kill_step": None, "restart_step": None, "r0": [], "recs": [],
           "promoted": None, "spares": len(names) - args.replicas, "policies": {}}
    train, _ = common.load_corpus(args.corpus, args.corpus_bytes)
    cover = common.Coverage(common.sequences(train, args.block))
    killed_at = restarted = None
    killed = set()  # Proc objects the launcher killed: their end is no one's done
    done, finished = set(), set()
    first_finished = None
    t_start = time.time()
    while len(done) < len(procs):
        if first_finished is not None and time.time() - first_finished > 120:
            # A process still running two minutes after another finished
            # (it could not rejoin): stop it, let the others leave.
            for n, p in procs.items():
                if n not in finished and n not in done:
                    print("  %s: %s still running after the job ended; stopping it" % (job, n), flush=True)
                    p.kill()
                    done.add(n)
                else:
                    p.send("exit")
            first_finished = None
        for n, p in list(procs.items()):
            while True:
                try:
                    m = p.q.get(timeout=0.05)
                except Exception:
                    break
                if m is None:
                    if p not in killed:
                        done.add(n)
                    break
                if m.get("finished"):
                    finished.add(n)
                    first_finished = first_finished or time.time()
                    if len(finished | done) == len(procs):
                        for q in procs.values():
                            q.send("exit")
                    continue
                if m.get("done"):
                    done.add(n)
                    continue
                if "step" not in m:
                    continue
                res["recs"].append({"who": n, "step": m["step"], "committed": m["committed"],
                                    "participants": m["participants"], "t": m["t"]})
                if m["committed"] and "plan" in m:
                    pl = m["plan"]
                    cover.add(m["step"], pl["position"], pl["samples"], pl["slot"], pl["ix"])
                    k = "%s/%d" % (pl["policy"], m["participants"])
                    res["policies"][k] = res["policies"].get(k, 0) + (m.get("rank") == 0)
                for e in m.get("events", []):
                    res["events"].append(dict(e, replica=n, step=m["step"], t=m["t"] - t_start))
                    if e["kind"] == "promoted" and res["promoted"] is None:
                        res["promoted"] = {"who": n, "step": m["step"],
                                           "after_kill_s": m["t"] - killed_at if killed_at else None}
                        print("  %s: %s, committing from step %d" % (job, e["text"], m["step"]), flush=True)
                if m.get("rank") == 0:  # the step's rank 0 (r0 until the job changes) speaks for the job
                    res["r0"].append([m["step"], m["committed"], m["participants"], m["epoch"], round(m["t"] - t_start, 4)])
                    if m["committed"]:
                        res["loss"][m["step"]] = m["loss"]
                        if "val" in m:
                            res["val"][m["step"]] = m["val"]
                    if m["committed"] and m["step"] % 250 == 0:
                        print("  %s: step %d loss %.3f (%d replicas)%s" % (job, m["step"], m["loss"], m["participants"],
                              "  val %.3f" % m["val"] if "val" in m else ""), flush=True)
                if kill and n == victim and killed_at is None and m["committed"] and m["step"] >= kill_step:
                    killed_at = time.time()  # the signal, not the end of the process's teardown
                    killed.add(p)
                    p.kill()
                    res["kill_step"] = m["step"]
                    res["killed_at"] = killed_at
                    print("  %s: %s SIGKILLed after committing step %d" % (job, victim, m["step"]), flush=True)
                    if args.restart_delay < 0:
                        done.add(victim)
                    else:
                        time.sleep(args.restart_delay)  # the launcher's pace, not a synchronisation
                        procs[victim] = start(victim)  # a plain replica: it waits as a spare if one took its place
                        procs[victim].send("go")
                        restarted = time.time()
                        res["restart_step"] = max([x[0] for x in res["r0"]] or [0])
                        print("  %s: %s restarted (%.1f s after the kill)%s" % (
                            job, victim, restarted - killed_at,
                            "; it waits as a spare if one took its place" if res["spares"] else ""), flush=True)
                    break
    for p in procs.values():
        p.close()
    res["seconds"] = time.time() - t_start
    res["final_val"] = res["val"].get(args.steps)
    res["coverage"] = cover.summary()
    if killed_at is not None:
        res["capacity"] = common.capacity(res["recs"], killed_at, args.replicas,
                                          ["r%d" % i for i in range(args.replicas - 1)], 1)
        res["restart_stepped"] = any(r["who"] == victim and r["t"] > (restarted or killed_at) for r in res["recs"])
    return res


FAILURE = "one replica killed and restarted"


def report(args, runs: dict, out_dir: str) -> None:
    series = []
    colours = {"no failure": "#1f77b4", FAILURE: "#d62728"}
    for name, r in runs.items():
        steps = sorted(r["loss"])
        series.append(("%s: training loss (EMA)" % name, steps, common.ema([r["loss"][s] for s in steps]), colours[name], False))
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
    common.svg_plot(os.path.join(out_dir, "loss.svg"), series, vlines,
                    title="GPT (%d layers, d=%d) on this repository's text, %d replicas, %s" % (
                        args.layers, args.d, args.replicas, args.device),
                    xlabel="committed step", ylabel="loss (nats/byte)")
    cap = []
    for name, r in runs.items():
        rows = [(x[0], x[2]) for x in r["r0"] if x[1]]
        cap.append(("%s: replicas in the step" % name, [a for a, _ in rows], [b for _, b in rows], colours[name],
                    name != FAILURE))
    common.svg_plot(os.path.join(out_dir, "capacity.svg"), cap, vlines,
                    title="Capacity: replicas per committed step, %d replicas + %d spare(s)" % (args.replicas, args.spares),
                    xlabel="committed step", ylabel="replicas")
    lines = ["train_gpt: %d replicas + %d spare(s) on %s, %d steps, batch %d × %d bytes per replica, batch policy %s" % (
        args.replicas, args.spares, args.device, args.steps, args.batch, args.block, args.batch_policy)]
    for name, r in runs.items():
        lines.append("%-34s final validation loss %.4f  (%.1f s)" % (name, r["final_val"] or float("nan"), r["seconds"]))
        lines.append("%-34s %s" % ("", common.Coverage.line(r["coverage"])))
        lines.append("%-34s steps by batch policy/replicas: %s" % ("", ", ".join(
            "%s %d" % kv for kv in sorted(r["policies"].items()))))
    if f and "no failure" in runs and runs["no failure"]["final_val"] and f["final_val"]:
        a, b = runs["no failure"]["final_val"], f["final_val"]
        lines.append("difference: %+.2f %% (target: within 2 %%)" % (100 * (b - a) / a))
    if f and f["kill_step"] is not None:
        c = f["capacity"]
        victim = "r%d" % (args.replicas - 1)
        lines.append("killed %s after its step %d:" % (victim, f["kill_step"]))
        lines.append("  survivors' first commit without it   %s after the kill" % common.fmt_s(c["survivor_commit_s"]))
        lines.append("  capacity back (full size committed)  %s after the kill" % common.fmt_s(c["capacity_back_s"]))
        lines.append("  GPU-seconds lost                     %s (stalls %s + 1 GPU missing until full size)" % (
            "n/a" if c["gpu_s_lost"] is None else "%.3f" % c["gpu_s_lost"],
            ", ".join("%s %s + grow %s" % (w, common.fmt_s(v), common.fmt_s(c["grow_stall_s"].get(w))) for w, v in sorted(c["stall_s"].items()))))
        if f["promoted"]:
            lines.append("  %s promoted in its place, first commit at step %d; the restarted %s %s" % (
                f["promoted"]["who"], f["promoted"]["step"], victim,
                "took part later" if f.get("restart_stepped") else "waited as a spare to the end"))
        else:
            alone = [x[0] for x in f["r0"] if x[1] and x[2] < args.replicas]
            lines.append("  no spare: restarted at once, it rejoined %d steps later (steps %d-%d had fewer replicas)" % (
                len(alone), min(alone, default=0), max(alone, default=0)))
        for e in f["events"]:
            if e["kind"] in ("healed", "reconfigured", "rolled back", "commit failed", "promoted"):
                lines.append("  %s step %d: %s" % (e["replica"], e["step"], e["text"]))
    lines.append("capacity timeline (committed step: replicas):")
    for name, r in runs.items():
        lines.append("  %-34s %s" % (name, common.timeline([(x[0], x[2]) for x in r["r0"] if x[1]])))
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
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="committed steps (default 300 on CPU, 2500 on CUDA)")
    ap.add_argument("--kill-at", type=float, default=0.4, help="kill the last replica after this fraction of the steps")
    ap.add_argument("--restart-delay", type=float, default=0, help="seconds between the kill and the restart (<0: never)")
    ap.add_argument("--spares", type=int, default=1,
                    help="spare replicas started with the job, promoted when one dies (0: none; the restart rejoins)")
    ap.add_argument("--no-gossip", dest="gossip", action="store_false",
                    help="detect deaths by lease expiry (2 s) and TCP errors only, not also by gossip (≈1 s)")
    ap.add_argument("--no-baseline", action="store_true", help="only the run with the failure")
    # Model and batch: small on CPU (2 shared cores train it in minutes),
    # larger on GPUs.
    ap.add_argument("--batch", type=int, default=None, help="sequences per replica and step (8 CPU, 32 CUDA)")
    ap.add_argument("--block", type=int, default=None, help="bytes per sequence (64 CPU, 128 CUDA)")
    ap.add_argument("--layers", type=int, default=None, help="2 CPU, 4 CUDA")
    ap.add_argument("--d", type=int, default=None, help="model width (64 CPU, 256 CUDA)")
    ap.add_argument("--batch-policy", choices=["replica", "global"], default="replica",
                    help="with fewer replicas: keep each replica's batch (the lr scaled by the global batch) or the "
                         "global batch (the survivors take more micro-batches)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--eval-every", type=int, default=None, help="committed steps between evaluations (25 CPU, 100 CUDA)")
    ap.add_argument("--eval-batches", type=int, default=32, help="validation batches per evaluation (fixed)")
    ap.add_argument("--op-timeout", type=float, default=20)
    ap.add_argument("--corpus", default=common.repo_root(), help="a directory whose .go and .md files are the text")
    ap.add_argument("--corpus-bytes", type=int, default=2 << 20)
    ap.add_argument("--out", default="torch-report")
    ap.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="gpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    for k, cpu, gpu in (("eval_every", 25, 100), ("steps", 300, 2500), ("batch", 8, 32), ("block", 64, 128), ("layers", 2, 4), ("d", 64, 256)):
        if getattr(args, k) is None:
            setattr(args, k, gpu if cuda else cpu)
    if args.replica is not None:
        replica(args)
        return
    import ftcomm.coordinator
    args.passthrough = [a for a in sys.argv[1:]]
    for k in ("steps", "batch", "block", "layers", "d", "eval_every"):
        args.passthrough += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    # join_timeout: a new quorum waits this long for live replicas that have
    # not asked yet, so a replica slowed down by a busy machine is not left
    # out of the first one.
    with ftcomm.coordinator.serve(join_timeout=2, gossip=args.gossip, log_level="off") as co:
        print("coordinator: %s (dashboard %s)" % (co.endpoints[0], co.dashboard), flush=True)
        if not args.no_baseline:
            print("job 1: no failure", flush=True)
            runs["no failure"] = run_job(args, co, "gpt-baseline", False, args.out)
        print("job 2: replica %d killed after %d%% of the steps and restarted; %d spare(s)" % (
            args.replicas - 1, 100 * args.kill_at, args.spares), flush=True)
        runs[FAILURE] = run_job(args, co, "gpt-failure", True, args.out)
    report(args, runs, args.out)


if __name__ == "__main__":
    main()
