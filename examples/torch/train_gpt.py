#!/usr/bin/env python3
"""Data-parallel training of a small GPT on this repository's own text through
ftcomm.ft.Comm, with one replica SIGKILLed midway and restarted: it heals
from its peers and the job goes on. One command runs the job twice, without
and with the failure, and plots both losses:

    python3 examples/torch/train_gpt.py                 # CPU, 2 replicas (gloo)
    python3 examples/torch/train_gpt.py --device cuda   # one replica per GPU (nccl)

Writes torch-report/loss.svg and torch-report/summary.txt.
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
    device = torch.device("cuda", args.replica % torch.cuda.device_count()) if cuda else torch.device("cpu")
    train, val = common.load_corpus(args.corpus, args.corpus_bytes)
    model = common.GPT(args.layers, args.d, args.heads, args.block).to(device)
    flat = common.Flat(model, device)
    opt = common.AdamW(flat.n, device, lr=args.lr)
    c = ftcomm.ft.Comm(job=args.job, group="r%d" % args.replica, backend="nccl" if cuda else "gloo", device=device,
                       min_replicas=1, timeout=args.op_timeout, lease_ttl=2, heartbeat=1, gossip=args.gossip,
                       log_level="error")
    c.register("params", flat.params)
    c.register("adam.m", opt.m)
    c.register("adam.v", opt.v)
    c.register("adam.t", opt.t)
    common.emit(ready=True, params=flat.n)
    sys.stdin.readline()  # the launcher's go: every replica is registered
    while c.committed_step < args.steps:
        t0 = time.monotonic()
        try:
            c.step()
        except ftcomm.RolledBackError:
            pass  # healed to the job's history; the step has started
        except ftcomm.FinishedError:
            break  # another replica ended the run: no one steps again  # healed to the job's history; the step has started
        s = c.committed_step
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + s * 1009 + args.replica)
        x, y = common.batch(train, g, args.batch, args.block, device)
        flat.grads.zero_()
        loss = model(x, y)
        loss.backward()
        c.all_reduce(flat.grads, ReduceOp.AVG)
        ok = c.commit()
        if ok:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(flat.params, flat.grads, common.lr_at(s, args.steps, args.lr))
        out = dict(step=c.committed_step, committed=ok, loss=loss.item(), participants=c.participants,
                   epoch=c.epoch, t=time.time(), dt=time.monotonic() - t0)
        evs = [{"kind": e.kind, "text": e.text, "bytes": e.bytes, "took": e.took_s} for e in c.events()]
        if evs:
            out["events"] = evs
        if ok and args.replica == 0 and (c.committed_step % args.eval_every == 0 or c.committed_step == args.steps):
            out["val"] = common.evaluate(model, val, args.batch, args.block, device, args.eval_batches)
        common.emit(**out)
    # The end of the run, agreed: a peer still in its last step ends it,
    # and one behind stops (FinishedError) instead of waiting for us.
    if c.committed_step >= args.steps:
        c.finish()
    common.emit(finished=True)
    c.close()
    common.emit(done=True)


# ---------------------------------------------------------------- launcher


def run_job(args, co, job: str, kill: bool, out_dir: str) -> dict:
    env = common.replica_env({"FTCOMM_CREDENTIALS": co.credentials, "FTCOMM_SECRET": "train-gpt-" + job,
                              "OMP_NUM_THREADS": str(max(1, args.threads))})
    base = [sys.executable, os.path.abspath(__file__), "--job", job] + args.passthrough

    def start(i):
        p = common.Proc("r%d" % i, base + ["--replica", str(i)], env, os.path.join(out_dir, "%s-r%d.log" % (job, i)))
        msg = p.q.get(timeout=300)
        if not msg or not msg.get("ready"):
            raise SystemExit("replica %d of %s did not start; see %s" % (i, job, p.log.name))
        return p

    procs = [start(i) for i in range(args.replicas)]
    for p in procs:
        p.send("go")
    victim = args.replicas - 1
    kill_step = int(args.steps * args.kill_at)
    res = {"loss": {}, "val": {}, "events": [], "kill_step": None, "restart_step": None, "r0": []}
    killed_at = restarted = r0_done = first_finished = None
    done, finished = set(), set()
    t_start = time.time()
    while len(done) < args.replicas:
        if first_finished is not None and time.time() - first_finished > 120:
            # A replica still training two minutes after another finished
            # (it could not rejoin): stop it, let the others leave.
            for i, p in enumerate(procs):
                if i not in finished and i not in done:
                    print("  %s: replica %d still running after the job ended; stopping it" % (job, i), flush=True)
                    p.kill()
                    done.add(i)
                else:
                    p.send("exit")
            first_finished = None
        for i, p in enumerate(procs):
            while True:
                try:
                    m = p.q.get(timeout=0.05)
                except Exception:
                    break
                if m is None:
                    if i != victim or not kill or restarted is not None:
                        done.add(i)
                    break
                if m.get("finished"):
                    finished.add(i)
                    first_finished = first_finished or time.time()
                    if len(finished | done) == args.replicas:
                        for q in procs:
                            q.send("exit")
                    continue
                if m.get("done"):
                    done.add(i)
                    if i == 0:
                        r0_done = time.time()
                    continue
                if "step" not in m:
                    continue
                for e in m.get("events", []):
                    res["events"].append(dict(e, replica=i, step=m["step"], t=m["t"] - t_start))
                if i == 0:
                    res["r0"].append([m["step"], m["committed"], m["participants"], m["epoch"], round(m["t"] - t_start, 4)])
                    if m["committed"]:
                        res["loss"][m["step"]] = m["loss"]
                        if "val" in m:
                            res["val"][m["step"]] = m["val"]
                        if killed_at is not None and "survivor_commit_s" not in res and m["participants"] < args.replicas:
                            # The survivor's first commit without the dead
                            # replica, on its own clock.
                            res["survivor_commit_s"] = m["t"] - killed_at
                    if m["committed"] and m["step"] % 250 == 0:
                        print("  %s: step %d loss %.3f (%d replicas)%s" % (job, m["step"], m["loss"], m["participants"],
                              "  val %.3f" % m["val"] if "val" in m else ""), flush=True)
                if kill and i == victim and killed_at is None and m["committed"] and m["step"] >= kill_step:
                    killed_at = time.time()  # the signal, not the end of the process's teardown
                    p.kill()
                    res["kill_step"] = m["step"]
                    print("  %s: replica %d SIGKILLed after committing step %d" % (job, victim, m["step"]), flush=True)
                    if args.restart_delay >= 0:
                        time.sleep(args.restart_delay)  # the launcher's pace, not a synchronisation
                        procs[victim] = start(victim)
                        procs[victim].send("go")
                        restarted = time.time()
                        res["restart_step"] = max([x[0] for x in res["r0"]] or [0])
                        print("  %s: replica %d restarted (%.1f s after the kill)" % (job, victim, restarted - killed_at), flush=True)
                    break
    for p in procs:
        p.close()
    res["seconds"] = time.time() - t_start
    res["final_val"] = res["val"].get(args.steps)
    return res


def report(args, runs: dict, out_dir: str) -> None:
    series = []
    colours = {"no failure": "#1f77b4", "one replica killed and restarted": "#d62728"}
    for name, r in runs.items():
        steps = sorted(r["loss"])
        series.append(("%s: training loss (EMA)" % name, steps, common.ema([r["loss"][s] for s in steps]), colours[name], False))
        vs = sorted(r["val"])
        series.append(("%s: validation loss" % name, vs, [r["val"][s] for s in vs], colours[name], True))
    f = runs.get("one replica killed and restarted")
    vlines = []
    if f and f["kill_step"] is not None:
        vlines = [(f["kill_step"], "kill"), (f["restart_step"] or f["kill_step"], "restart")]
    common.svg_plot(os.path.join(out_dir, "loss.svg"), series, vlines,
                    title="GPT (%d layers, d=%d) on this repository's text, %d replicas, %s" % (
                        args.layers, args.d, args.replicas, args.device),
                    xlabel="committed step", ylabel="loss (nats/byte)")
    lines = ["train_gpt: %d replicas on %s, %d steps, batch %d × %d bytes per replica" % (
        args.replicas, args.device, args.steps, args.batch, args.block)]
    for name, r in runs.items():
        lines.append("%-34s final validation loss %.4f  (%.1f s)" % (name, r["final_val"] or float("nan"), r["seconds"]))
    if f and "no failure" in runs and runs["no failure"]["final_val"] and f["final_val"]:
        a, b = runs["no failure"]["final_val"], f["final_val"]
        lines.append("difference: %+.2f %% (target: within 2 %%)" % (100 * (b - a) / a))
    if f and f["kill_step"] is not None:
        alone = [x[0] for x in f["r0"] if x[1] and x[2] < args.replicas]
        lines.append("killed replica %d after its step %d; the survivor's first commit without it %.3f s after the kill; "
                     "restarted at once, it rejoined %d steps later (steps %d-%d had fewer replicas)" % (
                         args.replicas - 1, f["kill_step"], f.get("survivor_commit_s", float("nan")), len(alone),
                         min(alone, default=0), max(alone, default=0)))
        for e in f["events"]:
            if e["kind"] in ("healed", "reconfigured", "rolled back", "commit failed"):
                lines.append("  r%d step %d: %s" % (e["replica"], e["step"], e["text"]))
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(text + "\n")
        fh.write(json.dumps({k: {kk: vv for kk, vv in v.items() if kk not in ("loss", "r0")} for k, v in runs.items()}) + "\n")
    print(text)
    print("plot: %s" % os.path.join(out_dir, "loss.svg"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="committed steps (default 300 on CPU, 2500 on CUDA)")
    ap.add_argument("--kill-at", type=float, default=0.4, help="kill the last replica after this fraction of the steps")
    ap.add_argument("--restart-delay", type=float, default=0, help="seconds between the kill and the restart (<0: never)")
    ap.add_argument("--no-gossip", dest="gossip", action="store_false",
                    help="detect deaths by lease expiry (2 s) and TCP errors only, not also by gossip (≈1 s)")
    ap.add_argument("--no-baseline", action="store_true", help="only the run with the failure")
    # Model and batch: small on CPU (2 shared cores train it in minutes),
    # larger on GPUs.
    ap.add_argument("--batch", type=int, default=None, help="sequences per replica and step (8 CPU, 32 CUDA)")
    ap.add_argument("--block", type=int, default=None, help="bytes per sequence (64 CPU, 128 CUDA)")
    ap.add_argument("--layers", type=int, default=None, help="2 CPU, 4 CUDA")
    ap.add_argument("--d", type=int, default=None, help="model width (64 CPU, 256 CUDA)")
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
        print("job 2: replica %d killed after %d%% of the steps and restarted" % (args.replicas - 1, 100 * args.kill_at), flush=True)
        runs["one replica killed and restarted"] = run_job(args, co, "gpt-failure", True, args.out)
    report(args, runs, args.out)


if __name__ == "__main__":
    main()
