#!/usr/bin/env python3
"""Streaming DiLoCo (Douillard et al. 2025) in PyTorch over ftcomm.ft.Comm:
replicas train the GPT of train_gpt.py locally with AdamW and, every H/F
inner steps, synchronise one of F parameter fragments: the outer gradient
(global − local) is averaged across replicas (overlapped with τ more inner
steps), an outer SGD with Nesterov momentum updates the global fragment,
and α blends it into the local one. Each sync is one ft step: a replica
that dies costs the others one discarded sync; its restart heals the global
parameters and momentum from them.

    python3 examples/torch/diloco.py                 # CPU, 2 replicas, one killed and restarted
    python3 examples/torch/diloco.py --device cuda   # one replica per GPU

The algorithm mirrors ft/diloco (Go); here the outer loop is plain torch.
The replicas follow the job's settings while they run (``ftcoord job set
<job> lr=… outer_lr=… sync_every=…``): every replica takes a new version
from the same sync.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import common


def replica(args) -> None:
    import ftcomm
    import ftcomm.ft
    from ftcomm import ReduceOp

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", args.replica % torch.cuda.device_count()) if cuda else torch.device("cpu")
    train, val = common.load_corpus(args.corpus, args.corpus_bytes)
    model = common.GPT(args.layers, args.d, args.heads, args.block).to(device)
    flat = common.Flat(model, device)
    inner = common.AdamW(flat.n, device, lr=args.lr)
    glob = flat.params.clone()  # the job's parameters, synced fragment by fragment
    mom = torch.zeros_like(glob)  # the outer optimizer's momentum
    F = args.fragments
    bounds = [flat.n * f // F for f in range(F + 1)]
    c = ftcomm.ft.Comm(job=args.job, group="r%d" % args.replica, backend="nccl" if cuda else "gloo", device=device,
                       min_replicas=1, timeout=20, lease_ttl=2, heartbeat=1, gossip=args.gossip, log_level="error")
    c.register("global", glob)
    c.register("momentum", mom)
    common.emit(ready=True, params=flat.n)
    sys.stdin.readline()
    every = max(1, args.H // F)
    step_in = 0  # inner steps taken by this replica
    losses = []
    # The job's settings (ftcoord job set) may change lr, outer_lr and
    # sync_every (H) while it runs: every replica sees a new version from
    # the same sync, right after step(), and follows it there alike.
    tune = {"version": 0, "lr": args.lr, "outer_lr": args.outer_lr}

    def inner_step():
        nonlocal step_in
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step_in * 1009 + args.replica * 7 + c.committed_step)
        x, y = common.batch(train, g, args.batch, args.block, device)
        flat.grads.zero_()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        inner.step(flat.params, flat.grads, common.lr_at(c.committed_step * every, args.syncs * every, tune["lr"]))
        losses.append(loss.item())
        step_in += 1

    while c.committed_step < args.syncs:
        for _ in range(every - args.tau):
            inner_step()
        t0 = time.monotonic()
        try:
            c.step()
        except ftcomm.RolledBackError:
            pass  # healed to the job's history; the step has started
        except ftcomm.FinishedError:
            break  # another replica ended the run: no one steps again
        evs = c.events()
        st = c.settings()
        if st.version != tune["version"]:
            tune.update(version=st.version, lr=float(st.get("lr", tune["lr"])), outer_lr=float(st.get("outer_lr", tune["outer_lr"])))
            h = int(st.get("sync_every", 0) or 0)
            if h // F > args.tau:
                every = max(1, h // F)  # from the next sync on
        weight = 1.0
        if any(e.kind == "healed" for e in evs):
            # Healed: the global parameters and momentum are the job's;
            # start again from them, with nothing of our own to add yet.
            flat.params.copy_(glob)
            inner.reset()
            weight = 0.0
        f = c.committed_step % F
        lo, hi = bounds[f], bounds[f + 1]
        buf = torch.empty(hi - lo + 1, device=device)
        buf[:-1] = (glob[lo:hi] - flat.params[lo:hi]) * weight
        buf[-1] = weight
        work = c.all_reduce(buf, ReduceOp.SUM, async_op=True)
        for _ in range(args.tau):  # overlap the exchange with inner steps
            inner_step()
        work.wait()
        ok = c.commit()
        if ok and buf[-1].item() > 0:
            g = buf[:-1] / buf[-1]
            with torch.no_grad():
                mom[lo:hi].mul_(args.outer_momentum).add_(g)
                glob[lo:hi].sub_(g + args.outer_momentum * mom[lo:hi], alpha=tune["outer_lr"])
                flat.params[lo:hi].mul_(args.alpha).add_(glob[lo:hi], alpha=1 - args.alpha)
        out = dict(step=c.committed_step, committed=ok, fragment=f, inner=step_in, participants=c.participants,
                   loss=sum(losses) / max(1, len(losses)), t=time.time(), sync_s=time.monotonic() - t0)
        losses.clear()
        if evs:
            out["events"] = [{"kind": e.kind, "text": e.text} for e in evs]
        if ok and args.replica == 0 and (c.committed_step % args.eval_every == 0 or c.committed_step == args.syncs):
            local = flat.params.clone()
            flat.params.copy_(glob)  # evaluate the job's (global) model
            out["val"] = common.evaluate(model, val, args.batch, args.block, device)
            flat.params.copy_(local)
        common.emit(**out)
    # The end of the run, agreed: a peer still in its last step ends it,
    # and one behind stops (FinishedError) instead of waiting for us.
    if c.committed_step >= args.syncs:
        c.finish()
    common.emit(finished=True)
    c.close()
    common.emit(done=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--syncs", type=int, default=None, help="committed syncs, ft steps (60 CPU, 150 CUDA)")
    ap.add_argument("--H", type=int, default=20, help="inner steps between syncs of one fragment")
    ap.add_argument("--fragments", type=int, default=2, help="F: Streaming DiLoCo fragments (1: plain DiLoCo)")
    ap.add_argument("--tau", type=int, default=1, help="inner steps overlapped with each exchange")
    ap.add_argument("--alpha", type=float, default=0.5, help="mixing of local progress into the synced fragment")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--kill-at", type=float, default=0.5, help="kill the last replica after this fraction of the syncs (0: never)")
    ap.add_argument("--restart-delay", type=float, default=0, help="seconds between the kill and the restart")
    ap.add_argument("--no-gossip", dest="gossip", action="store_false", help="detect deaths without gossip")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--block", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--d", type=int, default=None)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--corpus", default=common.repo_root())
    ap.add_argument("--corpus-bytes", type=int, default=2 << 20)
    ap.add_argument("--out", default="torch-report")
    ap.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--job", default="diloco", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    for k, cpu, gpu in (("syncs", 60, 150), ("batch", 8, 32), ("block", 64, 128), ("layers", 2, 4), ("d", 64, 256)):
        if getattr(args, k) is None:
            setattr(args, k, gpu if cuda else cpu)
    if not 0 <= args.tau < max(1, args.H // args.fragments):
        raise SystemExit("tau must be smaller than H/F")
    if args.replica is not None:
        replica(args)
        return

    import ftcomm.coordinator
    os.makedirs(args.out, exist_ok=True)
    passthrough = sys.argv[1:] + sum((["--" + k, str(getattr(args, k))] for k in ("syncs", "batch", "block", "layers", "d")), [])
    with ftcomm.coordinator.serve(join_timeout=2, gossip=args.gossip, log_level="off") as co:
        env = common.replica_env({"FTCOMM_CREDENTIALS": co.credentials, "FTCOMM_SECRET": "diloco-example",
                                  "OMP_NUM_THREADS": "1"})
        cmd = [sys.executable, os.path.abspath(__file__)] + passthrough

        def start(i):
            p = common.Proc("r%d" % i, cmd + ["--replica", str(i)], env, os.path.join(args.out, "diloco-r%d.log" % i))
            m = p.q.get(timeout=300)
            if not m or not m.get("ready"):
                raise SystemExit("replica %d did not start; see %s" % (i, p.log.name))
            return p

        procs = [start(i) for i in range(args.replicas)]
        for p in procs:
            p.send("go")
        victim, kill_sync = args.replicas - 1, int(args.syncs * args.kill_at)
        killed = restarted = first_finished = None
        vals, done, finished, t0 = {}, set(), set(), time.time()
        while len(done) < args.replicas:
            if first_finished is not None and time.time() - first_finished > 120:
                for i, p in enumerate(procs):  # it could not rejoin: stop it, let the others leave
                    if i not in finished and i not in done:
                        print("  replica %d still running after the job ended; stopping it" % i, flush=True)
                        p.kill()
                        done.add(i)
                    else:
                        p.send("exit")
                first_finished = None
            for i, p in enumerate(procs):
                try:
                    m = p.q.get(timeout=0.05)
                except Exception:
                    continue
                if m is None:
                    if i != victim or not args.kill_at or restarted:
                        done.add(i)
                    continue
                if m.get("finished"):
                    finished.add(i)
                    first_finished = first_finished or time.time()
                    if len(finished | done) == args.replicas:
                        for q in procs:
                            q.send("exit")
                    continue
                if m.get("done"):
                    done.add(i)
                    continue
                for e in m.get("events", []):
                    if e["kind"] in ("healed", "reconfigured", "commit failed"):
                        print("  r%d sync %d: %s" % (i, m["step"], e["text"]), flush=True)
                if i == 0 and m["committed"]:
                    if "val" in m:
                        vals[m["step"]] = m["val"]
                        print("  sync %d (fragment %d, %d inner steps): train %.3f, global model val %.3f, %d replicas" % (
                            m["step"], m["fragment"], m["inner"], m["loss"], m["val"], m["participants"]), flush=True)
                if args.kill_at and i == victim and not killed and m["committed"] and m["step"] >= kill_sync:
                    p.kill()
                    killed = m["step"]
                    print("  replica %d SIGKILLed after sync %d" % (victim, m["step"]), flush=True)
                    time.sleep(args.restart_delay)  # the launcher's pace, not a synchronisation
                    procs[victim] = start(victim)
                    procs[victim].send("go")
                    restarted = killed
                    print("  replica %d restarted" % victim, flush=True)
        for p in procs:
            p.close()
    steps = sorted(vals)
    common.svg_plot(os.path.join(args.out, "diloco.svg"), [("global model, validation loss", steps, [vals[s] for s in steps], "#2ca02c", False)],
                    [(killed, "kill"), (restarted, "restart")] if killed else [],
                    title="Streaming DiLoCo: H=%d, F=%d, tau=%d, alpha=%.2f, %d replicas" % (args.H, args.fragments, args.tau, args.alpha, args.replicas),
                    xlabel="committed sync", ylabel="loss (nats/byte)")
    print("Streaming DiLoCo: %d syncs in %.1f s; final validation loss of the global model %.4f; plot %s" % (
        args.syncs, time.time() - t0, vals.get(args.syncs, float("nan")), os.path.join(args.out, "diloco.svg")))


if __name__ == "__main__":
    main()
