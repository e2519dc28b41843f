"""Rank 0 of a 2-rank comm whose peer never joins its all-reduce: blocks in
the collective until SIGINT (test_signals.py). Prints what happened."""

import sys
import threading
import time

import numpy as np

import ftcomm

addr, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
c = ftcomm.new_comm("gloo", "cpu", name=name, store=addr, rank=0, size=2, timeout=60)


def report_blocked():
    deadline = time.monotonic() + 30
    while ftcomm._lib.blocked_calls() == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    print("blocked", flush=True)


threading.Thread(target=report_blocked, daemon=True).start()
t0 = time.monotonic()
try:
    if mode == "sync":
        c.all_reduce(np.ones(1 << 20, dtype=np.float32))
    else:
        c.all_reduce(np.ones(1 << 20, dtype=np.float32), async_op=True).wait()
    print("completed", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt after %.2fs; comm: %s; blocked calls left: %d" % (
        time.monotonic() - t0, c.error(), ftcomm._lib.blocked_calls()), flush=True)
c.finalize()
print("live handles", ftcomm.live_handles(), flush=True)
