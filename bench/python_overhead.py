#!/usr/bin/env python3
"""The cost of calling ftcomm from Python, next to the Go API, in one run:
2 rank processes on this host (gloo), a 4 KiB float32 all-reduce, timed in
interleaved rounds three ways on the same comm:

  go      the op called in a loop inside libftcomm (the Go API's cost)
  torch   comm.all_reduce(tensor) from Python on a torch tensor
  ctypes  the library's entry point called from a bare Python loop (the
          floor of any ctypes binding: call, argument conversion, cgo)
  numpy   comm.all_reduce(array) from Python on a numpy array

and the overhead (Python − Go) per op, medians over the rounds.

    PYTHONPATH=python FTCOMM_LIBRARY=... /usr/bin/python3 bench/python_overhead.py [--iters 2000 --rounds 15]
"""

import argparse
import ctypes
import datetime
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time


def rank_main(rank, addr, args, q):
    import numpy as np
    import torch

    import ftcomm
    torch.set_num_threads(1)
    c = ftcomm.new_comm("gloo", "cpu", name="bench", store=addr, rank=rank, size=2, timeout=60)
    n = args.bytes // 4
    t = torch.ones(n, dtype=torch.float32)
    a = np.ones(n, dtype=np.float32)
    L = ftcomm._lib.lib()
    el = ctypes.c_int64()

    def go(iters):
        ftcomm._lib.check(L.ftcomm_comm_loop(c._h, a.ctypes.data, n, 1, 4, iters, ctypes.byref(el)))
        return el.value / iters

    def py(x, iters):
        ar = c.all_reduce
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            ar(x, ftcomm.ReduceOp.MAX)
        return (time.perf_counter_ns() - t0) / iters

    def raw(iters):
        run, h, p, desc = L.ftcomm_comm_run, c._h, a.ctypes.data, 1 | 1 << 8 | 4 << 16
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            run(h, desc, p, n)
        return (time.perf_counter_ns() - t0) / iters

    for _ in range(3):  # warm up
        go(args.iters)
        raw(args.iters)
        py(t, args.iters)
        py(a, args.iters)
    res = {"go": [], "raw": [], "torch": [], "numpy": []}
    for r in range(args.rounds):
        order = [("go", lambda: go(args.iters)), ("raw", lambda: raw(args.iters)),
                 ("torch", lambda: py(t, args.iters)), ("numpy", lambda: py(a, args.iters))]
        if r % 2:
            order.reverse()
        for k, f in order:
            c.barrier()
            res[k].append(f())
    c.finalize()
    q.put((rank, res))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--bytes", type=int, default=4096)
    args = ap.parse_args()
    import ftcomm
    st = ftcomm.Store.listen("127.0.0.1:0")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, st.address, args, q)) for r in range(2)]
    for p in ps:
        p.start()
    out = dict(q.get(timeout=1800) for _ in ps)
    for p in ps:
        p.join()
    st.close()
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print("# %s, %s, %d CPUs, load %s, Python %s, %s" % (
        datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), cpu, os.cpu_count(),
        " ".join("%.1f" % x for x in os.getloadavg()), platform.python_version(), " ".join(sys.argv)))
    print("# 2 ranks (gloo, one host), %d-byte float32 all-reduce, %d rounds × %d ops, medians (µs/op)" % (
        args.bytes, args.rounds, args.iters))
    print("| rank | Go API | ctypes call alone | Python, torch | Python, numpy | overhead torch | overhead numpy |")
    print("|---|---|---|---|---|---|---|")
    for r in (0, 1):
        m = {k: statistics.median(v) / 1000 for k, v in out[r].items()}
        # per round differences, then the median: the rounds share conditions
        ot = statistics.median(a - b for a, b in zip(out[r]["torch"], out[r]["go"])) / 1000
        on = statistics.median(a - b for a, b in zip(out[r]["numpy"], out[r]["go"])) / 1000
        print("| %d | %.2f | %.2f | %.2f | %.2f | %+.2f | %+.2f |" % (r, m["go"], m["raw"], m["torch"], m["numpy"], ot, on))


if __name__ == "__main__":
    main()
